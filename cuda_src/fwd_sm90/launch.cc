// jax_flash_fwd_sm90: host launcher for the ahead-of-time exported Hopper
// forward kernels (cuda_src/fwd_sm90/kernel.py, exported by export.py).
//
// Build (verified on the CPU machine with nvcc 13.0; the jf_fwdseg90_* half of
// the objects is the packed-document variant, run when has_segments):
//
//   python -m cuda_src.fwd_sm90.export --arch sm_90a --out BUILD/fwd90_sm_90a
//   DSL=$(python -c "import nvidia_cutlass_dsl; print(list(nvidia_cutlass_dsl.__path__)[0])")
//   INC="-I cuda_src/include -I cuda_src/common -I BUILD/fwd90_sm_90a"
//   OBJS="BUILD/fwd90_sm_90a/*.o $DSL/cu13/lib/libcuda_dialect_runtime_static.a"
//   nvcc -std=c++17 -O2 -shared -Xcompiler -fPIC -cudart static $INC cuda_src/fwd_sm90/launch.cc $OBJS -Xlinker --exclude-libs,ALL -o libjax_flash_fwd_sm90.so
//
// The kernels read Q/K/V and write O with TMA; the tensor maps are encoded by
// the generated wrapper on every call from the dynamic shapes below.
//
// Verified on an H100 (2026-11-21): every plain variant against a float32
// reference on awkward lengths, masks and GQA, the GPU test suite through JAX,
// and compute-sanitizer memcheck/racecheck (see the README's benchmark notes).

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/kernel_api.h"
#include "launch_common.h"  // first: it sets up the module loaders' error hook
#include "fwd_launch_common.h"
#include "fwd_sm90_variants_sm_90a.h"

namespace {

using jax_flash_launch::EnsureLoaded;
using jax_flash_launch::Fail;
using jax_flash_launch::LoadedModule;

constexpr int kMaxGridYZ = 65535;  // grid = (query tiles, heads_q, batch)
constexpr uintptr_t kOperandAlign = 16;  // TMA needs 16-byte aligned bases

bool IsHopper(int device) {
  int major = 0;
  return jax_flash_launch::ComputeCapabilityMajor(device, &major) == cudaSuccess && major == 9;
}

using jax_flash_launch::Prod;

#define JF_FWD_ENTRY "jax_flash_fwd_sm90"

// Every variant but the paged one takes the sinks (kernel.py: mSinks, [B,
// Nq, 1] or, without sinks, [B, Nq, 0], which the kernel never reads) right
// after the stream, before any segment tensors.
#define JF_FWD90_SINK_TENSORS(prefix)                                       \
  const int32_t sink_cols = a.sinks != nullptr;                             \
  prefix##_Tensor_mSinks_t sinks = {const_cast<float*>(a.sinks),            \
                                    {p.batch, p.heads_q, sink_cols},        \
                                    {Prod(p.heads_q, sink_cols), sink_cols}};
#define JF_FWD90_SINK_SEG_TENSORS(prefix) \
  JF_FWD90_SINK_TENSORS(prefix)           \
  JF_FWD_SEG_TENSORS(prefix)
#define JF_FWD90_SINK_ARGS , &sinks
#define JF_FWD90_SINK_SEG_ARGS , &sinks JF_FWD_SEG_ARGS
// The variant lists carry head_dim_v (fwd_launch_common.h reads it from the
// problem) and the kinds' own columns, which the definitions do not take.
#define JF_DEFINE_FWD90_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix) \
  JF_DEFINE_FWD_LAUNCH(prefix, JF_FWD90_SINK_TENSORS, JF_FWD90_SINK_ARGS)
#define JF_DEFINE_FWD90_SEG_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix) \
  JF_DEFINE_FWD_LAUNCH(prefix, JF_FWD90_SINK_SEG_TENSORS, JF_FWD90_SINK_SEG_ARGS)
#define JF_DEFINE_FWD_SHORT_VARIANT(arch_tag, dtype_enum, hd, prefix, max_causal, max_full) \
  JF_DEFINE_FWD90_VARIANT(arch_tag, dtype_enum, hd, hd, prefix)
