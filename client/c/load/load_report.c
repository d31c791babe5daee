/*
 * load_report — counting a level's calls and writing the report (load_report.h).
 *
 * Every number the three formats print is derived once, by summarize(), so the text report, the
 * JSON and the CSV can never disagree about a rate or a percentile. Latencies are reported in
 * milliseconds, rates per second of the measured window, bytes as tensor payload (what the
 * requests and replies carry in their Tensor data, not the few bytes of protobuf framing).
 */
#include "load_report.h"
#include "moedclient.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* ---- counting ---- */

void load_stats_init(load_stats *s)
{
    memset(s, 0, sizeof *s);
    load_hist_init(&s->latency);
    load_hist_init(&s->queue);
    load_hist_init(&s->compute);
}

void load_stats_merge(load_stats *dst, const load_stats *src)
{
    dst->sent += src->sent;
    dst->ok += src->ok;
    dst->bad_sent += src->bad_sent;
    dst->expected_errors += src->expected_errors;
    for (int k = 0; k < LOAD_ERR_KINDS; k++) {
        if (!dst->errors[k] && src->errors[k])
            memcpy(dst->first_error[k], src->first_error[k], sizeof dst->first_error[k]);
        dst->errors[k] += src->errors[k];
    }
    dst->tokens += src->tokens;
    dst->bytes_sent += src->bytes_sent;
    dst->bytes_received += src->bytes_received;
    dst->batch_tokens += src->batch_tokens;
    dst->batch_requests += src->batch_requests;
    if (!dst->mismatches && src->mismatches)
        memcpy(dst->first_mismatch, src->first_mismatch, sizeof dst->first_mismatch);
    dst->verified += src->verified;
    dst->mismatches += src->mismatches;
    if (src->worst_verify_err > dst->worst_verify_err)
        dst->worst_verify_err = src->worst_verify_err;
    if (src->t_last_ns > dst->t_last_ns) dst->t_last_ns = src->t_last_ns;
    load_hist_merge(&dst->latency, &src->latency);
    load_hist_merge(&dst->queue, &src->queue);
    load_hist_merge(&dst->compute, &src->compute);
}

void load_stats_error(load_stats *s, int kind, const char *msg)
{
    if (!s->errors[kind]++) snprintf(s->first_error[kind], sizeof s->first_error[kind], "%s", msg);
}

uint64_t load_stats_errors(const load_stats *s)
{
    uint64_t n = 0;
    for (int k = 0; k < LOAD_ERR_KINDS; k++) n += s->errors[k];
    return n;
}

int load_experts_init(load_experts *x, const int *layers, int n, int n_experts)
{
    memset(x, 0, sizeof *x);
    x->layer = malloc(sizeof *x->layer * (size_t)(n > 0 ? n : 1));
    if (!x->layer) return MOED_ENOMEM;
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int j = 0; j < x->n_layers; j++) seen = seen || x->layer[j] == layers[i];
        if (!seen) x->layer[x->n_layers++] = layers[i];
    }
    x->n_experts = n_experts;
    x->tokens = calloc((size_t)x->n_layers * (size_t)n_experts + 1, sizeof *x->tokens);
    return x->tokens ? 0 : MOED_ENOMEM;
}

void load_experts_add(load_experts *x, int layer, int expert, uint64_t v)
{
    if (expert < 0 || expert >= x->n_experts) return;
    for (int i = 0; i < x->n_layers; i++)
        if (x->layer[i] == layer) x->tokens[(size_t)i * (size_t)x->n_experts + (size_t)expert] += v;
}

void load_experts_merge(load_experts *dst, const load_experts *src)
{
    for (int i = 0; i < src->n_layers; i++)
        for (int e = 0; e < src->n_experts; e++)
            load_experts_add(dst, src->layer[i], e,
                             src->tokens[(size_t)i * (size_t)src->n_experts + (size_t)e]);
}

