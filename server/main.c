/*
 * moed — the daemon: configuration, log, security, backend, weights, scheduler, gRPC, metrics,
 * then a libuv loop for signals, timers and the metrics endpoint until SIGTERM/SIGINT drains it.
 *
 * main() reads as the steps it takes; each step logs what it did or why it failed. Exit status:
 * 0 after a drain (clean, or cut short by --drain-timeout), 1 when start-up fails (TLS files,
 * weights, backend, binding), 2 on bad usage. The slow steps (backend, weights, scheduler, gRPC)
 * run on libuv's thread pool while the loop already answers the metrics endpoint
 * (/healthz says 503 until the weights are resident). gRPC listens from before the weights load:
 * health says NOT_SERVING and GetModel how far the load has come (moed_loading), which the log
 * also says every LOAD_LOG_MS, until every layer is resident. The heavy threads (completion queues,
 * scheduler workers, backend threads) are started by the steps; the main thread only waits in the
 * loop, woken by signals, timers, metrics scrapes, the end of the start-up steps, and the gRPC side
 * (uv_async_send) when the drain has finished every call. Under systemd (Type=notify) the service
 * manager hears READY=1 once the daemon serves, STOPPING=1 when it drains, and STATUS= lines on the
 * way. Nothing is printed on stdout except --help and --version.
 */
#include "config.h"
#include "doorbell.h"
#include "link.h"
#include "expert_load.h"
#include "http.h"
#include "loading.h"
#include "log.h"
#include "metrics.h"
#include "moed_registry.h"
#include "moed_dtype.h"
#include "notify.h"
#include "region.h"
#include "request.h"
#include "rpc.h"
#include "scheduler.h"
#include "security.h"
#include "shard.h"
#include "stacks.h"
#include "prune.h"
#include "rebalance.h"
#include "weights.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#define STATS_PERIOD_MS 10000
#define LOAD_LOG_MS     5000

typedef struct moed_daemon {
    moed_config cfg;
    moed_backend *backend;
    moed_model model;
    bool have_model;
    moed_expert_subset held;     /* --experts and --shared-experts */
    const moed_layer **resident; /* by backend slot */
    moed_shard *shards;          /* by backend slot: what the backend holds of each */
    moed_expert_load load;       /* --expert-load's file, read before anything else */
    double **loads;              /* by backend slot: its view's expert_load, or NULL */
    int loads_unused;            /* layers with a load that are not split */
    moed_served served;
    moed_regions *regions;
    moed_bufpool *pool;
    moed_sched *sched;
    moed_doorbell *doorbell;   /* NULL: regions off or --max-rings 0 */
    moed_links *links;         /* NULL: regions off or --max-links 0 */
    moed_rebalance *rebalance; /* re-placing split layers by measured load (--rebalance) */
    moed_rpc *rpc;
    moed_security security;
    moed_metrics *metrics; /* NULL without --metrics-listen and --rebalance: nothing recorded */
    moed_http *http;
    double start_time_s;
    uv_loop_t loop;
    uv_signal_t sigterm, sigint, sighup, sigusr2;
    uv_async_t drained;
    uv_timer_t stats, drain_timer, load_timer;
    uv_work_t start;
    int start_status; /* of the steps on the thread pool; read on the loop once they are done */
    bool serving, draining;
} moed_daemon;

static int fail(const char *step, const moed_error *err)
{
    moed_log_error("start failed", "step=%s code=%d reason=\"%s\"", step, err->code, err->msg);
    moed_notify("STATUS=start failed (%s): %s", step, err->msg);
    return 1;
}

/* ---- start-up steps -------------------------------------------------------------------------- */

static int open_log(const moed_config *cfg)
{
    if (!moed_log_init((moed_log_level)cfg->log_level, cfg->log_file)) return 0;
    fprintf(stderr,
            "moed: cannot open --log-file '%s' for appending; check the folder and its "
            "permissions\n",
            cfg->log_file);
    return 1;
}

/* TLS files and the token, read and checked before anything slow starts. */
static int load_security(moed_daemon *d)
{
    moed_error err = { 0 };
    moed_security_config sc = { .tls_cert = d->cfg.tls_cert,
                                .tls_key = d->cfg.tls_key,
                                .tls_client_ca = d->cfg.tls_client_ca,
                                .token_file = d->cfg.auth_token_file,
                                .token_env = getenv("MOED_AUTH_TOKEN") };
    if (moed_security_load(&sc, &d->security, &err)) return fail("security", &err);
    moed_log_info("security", "tls=%s client_certs=%s token=%s",
                  d->security.cert_pem ? "on" : "off", d->security.ca_pem ? "required" : "off",
                  d->security.n_tokens ? d->security.token_source : "off");
    return 0;
}

static int open_backend(moed_daemon *d)
{
    moed_error err = { 0 };
    moed_backend_config bc = { .threads = d->cfg.threads,
                               .streams = d->cfg.streams,
                               .devices = d->cfg.devices.n ? d->cfg.devices.v : NULL,
                               .n_devices = d->cfg.devices.n,
                               .max_tokens = d->cfg.max_batch_tokens,
                               .expert_parallel = d->cfg.expert_parallel };
    if (moed_backend_open(d->cfg.backend, &bc, &d->backend, &err)) return fail("backend", &err);
    moed_log_info("backend opened", "asked=%s backend=%s", d->cfg.backend,
                  moed_backend_name(d->backend));
    return 0;
}

/* The load's progress is kept from here on (moed_loading): reading or generating the layers, then
 * placing them in the backend. */