JF_FWD_SM90_VARIANTS_SM_90A(JF_DEFINE_FWD90_VARIANT)
JF_FWD_SM90_SEG_VARIANTS_SM_90A(JF_DEFINE_FWD90_SEG_VARIANT)
JF_FWD_SM90_SHORT_VARIANTS_SM_90A(JF_DEFINE_FWD_SHORT_VARIANT)
#define JF_DEFINE_FWD_PAIR_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix, min_seqlen_q) \
  JF_DEFINE_FWD90_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix)
JF_FWD_SM90_PAIR_VARIANTS_SM_90A(JF_DEFINE_FWD_PAIR_VARIANT)
#undef JF_DEFINE_FWD_PAIR_VARIANT
#undef JF_DEFINE_FWD_SHORT_VARIANT
#undef JF_DEFINE_FWD90_SEG_VARIANT
#undef JF_DEFINE_FWD90_VARIANT
#undef JF_FWD_ENTRY

using LaunchFn = int (*)(const JfFwdArgs&, cudaStream_t, char*, size_t);

// has_segments other than 0 or 1 finds no kernel.
LaunchFn FindVariant(JfDtype dtype, int head_dim, int head_dim_v, int has_segments) {
#define JF_MATCH_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix) \
  if (dtype == dtype_enum && head_dim == hd && head_dim_v == hd_v) return Launch_##prefix;
  if (has_segments == 0) {
    JF_FWD_SM90_VARIANTS_SM_90A(JF_MATCH_VARIANT)
  } else if (has_segments == 1) {
    JF_FWD_SM90_SEG_VARIANTS_SM_90A(JF_MATCH_VARIANT)
  }
#undef JF_MATCH_VARIANT
  return nullptr;
}

// Short sequences have their own tiles at some head dims, up to a length
// that depends on whether the right edge of the window is bounded (causal-
// like); SHORT_TILE in tile_config.py says which and why. Long ones without
// a window may pair their CTAs up; every other problem runs the plain or
// segment variant.
LaunchFn FindVariant(const JfProblem& p) {
  if (p.has_segments == 0 && p.head_dim == p.head_dim_v) {
    const bool causal_like = p.window_right >= 0;
#define JF_MATCH_SHORT_VARIANT(arch_tag, dtype_enum, hd, prefix, max_causal, max_full) \
  if (p.dtype == dtype_enum && p.head_dim == hd &&                                    \
      p.seqlen_q <= (causal_like ? (max_causal) : (max_full)))                         \
    return Launch_##prefix;
    JF_FWD_SM90_SHORT_VARIANTS_SM_90A(JF_MATCH_SHORT_VARIANT)
#undef JF_MATCH_SHORT_VARIANT
  }
  // K / V multicast in 2-CTA clusters (KV_MULTICAST in tile_config.py).
  if (p.has_segments == 0 && p.window_left < 0 && p.window_right < 0) {
#define JF_MATCH_PAIR_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix, min_seqlen_q) \
  if (p.dtype == dtype_enum && p.head_dim == hd && p.head_dim_v == hd_v &&            \
      p.seqlen_q >= (min_seqlen_q))                                                    \
    return Launch_##prefix;
    JF_FWD_SM90_PAIR_VARIANTS_SM_90A(JF_MATCH_PAIR_VARIANT)
#undef JF_MATCH_PAIR_VARIANT
  }
  return FindVariant(p.dtype, p.head_dim, p.head_dim_v, p.has_segments);
}

// Shapes the kernels serve. An empty key set is left to the sm80 kernel: a
// TMA descriptor cannot describe a zero-length sequence.
bool Serves(const JfProblem& p) {
  return FindVariant(p) != nullptr && p.batch >= 0 && p.seqlen_q >= 0 && p.seqlen_k > 0 &&
         p.heads_q > 0 && p.heads_kv > 0 && p.heads_q % p.heads_kv == 0 &&
         p.heads_q <= kMaxGridYZ && p.batch <= kMaxGridYZ;
}

