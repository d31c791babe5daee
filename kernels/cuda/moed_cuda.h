/*
 * moed_cuda — the launch API of the CUDA kernels, called from the C host code of the CUDA backend
 * (cuda_*.c, pipeline.c) and from the kernel benchmarks. Each op lives in its own .cu file with its
 * launcher; every launcher is asynchronous on the given stream and returns 0 or a MOED_E* code
 * (MOED_EDEVICE when the launch itself fails).
 *
 * The pipeline for one batch, all on one stream, with no device-to-host synchronisation:
 *   route choice (route_choice.cu): where a client keeps its choice in device memory, checks it
 *                                and packs it into the route's slots, before the pipeline proper;
 *   route prep (route_prep.cu):  per-expert counts → offsets → the sorted (expert, token) rows and
 *                                the list of m-tiles (expert, first row) the GEMMs walk;
 *   convert (convert.cu):        hidden [T, d] in f32/f16/bf16 → X [T, d_pad] in the compute type;
 *   up GEMM (gemm_*.cu):         H[s] = act(X[token(s)] · W13_e^T) — rows gathered in the A load,
 *                                SwiGLU/GELU/ReLU in the epilogue;
 *   down GEMM:                   Y[s] = H[s] · W2_e^T;
 *   combine (combine.cu):        out[t] = Σ_j w_j · Y[slot(t, j)] in route order (+ shared
 * experts), converted to the request's dtype. Every sorted row s is computed alone: its result
 * never depends on where it lands in a tile, so a token's output never depends on the other tokens
 * of the batch.
 *
 * Padding: d and d_ff are padded to multiples of MOED_CUDA_PAD with zeros (weights and X), which
 * adds exact zeros, so the GEMMs have no K or N edge cases; only M (rows per expert) is ragged.
 * SwiGLU weights are stored as one matrix W13 [2·ff_pad, d_pad] that interleaves W1 and W3 in
 * blocks of MOED_CUDA_GLU_BLOCK rows (gate block j, then up block j), so an N tile holds matching
 * gate and up columns and the epilogue can multiply them in registers.
 *
 * FP8 layers (block-scaled e4m3, moed_fp8.h) keep the checkpoint's e4m3 codes in the same layout,
 * one byte an element, and their scales in tables of float32 [K/128][rows/MOED_CUDA_FP8_SROWS] (a
 * scale per 32 rows of the padded, interleaved matrix and per 128-deep K block: the checkpoint's
 * 128 x 128 block that holds them, 0 for padding rows). On Hopper (tile_config.c decides) they run
 * on the FP8 Tensor Cores: the convert stage quantizes each token's row per 128 channels (e4m3 and
 * a scale per group, quant_fp8.cu), the up GEMM writes H in bf16, H is quantized the same way, and
 * gemm_fp8_sm90.cu promotes the products through both scales every 128 of K. Elsewhere the
 * portable GEMM dequantizes the weights as it loads them and multiplies bf16. The combine is the
 * same for both, so merged requests stay bit-identical to the same requests alone.
 *
 * 2:4 sparse layers (moed_layer_info.sparse24, bf16/f16 compute) keep their routed experts'
 * matrices compressed (sp24_pack.c), after the same padding and interleaving as dense ones, so
 * padding stays groups of zeros: per [n, k] matrix the kept values [n, k/2] (the two of each group
 * of four along K, in order) and 2-bit metadata, n·k/8 bytes, 0.5625 of the dense bytes in all.
 * The metadata is laid out as mma.sp m16n8k32's fragments read it, one uint2 a lane per 16 rows
 * and 128 of K (sp24_pack.c writes it). Four groups (16 of K) of one row take 16 bits: the
 * index of each group's first kept value in its low two bits, of its second (the greater) in the
 * high two, group q at bits 4q. An mma.sp (16 rows, 32 of K) takes from threads 2·sel and 2·sel+1
 * of each four (sel: its sparsity selector) one 32-bit word each: thread 2·sel + h holds K 16h ..
 * 16h+15 of row g (low half) and of row g + 8 (high half), g = lane / 4. So for rows 16·rb ..
 * 16·rb+15 and K block kb (128 deep), the uint2 of lane 4g + t at word ((rb·(k/128) + kb)·32 +
 * lane)·2 holds in word j the K step 2j + (t >> 1) (run under selector t >> 1), half t & 1: one
 * 8-byte load a lane serves the block's four K steps. The
 * kernels (gemm_sp_sm80.cu on mma.sp, gemm_sp_sm90.cu on wgmma.sp, which reads the same layout:
 * wgmma.sp takes each warp's metadata as mma.sp m16n8k32 does) run them on the Sparse Tensor Cores
 * with the weights as the sparse A operand, C^T = W · X^T; the shared experts stay dense.
 */
