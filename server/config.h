/*
 * moed_config — the daemon's settings: defaults, then a config file (--config FILE, lines of
 * `key = value` with the long flags' names), then the command line, which wins. The option engine
 * (moed_opt.h) reads them and states the rules for words, values and the file; this module keeps
 * the daemon's table and what only the daemon checks.
 *
 * The file is at most 1 MiB of text (a regular file: a directory, FIFO or device is refused at
 * once). Listen addresses are checked here, in the forms their listeners can bind (host:port with
 * a valid host and a port from 0 to 65535; for gRPC, unix:PATH or unix-abstract:NAME too, and no
 * scheme or empty host); layer, expert and device lists take numbers up to MOED_CONFIG_MAX_LAYER,
 * in at most MOED_CONFIG_MAX_LIST characters, and are expanded in linear time. Options that do not
 * go together (--model with --synthetic, TLS flags without their pair) are refused too.
 *
 * A bad value fails with MOED_EINVAL and a message naming the flag (or file and line), the value
 * and what is accepted; the daemon prints it with moed_config_usage and exits 2.
 */
#ifndef MOED_CONFIG_H
#define MOED_CONFIG_H

#include "moed_err.h"

#include <stdint.h>
#include <stdio.h>

#define MOED_CONFIG_MAX_DEVICES   64
#define MOED_CONFIG_MAX_LAYER     65535     /* the largest number a layer (or device) list takes */
#define MOED_CONFIG_MAX_LIST      4096      /* characters in a layer or device list */
#define MOED_CONFIG_MAX_FILE      (1 << 20) /* bytes in a config file */
#define MOED_CONFIG_MAX_UNIX_PATH 107 /* bytes of a unix socket's path (sun_path, less its NUL) */

/* A list of numbers as given ("0-3,7") and expanded: increasing, without repeats. */
typedef struct moed_config_list {
    const char *text; /* NULL: not given (every layer, every expert) */
    int *v;
    int n;
} moed_config_list;

/* CUDA device ordinals in the order given, repeats kept (a GPU listed twice is two devices). */
typedef struct moed_config_devices {
    int v[MOED_CONFIG_MAX_DEVICES];
    int n; /* 0: every device */
} moed_config_devices;

/* Strings point into argv, the config file's text (kept here) or the table's defaults. */
typedef struct moed_config {
    const char *listen;          /* --listen ADDR */
    const char *model;           /* --model DIR, or NULL */
    const char *synthetic;       /* --synthetic SPEC, or NULL (no --model: the defaults) */
    moed_config_list layers;     /* --layers LIST: serve only these MoE layers */
    moed_config_list experts;    /* --experts LIST: hold only these experts of each layer */
    const char *shared_experts;  /* auto | on | off: this daemon adds the shared experts' term */
    const char *backend;         /* cpu | cuda | auto */
    const char *weights;         /* stored | fp8 | sparse24 */
    int threads;                 /* CPU worker threads, 0 = one per core */
    int streams;                 /* CUDA streams per device, 0 = the backend's default */
    moed_config_devices devices; /* --devices LIST */
    int expert_parallel;         /* --expert-parallel: split layers over the devices */
    const char *expert_load;     /* --expert-load FILE: measured load per expert (expert_load.h) */
    int rebalance_s;             /* --rebalance SECONDS: re-place split layers by load; 0: off */
    int rebalance_replicas;      /* --rebalance-replicas N: extra copies of hot experts a layer */
    double rebalance_min_gain;   /* --rebalance-min-gain FRACTION */
    int64_t rebalance_min_pairs; /* --rebalance-min-pairs N; 0: 32 per held expert */
    int cq_threads;              /* gRPC completion queues, one thread each */
    int64_t max_message_bytes;
    int64_t max_batch_tokens;   /* the most tokens in one launch and in one request */
    int64_t max_delay_us;       /* merge window; 0 = merge only what is already queued */
    int64_t min_batch_requests; /* a queue waits (up to the window) for this many requests */
    int64_t max_queue_requests;
    int64_t max_batch_pairs;  /* (token, expert) pairs in one request and one launch; 0: derived */
    int max_streams;          /* MAX_CONCURRENT_STREAMS per connection; 0: --max-queue-requests */
    int64_t max_grpc_memory;  /* gRPC core's resource quota in bytes; 0: derived */
    int accept_compression;   /* 1: gzip/deflate requests accepted (inflated by moed, bounded) */
    const char *regions;      /* off | local | any: who may use tensor regions */
    int64_t max_regions;      /* per principal */
    int64_t max_region_bytes; /* registered per principal */
    int64_t max_region_bytes_total; /* registered in all */
    int64_t max_rings;              /* doorbell rings open per principal; 0: no doorbell */
    int64_t max_links;              /* NCCL links open per principal; 0: no links */
    int64_t staging_pool;           /* bytes of the inline path's buffers; 0: derived */
    const char *metrics_listen;     /* --metrics-listen ADDR: /metrics and /healthz; NULL: off */
    const char *metrics_token_file; /* --metrics-token-file FILE: /metrics needs the token */
    int drain_timeout_s;            /* --drain-timeout: calls still open this long after SIGTERM are
                                       cancelled */
    const char *tls_cert;           /* --tls-cert FILE (PEM chain), with tls_key; NULL: plaintext */
    const char *tls_key;            /* --tls-key FILE */
    const char *tls_client_ca;   /* --tls-client-ca FILE: require client certificates it signed */
    const char *auth_token_file; /* --auth-token-file FILE: calls need a bearer token */
    int log_level;               /* moed_log_level */
    const char *log_file;        /* NULL: stderr */
    const char *config_file;     /* --config FILE, or NULL */
    char *config_text;           /* the file's text, which strings above point into */
} moed_config;

/* What moed_config_load found on the command line. */
enum { MOED_CONFIG_RUN = 0, MOED_CONFIG_EXIT = 1 };

/* Fills cfg from defaults, the config file and argv. Returns MOED_CONFIG_RUN, MOED_CONFIG_EXIT
 * after printing --help or --version to out, or MOED_EINVAL with err naming the bad flag or line.
 * cfg must be released with moed_config_free whatever the result. */
int moed_config_load(moed_config *cfg, int argc, char **argv, FILE *out, moed_error *err);
void moed_config_free(moed_config *cfg);

/* Prints a usage error of moed_config_load as every moed program does ("moed: MESSAGE" and where
 * to read more, on stderr). */
void moed_config_usage(const moed_error *err);

/* True when checkpoint layer `index` is to be served (always, without --layers). */
int moed_config_wants_layer(const moed_config *cfg, int index);

/* Parses a list such as "0-3,7" (layers, experts, devices) into an increasing array without
 * repeats (malloc'd, freed by the caller); MOED_EINVAL names the bad element. Shared with the
 * weights loader's syntax so `--layers` means the same for checkpoints and synthetic models. */
int moed_config_parse_layers(const char *list, int **out, int *n, moed_error *err);

#endif