static int begin_load(moed_daemon *d)
{
    moed_loading_begin(d->cfg.model       ? d->cfg.model
                       : d->cfg.synthetic ? d->cfg.synthetic
                                          : "the default synthetic model",
                       2);
    return 0;
}

static int load_weights(moed_daemon *d)
{
    moed_error err = { 0 };
    const int wdtype = !strcmp(d->cfg.weights, "fp8")        ? MOED_FP8
                       : !strcmp(d->cfg.weights, "sparse24") ? MOED_WEIGHTS_SPARSE24
                                                             : 0;
    int rc;
    d->held = moed_shard_subset(d->cfg.experts.v, d->cfg.experts.n, d->cfg.shared_experts);
    if (d->cfg.model) {
        moed_log_info("loading checkpoint", "dir=\"%s\" layers=%s", d->cfg.model,
                      d->cfg.layers.text ? d->cfg.layers.text : "all");
        /* A backend that computes from the host weights for as long as moed runs must not find
         * them in a file that can change; one that copies them to its devices while loading can
         * read them from the mapping. */
        rc = moed_weights_checkpoint_held(
            d->cfg.model, d->cfg.layers.text,
            moed_backend_computes_from_host(d->backend) ? MOED_WEIGHTS_COPY : MOED_WEIGHTS_MAP,
            wdtype, &d->held, &d->model, &err);
    } else {
        if (!d->cfg.synthetic)
            moed_log_info("no --model or --synthetic given: serving the default synthetic model",
                          NULL);
        rc = moed_weights_synthetic_held(d->cfg.synthetic ? d->cfg.synthetic : "", wdtype, &d->held,
                                         &d->model, &err);
    }
    if (rc && d->cfg.experts.text) moed_error_prefix(&err, "--experts %s", d->cfg.experts.text);
    if (rc) return fail("weights", &err);
    d->have_model = true;
    moed_log_info("weights loaded", "model=\"%s\" arch=%s moe_layers=%d", d->model.source,
                  d->model.arch, d->model.n_layers);
    /* Pruning changes the model: say by how much, layer by layer, where an operator reads it. */
    for (int i = 0; d->model.pruned && i < d->model.n_layers; i++) {
        const struct moed_pruned *pr = &d->model.pruned[i];
        if (pr->pairs)
            moed_log_warn("pruned to 2:4 (--weights sparse24 changes the model)",
                          "layer=%d relative_error=%.4g tokens=%d pairs=%d against=dense",
                          d->model.layers[i].info.index, pr->error, MOED_PRUNE_TOKENS, pr->pairs);
        else /* an expert shard whose experts the batch does not reach */
            moed_log_warn("pruned to 2:4 (--weights sparse24 changes the model)",
                          "layer=%d relative_error=none tokens=%d pairs=0 note=%s",
                          d->model.layers[i].info.index, MOED_PRUNE_TOKENS,
                          "the batch reached none of the experts held");
    }
    return 0;
}

/* Every --layers entry must exist in the model: serving fewer layers than asked is a mistake. */
static int check_layer_list(moed_daemon *d)
{
    for (int i = 0; i < d->cfg.layers.n; i++)
        if (!moed_model_layer(&d->model, d->cfg.layers.v[i], NULL)) {
            moed_error err;
            moed_fail(&err, MOED_ENOTFOUND,
                      "--layers names layer %d, which is not a MoE layer of %s (it has %d MoE "
                      "layers, from %d to %d)",
                      d->cfg.layers.v[i], d->model.source, d->model.n_layers,
                      d->model.n_layers ? d->model.layers[0].info.index : -1,
                      d->model.n_layers ? d->model.layers[d->model.n_layers - 1].info.index : -1);
            return fail("layers", &err);
        }
    return 0;
}

/* Layer l's shard (its view of the experts this daemon holds, made before) into the backend as
 * `slot`. The log says where it went (experts@device, devices as GetModel numbers them). */
static int load_shard(moed_daemon *d, int slot, const moed_layer *l, moed_error *err)
{
    moed_loading_layer(l->info.index);
    int rc = moed_backend_load_layer(d->backend, slot, &d->shards[slot].view, err);
    if (rc) {
        moed_error_prefix(err, "layer %d", l->info.index);
        return rc;
    }
    moed_loading_bytes(moed_layer_bytes(&d->shards[slot].view.info));
    moed_loading_layer_done();
    moed_layer_place p;
    char where[512];
    if (moed_backend_layer_place(d->backend, slot, &p)) {
        d->loads_unused += d->loads && d->loads[slot];
        return 0;
    }
    d->loads_unused += d->loads && d->loads[slot] && !moed_place_is_split(&p);
    moed_shard_place_text(&d->shards[slot], &p, where, sizeof where);
    moed_log_info("layer placed", "layer=%d home_device=%d split=%d experts=\"%s\"", l->info.index,
                  p.home, moed_place_is_split(&p), where);
    return 0;
}

/* --expert-load: each slot's view gets the measured load of its experts (in the view's numbering),
 * logged layer by layer; a layer the file does not name, or whose held experts all count 0,
 * keeps the uniform expectation. A layer of the file that is no MoE layer of the model, or an
 * expert out of a layer's range, fails the start; with --layers, the layers of the file that are
 * not served are skipped. */