#ifndef MOED_CUDA_H
#define MOED_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOED_CUDA_PAD       128
#define MOED_CUDA_GLU_BLOCK 32
#define MOED_CUDA_FP8_K     128 /* the K depth of a scale block (moed_fp8.h's block) */
#define MOED_CUDA_FP8_SROWS 32  /* weight rows per scale in the kernels' tables */

/* Bytes of one compute-type element: bf16 and f16 alike, so workspaces sized before any layer's
 * type is known fit either. */
#define MOED_CUDA_CSIZE 2

static inline size_t moed_cuda_cbytes(int64_t n)
{
    return (size_t)n * MOED_CUDA_CSIZE;
}

typedef struct CUstream_st *moed_cuda_stream;

enum {
    MOED_CUDA_EPI_SWIGLU = 1,
    MOED_CUDA_EPI_GELU = 2,
    MOED_CUDA_EPI_RELU = 3,
    MOED_CUDA_EPI_STORE = 4
};

/* Device arrays of one batch's route; the first four are inputs, the rest route prep writes. A
 * pair whose expert is E is a null pair (a slot of a device-routed token that holds padding or a
 * refused pair, route_choice.cu), of weight 0: no GEMM computes a row for it, and route prep points
 * it at null_row, a row of Y that holds zeros and that no kernel writes, so the combine adds 0 · 0
 * = +0 for it — and adding +0 leaves a sum's bits as they were (the combine's sums start at +0 and
 * never become -0: round to nearest gives -0 only for -0 + -0), so a null pair is exactly an
 * absent one, with no test for it in the combine. A route without null pairs runs as it always
 * did. */
typedef struct moed_cuda_route_dev {
    int32_t T, P, E;
    const int32_t *tok_off;  /* [T+1] pairs of token t: tok_off[t] .. tok_off[t+1]-1 */
    const int32_t *pair_tok; /* [P] */
    const int32_t *pair_exp; /* [P] in [0, E] */
    const float *pair_w;     /* [P] */
    int32_t *exp_off;        /* [E+1] first sorted row of each expert; exp_off[E]: rows in use */
    int32_t *cursor;         /* [E+1] scratch */
    int32_t *slot_tok;       /* [P] token of sorted row s (null pairs' rows follow the others') */
    int32_t *pair_slot;      /* [P] sorted row of pair p (null_row for a null pair) */
    int32_t *tile_exp;       /* [max_tiles] expert of m-tile i */
    int32_t *tile_row;       /* [max_tiles] first sorted row of m-tile i */
    int32_t *n_tiles;        /* [1] m-tiles in use */
    int32_t bm;              /* rows per m-tile */
    int32_t max_tiles;       /* capacity of tile_exp/tile_row: ceil(P/bm) + min(E, P) */
    int32_t null_row;        /* set by the caller of a route with null pairs (see above) */
} moed_cuda_route_dev;