bool load_experts_any(const load_experts *x)
{
    for (size_t i = 0; i < (size_t)x->n_layers * (size_t)x->n_experts; i++)
        if (x->tokens[i]) return true;
    return false;
}

void load_experts_free(load_experts *x)
{
    free(x->layer);
    free(x->tokens);
    memset(x, 0, sizeof *x);
}

const char *load_err_kind_name(int kind)
{
    switch (kind) {
    case LOAD_ERR_MALFORMED:
        return "MALFORMED_REPLY";
    case LOAD_ERR_CLIENT:
        return "CLIENT";
    case LOAD_ERR_BAD_ACCEPTED:
        return "BAD_ACCEPTED";
    }
    return moedc_grpc_status_name(kind);
}

/* ---- derived numbers ---- */

enum { Q_MIN, Q_MEAN, Q_P50, Q_P90, Q_P95, Q_P99, Q_P999, Q_MAX, N_Q };
static const char *const q_names[N_Q] = {
    "min", "mean", "p50", "p90", "p95", "p99", "p99.9", "max"
};
static const char *const q_keys[N_Q] = { "min", "mean", "p50", "p90", "p95", "p99", "p999", "max" };
static const double q_levels[N_Q] = { 0, -1, 0.5, 0.9, 0.95, 0.99, 0.999, 1 };

typedef struct summary {
    double rps, tokens_per_s, mb_sent_per_s, mb_received_per_s;
    double lat_ms[N_Q];
    double queue_ms[3], compute_ms[3]; /* mean, p50, p99 */
    double batch_tokens, batch_requests;
    uint64_t errors;
    double cpu_us_per_call, cpu_cores; /* moed-load's own cost */
} summary;

static double ms(double ns)
{
    return ns / 1e6;
}

static void server_timing(const load_hist *h, double out[3])
{
    out[0] = ms(load_hist_mean(h));
    out[1] = ms((double)load_hist_quantile(h, 0.5));
    out[2] = ms((double)load_hist_quantile(h, 0.99));
}

static summary summarize(const load_level *l)
{
    const load_stats *st = &l->st;
    summary s;
    memset(&s, 0, sizeof s);
    double t = l->elapsed_s;
    if (t > 0) {
        s.rps = (double)(st->ok + st->expected_errors + load_stats_errors(st)) / t;
        s.tokens_per_s = (double)st->tokens / t;
        s.mb_sent_per_s = (double)st->bytes_sent / t / 1e6;
        s.mb_received_per_s = (double)st->bytes_received / t / 1e6;
    }
    for (int i = 0; i < N_Q; i++)
        s.lat_ms[i] = ms(q_levels[i] < 0 ? load_hist_mean(&st->latency)
                                         : (double)load_hist_quantile(&st->latency, q_levels[i]));
    server_timing(&st->queue, s.queue_ms);
    server_timing(&st->compute, s.compute_ms);
    if (st->ok) {
        s.batch_tokens = (double)st->batch_tokens / (double)st->ok;
        s.batch_requests = (double)st->batch_requests / (double)st->ok;
    }
    s.errors = load_stats_errors(st);
    if (l->calls) s.cpu_us_per_call = l->cpu_s * 1e6 / (double)l->calls;
    if (l->wall_s > 0) s.cpu_cores = l->cpu_s / l->wall_s;
    return s;
}

/* ---- text ---- */

/* Milliseconds with about three significant digits. */
static const char *fmt_ms(char *buf, size_t n, double v)
{
    snprintf(buf, n, v < 1 ? "%.3f" : v < 100 ? "%.2f" : "%.1f", v);
    return buf;
}

static const char *edge_label(char *buf, size_t n, uint64_t ns)
{
    if (ns < 1000000)
        snprintf(buf, n, "%lluus", (unsigned long long)(ns / 1000));
    else if (ns < 1000000000)
        snprintf(buf, n, "%llums", (unsigned long long)(ns / 1000000));
    else
        snprintf(buf, n, "%llus", (unsigned long long)(ns / 1000000000));
    return buf;
}

