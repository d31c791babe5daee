/*
 * moedclient — the C client library of moed (libmoedclient): connect to a daemon, run Forward,
 * GetModel and grpc.health.v1 Check.
 *
 * This header is the whole public interface and stands alone: it includes only the C standard
 * library, and everything it names starts with moedc_ / MOEDC_. Link -lmoedclient.
 *
 * Contract:
 * - A moedc is one gRPC channel, and one TCP connection of its own (channels never share one, so a
 *   load generator opens N connections by opening N moedc). Any number of threads may call any
 *   function on one moedc at once; each call has its own gRPC call and completion queue.
 * - Two ways to call Forward. moedc_forward blocks until the reply. The asynchronous API keeps many
 *   calls in flight from one thread: moedc_forward_start on a moedc_queue, then moedc_queue_next
 *   hands back whichever call finished, and moedc_call_finish turns it into a result or an error.
 * - hidden is sent without being copied: it must stay valid and unchanged until moedc_forward or
 *   moedc_call_finish returns. Everything else in a request is copied by the start.
 * - Tensor regions (a caller on the server's host): memory shared with the server, registered once
 *   on a session (moedc_session_open), which requests then name instead of sending bytes
 *   (moedc_ref). A region lives as long as its session: closing the session, or the process
 *   ending, releases it on the server. A tensor in a region must stay unchanged, and an output
 *   region untouched, until the call finishes.
 * - Every function returns 0 or a negative MOEDC_E* code and fills err. For a call the server
 *   refused, err->code is moedc_code_from_grpc(status) and err->msg the server's status message
 *   verbatim, so moedc_code_to_grpc(err->code) gives the status back (for the few statuses moed
 *   never sends, the message starts with the status name, e.g. "ABORTED: ..."). Failures on this
 *   side (bad arguments, a malformed reply) are MOEDC_EINVAL / MOEDC_EFORMAT.
 * - Tensors are row-major and little-endian, as on the wire; the library builds only for
 *   little-endian hosts.
 *
 * Example (README.md has a whole program; client/c/cli/moectl.c is a complete tool):
 *
 *   moedc *c;
 *   moedc_error err;
 *   if (moedc_connect("127.0.0.1:50051", NULL, &c, &err)) die(err.msg);
 *   moedc_request req = { .layer = 0, .dtype = MOEDC_F32, .tokens = T, .d_model = d, .hidden = x,
 *                         .routing = MOEDC_ROUTE_LOGITS, .n_experts = E, .logits = logits,
 *                         .gating = { .strategy = MOEDC_GATE_TOPK, .top_k = 2 } };
 *   moedc_result res;
 *   if (moedc_forward(c, &req, &res, &err)) {
 *       int status = moedc_code_to_grpc(err.code);
 *       fprintf(stderr, "%s: %s\n", moedc_grpc_status_name(status), err.msg);
 *   } else {
 *       use(res.output, res.output_bytes);
 *       moedc_result_free(&res);
 *   }
 *   moedc_close(c);
 */
#ifndef MOEDCLIENT_H
#define MOEDCLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Marks the library's interface: the shared library is built with every other symbol hidden, so
 * these are all it exports. On Windows, define MOEDC_BUILDING_SHARED when building the DLL and
 * MOEDC_USING_SHARED when linking against it. */
#if defined(_WIN32)
#if defined(MOEDC_BUILDING_SHARED)
#define MOEDC_EXTERN __declspec(dllexport)
#elif defined(MOEDC_USING_SHARED)
#define MOEDC_EXTERN __declspec(dllimport)
#else
#define MOEDC_EXTERN
#endif
#elif defined(__GNUC__) && __GNUC__ >= 4
#define MOEDC_EXTERN __attribute__((visibility("default")))
#else
#define MOEDC_EXTERN
#endif

/* ---- errors ---- */

/* XX(name, value, description): the codes functions return, the daemon's own table (the values
 * are moed's, so a code means the same on both sides of the wire). */
#define MOEDC_ERR_MAP(XX)                                                                          \
    XX(OK, 0, "success")                                                                           \
    XX(EINVAL, -1, "invalid argument")                                                             \
    XX(ENOTFOUND, -2, "not found")                                                                 \
    XX(ETOOBIG, -3, "over the size limit")                                                         \
    XX(EFULL, -4, "queue full")                                                                    \
    XX(EDRAINING, -5, "server draining")                                                           \
    XX(EDEADLINE, -6, "deadline exceeded")                                                         \
    XX(ECANCELLED, -7, "cancelled")                                                                \
    XX(ENOMEM, -8, "out of memory")                                                                \
    XX(EIO, -9, "input/output error")                                                              \
    XX(EFORMAT, -10, "malformed file or message")                                                  \
    XX(EDEVICE, -11, "device error")                                                               \
    XX(ENODEV, -12, "no usable device")                                                            \
    XX(EUNSUPPORTED, -13, "not supported")                                                         \
    XX(EUNAUTH, -14, "unauthenticated")                                                            \
    XX(EUNAVAIL, -15, "unavailable")                                                               \
    XX(EINTERNAL, -16, "internal error")                                                           \
    XX(EPRECOND, -17, "failed precondition")