/* Upper bound on the m-tiles of P pairs over E experts with bm rows per tile. */
static inline int32_t moed_cuda_route_max_tiles(int32_t P, int32_t E, int32_t bm)
{
    return (P + bm - 1) / bm + (E < P ? E : P);
}

int moed_cuda_route_prep(const moed_cuda_route_dev *r, moed_cuda_stream s);

/* The server router (router.cu): logits [T, E] float32 = x [T, d] (xdtype) · w [E, d]^T (wdtype),
 * both MOED_F32/F16/BF16 as stored; each logit one chain of fused multiply-adds in k order from 0,
 * bit-identical to the CPU backend's. */
int moed_cuda_router_logits(const void *x, int xdtype, int64_t T, int d, const void *w, int wdtype,
                            int E, float *logits, moed_cuda_stream s);

/* x [T, d] of dtype (MOED_F32/F16/BF16) → xc [T, d_pad] of cdtype (MOED_BF16/F16), zero padded. */
int moed_cuda_convert_in(const void *x, int dtype, int64_t T, int d, void *xc, int cdtype,
                         int d_pad, moed_cuda_stream s);

/* out[t, :d] (dtype) = Σ_j pair_w[j] · y[pair_slot[j], :d] over the token's pairs in order, plus
 * ys[t, :d] when ys is not NULL; y and ys are [*, d_pad] of cdtype. Below 256 tokens it starts
 * early, as MOED_CUDA_OVERLAP_WEIGHTS below: y and ys may still be being written by the kernel
 * before it on the stream, the route's arrays may not. */
int moed_cuda_combine(const moed_cuda_route_dev *r, const void *y, const void *ys, int cdtype,
                      int d, int d_pad, void *out, int dtype, moed_cuda_stream s);

/* Parts a split layer's combine adds (moed_cuda_pipeline_routed below). */
#define MOED_CUDA_MAX_PARTS 16

/* out[t, :d] (dtype) = Σ_q rows[row[q·T + t], :d] over the parts q < n_parts in order (a -1 row
 * left out), plus ys[t, :d] when ys is not NULL, summed in fp32 and rounded once; rows are fp32
 * [*, d], ys [*, d_pad] of cdtype. */
int moed_cuda_combine_parts(const int32_t *row, int n_parts, int64_t T, const float *rows,
                            const void *ys, int cdtype, int d, int d_pad, void *out, int dtype,
                            moed_cuda_stream s);

/* How a launch may overlap the kernel before it on the same stream (programmatic dependent launch,
 * sm_90 and newer; on older GPUs every launch waits for the one before). The batch's kernels run
 * back to back, so a launch that waits plainly leaves the SMs idle while it starts and while the
 * kernel before drains its last CTAs. */
enum {
    MOED_CUDA_OVERLAP_NONE = 0,   /* starts once everything before it on the stream has finished */
    MOED_CUDA_OVERLAP_LAUNCH = 1, /* may start early, but reads nothing before that kernel ends */
    /* may start early and load weights (and read the m-tile tables) at once: only A, and what it
     * writes, wait. The tables must be route prep's, finished before the kernel before started:
     * every kernel lets the next start only once it has passed its own wait, so route prep two
     * launches back has finished by then. */
    MOED_CUDA_OVERLAP_WEIGHTS = 2
};

/* One grouped GEMM over the m-tiles of a route: for each tile (expert e, rows r0 .. r0+bm-1, cut
 * at row_end), C[r] = epilogue(A[row(r)] · B_e^T) for the tile's rows and every N column. */