int Validate(const JfFwdArgs* args, char* err, size_t err_len) {
  if (args == nullptr) return Fail(err, err_len, "jax_flash_fwd_sm90: args is null");
  const JfProblem& p = args->problem;
  if (p.has_segments != 0 && p.has_segments != 1) {
    return Fail(err, err_len, "jax_flash_fwd_sm90: has_segments must be 0 or 1, got %d",
                p.has_segments);
  }
  if (jax_flash_launch::CheckOptions(p, "jax_flash_fwd_sm90", err, err_len) != 0) return 1;
  if (FindVariant(p) == nullptr) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90: no kernel for JfDtype %d, head_dim %d, head_dim_v %d "
                "(check jax_flash_fwd_sm90_can_implement first)",
                static_cast<int>(p.dtype), p.head_dim, p.head_dim_v);
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90: sizes must be >= 0, got batch=%d seqlen_q=%d seqlen_k=%d",
                p.batch, p.seqlen_q, p.seqlen_k);
  }
  if (p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90: need heads_q, heads_kv > 0 and heads_q %% heads_kv == 0, "
                "got heads_q=%d heads_kv=%d",
                p.heads_q, p.heads_kv);
  }
  if (p.heads_q > kMaxGridYZ || p.batch > kMaxGridYZ) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90: heads_q and batch must be <= %d, got %d and %d",
                kMaxGridYZ, p.heads_q, p.batch);
  }
  if (p.batch > 0 && p.seqlen_q > 0 && p.seqlen_k == 0) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90: seqlen_k must be > 0 (the sm80 kernel serves "
                "seqlen_k == 0; see jax_flash_fwd_sm90_can_implement)");
  }
  const bool has_q = p.batch > 0 && p.seqlen_q > 0;
  const bool seg = p.has_segments == 1;
  struct Operand {
    const char* name;
    const void* ptr;
    bool needed;
    bool vector;
  } operands[] = {
      {"q", args->q, true, true},          {"k", args->k, true, true},
      {"v", args->v, true, true},          {"o", args->o, true, true},
      {"lse", args->lse, true, false},     {"q_lens", args->q_lens, true, false},
      {"kv_lens", args->kv_lens, true, false},
      {"q_segment_ids", args->q_segment_ids, seg, false},
      {"kv_segment_ids", args->kv_segment_ids, seg, false},
      {"kv_bounds", args->kv_bounds, seg, false},
  };
  if (!has_q) return 0;
  for (const Operand& op : operands) {
    if (!op.needed) continue;
    if (op.ptr == nullptr) {
      return Fail(err, err_len, "jax_flash_fwd_sm90: %s is null", op.name);
    }
    if (op.vector && !jax_flash_launch::IsAligned(op.ptr, kOperandAlign)) {
      return Fail(err, err_len, "jax_flash_fwd_sm90: %s must be %d-byte aligned", op.name,
                  static_cast<int>(kOperandAlign));
    }
  }
  return 0;
}

// ---- Paged K / V (kernel_api.h: JfPagedFwdArgs) ------------------------------

constexpr int kPageBox = 16;  // paged_kv.py: PAGE_BOX, the rows of one TMA box

// The paged call's generated descriptors (dynamic modes only, as above)
// from a: JfPagedFwdArgs; the FP8 cache adds its scales.
#define JF_FWD90_PAGED_LAUNCH_BEGIN(prefix, who)                                           \
  cudaError_t load = EnsureLoaded(g_##prefix, prefix##_Kernel_Module_Load);               \
  if (load != cudaSuccess) {                                                              \
    return Fail(err, err_len, who ": loading " #prefix ": %s", cudaGetErrorString(load)); \
  }                                                                                       \
  const JfProblem& p = a.problem;                                                         \
  const int64_t h = p.head_dim, hv = p.head_dim_v;                                        \
  const int32_t outs = p.batch * (a.max_pages / a.split_pages); /* <= kMaxGridYZ */       \
  prefix##_Tensor_mQ_t q = {const_cast<void*>(a.q),                                       \
                            {p.batch, p.seqlen_q, p.heads_q},                             \
                            {Prod(p.seqlen_q, p.heads_q, h), Prod(p.heads_q, h)}};        \
  prefix##_Tensor_mK_t k = {const_cast<void*>(a.k_pages),                                 \
                            {a.num_pages, a.page_size, p.heads_kv},                       \
                            {Prod(a.page_size, p.heads_kv, h), Prod(p.heads_kv, h)}};     \
  prefix##_Tensor_mV_t v = {const_cast<void*>(a.v_pages),                                 \
                            {a.num_pages, a.page_size, p.heads_kv},                       \
                            {Prod(a.page_size, p.heads_kv, hv), Prod(p.heads_kv, hv)}};   \
  prefix##_Tensor_mO_t o = {a.o,                                                          \
                            {outs, p.seqlen_q, p.heads_q},                                \
                            {Prod(p.seqlen_q, p.heads_q, hv), Prod(p.heads_q, hv)}};      \
  prefix##_Tensor_mLSE_t lse = {a.lse,                                                    \
                                {outs, p.heads_q, p.seqlen_q},                            \
                                {Prod(p.heads_q, p.seqlen_q), p.seqlen_q}};               \
  prefix##_Tensor_mQLens_t q_lens = {const_cast<int32_t*>(a.q_lens), {p.batch}};          \
  prefix##_Tensor_mKVLens_t kv_lens = {const_cast<int32_t*>(a.kv_lens), {p.batch}};       \
  prefix##_Tensor_mPageTable_t table = {const_cast<int32_t*>(a.page_table),               \
                                        {p.batch, a.max_pages}, {a.max_pages}};