enum {
#define MOEDC_ERR_ENUM(name, value, text) MOEDC_##name = value,
    MOEDC_ERR_MAP(MOEDC_ERR_ENUM)
#undef MOEDC_ERR_ENUM
};

/* A code and the sentence that explains it to a person. */
typedef struct moedc_error {
    int code;
    char msg[480];
} moedc_error;

/* The table's description of a code ("unknown error" outside it). */
MOEDC_EXTERN const char *moedc_strerror(int code);
/* The gRPC status code (grpc_status_code's value) a code stands for, and the code a gRPC status
 * is reported as (MOEDC_OK for 0). */
MOEDC_EXTERN int moedc_code_to_grpc(int code);
MOEDC_EXTERN int moedc_code_from_grpc(int grpc_status);
/* "OK", "CANCELLED", ..., "UNAUTHENTICATED" (the gRPC names); "UNKNOWN" outside 0..16. */
MOEDC_EXTERN const char *moedc_grpc_status_name(int grpc_status);

/* ---- the protocol's enumerations (values as in proto/moed/v1/moed.proto) ---- */

/* moed.v1.DType: the activation and weight types. */
/* MOEDC_FP8 (block-scaled e4m3) is a weight dtype only: layers report it, requests never carry it.
 */
typedef enum moedc_dtype {
    MOEDC_F32 = 1,
    MOEDC_F16 = 2,
    MOEDC_BF16 = 3,
    MOEDC_FP8 = 5
} moedc_dtype;

/* moed.v1.Strategy: how router logits become a route; MODEL is the layer's own rule. */
enum {
    MOEDC_GATE_MODEL = 0,
    MOEDC_GATE_TOPK = 1,
    MOEDC_GATE_SIGMOID = 2,
    MOEDC_GATE_SPARSEMAX = 3,
    MOEDC_GATE_QUADRATIC = 4,
    MOEDC_GATE_PIONEER = 5,
};

/* moed.v1.Renormalize. */
enum { MOEDC_RENORM_DEFAULT = 0, MOEDC_RENORM_ON = 1, MOEDC_RENORM_OFF = 2 };

/* moed.v1.Activation and moed.v1.RouterRule. */
enum { MOEDC_ACT_SWIGLU = 1, MOEDC_ACT_GELU = 2, MOEDC_ACT_RELU = 3 };
enum { MOEDC_RULE_SOFTMAX_TOPK = 1, MOEDC_RULE_DEEPSEEK_V3 = 2 };

/* moed.v1.Gating; all zero: the layer's own rule. */
typedef struct moedc_gating {
    int strategy;    /* MOEDC_GATE_* */
    int top_k;       /* 0: the layer's top_k */
    int renormalize; /* MOEDC_RENORM_* */
    float threshold; /* SIGMOID, in (0, 1); 0: 0.5 */
} moedc_gating;

/* ---- channel ---- */

typedef struct moedc moedc;

/* How to reach the daemon. All zero (or opts NULL): plaintext, no token, no deadline.
 *
 * TLS is on when `tls` is set or any tls_* field is. Each tls_ca / tls_cert / tls_key is the path
 * of a PEM file or, when it starts with "-----BEGIN", the PEM text itself; files are read (and
 * checked to hold the PEM block they should) by moedc_connect, which fails with MOEDC_EINVAL and a
 * message naming the field and the file otherwise. The server's certificate is checked against
 * tls_ca, or without it against gRPC's default roots ($GRPC_DEFAULT_SSL_ROOTS_FILE_PATH, else the
 * roots.pem gRPC installs), for the target's host name or tls_server_name. */
typedef struct moedc_opts {
    double timeout_s;            /* default deadline of every call, seconds; 0: none */
    const char *bearer_token;    /* sent as "authorization: Bearer TOKEN"; NULL: none */
    bool tls;                    /* TLS even when no tls_* field is set */
    const char *tls_ca;          /* CA certificates the server's must chain to */
    const char *tls_cert;        /* client certificate (chain), for mutual TLS; needs tls_key */
    const char *tls_key;         /* its private key, unencrypted */
    const char *tls_server_name; /* the name the server's certificate must carry, when the
                                    target's host is not it (an IP address; for a unix: target
                                    gRPC checks "localhost") */
} moedc_opts;

/* Opens a channel to target ("host:port", "unix:/path", any gRPC target). gRPC connects lazily: an
 * unreachable server, or a failed TLS handshake, shows up as UNAVAILABLE on the first call. */
MOEDC_EXTERN int moedc_connect(const char *target, const moedc_opts *opts, moedc **out,
                               moedc_error *err);