typedef struct moed_cuda_gemm {
    int cdtype;    /* MOED_BF16 or MOED_F16: the element type of C, and of A and B unless FP8 */
    const void *a; /* A rows, lda elements apart */
    int64_t lda;
    /* FP8 B (b_scale set): e4m3 codes, scales [k/128][b_experts·n/MOED_CUDA_FP8_SROWS]. FP8 A
     * (a_scale set, Hopper only): e4m3 rows, scale of A row i in K block j at a_scale[j·ld + i]. */
    const float *b_scale;
    const float *a_scale;
    int64_t a_scale_ld;
    const int32_t *a_rows; /* gather: A row of sorted row r is a_rows[r]; NULL: r itself */
    int64_t a_rows_total;  /* rows of A that exist (loads past it are zero-filled) */
    const void *b;         /* expert e's [n, k] matrix starts at b + e·b_estride elements */
    int64_t b_estride;     /* = n·k: the experts are contiguous (the TMA path maps them as one) */
    /* 2:4 sparse B (gemm_sp_sm80.cu): b holds the kept values, [n, k/2] an expert (b_estride =
     * n·k/2), and b_meta their metadata, n·k/32 words an expert; NULL for dense B */
    const uint32_t *b_meta;
    int32_t b_experts;
    int n, k; /* multiples of MOED_CUDA_PAD */
    void *c;  /* C rows, ldc elements apart */
    int64_t ldc;
    int64_t c_rows; /* rows of C (the Hopper kernels' TMA stores are bounded by them) */
    int epi;        /* MOED_CUDA_EPI_*; SWIGLU writes n/2 columns */
    /* The m-tiles: from route prep (tile_exp, tile_row, n_tiles, exp_off) or, when tile_exp is
     * NULL, `identity_rows` rows of expert 0 in order (shared experts). */
    const int32_t *tile_exp, *tile_row, *n_tiles, *exp_off;
    int32_t max_tiles;
    int32_t identity_rows;
    int32_t bm;
    int overlap; /* MOED_CUDA_OVERLAP_*, honoured by the portable kernel (the Hopper ones start
                  * plainly) */
} moed_cuda_gemm;

/* The kernel family and tile shape chosen by the heuristic table (tile_config.c). */
typedef struct moed_cuda_tile_cfg {
    int kernel; /* MOED_CUDA_KERNEL_SM80 (mma.sync), _SM90 (wgmma + TMA), _SM90_FP8 (e4m3 wgmma),
                 * _SM80_SP (mma.sp on 2:4 sparse weights), _SM90_SP (wgmma.sp on them) */
    int bm, bn;
    int gather; /* up projection: gather token rows in the A load (1) or pre-permute them (0) */
    int gather_policy; /* the Hopper kernels' gathered rows: MOED_CUDA_GATHER_* */
    int cluster; /* _SM90: CTAs a cluster along M (1 or 2), sharing weight tiles by multicast */
} moed_cuda_tile_cfg;
/* How a Hopper kernel's gathering producer thread (producer_sm90.cuh) completes a stage with its
 * cp.async copies:
 *   LAG_TILE  it waits for its copies STAGES - 2 stages after issuing them, fences the proxies and
 *             arrives on the stage's barrier; a tile's last stages at the tile's end
 *   LAG_RUN   the same lag counted across tiles, so a tile's first stages never wait for the last
 *             ones of the tile before
 *   ARRIVE    the copies arrive on the barrier once landed (cp.async.mbarrier.arrive.noinc): no
 *             thread waits, every stage of the ring is in flight as with TMA, and each consumer
 *             fences the proxies after its wait instead (cp.async writes through the generic
 *             proxy, wgmma reads through the async one)
 * The bf16 kernel has LAG_TILE and ARRIVE (the table picks by rows an expert;
 * MOED_CUDA_GATHER_POLICY=tile|arrive pins it, for tests and measurements), the FP8 kernel
 * LAG_RUN. */
enum { MOED_CUDA_GATHER_LAG_TILE, MOED_CUDA_GATHER_LAG_RUN, MOED_CUDA_GATHER_ARRIVE };
enum {
    MOED_CUDA_KERNEL_SM80 = 80,
    MOED_CUDA_KERNEL_SM80_SP = 81,
    MOED_CUDA_KERNEL_SM90 = 90,
    MOED_CUDA_KERNEL_SM90_FP8 = 92,
    MOED_CUDA_KERNEL_SM90_SP = 93
};
/* The table's weight format for the routed experts of a 2:4 sparse layer (beside the moed dtypes
 * MOED_BF16, MOED_F16 and MOED_FP8, whose values it does not take). */
