// The C ABI between the attention kernels and their callers.
//
// Every backend (CPU, sm80 CuTe DSL, later sm90) implements the same two entry
// points over these argument structs. The XLA FFI handlers fill them from
// buffers; tests and benchmarks can also call them directly through ctypes.
//
// Layouts (all row-major, contiguous):
//   q        [batch, seqlen_q, heads_q,  head_dim]
//   k        [batch, seqlen_k, heads_kv, head_dim]
//   v        [batch, seqlen_k, heads_kv, head_dim_v]
//   o, dout  [batch, seqlen_q, heads_q,  head_dim_v]
//   lse      [batch, heads_q, seqlen_q]  float32, natural log; -inf for a row
//                                        that sees no key
//   delta    [batch, heads_q, seqlen_q]  float32, rowsum(dout * o) - dlse
//   q_lens, kv_lens [batch] int32        valid prefix of each sequence
//   dq_accum [dq_chains, batch, seqlen_q, heads_q, head_dim] float32: the
//            (scaled) dQ is the sum of the dq_chains accumulators in order
//            (one but for the deterministic backward, where the sm90 kernels
//            take up to JF_MAX_DQ_CHAINS (jax_flash_bwd_sm90_deterministic_
//            dq_chains) and the others fill the first and zero the rest).
//            With dq_tile_rows = M > 0 (the sm90 variants that ask for it:
//            jax_flash_bwd_sm90_dq_tile_rows) it is instead
//            [batch, dq_chains, heads_q, ceil(seqlen_q / M), M, head_dim],
//            batch first so that a vmapped call's leading dims stay batch
//            dims; each query tile's M x head_dim floats are contiguous, in
//            the order of the kernel's accumulator fragments
//            (bwd_sm90/wgmma_views.py: store_dq_fragments), which
//            jax_flash/_ffi.py puts back into q's layout
//   dk, dv   like k, v, in the input dtype
//   dq_semaphore [batch, heads_q, dq_chains * ceil(seqlen_q / 32)] int32,
//            scratch of the deterministic backward (problem.deterministic =
//            1), else NULL
//
// Query head h reads key/value head h / (heads_q / heads_kv).
//
// Mask: query row i (0-based) may attend to key column j iff
//   i < q_lens[b] and j < kv_lens[b] and
//   (window_left  < 0 or j >= i + diag_offset - window_left) and
//   (window_right < 0 or j <= i + diag_offset + window_right).
// Causal is window_right = 0; FlashAttention's bottom-right alignment is
// diag_offset = seqlen_k - seqlen_q, jax.nn's top-left alignment is 0.
//
// Packed documents (problem.has_segments = 1; the four pointers below are set,
// else all NULL): additionally q_segment_ids[b, i] == kv_segment_ids[b, j].
//   q_segment_ids  [batch, seqlen_q] int32, kv_segment_ids [batch, seqlen_k]
//   kv_bounds [batch, seqlen_q, 2] int32: for query i, [first, last + 1) of
//             the keys that carry its id ([0, 0) when none do)
//   q_bounds  [batch, seqlen_k, 2] int32: for key j, the same over queries
// Every visible pair lies inside both bounds, so a kernel may skip any tile
// outside them; for documents packed back to back the bounds are exact and
// a packed row costs the sum of its documents' work.
// A query row that sees no key writes zeros to o and -inf to lse; its
// gradients are zero.
//
// Attention sinks (JfFwdArgs.sinks, jax_flash_fwd_sm90 only; NULL: none):
//   sinks    [batch, heads_q] float32, a logit per (batch entry, query head)
//            that joins every row's softmax denominator without a value row:
//            a row that sees keys gets o = sum_j e^(s_j - lse) v_j and lse =
//            log(sum_j e^(s_j) + e^(sink)); a row that sees none writes zeros
//            to o and its sink to lse. A sink of -inf changes no bit.
// The other forward entry points take no sinks and fail on a non-NULL one.
//
// Soft capping (problem.softcap > 0): the logit of a visible pair is
// softcap * tanh(scale * q.k / softcap) instead of scale * q.k.
//
// Deterministic backward (problem.deterministic = 1): dq_accum is summed in
// a fixed order, so repeated calls give bitwise equal gradients. The GPU
// kernels order their dQ additions per query tile through dq_semaphore,
// which the launcher zeroes on the stream. The sm90 ones store the first
// turn of each query tile and accumulator instead of adding it, so their
// dq_accum is not zeroed: a tile whose dq_semaphore entry (tile x dq_chains
// + chain, jax_flash_bwd_sm90_deterministic_query_tile rows per tile) is
// still 0 after the call was never written, and the caller counts it as
// zeros.
#ifndef JAX_FLASH_KERNEL_API_H_
#define JAX_FLASH_KERNEL_API_H_