#define JF_FWD90_PAGED_LAUNCH_END(prefix, who, ...)                                         \
  int32_t rc = cute_dsl_##prefix##_wrapper(                                               \
      &g_##prefix.module, &q, &k, &v, &o, &lse, &q_lens, &kv_lens, p.scale, p.softcap,    \
      p.diag_offset, p.window_left, p.window_right, stream, &table, a.split_pages          \
      __VA_ARGS__);                                                                       \
  if (rc != 0) return Fail(err, err_len, who ": " #prefix " returned %d", rc);            \
  return 0;

#define JF_DEFINE_FWD_PAGED_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix)                  \
  LoadedModule<prefix##_Kernel_Module_t> g_##prefix;                                      \
  int Launch_##prefix(const JfPagedFwdArgs& a, cudaStream_t stream, char* err,            \
                      size_t err_len) {                                                   \
    JF_FWD90_PAGED_LAUNCH_BEGIN(prefix, "jax_flash_fwd_sm90_paged")                       \
    JF_FWD90_PAGED_LAUNCH_END(prefix, "jax_flash_fwd_sm90_paged")                         \
  }
JF_FWD_SM90_PAGED_VARIANTS_SM_90A(JF_DEFINE_FWD_PAGED_VARIANT)
#undef JF_DEFINE_FWD_PAGED_VARIANT

// kernel.py call_paged_fp8: the scales [num_pages, heads_kv, page_size].
#define JF_DEFINE_FWD_PAGED_FP8_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix)              \
  LoadedModule<prefix##_Kernel_Module_t> g_##prefix;                                      \
  int Launch_##prefix(const JfPagedFp8FwdArgs& f, cudaStream_t stream, char* err,         \
                      size_t err_len) {                                                   \
    const JfPagedFwdArgs& a = f.base;                                                     \
    JF_FWD90_PAGED_LAUNCH_BEGIN(prefix, "jax_flash_fwd_sm90_paged_fp8")                   \
    const int32_t scale_dims[] = {a.num_pages, p.heads_kv, a.page_size};                  \
    const int64_t scale_strides[] = {Prod(p.heads_kv, a.page_size), a.page_size};         \
    prefix##_Tensor_mKScale_t k_scales = {const_cast<float*>(f.k_scales),                 \
                                          {scale_dims[0], scale_dims[1], scale_dims[2]},  \
                                          {scale_strides[0], scale_strides[1]}};          \
    prefix##_Tensor_mVScale_t v_scales = {const_cast<float*>(f.v_scales),                 \
                                          {scale_dims[0], scale_dims[1], scale_dims[2]},  \
                                          {scale_strides[0], scale_strides[1]}};          \
    JF_FWD90_PAGED_LAUNCH_END(prefix, "jax_flash_fwd_sm90_paged_fp8", , &k_scales, &v_scales) \
  }
JF_FWD_SM90_PAGED_FP8_VARIANTS_SM_90A(JF_DEFINE_FWD_PAGED_FP8_VARIANT)
#undef JF_DEFINE_FWD_PAGED_FP8_VARIANT
#undef JF_FWD90_PAGED_LAUNCH_BEGIN
#undef JF_FWD90_PAGED_LAUNCH_END

using PagedFp8LaunchFn = int (*)(const JfPagedFp8FwdArgs&, cudaStream_t, char*, size_t);

