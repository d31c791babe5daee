/*
 * moed_config — the daemon's settings: defaults, then a config file (--config FILE, lines of
 * `key = value` with the long flags' names), then the command line, which wins.
 *
 * The file: at most 1 MiB of text (a regular file: a directory, FIFO or device is refused at
 * once); blank lines and `# comment` lines; a `#` after an unquoted value starts a comment. A value
 * in double quotes is taken as it is up to its closing quote, `#` and blanks included; inside
 * quotes \" is a quote and \\ a backslash (no other escapes), and only a comment may follow.
 * Listen addresses are checked here, in the forms their listeners can bind (host:port with a
 * valid host and a port from 0 to 65535; for gRPC, unix:PATH or unix-abstract:NAME too, and no
 * scheme or empty host); layer, expert and device lists take numbers up to MOED_CONFIG_MAX_LAYER,
 * in at most MOED_CONFIG_MAX_LIST characters, and are expanded in linear time.
 *
 * One table describes every option (name, kind, range, help), so parsing, the file, --help and the
 * error messages can never disagree. A bad value fails with MOED_EINVAL and a message naming the
 * flag (or file and line), the value and what is accepted; the daemon exits 2 on it.
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

typedef struct moed_config {
    char *listen;    /* --listen ADDR */
    char *model;     /* --model DIR, or NULL */
    char *synthetic; /* --synthetic SPEC, or NULL (with no --model: the generator's defaults) */
    char *layers;    /* --layers LIST as given ("0-3,7"), or NULL: every MoE layer */
    int *layer_list; /* the LIST expanded, increasing, without repeats */
    int n_layer_list;
    char *experts;    /* --experts LIST as given, or NULL: every expert of each layer */
    int *expert_list; /* the LIST expanded, increasing, without repeats */
    int n_expert_list;
    char *shared_experts; /* auto | on | off: this daemon adds the shared experts' term */
    char *backend;        /* cpu | cuda | auto */
    char *weights;        /* stored | fp8 */
    int threads;          /* CPU worker threads, 0 = one per core */
    int streams;          /* CUDA streams per device, 0 = the backend's default */
    int devices[MOED_CONFIG_MAX_DEVICES]; /* --devices LIST (CUDA ordinals, in order, repeats) */
    int n_devices;                        /* 0: every device */
    int expert_parallel;                  /* --expert-parallel: split layers over the devices */
    int cq_threads;                       /* gRPC completion queues, one thread each */
    int64_t max_message_bytes;
    int64_t max_batch_tokens;   /* the most tokens in one launch and in one request */
    int64_t max_delay_us;       /* merge window; 0 = merge only what is already queued */
    int64_t min_batch_requests; /* a queue waits (up to the window) for this many requests */
    int64_t max_queue_requests;
    int64_t max_batch_pairs;  /* (token, expert) pairs in one request and one launch; 0: derived */
    int max_streams;          /* MAX_CONCURRENT_STREAMS per connection; 0: --max-queue-requests */
    int64_t max_grpc_memory;  /* gRPC core's resource quota in bytes; 0: derived */
    int accept_compression;   /* 1: gzip/deflate requests accepted (inflated by moed, bounded) */
    char *regions;            /* off | local | any: who may use tensor regions */
    int64_t max_regions;      /* per principal */
    int64_t max_region_bytes; /* registered per principal */
    int64_t max_region_bytes_total; /* registered in all */
    int64_t staging_pool;           /* bytes of the inline path's buffers; 0: derived */
    char *metrics_listen; /* --metrics-listen ADDR: Prometheus /metrics and /healthz; NULL: off */
    char *metrics_token_file; /* --metrics-token-file FILE: /metrics needs the bearer token */
    int drain_timeout_s; /* --drain-timeout: calls still open this long after SIGTERM are cancelled
                          */
    char *tls_cert;      /* --tls-cert FILE (PEM chain), with tls_key; NULL: plaintext */
    char *tls_key;       /* --tls-key FILE */
    char *tls_client_ca; /* --tls-client-ca FILE: require client certificates it signed */
    char *auth_token_file; /* --auth-token-file FILE: calls need `authorization: Bearer <token>` */
    int log_level;         /* moed_log_level */
    char *log_file;        /* NULL: stderr */
    char *config_file;     /* --config FILE, or NULL */
} moed_config;

/* What moed_config_load found on the command line. */
enum { MOED_CONFIG_RUN = 0, MOED_CONFIG_EXIT = 1 };

/* Fills cfg from defaults, the config file and argv. Returns MOED_CONFIG_RUN, MOED_CONFIG_EXIT
 * after printing --help or --version to out, or MOED_EINVAL with err naming the bad flag or line.
 * cfg must be released with moed_config_free whatever the result. */
int moed_config_load(moed_config *cfg, int argc, char **argv, FILE *out, moed_error *err);
void moed_config_free(moed_config *cfg);

/* True when checkpoint layer `index` is to be served (always, without --layers). */
int moed_config_wants_layer(const moed_config *cfg, int index);

/* Parses a list such as "0-3,7" (layers, experts, devices) into an increasing array without
 * repeats (malloc'd, freed by the caller); MOED_EINVAL names the bad element. Shared with the
 * weights loader's syntax so `--layers` means the same for checkpoints and synthetic models. */
int moed_config_parse_layers(const char *list, int **out, int *n, moed_error *err);

#endif