static void text_histogram(FILE *f, const load_hist *h)
{
    int first = -1, last = -1;
    uint64_t top = 0;
    for (int i = 0; i < LOAD_HIST_DISPLAY; i++) {
        if (!h->display[i]) continue;
        if (first < 0) first = i;
        last = i;
        if (h->display[i] > top) top = h->display[i];
    }
    if (first < 0) return;
    fprintf(f, "histogram  (ok replies; buckets 1-2-5 per decade)\n");
    for (int i = first; i <= last; i++) {
        char lo[16], hi[16], range[40];
        if (i == 0)
            snprintf(range, sizeof range, "< %s", edge_label(hi, sizeof hi, load_hist_edge(0)));
        else if (i == LOAD_HIST_EDGES)
            snprintf(range, sizeof range, ">= %s",
                     edge_label(lo, sizeof lo, load_hist_edge(i - 1)));
        else
            snprintf(range, sizeof range, "%s - %s",
                     edge_label(lo, sizeof lo, load_hist_edge(i - 1)),
                     edge_label(hi, sizeof hi, load_hist_edge(i)));
        int bar = (int)((h->display[i] * 40 + top - 1) / top);
        fprintf(f, "  %15s %10llu %5.1f%% %.*s\n", range, (unsigned long long)h->display[i],
                100.0 * (double)h->display[i] / (double)h->n, bar,
                "########################################");
    }
}

/* Per layer: the spread of tokens over its experts in one line, then every expert's count. */
static void text_experts(FILE *f, const load_experts *x, const char *source)
{
    for (int i = 0; i < x->n_layers; i++) {
        const uint64_t *t = x->tokens + (size_t)i * (size_t)x->n_experts;
        int hi = 0, lo = 0;
        double sum = 0;
        for (int e = 0; e < x->n_experts; e++) {
            sum += (double)t[e];
            if (t[e] > t[hi]) hi = e;
            if (t[e] < t[lo]) lo = e;
        }
        const double mean = sum / (x->n_experts ? x->n_experts : 1);
        fprintf(f,
                "experts    layer %d, tokens per expert (%s): mean %.1f, max %llu (expert %d, "
                "%.2fx the mean), min %llu (expert %d)\n          ",
                x->layer[i], source, mean, (unsigned long long)t[hi], hi,
                mean > 0 ? (double)t[hi] / mean : 0, (unsigned long long)t[lo], lo);
        for (int e = 0; e < x->n_experts; e++)
            fprintf(f, "%s %d:%llu", e && e % 12 == 0 ? "\n          " : "", e,
                    (unsigned long long)t[e]);
        fprintf(f, "\n");
    }
}

