// CPU FFI handlers and the nanobind module that hands them to Python.
#include <nanobind/nanobind.h>

#include "attention_ffi.h"
#include "mla_ffi.h"
#include "paged_ffi.h"

namespace jax_flash {
namespace {

ffi::Error LaunchFwdCpu(const JfFwdArgs& args) {
  return CallKernel([&](char* err, size_t n) { return jax_flash_fwd_cpu(&args, err, n); });
}

ffi::Error LaunchBwdCpu(const JfBwdArgs& args) {
  return CallKernel([&](char* err, size_t n) { return jax_flash_bwd_cpu(&args, err, n); });
}

ffi::Error FwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer q_lens,
                  ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_ids, ffi::AnyBuffer kv_ids,
                  ffi::AnyBuffer kv_bounds, ffi::AnyBuffer q_bounds, ffi::Result<ffi::AnyBuffer> o,
                  ffi::Result<ffi::AnyBuffer> lse, float scale, int32_t diag_offset,
                  int32_t window_left, int32_t window_right, float softcap) {
  return AttentionForward(LaunchFwdCpu, q, k, v, q_lens, kv_lens,
                          SegmentBuffers{q_ids, kv_ids, kv_bounds, q_bounds}, o, lse, scale,
                          diag_offset, window_left, window_right, Options{softcap, 0});
}

ffi::Error FwdCpuV1(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer q_lens,
                    ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_ids, ffi::AnyBuffer kv_ids,
                    ffi::AnyBuffer kv_bounds, ffi::AnyBuffer q_bounds,
                    ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale,
                    int32_t diag_offset, int32_t window_left, int32_t window_right) {
  return FwdCpu(q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds, o, lse, scale,
                diag_offset, window_left, window_right, 0.0f);
}

ffi::Error BwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dout,
                  ffi::AnyBuffer lse, ffi::AnyBuffer delta, ffi::AnyBuffer q_lens,
                  ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_ids, ffi::AnyBuffer kv_ids,
                  ffi::AnyBuffer kv_bounds, ffi::AnyBuffer q_bounds,
                  ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> dk,
                  ffi::Result<ffi::AnyBuffer> dv, float scale, int32_t diag_offset,
                  int32_t window_left, int32_t window_right,
                  ffi::Result<ffi::AnyBuffer> dq_semaphore, float softcap,
                  int32_t deterministic) {
  // The CPU kernels are deterministic by construction; dq_semaphore is unused.
  return AttentionBackward(LaunchBwdCpu, q, k, v, dout, lse, delta, q_lens, kv_lens,
                           SegmentBuffers{q_ids, kv_ids, kv_bounds, q_bounds}, dq_accum, dk, dv,
                           &*dq_semaphore, scale, diag_offset, window_left, window_right,
                           Options{softcap, deterministic});
}

ffi::Error BwdCpuV1(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dout,
                    ffi::AnyBuffer lse, ffi::AnyBuffer delta, ffi::AnyBuffer q_lens,
                    ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_ids, ffi::AnyBuffer kv_ids,
                    ffi::AnyBuffer kv_bounds, ffi::AnyBuffer q_bounds,
                    ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, float scale, int32_t diag_offset,
                    int32_t window_left, int32_t window_right) {
  return AttentionBackward(LaunchBwdCpu, q, k, v, dout, lse, delta, q_lens, kv_lens,
                           SegmentBuffers{q_ids, kv_ids, kv_bounds, q_bounds}, dq_accum, dk, dv,
                           nullptr, scale, diag_offset, window_left, window_right, Options{});
}

// The paged forward (paged_ffi.h), each sequence in one split.
ffi::Error PagedFwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                       ffi::AnyBuffer page_table, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                       ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                       float scale, float softcap, int32_t window_left, int32_t window_right,
                       int32_t split_pages) {
  auto launch = [](const JfPagedFwdArgs& args) {
    return CallKernel([&](char* err, size_t n) { return jax_flash_paged_fwd_cpu(&args, err, n); });
  };
  return PagedForward(launch, q, k_pages, v_pages, page_table, q_lens, kv_lens, o, lse, scale,
                      softcap, window_left, window_right, split_pages);
}

// MLA decoding (mla_ffi.h), each sequence in one split.
ffi::Error MlaDecodeCpu(ffi::AnyBuffer q, ffi::AnyBuffer cache, ffi::AnyBuffer page_table,
                        ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                        ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                        float scale, int32_t split_pages) {
  auto launch = [](const JfMlaDecodeArgs& args) {
    return CallKernel([&](char* err, size_t n) { return jax_flash_mla_decode_cpu(&args, err, n); });
  };
  return MlaDecode(launch, q, cache, page_table, q_lens, kv_lens, o, lse, scale, split_pages);
}

ffi::Error MlaFp8DecodeCpu(ffi::AnyBuffer q, ffi::AnyBuffer latent, ffi::AnyBuffer scales,
                           ffi::AnyBuffer rope, ffi::AnyBuffer page_table, ffi::AnyBuffer q_lens,
                           ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> o,
                           ffi::Result<ffi::AnyBuffer> lse, float scale, int32_t split_pages) {
  auto launch = [](const JfMlaFp8DecodeArgs& args) {
    return CallKernel(
        [&](char* err, size_t n) { return jax_flash_mla_fp8_decode_cpu(&args, err, n); });
  };
  return MlaFp8Decode(launch, q, latent, scales, rope, page_table, q_lens, kv_lens, o, lse, scale,
                      split_pages);
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashMlaDecodeCpu, jax_flash::MlaDecodeCpu,
                              jax_flash::BindMlaDecode(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashMlaFp8DecodeCpu, jax_flash::MlaFp8DecodeCpu,
                              jax_flash::BindMlaFp8Decode(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashPagedFwdCpu, jax_flash::PagedFwdCpu,
                              jax_flash::BindPagedForward(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashFwdCpu, jax_flash::FwdCpu,
                              jax_flash::BindForwardV2(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBwdCpu, jax_flash::BwdCpu,
                              jax_flash::BindBackward(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashFwdCpuV1, jax_flash::FwdCpuV1,
                              jax_flash::BindForwardV1(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBwdCpuV1, jax_flash::BwdCpuV1,
                              jax_flash::BindBackwardV1(xla::ffi::Ffi::Bind()));

namespace nb = nanobind;

template <typename T>
static nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_cpu_ffi, m) {
  m.doc() = "jax_flash CPU attention kernels as XLA FFI handlers.";
  m.def("registrations", []() {
    nb::dict targets;
    targets["fwd_v2"] = Capsule(JaxFlashFwdCpu);
    targets["bwd_v2"] = Capsule(JaxFlashBwdCpu);
    targets["fwd_v1"] = Capsule(JaxFlashFwdCpuV1);
    targets["bwd_v1"] = Capsule(JaxFlashBwdCpuV1);
    return targets;
  });
  // Separate from registrations(), whose keys ffi.py reads as <direction>_<version>.
  m.def("paged_registrations", []() {
    nb::dict targets;
    targets["jax_flash_cpu_paged_fwd_v1"] = Capsule(JaxFlashPagedFwdCpu);
    return targets;
  });
  m.def("mla_registrations", []() {
    nb::dict targets;
    targets["jax_flash_cpu_mla_decode_v1"] = Capsule(JaxFlashMlaDecodeCpu);
    targets["jax_flash_cpu_mla_decode_fp8_v1"] = Capsule(JaxFlashMlaFp8DecodeCpu);
    return targets;
  });
}
