// What the backward launchers (bwd_sm80, bwd_sm90) share: the operand
// checks, the zero-gradient shortcut for empty problems, and the tensor
// descriptors the exported wrappers take. Messages start with `who`, the
// entry point's name, so each family reports under its own name.

#ifndef JAX_FLASH_COMMON_BWD_LAUNCH_COMMON_H_
#define JAX_FLASH_COMMON_BWD_LAUNCH_COMMON_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "jax_flash/kernel_api.h"
#include "launch_common.h"

namespace jax_flash_launch {

// Tensor descriptors as the exported wrappers take them: the data pointer,
// the dynamic extents (every mode but head_dim) and the dynamic strides (all
// but the two innermost, which are head_dim and 1 or just 1), in mode order.
struct Bthd {  // [batch, seqlen, heads, head_dim] (v, dout, dv: head_dim_v)
  void* data;
  int32_t shape[3];
  int64_t stride[2];
};
struct Bht {  // [batch, heads, seqlen] (or query tiles)
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

struct BwdLaunchArgs {
  Bthd q, k, v, dout, dq, dk, dv;
  Bht lse, delta;
  Bht dq_sem;  // read by the deterministic backward only
  Lens q_lens, kv_lens;
  SegIds q_seg, kv_seg;  // read by the segment variants only
  Bounds q_bounds;
  float scale, softcap;
  int32_t key_lo, key_hi;
  // 0, or nonzero for a deterministic backward: the sm80 kernels read a
  // flag, the sm90 ones how many CTAs may wait on each other (launch.cc).
  int32_t deterministic;
};

// Query tiles per (batch, head) and dQ chain in dq_semaphore (kernel_api.h).
inline int32_t SemaphoreTiles(int32_t seqlen_q) { return (seqlen_q + 31) / 32; }

// Element counts of the problem's query-side and key-side tensors: q (and
// dq_accum), k (and dk), v (and dv, head_dim_v wide).
struct BwdSizes {
  size_t q_elems;
  size_t kv_elems;
  size_t v_elems;
};

inline BwdSizes SizesOf(const JfProblem& p) {
  const size_t keys = size_t(p.batch) * p.seqlen_k * p.heads_kv;
  return {size_t(p.batch) * p.seqlen_q * p.heads_q * p.head_dim, keys * p.head_dim, keys * p.head_dim_v};
}

// Rows of one dQ chain in query tiles of `tile_rows` (kernel_api.h:
// dq_tile_rows): every (batch, head)'s rows rounded up to whole tiles.
inline size_t DqTileChainRows(const JfProblem& p, int32_t tile_rows) {
  const size_t tiles = (size_t(p.seqlen_q) + tile_rows - 1) / tile_rows;
  return size_t(p.batch) * p.heads_q * tiles * tile_rows;
}

// Floats of one dQ chain in dq_accum's layout.
inline size_t DqChainElems(const JfBwdArgs* args, BwdSizes n) {
  return args->dq_tile_rows > 0 ? DqTileChainRows(args->problem, args->dq_tile_rows) * args->problem.head_dim
                                : n.q_elems;
}

// Every operand the problem reads or writes must be present and aligned as
// the kernels' vector accesses need; the segment tensors only when seg.
inline int CheckBwdOperands(const JfBwdArgs* args, BwdSizes n, bool seg, const char* who, char* err,
                            size_t err_len) {
  const bool has_q = n.q_elems > 0, has_kv = n.kv_elems > 0, has_batch = args->problem.batch > 0;
  struct {
    const void* ptr;
    const char* name;
    bool needed;
    uintptr_t align;
  } const ptrs[] = {
      {args->q, "q", has_q, 16},          {args->k, "k", has_kv, 16},
      {args->v, "v", has_kv, 16},         {args->dout, "dout", has_q, 16},
      {args->lse, "lse", has_q, 4},       {args->delta, "delta", has_q, 4},
      {args->q_lens, "q_lens", has_batch, 4}, {args->kv_lens, "kv_lens", has_batch, 4},
      {args->dq_accum, "dq_accum", has_q, 16}, {args->dk, "dk", has_kv, 16},
      {args->dv, "dv", has_kv, 16},
      {args->dq_semaphore, "dq_semaphore", args->problem.deterministic == 1 && has_q, 4},
      {args->q_segment_ids, "q_segment_ids", seg && has_q && has_kv, 4},
      {args->kv_segment_ids, "kv_segment_ids", seg && has_q && has_kv, 4},
      {args->q_bounds, "q_bounds", seg && has_q && has_kv, 4},
  };
  if (args->dq_chains < 1 || args->dq_chains > JF_MAX_DQ_CHAINS ||
      (args->dq_chains > 1 && args->problem.deterministic != 1))
    return Fail(err, err_len, "%s: dq_chains must be 1, or up to %d with deterministic = 1; got %d", who,
                JF_MAX_DQ_CHAINS, int(args->dq_chains));
  if (args->dq_tile_rows < 0)
    return Fail(err, err_len, "%s: dq_tile_rows must be >= 0, got %d", who, int(args->dq_tile_rows));
  for (const auto& e : ptrs) {
    if (!e.needed) continue;
    if (e.ptr == nullptr) return Fail(err, err_len, "%s: %s is NULL", who, e.name);
    if (!IsAligned(e.ptr, e.align))
      return Fail(err, err_len, "%s: %s must be %d-byte aligned", who, e.name, int(e.align));
  }
  return 0;
}

// Zeroes dq_accum, every chain of it (the kernels add into it), unless the
// kernel writes it itself (zero_dq false) and there are keys to launch it for.
// When there is no query or no key every gradient is zero, so dk and dv are
// zeroed too and *done is set: nothing is left to launch.
inline int ZeroBwdOutputs(const JfBwdArgs* args, BwdSizes n, cudaStream_t stream, const char* who,
                          char* err, size_t err_len, bool* done, bool zero_dq = true) {
  constexpr size_t kElemBytes = 2;  // float16 / bfloat16
  *done = false;
  cudaError_t e = cudaSuccess;
  if (n.q_elems > 0 && (zero_dq || n.kv_elems == 0)) {
    e = cudaMemsetAsync(args->dq_accum, 0, args->dq_chains * DqChainElems(args, n) * sizeof(float), stream);
    if (e != cudaSuccess) return Fail(err, err_len, "%s: zeroing dq_accum: %s", who, cudaGetErrorString(e));
  }
  const JfProblem& p = args->problem;
  if (n.q_elems > 0 && p.deterministic == 1) {
    const size_t turns = size_t(p.batch) * p.heads_q * args->dq_chains * SemaphoreTiles(p.seqlen_q);
    e = cudaMemsetAsync(args->dq_semaphore, 0, turns * sizeof(int32_t), stream);
    if (e != cudaSuccess) return Fail(err, err_len, "%s: zeroing dq_semaphore: %s", who, cudaGetErrorString(e));
  }
  if (n.q_elems == 0 || n.kv_elems == 0) {
    if (n.kv_elems > 0) {
      e = cudaMemsetAsync(args->dk, 0, n.kv_elems * kElemBytes, stream);
      if (e == cudaSuccess) e = cudaMemsetAsync(args->dv, 0, n.v_elems * kElemBytes, stream);
      if (e != cudaSuccess) return Fail(err, err_len, "%s: zeroing dk/dv: %s", who, cudaGetErrorString(e));
    }
    *done = true;
  }
  return 0;
}

// Which object family the current device runs: 90 for compute capability
// 9.x, 80 for 8.x when the family has sm_80 objects, else -major (none).
inline int CurrentBwdArch(bool has_sm80, const char* who, char* err, size_t err_len, int* arch) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return Fail(err, err_len, "%s: cudaGetDevice: %s", who, cudaGetErrorString(e));
  int major = 0;
  e = ComputeCapabilityMajor(device, &major);
  if (e != cudaSuccess) return Fail(err, err_len, "%s: cudaDeviceGetAttribute: %s", who, cudaGetErrorString(e));
  *arch = (major == 8 && has_sm80) ? 80 : major == 9 ? 90 : -major;
  return 0;
}

inline BwdLaunchArgs MakeBwdLaunchArgs(const JfBwdArgs* args) {
  const JfProblem& p = args->problem;
  const int32_t B = p.batch, T = p.seqlen_q, S = p.seqlen_k, Hq = p.heads_q, Hkv = p.heads_kv;
  auto bthd = [&](const void* ptr, int32_t t, int32_t h, int32_t d) {
    return Bthd{const_cast<void*>(ptr), {B, t, h}, {int64_t{t} * h * d, int64_t{h} * d}};
  };
  auto bht = [&](const void* ptr) {
    return Bht{const_cast<void*>(ptr), {B, Hq, T}, {int64_t{Hq} * T, int64_t{T}}};
  };
  // Visible pairs satisfy key_lo <= j - i <= key_hi. |j - i| < T + S, so a
  // bound past that is the same as none, and clamping keeps int32 safe.
  const int64_t reach = int64_t{T} + S + 1;
  int64_t lo = p.window_left < 0 ? -reach : int64_t{p.diag_offset} - p.window_left;
  int64_t hi = p.window_right < 0 ? reach : int64_t{p.diag_offset} + p.window_right;
  lo = std::min(std::max(lo, -reach), reach);
  hi = std::min(std::max(hi, -reach), reach);

  BwdLaunchArgs a;
  const int32_t D = p.head_dim, Dv = p.head_dim_v;
  a.q = bthd(args->q, T, Hq, D);
  a.k = bthd(args->k, S, Hkv, D);
  a.v = bthd(args->v, S, Hkv, Dv);
  a.dout = bthd(args->dout, T, Hq, Dv);
  a.dq = bthd(args->dq_accum, T, Hq, D);  // the first chain (the sm90 launcher may widen it)
  a.dk = bthd(args->dk, S, Hkv, D);
  a.dv = bthd(args->dv, S, Hkv, Dv);
  a.lse = bht(args->lse);
  a.delta = bht(args->delta);
  const int32_t tiles = args->dq_chains * SemaphoreTiles(T);
  a.dq_sem = Bht{args->dq_semaphore, {B, Hq, tiles}, {int64_t{Hq} * tiles, int64_t{tiles}}};
  a.q_lens = Lens{const_cast<int32_t*>(args->q_lens), {B}};
  a.kv_lens = Lens{const_cast<int32_t*>(args->kv_lens), {B}};
  a.q_seg = SegIds{const_cast<int32_t*>(args->q_segment_ids), {B, T}, {int64_t{T}}};
  a.kv_seg = SegIds{const_cast<int32_t*>(args->kv_segment_ids), {B, S}, {int64_t{S}}};
  a.q_bounds = Bounds{const_cast<int32_t*>(args->q_bounds), {B, S}, {int64_t{S} * 2}};
  a.scale = p.scale;
  a.softcap = p.softcap;
  a.key_lo = int32_t(lo);
  a.key_hi = int32_t(hi);
  a.deterministic = p.deterministic;
  return a;
}

}  // namespace jax_flash_launch