/* Opens a fleet: several daemons that split the layers (moed --layers) and the experts of each
 * layer (moed --experts) between them, behind one moedc that every call of this header takes.
 * targets[0 .. n-1] each name a daemon; a "dns:" name that resolves to several addresses (a
 * Kubernetes headless Service) names one daemon per address. One channel per daemon; every
 * daemon's GetModel is asked now (for at most 5 s each), so what each holds is known: daemons
 * holding the same experts of a layer are replicas of a shard; the shards of a layer must be
 * disjoint and exactly one must add the shared experts, and the daemons must serve one model
 * (equal model_fingerprint), else MOEDC_EPRECOND naming the daemons. The fleet's model is then
 * fixed: a daemon found serving another later is left out. A daemon that does not answer is asked
 * again (at most once a second) when a call needs it, one that failed after 0.5 s doubling to 5 s
 * (a real connection attempt each time), and every daemon while a layer cannot be planned.
 *
 * A Forward goes to one replica of each shard of its layer at once (the one with the fewest calls
 * outstanding from this moedc); with MOEDC_ROUTE_EXPERTS a shard gets only the tokens with a pair
 * on an expert it holds (every token for the one adding the shared experts), and one that would
 * get none gets no call, so a shard that is down fails only the calls that need it. It states the
 * model and experts it expects of it (moed.proto's ForwardRequest.expect): a daemon restarted as
 * something else refuses it rather than add a wrong partial. A replica answering UNAVAILABLE
 * (draining, queue full, unreachable) is passed over for a while, and the call goes to the next
 * replica at once, as it does from one that refused; each replica once per call. A shard none of
 * whose replicas answered fails the call UNAVAILABLE (one refused: MOEDC_EPRECOND) naming the
 * layer, the experts and each daemon with what it said. The start of a call blocks while a daemon's
 * GetModel is asked, and a call that finds no daemon to try waits (within its deadline) for the
 * next one due to be asked again, and asks it, before it fails. The result is the shards' partial
 * outputs added in float32 in the order of each shard's lowest expert and rounded once to the
 * request's dtype (moed.proto's "Expert shards" bounds the cost in bf16 and f16; a token a shard
 * did not get adds the +0.0 it would have answered, so the sum's bits are those of every token sent
 * to every shard); its timings, request_id and expert_set are those of the slowest shard. With one
 * shard the reply is the result, as from one daemon. Batch gating over a layer split into several
 * shards is MOEDC_EPRECOND. moedc_info answers the fleet's model (each layer once, held: the
 * experts the daemons serving it hold between them; the smallest limits; every device; its
 * fingerprint); moedc_health SERVING when every layer has every expert on a SERVING daemon. A
 * region session and ListRegions need one daemon: MOEDC_EPRECOND. With n == 1 and a target that is
 * one daemon, this is moedc_connect. */
MOEDC_EXTERN int moedc_connect_many(const char *const *targets, int n, const moedc_opts *opts,
                                    moedc **out, moedc_error *err);
/* Closes the channel. Every call started on it must have been finished. */
MOEDC_EXTERN void moedc_close(moedc *c);

/* ---- Forward ---- */

/* ---- tensor regions ---- */

/* A region session: one moed.v1.Moed/Regions stream, the lease of the regions registered on it.
 * Its calls block (each command waits for its answer) and may come from any thread. */
typedef struct moedc_session moedc_session;

enum { MOEDC_REGION_HOST = 1, MOEDC_REGION_CUDA = 2 }; /* moed.v1.RegionKind */

/* A registered region (read-only for the caller). */
typedef struct moedc_region {
    uint64_t id;    /* the server's id, what requests name */
    int kind;       /* MOEDC_REGION_HOST or MOEDC_REGION_CUDA */
    void *ptr;      /* HOST: the region in this process; CUDA: the device pointer registered */
    size_t bytes;   /* the region's size */
    int device;     /* CUDA: this process's device ordinal */
    char name[256]; /* HOST: the shared-memory name it had (unlinked once the server mapped it) */
    moedc_session *session;
} moedc_region;

/* Opens a session on c's channel. The server checks it on the first command: a session from
 * another host (unless the server runs --regions any), or to a server with regions off, fails
 * there with MOEDC_EPRECOND. */
MOEDC_EXTERN int moedc_session_open(moedc *c, moedc_session **out, moedc_error *err);
/* Closes the rings still open on s (moedc_ring_close), frees every region still registered on s
 * and ends the session (the server releases them). */
MOEDC_EXTERN void moedc_session_close(moedc_session *s);

/* Creates `bytes` (at least 16) of POSIX shared memory, maps it, and registers it with the
 * server: the server maps the object by name and answers a challenge, which this writes at offset
 * 0 and confirms; then the name is unlinked (the memory lives on in both processes, and nothing is
 * left in /dev/shm if either dies). mode: the object's permission bits while the server opens it,
 * 0 for 0600 (the server runs as this user; 0660 for a group both share). The region's memory is
 * r->ptr, zeroed but for those 16 bytes. */
MOEDC_EXTERN int moedc_region_create_host(moedc_session *s, size_t bytes, unsigned mode,
                                          moedc_region **out, moedc_error *err);