static int apply_expert_load(moed_daemon *d, int n)
{
    moed_error err = { 0 };
    if (!d->cfg.expert_load) return 0;
    int *have = malloc(((size_t)d->model.n_layers + 1) * sizeof *have), ignored = 0;
    if (!(d->loads = calloc((size_t)d->model.n_layers + 1, sizeof *d->loads)) || !have) {
        free(have);
        moed_fail(&err, MOED_ENOMEM, "no memory for the expert load");
        return fail("expert load", &err);
    }
    for (int i = 0; i < d->model.n_layers; i++) have[i] = d->model.layers[i].info.index;
    int rc = moed_expert_load_check(&d->load, have, d->model.n_layers, d->model.source,
                                    d->cfg.layers.text != NULL, &ignored, &err);
    free(have);
    if (rc) return fail("expert load", &err);
    if (ignored)
        moed_log_info("expert load: layers not served are skipped", "file=\"%s\" layers=%d",
                      d->cfg.expert_load, ignored);
    const double launches = moed_expert_load_launches(&d->load); /* the same for every layer */
    for (int slot = 0; slot < n; slot++) {
        moed_shard *sh = &d->shards[slot];
        const moed_layer_info *li = &sh->full->info;
        int named;
        if (moed_expert_load_layer(&d->load, li->index, li->n_experts, sh->global_of, sh->n_held,
                                   &d->loads[slot], &named, &err))
            return fail("expert load", &err);
        const double *v = d->loads[slot];
        if (!v) {
            moed_log_info("expert load: none for this layer, its placement stays uniform",
                          "layer=%d reason=%s", li->index,
                          named ? "every_held_expert_counts_0" : "not_in_file");
            continue;
        }
        sh->view.expert_load = v;
        sh->view.expert_launches = launches;
        double total = 0;
        int top = 0;
        for (int k = 0; k < sh->n_held; k++) {
            total += v[k];
            if (v[k] > v[top]) top = k;
        }
        moed_log_info("expert load",
                      "layer=%d experts=%d pairs=%.0f top_expert=%d top_share=%.4f launches=%.0f",
                      li->index, sh->n_held, total, moed_shard_global(sh, top), v[top] / total,
                      sh->view.expert_launches);
    }
    return 0;
}

/* What the log says the daemon holds of each layer's experts: "all", or "0-31 shared=off". */
static void held_experts(const moed_daemon *d, char *buf, size_t n)
{
    if (!d->served.n_layers || (!d->cfg.experts.text && d->held.shared)) {
        snprintf(buf, n, "all");
        return;
    }
    char list[256];
    moed_shard_ranges(&d->shards[0], list, sizeof list);
    snprintf(buf, n, "%s shared=%s", list, d->held.shared ? "on" : "off");
}

/* Loads the chosen layers into the backend (slots in increasing layer order) and starts it. */
static int load_layers(moed_daemon *d)
{
    moed_error err = { 0 };
    if (check_layer_list(d)) return 1;
    d->resident = calloc((size_t)d->model.n_layers + 1, sizeof *d->resident);
    d->shards = calloc((size_t)d->model.n_layers + 1, sizeof *d->shards);
    if (!d->resident || !d->shards) {
        moed_fail(&err, MOED_ENOMEM, "no memory for the layer table");
        return fail("layers", &err);
    }
    int n = 0;
    uint64_t bytes = 0;
    for (int i = 0; i < d->model.n_layers; i++) { /* the shards first: the phase's size */
        const moed_layer *l = &d->model.layers[i];
        if (!moed_config_wants_layer(&d->cfg, l->info.index)) continue;
        if (moed_shard_make(l, &d->held, &d->shards[n], &err)) {
            moed_error_prefix(&err, "layer %d", l->info.index);
            return fail("load layers", &err);
        }
        d->resident[n] = l;
        bytes += moed_layer_bytes(&d->shards[n++].view.info);
    }
    if (apply_expert_load(d, n)) return 1;
    moed_loading_phase("placing", n, bytes);
    for (int slot = 0; slot < n; slot++)
        if (load_shard(d, slot, d->resident[slot], &err)) return fail("load layers", &err);
    if (!n) {
        moed_fail(&err, MOED_ENOTFOUND, "no MoE layer to serve in %s", d->model.source);
        return fail("load layers", &err);
    }
    if (d->loads_unused)
        moed_log_info("expert load unused: the layers are served whole, not split over devices",
                      "layers=%d backend=%s", d->loads_unused, moed_backend_name(d->backend));
    if (moed_backend_start(d->backend, &err)) return fail("backend start", &err);
    d->served = (moed_served){ .layers = d->resident,
                               .shards = d->shards,
                               .n_layers = n,
                               .max_batch_tokens = d->cfg.max_batch_tokens,
                               .max_message_bytes = d->cfg.max_message_bytes,
                               .fingerprint = d->model.fingerprint };
    char list[256], experts[300];
    moed_served_layer_list(&d->served, list, sizeof list);
    held_experts(d, experts, sizeof experts);
    moed_log_info("layers resident",
                  "layers=%s experts=\"%s\" count=%d weight_bytes=%llu exec_slots=%d", list,
                  experts, n, (unsigned long long)bytes, moed_backend_n_exec(d->backend));
    return 0;
}

/* The gRPC server's limits whose defaults (0) follow from other flags: set before it starts. */
static int derive_rpc_limits(moed_daemon *d)
{
    moed_config *c = &d->cfg;
    if (!c->max_streams)
        c->max_streams = c->max_queue_requests < (1 << 20) ? (int)c->max_queue_requests : 1 << 20;
    if (!c->max_grpc_memory) c->max_grpc_memory = 4 * c->max_message_bytes + ((int64_t)256 << 20);
    return 0;
}

