// The XLA FFI handlers of the paged forward (kernel_api.h: JfPagedFwdArgs,
// and JfPagedFp8FwdArgs on an FP8 cache): decode and validate the buffers,
// then call the kernel's entry point.
#ifndef JAX_FLASH_PAGED_FFI_H_
#define JAX_FLASH_PAGED_FFI_H_

#include <cstdint>
#include <string>
#include <utility>

#include "attention_ffi.h"

namespace jax_flash {

// Reads [d0, d1, d2, d3] exactly (no folded leading dimensions: a page pool
// and its table are not vmapped).
inline ffi::Error ReadRank4(const char* name, const ffi::AnyBuffer& buf, int64_t dims[4]) {
  const auto shape = buf.dimensions();
  if (shape.size() != 4) {
    return Invalid(std::string(name) + " must have rank 4, got shape " + ShapeString(shape));
  }
  for (int i = 0; i < 4; ++i) {
    if (!FitsInt32(shape[i])) return Invalid(std::string(name) + " exceeds the int32 range");
    dims[i] = shape[i];
  }
  return ffi::Error::Success();
}

template <typename Launch>
ffi::Error PagedForward(Launch&& launch, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                        ffi::AnyBuffer v_pages, ffi::AnyBuffer page_table,
                        ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                        ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                        float scale, float softcap, int32_t window_left, int32_t window_right,
                        int32_t split_pages, bool fp8_cache = false) {
  int64_t qd[4], kd[4], vd[4], od[4];
  if (auto e = ReadRank4("q", q, qd); e.failure()) return e;
  if (auto e = ReadRank4("k_pages", k_pages, kd); e.failure()) return e;
  if (auto e = ReadRank4("v_pages", v_pages, vd); e.failure()) return e;
  if (auto e = ReadRank4("o", *o, od); e.failure()) return e;
  const int64_t batch = qd[0], pages = kd[0], page_size = kd[1], heads_kv = kd[2];
  if (vd[0] != pages || vd[1] != page_size || vd[2] != heads_kv || kd[3] != qd[3]) {
    return Invalid("k_pages " + ShapeString(k_pages.dimensions()) + " and v_pages " +
                   ShapeString(v_pages.dimensions()) + " must share their pages, and k_pages q's "
                   "head_dim " + std::to_string(qd[3]));
  }
  const ffi::DataType pages_type = fp8_cache ? ffi::DataType::F8E4M3FN : q.element_type();
  if (k_pages.element_type() != pages_type || v_pages.element_type() != pages_type ||
      o->element_type() != q.element_type()) {
    return Invalid(fp8_cache ? "k_pages and v_pages must be float8_e4m3fn, o of q's dtype"
                             : "q, k_pages, v_pages and o must share one dtype");
  }
  JfDtype dtype;
  if (!ToJfDtype(q.element_type(), &dtype)) return Invalid("q dtype must be float16 or bfloat16");
  const auto table = page_table.dimensions();
  if (page_table.element_type() != ffi::DataType::S32 || table.size() != 2 ||
      table[0] != batch || !FitsInt32(table[1]) || split_pages <= 0 ||
      table[1] % split_pages != 0) {
    return Invalid("page_table must be int32 [batch=" + std::to_string(batch) +
                   ", a multiple of split_pages=" + std::to_string(split_pages) + "], got " +
                   ShapeString(table));
  }
  const int64_t splits = table[1] / split_pages;
  if (od[0] != batch * splits || od[1] != qd[1] || od[2] != qd[2] || od[3] != vd[3]) {
    return Invalid("o must have shape [batch * splits, seqlen_q, heads_q, head_dim_v] = (" +
                   std::to_string(batch * splits) + ", " + std::to_string(qd[1]) + ", " +
                   std::to_string(qd[2]) + ", " + std::to_string(vd[3]) + "), got " +
                   ShapeString(o->dimensions()));
  }
  if (auto e = ExpectElements("lse", *lse, ffi::DataType::F32, batch * splits * qd[2] * qd[1]);
      e.failure())
    return e;
  if (auto e = ExpectElements("q_lens", q_lens, ffi::DataType::S32, batch); e.failure()) return e;
  if (auto e = ExpectElements("kv_lens", kv_lens, ffi::DataType::S32, batch); e.failure()) return e;
  if (!(softcap >= 0.0f) || softcap == INFINITY) {
    return Invalid("softcap must be finite and >= 0, got " + std::to_string(softcap));
  }
  JfPagedFwdArgs args{};
  args.problem = JfProblem{dtype,
                           static_cast<int32_t>(batch),
                           static_cast<int32_t>(qd[1]),
                           static_cast<int32_t>(table[1] * page_size),
                           static_cast<int32_t>(qd[2]),
                           static_cast<int32_t>(heads_kv),
                           static_cast<int32_t>(qd[3]),
                           static_cast<int32_t>(vd[3]),
                           scale,
                           0,
                           window_left,
                           window_right};
  args.problem.softcap = softcap;
  args.num_pages = static_cast<int32_t>(pages);
  args.page_size = static_cast<int32_t>(page_size);
  args.max_pages = static_cast<int32_t>(table[1]);
  args.split_pages = split_pages;
  args.q = q.untyped_data();
  args.k_pages = k_pages.untyped_data();
  args.v_pages = v_pages.untyped_data();
  args.page_table = static_cast<const int32_t*>(page_table.untyped_data());
  args.q_lens = static_cast<const int32_t*>(q_lens.untyped_data());
  args.kv_lens = static_cast<const int32_t*>(kv_lens.untyped_data());
  args.o = o->untyped_data();
  args.lse = static_cast<float*>(lse->untyped_data());
  return launch(args);
}

// The FP8 cache: its scales [num_pages, heads_kv, page_size] float32 beside
// PagedForward's checks.
template <typename Launch>
ffi::Error PagedFp8Forward(Launch&& launch, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                           ffi::AnyBuffer v_pages, ffi::AnyBuffer k_scales,
                           ffi::AnyBuffer v_scales, ffi::AnyBuffer page_table,
                           ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                           ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                           float scale, float softcap, int32_t window_left,
                           int32_t window_right, int32_t split_pages) {
  int64_t kd[4];
  if (auto e = ReadRank4("k_pages", k_pages, kd); e.failure()) return e;
  for (auto [name, scales] : {std::pair{"k_scales", &k_scales}, std::pair{"v_scales", &v_scales}}) {
    const auto dims = scales->dimensions();
    if (scales->element_type() != ffi::DataType::F32 || dims.size() != 3 || dims[0] != kd[0] ||
        dims[1] != kd[2] || dims[2] != kd[1]) {
      return Invalid(std::string(name) + " must be float32 [num_pages, heads_kv, page_size] = (" +
                     std::to_string(kd[0]) + ", " + std::to_string(kd[2]) + ", " +
                     std::to_string(kd[1]) + "), got " + ShapeString(dims));
    }
  }
  auto with_scales = [&](const JfPagedFwdArgs& base) {
    JfPagedFp8FwdArgs args{base, static_cast<const float*>(k_scales.untyped_data()),
                           static_cast<const float*>(v_scales.untyped_data())};
    return launch(args);
  };
  return PagedForward(with_scales, q, k_pages, v_pages, page_table, q_lens, kv_lens, o, lse,
                      scale, softcap, window_left, window_right, split_pages, true);
}

// The operands after the pools (and an FP8 cache's scales), the results
// and the attributes of both handlers.
template <typename Binding>
auto BindPagedTail(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // page_table
      .template Arg<ffi::AnyBuffer>()  // q_lens
      .template Arg<ffi::AnyBuffer>()  // kv_lens
      .template Ret<ffi::AnyBuffer>()  // o
      .template Ret<ffi::AnyBuffer>()  // lse
      .template Attr<float>("scale")
      .template Attr<float>("softcap")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right")
      .template Attr<int32_t>("split_pages");
}

template <typename Binding>
auto BindPagedForward(Binding&& binding) {
  return BindPagedTail(std::forward<Binding>(binding)
                           .template Arg<ffi::AnyBuffer>()    // q
                           .template Arg<ffi::AnyBuffer>()    // k_pages
                           .template Arg<ffi::AnyBuffer>());  // v_pages
}

template <typename Binding>
auto BindPagedFp8Forward(Binding&& binding) {
  return BindPagedTail(std::forward<Binding>(binding)
                           .template Arg<ffi::AnyBuffer>()    // q
                           .template Arg<ffi::AnyBuffer>()    // k_pages (codes)
                           .template Arg<ffi::AnyBuffer>()    // v_pages (codes)
                           .template Arg<ffi::AnyBuffer>()    // k_scales
                           .template Arg<ffi::AnyBuffer>());  // v_scales
}

}  // namespace jax_flash

#endif  // JAX_FLASH_PAGED_FFI_H_
