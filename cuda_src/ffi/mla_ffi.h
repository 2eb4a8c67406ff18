// The XLA FFI handlers of MLA decoding (kernel_api.h: JfMlaDecodeArgs and
// JfMlaFp8DecodeArgs): decode and validate the buffers, then call the
// kernel's entry point.
#ifndef JAX_FLASH_MLA_FFI_H_
#define JAX_FLASH_MLA_FFI_H_

#include <cstdint>
#include <string>

#include "attention_ffi.h"
#include "paged_ffi.h"

namespace jax_flash {

constexpr int64_t kMlaPage = 64, kMlaWidth = 576, kMlaLatent = 512, kMlaRope = 64;

// q [batch, s_q, heads, 576], cache [num_pages, 64, 576], page_table [batch,
// max_pages] int32, q_lens / kv_lens [batch] int32; o [batch * splits, s_q,
// heads, 512] in q's dtype and lse [batch * splits, s_q, heads] float32,
// splits = max_pages / split_pages (the caller merges them).
template <typename Launch>
ffi::Error MlaDecode(Launch&& launch, ffi::AnyBuffer q, ffi::AnyBuffer cache,
                     ffi::AnyBuffer page_table, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                     ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale,
                     int32_t split_pages) {
  int64_t qd[4], od[4];
  if (auto e = ReadRank4("q", q, qd); e.failure()) return e;
  if (auto e = ReadRank4("o", *o, od); e.failure()) return e;
  const auto cd = cache.dimensions();
  if (cd.size() != 3 || cd[1] != kMlaPage || cd[2] != kMlaWidth || cd[0] <= 0 ||
      !FitsInt32(cd[0])) {
    return Invalid("cache must be [num_pages > 0, 64, 576], got " + ShapeString(cd));
  }
  const int64_t batch = qd[0], s_q = qd[1], heads = qd[2];
  if (qd[3] != kMlaWidth || heads <= 0 || !FitsInt32(s_q * heads)) {
    return Invalid("q must be [batch, s_q, heads > 0, 576], got " + ShapeString(q.dimensions()));
  }
  JfDtype dtype;
  if (!ToJfDtype(q.element_type(), &dtype) || dtype == JF_FLOAT32) {
    return Invalid("q must be float16 or bfloat16");
  }
  if (cache.element_type() != q.element_type() || o->element_type() != q.element_type()) {
    return Invalid("q, cache and o must share one dtype");
  }
  const auto table = page_table.dimensions();
  if (page_table.element_type() != ffi::DataType::S32 || table.size() != 2 ||
      table[0] != batch || table[1] <= 0 || !FitsInt32(table[1]) || split_pages <= 0 ||
      table[1] % split_pages != 0) {
    return Invalid("page_table must be int32 [batch=" + std::to_string(batch) +
                   ", a positive multiple of split_pages=" + std::to_string(split_pages) +
                   "], got " + ShapeString(table));
  }
  const int64_t splits = table[1] / split_pages;
  if (od[0] != batch * splits || od[1] != s_q || od[2] != heads || od[3] != kMlaLatent) {
    return Invalid("o must have shape [batch * splits, s_q, heads, 512] = (" +
                   std::to_string(batch * splits) + ", " + std::to_string(s_q) + ", " +
                   std::to_string(heads) + ", 512), got " + ShapeString(o->dimensions()));
  }
  if (auto e = ExpectElements("lse", *lse, ffi::DataType::F32, batch * splits * s_q * heads);
      e.failure())
    return e;
  if (auto e = ExpectElements("q_lens", q_lens, ffi::DataType::S32, batch); e.failure()) return e;
  if (auto e = ExpectElements("kv_lens", kv_lens, ffi::DataType::S32, batch); e.failure()) return e;
  JfMlaDecodeArgs args{};
  args.dtype = dtype;
  args.batch = static_cast<int32_t>(batch);
  args.rows = static_cast<int32_t>(s_q * heads);
  args.heads = static_cast<int32_t>(heads);
  args.num_pages = static_cast<int32_t>(cd[0]);
  args.max_pages = static_cast<int32_t>(table[1]);
  args.split_pages = split_pages;
  args.scale = scale;
  args.q = q.untyped_data();
  args.cache = cache.untyped_data();
  args.page_table = static_cast<const int32_t*>(page_table.untyped_data());
  args.q_lens = static_cast<const int32_t*>(q_lens.untyped_data());
  args.kv_lens = static_cast<const int32_t*>(kv_lens.untyped_data());
  args.o = o->untyped_data();
  args.lse = static_cast<float*>(lse->untyped_data());
  return launch(args);
}

// The FP8 cache (kernel_api.h: JfMlaFp8DecodeArgs): q_codes [batch, s_q,
// heads, 512] float8_e4m3fn, q_scales [batch, s_q, heads] float32, q_rope
// [batch, s_q, heads, 64] bfloat16; latent [num_pages, 64, 512]
// float8_e4m3fn, scales [num_pages, 64] float32, rope [num_pages, 64, 64]
// bfloat16; the rest as MlaDecode's, o bfloat16.
template <typename Launch>
ffi::Error MlaDecodeFp8(Launch&& launch, ffi::AnyBuffer q_codes, ffi::AnyBuffer q_scales,
                        ffi::AnyBuffer q_rope, ffi::AnyBuffer latent, ffi::AnyBuffer scales,
                        ffi::AnyBuffer rope, ffi::AnyBuffer page_table, ffi::AnyBuffer q_lens,
                        ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::AnyBuffer> lse, float scale, int32_t split_pages) {
  int64_t qd[4], od[4];
  if (auto e = ReadRank4("q_codes", q_codes, qd); e.failure()) return e;
  if (auto e = ReadRank4("o", *o, od); e.failure()) return e;
  const int64_t batch = qd[0], s_q = qd[1], heads = qd[2];
  if (qd[3] != kMlaLatent || heads <= 0 || !FitsInt32(s_q * heads) ||
      q_codes.element_type() != ffi::DataType::F8E4M3FN) {
    return Invalid("q_codes must be float8_e4m3fn [batch, s_q, heads > 0, 512], got " +
                   ShapeString(q_codes.dimensions()));
  }
  if (auto e = ExpectShape("q_rope", q_rope.dimensions(), batch, s_q, heads, kMlaRope);
      e.failure())
    return e;
  if (q_rope.element_type() != ffi::DataType::BF16) return Invalid("q_rope must be bfloat16");
  if (auto e = ExpectElements("q_scales", q_scales, ffi::DataType::F32, batch * s_q * heads);
      e.failure())
    return e;
  const auto ld = latent.dimensions();
  if (ld.size() != 3 || ld[1] != kMlaPage || ld[2] != kMlaLatent || ld[0] <= 0 ||
      !FitsInt32(ld[0]) || latent.element_type() != ffi::DataType::F8E4M3FN) {
    return Invalid("latent must be float8_e4m3fn [num_pages > 0, 64, 512], got " +
                   ShapeString(ld));
  }
  const int64_t num_pages = ld[0];
  const auto sd = scales.dimensions();
  if (sd.size() != 2 || sd[0] != num_pages || sd[1] != kMlaPage ||
      scales.element_type() != ffi::DataType::F32) {
    return Invalid("scales must be float32 [num_pages=" + std::to_string(num_pages) +
                   ", 64], got " + ShapeString(sd));
  }
  const auto rd = rope.dimensions();
  if (rd.size() != 3 || rd[0] != num_pages || rd[1] != kMlaPage || rd[2] != kMlaRope ||
      rope.element_type() != ffi::DataType::BF16) {
    return Invalid("rope must be bfloat16 [num_pages=" + std::to_string(num_pages) +
                   ", 64, 64], got " + ShapeString(rd));
  }
  if (o->element_type() != ffi::DataType::BF16) return Invalid("o must be bfloat16");
  const auto table = page_table.dimensions();
  if (page_table.element_type() != ffi::DataType::S32 || table.size() != 2 ||
      table[0] != batch || table[1] <= 0 || !FitsInt32(table[1]) || split_pages <= 0 ||
      table[1] % split_pages != 0) {
    return Invalid("page_table must be int32 [batch=" + std::to_string(batch) +
                   ", a positive multiple of split_pages=" + std::to_string(split_pages) +
                   "], got " + ShapeString(table));
  }
  const int64_t splits = table[1] / split_pages;
  if (od[0] != batch * splits || od[1] != s_q || od[2] != heads || od[3] != kMlaLatent) {
    return Invalid("o must have shape [batch * splits, s_q, heads, 512] = (" +
                   std::to_string(batch * splits) + ", " + std::to_string(s_q) + ", " +
                   std::to_string(heads) + ", 512), got " + ShapeString(o->dimensions()));
  }
  if (auto e = ExpectElements("lse", *lse, ffi::DataType::F32, batch * splits * s_q * heads);
      e.failure())
    return e;
  if (auto e = ExpectElements("q_lens", q_lens, ffi::DataType::S32, batch); e.failure()) return e;
  if (auto e = ExpectElements("kv_lens", kv_lens, ffi::DataType::S32, batch); e.failure()) return e;
  JfMlaFp8DecodeArgs args{};
  args.batch = static_cast<int32_t>(batch);
  args.rows = static_cast<int32_t>(s_q * heads);
  args.heads = static_cast<int32_t>(heads);
  args.num_pages = static_cast<int32_t>(num_pages);
  args.max_pages = static_cast<int32_t>(table[1]);
  args.split_pages = split_pages;
  args.scale = scale;
  args.q_codes = q_codes.untyped_data();
  args.q_scales = static_cast<const float*>(q_scales.untyped_data());
  args.q_rope = q_rope.untyped_data();
  args.latent = latent.untyped_data();
  args.scales = static_cast<const float*>(scales.untyped_data());
  args.rope = rope.untyped_data();
  args.page_table = static_cast<const int32_t*>(page_table.untyped_data());
  args.q_lens = static_cast<const int32_t*>(q_lens.untyped_data());
  args.kv_lens = static_cast<const int32_t*>(kv_lens.untyped_data());
  args.o = o->untyped_data();
  args.lse = static_cast<float*>(lse->untyped_data());
  return launch(args);
}

template <typename Binding>
auto BindMlaDecodeFp8(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // q_codes
      .template Arg<ffi::AnyBuffer>()  // q_scales
      .template Arg<ffi::AnyBuffer>()  // q_rope
      .template Arg<ffi::AnyBuffer>()  // latent
      .template Arg<ffi::AnyBuffer>()  // scales
      .template Arg<ffi::AnyBuffer>()  // rope
      .template Arg<ffi::AnyBuffer>()  // page_table
      .template Arg<ffi::AnyBuffer>()  // q_lens
      .template Arg<ffi::AnyBuffer>()  // kv_lens
      .template Ret<ffi::AnyBuffer>()  // o
      .template Ret<ffi::AnyBuffer>()  // lse
      .template Attr<float>("scale")
      .template Attr<int32_t>("split_pages");
}

template <typename Binding>
auto BindMlaDecode(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // cache
      .template Arg<ffi::AnyBuffer>()  // page_table
      .template Arg<ffi::AnyBuffer>()  // q_lens
      .template Arg<ffi::AnyBuffer>()  // kv_lens
      .template Ret<ffi::AnyBuffer>()  // o
      .template Ret<ffi::AnyBuffer>()  // lse
      .template Attr<float>("scale")
      .template Attr<int32_t>("split_pages");
}

}  // namespace jax_flash

#endif  // JAX_FLASH_MLA_FFI_H_
