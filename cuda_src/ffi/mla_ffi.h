// The XLA FFI handler of MLA decoding (kernel_api.h: JfMlaDecodeArgs):
// decodes and validates the buffers, then calls the kernel's entry point.
#ifndef JAX_FLASH_MLA_FFI_H_
#define JAX_FLASH_MLA_FFI_H_

#include <cstdint>
#include <initializer_list>
#include <string>

#include "attention_ffi.h"
#include "paged_ffi.h"

namespace jax_flash {

constexpr int64_t kMlaPage = 64, kMlaWidth = 576, kMlaLatent = 512;

// Checks q [batch, s_q, heads, 576], page_table [batch, max_pages] int32,
// q_lens / kv_lens [batch] int32, o [batch * splits, s_q, heads, 512] in q's
// dtype and lse [batch * splits, s_q, heads] float32 (splits = max_pages /
// split_pages: the caller merges them) and fills args, all but the cache.
inline ffi::Error MlaOperands(ffi::AnyBuffer q, ffi::AnyBuffer page_table, ffi::AnyBuffer q_lens,
                              ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer>& o,
                              ffi::Result<ffi::AnyBuffer>& lse, float scale, int32_t split_pages,
                              int64_t num_pages, JfMlaDecodeArgs* args) {
  int64_t qd[4], od[4];
  if (auto e = ReadRank4("q", q, qd); e.failure()) return e;
  if (auto e = ReadRank4("o", *o, od); e.failure()) return e;
  const int64_t batch = qd[0], s_q = qd[1], heads = qd[2];
  if (qd[3] != kMlaWidth || heads <= 0 || !FitsInt32(s_q * heads)) {
    return Invalid("q must be [batch, s_q, heads > 0, 576], got " + ShapeString(q.dimensions()));
  }
  JfDtype dtype;
  if (!ToJfDtype(q.element_type(), &dtype) || dtype == JF_FLOAT32) {
    return Invalid("q must be float16 or bfloat16");
  }
  if (o->element_type() != q.element_type()) return Invalid("q and o must share one dtype");
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
  args->dtype = dtype;
  args->batch = static_cast<int32_t>(batch);
  args->rows = static_cast<int32_t>(s_q * heads);
  args->heads = static_cast<int32_t>(heads);
  args->num_pages = static_cast<int32_t>(num_pages);
  args->max_pages = static_cast<int32_t>(table[1]);
  args->split_pages = split_pages;
  args->scale = scale;
  args->q = q.untyped_data();
  args->page_table = static_cast<const int32_t*>(page_table.untyped_data());
  args->q_lens = static_cast<const int32_t*>(q_lens.untyped_data());
  args->kv_lens = static_cast<const int32_t*>(kv_lens.untyped_data());
  args->o = o->untyped_data();
  args->lse = static_cast<float*>(lse->untyped_data());
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

// The FP8 cache (jax_flash.MlaFp8Cache): latent [num_pages, 64, 512]
// float8_e4m3fn, scales [num_pages, 64] float32, rope [num_pages, 64, 64]
// bfloat16; q bfloat16.
template <typename Launch>
ffi::Error MlaFp8Decode(Launch&& launch, ffi::AnyBuffer q, ffi::AnyBuffer latent,
                        ffi::AnyBuffer scales, ffi::AnyBuffer rope, ffi::AnyBuffer page_table,
                        ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                        ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                        float scale, int32_t split_pages) {
  int64_t pages = -1;
  if (auto e = MlaPool("latent", latent, ffi::DataType::F8E4M3FN, "float8_e4m3fn", {kMlaLatent},
                       &pages);
      e.failure())
    return e;
  if (auto e = MlaPool("scales", scales, ffi::DataType::F32, "float32", {}, &pages); e.failure())
    return e;
  if (auto e = MlaPool("rope", rope, ffi::DataType::BF16, "bfloat16", {kMlaWidth - kMlaLatent},
                       &pages);
      e.failure())
    return e;
  if (q.element_type() != ffi::DataType::BF16) return Invalid("q must be bfloat16");
  JfMlaFp8DecodeArgs args{};
  if (auto e = MlaOperands(q, page_table, q_lens, kv_lens, o, lse, scale, split_pages, pages,
                           &args.mla);
      e.failure())
    return e;
  args.mla.cache = latent.untyped_data();
  args.scales = static_cast<const float*>(scales.untyped_data());
  args.rope = rope.untyped_data();
  return launch(args);
}

// The operands after the cache's, the results and the attributes: the same
// for both cache formats.
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

}  // namespace jax_flash

#endif  // JAX_FLASH_MLA_FFI_H_