/* The limits whose defaults (0) follow from the layers served; logged with the others as used. */
static int derive_limits(moed_daemon *d)
{
    moed_config *c = &d->cfg;
    int top_k = 1;
    for (int i = 0; i < d->served.n_layers; i++)
        if (d->served.layers[i]->info.top_k > top_k) top_k = d->served.layers[i]->info.top_k;
    if (!c->max_batch_pairs) c->max_batch_pairs = 2 * c->max_batch_tokens * top_k;
    d->served.max_batch_pairs = c->max_batch_pairs;
    moed_log_info("limits",
                  "max_batch_tokens=%lld max_batch_pairs=%lld max_streams=%d max_grpc_memory=%lld "
                  "accept_compression=%d",
                  (long long)c->max_batch_tokens, (long long)c->max_batch_pairs, c->max_streams,
                  (long long)c->max_grpc_memory, c->accept_compression);
    return 0;
}

/* The data plane: the region registry and the inline path's staging pool. */
static int start_data_plane(moed_daemon *d)
{
    moed_error err = { 0 };
    const moed_config *c = &d->cfg;
    const int mode = !strcmp(c->regions, "off")     ? MOED_REGIONS_OFF
                     : !strcmp(c->regions, "local") ? MOED_REGIONS_LOCAL
                                                    : MOED_REGIONS_ANY;
    moed_regions_config rc = { .backend = d->backend,
                               .mode = mode,
                               .max_regions = c->max_regions,
                               .max_bytes = c->max_region_bytes,
                               .max_total_bytes = c->max_region_bytes_total };
    int64_t max_d = 1;
    for (int i = 0; i < d->served.n_layers; i++)
        if (d->served.layers[i]->info.d_model > max_d) max_d = d->served.layers[i]->info.d_model;
    const int64_t pool = c->staging_pool ? c->staging_pool : 4 * c->max_batch_tokens * max_d * 4;
    if ((mode != MOED_REGIONS_OFF && moed_regions_create(&rc, &d->regions, &err)) ||
        moed_bufpool_create(d->backend, (size_t)pool, &d->pool, &err))
        return fail("data plane", &err);
    d->served.regions = d->regions;
    d->served.pool = d->pool;
    moed_log_info("data plane",
                  "regions=%s max_regions=%lld max_region_bytes=%lld "
                  "max_region_bytes_total=%lld staging_pool=%lld",
                  c->regions, (long long)c->max_regions, (long long)c->max_region_bytes,
                  (long long)c->max_region_bytes_total, (long long)pool);
    return 0;
}

/* The counters, from the first call (GetModel and health are answered while the weights load);
 * their per-expert table once the layers are known (start_scheduler). --rebalance weighs the
 * per-expert counters, so they are kept with it even without the endpoint. */
static int create_metrics(moed_daemon *d)
{
    moed_error err = { 0 };
    if ((d->cfg.metrics_listen || d->cfg.rebalance_s) && !(d->metrics = moed_metrics_create())) {
        moed_fail(&err, MOED_ENOMEM, "no memory for the metrics");
        return fail("metrics", &err);
    }
    return 0;
}

static int start_scheduler(moed_daemon *d)
{
    moed_error err = { 0 };
    if (d->metrics && moed_metrics_set_layers(d->metrics, d->shards, d->served.n_layers)) {
        moed_fail(&err, MOED_ENOMEM, "no memory for the metrics");
        return fail("metrics", &err);
    }
    moed_sched_config sc = { .backend = d->backend,
                             .layers = d->served.layers,
                             .shards = d->shards,
                             .n_layers = d->served.n_layers,
                             .max_batch_tokens = d->cfg.max_batch_tokens,
                             .max_batch_pairs = d->cfg.max_batch_pairs,
                             .max_delay_us = d->cfg.max_delay_us,
                             .min_batch_requests = d->cfg.min_batch_requests,
                             .max_queue_requests = d->cfg.max_queue_requests,
                             .metrics = d->metrics };
    if (moed_sched_create(&sc, &d->sched, &err)) return fail("scheduler", &err);
    return 0;
}

/* The same-host data path: rings in regions, and the thread that polls them. */
static int start_doorbell(moed_daemon *d)
{
    moed_error err = { 0 };
    if (!d->regions || !d->cfg.max_rings) return 0;
    moed_doorbell_config dc = { .served = &d->served,
                                .sched = d->sched,
                                .metrics = d->metrics,
                                .max_rings = d->cfg.max_rings };
    if (moed_doorbell_create(&dc, &d->doorbell, &err)) return fail("doorbell", &err);
    moed_log_info("doorbell", "max_rings=%lld", (long long)d->cfg.max_rings);
    return 0;
}

/* NCCL links, opened by Regions sessions: a registry only until a session opens one. */
static int start_links(moed_daemon *d)
{
    moed_error err = { 0 };
    if (!d->regions || !d->cfg.max_links) return 0;
    moed_links_config lc = { .served = &d->served,
                             .backend = d->backend,
                             .sched = d->sched,
                             .metrics = d->metrics,
                             .max_links = d->cfg.max_links };
    if (moed_links_create(&lc, &d->links, &err)) return fail("links", &err);
    moed_log_info("links", "max_links=%lld", (long long)d->cfg.max_links);
    return 0;
}

