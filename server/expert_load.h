/*
 * moed_expert_load — the measured load of each expert (moed --expert-load FILE): the
 * moed_expert_tokens_total counters a running moed exports on /metrics, scraped into a file
 * (`curl -s HOST:PORT/metrics > load.prom`) and read at the next start, where they become each
 * served layer's moed_layer.expert_load, the placement hint a backend splitting the layer over
 * devices evens out.
 *
 * The file is Prometheus text (exposition format 0.0.4), at most MOED_EXPERT_LOAD_MAX_FILE bytes
 * of a regular file (moed_file: a directory, FIFO or device is refused at once, naming it), with
 * LF or CRLF line ends. Only the lines of the metric moed_expert_tokens_total count:
 *
 *   moed_expert_tokens_total{layer="3",expert="17"} 123456
 *
 * Blank lines, `#` lines (HELP, TYPE, comments) and every other metric's lines are skipped
 * unread; a NUL byte anywhere is refused (not a text file). A line of the metric has exactly the
 * two labels `layer` (the checkpoint's layer index) and `expert` (the whole layer's expert id), in
 * either order, each a quoted decimal number from 0 to MOED_EXPERT_LOAD_MAX_ID; blanks may
 * separate the tokens and a comma may end the label list, as Prometheus allows. Then the value, a
 * finite number >= 0 written as Prometheus does (123456, 1.5e+06; NaN, Inf and negative numbers
 * are refused), and optionally a timestamp (an integer, ignored). A label other than the two, a
 * label given twice or missing, a line of the metric over MOED_EXPERT_LOAD_MAX_LINE bytes, and a
 * (layer, expert) given on two lines are refused too. Every refusal is MOED_EINVAL with a message
 * naming the file and the line, and what is wrong; the line's bytes are quoted only as a short
 * excerpt with anything but printable ASCII replaced by '?'. A file that names no expert is no
 * error: no layer gets a load.
 *
 * The page's moed_batch_tokens_count line (the launches the scraped daemon ran, over all its
 * layers: `moed_batch_tokens_count 1234`) is read too, when present: a split layer's placement
 * counts each expert's weights streamed once a launch (docs/cuda.md), which small batches spend
 * most of their time on. Given twice, or not a count, it is refused as a line of the metric is.
 *
 * Whether a layer and an expert exist is known only once the model is: moed_expert_load_check
 * and moed_expert_load_layer check the file's layers and experts against it.
 */
#ifndef MOED_EXPERT_LOAD_H
#define MOED_EXPERT_LOAD_H

#include "moed_err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Bytes of a file (a whole /metrics page of a 100-layer model with 1024 experts is ~6 MiB), bytes
 * of one line of the metric, and the largest layer index or expert id taken. */
#define MOED_EXPERT_LOAD_MAX_FILE (64 << 20)
#define MOED_EXPERT_LOAD_MAX_LINE 1024
#define MOED_EXPERT_LOAD_MAX_ID   65535

/* One (layer, expert) of the file, with the line it came from. */
typedef struct moed_expert_load_entry {
    int layer, expert, line;
    double tokens;
} moed_expert_load_entry;

typedef struct moed_expert_load {
    char *what;                /* "--expert-load PATH": what messages name */
    moed_expert_load_entry *v; /* sorted by layer, then expert: no two alike */
    int n;
    double launches;   /* moed_batch_tokens_count, or 0 */
    int launches_line; /* its line, or 0 */
} moed_expert_load;

/* Parses len bytes of text (need not end in NUL) into out; `what` names the source in messages
 * (e.g. "--expert-load load.prom"). Errors: MOED_EINVAL (the first bad line by the rules above;
 * for a (layer, expert) given twice, the later line of the first such pair in the file, with the
 * earlier one), MOED_ENOMEM. out must be released with moed_expert_load_free whatever the
 * result. */
int moed_expert_load_parse(const char *text, size_t len, const char *what, moed_expert_load *out,
                           moed_error *err);

/* Reads and parses the file at path (moed_file_read: its errors, a file over
 * MOED_EXPERT_LOAD_MAX_FILE being MOED_ETOOBIG, each naming --expert-load and the path). */
int moed_expert_load_read(const char *path, moed_expert_load *out, moed_error *err);

/* A layer's launches over the scraped run: the page's launches over the layers it names (each
 * call of a model's step runs each layer once); 0 when unknown. */
double moed_expert_load_launches(const moed_expert_load *l);

void moed_expert_load_free(moed_expert_load *l);

/* Checks the file's layers against a model's MoE layers: `have`, n_have checkpoint indices in
 * increasing order, of a model called `model` in messages. A layer of the file not among them is
 * MOED_EINVAL naming its line and the layers the model has, unless ignore_others is set (the
 * daemon serves only some layers, --layers, and holds only those): then it is counted in
 * *ignored (may be NULL). */
int moed_expert_load_check(const moed_expert_load *l, const int *have, int n_have,
                           const char *model, bool ignore_others, int *ignored, moed_error *err);

/* Layer `index`'s counts for the experts `ids` (n_ids ids of the whole layer's numbering, each
 * under n_experts: an expert shard's held experts, moed_shard's global_of; NULL: every expert of
 * the layer, n_ids ignored), in the layer's n_experts. *named: how many experts of the layer the
 * file names (0: none). *out: a malloc'd array of the ids' counts in their order (0 for an expert
 * the file does not name; the caller frees it), or NULL when the file names none of the layer or
 * every count of the ids is 0 (the layer then keeps the uniform expectation). An expert id of the
 * file not under n_experts is MOED_EINVAL naming its line and the range; MOED_ENOMEM. */
int moed_expert_load_layer(const moed_expert_load *l, int index, int n_experts, const int32_t *ids,
                           int n_ids, double **out, int *named, moed_error *err);

#endif
