// The XLA FFI handler of FP8 attention on Hopper (kernel_api.h:
// JfFp8FwdArgs): decodes and validates the buffers, then calls the kernel's
// entry point. No allocation, no host synchronisation.
#ifndef JAX_FLASH_FP8_FFI_H_
#define JAX_FLASH_FP8_FFI_H_

#include <cstdint>
#include <string>

#include "attention_ffi.h"
#include "paged_ffi.h"  // ReadRank4

namespace jax_flash {

template <typename Launch>
ffi::Error Fp8Forward(Launch&& launch, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v_t,
                      ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::AnyBuffer q_descale,
                      ffi::AnyBuffer k_descale, ffi::AnyBuffer v_descale,
                      ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale,
                      int32_t diag_offset, int32_t window_left, int32_t window_right) {
  int64_t qd[4], kd[4], vd[4], od[4];
  if (auto e = ReadRank4("q", q, qd); e.failure()) return e;
  if (auto e = ReadRank4("k", k, kd); e.failure()) return e;
  if (auto e = ReadRank4("v_t", v_t, vd); e.failure()) return e;
  if (auto e = ReadRank4("o", *o, od); e.failure()) return e;
  const int64_t batch = qd[0], seq_q = qd[1], heads_q = qd[2], seq_k = kd[1], heads_kv = kd[2];
  for (const ffi::AnyBuffer* x : {&q, &k, &v_t}) {
    if (x->element_type() != ffi::DataType::F8E4M3FN) {
      return Invalid("q, k and v_t must be float8_e4m3fn");
    }
  }
  if (kd[0] != batch || kd[3] != qd[3] || vd[0] != batch || vd[1] != heads_kv ||
      vd[3] < seq_k) {
    return Invalid("k " + ShapeString(k.dimensions()) + " must be [batch, seq_k, heads_kv, "
                   "head_dim] with q's batch and head_dim, and v_t " +
                   ShapeString(v_t.dimensions()) + " [batch, heads_kv, head_dim_v, >= seq_k]");
  }
  if (od[0] != batch || od[1] != seq_q || od[2] != heads_q || od[3] != vd[2]) {
    return Invalid("o must have shape [batch, seq_q, heads_q, head_dim_v], got " +
                   ShapeString(o->dimensions()));
  }
  JfDtype dtype;
  if (!ToJfDtype(o->element_type(), &dtype) || dtype == JF_FLOAT32) {
    return Invalid("o dtype must be float16 or bfloat16");
  }
  if (auto e = ExpectElements("lse", *lse, ffi::DataType::F32, batch * heads_q * seq_q);
      e.failure())
    return e;
  if (auto e = ExpectElements("q_lens", q_lens, ffi::DataType::S32, batch); e.failure()) return e;
  if (auto e = ExpectElements("kv_lens", kv_lens, ffi::DataType::S32, batch); e.failure()) return e;
  if (auto e = ExpectElements("q_descale", q_descale, ffi::DataType::F32, batch * heads_q);
      e.failure())
    return e;
  if (auto e = ExpectElements("k_descale", k_descale, ffi::DataType::F32, batch * heads_kv);
      e.failure())
    return e;
  if (auto e = ExpectElements("v_descale", v_descale, ffi::DataType::F32, batch * heads_kv);
      e.failure())
    return e;
  JfFp8FwdArgs args{};
  args.problem = JfProblem{dtype,
                           static_cast<int32_t>(batch),
                           static_cast<int32_t>(seq_q),
                           static_cast<int32_t>(seq_k),
                           static_cast<int32_t>(heads_q),
                           static_cast<int32_t>(heads_kv),
                           static_cast<int32_t>(qd[3]),
                           static_cast<int32_t>(vd[2]),
                           scale,
                           diag_offset,
                           window_left,
                           window_right};
  args.seqlen_v = static_cast<int32_t>(vd[3]);
  args.q = q.untyped_data();
  args.k = k.untyped_data();
  args.v_t = v_t.untyped_data();
  args.q_lens = static_cast<const int32_t*>(q_lens.untyped_data());
  args.kv_lens = static_cast<const int32_t*>(kv_lens.untyped_data());
  args.o = o->untyped_data();
  args.lse = static_cast<float*>(lse->untyped_data());
  args.q_descale = static_cast<const float*>(q_descale.untyped_data());
  args.k_descale = static_cast<const float*>(k_descale.untyped_data());
  args.v_descale = static_cast<const float*>(v_descale.untyped_data());
  return launch(args);
}

template <typename Binding>
auto BindFp8Forward(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k
      .template Arg<ffi::AnyBuffer>()  // v_t
      .template Arg<ffi::AnyBuffer>()  // q_lens
      .template Arg<ffi::AnyBuffer>()  // kv_lens
      .template Arg<ffi::AnyBuffer>()  // q_descale
      .template Arg<ffi::AnyBuffer>()  // k_descale
      .template Arg<ffi::AnyBuffer>()  // v_descale
      .template Ret<ffi::AnyBuffer>()  // o
      .template Ret<ffi::AnyBuffer>()  // lse
      .template Attr<float>("scale")
      .template Attr<int32_t>("diag_offset")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right");
}

}  // namespace jax_flash

#endif  // JAX_FLASH_FP8_FFI_H_