/* Registers `bytes` of CUDA device memory from dev_ptr (cudaMalloc'd, by this process), sent as
 * a cudaIpcMemHandle_t of its allocation, the offset of dev_ptr in it and the GPU's UUID. The
 * client links no CUDA library: it asks the process's CUDA driver (libcuda.so.1, opened at the
 * first such call), so any CUDA runtime the program uses will do. MOEDC_EUNSUPPORTED where no
 * driver can be loaded (a machine without an NVIDIA driver), MOEDC_EINVAL for memory that is not
 * the device memory of this process. */
MOEDC_EXTERN int moedc_region_register_cuda(moedc_session *s, void *dev_ptr, size_t bytes,
                                            moedc_region **out, moedc_error *err);
/* Unregisters r and frees it (HOST: unmaps it here; CUDA: the memory stays the caller's). The
 * server unmaps it once no request holds it. */
MOEDC_EXTERN int moedc_region_free(moedc_region *r, moedc_error *err);

/* A tensor in a region: `offset` bytes into it (a multiple of the element size); its length is
 * the tensor's size. region NULL: the tensor travels inline, in the request. */
typedef struct moedc_ref {
    const moedc_region *region;
    uint64_t offset;
} moedc_ref;

/* How a request routes its tokens (the oneof of moed.v1.ForwardRequest). */
typedef enum moedc_routing {
    MOEDC_ROUTE_EXPERTS = 1, /* expert_ids [T, k] int32 + expert_weights [T, k] float32 */
    MOEDC_ROUTE_LOGITS = 2,  /* logits [T, n_experts] float32, gated by the server with gating */
    MOEDC_ROUTE_SERVER = 3,  /* the layer's router on the server, then gating */
} moedc_routing;

typedef struct moedc_request {
    const char *request_id; /* echoed in the result; NULL or at most 128 bytes */
    uint32_t layer;         /* the layer's index, as moedc_info lists it */
    int dtype;              /* MOEDC_F32, MOEDC_F16 or MOEDC_BF16: the output's dtype too */
    int64_t tokens;         /* T */
    int64_t d_model;
    const void *hidden; /* T x d_model elements of dtype; sent zero-copy (see the contract) */
    int routing;        /* moedc_routing */
    int k;              /* EXPERTS: columns of ids and weights (-1 with weight 0 pads) */
    const int32_t *expert_ids;   /* EXPERTS */
    const float *expert_weights; /* EXPERTS */
    int n_experts;               /* LOGITS: columns of logits */
    const float *logits;         /* LOGITS */
    moedc_gating gating;         /* LOGITS and SERVER */
    bool batch_gating;           /* batch-level dynamic gating (needs LOGITS or SERVER) */
    uint32_t k_batch;            /* its set size; 0: the layer's top_k */
    double timeout_s;            /* 0: the moedc's default; < 0: no deadline */
    /* Tensors in regions instead of inline (each ignores its pointer above when its region is
     * set), and where the output goes: into output_at's region, and the reply carries no bytes. */
    moedc_ref hidden_at, expert_ids_at, expert_weights_at, logits_at, output_at;
} moedc_request;

typedef struct moedc_timings {
    uint64_t queue_us, compute_us, total_us;
    uint32_t batch_tokens, batch_requests;
} moedc_timings;

typedef struct moedc_result {
    int dtype;               /* the request's dtype */
    int64_t tokens, d_model; /* the request's shape */
    const void *output;      /* tokens x d_model elements of dtype, owned by the result; with
                                output_at set, where it went in that region (a device pointer for
                                a CUDA region) */
    size_t output_bytes;
    const int32_t *expert_set; /* batch gating: the set S, by decreasing batch score */
    size_t n_expert_set;
    moedc_timings timings;
    const char *request_id; /* echoed by the server ("" if none) */
    void *priv;             /* the decoded reply that owns the memory above */
} moedc_result;

/* One Forward, blocking. On success fills res (release it with moedc_result_free). */
MOEDC_EXTERN int moedc_forward(moedc *c, const moedc_request *req, moedc_result *res,
                               moedc_error *err);
/* Releases what a result owns; safe on a zeroed or already released result. */
MOEDC_EXTERN void moedc_result_free(moedc_result *res);

/* ---- asynchronous calls ---- */

typedef struct moedc_queue moedc_queue; /* where finished calls are collected */
typedef struct moedc_call moedc_call;   /* one Forward in flight */

MOEDC_EXTERN int moedc_queue_create(moedc_queue **out, moedc_error *err);
/* Every call started on q must have been collected by moedc_queue_next and finished first. */
MOEDC_EXTERN void moedc_queue_destroy(moedc_queue *q);

/* Starts a Forward whose completion will be delivered on q; user is returned by moedc_call_user.
 * On failure nothing was started and *out is NULL. One queue may be used by several threads. */
MOEDC_EXTERN int moedc_forward_start(moedc *c, const moedc_request *req, moedc_queue *q, void *user,
                                     moedc_call **out, moedc_error *err);
/* Waits up to timeout_s (< 0: for ever) for a call started on q to finish. Returns 1 and sets *out
 * when one did, 0 on timeout. */
MOEDC_EXTERN int moedc_queue_next(moedc_queue *q, double timeout_s, moedc_call **out);
MOEDC_EXTERN void *moedc_call_user(const moedc_call *call);
/* Asks the server to drop the call; it still finishes through its queue (as CANCELLED, unless the
 * reply was already on its way). May run while another thread waits in moedc_queue_next, but not
 * after the call was finished. */
