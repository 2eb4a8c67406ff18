// The per-variant launch functions shared by the forward launchers
// (fwd_sm80, fwd_sm90): both families export kernels with the same operand
// list, so the code that fills the generated tensor descriptors is one macro.
//
// The including file defines JF_FWD_ENTRY (its entry point's name, a string
// literal, used in messages) and then expands its variant lists with
// JF_DEFINE_FWD_VARIANT / JF_DEFINE_FWD_SEG_VARIANT inside its anonymous
// namespace, where Fail, EnsureLoaded, LoadedModule and Prod are visible.
#ifndef JAX_FLASH_FWD_LAUNCH_COMMON_H_
#define JAX_FLASH_FWD_LAUNCH_COMMON_H_

#include <cstdint>

namespace jax_flash_launch {

inline int64_t Prod(int64_t a, int64_t b, int64_t c = 1) { return a * b * c; }

}  // namespace jax_flash_launch

// Expands to one function per exported variant that fills the tensor
// descriptors (only dynamic modes: shapes [B, T|S, N], strides [B, T|S] for
// the 4-D operands, shapes [B, N, T] / strides [B, N] for lse) and launches.
// EXTRA_TENSORS declares the descriptors of the operands after the stream and
// EXTRA_ARGS passes them: none for fwd_sm80's plain variants; the segment
// variants append those of JF_FWD_SEG_TENSORS (the forward needs no
// q_bounds); fwd_sm90 passes its sinks first.
#define JF_DEFINE_FWD_LAUNCH(prefix, EXTRA_TENSORS, EXTRA_ARGS)                      \
  LoadedModule<prefix##_Kernel_Module_t> g_##prefix;                              \
  int Launch_##prefix(const JfFwdArgs& a, cudaStream_t stream, char* err,         \
                      size_t err_len) {                                           \
    cudaError_t load = EnsureLoaded(g_##prefix, prefix##_Kernel_Module_Load);     \
    if (load != cudaSuccess) {                                                    \
      return Fail(err, err_len, JF_FWD_ENTRY ": loading " #prefix ": %s",         \
                  cudaGetErrorString(load));                                      \
    }                                                                             \
    const JfProblem& p = a.problem;                                               \
    EXTRA_TENSORS(prefix)                                                         \
    const int64_t h = p.head_dim;                                                 \
    const int64_t hv = p.head_dim_v;                                              \
    prefix##_Tensor_mQ_t q = {const_cast<void*>(a.q),                             \
                              {p.batch, p.seqlen_q, p.heads_q},                   \
                              {Prod(p.seqlen_q, p.heads_q, h), Prod(p.heads_q, h)}}; \
    prefix##_Tensor_mK_t k = {const_cast<void*>(a.k),                             \
                              {p.batch, p.seqlen_k, p.heads_kv},                  \
                              {Prod(p.seqlen_k, p.heads_kv, h), Prod(p.heads_kv, h)}}; \
    prefix##_Tensor_mV_t v = {const_cast<void*>(a.v),                             \
                              {p.batch, p.seqlen_k, p.heads_kv},                  \
                              {Prod(p.seqlen_k, p.heads_kv, hv), Prod(p.heads_kv, hv)}}; \
    prefix##_Tensor_mO_t o = {a.o,                                                \
                              {p.batch, p.seqlen_q, p.heads_q},                   \
                              {Prod(p.seqlen_q, p.heads_q, hv), Prod(p.heads_q, hv)}}; \
    prefix##_Tensor_mLSE_t lse = {a.lse,                                          \
                                  {p.batch, p.heads_q, p.seqlen_q},               \
                                  {Prod(p.heads_q, p.seqlen_q), p.seqlen_q}};     \
    prefix##_Tensor_mQLens_t q_lens = {const_cast<int32_t*>(a.q_lens), {p.batch}}; \
    prefix##_Tensor_mKVLens_t kv_lens = {const_cast<int32_t*>(a.kv_lens), {p.batch}}; \
    int32_t rc = cute_dsl_##prefix##_wrapper(                                     \
        &g_##prefix.module, &q, &k, &v, &o, &lse, &q_lens, &kv_lens, p.scale,     \
        p.softcap,                                                                \
        p.diag_offset, p.window_left, p.window_right, stream EXTRA_ARGS);         \
    if (rc != 0) {                                                                \
      return Fail(err, err_len, JF_FWD_ENTRY ": " #prefix " returned %d", rc);    \
    }                                                                             \
    return 0;                                                                     \
  }

#define JF_FWD_NO_SEG_TENSORS(prefix)
#define JF_FWD_SEG_TENSORS(prefix)                                                 \
  prefix##_Tensor_mQSeg_t q_seg = {const_cast<int32_t*>(a.q_segment_ids),         \
                                   {p.batch, p.seqlen_q}, {p.seqlen_q}};          \
  prefix##_Tensor_mKVSeg_t kv_seg = {const_cast<int32_t*>(a.kv_segment_ids),      \
                                     {p.batch, p.seqlen_k}, {p.seqlen_k}};        \
  prefix##_Tensor_mKVBounds_t kv_bounds = {const_cast<int32_t*>(a.kv_bounds),     \
                                           {p.batch, p.seqlen_q},                 \
                                           {Prod(p.seqlen_q, 2)}};
#define JF_FWD_SEG_ARGS , &q_seg, &kv_seg, &kv_bounds
#define JF_DEFINE_FWD_VARIANT(arch_tag, dtype_enum, hd, prefix) \
  JF_DEFINE_FWD_LAUNCH(prefix, JF_FWD_NO_SEG_TENSORS, )
#define JF_DEFINE_FWD_SEG_VARIANT(arch_tag, dtype_enum, hd, prefix) \
  JF_DEFINE_FWD_LAUNCH(prefix, JF_FWD_SEG_TENSORS, JF_FWD_SEG_ARGS)

#endif  // JAX_FLASH_FWD_LAUNCH_COMMON_H_
