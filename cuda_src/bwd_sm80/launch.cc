// jax_flash_bwd_sm80: C-ABI launcher for the AOT-compiled CuTe DSL backward
// kernels (cuda_src/bwd_sm80/kernel.py, exported by export.py).
//
// Build (verified; OBJ_80 / OBJ_90A are the export.py --out directories of
// the two arches, DSL = site-packages/nvidia_cutlass_dsl):
//
//   nvcc -std=c++17 -O2 -shared -Xcompiler -fPIC -cudart static
//        -I cuda_src/include -I $OBJ_80 -I $OBJ_90A
//        cuda_src/bwd_sm80/launch.cc $OBJ_80/*.o $OBJ_90A/*.o
//        $DSL/cu13/lib/libcuda_dialect_runtime_static.a
//        -Xlinker --exclude-libs,ALL -o libjax_flash_bwd_sm80.so
//
// (-Xlinker X is nvcc's spelling of -Wl,X.) The exported objects' own
// symbols stay visible; adding -Xlinker --version-script=F with F =
// "{ global: jax_flash_*; local: *; };" leaves only the entry points
// (checked with nm -D).
//
// All 40 variants of both arches link into one library without duplicate
// symbols: each object's symbols carry its function_prefix
// (jf_bwd_<arch>_<dtype>_hd<d>, or jf_bwdseg_... for the packed-document
// variants that run when has_segments is 1), and the static DSL runtime is
// linked once.
//
// Compute capability 8.x runs the sm_80 objects, 9.x the sm_90a ones.

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <mutex>

#include "jax_flash/kernel_api.h"
#include "bwd_sm80_variants_sm_80.h"
#include "bwd_sm80_variants_sm_90a.h"

namespace {

int Fail(char* err, size_t err_len, const char* fmt, ...) {
  if (err != nullptr && err_len > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
  }
  return 1;
}

// Which object family the current device runs: 80, 90, or 0 (unsupported).
// The attribute queries are cheap, and the answer is cached per device.
constexpr int kMaxDevices = 64;
std::atomic<int> g_arch_of_device[kMaxDevices];  // 0: not queried yet

int CurrentArch(char* err, size_t err_len, int* arch) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return Fail(err, err_len, "jax_flash_bwd_sm80: cudaGetDevice: %s", cudaGetErrorString(e));
  if (device >= 0 && device < kMaxDevices) {
    int cached = g_arch_of_device[device].load(std::memory_order_relaxed);
    if (cached != 0) {
      *arch = cached;
      return 0;
    }
  }
  int major = 0;
  e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e != cudaSuccess) return Fail(err, err_len, "jax_flash_bwd_sm80: cudaDeviceGetAttribute: %s", cudaGetErrorString(e));
  *arch = major == 8 ? 80 : major == 9 ? 90 : -major;
  if (device >= 0 && device < kMaxDevices) g_arch_of_device[device].store(*arch, std::memory_order_relaxed);
  return 0;
}

// Tensor descriptors as the exported wrappers take them: the data pointer,
// the dynamic extents (every mode but head_dim) and the dynamic strides (all
// but the two innermost, which are head_dim and 1 or just 1), in mode order.
struct Bthd {  // [batch, seqlen, heads, head_dim]
  void* data;
  int32_t shape[3];
  int64_t stride[2];
};
struct Bht {  // [batch, heads, seqlen]
  void* data;
  int32_t shape[3];
  int64_t stride[2];
};
struct Lens {  // [batch]
  void* data;
  int32_t shape[1];
};
struct SegIds {  // [batch, seqlen]
  void* data;
  int32_t shape[2];
  int64_t stride[1];
};
struct Bounds {  // [batch, seqlen, 2]
  void* data;
  int32_t shape[2];
  int64_t stride[1];
};

Bthd MakeBthd(const void* p, int32_t b, int32_t t, int32_t h, int32_t d) {
  return Bthd{const_cast<void*>(p), {b, t, h}, {int64_t{t} * h * d, int64_t{h} * d}};
}
Bht MakeBht(const void* p, int32_t b, int32_t h, int32_t t) {
  return Bht{const_cast<void*>(p), {b, h, t}, {int64_t{h} * t, int64_t{t}}};
}

struct LaunchArgs {
  Bthd q, k, v, dout, dq, dk, dv;
  Bht lse, delta;
  Lens q_lens, kv_lens;
  SegIds q_seg, kv_seg;  // segment variants only
  Bounds q_bounds;
  float scale;
  int32_t key_lo, key_hi;
};

