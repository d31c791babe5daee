/*
 * load_html — moed-load's report as one HTML page (--report): the runs' JSON documents
 * (load_report_doc, or earlier runs' --json files read back with --from), drawn by html/report.js
 * with Chart.js 3.9.1 (html/chart.min.js, MIT, as Debian ships it). Both scripts, the style and
 * the data are inline, so the page opens from a file with no network (about 230 KB, most of it
 * Chart.js). The data sits in a <script type="application/json"> block with every '<', '>' and
 * '&' written as a \u escape, so no string a server sent (a model name, an error message) can end
 * the block or become markup; report.js sets every such string as text.
 */
#ifndef LOAD_HTML_H
#define LOAD_HTML_H

#include "moed_err.h"

#include <cjson/cJSON.h>

/* Writes the page of runs[0..n-1] (moed-load --json documents; each gets a "source" member naming
 * where it came from, sources[i], unless NULL) to path. 0 or a negative MOED_E* code. */
int load_html_write(const char *path, cJSON *const *runs, const char *const *sources, int n,
                    moed_error *err);

/* Reads one earlier run's --json document from path (a regular file of at most 64 MiB holding a
 * JSON object with a "levels" array of objects, as moed-load writes it). On success *out is the
 * caller's to cJSON_Delete. */
int load_html_read_run(const char *path, cJSON **out, moed_error *err);

#endif
