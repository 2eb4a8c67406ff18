// The XLA FFI handlers of MLA decoding (kernel_api.h: JfMlaDecodeArgs,
// JfMlaFp8DecodeArgs and JfMlaFp8Sm90Args): decode and validate the buffers,
// then call the kernel's entry point.
#ifndef JAX_FLASH_MLA_FFI_H_
#define JAX_FLASH_MLA_FFI_H_

#include <cstdint>
#include <initializer_list>
#include <string>

#include "attention_ffi.h"
#include "paged_ffi.h"

namespace jax_flash {

constexpr int64_t kMlaPage = 64, kMlaWidth = 576, kMlaLatent = 512, kMlaRope = 64;

// Checks that the query part `name` is [batch, s_q, heads > 0, width] and
// reads its extents into qd.
inline ffi::Error MlaQueryShape(const char* name, const ffi::AnyBuffer& q, int64_t width,
                                int64_t qd[4]) {
  if (auto e = ReadRank4(name, q, qd); e.failure()) return e;
  if (qd[3] != width || qd[2] <= 0 || !FitsInt32(qd[1] * qd[2])) {
    return Invalid(std::string(name) + " must be [batch, s_q, heads > 0, " +
                   std::to_string(width) + "], got " + ShapeString(q.dimensions()));
  }
  return ffi::Error::Success();
}

// For a query of extents qd [batch, s_q, heads, ...]: checks page_table
// [batch, max_pages] int32, q_lens / kv_lens [batch] int32, o [batch *
// splits, s_q, heads, 512] and lse [batch * splits, s_q, heads] float32
// (splits = max_pages / split_pages: the caller merges them) and fills args,
// all but dtype, q and the cache.
inline ffi::Error MlaTablesAndResults(const int64_t qd[4], ffi::AnyBuffer page_table,
                                      ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                                      ffi::Result<ffi::AnyBuffer>& o,
                                      ffi::Result<ffi::AnyBuffer>& lse, float scale,
                                      int32_t split_pages, int64_t num_pages,
                                      JfMlaDecodeArgs* args) {
  int64_t od[4];
  if (auto e = ReadRank4("o", *o, od); e.failure()) return e;
  const int64_t batch = qd[0], s_q = qd[1], heads = qd[2];
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
  args->batch = static_cast<int32_t>(batch);
  args->rows = static_cast<int32_t>(s_q * heads);
  args->heads = static_cast<int32_t>(heads);
  args->num_pages = static_cast<int32_t>(num_pages);
  args->max_pages = static_cast<int32_t>(table[1]);
  args->split_pages = split_pages;
  args->scale = scale;
  args->page_table = static_cast<const int32_t*>(page_table.untyped_data());
  args->q_lens = static_cast<const int32_t*>(q_lens.untyped_data());
  args->kv_lens = static_cast<const int32_t*>(kv_lens.untyped_data());
  args->o = o->untyped_data();
  args->lse = static_cast<float*>(lse->untyped_data());
  return ffi::Error::Success();
}

// Checks q [batch, s_q, heads, 576] float16 / bfloat16 (o in its dtype) and
// everything MlaTablesAndResults checks; fills args, all but the cache.
inline ffi::Error MlaOperands(ffi::AnyBuffer q, ffi::AnyBuffer page_table, ffi::AnyBuffer q_lens,
                              ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer>& o,
                              ffi::Result<ffi::AnyBuffer>& lse, float scale, int32_t split_pages,
                              int64_t num_pages, JfMlaDecodeArgs* args) {
  int64_t qd[4];
  if (auto e = MlaQueryShape("q", q, kMlaWidth, qd); e.failure()) return e;
  if (!ToJfDtype(q.element_type(), &args->dtype) || args->dtype == JF_FLOAT32) {
    return Invalid("q must be float16 or bfloat16");
  }
  if (o->element_type() != q.element_type()) return Invalid("q and o must share one dtype");
  if (auto e = MlaTablesAndResults(qd, page_table, q_lens, kv_lens, o, lse, scale, split_pages,
                                   num_pages, args);
      e.failure())
    return e;
  args->q = q.untyped_data();
  return ffi::Error::Success();
}

// Checks that pool is [num_pages > 0, 64, dims...] of the given type; returns
// num_pages in *pages (every part of a cache has the first part's pages).
inline ffi::Error MlaPool(const char* name, const ffi::AnyBuffer& pool, ffi::DataType type,
                          const char* type_name, std::initializer_list<int64_t> row,
                          int64_t* pages) {
  const auto dims = pool.dimensions();
  bool ok = dims.size() == 2 + row.size() && dims[1] == kMlaPage && dims[0] > 0 &&
            FitsInt32(dims[0]) && (*pages < 0 || dims[0] == *pages);
  for (size_t i = 0; ok && i < row.size(); ++i) ok = dims[2 + i] == row.begin()[i];
  if (!ok) {
    std::string want = "[num_pages > 0, 64";
    for (const int64_t d : row) want += ", " + std::to_string(d);
    return Invalid(std::string(name) + " must be " + want + "] (num_pages shared), got " +
                   ShapeString(dims));
  }
  if (pool.element_type() != type) return Invalid(std::string(name) + " must be " + type_name);
  *pages = dims[0];
  return ffi::Error::Success();
}

// The bfloat16 / float16 cache [num_pages, 64, 576] in q's dtype.
template <typename Launch>
ffi::Error MlaDecode(Launch&& launch, ffi::AnyBuffer q, ffi::AnyBuffer cache,
                     ffi::AnyBuffer page_table, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                     ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale,
                     int32_t split_pages) {
  int64_t pages = -1;
  if (auto e = MlaPool("cache", cache, q.element_type(), "q's dtype", {kMlaWidth}, &pages);
      e.failure())
    return e;
  JfMlaDecodeArgs args{};
  if (auto e = MlaOperands(q, page_table, q_lens, kv_lens, o, lse, scale, split_pages, pages,
                           &args);
      e.failure())
    return e;
  args.cache = cache.untyped_data();
  return launch(args);
}

// Checks the FP8 cache (jax_flash.MlaFp8Cache): latent [num_pages, 64, 512]
// float8_e4m3fn, scales [num_pages, 64] float32, rope [num_pages, 64, 64]
// bfloat16; fills the cache's pointers of args (mla.cache, scales, rope).
inline ffi::Error MlaFp8Pools(const ffi::AnyBuffer& latent, const ffi::AnyBuffer& scales,
                              const ffi::AnyBuffer& rope, int64_t* pages,
                              JfMlaFp8DecodeArgs* args) {
  *pages = -1;
  if (auto e = MlaPool("latent", latent, ffi::DataType::F8E4M3FN, "float8_e4m3fn", {kMlaLatent},
                       pages);
      e.failure())
    return e;
  if (auto e = MlaPool("scales", scales, ffi::DataType::F32, "float32", {}, pages); e.failure())
    return e;
  if (auto e = MlaPool("rope", rope, ffi::DataType::BF16, "bfloat16", {kMlaRope}, pages);
      e.failure())
    return e;
  args->mla.cache = latent.untyped_data();
  args->scales = static_cast<const float*>(scales.untyped_data());
  args->rope = rope.untyped_data();
  return ffi::Error::Success();
}

// The FP8 cache with q [batch, s_q, heads, 576] bfloat16 (the CPU kernel
// quantises it itself).
template <typename Launch>
ffi::Error MlaFp8Decode(Launch&& launch, ffi::AnyBuffer q, ffi::AnyBuffer latent,
                        ffi::AnyBuffer scales, ffi::AnyBuffer rope, ffi::AnyBuffer page_table,
                        ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                        ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                        float scale, int32_t split_pages) {
  JfMlaFp8DecodeArgs args{};
  int64_t pages;
  if (auto e = MlaFp8Pools(latent, scales, rope, &pages, &args); e.failure()) return e;
  if (q.element_type() != ffi::DataType::BF16) return Invalid("q must be bfloat16");
  if (auto e = MlaOperands(q, page_table, q_lens, kv_lens, o, lse, scale, split_pages, pages,
                           &args.mla);
      e.failure())
    return e;
  return launch(args);
}

// The FP8 cache with the query quantised by the caller (the Hopper kernel,
// kernel_api.h: JfMlaFp8Sm90Args): q_codes [batch, s_q, heads, 512]
// float8_e4m3fn, q_scales [batch, s_q, heads] float32, q_rope [batch, s_q,
// heads, 64] bfloat16; o bfloat16.
template <typename Launch>
ffi::Error MlaFp8QuantisedDecode(Launch&& launch, ffi::AnyBuffer q_codes, ffi::AnyBuffer q_scales,
                                 ffi::AnyBuffer q_rope, ffi::AnyBuffer latent,
                                 ffi::AnyBuffer scales, ffi::AnyBuffer rope,
                                 ffi::AnyBuffer page_table, ffi::AnyBuffer q_lens,
                                 ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> o,
                                 ffi::Result<ffi::AnyBuffer> lse, float scale,
                                 int32_t split_pages) {
  JfMlaFp8Sm90Args args{};
  int64_t pages;
  if (auto e = MlaFp8Pools(latent, scales, rope, &pages, &args.cache); e.failure()) return e;
  int64_t qd[4];
  if (auto e = MlaQueryShape("q_codes", q_codes, kMlaLatent, qd); e.failure()) return e;
  if (q_codes.element_type() != ffi::DataType::F8E4M3FN) {
    return Invalid("q_codes must be float8_e4m3fn");
  }
  if (auto e = ExpectShape("q_rope", q_rope.dimensions(), qd[0], qd[1], qd[2], kMlaRope);
      e.failure())
    return e;
  if (q_rope.element_type() != ffi::DataType::BF16) return Invalid("q_rope must be bfloat16");
  if (auto e = ExpectElements("q_scales", q_scales, ffi::DataType::F32, qd[0] * qd[1] * qd[2]);
      e.failure())
    return e;
  if (o->element_type() != ffi::DataType::BF16) return Invalid("o must be bfloat16");
  JfMlaDecodeArgs& mla = args.cache.mla;
  if (auto e = MlaTablesAndResults(qd, page_table, q_lens, kv_lens, o, lse, scale, split_pages,
                                   pages, &mla);
      e.failure())
    return e;
  mla.dtype = JF_BFLOAT16;
  mla.q = q_codes.untyped_data();
  args.q_scales = static_cast<const float*>(q_scales.untyped_data());
  args.q_rope = q_rope.untyped_data();
  return launch(args);
}

// The operands after the cache's, the results and the attributes: the same
// for every MLA binding.
template <typename Binding>
auto BindMlaTablesAndResults(Binding&& binding) {
  return std::forward<Binding>(binding)
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
  return BindMlaTablesAndResults(std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()    // q
      .template Arg<ffi::AnyBuffer>());  // cache
}

template <typename Binding>
auto BindMlaFp8Decode(Binding&& binding) {
  return BindMlaTablesAndResults(std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()    // q
      .template Arg<ffi::AnyBuffer>()    // latent
      .template Arg<ffi::AnyBuffer>()    // scales
      .template Arg<ffi::AnyBuffer>());  // rope
}

template <typename Binding>
auto BindMlaFp8QuantisedDecode(Binding&& binding) {
  return BindMlaTablesAndResults(std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()    // q_codes
      .template Arg<ffi::AnyBuffer>()    // q_scales
      .template Arg<ffi::AnyBuffer>()    // q_rope
      .template Arg<ffi::AnyBuffer>()    // latent
      .template Arg<ffi::AnyBuffer>()    // scales
      .template Arg<ffi::AnyBuffer>());  // rope
}

}  // namespace jax_flash

#endif  // JAX_FLASH_MLA_FFI_H_