MOEDC_EXTERN void moedc_call_cancel(moedc_call *call);
/* Turns a finished call (from moedc_queue_next) into a result or an error, and frees the call. */
MOEDC_EXTERN int moedc_call_finish(moedc_call *call, moedc_result *res, moedc_error *err);

/* ---- the doorbell: calls through a ring in shared memory ---- */

/* A ring (moed.proto's RegisterRing): call slots in shared memory on a region session, through
 * which a caller on the server's host makes a Forward without a message: it writes the call into a
 * slot and rings, the server computes it like any other call (merged with gRPC calls alike), and
 * writes the completion into the slot. Every tensor of a ring call is in a registered region (host
 * or CUDA), routing is the caller's expert choices, and the output goes into a region.
 *
 * Two ways to call:
 * - from the host: moedc_ring_start, then moedc_ring_wait (it spins a while, then sleeps);
 * - on a CUDA stream: moedc_ring_enqueue writes the call now and puts the doorbell and the wait for
 *   its completion on the caller's stream (cuStreamWriteValue32 / cuStreamWaitValue32), so work
 *   queued after it on the stream sees the output. A stream being captured into a CUDA graph
 *   captures that too: each replay of the graph makes the same call again. A captured call keeps
 *   its slot until moedc_ring_release; a call enqueued on a stream that is not capturing frees its
 *   slot by itself once the stream has passed it.
 *
 * Slots: a slot holds one call at a time and is free again when its call is over: a host call once
 * moedc_ring_wait returned its completion, a stream call once the stream passed it, a captured call
 * once released. When no slot is free, start and enqueue answer MOEDC_EFULL at once (nothing
 * waits): wait for a call, or open the ring with more slots. A caller that never waits its calls
 * fills its own ring and nothing else.
 *
 * Failures: a call's own failure (a bad reference, a deadline, the server draining) is its status.
 * A ring whose server closed it (the session ended, unregistered, or the daemon stopped) or whose
 * session's stream ended (the daemon died, the connection dropped) is dead: the library completes
 * the caller's calls still in it as UNAVAILABLE itself, so no host waiter and no stream waits for
 * ever, and later starts and enqueues answer MOEDC_EUNAVAIL. After a daemon died or a connection
 * dropped, a call that daemon had taken may still be written by it if it lives: the output region
 * is the server's until every call naming it is over (moedc_region_free's event says when).
 * A graph that replays stream calls checks moedc_ring_failures after synchronising: it counts the
 * ring's calls that completed with a status other than OK, those the library completed included.
 *
 * Threads: any number of threads may start, enqueue, wait and release on one ring at once (each
 * ticket waited for by one thread); moedc_ring_close must come after every other call on the ring
 * has returned. Each ring has a watchdog thread of its own, which looks every 2 ms whether the
 * ring is still served.
 *
 * Without a CUDA driver the host calls work as everywhere (host regions), and stream calls answer
 * MOEDC_EUNSUPPORTED saying why: the library links no CUDA library (moedc_region_register_cuda). */
typedef struct moedc_ring moedc_ring;

/* One Forward through a ring: expert choices (padding: id -1 with weight 0) and every tensor in a
 * region of the ring's principal (hidden [tokens, d_model] of dtype, expert_ids [tokens, k] int32,
 * expert_weights [tokens, k] float32, output [tokens, d_model] of dtype). */
typedef struct moedc_ring_call {
    uint32_t layer;
    int dtype; /* MOEDC_F32, MOEDC_F16 or MOEDC_BF16 */
    int64_t tokens, d_model;
    int k;
    moedc_ref hidden, expert_ids, expert_weights, output; /* region set in each */
    double timeout_s; /* the server's deadline, counted from when it takes the call; 0: the moedc's
                         default; < 0: none */
    uint64_t tag;     /* the caller's, in the server's logs */
} moedc_ring_call;

/* A call in a ring: its slot and its ticket (the number that rang it). */
typedef struct moedc_ring_ticket {
    uint32_t slot, ticket;
} moedc_ring_ticket;

typedef struct moedc_ring_result {
    int status;            /* MOEDC_OK or the call's failure as a code (moedc_code_from_grpc) */
    char message[224];     /* why, when status is not OK */
    moedc_timings timings; /* total_us: from the start to the completion seen (host calls) */
} moedc_ring_result;

/* Opens a ring of `slots` (1 .. 4096) on session s: shared memory of its own, registered as a host
 * region of s, the ring's header written, and the ring registered with the server (MOEDC_EPRECOND
 * from a server without the doorbell, or RESOURCE_EXHAUSTED as MOEDC_ETOOBIG over its rings per
 * principal). A ring lives until moedc_ring_close or the session's close. */
MOEDC_EXTERN int moedc_ring_open(moedc_session *s, uint32_t slots, moedc_ring **out,
                                 moedc_error *err);