#include <stddef.h>
#include <stdint.h>

// dQ accumulators a deterministic backward call may pass (JfBwdArgs.dq_chains).
#define JF_MAX_DQ_CHAINS 4

#ifdef __cplusplus
extern "C" {
#endif

typedef enum JfDtype {
  JF_FLOAT16 = 0,
  JF_BFLOAT16 = 1,
  JF_FLOAT32 = 2,
} JfDtype;

typedef struct JfProblem {
  JfDtype dtype;
  int32_t batch;
  int32_t seqlen_q;
  int32_t seqlen_k;
  int32_t heads_q;
  int32_t heads_kv;
  int32_t head_dim;
  int32_t head_dim_v;
  float scale;  // multiplies q.k before the softmax
  int32_t diag_offset;
  int32_t window_left;   // < 0: unbounded
  int32_t window_right;  // < 0: unbounded
  int32_t has_segments;  // 1: the segment pointers of the args are set
  float softcap;          // > 0: cap the logits (see above); 0: no cap
  int32_t deterministic;  // 1: bitwise reproducible backward
} JfProblem;

typedef struct JfFwdArgs {
  JfProblem problem;
  const void* q;
  const void* k;
  const void* v;
  const int32_t* q_lens;
  const int32_t* kv_lens;
  void* o;
  float* lse;
  const int32_t* q_segment_ids;
  const int32_t* kv_segment_ids;
  const int32_t* kv_bounds;
  const int32_t* q_bounds;
  const float* sinks;  // NULL, or [batch, heads_q] (see above)
} JfFwdArgs;

typedef struct JfBwdArgs {
  JfProblem problem;
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const float* lse;
  const float* delta;
  const int32_t* q_lens;
  const int32_t* kv_lens;
  float* dq_accum;
  void* dk;
  void* dv;
  const int32_t* q_segment_ids;
  const int32_t* kv_segment_ids;
  const int32_t* kv_bounds;
  const int32_t* q_bounds;
  int32_t* dq_semaphore;
  int32_t dq_chains;  // 1, or up to JF_MAX_DQ_CHAINS with problem.deterministic = 1
  int32_t dq_tile_rows;  // 0: dq_accum in q's layout; M: in query tiles
} JfBwdArgs;

// Paged KV cache (jax_flash.paged_attention): the keys of sequence b are
// the rows of the pages page_table[b, 0], page_table[b, 1], ... in order.
//   q          [batch, seqlen_q, heads_q, head_dim]: each sequence's new
//              tokens, the last q_lens[b] tokens of its cache
//   k_pages    [num_pages, page_size, heads_kv, head_dim]
//   v_pages    [num_pages, page_size, heads_kv, head_dim_v]
//   page_table [batch, max_pages] int32; max_pages a multiple of split_pages
//   q_lens     [batch] int32, kv_lens [batch] int32: new tokens and cache
//              length (new tokens included) per sequence
//   o          [batch * splits, seqlen_q, heads_q, head_dim_v]
//   lse        [batch * splits, heads_q, seqlen_q] float32
// with splits = max_pages / split_pages: entry b * splits + s is the result
// over keys [s * split_pages * page_size, (s + 1) * split_pages * page_size)
// of sequence b (zeros and -inf where a row sees none of them); the caller
// merges the splits. The mask is the one above with the diagonal at each
// sequence's bottom right: diag_offset = kv_lens[b] - q_lens[b] +
// problem.diag_offset. problem.seqlen_k is max_pages * page_size; a page id
// outside [0, num_pages) reads zeros.
typedef struct JfPagedFwdArgs {
  JfProblem problem;
  int32_t num_pages;
  int32_t page_size;
  int32_t max_pages;
  int32_t split_pages;
  const void* q;
  const void* k_pages;
  const void* v_pages;
  const int32_t* page_table;
  const int32_t* q_lens;
  const int32_t* kv_lens;
  void* o;
  float* lse;
} JfPagedFwdArgs;

// The paged forward on an FP8 cache (paged_attention with Fp8Pages): base's
// k_pages / v_pages hold float8_e4m3fn codes in the same layout, token i of
// page p and kv head h standing for code x k_scales[p, h, i] (v_scales for
// values); problem.dtype is q's and o's (float16 or bfloat16).
//   k_scales, v_scales [num_pages, heads_kv, page_size] float32
typedef struct JfPagedFp8FwdArgs {
  JfPagedFwdArgs base;
  const float* k_scales;
  const float* v_scales;
} JfPagedFp8FwdArgs;

// MLA decoding (jax_flash.mla_decode) against a paged bfloat16 / float16
// latent cache: one 576-wide row per token (512 latent columns, the values,
// then 64 RoPE columns), read by every query head.
//   q          [batch, rows, 576]: rows = s_q * heads, row r is token r / heads
//              (the last q_lens[b] tokens of the cache) and head r % heads
//   cache      [num_pages, 64, 576]
//   page_table [batch, max_pages] int32; max_pages a multiple of split_pages
//   o          [batch * splits, rows, 512], lse [batch * splits, rows] float32
// with splits = max_pages / split_pages: entry b * splits + s is the result
// over keys [s * split_pages * 64, (s + 1) * split_pages * 64) of sequence b
// (zeros and -inf where a row sees none of them, and for rows of tokens
// t >= q_lens[b]); token t sees the keys up to kv_lens[b] - q_lens[b] + t.
// A page id outside [0, num_pages) reads zeros.
typedef struct JfMlaDecodeArgs {
  JfDtype dtype;
  int32_t batch;
  int32_t rows;
  int32_t heads;
  int32_t num_pages;
  int32_t max_pages;
  int32_t split_pages;
  float scale;
  const void* q;
  const void* cache;
  const int32_t* page_table;
  const int32_t* q_lens;
  const int32_t* kv_lens;
  void* o;
  float* lse;
} JfMlaDecodeArgs;

// FP8 attention (jax_flash.fp8_attention) on Hopper: e4m3 q and k in
// JfFwdArgs' layouts; v_t is V transposed, [batch, heads_kv, head_dim_v,
// seqlen_v] with seqlen_v >= seqlen_k a multiple of 32, key c of every
// 32-key slice at column 16 (j / 2) + 4 q + 2 (j % 2) + e of the slice,
// where c = 8 j + 2 q + e (cuda_src/fwd_sm90/fp8_operands.py), and zeros
// past each sequence's kv_lens. o [batch, seqlen_q, heads_q, head_dim_v]
// in problem.dtype (JF_BFLOAT16 or JF_FLOAT16), lse as in JfFwdArgs. The
// real values are code * descale: q_descale [batch, heads_q], k_descale
// and v_descale [batch, heads_kv], float32. problem.has_segments and
// problem.softcap must be 0.
typedef struct JfFp8FwdArgs {
  JfProblem problem;
  int32_t seqlen_v;
  const void* q;
  const void* k;
  const void* v_t;
  const int32_t* q_lens;
  const int32_t* kv_lens;
  void* o;
  float* lse;
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
} JfFp8FwdArgs;

// MLA decoding against the FP8 latent cache (jax_flash.MlaFp8Cache): mla.cache
// holds the latent codes [num_pages, 64, 512] float8_e4m3fn, beside each
// token's float32 scale and its 64 RoPE columns in bfloat16; q is bfloat16 and
// quantised per token and head like the cache's tokens (docs/mla.md: the
// logits from the FP8 latent product with both scales plus the RoPE product, P
// requantised to e4m3 per query row and page before P V).
typedef struct JfMlaFp8DecodeArgs {
  JfMlaDecodeArgs mla;
  const float* scales;  // [num_pages, 64]
  const void* rope;     // [num_pages, 64, 64] bfloat16
} JfMlaFp8DecodeArgs;

// MLA decoding on Hopper against the FP8 cache, its queries quantised by the
// caller per token and head as the cache's tokens are (jax_flash/_mla.py:
// quantize_latent): cache.mla.q holds the query's latent codes [batch, rows,
// 512] float8_e4m3fn (not q [batch, rows, 576]), q_scales their float32
// scales and q_rope the query's RoPE columns in bfloat16; cache.mla.dtype is
// JF_BFLOAT16, o's dtype. Pointers 16-byte aligned except q_scales, the
// lengths, the table and lse (4).
typedef struct JfMlaFp8Sm90Args {
  JfMlaFp8DecodeArgs cache;
  const float* q_scales;  // [batch, rows]
  const void* q_rope;     // [batch, rows, 64] bfloat16
} JfMlaFp8Sm90Args;

// Return 0 on success. On failure return non-zero and write a NUL-terminated
// message of at most err_len bytes into err. GPU entry points enqueue work on
// `stream` (a cudaStream_t) and never synchronise the host or allocate.
// jax_flash_bwd_* zero dq_accum themselves (on the stream, for the GPU).
int jax_flash_fwd_cpu(const JfFwdArgs* args, char* err, size_t err_len);
int jax_flash_bwd_cpu(const JfBwdArgs* args, char* err, size_t err_len);
int jax_flash_fwd_sm80(const JfFwdArgs* args, void* stream, char* err,
                       size_t err_len);
int jax_flash_bwd_sm80(const JfBwdArgs* args, void* stream, char* err,
                       size_t err_len);

// Hopper (sm_90a) kernels. can_implement returns 1 when they serve the
// problem on the current device; otherwise the sm80 kernels run.
int jax_flash_fwd_sm90_can_implement(const JfProblem* problem);
// 1 when this build holds an sm90 forward variant for the dtype (JfDtype),
// head dims and has_segments (0 or 1): can_implement then accepts every
// problem of them on a Hopper GPU with seqlen_k > 0 and batch, heads_q <=
// 65535. Python asks it to know, while tracing, which kernel will run.
int jax_flash_fwd_sm90_has_variant(int32_t dtype, int32_t head_dim, int32_t head_dim_v,
                                   int32_t has_segments);
int jax_flash_fwd_sm90(const JfFwdArgs* args, void* stream, char* err,
                       size_t err_len);
int jax_flash_bwd_sm90_can_implement(const JfProblem* problem);
// 1 when this build holds an sm90 backward variant for the dtype (JfDtype),
// head dims and kind (deterministic, has_segments, softcap: 0 or 1):
// can_implement then accepts every problem of them on a Hopper GPU with
// batch, heads_kv <= 65535. Python asks it while tracing, as the forward's.
int jax_flash_bwd_sm90_has_variant(int32_t dtype, int32_t head_dim, int32_t head_dim_v,
                                   int32_t deterministic, int32_t has_segments,
                                   int32_t softcap);
// The query rows of the dq_accum tiles that the sm90 variants of these head
// dims take (dq_tile_rows), or 0 where they take q's layout or none exists.
int jax_flash_bwd_sm90_dq_tile_rows(int32_t head_dim, int32_t head_dim_v);
int jax_flash_bwd_sm90(const JfBwdArgs* args, void* stream, char* err,
                       size_t err_len);
// The paged forward on the CPU: split_pages must equal max_pages (each
// sequence is one split; it is batch invariant without splitting).
int jax_flash_paged_fwd_cpu(const JfPagedFwdArgs* args, char* err, size_t err_len);
// The paged forward on Hopper: 1 when it serves the problem.
int jax_flash_fwd_sm90_paged_can_implement(const JfPagedFwdArgs* args);
int jax_flash_fwd_sm90_paged(const JfPagedFwdArgs* args, void* stream, char* err,
                             size_t err_len);
// The same on an FP8 cache: whether this build holds a kernel for q's dtype
// and the head dims (Python asks while tracing), and the call.
int jax_flash_fwd_sm90_paged_fp8_has_variant(int32_t dtype, int32_t head_dim, int32_t head_dim_v);
int jax_flash_fwd_sm90_paged_fp8(const JfPagedFp8FwdArgs* args, void* stream, char* err,
                                 size_t err_len);
// The paged forward of the sm80 family (compute capability 8.x and 9.x,
// head_dim == head_dim_v in 64, 96, 128, 192, 256, any page size): 1 when
// it serves the problem on the current device.
int jax_flash_fwd_sm80_paged_can_implement(const JfPagedFwdArgs* args);
int jax_flash_fwd_sm80_paged(const JfPagedFwdArgs* args, void* stream, char* err,
                             size_t err_len);

// FP8 attention on Hopper: 1 when this build holds a variant for the output
// dtype (JfDtype) and head dims (Python asks while tracing), and whether it
// serves the arguments on the current device.
int jax_flash_fwd_sm90_fp8_has_variant(int32_t out_dtype, int32_t head_dim, int32_t head_dim_v);
int jax_flash_fwd_sm90_fp8_can_implement(const JfFp8FwdArgs* args);
int jax_flash_fwd_sm90_fp8(const JfFp8FwdArgs* args, void* stream, char* err, size_t err_len);

// MLA decoding on the CPU, each sequence as one split (split_pages must equal
// max_pages), in both cache formats.
int jax_flash_mla_decode_cpu(const JfMlaDecodeArgs* args, char* err, size_t err_len);
int jax_flash_mla_fp8_decode_cpu(const JfMlaFp8DecodeArgs* args, char* err, size_t err_len);
// MLA decoding on Hopper: 1 when the current device and the arguments are served.
int jax_flash_mla_sm90_can_implement(const JfMlaDecodeArgs* args);
int jax_flash_mla_sm90(const JfMlaDecodeArgs* args, void* stream, char* err, size_t err_len);
// 1 when this build holds the FP8-cache kernel (Python asks it while tracing).
int jax_flash_mla_sm90_fp8_available(void);
int jax_flash_mla_sm90_fp8(const JfMlaFp8Sm90Args* args, void* stream, char* err,
                           size_t err_len);

#ifdef __cplusplus
}
#endif

#endif  // JAX_FLASH_KERNEL_API_H_