static int start_rpc(moed_daemon *d)
{
    moed_error err = { 0 };
    moed_rpc_config rc = { .listen = d->cfg.listen,
                           .cq_threads = d->cfg.cq_threads,
                           .max_message_bytes = d->cfg.max_message_bytes,
                           .max_streams = d->cfg.max_streams,
                           .max_grpc_memory = d->cfg.max_grpc_memory,
                           .accept_compression = d->cfg.accept_compression,
                           .served = &d->served,
                           .backend = d->backend,
                           .model = d->model.source,
                           .security = &d->security,
                           .metrics = d->metrics };
    if (moed_rpc_start(&rc, &d->rpc, &err)) return fail("grpc", &err);
    /* health says NOT_SERVING until the weights are resident (ready) */
    moed_log_info("grpc listening", "addr=%s health=NOT_SERVING", moed_rpc_address(d->rpc));
    if (!moed_listen_is_loopback(d->cfg.listen) && !d->security.cert_pem && !d->security.n_tokens)
        moed_log_warn("listening beyond this host without TLS or a token: anyone who can reach "
                      "the port can call moed and read its traffic; set --tls-cert/--tls-key "
                      "and --auth-token-file (or keep it behind a firewall)",
                      "addr=%s", d->cfg.listen);
    return 0;
}

/* Re-placing split layers by their load: the --expert-load file's once, before the daemon is
 * ready, when copies of hot experts may be made (--rebalance-replicas > 0; the load already cut
 * the ranges at load), so they serve from the first call; then every --rebalance seconds by the
 * load measured, on the module's thread (rebalance.h). */
static int start_rebalance(moed_daemon *d)
{
    moed_error err = { 0 };
    const bool apply = d->loads && d->cfg.rebalance_replicas > 0;
    if (!d->cfg.rebalance_s && !apply) return 0;
    moed_rebalance_config rc = { .backend = d->backend,
                                 .shards = d->shards,
                                 .n_slots = d->served.n_layers,
                                 .metrics = d->metrics,
                                 .period_s = d->cfg.rebalance_s,
                                 .max_replicas = d->cfg.rebalance_replicas,
                                 .min_gain = d->cfg.rebalance_min_gain,
                                 .min_pairs = d->cfg.rebalance_min_pairs };
    if (moed_rebalance_create(&rc, &d->rebalance, &err)) return fail("rebalance", &err);
    d->served.rebalance = d->rebalance;
    for (int slot = 0; apply && slot < d->served.n_layers; slot++) {
        moed_layer_place p;
        bool changed;
        if (!d->loads[slot] || moed_backend_layer_place(d->backend, slot, &p) ||
            !moed_place_is_split(&p))
            continue;
        /* a failure is logged and leaves the placement made at load: not worth failing the start */
        moed_rebalance_apply(d->rebalance, slot, d->loads[slot],
                             moed_expert_load_launches(&d->load), &changed, &err);
    }
    if (moed_rebalance_start(d->rebalance, &err)) return fail("rebalance", &err);
    return 0;
}

/* Every method is served from now on; health says SERVING once the loop has made the daemon
 * ready. */
static int serve_calls(moed_daemon *d)
{
    moed_rpc_loaded(d->rpc, d->sched, d->doorbell, d->links);
    moed_loading_end();
    return 0;
}

/* ---- the metrics endpoint -------------------------------------------------------------------- */

static void metrics_page(moed_daemon *d, moed_http_reply *out)
{
    moed_sched_stats ss;
    moed_rpc_stats rs;
    moed_http_stats hs;
    moed_device_info dev[MOED_CONFIG_MAX_DEVICES];
    int n = 0;
    moed_sched_get_stats(d->sched, &ss);
    moed_rpc_get_stats(d->rpc, &rs);
    moed_http_get_stats(d->http, &hs);
    for (int i = 0; i < moed_backend_n_devices(d->backend) && n < MOED_CONFIG_MAX_DEVICES; i++)
        if (!moed_backend_device_info(d->backend, i, &dev[n])) {
            dev[n].name[sizeof dev[n].name - 1] = 0;
            n++;
        }
    moed_metrics_gauges g = { .serving = d->serving && !d->draining,
                              .queue_requests = ss.queued,
                              .calls_active = rs.active_calls,
                              .connections_closed = rs.connections_closed,
                              .exec_busy = ss.running,
                              .exec_size = (uint64_t)moed_backend_n_exec(d->backend),
                              .devices = dev,
                              .n_devices = n,
                              .version = MOED_VERSION,
                              .backend = moed_backend_name(d->backend),
                              .start_time_s = d->start_time_s,
                              .http_connections = hs.open,
                              .http_refused = hs.refused,
                              .staging_pool_used = moed_bufpool_used(d->pool),
                              .staging_pool_bytes = moed_bufpool_size(d->pool),
                              .rings = moed_doorbell_rings(d->doorbell),
                              .links = moed_links_count(d->links) };
    moed_regions_stats rs_;
    moed_regions_get_stats(d->regions, &rs_);
    for (int k = 0; k < 2; k++) {
        g.regions[k] = rs_.count[k + 1];
        g.region_bytes[k] = rs_.bytes[k + 1];
    }
    out->body = moed_metrics_render(d->metrics, &g, &out->len);
    out->status = out->body ? 200 : 500;
    out->content_type = "text/plain; version=0.0.4; charset=utf-8";
}

/* On the loop's thread: /metrics (behind --metrics-token-file when given; 503 until serving) and
 * /healthz (always open; 200 while SERVING, 503 before and while draining, as Kubernetes' HTTP
 * probes and load balancers expect). */