/* Rings a call from the host into a free slot; *t is the ticket to wait for. MOEDC_EINVAL for a
 * call that does not describe its tensors (a region missing, sizes that overflow or run past their
 * region), MOEDC_EFULL when no slot is free, MOEDC_EUNAVAIL on a dead ring. */
MOEDC_EXTERN int moedc_ring_start(moedc_ring *r, const moedc_ring_call *call, moedc_ring_ticket *t,
                                  moedc_error *err);
/* Waits up to timeout_s (< 0: for ever) for the host call t. Returns 1 when it completed (res
 * filled; the ticket is used up and its slot free), 0 when timeout_s passed first (it is still in
 * flight: wait again), MOEDC_EINVAL for a ticket that is not a host call in flight on r. */
MOEDC_EXTERN int moedc_ring_wait(moedc_ring *r, const moedc_ring_ticket *t, double timeout_s,
                                 moedc_ring_result *res, moedc_error *err);
/* Enqueues a call on cuda_stream (a CUstream or cudaStream_t; NULL: the legacy default stream) of
 * the current or any context: the call is written now, and the stream rings it and waits for its
 * completion. Tensors in CUDA regions are read and written by the server in stream order only
 * through this wait: work enqueued before the call is finished before it is rung, work after it
 * starts after the completion. *t names the call (for moedc_ring_release and
 * moedc_ring_stream_result). MOEDC_EUNSUPPORTED without a CUDA driver (or one older than CUDA
 * 11.7); otherwise as moedc_ring_start, and MOEDC_EDEVICE naming the driver call that failed. */
MOEDC_EXTERN int moedc_ring_enqueue(moedc_ring *r, const moedc_ring_call *call, void *cuda_stream,
                                    moedc_ring_ticket *t, moedc_error *err);
/* The completion of stream call t as the ring holds it: its status, message and the server's
 * timings (a captured call: its latest replay's). Returns 1 once the stream passed the call (after
 * synchronising it), 0 while it has not, MOEDC_EINVAL once the slot holds another call. */
MOEDC_EXTERN int moedc_ring_stream_result(moedc_ring *r, const moedc_ring_ticket *t,
                                          moedc_ring_result *res, moedc_error *err);
/* Frees the slot of the captured call t, for a graph that will not be launched again and whose
 * launches have all finished (destroy the graph's executable first). MOEDC_EINVAL for a ticket
 * that is not a captured call of r. */
MOEDC_EXTERN int moedc_ring_release(moedc_ring *r, const moedc_ring_ticket *t, moedc_error *err);
/* The ring's calls completed with a status other than OK so far (wrapping at 2^32). */
MOEDC_EXTERN uint32_t moedc_ring_failures(const moedc_ring *r);
/* Unregisters the ring and frees its memory. Every host call must have been waited for, every
 * stream that enqueued calls synchronised, and every graph that captured some destroyed. */
MOEDC_EXTERN void moedc_ring_close(moedc_ring *r);

/* ---- links: Forwards whose tensors move over NCCL ---- */

/* Links (moed.proto's OpenLink; docs/fleets.md, "Over NCCL"): a caller whose tensors are on a GPU
 * makes its Forwards over NCCL, GPU to GPU, instead of gRPC. c is one daemon or a fleet: a link
 * per daemon the calls need (one replica of each shard of each layer; another replica, or the same
 * daemon again, is linked when one fails), each a region session, a two-rank communicator (the
 * daemon rank 0, this process rank 1 on opts.device) and buffers on that device.
 *
 * A call (moedc_links_forward) routes its tokens as the fleet does (the caller's expert choices:
 * each shard gets the tokens with a pair on an expert it holds, moedc_connect_many; or every token,
 * opts.send), sends each shard its rows and adds the shards' partial outputs on the GPU by the
 * fleet's rule, so the output is bit for bit the one moedc_forward gives for the same daemons.
 * Everything runs on the caller's stream after the work queued there before; the call blocks until
 * the output is written.
 *
 * Failures: a call not answered within opts.timeout_s fails MOEDC_EUNAVAIL naming each daemon that
 * did not answer and its experts; those links are aborted (which frees the stream) and linked
 * again by a later call. A daemon's refusal fails the call with its code and message, naming it.
 * A failed call never writes output (so output may be hidden itself, and the caller may make the
 * call again over gRPC).
 *
 * Where links cannot be used, moedc_links_open fails and the caller keeps gRPC: MOEDC_EUNSUPPORTED
 * without NCCL (libnccl.so.2, or the one MOED_NCCL_LIB names), without a CUDA driver, with a daemon
 * whose NCCL is another major.minor than this process's (naming both), or from a build without
 * nvcc (the kernels are compiled at build time); a daemon's refusal of open_link with its code.
 *
 * Threads: one call at a time on a moedc_links (others wait). Close the links before c. */
