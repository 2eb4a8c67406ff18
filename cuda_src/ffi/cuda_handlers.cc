// CUDA FFI handlers. They live in a plain C-ABI shared library (no Python
// inside), so one build serves every Python version; jax_flash loads it with
// ctypes and registers the exported symbols below.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "attention_ffi.h"
#include "fp8_ffi.h"
#include "mla_ffi.h"
#include "paged_ffi.h"

namespace jax_flash {
namespace {

// Counts handler executions. When XLA replays a recorded CUDA graph it does
// not call the handler, which is how tests/test_cuda_graphs.py sees capture.
std::atomic<int64_t> g_handler_calls{0};

// The newest kernels that serve the problem: sm90 on Hopper when built and
// able, else the sm80 family (which runs on every GPU from Ampere on).
int LaunchForward(const JfFwdArgs& args, cudaStream_t stream, char* err, size_t n) {
#ifdef JF_HAVE_FWD_SM90
  if (jax_flash_fwd_sm90_can_implement(&args.problem)) {
    return jax_flash_fwd_sm90(&args, stream, err, n);
  }
#endif
  return jax_flash_fwd_sm80(&args, stream, err, n);
}

// The backward also by dq_accum's layout: a module serialized before the
// sm90 kernels took dQ in query tiles passes q's layout, which the sm80
// kernels take (kernel_api.h: dq_tile_rows).
int LaunchBackward(const JfBwdArgs& args, cudaStream_t stream, char* err, size_t n) {
#ifdef JF_HAVE_BWD_SM90
  const JfProblem& p = args.problem;
  if (jax_flash_bwd_sm90_can_implement(&p) &&
      args.dq_tile_rows == jax_flash_bwd_sm90_dq_tile_rows(p.head_dim, p.head_dim_v)) {
    return jax_flash_bwd_sm90(&args, stream, err, n);
  }
#endif
  return jax_flash_bwd_sm80(&args, stream, err, n);
}

ffi::Error FwdCudaWith(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                       const SegmentBuffers& segments, const ffi::AnyBuffer* sinks,
                       ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                       float scale, int32_t diag_offset, int32_t window_left,
                       int32_t window_right, float softcap) {
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  auto launch = [stream](const JfFwdArgs& args) {
    return CallKernel([&](char* err, size_t n) { return LaunchForward(args, stream, err, n); });
  };
  return AttentionForward(launch, q, k, v, q_lens, kv_lens, segments, o, lse, scale, diag_offset,
                          window_left, window_right, Options{softcap, 0}, sinks);
}

// v3: the sinks after q_bounds (attention_ffi.h: ReadSinks), which only the
// sm90 kernels take (the sm80 launcher refuses them).
ffi::Error FwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_ids,
                   ffi::AnyBuffer kv_ids, ffi::AnyBuffer kv_bounds, ffi::AnyBuffer q_bounds,
                   ffi::AnyBuffer sinks, ffi::Result<ffi::AnyBuffer> o,
                   ffi::Result<ffi::AnyBuffer> lse, float scale, int32_t diag_offset,
                   int32_t window_left, int32_t window_right, float softcap) {
  return FwdCudaWith(stream, q, k, v, q_lens, kv_lens,
                     SegmentBuffers{q_ids, kv_ids, kv_bounds, q_bounds}, &sinks, o, lse, scale,
                     diag_offset, window_left, window_right, softcap);
}

ffi::Error FwdCudaV2(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_ids,
                     ffi::AnyBuffer kv_ids, ffi::AnyBuffer kv_bounds, ffi::AnyBuffer q_bounds,
                     ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale,
                     int32_t diag_offset, int32_t window_left, int32_t window_right,
                     float softcap) {
  return FwdCudaWith(stream, q, k, v, q_lens, kv_lens,
                     SegmentBuffers{q_ids, kv_ids, kv_bounds, q_bounds}, nullptr, o, lse, scale,
                     diag_offset, window_left, window_right, softcap);
}

ffi::Error FwdCudaV1(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_ids,
                     ffi::AnyBuffer kv_ids, ffi::AnyBuffer kv_bounds, ffi::AnyBuffer q_bounds,
                     ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale,
                     int32_t diag_offset, int32_t window_left, int32_t window_right) {
  return FwdCudaV2(stream, q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds, o, lse,
                   scale, diag_offset, window_left, window_right, 0.0f);
}

ffi::Error BwdCudaWith(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer delta,
                       ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                       const SegmentBuffers& segments, ffi::Result<ffi::AnyBuffer> dq_accum,
                       ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                       ffi::AnyBuffer* dq_semaphore, float scale, int32_t diag_offset,
                       int32_t window_left, int32_t window_right, const Options& options) {
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  auto launch = [stream](const JfBwdArgs& args) {
    return CallKernel([&](char* err, size_t n) { return LaunchBackward(args, stream, err, n); });
  };
  return AttentionBackward(launch, q, k, v, dout, lse, delta, q_lens, kv_lens, segments, dq_accum,
                           dk, dv, dq_semaphore, scale, diag_offset, window_left, window_right,
                           options);
}

ffi::Error BwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer delta,
                   ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_ids,
                   ffi::AnyBuffer kv_ids, ffi::AnyBuffer kv_bounds, ffi::AnyBuffer q_bounds,
                   ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> dk,
                   ffi::Result<ffi::AnyBuffer> dv, float scale, int32_t diag_offset,
                   int32_t window_left, int32_t window_right,
                   ffi::Result<ffi::AnyBuffer> dq_semaphore, float softcap,
                   int32_t deterministic) {
  return BwdCudaWith(stream, q, k, v, dout, lse, delta, q_lens, kv_lens,
                     SegmentBuffers{q_ids, kv_ids, kv_bounds, q_bounds}, dq_accum, dk, dv,
                     &*dq_semaphore, scale, diag_offset, window_left, window_right,
                     Options{softcap, deterministic});
}