// One function per variant: load its module once (thread-safe) and call the
// exported wrapper. Its tensor structs have the same layout as ours.
// SEG_ARGS is empty for the plain variants and appends the segment tensors
// for the has_segments ones.
#define JF_BWD_DEFINE_LAUNCH_IMPL(PREFIX, SEG_ARGS)                                               \
  int Launch_##PREFIX(const LaunchArgs& a, cudaStream_t stream, char* err, size_t err_len) {      \
    static PREFIX##_Kernel_Module_t module;                                                        \
    static std::once_flag once;                                                                    \
    static cudaError_t load_status = cudaSuccess;                                                  \
    std::call_once(once, [] {                                                                      \
      cudaGetLastError();                                                                          \
      PREFIX##_Kernel_Module_Load(&module);                                                        \
      load_status = cudaGetLastError();                                                            \
    });                                                                                            \
    if (load_status != cudaSuccess)                                                                \
      return Fail(err, err_len, "jax_flash_bwd_sm80: loading " #PREFIX " failed: %s",             \
                  cudaGetErrorString(load_status));                                                \
    auto* q = reinterpret_cast<PREFIX##_Tensor_mQ_t*>(const_cast<Bthd*>(&a.q));                    \
    auto* k = reinterpret_cast<PREFIX##_Tensor_mK_t*>(const_cast<Bthd*>(&a.k));                    \
    auto* v = reinterpret_cast<PREFIX##_Tensor_mV_t*>(const_cast<Bthd*>(&a.v));                    \
    auto* dout = reinterpret_cast<PREFIX##_Tensor_mdO_t*>(const_cast<Bthd*>(&a.dout));             \
    auto* lse = reinterpret_cast<PREFIX##_Tensor_mLSE_t*>(const_cast<Bht*>(&a.lse));               \
    auto* delta = reinterpret_cast<PREFIX##_Tensor_mDelta_t*>(const_cast<Bht*>(&a.delta));         \
    auto* ql = reinterpret_cast<PREFIX##_Tensor_mQLens_t*>(const_cast<Lens*>(&a.q_lens));          \
    auto* kl = reinterpret_cast<PREFIX##_Tensor_mKVLens_t*>(const_cast<Lens*>(&a.kv_lens));        \
    auto* dq = reinterpret_cast<PREFIX##_Tensor_mdQ_t*>(const_cast<Bthd*>(&a.dq));                 \
    auto* dk = reinterpret_cast<PREFIX##_Tensor_mdK_t*>(const_cast<Bthd*>(&a.dk));                 \
    auto* dv = reinterpret_cast<PREFIX##_Tensor_mdV_t*>(const_cast<Bthd*>(&a.dv));                 \
    int32_t rc = cute_dsl_##PREFIX##_wrapper(&module, q, k, v, dout, lse, delta, ql, kl, dq, dk, dv, \
                                             a.scale, a.key_lo, a.key_hi, stream SEG_ARGS(PREFIX));\
    if (rc != 0) return Fail(err, err_len, "jax_flash_bwd_sm80: " #PREFIX " returned %d", rc);    \
    return 0;                                                                                      \
  }
#define JF_BWD_NO_SEG_ARGS(PREFIX)
#define JF_BWD_SEG_ARGS(PREFIX)                                                     \
  , reinterpret_cast<PREFIX##_Tensor_mQSeg_t*>(const_cast<SegIds*>(&a.q_seg)),      \
      reinterpret_cast<PREFIX##_Tensor_mKVSeg_t*>(const_cast<SegIds*>(&a.kv_seg)),  \
      reinterpret_cast<PREFIX##_Tensor_mQBounds_t*>(const_cast<Bounds*>(&a.q_bounds))
#define JF_BWD_DEFINE_LAUNCH(ARCH, DTYPE, HDIM, PREFIX) JF_BWD_DEFINE_LAUNCH_IMPL(PREFIX, JF_BWD_NO_SEG_ARGS)
#define JF_BWD_DEFINE_SEG_LAUNCH(ARCH, DTYPE, HDIM, PREFIX) JF_BWD_DEFINE_LAUNCH_IMPL(PREFIX, JF_BWD_SEG_ARGS)
JF_BWD_SM80_VARIANTS_SM80(JF_BWD_DEFINE_LAUNCH)
JF_BWD_SM80_VARIANTS_SM90A(JF_BWD_DEFINE_LAUNCH)
JF_BWD_SM80_SEG_VARIANTS_SM80(JF_BWD_DEFINE_SEG_LAUNCH)
JF_BWD_SM80_SEG_VARIANTS_SM90A(JF_BWD_DEFINE_SEG_LAUNCH)
#undef JF_BWD_DEFINE_SEG_LAUNCH
#undef JF_BWD_DEFINE_LAUNCH
#undef JF_BWD_SEG_ARGS
#undef JF_BWD_NO_SEG_ARGS
#undef JF_BWD_DEFINE_LAUNCH_IMPL