void load_report_text(FILE *f, const load_setup *s, const load_level *l)
{
    const load_stats *st = &l->st;
    summary m = summarize(l);
    char a[32], b[32], c[32];
    if (l->concurrency)
        fprintf(f, "level      closed loop, concurrency %d\n", l->concurrency);
    else
        fprintf(f, "level      open loop, %g req/s asked (%s arrivals)\n", l->rate, s->arrival);
    fprintf(f,
            "requests   %llu sent: %llu ok, %llu expected errors (of %llu bad requests), %llu "
            "errors\n",
            (unsigned long long)st->sent, (unsigned long long)st->ok,
            (unsigned long long)st->expected_errors, (unsigned long long)st->bad_sent,
            (unsigned long long)m.errors);
    fprintf(f, "rate       %.1f req/s achieved over %.3f s", m.rps, l->elapsed_s);
    if (l->rate > 0) fprintf(f, " (asked %g req/s, %.1f%%)", l->rate, 100 * m.rps / l->rate);
    fprintf(f, "\nthroughput %.0f tokens/s, %.2f MB/s sent, %.2f MB/s received\n", m.tokens_per_s,
            m.mb_sent_per_s, m.mb_received_per_s);
    if (st->latency.n) {
        fprintf(f, "latency   ");
        for (int i = 0; i < N_Q; i++)
            fprintf(f, " %s %s", q_names[i], fmt_ms(a, sizeof a, m.lat_ms[i]));
        fprintf(f, " ms\n");
        const double *t[2] = { m.queue_ms, m.compute_ms };
        fprintf(f, "server    ");
        for (int k = 0; k < 2; k++)
            fprintf(f, " %s mean %s p50 %s p99 %s ms;", k ? "compute" : "queue",
                    fmt_ms(a, sizeof a, t[k][0]), fmt_ms(b, sizeof b, t[k][1]),
                    fmt_ms(c, sizeof c, t[k][2]));
        fprintf(f, " merged batch mean %.2f requests, %.1f tokens\n", m.batch_requests,
                m.batch_tokens);
    }
    fprintf(f, "client     %.1f us CPU per call, %.2f cores (moed-load itself, all threads)\n",
            m.cpu_us_per_call, m.cpu_cores);
    if (s->verify)
        fprintf(f,
                "verify     %llu replies checked against the local CPU reference: %llu mismatches "
                "(worst relative error %.2g, bound %.0e)\n",
                (unsigned long long)st->verified, (unsigned long long)st->mismatches,
                st->worst_verify_err, s->verify_bound);
    if (st->mismatches) fprintf(f, "           first mismatch: %s\n", st->first_mismatch);
    for (int k = 0; k < LOAD_ERR_KINDS; k++)
        if (st->errors[k])
            fprintf(f, "error      %s x%llu, first: %s\n", load_err_kind_name(k),
                    (unsigned long long)st->errors[k], st->first_error[k]);
    if (load_experts_any(&l->sent)) text_experts(f, &l->sent, "from the routes sent");
    if (l->servers.tokens) text_experts(f, &l->servers, "from the daemons' metrics");
    text_histogram(f, &st->latency);
}

/* ---- JSON ---- */