typedef struct moedc_links moedc_links;
typedef struct moedc_links_opts {
    int device;          /* the caller's CUDA ordinal: where its tensors are */
    uint32_t max_tokens; /* the largest T of a call */
    uint32_t max_top_k;  /* the largest k (<= 64) */
    double timeout_s; /* a call not answered within it fails UNAVAILABLE naming the daemons that did
                         not answer; 0: 30 */
    int send;         /* which tokens a fleet's call sends each shard: MOEDC_LINKS_SEND_* */
} moedc_links_opts;
/* opts.send. CHOSEN: each shard only the tokens with a pair on an expert it holds, which needs the
 * call's expert choices on the host: the call waits for the caller's stream to reach it, reads
 * them and plans (at T = 4096 over three shards on H200s, 0.55 ms of the call). ALL: every shard
 * every token (a shard's partial for a token it holds no expert of is +0.0, so the output's bits
 * are the same), nothing read on the host. AUTO (0): ALL where the bytes CHOSEN would save are
 * few, CHOSEN otherwise (moedc_plan_sends_all: when the layer's shards, under uniform routing,
 * would skip under a quarter of the tokens on average). A captured call always sends ALL. */
enum { MOEDC_LINKS_SEND_AUTO = 0, MOEDC_LINKS_SEND_CHOSEN = 1, MOEDC_LINKS_SEND_ALL = 2 };
MOEDC_EXTERN int moedc_links_open(moedc *c, const moedc_links_opts *o, moedc_links **out,
                                  moedc_error *err);
typedef struct moedc_link_call {
    uint32_t layer;
    int dtype; /* MOEDC_F32, MOEDC_F16 or MOEDC_BF16: hidden's and the output's */
    int64_t tokens, d_model;
    int k;
    const void *hidden;          /* device pointers on opts.device: [T, d_model] of dtype */
    const int32_t *expert_ids;   /* [T, k] (-1 with weight 0 pads) */
    const float *expert_weights; /* [T, k] */
    void *output;                /* [T, d_model] of dtype; may be hidden itself */
    void *stream; /* the caller's CUstream / cudaStream_t; NULL: the legacy default stream */
} moedc_link_call;
/* Blocking: returns once the output is written (work the caller queued on `stream` before is done
 * first). t (may be NULL): the slowest shard's timings, total_us the call's.
 *
 * Captured: when `stream` is being captured into a CUDA graph, the call is recorded and returns at
 * once (t zeroed), and each replay of the graph makes it again: each link counts its calls on the
 * device, so every replay is a call of its own to the daemons, answered as any other. A captured
 * call sends every shard every token (the choices of a replay are not known at capture; the sum,
 * and so the output's bits, are the same), and needs the layer's links open (a call of the layer
 * outside the capture opens them again after a failure). A replay whose reply is missing, refused
 * or out of step writes no output and is counted in moedc_links_failures; a watchdog thread aborts
 * the links of a daemon whose session ended, so a replay never waits on a daemon that is gone.
 * Calls on one moedc_links must be ordered with each other (one stream, or synchronised): they
 * share each link's messages. Destroy the graphs before moedc_links_close, which waits for NCCL to
 * release their communicators and then frees the buffers they use. */
MOEDC_EXTERN int moedc_links_forward(moedc_links *l, const moedc_link_call *call, moedc_timings *t,
                                     moedc_error *err);
/* Calls, captured replays and blocking calls alike, whose output was not written because a reply
 * was missing, refused or out of step when they were combined (a blocking call that failed before
 * its messages were posted is not among them), since open; read after synchronising the stream
 * that ran them. */
MOEDC_EXTERN int moedc_links_failures(moedc_links *l, uint64_t *count, moedc_error *err);
/* A line for logs: "nccl 2.27.3: 3 links (daemons a, b, c)", or why links are not used. */
MOEDC_EXTERN const char *moedc_links_describe(const moedc_links *l);
/* Closes every link (close_link, the communicator aborted) and frees l; NULL is a no-op. */
MOEDC_EXTERN void moedc_links_close(moedc_links *l);

/* ---- model information and health ---- */

/* Experts first .. last, both included (moed.v1.ExpertRange). */
typedef struct moedc_expert_range {
    int first, last;
} moedc_expert_range;

/* Experts first .. last on device `device`, an index into moedc_model_info.devices
 * (moed.v1.ExpertPlacement). */
typedef struct moedc_expert_place {
    int first, last, device;
} moedc_expert_place;

/* An extra copy of expert `expert` on device `device` (moed.v1.LayerInfo.expert_replicas: an
 * ExpertPlacement with first == last). */
typedef struct moedc_expert_copy {
    int expert, device;
} moedc_expert_copy;