PagedFp8LaunchFn FindPagedFp8Variant(int32_t dtype, int32_t head_dim, int32_t head_dim_v) {
#define JF_MATCH_PAGED_FP8_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix) \
  if (dtype == dtype_enum && head_dim == hd && head_dim_v == hd_v) return Launch_##prefix;
  JF_FWD_SM90_PAGED_FP8_VARIANTS_SM_90A(JF_MATCH_PAGED_FP8_VARIANT)
#undef JF_MATCH_PAGED_FP8_VARIANT
  return nullptr;
}

using PagedLaunchFn = int (*)(const JfPagedFwdArgs&, cudaStream_t, char*, size_t);

PagedLaunchFn FindPagedVariant(const JfProblem& p) {
#define JF_MATCH_PAGED_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix) \
  if (p.dtype == dtype_enum && p.head_dim == hd && p.head_dim_v == hd_v) return Launch_##prefix;
  JF_FWD_SM90_PAGED_VARIANTS_SM_90A(JF_MATCH_PAGED_VARIANT)
#undef JF_MATCH_PAGED_VARIANT
  return nullptr;
}

// Every value the kernel relies on; a message naming the first that fails.
int ValidatePaged(const JfPagedFwdArgs* a, char* err, size_t err_len) {
  if (a == nullptr) return Fail(err, err_len, "jax_flash_fwd_sm90_paged: args is null");
  const JfProblem& p = a->problem;
  if (jax_flash_launch::CheckOptions(p, "jax_flash_fwd_sm90_paged", err, err_len) != 0) return 1;
  if (FindPagedVariant(p) == nullptr) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90_paged: no kernel for JfDtype %d, head_dim %d, head_dim_v %d",
                static_cast<int>(p.dtype), p.head_dim, p.head_dim_v);
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.heads_q <= 0 || p.heads_kv <= 0 ||
      p.heads_q % p.heads_kv != 0 || p.heads_q > kMaxGridYZ) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90_paged: need batch, seqlen_q >= 0, 0 < heads_kv, heads_q a "
                "multiple of heads_kv up to %d; got batch=%d seqlen_q=%d heads_q=%d heads_kv=%d",
                kMaxGridYZ, p.batch, p.seqlen_q, p.heads_q, p.heads_kv);
  }
  if (a->page_size <= 0 || a->page_size % kPageBox != 0 || a->num_pages <= 0 ||
      a->split_pages <= 0 || a->max_pages <= 0 || a->max_pages % a->split_pages != 0) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90_paged: need page_size a multiple of %d, num_pages > 0 and "
                "max_pages a positive multiple of split_pages; got page_size=%d num_pages=%d "
                "max_pages=%d split_pages=%d",
                kPageBox, a->page_size, a->num_pages, a->max_pages, a->split_pages);
  }
  if (int64_t{p.batch} * (a->max_pages / a->split_pages) > kMaxGridYZ) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90_paged: batch x splits must be <= %d, got %d x %d", kMaxGridYZ,
                p.batch, a->max_pages / a->split_pages);
  }
  if (p.batch == 0 || p.seqlen_q == 0) return 0;
  const void* vectors[] = {a->q, a->k_pages, a->v_pages, a->o};
  for (const void* ptr : vectors) {
    if (!jax_flash_launch::IsAligned(ptr, kOperandAlign)) {
      return Fail(err, err_len, "jax_flash_fwd_sm90_paged: q, pages and o must be %d-byte aligned",
                  static_cast<int>(kOperandAlign));
    }
  }
  if (a->page_table == nullptr || a->q_lens == nullptr || a->kv_lens == nullptr ||
      a->lse == nullptr) {
    return Fail(err, err_len, "jax_flash_fwd_sm90_paged: a table, length or lse pointer is null");
  }
  return 0;
}