using LaunchFn = int (*)(const LaunchArgs&, cudaStream_t, char*, size_t);

LaunchFn FindVariant(int arch, JfDtype dtype, int head_dim, bool has_segments) {
#define JF_BWD_MATCH(ARCH, DTYPE, HDIM, PREFIX) \
  if (dtype == DTYPE && head_dim == HDIM) return &Launch_##PREFIX;
  if (arch == 80 && !has_segments) {
    JF_BWD_SM80_VARIANTS_SM80(JF_BWD_MATCH)
  } else if (arch == 90 && !has_segments) {
    JF_BWD_SM80_VARIANTS_SM90A(JF_BWD_MATCH)
  } else if (arch == 80) {
    JF_BWD_SM80_SEG_VARIANTS_SM80(JF_BWD_MATCH)
  } else if (arch == 90) {
    JF_BWD_SM80_SEG_VARIANTS_SM90A(JF_BWD_MATCH)
  }
#undef JF_BWD_MATCH
  return nullptr;
}

bool Aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

}  // namespace

extern "C" int jax_flash_bwd_sm80(const JfBwdArgs* args, void* stream_ptr, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) err[0] = '\0';
  if (args == nullptr) return Fail(err, err_len, "jax_flash_bwd_sm80: args is NULL");
  const JfProblem& p = args->problem;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);

  if (p.dtype != JF_FLOAT16 && p.dtype != JF_BFLOAT16)
    return Fail(err, err_len, "jax_flash_bwd_sm80: dtype must be float16 or bfloat16, got JfDtype %d", int(p.dtype));
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0)
    return Fail(err, err_len, "jax_flash_bwd_sm80: batch, seqlen_q, seqlen_k must be >= 0, got %d, %d, %d",
                p.batch, p.seqlen_q, p.seqlen_k);
  if (p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0)
    return Fail(err, err_len, "jax_flash_bwd_sm80: heads_q (%d) must be a positive multiple of heads_kv (%d)",
                p.heads_q, p.heads_kv);
  if (p.head_dim != p.head_dim_v)
    return Fail(err, err_len, "jax_flash_bwd_sm80: head_dim_v (%d) must equal head_dim (%d)", p.head_dim_v,
                p.head_dim);
  if (p.head_dim != 64 && p.head_dim != 96 && p.head_dim != 128 && p.head_dim != 192 && p.head_dim != 256)
    return Fail(err, err_len, "jax_flash_bwd_sm80: head_dim must be one of 64, 96, 128, 192, 256, got %d",
                p.head_dim);
  if (!(p.scale == p.scale) || p.scale == INFINITY || p.scale == -INFINITY)
    return Fail(err, err_len, "jax_flash_bwd_sm80: scale must be finite");
  if (p.has_segments != 0 && p.has_segments != 1)
    return Fail(err, err_len, "jax_flash_bwd_sm80: has_segments must be 0 or 1, got %d", p.has_segments);
  if (p.heads_kv > 65535 || p.batch > 65535)
    return Fail(err, err_len, "jax_flash_bwd_sm80: batch (%d) and heads_kv (%d) must be <= 65535", p.batch,
                p.heads_kv);

  const int32_t B = p.batch, T = p.seqlen_q, S = p.seqlen_k, Hq = p.heads_q, Hkv = p.heads_kv, D = p.head_dim;
  const size_t elem = 2;
  const size_t q_elems = size_t(B) * T * Hq * D;
  const size_t kv_elems = size_t(B) * S * Hkv * D;
  if (q_elems == 0 && kv_elems == 0) return 0;
  const bool seg = p.has_segments == 1;

  struct {
    const void* ptr;
    const char* name;
    bool needed;
    uintptr_t align;
  } const ptrs[] = {
      {args->q, "q", q_elems > 0, 16},          {args->k, "k", kv_elems > 0, 16},
      {args->v, "v", kv_elems > 0, 16},         {args->dout, "dout", q_elems > 0, 16},
      {args->lse, "lse", q_elems > 0, 4},       {args->delta, "delta", q_elems > 0, 4},
      {args->q_lens, "q_lens", B > 0, 4},       {args->kv_lens, "kv_lens", B > 0, 4},
      {args->dq_accum, "dq_accum", q_elems > 0, 16}, {args->dk, "dk", kv_elems > 0, 16},
      {args->dv, "dv", kv_elems > 0, 16},
      {args->q_segment_ids, "q_segment_ids", seg && q_elems > 0 && kv_elems > 0, 4},
      {args->kv_segment_ids, "kv_segment_ids", seg && q_elems > 0 && kv_elems > 0, 4},
      {args->q_bounds, "q_bounds", seg && q_elems > 0 && kv_elems > 0, 4},
  };
  for (const auto& e : ptrs) {
    if (!e.needed) continue;
    if (e.ptr == nullptr) return Fail(err, err_len, "jax_flash_bwd_sm80: %s is NULL", e.name);
    if (!Aligned(e.ptr, e.align))
      return Fail(err, err_len, "jax_flash_bwd_sm80: %s must be %d-byte aligned", e.name, int(e.align));
  }

  cudaError_t e = cudaSuccess;
  if (q_elems > 0) {
    e = cudaMemsetAsync(args->dq_accum, 0, q_elems * sizeof(float), stream);
    if (e != cudaSuccess) return Fail(err, err_len, "jax_flash_bwd_sm80: zeroing dq_accum: %s", cudaGetErrorString(e));
  }
  if (q_elems == 0 || kv_elems == 0) {
    // No query or no key: every gradient is zero.
    if (kv_elems > 0) {
      e = cudaMemsetAsync(args->dk, 0, kv_elems * elem, stream);
      if (e == cudaSuccess) e = cudaMemsetAsync(args->dv, 0, kv_elems * elem, stream);
      if (e != cudaSuccess) return Fail(err, err_len, "jax_flash_bwd_sm80: zeroing dk/dv: %s", cudaGetErrorString(e));
    }
    return 0;
  }

  int arch = 0;
  if (CurrentArch(err, err_len, &arch) != 0) return 1;
  LaunchFn launch = FindVariant(arch, p.dtype, D, seg);
  if (launch == nullptr)
    return Fail(err, err_len, "jax_flash_bwd_sm80: no kernel for compute capability %d.x (needs 8.x or 9.x)",
                arch > 0 ? arch / 10 : -arch);

  // Visible pairs satisfy key_lo <= j - i <= key_hi. |j - i| < T + S, so a
  // bound past that is the same as none, and clamping keeps int32 safe.
  const int64_t reach = int64_t{T} + S + 1;
  int64_t lo = p.window_left < 0 ? -reach : int64_t{p.diag_offset} - p.window_left;
  int64_t hi = p.window_right < 0 ? reach : int64_t{p.diag_offset} + p.window_right;
  lo = std::min(std::max(lo, -reach), reach);
  hi = std::min(std::max(hi, -reach), reach);

  LaunchArgs a;
  a.q = MakeBthd(args->q, B, T, Hq, D);
  a.k = MakeBthd(args->k, B, S, Hkv, D);
  a.v = MakeBthd(args->v, B, S, Hkv, D);
  a.dout = MakeBthd(args->dout, B, T, Hq, D);
  a.dq = MakeBthd(args->dq_accum, B, T, Hq, D);
  a.dk = MakeBthd(args->dk, B, S, Hkv, D);
  a.dv = MakeBthd(args->dv, B, S, Hkv, D);
  a.lse = MakeBht(args->lse, B, Hq, T);
  a.delta = MakeBht(args->delta, B, Hq, T);
  a.q_lens = Lens{const_cast<int32_t*>(args->q_lens), {B}};
  a.kv_lens = Lens{const_cast<int32_t*>(args->kv_lens), {B}};
  a.q_seg = SegIds{const_cast<int32_t*>(args->q_segment_ids), {B, T}, {int64_t{T}}};
  a.kv_seg = SegIds{const_cast<int32_t*>(args->kv_segment_ids), {B, S}, {int64_t{S}}};
  a.q_bounds = Bounds{const_cast<int32_t*>(args->q_bounds), {B, S}, {int64_t{S} * 2}};
  a.scale = p.scale;
  a.key_lo = int32_t(lo);
  a.key_hi = int32_t(hi);

  if (launch(a, stream, err, err_len) != 0) return 1;
  e = cudaGetLastError();
  if (e != cudaSuccess) return Fail(err, err_len, "jax_flash_bwd_sm80: kernel launch: %s", cudaGetErrorString(e));
  return 0;
}