#define MOED_CUDA_SP24 0x524
/* force_kernel values: 0 (the table decides), MOED_CUDA_KERNEL_SM80, MOED_CUDA_KERNEL_SM90 (gather
 * in the A load), MOED_CUDA_KERNEL_SM90P (Hopper with pre-permuted rows). For FP8 layers sm80 is
 * the portable path and sm90/sm90p the FP8 Hopper kernel. MOED_CUDA_KERNEL=sm80|sm90|sm90p sets
 * it. */
enum { MOED_CUDA_KERNEL_SM90P = 91 };
int moed_cuda_kernel_parse(const char *name);

/* The table: the tile for a batch of P pairs over n_active experts that have rows, on a device of
 * compute capability sm (80, 90, ...), for an N x K GEMM of weights in wdtype (the compute type,
 * MOED_FP8, or MOED_CUDA_SP24: 2:4 sparse, which has one kernel, so force_kernel leaves it be).
 * force_kernel (0 = choose) pins the family, for tests and benchmarks. */
moed_cuda_tile_cfg moed_cuda_tile_choose(int sm, int64_t P, int n_active, int n, int k, int wdtype,
                                         int force_kernel);
/* The rows per m-tile both GEMMs of a batch use (route prep needs it before either runs). */
int moed_cuda_tile_bm(int sm, int64_t P, int n_active, int wdtype, int force_kernel);
/* Whether an FP8 layer runs on the FP8 Tensor Cores (quantized activations: Hopper) rather than
 * the portable path (weights dequantized in the load). */
int moed_cuda_fp8_native(int sm, int force_kernel);

int moed_cuda_gemm_sm80(const moed_cuda_gemm *g, int bn, moed_cuda_stream s);
/* 2:4 sparse B (g->b_meta set), bf16/f16, bm 16, 32, 64 or 128, n a multiple of 128. */
int moed_cuda_gemm_sp_sm80(const moed_cuda_gemm *g, moed_cuda_stream s);
/* The same on wgmma.sp (sm_90a): bm 128, n a multiple of 256, the same bits as the above; cluster
 * 1, or 2 (two m-tiles share the weight tile by multicast). */
int moed_cuda_gemm_sp_sm90(const moed_cuda_gemm *g, int cluster, moed_cuda_stream s);
/* bm 128, bn 256, n a multiple of 128 (the last n-tile may be a half); cluster 1 or 2; gathered
 * rows completed by `policy` (MOED_CUDA_GATHER_*). */
int moed_cuda_gemm_sm90(const moed_cuda_gemm *g, int cluster, int policy, moed_cuda_stream s);
/* FP8 A and B (both scales set), bf16 C, bm 64 or 128, bn 128; cluster 1, or 2 at bm 128; `policy`
 * as above. */
int moed_cuda_gemm_fp8_sm90(const moed_cuda_gemm *g, int cluster, int policy, moed_cuda_stream s);
/* Dispatches on cfg->kernel. */
int moed_cuda_gemm_run(const moed_cuda_gemm *g, const moed_cuda_tile_cfg *cfg, moed_cuda_stream s);

/* Int32 words of one batch's route on the device: the packed inputs (tok_off, pair_tok, pair_exp,
 * pair_w) followed by route prep's arrays, for T tokens, P pairs, E experts and max_tiles m-tiles.
 */
size_t moed_cuda_route_words(int64_t T, int64_t P, int E, int32_t max_tiles);
/* The words of the packed inputs alone (what moves host to device). */
size_t moed_cuda_route_in_words(int64_t T, int64_t P);

