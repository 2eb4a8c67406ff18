// CPU FFI handlers and the nanobind module that hands them to Python.
#include <nanobind/nanobind.h>

#include "attention_ffi.h"

namespace jax_flash {
namespace {

ffi::Error LaunchFwdCpu(const JfFwdArgs& args) {
  return CallKernel([&](char* err, size_t n) { return jax_flash_fwd_cpu(&args, err, n); });
}

ffi::Error LaunchBwdCpu(const JfBwdArgs& args) {
  return CallKernel([&](char* err, size_t n) { return jax_flash_bwd_cpu(&args, err, n); });
}

ffi::Error FwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_ids,
                  ffi::AnyBuffer kv_ids, ffi::AnyBuffer kv_bounds, ffi::AnyBuffer q_bounds,
                  ffi::Result<ffi::AnyBuffer> o,
                  ffi::Result<ffi::AnyBuffer> lse, float scale, int32_t diag_offset,
                  int32_t window_left, int32_t window_right) {
  return AttentionForward(LaunchFwdCpu, q, k, v, q_lens, kv_lens,
                          SegmentBuffers{q_ids, kv_ids, kv_bounds, q_bounds}, o, lse, scale, diag_offset,
                          window_left, window_right);
}

ffi::Error BwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dout,
                  ffi::AnyBuffer lse, ffi::AnyBuffer delta, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_ids,
                  ffi::AnyBuffer kv_ids, ffi::AnyBuffer kv_bounds, ffi::AnyBuffer q_bounds,
                  ffi::Result<ffi::AnyBuffer> dq_accum,
                  ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, float scale,
                  int32_t diag_offset, int32_t window_left, int32_t window_right) {
  return AttentionBackward(LaunchBwdCpu, q, k, v, dout, lse, delta, q_lens, kv_lens,
                           SegmentBuffers{q_ids, kv_ids, kv_bounds, q_bounds}, dq_accum,
                           dk, dv, scale, diag_offset, window_left, window_right);
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashFwdCpu, jax_flash::FwdCpu,
                              jax_flash::BindForward(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBwdCpu, jax_flash::BwdCpu,
                              jax_flash::BindBackward(xla::ffi::Ffi::Bind()));

namespace nb = nanobind;

template <typename T>
static nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_cpu_ffi, m) {
  m.doc() = "jax_flash CPU attention kernels as XLA FFI handlers.";
  m.def("registrations", []() {
    nb::dict targets;
    targets["fwd"] = Capsule(JaxFlashFwdCpu);
    targets["bwd"] = Capsule(JaxFlashBwdCpu);
    return targets;
  });
}
