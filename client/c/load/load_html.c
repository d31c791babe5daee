/*
 * load_html — the report page (load_html.h). The scripts and the style are compiled in: CMake
 * turns html/chart.min.js, html/report.js and html/report.css into byte arrays (html/embed.cmake),
 * so moed-load writes the page from anywhere, installed or not.
 */
#include "load_html.h"
#include "load_report.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* From the file embed.cmake generates. */
extern const unsigned char load_html_chart_js[], load_html_report_js[], load_html_report_css[];
extern const size_t load_html_chart_js_len, load_html_report_js_len, load_html_report_css_len;

#define RUN_FILE_MAX ((off_t)64 << 20)

/* A growing text; once out of memory it stays failed and appends nothing. */
typedef struct page {
    char *text;
    size_t len, cap;
    bool failed;
} page;

static void put(page *p, const void *s, size_t n)
{
    if (p->failed) return;
    if (p->len + n + 1 > p->cap) {
        size_t cap = p->cap ? p->cap : 1 << 16;
        while (cap < p->len + n + 1) cap *= 2;
        char *grown = realloc(p->text, cap);
        if (!grown) {
            p->failed = true;
            return;
        }
        p->text = grown;
        p->cap = cap;
    }
    memcpy(p->text + p->len, s, n);
    p->len += n;
    p->text[p->len] = 0;
}

static void puts_(page *p, const char *s)
{
    put(p, s, strlen(s));
}

/* JSON text inside a script element: '<', '>' and '&' as \u escapes. They occur only inside
 * strings (JSON has them nowhere else), where the escape means the same character. */
static void put_json(page *p, const char *json)
{
    for (const char *s = json; *s; s++) {
        char esc[8];
        if (*s == '<' || *s == '>' || *s == '&') {
            snprintf(esc, sizeof esc, "\\u%04x", (unsigned char)*s);
            puts_(p, esc);
        } else {
            put(p, s, 1);
        }
    }
}

int load_html_write(const char *path, cJSON *const *runs, const char *const *sources, int n,
                    moed_error *err)
{
    cJSON *data = cJSON_CreateObject(), *list = NULL;
    char when[64];
    time_t now = time(NULL);
    struct tm tm;
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", gmtime_r(&now, &tm));
    if (data && cJSON_AddStringToObject(data, "generated", when))
        list = cJSON_AddArrayToObject(data, "runs");
    for (int i = 0; list && i < n; i++) {
        cJSON *run = cJSON_Duplicate(runs[i], 1);
        if (run && sources && sources[i]) {
            cJSON_DeleteItemFromObject(run, "source");
            cJSON_AddStringToObject(run, "source", sources[i]);
        }
        if (!run || !cJSON_AddItemToArray(list, run)) {
            cJSON_Delete(run);
            list = NULL;
        }
    }
    char *json = list ? cJSON_PrintUnformatted(data) : NULL;
    cJSON_Delete(data);
    page p = { 0 };
    if (json) {
        puts_(&p, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
                  "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
                  "<title>moed-load report</title>\n<style>\n");
        put(&p, load_html_report_css, load_html_report_css_len);
        puts_(&p, "</style>\n</head>\n<body>\n<main id=\"report\"><noscript>This page draws its "
                  "plots with JavaScript; its numbers are in the moed-runs block of its "
                  "source.</noscript></main>\n<script id=\"moed-runs\" "
                  "type=\"application/json\">");
        put_json(&p, json);
        puts_(&p, "</script>\n<script>\n");
        put(&p, load_html_chart_js, load_html_chart_js_len);
        puts_(&p, "\n</script>\n<script>\n");
        put(&p, load_html_report_js, load_html_report_js_len);
        puts_(&p, "</script>\n</body>\n</html>\n");
    }
    cJSON_free(json);
    int rc = !json || p.failed
                 ? moed_fail(err, MOED_ENOMEM, "out of memory writing --report %s", path)
                 : load_write_file(path, p.text, p.len, "--report", err);
    free(p.text);
    return rc;
}

/* What the page reads of a level must be there, of the kind it reads. */
static int check_level(const char *path, int i, const cJSON *l, moed_error *err)
{
    const cJSON *server = cJSON_GetObjectItemCaseSensitive(l, "server");
    const char *lacks =
        !cJSON_IsObject(l)                                                   ? "is not an object"
        : !cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(l, "latency_ms")) ? "lacks latency_ms"
        : !cJSON_IsObject(server)                                            ? "lacks server"
        : !cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(server, "queue_ms")) ||
                !cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(server, "compute_ms"))
            ? "lacks server.queue_ms or server.compute_ms"
            : NULL;
    if (!lacks) return 0;
    return moed_fail(err, MOED_EFORMAT,
                     "--from %s: level %d %s: give the --json file of a moed-load run", path, i + 1,
                     lacks);
}

int load_html_read_run(const char *path, cJSON **out, moed_error *err)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    struct stat st;
    if (fd < 0)
        return moed_fail(err, MOED_EIO, "--from %s: cannot open it: %s", path, strerror(errno));
    if (fstat(fd, &st) || !S_ISREG(st.st_mode) || st.st_size > RUN_FILE_MAX) {
        close(fd);
        return moed_fail(err, MOED_EINVAL,
                         "--from %s: not a regular file of at most 64 MiB: give the --json file "
                         "of a moed-load run",
                         path);
    }
    char *text = malloc((size_t)st.st_size + 1);
    size_t got = 0;
    while (text && got < (size_t)st.st_size) {
        ssize_t k = read(fd, text + got, (size_t)st.st_size - got);
        if (k <= 0) break;
        got += (size_t)k;
    }
    close(fd);
    if (!text) return moed_fail(err, MOED_ENOMEM, "--from %s: out of memory reading it", path);
    cJSON *doc = cJSON_ParseWithLength(text, got);
    free(text);
    const cJSON *levels = cJSON_GetObjectItemCaseSensitive(doc, "levels");
    int rc = 0;
    if (!cJSON_IsObject(doc) || !cJSON_IsArray(levels) || !cJSON_GetArraySize(levels))
        rc = moed_fail(err, MOED_EFORMAT,
                       "--from %s: not a moed-load --json report (a JSON object with a list of "
                       "levels)",
                       path);
    for (int i = 0; !rc && i < cJSON_GetArraySize(levels); i++)
        rc = check_level(path, i, cJSON_GetArrayItem(levels, i), err);
    if (rc)
        cJSON_Delete(doc);
    else
        *out = doc;
    return rc;
}