/* Tokens [t0, t0 + rows) of a job whose pairs come from a choice in device memory (ids int32 and
 * weights float32 [rows, k] on device dev): k slots a token in the packed route, padding
 * included, which moed_cuda_route_choice fills on the device. */
typedef struct moed_cuda_drun {
    int64_t t0, rows;
    int32_t k;
    const int32_t *ids;
    const float *w;
    int dev;
} moed_cuda_drun;

/* A job's route as the packer reads it (route_pack.c): the host pairs in CSR (off, expert,
 * weight: moed_route's arrays, no pair for a run's tokens) and the runs of device-routed tokens,
 * increasing and disjoint; lay [T+1] the packed route's offsets (moed_cuda_route_offsets), which
 * is off itself when there is no run. */
typedef struct moed_cuda_route_src {
    const int64_t *off;
    const int32_t *expert;
    const float *weight;
    const int64_t *lay;
    const moed_cuda_drun *runs;
    int n_runs;
} moed_cuda_route_src;

/* lay[t] for t in [0, T]: the packed pairs of the tokens before t, a run's token counting k slots
 * and any other its pairs in off. */
void moed_cuda_route_offsets(int64_t *lay, const int64_t *off, int64_t T,
                             const moed_cuda_drun *runs, int n_runs);
/* Packs tokens [t0, t1) into dst (moed_cuda_route_in_words(t1 - t0, lay[t1] - lay[t0]) words):
 * tok_off from lay, and the host pairs at their slots, token numbers and offsets rebased to t0.
 * The slots of the runs' tokens are left as they were: moed_cuda_route_choice writes them on the
 * device once dst is there. */
void moed_cuda_route_pack(int32_t *dst, const moed_cuda_route_src *src, int64_t t0, int64_t t1);
/* Points r's arrays into a device buffer laid out as moed_cuda_route_words says, for m-tiles of bm
 * rows.
 */
void moed_cuda_route_layout(moed_cuda_route_dev *r, int32_t *dev, int64_t T, int64_t P, int E,
                            int bm);

/* A run's rows [row0, row0 + rows) as they land in a packed route (route_choice.cu): ids and w
 * point at row row0 (the client's memory, or the packed route's own slots where they were copied
 * to), the rows are tokens tok0 .. of the batch and fill its slots from pair0 on. Ids are checked
 * against n_ids; with local_of (an expert shard's map in device memory, [n_ids], moed_layer's)
 * each is then renumbered, and a pair of an expert not held is a null pair. Without it n_ids is
 * E. */
typedef struct moed_cuda_choice {
    const int32_t *ids;
    const float *w;
    int64_t row0, rows;
    int32_t k, E, n_ids, tok0, pair0;
    const int32_t *local_of;
    unsigned long long *bad; /* the part's status word: UINT64_MAX, or a refusal's code */
} moed_cuda_choice;

/* Writes the choice's slots of the packed route r (its inputs, laid out by moed_cuda_route_layout):
 * pair_tok, and pair_exp, pair_w = the (renumbered) id and the weight, or E and 0 (a null pair) for
 * padding, for an expert not held and for a pair moed_choice_rule refuses; and lowers *bad to the
 * code (moed_choice_check's, the position counted from the part's row 0) of each refused pair, so
 * it ends as the first. ids and w may be the slots themselves: each is read before it is written.
 */
int moed_cuda_route_choice(const moed_cuda_choice *c, const moed_cuda_route_dev *r,
                           moed_cuda_stream s);

/* Rows [R, cols] of dtype (MOED_F32/F16/BF16), ldx elements apart, to e4m3 rows q [R, cols_pad]
 * (zero padded) and a scale per row and 128 columns: scale[j·scale_ld + r] = amax / 448 of row r's
 * columns 128j .. 128j+127 (1 where that is 0), q = e4m3(x / scale) rounded to nearest, saturating
 * (moed_fp8.h's rule, per row). cols_pad is a multiple of 128. */