// The FP8 cache: the paged call's rules, a kernel for q's dtype, the scales.
int ValidatePagedFp8(const JfPagedFp8FwdArgs* a, char* err, size_t err_len) {
  if (a == nullptr) return Fail(err, err_len, "jax_flash_fwd_sm90_paged_fp8: args is null");
  const JfProblem& p = a->base.problem;
  if (FindPagedFp8Variant(p.dtype, p.head_dim, p.head_dim_v) == nullptr) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90_paged_fp8: no kernel for JfDtype %d, head_dim %d, "
                "head_dim_v %d", static_cast<int>(p.dtype), p.head_dim, p.head_dim_v);
  }
  // The codes' pool has the layout of a 16-bit one: ValidatePaged checks it
  // for a variant of q's dtype and head dims, which every FP8 one has.
  if (int rc = ValidatePaged(&a->base, err, err_len)) return rc;
  if (p.batch != 0 && p.seqlen_q != 0 && (a->k_scales == nullptr || a->v_scales == nullptr)) {
    return Fail(err, err_len, "jax_flash_fwd_sm90_paged_fp8: a scales pointer is null");
  }
  return 0;
}

// ---- FP8 inputs (kernel_api.h: JfFp8FwdArgs; fp8_variant.py) ----------------

constexpr int kFp8KeySlice = 32;  // fp8_operands.py: MMA_K, the keys v_t is padded to

#define JF_DEFINE_FWD_FP8_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix)                    \
  LoadedModule<prefix##_Kernel_Module_t> g_##prefix;                                      \
  int Launch_##prefix(const JfFp8FwdArgs& a, cudaStream_t stream, char* err,              \
                      size_t err_len) {                                                   \
    cudaError_t load = EnsureLoaded(g_##prefix, prefix##_Kernel_Module_Load);             \
    if (load != cudaSuccess) {                                                            \
      return Fail(err, err_len, "jax_flash_fwd_sm90_fp8: loading " #prefix ": %s",        \
                  cudaGetErrorString(load));                                              \
    }                                                                                     \
    const JfProblem& p = a.problem;                                                       \
    const int64_t h = p.head_dim, hv = p.head_dim_v;                                      \
    prefix##_Tensor_mQ_t q = {const_cast<void*>(a.q),                                     \
                              {p.batch, p.seqlen_q, p.heads_q},                           \
                              {Prod(p.seqlen_q, p.heads_q, h), Prod(p.heads_q, h)}};      \
    prefix##_Tensor_mK_t k = {const_cast<void*>(a.k),                                     \
                              {p.batch, p.seqlen_k, p.heads_kv},                          \
                              {Prod(p.seqlen_k, p.heads_kv, h), Prod(p.heads_kv, h)}};    \
    prefix##_Tensor_mVt_t v_t = {const_cast<void*>(a.v_t),                               \
                                 {p.batch, p.heads_kv, a.seqlen_v},                       \
                                 {Prod(p.heads_kv, hv, a.seqlen_v), Prod(hv, a.seqlen_v),  \
                                  a.seqlen_v}};                                           \
    prefix##_Tensor_mO_t o = {a.o,                                                        \
                              {p.batch, p.seqlen_q, p.heads_q},                           \
                              {Prod(p.seqlen_q, p.heads_q, hv), Prod(p.heads_q, hv)}};    \
    prefix##_Tensor_mLSE_t lse = {a.lse,                                                  \
                                  {p.batch, p.heads_q, p.seqlen_q},                       \
                                  {Prod(p.heads_q, p.seqlen_q), p.seqlen_q}};             \
    prefix##_Tensor_mQLens_t q_lens = {const_cast<int32_t*>(a.q_lens), {p.batch}};        \
    prefix##_Tensor_mKVLens_t kv_lens = {const_cast<int32_t*>(a.kv_lens), {p.batch}};     \
    prefix##_Tensor_mQDescale_t q_descale = {const_cast<float*>(a.q_descale),             \
                                             {p.batch, p.heads_q}, {p.heads_q}};          \
    prefix##_Tensor_mKDescale_t k_descale = {const_cast<float*>(a.k_descale),             \
                                             {p.batch, p.heads_kv}, {p.heads_kv}};        \
    prefix##_Tensor_mVDescale_t v_descale = {const_cast<float*>(a.v_descale),             \
                                             {p.batch, p.heads_kv}, {p.heads_kv}};        \
    int32_t rc = cute_dsl_##prefix##_wrapper(                                             \
        &g_##prefix.module, &q, &k, &v_t, &o, &lse, &q_lens, &kv_lens, p.scale,           \
        p.diag_offset, p.window_left, p.window_right, stream, &q_descale, &k_descale,     \
        &v_descale);                                                                      \
    if (rc != 0) {                                                                        \
      return Fail(err, err_len, "jax_flash_fwd_sm90_fp8: " #prefix " returned %d", rc);   \
    }                                                                                     \
    return 0;                                                                             \
  }