static void on_http(void *arg, const char *path, bool authorized, moed_http_reply *out)
{
    moed_daemon *d = arg;
    if (!strcmp(path, "/metrics") && !authorized) {
        out->status = 401;
        out->body = strdup("/metrics needs 'Authorization: Bearer <token>' with the token of "
                           "--metrics-token-file\n");
        out->len = out->body ? strlen(out->body) : 0;
    } else if (!strcmp(path, "/metrics") && d->serving) {
        metrics_page(d, out);
    } else if (!strcmp(path, "/metrics")) { /* still starting: nothing to count yet */
        out->status = 503;
        out->body = strdup("starting\n");
        out->len = out->body ? strlen(out->body) : 0;
    } else if (!strcmp(path, "/healthz")) {
        bool up = d->serving && !d->draining;
        out->status = up ? 200 : 503;
        out->body = strdup(up ? "SERVING\n" : "NOT_SERVING\n");
        out->len = out->body ? strlen(out->body) : 0;
    }
}

static int start_metrics(moed_daemon *d)
{
    moed_error err = { 0 };
    if (!d->cfg.metrics_listen) return 0;
    moed_http_config hc = { .listen = d->cfg.metrics_listen,
                            .token_file = d->cfg.metrics_token_file };
    if (moed_http_start(&d->loop, &hc, on_http, d, &d->http, &err)) return fail("metrics", &err);
    moed_log_info("metrics listening", "addr=%s paths=/metrics,/healthz metrics_token=%s",
                  moed_http_address(d->http), hc.token_file ? "on" : "off");
    if (!moed_listen_is_loopback(hc.listen) && !hc.token_file)
        moed_log_warn("metrics listening beyond this host without a token: anyone who can reach "
                      "the port can read /metrics; set --metrics-token-file (or keep it on "
                      "loopback)",
                      "addr=%s", hc.listen);
    return 0;
}

static void ready(moed_daemon *d)
{
    char list[256], experts[300];
    moed_served_layer_list(&d->served, list, sizeof list);
    held_experts(d, experts, sizeof experts);
    moed_rpc_set_serving(d->rpc, true);
    d->serving = true;
    moed_log_info("ready",
                  "addr=%s backend=%s layers=%s experts=\"%s\" model=\"%s\" fingerprint=%016llx "
                  "version=%s",
                  moed_rpc_address(d->rpc), moed_backend_name(d->backend), list, experts,
                  d->model.source, (unsigned long long)d->model.fingerprint, MOED_VERSION);
    moed_notify("READY=1\nSTATUS=serving on %s: layers %s of %s, %s backend\nMAINPID=%d",
                moed_rpc_address(d->rpc), list, d->model.source, moed_backend_name(d->backend),
                (int)getpid());
}

/* ---- the loop -------------------------------------------------------------------------------- */

/* On a completion-queue thread: every call has finished. */
static void on_rpc_drained(void *arg)
{
    moed_daemon *d = arg;
    uv_async_send(&d->drained);
}

/* Cuts the drain short: the calls still open are cancelled (gRPC ends them with UNAVAILABLE; a
 * launch computing runs to its end and its replies are dropped); the loop then ends as usual
 * once every call is gone. */
static void cancel_open_calls(moed_daemon *d, const char *why)
{
    moed_rpc_stats rs;
    moed_sched_stats ss;
    moed_rpc_get_stats(d->rpc, &rs);
    moed_sched_get_stats(d->sched, &ss);
    moed_log_warn("cancelling the calls still open",
                  "why=\"%s\" calls=%llu queued=%llu running=%llu", why,
                  (unsigned long long)rs.active_calls, (unsigned long long)ss.queued,
                  (unsigned long long)ss.running);
    moed_notify("STATUS=draining: %s, cancelled %llu calls", why,
                (unsigned long long)rs.active_calls);
    moed_rpc_cancel_all(d->rpc);
}

static void on_drain_timeout(uv_timer_t *t)
{
    moed_daemon *d = t->data;
    char why[64];
    snprintf(why, sizeof why, "--drain-timeout of %d s passed", d->cfg.drain_timeout_s);
    cancel_open_calls(d, why);
}

static void on_stop_signal(uv_signal_t *h, int signum)
{
    moed_daemon *d = h->data;
    const char *sig = signum == SIGINT ? "SIGINT" : "SIGTERM";
    if (d->draining) {
        cancel_open_calls(d, signum == SIGINT ? "a second SIGINT" : "a second SIGTERM");
        return;
    }
    d->draining = true;
    moed_rpc_stats rs;
    moed_rpc_get_stats(d->rpc, &rs);
    moed_log_info("draining", "signal=%s calls=%llu drain_timeout_s=%d", sig,
                  (unsigned long long)rs.active_calls, d->cfg.drain_timeout_s);
    moed_notify("STOPPING=1\nSTATUS=draining after %s: %llu calls open (cancelled if still open "
                "in %d s)",
                sig, (unsigned long long)rs.active_calls, d->cfg.drain_timeout_s);
    moed_doorbell_drain(d->doorbell);  /* before the sessions end: what rings hold is taken */
    moed_links_drain(d->links);        /* likewise: links stay, answering UNAVAILABLE */
    moed_rebalance_stop(d->rebalance); /* none starts now; one in progress ends in teardown */
    moed_rpc_drain(d->rpc, on_rpc_drained, d);
    uv_timer_start(&d->drain_timer, on_drain_timeout, (uint64_t)d->cfg.drain_timeout_s * 1000u, 0);
}