int moed_cuda_quant_fp8(const void *x, int dtype, int64_t R, int cols, int64_t ldx, void *q,
                        int cols_pad, float *scale, int64_t scale_ld, moed_cuda_stream s);

/* dst[s] = src[idx[s]] for s < n, rows of row_bytes (src may be another device's memory where
 * peer access is enabled). */
int moed_cuda_gather_rows(void *dst, const void *src, const int32_t *idx, int n, size_t row_bytes,
                          moed_cuda_stream s);
/* The same for the columns of a table [groups][ld] (FP8 rows' scales): dst[c * dst_ld + s] =
 * src[c * src_ld + idx[s]] for c < groups, s < n. */
int moed_cuda_gather_cols(float *dst, int64_t dst_ld, const float *src, int64_t src_ld,
                          const int32_t *idx, int n, int groups, moed_cuda_stream s);

struct moed_expert_w;
/* An FP8 expert's up matrix (W1, or W1|W3 interleaved for SwiGLU: glu) as e4m3 codes [n_up, d_pad]
 * into dst, and its scales as the table [d_pad/128][n_up/MOED_CUDA_FP8_SROWS] into scale; the
 * checkpoint's [ff, d] matrices and 128 x 128 block scales as moed_fp8.h has them (fp8_pack.c). */
void moed_cuda_fp8_pack_up(void *dst, float *scale, const struct moed_expert_w *w, int glu, int d,
                           int ff, int d_pad, int n_up);
/* Its down matrix W2 [d, ff] as codes [d_pad, ff_pad] and the table [ff_pad/128][d_pad/32]. */
void moed_cuda_fp8_pack_down(void *dst, float *scale, const struct moed_expert_w *w, int d, int ff,
                             int d_pad, int ff_pad);

/* 2:4 compression (sp24_pack.c) of a [rows, k] matrix of 16-bit values (bf16 or f16 bits; rows a
 * multiple of 16, k of 128), row-major: the kept values into vals [rows, k/2] and the metadata into
 * meta (MOED_CUDA_SP24_META_WORDS 32-bit words, as the 16-bit halves of the layout above). A group
 * keeps its non-zeros (a zero of either sign counting as zero) and, where it has fewer than two,
 * zeros beside them: the lowest free positions. Returns 0, or MOED_EINVAL with the first group
 * (row-major) of three or more non-zeros in *bad_row and *bad_col (its first column), leaving vals
 * and meta partly written. */
#define MOED_CUDA_SP24_META_WORDS(rows, k) ((size_t)(rows) * (size_t)(k) / 32)
int moed_cuda_sp24_pack(const uint16_t *w, int64_t rows, int64_t k, uint16_t *vals, uint16_t *meta,
                        int64_t *bad_row, int64_t *bad_col);
/* The inverse: the dense [rows, k] matrix the packed one stands for, +0 where nothing is kept. */
void moed_cuda_sp24_unpack(const uint16_t *vals, const uint16_t *meta, int64_t rows, int64_t k,
                           uint16_t *w);
/* A layer resident on one device, in the kernels' layout (padded, W1|W3 interleaved). */
typedef struct moed_cuda_layer_dev {
    int cdtype; /* MOED_BF16 or MOED_F16: activations (bf16 for FP8 layers), and weights unless */
    int wdtype; /* MOED_FP8; else cdtype */
    int act;    /* moed_act */
    int d, d_pad, E;
    int ff_pad, n_up;     /* n_up = 2·ff_pad for SwiGLU, else ff_pad */
    int sff_pad, sn_up;   /* shared experts; 0 if none */
    const void *w13, *w2; /* [E][n_up][d_pad], [E][d_pad][ff_pad] */
    const void *s13, *s2; /* [sn_up][d_pad], [d_pad][sff_pad] */
    /* FP8: the scale tables of w13, w2, s13, s2 ([K/128][E·N/MOED_CUDA_FP8_SROWS]); else NULL */
    const float *w13_scale, *w2_scale, *s13_scale, *s2_scale;
    /* 2:4 sparse routed experts: w13 and w2 hold the kept values ([E][n_up][d_pad/2],
     * [E][d_pad][ff_pad/2]) and these their metadata (the layout above); else 0 and NULL */
    int sparse24;
    const uint32_t *w13_meta, *w2_meta;
} moed_cuda_layer_dev;