JF_FWD_SM90_FP8_VARIANTS_SM_90A(JF_DEFINE_FWD_FP8_VARIANT)
#undef JF_DEFINE_FWD_FP8_VARIANT

using Fp8LaunchFn = int (*)(const JfFp8FwdArgs&, cudaStream_t, char*, size_t);

Fp8LaunchFn FindFp8Variant(int32_t out_dtype, int32_t head_dim, int32_t head_dim_v) {
#define JF_MATCH_FP8_VARIANT(arch_tag, dtype_enum, hd, hd_v, prefix) \
  if (out_dtype == dtype_enum && head_dim == hd && head_dim_v == hd_v) return Launch_##prefix;
  JF_FWD_SM90_FP8_VARIANTS_SM_90A(JF_MATCH_FP8_VARIANT)
#undef JF_MATCH_FP8_VARIANT
  return nullptr;
}

// Every value the kernel relies on; a message naming the first that fails.
int ValidateFp8(const JfFp8FwdArgs* a, char* err, size_t err_len) {
  if (a == nullptr) return Fail(err, err_len, "jax_flash_fwd_sm90_fp8: args is null");
  const JfProblem& p = a->problem;
  if (p.has_segments != 0 || p.softcap != 0.0f) {
    return Fail(err, err_len, "jax_flash_fwd_sm90_fp8: no segments or softcap, got "
                "has_segments=%d softcap=%g", p.has_segments, static_cast<double>(p.softcap));
  }
  if (jax_flash_launch::CheckOptions(p, "jax_flash_fwd_sm90_fp8", err, err_len) != 0) return 1;
  if (FindFp8Variant(p.dtype, p.head_dim, p.head_dim_v) == nullptr) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90_fp8: no kernel for output JfDtype %d, head_dim %d, "
                "head_dim_v %d", static_cast<int>(p.dtype), p.head_dim, p.head_dim_v);
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 ||
      p.heads_q % p.heads_kv != 0 || p.heads_q > kMaxGridYZ || p.batch > kMaxGridYZ) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90_fp8: need batch, seqlen_q >= 0, seqlen_k > 0, heads_q a "
                "multiple of heads_kv > 0, batch and heads_q <= %d; got batch=%d seqlen_q=%d "
                "seqlen_k=%d heads_q=%d heads_kv=%d", kMaxGridYZ, p.batch, p.seqlen_q,
                p.seqlen_k, p.heads_q, p.heads_kv);
  }
  if (a->seqlen_v < p.seqlen_k || a->seqlen_v % kFp8KeySlice != 0) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90_fp8: seqlen_v must be a multiple of %d >= seqlen_k=%d, "
                "got %d", kFp8KeySlice, p.seqlen_k, a->seqlen_v);
  }
  if (p.batch == 0 || p.seqlen_q == 0) return 0;
  const void* vectors[] = {a->q, a->k, a->v_t, a->o};
  for (const void* ptr : vectors) {
    if (!jax_flash_launch::IsAligned(ptr, kOperandAlign)) {
      return Fail(err, err_len, "jax_flash_fwd_sm90_fp8: q, k, v_t and o must be %d-byte aligned",
                  static_cast<int>(kOperandAlign));
    }
  }
  if (a->q_lens == nullptr || a->kv_lens == nullptr || a->lse == nullptr ||
      a->q_descale == nullptr || a->k_descale == nullptr || a->v_descale == nullptr) {
    return Fail(err, err_len, "jax_flash_fwd_sm90_fp8: a length, lse or descale pointer is null");
  }
  return 0;
}

}  // namespace

extern "C" int jax_flash_fwd_sm90_paged_can_implement(const JfPagedFwdArgs* args) {
  char unused[8];
  if (ValidatePaged(args, unused, sizeof unused) != 0) return 0;
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess && IsHopper(device);
}