static cJSON *json_level(const load_setup *s, const load_level *l)
{
    const load_stats *st = &l->st;
    summary m = summarize(l);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "concurrency", l->concurrency);
    cJSON_AddNumberToObject(o, "rate_asked", l->rate);
    cJSON_AddNumberToObject(o, "elapsed_s", l->elapsed_s);
    cJSON_AddNumberToObject(o, "requests", (double)st->sent);
    cJSON_AddNumberToObject(o, "ok", (double)st->ok);
    cJSON_AddNumberToObject(o, "bad_requests", (double)st->bad_sent);
    cJSON_AddNumberToObject(o, "expected_errors", (double)st->expected_errors);
    cJSON_AddNumberToObject(o, "errors_total", (double)m.errors);
    cJSON *errs = cJSON_AddObjectToObject(o, "errors");
    cJSON *msgs = cJSON_AddObjectToObject(o, "error_messages");
    for (int k = 0; k < LOAD_ERR_KINDS; k++)
        if (st->errors[k]) {
            cJSON_AddNumberToObject(errs, load_err_kind_name(k), (double)st->errors[k]);
            cJSON_AddStringToObject(msgs, load_err_kind_name(k), st->first_error[k]);
        }
    cJSON_AddNumberToObject(o, "rps", m.rps);
    cJSON_AddNumberToObject(o, "tokens_per_s", m.tokens_per_s);
    cJSON_AddNumberToObject(o, "mb_per_s_sent", m.mb_sent_per_s);
    cJSON_AddNumberToObject(o, "mb_per_s_received", m.mb_received_per_s);
    cJSON *lat = cJSON_AddObjectToObject(o, "latency_ms");
    for (int i = 0; i < N_Q; i++) cJSON_AddNumberToObject(lat, q_keys[i], m.lat_ms[i]);
    cJSON *hist = cJSON_AddArrayToObject(o, "histogram");
    for (int i = 0; i < LOAD_HIST_DISPLAY; i++) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddNumberToObject(b, "ge_ms", i ? ms((double)load_hist_edge(i - 1)) : 0);
        if (i < LOAD_HIST_EDGES)
            cJSON_AddNumberToObject(b, "lt_ms", ms((double)load_hist_edge(i)));
        else
            cJSON_AddNullToObject(b, "lt_ms");
        cJSON_AddNumberToObject(b, "count", (double)st->latency.display[i]);
        cJSON_AddItemToArray(hist, b);
    }
    cJSON *srv = cJSON_AddObjectToObject(o, "server");
    const char *tk[3] = { "mean", "p50", "p99" };
    cJSON *qo = cJSON_AddObjectToObject(srv, "queue_ms"),
          *co = cJSON_AddObjectToObject(srv, "compute_ms");
    for (int i = 0; i < 3; i++) {
        cJSON_AddNumberToObject(qo, tk[i], m.queue_ms[i]);
        cJSON_AddNumberToObject(co, tk[i], m.compute_ms[i]);
    }
    cJSON_AddNumberToObject(srv, "batch_requests_mean", m.batch_requests);
    cJSON_AddNumberToObject(srv, "batch_tokens_mean", m.batch_tokens);
    cJSON *cl = cJSON_AddObjectToObject(o, "client");
    cJSON_AddNumberToObject(cl, "cpu_us_per_call", m.cpu_us_per_call);
    cJSON_AddNumberToObject(cl, "cpu_cores", m.cpu_cores);
    cJSON *v = cJSON_AddObjectToObject(o, "verify");
    cJSON_AddNumberToObject(v, "asked", (double)s->verify);
    cJSON_AddNumberToObject(v, "checked", (double)st->verified);
    cJSON_AddNumberToObject(v, "mismatches", (double)st->mismatches);
    cJSON_AddNumberToObject(v, "worst_rel_err", st->worst_verify_err);
    cJSON_AddNumberToObject(v, "bound", s->verify_bound);
    if (st->mismatches) cJSON_AddStringToObject(v, "first_mismatch", st->first_mismatch);
    cJSON *ex = cJSON_AddObjectToObject(o, "expert_tokens");
    const load_experts *tables[2] = { &l->sent, &l->servers };
    for (int k = 0; k < 2; k++) {
        const load_experts *x = tables[k];
        if (!x->tokens || (!k && !load_experts_any(x))) continue;
        cJSON *by = cJSON_AddObjectToObject(ex, k ? "servers" : "sent");
        for (int i = 0; by && i < x->n_layers; i++) {
            char name[16];
            snprintf(name, sizeof name, "%d", x->layer[i]);
            cJSON *a = cJSON_AddArrayToObject(by, name);
            for (int e = 0; a && e < x->n_experts; e++)
                cJSON_AddItemToArray(
                    a, cJSON_CreateNumber(
                           (double)x->tokens[(size_t)i * (size_t)x->n_experts + (size_t)e]));
        }
    }
    return o;
}

int load_write_file(const char *path, const char *text, size_t n, const char *what, moed_error *err)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return moed_fail(err, MOED_EIO, "%s %s: cannot write it: %s", what, path, strerror(errno));
    bool written = fwrite(text, 1, n, f) == n;
    if (fclose(f) || !written)
        return moed_fail(err, MOED_EIO, "%s %s: write failed: %s", what, path, strerror(errno));
    return 0;
}