ffi::Error BwdCudaV1(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer delta,
                     ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_ids,
                     ffi::AnyBuffer kv_ids, ffi::AnyBuffer kv_bounds, ffi::AnyBuffer q_bounds,
                     ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> dk,
                     ffi::Result<ffi::AnyBuffer> dv, float scale, int32_t diag_offset,
                     int32_t window_left, int32_t window_right) {
  return BwdCudaWith(stream, q, k, v, dout, lse, delta, q_lens, kv_lens,
                     SegmentBuffers{q_ids, kv_ids, kv_bounds, q_bounds}, dq_accum, dk, dv, nullptr,
                     scale, diag_offset, window_left, window_right, Options{});
}

ffi::Error PagedFwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                        ffi::AnyBuffer v_pages, ffi::AnyBuffer page_table, ffi::AnyBuffer q_lens,
                        ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::AnyBuffer> lse, float scale, float softcap,
                        int32_t window_left, int32_t window_right, int32_t split_pages) {
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  // Hopper's kernel where it serves (its head dims on a Hopper GPU), else
  // the sm80 family's (8.x, and 9.x for the head dims Hopper's lacks).
  auto launch = [stream](const JfPagedFwdArgs& args) {
    return CallKernel([&](char* err, size_t n) {
#ifdef JF_HAVE_FWD_SM90
      if (jax_flash_fwd_sm90_paged_can_implement(&args)) {
        return jax_flash_fwd_sm90_paged(&args, stream, err, n);
      }
#endif
      return jax_flash_fwd_sm80_paged(&args, stream, err, n);
    });
  };
  return PagedForward(launch, q, k_pages, v_pages, page_table, q_lens, kv_lens, o, lse, scale,
                      softcap, window_left, window_right, split_pages);
}

ffi::Error PagedFp8FwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                           ffi::AnyBuffer v_pages, ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                           ffi::AnyBuffer page_table, ffi::AnyBuffer q_lens,
                           ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> o,
                           ffi::Result<ffi::AnyBuffer> lse, float scale, float softcap,
                           int32_t window_left, int32_t window_right, int32_t split_pages) {
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  auto launch = [stream](const JfPagedFp8FwdArgs& args) {
    return CallKernel([&](char* err, size_t n) {
#ifdef JF_HAVE_FWD_SM90
      return jax_flash_fwd_sm90_paged_fp8(&args, stream, err, n);
#else
      std::snprintf(err, n, "this build holds no Hopper kernels for the FP8 paged cache");
      return 1;
#endif
    });
  };
  return PagedFp8Forward(launch, q, k_pages, v_pages, k_scales, v_scales, page_table, q_lens,
                         kv_lens, o, lse, scale, softcap, window_left, window_right, split_pages);
}