/* The weight format the table is asked about for the layer's routed experts (its shared experts
 * are always dense: wdtype). */
static inline int moed_cuda_routed_wfmt(const moed_cuda_layer_dev *L)
{
    return L->sparse24 ? MOED_CUDA_SP24 : L->wdtype;
}

/* Device buffers of one batch (one execution slot's workspace). */
typedef struct moed_cuda_work_dev {
    void *xc; /* [T, d_pad] compute type */
    void *h,
        *y; /* [P, ff_pad], [P, d_pad]; y also holds the pre-permuted rows until the down GEMM */
    void *hs, *ys; /* [T, sff_pad], [T, d_pad] (shared experts) */
    /* FP8 layers on Hopper: X and H quantized (e4m3 rows [T, d_pad] and [max(P, T), max(ff_pad,
     * sff_pad)]) and their scales ([d_pad/128][xs_ld], [max(ff_pad, sff_pad)/128][hs_ld]; the lds
     * at least T and max(P, T)); NULL where no FP8 layer runs natively */
    void *xq, *hq;
    float *xs, *hs_scale;
    int64_t xs_ld, hs_ld;
} moed_cuda_work_dev;

/* The whole pipeline for one batch whose route inputs (tok_off, pair_tok, pair_exp, pair_w, and
 * the scratch pointers) are already on the device: convert x (dtype) into work->xc (or quantize it
 * into work->xq), route prep, up and down GEMMs, shared experts, combine into out [T, d] (dtype).
 * r->bm must be moed_cuda_tile_bm(sm, P, n_active, moed_cuda_routed_wfmt(L), force_kernel). If ev
 * is not NULL its 6 events are recorded between the stages (convert | route prep | up | down |
 * shared | combine), for the benchmarks. */
int moed_cuda_pipeline(const moed_cuda_layer_dev *L, moed_cuda_route_dev *r,
                       const moed_cuda_work_dev *w, const void *x, int dtype, void *out, int sm,
                       int n_active, int force_kernel, moed_cuda_stream s, void *const *ev);

/* A layer split over devices (expert parallelism) runs the pipeline in two pieces, each stage the
 * same launches as above. On each part (its experts as L, numbered from 0, no shared experts, r
 * over only the tokens with a pair of its experts): convert x, route prep and the routed GEMMs of
 * the part's pairs into w->y, then moed_cuda_combine with no shared row into an fp32 partial row
 * per token (written straight into the home device's memory where peer access allows). On the home
 * device: convert x and the shared experts (nothing when L has none), then
 * moed_cuda_combine_parts adds each token's partial rows in part order and its shared row. A
 * token's bits depend only on its own row and pairs and on the placement (not on the other tokens,
 * so merged requests stay bit-identical to the same requests alone); against the layer unsplit
 * only the order of the fp32 sums differs, before the one rounding to the output dtype. */
int moed_cuda_pipeline_routed(const moed_cuda_layer_dev *L, moed_cuda_route_dev *r,
                              const moed_cuda_work_dev *w, const void *x, int dtype, int sm,
                              int n_active, int force_kernel, moed_cuda_stream s);
int moed_cuda_pipeline_shared(const moed_cuda_layer_dev *L, int64_t T, const moed_cuda_work_dev *w,
                              const void *x, int dtype, int sm, int force_kernel,
                              moed_cuda_stream s);

#ifdef __cplusplus
}
#endif
#endif