cJSON *load_report_doc(const load_setup *s, const load_level *levels, int n)
{
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    cJSON_AddStringToObject(root, "target", s->target);
    cJSON_AddStringToObject(root, "model", s->model);
    cJSON_AddStringToObject(root, "backend", s->backend);
    cJSON_AddStringToObject(root, "layers", s->layers);
    cJSON_AddStringToObject(root, "dtype", s->dtype);
    cJSON_AddStringToObject(root, "tokens", s->tokens);
    cJSON_AddStringToObject(root, "routing", s->routing);
    cJSON_AddStringToObject(root, "transport", s->transport);
    cJSON_AddStringToObject(root, "mode", levels[0].concurrency ? "closed" : "open");
    cJSON_AddStringToObject(root, "arrival", s->arrival);
    cJSON_AddNumberToObject(root, "connections", s->connections);
    cJSON_AddNumberToObject(root, "threads", s->threads);
    cJSON_AddNumberToObject(root, "warmup_s", s->warmup_s);
    cJSON_AddNumberToObject(root, "duration_s", s->duration_s);
    cJSON_AddNumberToObject(root, "requests_asked", (double)s->requests);
    cJSON_AddNumberToObject(root, "deadline_ms", s->deadline_ms);
    cJSON_AddNumberToObject(root, "bad_fraction", s->bad_fraction);
    cJSON *arr = cJSON_AddArrayToObject(root, "levels");
    bool pass = true;
    for (int i = 0; i < n; i++) {
        cJSON_AddItemToArray(arr, json_level(s, &levels[i]));
        pass = pass && !load_stats_errors(&levels[i].st) && !levels[i].st.mismatches;
    }
    cJSON_AddBoolToObject(root, "pass", pass);
    return root;
}

int load_report_json(const char *path, const load_setup *s, const load_level *levels, int n,
                     moed_error *err)
{
    cJSON *root = load_report_doc(s, levels, n);
    char *text = root ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (!text) return moed_fail(err, MOED_ENOMEM, "out of memory writing --json %s", path);
    int rc = load_write_file(path, text, strlen(text), "--json", err);
    cJSON_free(text);
    return rc;
}

/* ---- CSV ---- */

int load_report_csv(const char *path, const load_level *levels, int n, moed_error *err)
{
    FILE *f = fopen(path, "w");
    if (!f) return moed_fail(err, MOED_EIO, "--csv %s: cannot write it: %s", path, strerror(errno));
    fprintf(f, "concurrency,rate_asked,elapsed_s,requests,ok,bad_requests,expected_errors,errors,"
               "rps,tokens_per_s,mb_per_s_sent,mb_per_s_received");
    for (int i = 0; i < N_Q; i++) fprintf(f, ",latency_%s_ms", q_keys[i]);
    fprintf(f, ",queue_mean_ms,queue_p50_ms,queue_p99_ms,compute_mean_ms,compute_p50_ms,"
               "compute_p99_ms,batch_requests_mean,batch_tokens_mean,verified,mismatches,"
               "client_cpu_us_per_call\n");
    for (int i = 0; i < n; i++) {
        const load_level *l = &levels[i];
        const load_stats *st = &l->st;
        summary m = summarize(l);
        fprintf(f, "%d,%g,%.6f,%llu,%llu,%llu,%llu,%llu,%.3f,%.3f,%.6f,%.6f", l->concurrency,
                l->rate, l->elapsed_s, (unsigned long long)st->sent, (unsigned long long)st->ok,
                (unsigned long long)st->bad_sent, (unsigned long long)st->expected_errors,
                (unsigned long long)m.errors, m.rps, m.tokens_per_s, m.mb_sent_per_s,
                m.mb_received_per_s);
        for (int q = 0; q < N_Q; q++) fprintf(f, ",%.6f", m.lat_ms[q]);
        for (int q = 0; q < 3; q++) fprintf(f, ",%.6f", m.queue_ms[q]);
        for (int q = 0; q < 3; q++) fprintf(f, ",%.6f", m.compute_ms[q]);
        fprintf(f, ",%.4f,%.4f,%llu,%llu,%.3f\n", m.batch_requests, m.batch_tokens,
                (unsigned long long)st->verified, (unsigned long long)st->mismatches,
                m.cpu_us_per_call);
    }
    if (fclose(f))
        return moed_fail(err, MOED_EIO, "--csv %s: write failed: %s", path, strerror(errno));
    return 0;
}