// Defines Launch_<PREFIX>(const BwdLaunchArgs&, stream, err, err_len) for one
// exported variant: load its module once and call its wrapper, whose tensor
// structs have the same layout as ours. SEG_ARGS(PREFIX) is empty for the
// plain variants and appends the segment tensors for the has_segments ones.
#define JF_BWD_DEFINE_LAUNCH_WITH(WHO, PREFIX, SEG_ARGS)                                           \
  ::jax_flash_launch::LoadedModule<PREFIX##_Kernel_Module_t> g_##PREFIX;                             \
  int Launch_##PREFIX(const ::jax_flash_launch::BwdLaunchArgs& a, cudaStream_t stream, char* err,    \
                      size_t err_len) {                                                              \
    using namespace ::jax_flash_launch;                                                              \
    cudaError_t load = EnsureLoaded(g_##PREFIX, PREFIX##_Kernel_Module_Load);                        \
    if (load != cudaSuccess)                                                                         \
      return Fail(err, err_len, WHO ": loading " #PREFIX " failed: %s", cudaGetErrorString(load));  \
    auto* q = reinterpret_cast<PREFIX##_Tensor_mQ_t*>(const_cast<Bthd*>(&a.q));                      \
    auto* k = reinterpret_cast<PREFIX##_Tensor_mK_t*>(const_cast<Bthd*>(&a.k));                      \
    auto* v = reinterpret_cast<PREFIX##_Tensor_mV_t*>(const_cast<Bthd*>(&a.v));                      \
    auto* dout = reinterpret_cast<PREFIX##_Tensor_mdO_t*>(const_cast<Bthd*>(&a.dout));               \
    auto* lse = reinterpret_cast<PREFIX##_Tensor_mLSE_t*>(const_cast<Bht*>(&a.lse));                 \
    auto* delta = reinterpret_cast<PREFIX##_Tensor_mDelta_t*>(const_cast<Bht*>(&a.delta));           \
    auto* ql = reinterpret_cast<PREFIX##_Tensor_mQLens_t*>(const_cast<Lens*>(&a.q_lens));            \
    auto* kl = reinterpret_cast<PREFIX##_Tensor_mKVLens_t*>(const_cast<Lens*>(&a.kv_lens));          \
    auto* dq = reinterpret_cast<PREFIX##_Tensor_mdQ_t*>(const_cast<Bthd*>(&a.dq));                   \
    auto* dk = reinterpret_cast<PREFIX##_Tensor_mdK_t*>(const_cast<Bthd*>(&a.dk));                   \
    auto* dv = reinterpret_cast<PREFIX##_Tensor_mdV_t*>(const_cast<Bthd*>(&a.dv));                   \
    auto* sem = reinterpret_cast<PREFIX##_Tensor_mDqSem_t*>(const_cast<Bht*>(&a.dq_sem));            \
    int32_t rc = cute_dsl_##PREFIX##_wrapper(&g_##PREFIX.module, q, k, v, dout, lse, delta, ql, kl,  \
                                             dq, dk, dv, sem, a.scale, a.softcap, a.key_lo,          \
                                             a.key_hi, a.deterministic, stream SEG_ARGS(PREFIX));   \
    if (rc != 0) return Fail(err, err_len, WHO ": " #PREFIX " returned %d", rc);                    \
    return 0;                                                                                        \
  }
#define JF_BWD_NO_SEG_ARGS(PREFIX)

#endif  // JAX_FLASH_COMMON_BWD_LAUNCH_COMMON_H_