static void on_hup(uv_signal_t *h, int signum)
{
    if (moed_log_reopen())
        moed_log_error("cannot reopen the log file", NULL);
    else
        moed_log_info("log reopened", NULL);
}

/* An operator's SIGUSR2: every thread's stack in the log (stacks.h). */
static void on_usr2(uv_signal_t *h, int signum)
{
    moed_stacks_log();
}

static void on_stats(uv_timer_t *t)
{
    moed_daemon *d = t->data;
    moed_sched_stats s;
    moed_rpc_stats r;
    moed_sched_get_stats(d->sched, &s);
    moed_rpc_get_stats(d->rpc, &r);
    moed_log_debug("stats",
                   "active_calls=%llu forwards=%llu ok=%llu queued=%llu submitted=%llu "
                   "completed=%llu rejected=%llu cancelled=%llu expired=%llu failed=%llu "
                   "batches=%llu batch_tokens=%llu compute_us=%llu",
                   (unsigned long long)r.active_calls, (unsigned long long)r.forwards,
                   (unsigned long long)r.by_status[0], (unsigned long long)s.queued,
                   (unsigned long long)s.submitted, (unsigned long long)s.completed,
                   (unsigned long long)s.rejected, (unsigned long long)s.cancelled,
                   (unsigned long long)s.expired, (unsigned long long)s.failed,
                   (unsigned long long)s.batches, (unsigned long long)s.batch_tokens,
                   (unsigned long long)s.compute_us);
}

/* The signals the loop takes: they stop moed, reopen its log or dump its threads' stacks. */
#define N_LOOP_SIGNALS 4
static const int loop_signals[N_LOOP_SIGNALS] = { SIGTERM, SIGINT, SIGHUP, SIGUSR2 };

/* Blocks (how = SIG_BLOCK) or restores the loop's signals in this thread; *old gets the mask
 * before. */
static void mask_loop_signals(int how, sigset_t *old)
{
    sigset_t set;
    sigemptyset(&set);
    for (int i = 0; i < N_LOOP_SIGNALS; i++) sigaddset(&set, loop_signals[i]);
    pthread_sigmask(how, &set, old);
}

/* uv_walk callback: closes a handle; with a non-NULL arg, every handle but the signal handles. */
static void close_handle(uv_handle_t *h, void *keep_signals)
{
    if (keep_signals && h->type == UV_SIGNAL) return;
    if (!uv_is_closing(h)) uv_close(h, NULL);
}

/* Ends the loop: the endpoint and the other handles close; the signal handles stay registered
 * through teardown, so a further SIGTERM while moed winds down is caught (and, with the loop
 * stopped, ignored) rather than killing it with the default action. */
static void stop_loop(moed_daemon *d)
{
    moed_http_close(d->http); /* frees its connections as they close */
    d->http = NULL;
    uv_walk(&d->loop, close_handle, (void *)1);
    uv_stop(&d->loop);
}

static void on_drained(uv_async_t *h)
{
    moed_daemon *d = h->data;
    moed_log_info("every call answered", NULL);
    stop_loop(d);
}

/* The loop takes the signals from here on: before READY=1 goes out, so a supervisor that stops
 * moed as soon as it is ready finds the drain in place (a signal that comes before the loop runs
 * waits for it). Until then SIGTERM and SIGINT end a start that has nothing to drain, and SIGHUP
 * and SIGUSR2 are ignored (see main). */
static void watch_signals(moed_daemon *d)
{
    uv_signal_t *sigs[N_LOOP_SIGNALS] = { &d->sigterm, &d->sigint, &d->sighup, &d->sigusr2 };
    uv_signal_cb cbs[N_LOOP_SIGNALS] = { on_stop_signal, on_stop_signal, on_hup, on_usr2 };
    for (int i = 0; i < N_LOOP_SIGNALS; i++) {
        uv_signal_init(&d->loop, sigs[i]);
        sigs[i]->data = d;
        uv_signal_start(sigs[i], cbs[i], loop_signals[i]);
    }
}

/* On the thread pool: the slow steps. */
static void start_steps(uv_work_t *w)
{
    moed_daemon *d = w->data;
    d->start_status = open_backend(d) || begin_load(d) || create_metrics(d) ||
                      derive_rpc_limits(d) || start_rpc(d) || load_weights(d) || load_layers(d) ||
                      derive_limits(d) || start_data_plane(d) || start_scheduler(d) ||
                      start_doorbell(d) || start_links(d) || start_rebalance(d) || serve_calls(d);
    if (d->start_status) moed_loading_end();
}

/* On the loop, every LOAD_LOG_MS while the weights load: how far it has come, in the log and in
 * systemd's STATUS. */
static void on_load_tick(uv_timer_t *t)
{
    moed_loading_state s;
    char how[300];
    moed_loading_get(&s);
    if (!s.active) return;
    moed_loading_describe(&s, how, sizeof how);
    moed_log_info("loading",
                  "phase=%s phase_no=%d phases=%d layer=%d layers_done=%d layers=%d bytes=%llu "
                  "bytes_total=%llu percent=%.1f rate_mib_s=%.1f eta_s=%.0f elapsed_s=%.1f",
                  s.phase[0] ? s.phase : "starting", s.phase_no, s.phases, s.layer, s.layers_done,
                  s.layers_total, (unsigned long long)s.bytes_done,
                  (unsigned long long)s.bytes_total, s.percent, s.rate_bps / (1 << 20), s.eta_s,
                  s.elapsed_s);
    moed_notify("STATUS=loading weights: %s", how);
}