/* moed.v1.LayerInfo: one resident layer. */
typedef struct moedc_layer_info {
    int index; /* what requests name */
    int d_model;
    int d_ff; /* per routed expert */
    int n_experts;
    int top_k;
    int act;         /* MOEDC_ACT_* */
    int wdtype;      /* moedc_dtype of the weights */
    bool has_router; /* the server can compute logits (MOEDC_ROUTE_SERVER) */
    bool norm_topk;  /* top-k weights renormalised */
    int rule;        /* MOEDC_RULE_*: what MOEDC_GATE_MODEL does */
    int n_group;     /* DeepSeek-V3 group-limited routing; 1 when not grouped */
    int topk_group;
    float routed_scale; /* routed_scaling_factor; 1 when absent */
    int n_shared;       /* shared experts, applied to every token with weight 1 */
    int shared_d_ff;    /* their total width */
    /* The experts whose terms the daemon computes (moed --experts: an expert shard), as
     * increasing ranges; every expert, [0, n_experts - 1], unless it holds a shard. */
    moedc_expert_range *held;
    int n_held;
    bool adds_shared; /* its replies include the shared experts' term */
    /* Where the layer lives on the daemon's devices: the home device (router, shared experts,
     * where its calls run) and the held experts' devices as increasing ranges, over several
     * devices when its experts are split (moed --expert-parallel). No ranges from a moed older than
     * these fields, nor in a fleet's merged moedc_model_info (each daemon's numbers its own). */
    int home_device;
    moedc_expert_place *placed;
    int n_placed;
    /* Every routed expert's matrices are 2:4 sparse, the zeros part of the weights served (moed
     * --weights sparse24, or a compressed-tensors 2:4 checkpoint); false from an older moed. */
    bool sparse24;
    /* Extra copies of hot experts of a split layer, by expert then device, and the re-placements
     * by measured load applied so far (moed --rebalance; 0: the placement made at load). None and
     * 0 from a moed older than these fields, and in a fleet's merged moedc_model_info. */
    moedc_expert_copy *replicas;
    int n_replicas;
    uint32_t placement_generation;
} moedc_layer_info;

typedef struct moedc_device {
    char *name; /* "cpu" or the GPU's name */
    uint64_t memory_total, memory_used;
} moedc_device;

/* How far a daemon still loading its weights has come (moed.proto's LoadProgress): the phase in
 * hand ("reading", "generating", "placing"), its layers and bytes, and its percent, rate and time
 * left. */
typedef struct moedc_load_progress {
    char phase[16];
    int phase_number, phases;
    int layer; /* the layer in hand; -1 between layers */
    int layers_done, layers_total;
    uint64_t bytes_done, bytes_total; /* bytes_total 0: the phase counts layers only */
    double percent, elapsed_s, bytes_per_s;
    double eta_s; /* < 0: not known yet */
} moedc_load_progress;

typedef struct moedc_model_info {
    char *model;   /* the checkpoint folder, or the synthetic spec */
    char *backend; /* "cpu" or "cuda" */
    char *version;
    int n_layers;
    moedc_layer_info *layers;
    int n_devices;
    moedc_device *devices;
    uint64_t max_message_bytes;
    uint32_t max_batch_tokens; /* the most tokens one request may carry */
    /* tensor regions: "off", "local" (callers on the server's host) or "any"; the caps */
    char *regions_mode;
    uint32_t max_regions;
    uint64_t max_region_bytes, max_region_bytes_total;
    bool cuda_regions; /* the server takes CUDA regions (its cuda backend) */
    /* the model's identity: equal on every daemon serving the same model (0: a moed older than
     * it; moed.proto's ModelInfo.model_fingerprint) */
    uint64_t model_fingerprint;
    /* true while the daemon loads its weights (health NOT_SERVING): `loading` says how far it has
     * come, and model, backend, devices, version and max_message_bytes are all else there is */
    bool is_loading;
    moedc_load_progress loading;
} moedc_model_info;

/* GetModel. Release with moedc_model_info_free. */
MOEDC_EXTERN int moedc_info(moedc *c, moedc_model_info *out, moedc_error *err);
MOEDC_EXTERN void moedc_model_info_free(moedc_model_info *m);

/* moed.v1.Region: one of the caller's regions, as the server holds it. */
typedef struct moedc_region_info {
    uint64_t id;
    int kind; /* MOEDC_REGION_HOST or MOEDC_REGION_CUDA */
    char name[256];
    uint64_t bytes;
    int device;        /* CUDA: the server's ordinal */
    bool ready;        /* usable (HOST: confirmed) */
    bool broken;       /* HOST: it shrank under the server */
    uint32_t requests; /* references requests hold on it now (one per tensor naming it) */
} moedc_region_info;

/* ListRegions: the regions of the caller's token, from every session. *out is malloc'd (free()
 * it), *n entries. */
MOEDC_EXTERN int moedc_list_regions(moedc *c, moedc_region_info **out, int *n, moedc_error *err);

/* Values of grpc.health.v1.HealthCheckResponse.ServingStatus. */
enum {
    MOEDC_HEALTH_UNKNOWN = 0,
    MOEDC_HEALTH_SERVING = 1,
    MOEDC_HEALTH_NOT_SERVING = 2,
    MOEDC_HEALTH_SERVICE_UNKNOWN = 3,
};

/* grpc.health.v1.Health/Check of service ("" or NULL: the server as a whole) into *status. */
MOEDC_EXTERN int moedc_health(moedc *c, const char *service, int *status, moedc_error *err);
/* "SERVING", "NOT_SERVING", "UNKNOWN", "SERVICE_UNKNOWN". */
MOEDC_EXTERN const char *moedc_health_name(int status);

#ifdef __cplusplus
}
#endif

#endif