extern "C" int jax_flash_fwd_sm90_paged(const JfPagedFwdArgs* args, void* stream, char* err,
                                        size_t err_len) {
  if (int rc = ValidatePaged(args, err, err_len)) return rc;
  const JfProblem& p = args->problem;
  if (p.batch == 0 || p.seqlen_q == 0) return 0;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess || !IsHopper(device)) {
    return Fail(err, err_len, "jax_flash_fwd_sm90_paged: device %d is not compute capability 9.x",
                device);
  }
  if (int rc = FindPagedVariant(p)(*args, static_cast<cudaStream_t>(stream), err, err_len)) {
    return rc;
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    return Fail(err, err_len, "jax_flash_fwd_sm90_paged: launch failed: %s", cudaGetErrorString(e));
  }
  return 0;
}

extern "C" int jax_flash_fwd_sm90_paged_fp8_has_variant(int32_t dtype, int32_t head_dim,
                                                        int32_t head_dim_v) {
  return FindPagedFp8Variant(dtype, head_dim, head_dim_v) != nullptr;
}

extern "C" int jax_flash_fwd_sm90_paged_fp8(const JfPagedFp8FwdArgs* args, void* stream,
                                            char* err, size_t err_len) {
  if (int rc = ValidatePagedFp8(args, err, err_len)) return rc;
  const JfProblem& p = args->base.problem;
  if (p.batch == 0 || p.seqlen_q == 0) return 0;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess || !IsHopper(device)) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90_paged_fp8: device %d is not compute capability 9.x", device);
  }
  PagedFp8LaunchFn launch = FindPagedFp8Variant(p.dtype, p.head_dim, p.head_dim_v);
  if (int rc = launch(*args, static_cast<cudaStream_t>(stream), err, err_len)) return rc;
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    return Fail(err, err_len, "jax_flash_fwd_sm90_paged_fp8: launch failed: %s",
                cudaGetErrorString(e));
  }
  return 0;
}

extern "C" int jax_flash_fwd_sm90_fp8_has_variant(int32_t out_dtype, int32_t head_dim,
                                                  int32_t head_dim_v) {
  return FindFp8Variant(out_dtype, head_dim, head_dim_v) != nullptr;
}

extern "C" int jax_flash_fwd_sm90_fp8_can_implement(const JfFp8FwdArgs* args) {
  char unused[8];
  if (ValidateFp8(args, unused, sizeof unused) != 0) return 0;
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess && IsHopper(device);
}

extern "C" int jax_flash_fwd_sm90_fp8(const JfFp8FwdArgs* args, void* stream, char* err,
                                      size_t err_len) {
  if (int rc = ValidateFp8(args, err, err_len)) return rc;
  const JfProblem& p = args->problem;
  if (p.batch == 0 || p.seqlen_q == 0) return 0;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess || !IsHopper(device)) {
    return Fail(err, err_len, "jax_flash_fwd_sm90_fp8: device %d is not compute capability 9.x",
                device);
  }
  Fp8LaunchFn launch = FindFp8Variant(p.dtype, p.head_dim, p.head_dim_v);
  if (int rc = launch(*args, static_cast<cudaStream_t>(stream), err, err_len)) return rc;
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    return Fail(err, err_len, "jax_flash_fwd_sm90_fp8: launch failed: %s", cudaGetErrorString(e));
  }
  return 0;
}

extern "C" int jax_flash_fwd_sm90_has_variant(int32_t dtype, int32_t head_dim,
                                              int32_t head_dim_v, int32_t has_segments) {
  return FindVariant(static_cast<JfDtype>(dtype), head_dim, head_dim_v, has_segments) != nullptr;
}

extern "C" int jax_flash_fwd_sm90_can_implement(const JfProblem* problem) {
  if (problem == nullptr || !Serves(*problem)) return 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  return IsHopper(device);
}

extern "C" int jax_flash_fwd_sm90(const JfFwdArgs* args, void* stream, char* err,
                                  size_t err_len) {
  if (int rc = Validate(args, err, err_len)) return rc;
  const JfProblem& p = args->problem;
  if (p.batch == 0 || p.seqlen_q == 0) return 0;

  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    return Fail(err, err_len, "jax_flash_fwd_sm90: cudaGetDevice: %s", cudaGetErrorString(e));
  }
  if (!IsHopper(device)) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm90: device %d is not compute capability 9.x", device);
  }
  LaunchFn launch = FindVariant(p);
  if (int rc = launch(*args, static_cast<cudaStream_t>(stream), err, err_len)) return rc;
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    return Fail(err, err_len, "jax_flash_fwd_sm90: launch failed: %s", cudaGetErrorString(e));
  }
  return 0;
}