ffi::Error Fp8FwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v_t,
                      ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_descale,
                      ffi::AnyBuffer k_descale, ffi::AnyBuffer v_descale,
                      ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale,
                      int32_t diag_offset, int32_t window_left, int32_t window_right) {
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  auto launch = [stream](const JfFp8FwdArgs& args) {
    return CallKernel([&](char* err, size_t n) {
#ifdef JF_HAVE_FWD_SM90
      return jax_flash_fwd_sm90_fp8(&args, stream, err, n);
#else
      std::snprintf(err, n, "this build holds no Hopper kernels for FP8 attention");
      return 1;
#endif
    });
  };
  return Fp8Forward(launch, q, k, v_t, q_lens, kv_lens, q_descale, k_descale, v_descale, o, lse,
                    scale, diag_offset, window_left, window_right);
}

ffi::Error MlaDecodeCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer cache,
                         ffi::AnyBuffer page_table, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                         ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                         float scale, int32_t split_pages) {
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  auto launch = [stream](const JfMlaDecodeArgs& args) {
    return CallKernel([&](char* err, size_t n) {
#ifdef JF_HAVE_MLA_SM90
      return jax_flash_mla_sm90(&args, stream, err, n);
#else
      std::snprintf(err, n, "this build holds no Hopper kernels for MLA decoding");
      return 1;
#endif
    });
  };
  return MlaDecode(launch, q, cache, page_table, q_lens, kv_lens, o, lse, scale, split_pages);
}

ffi::Error MlaFp8DecodeCuda(cudaStream_t stream, ffi::AnyBuffer q_codes, ffi::AnyBuffer q_scales,
                            ffi::AnyBuffer q_rope, ffi::AnyBuffer latent, ffi::AnyBuffer scales,
                            ffi::AnyBuffer rope, ffi::AnyBuffer page_table,
                            ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                            ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                            float scale, int32_t split_pages) {
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  auto launch = [stream](const JfMlaFp8Sm90Args& args) {
    return CallKernel([&](char* err, size_t n) {
#ifdef JF_HAVE_MLA_SM90
      return jax_flash_mla_sm90_fp8(&args, stream, err, n);
#else
      std::snprintf(err, n, "this build holds no Hopper kernels for MLA decoding");
      return 1;
#endif
    });
  };
  return MlaFp8QuantisedDecode(launch, q_codes, q_scales, q_rope, latent, scales, rope, page_table,
                               q_lens, kv_lens, o, lse, scale, split_pages);
}

}  // namespace
}  // namespace jax_flash

extern "C" int64_t JaxFlashCudaHandlerCalls() {
  return jax_flash::g_handler_calls.load(std::memory_order_relaxed);
}

// Command-buffer (CUDA graph) compatible: the handlers only enqueue kernels
// and memsets on XLA's stream; tests/test_cuda_graphs.py checks that XLA
// replays them from a graph and that the results do not change.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashFwdCuda, jax_flash::FwdCuda,
    jax_flash::BindForwardV3(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashFwdCudaV2, jax_flash::FwdCudaV2,
    jax_flash::BindForwardV2(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashBwdCuda, jax_flash::BwdCuda,
    jax_flash::BindBackward(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashFwdCudaV1, jax_flash::FwdCudaV1,
    jax_flash::BindForwardV1(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashBwdCudaV1, jax_flash::BwdCudaV1,
    jax_flash::BindBackwardV1(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashPagedFwdCuda, jax_flash::PagedFwdCuda,
    jax_flash::BindPagedForward(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashPagedFp8FwdCuda, jax_flash::PagedFp8FwdCuda,
    jax_flash::BindPagedFp8Forward(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashMlaDecodeCuda, jax_flash::MlaDecodeCuda,
    jax_flash::BindMlaDecode(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashFp8FwdCuda, jax_flash::Fp8FwdCuda,
    jax_flash::BindFp8Forward(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashMlaFp8DecodeCuda, jax_flash::MlaFp8DecodeCuda,
    jax_flash::BindMlaFp8QuantisedDecode(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