/* Back on the loop: serve, or stop after a failed start. */
static void started(uv_work_t *w, int cancelled)
{
    moed_daemon *d = w->data;
    uv_timer_stop(&d->load_timer);
    if (d->start_status) {
        stop_loop(d);
        return;
    }
    if (moed_log_enabled(MOED_LOG_DEBUG)) {
        uv_timer_init(&d->loop, &d->stats);
        d->stats.data = d;
        uv_timer_start(&d->stats, on_stats, STATS_PERIOD_MS, STATS_PERIOD_MS);
    }
    watch_signals(d);
    ready(d);
}

/* Starts the slow steps on the thread pool and runs the loop until the drain (or a failed start)
 * ends it; the start's status. */
static int run_loop(moed_daemon *d)
{
    uv_timer_init(&d->loop, &d->drain_timer);
    d->drain_timer.data = d;
    uv_async_init(&d->loop, &d->drained, on_drained);
    d->drained.data = d;
    uv_timer_init(&d->loop, &d->load_timer);
    d->load_timer.data = d;
    uv_timer_start(&d->load_timer, on_load_tick, LOAD_LOG_MS, LOAD_LOG_MS);
    d->start.data = d;
    /* The pool's threads, created here, and the ones the steps start inherit a mask that keeps
     * the loop's signals out of them: the loop's thread takes those, and teardown holds them there
     * until they are ignored, while the pool's threads live on to the exit. */
    sigset_t old;
    mask_loop_signals(SIG_BLOCK, &old);
    uv_queue_work(&d->loop, &d->start, start_steps, started);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    uv_run(&d->loop, UV_RUN_DEFAULT);
    return d->start_status;
}

/* ---- teardown, in the reverse order of start-up ---------------------------------------------- */

static void teardown(moed_daemon *d)
{
    moed_rebalance_destroy(d->rebalance);     /* waits for a re-placement in progress (bounded) */
    if (d->sched) moed_sched_drain(d->sched); /* nothing is left once every call is answered */
    moed_rpc_destroy(d->rpc);                 /* every session closed: rings left are the drain's */
    moed_doorbell_destroy(d->doorbell);       /* before the scheduler it submits to */
    moed_links_destroy(d->links);             /* likewise */
    moed_sched_destroy(d->sched);
    moed_bufpool_destroy(d->pool);    /* every call is gone: no reply holds a buffer */
    moed_regions_destroy(d->regions); /* every session closed with its call */
    moed_backend_destroy(d->backend); /* before the weights: it may compute from them in place */
    for (int i = 0; d->shards && i < d->model.n_layers; i++) moed_shard_free(&d->shards[i]);
    free(d->shards);
    for (int i = 0; d->loads && i < d->model.n_layers; i++) free(d->loads[i]);
    free(d->loads);
    moed_expert_load_free(&d->load);
    if (d->have_model) moed_weights_release(&d->model);
    free(d->resident);
    /* After a failed start the endpoint may be open; its handles close on one more turn. */
    moed_http_close(d->http);
    /* Closing the signal handles gives the loop's signals their default action back, and a moed
     * about to exit 0 must not die of one: they are held (every other thread is gone or blocks
     * them) until ignored, which drops any that came meanwhile. */
    mask_loop_signals(SIG_BLOCK, NULL);
    uv_walk(&d->loop, close_handle, NULL);
    uv_run(&d->loop, UV_RUN_DEFAULT);
    for (int i = 0; i < N_LOOP_SIGNALS; i++) signal(loop_signals[i], SIG_IGN);
    if (uv_loop_close(&d->loop)) moed_log_warn("the event loop closed with handles open", NULL);
    moed_metrics_destroy(d->metrics);
    moed_security_free(&d->security);
    moed_config_free(&d->cfg);
}

int main(int argc, char **argv)
{
    /* First: `systemctl reload` sends SIGHUP, whose default action would kill a moed still
     * loading its weights. The loop's handler (log reopening) replaces this once it runs; so for
     * SIGUSR2 (the threads' stacks, moed_stacks). */
    signal(SIGHUP, SIG_IGN);
    signal(SIGUSR2, SIG_IGN);
    moed_stacks_install();
    static moed_daemon d;
    moed_error err = { 0 };
    int rc = moed_config_load(&d.cfg, argc, argv, stdout, &err);
    if (rc != MOED_CONFIG_RUN) {
        if (rc < 0) moed_config_usage(&err);
        moed_config_free(&d.cfg);
        return rc < 0 ? 2 : 0;
    }
    /* --expert-load is usage like any flag: a file that cannot be read or parsed ends it here. */
    if (d.cfg.expert_load && (rc = moed_expert_load_read(d.cfg.expert_load, &d.load, &err))) {
        moed_config_usage(&err);
        moed_expert_load_free(&d.load);
        moed_config_free(&d.cfg);
        return rc == MOED_ENOMEM ? 1 : 2;
    }
    if (open_log(&d.cfg)) {
        moed_expert_load_free(&d.load);
        moed_config_free(&d.cfg);
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    d.start_time_s = (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
    uv_loop_init(&d.loop);
    moed_log_info("starting", "version=%s pid=%d", MOED_VERSION, (int)getpid());
    moed_notify("STATUS=starting: loading weights");
    int status = load_security(&d) || start_metrics(&d) || run_loop(&d);
    teardown(&d);
    moed_log_info(status ? "exiting after a failed start" : "stopped", "exit=%d", status);
    moed_log_close();
    return status;
}
