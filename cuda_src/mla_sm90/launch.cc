// jax_flash_mla_sm90(_fp8): host launchers for the ahead-of-time exported
// Hopper MLA decode kernels (cuda_src/mla_sm90/kernel.py for the bfloat16 /
// float16 cache, kernel_fp8.py for the FP8 cache, exported by export.py). The
// generated wrappers encode the TMA descriptors from the shapes below on
// every call; nothing here synchronises or allocates.

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/kernel_api.h"
#include "launch_common.h"  // first: it sets up the module loaders' error hook
#include "mla_sm90_variants_sm_90a.h"

namespace {

using jax_flash_launch::EnsureLoaded;
using jax_flash_launch::Fail;
using jax_flash_launch::LoadedModule;

constexpr int kWidth = 576;    // kernel.py: HEAD_DIM
constexpr int kLatent = 512;   // kernel.py: LATENT
constexpr int kRope = 64;      // kernel_fp8.py: ROPE
constexpr int kPage = 64;      // kernel.py: PAGE
constexpr int kMaxGridY = 65535;
constexpr uintptr_t kOperandAlign = 16;  // TMA needs 16-byte aligned bases

bool IsHopper(int device) {
  int major = 0;
  return jax_flash_launch::ComputeCapabilityMajor(device, &major) == cudaSuccess && major == 9;
}

#define JF_DEFINE_MLA_VARIANT(arch_tag, dtype_enum, prefix)                                   \
  LoadedModule<prefix##_Kernel_Module_t> g_##prefix;                                        \
  int Launch_##prefix(const JfMlaDecodeArgs& a, cudaStream_t stream, char* err,             \
                      size_t err_len) {                                                     \
    cudaError_t load = EnsureLoaded(g_##prefix, prefix##_Kernel_Module_Load);               \
    if (load != cudaSuccess) {                                                              \
      return Fail(err, err_len, "jax_flash_mla_sm90: loading " #prefix ": %s",              \
                  cudaGetErrorString(load));                                                \
    }                                                                                       \
    const int32_t outs = a.batch * (a.max_pages / a.split_pages);                           \
    prefix##_Tensor_mQ_t q = {const_cast<void*>(a.q), {a.batch, a.rows},                    \
                              {int64_t{a.rows} * kWidth}};                                  \
    prefix##_Tensor_mCache_t cache = {const_cast<void*>(a.cache), {a.num_pages}};           \
    prefix##_Tensor_mO_t o = {a.o, {outs, a.rows}, {int64_t{a.rows} * kLatent}};            \
    prefix##_Tensor_mLSE_t lse = {a.lse, {outs, a.rows}, {a.rows}};                         \
    prefix##_Tensor_mPageTable_t table = {const_cast<int32_t*>(a.page_table),               \
                                          {a.batch, a.max_pages}, {a.max_pages}};           \
    prefix##_Tensor_mQLens_t q_lens = {const_cast<int32_t*>(a.q_lens), {a.batch}};          \
    prefix##_Tensor_mKVLens_t kv_lens = {const_cast<int32_t*>(a.kv_lens), {a.batch}};       \
    int32_t rc = cute_dsl_##prefix##_wrapper(&g_##prefix.module, &q, &cache, &o, &lse,      \
                                             &table, &q_lens, &kv_lens, a.scale, a.heads,   \
                                             a.split_pages, stream);                        \
    if (rc != 0) return Fail(err, err_len, "jax_flash_mla_sm90: " #prefix " returned %d", rc); \
    return 0;                                                                               \
  }
JF_MLA_SM90_VARIANTS_SM_90A(JF_DEFINE_MLA_VARIANT)
#undef JF_DEFINE_MLA_VARIANT

#define JF_DEFINE_MLA_FP8_VARIANT(arch_tag, prefix)                                           \
  LoadedModule<prefix##_Kernel_Module_t> g_##prefix;                                        \
  int Launch_##prefix(const JfMlaFp8Sm90Args& args, cudaStream_t stream, char* err,         \
                      size_t err_len) {                                                     \
    cudaError_t load = EnsureLoaded(g_##prefix, prefix##_Kernel_Module_Load);               \
    if (load != cudaSuccess) {                                                              \
      return Fail(err, err_len, "jax_flash_mla_sm90_fp8: loading " #prefix ": %s",          \
                  cudaGetErrorString(load));                                                \
    }                                                                                       \
    const JfMlaFp8DecodeArgs& c = args.cache;                                               \
    const JfMlaDecodeArgs& a = c.mla;                                                       \
    const int32_t outs = a.batch * (a.max_pages / a.split_pages);                           \
    prefix##_Tensor_mQ_t q = {const_cast<void*>(a.q), {a.batch, a.rows},                    \
                              {int64_t{a.rows} * kLatent}};                                 \
    prefix##_Tensor_mQScales_t q_scales = {const_cast<float*>(args.q_scales),               \
                                           {a.batch, a.rows}, {a.rows}};                    \
    prefix##_Tensor_mQRope_t q_rope = {const_cast<void*>(args.q_rope), {a.batch, a.rows},   \
                                       {int64_t{a.rows} * kRope}};                          \
    prefix##_Tensor_mLatent_t latent = {const_cast<void*>(a.cache), {a.num_pages}};         \
    prefix##_Tensor_mScales_t scales = {const_cast<float*>(c.scales), {a.num_pages}};       \
    prefix##_Tensor_mRope_t rope = {const_cast<void*>(c.rope), {a.num_pages}};              \
    prefix##_Tensor_mO_t o = {a.o, {outs, a.rows}, {int64_t{a.rows} * kLatent}};            \
    prefix##_Tensor_mLSE_t lse = {a.lse, {outs, a.rows}, {a.rows}};                         \
    prefix##_Tensor_mPageTable_t table = {const_cast<int32_t*>(a.page_table),               \
                                          {a.batch, a.max_pages}, {a.max_pages}};           \
    prefix##_Tensor_mQLens_t q_lens = {const_cast<int32_t*>(a.q_lens), {a.batch}};          \
    prefix##_Tensor_mKVLens_t kv_lens = {const_cast<int32_t*>(a.kv_lens), {a.batch}};       \
    int32_t rc = cute_dsl_##prefix##_wrapper(&g_##prefix.module, &q, &q_scales, &q_rope,    \
                                             &latent, &scales, &rope, &o, &lse, &table,     \
                                             &q_lens, &kv_lens, a.scale, a.heads,           \
                                             a.split_pages, stream);                        \
    if (rc != 0) {                                                                          \
      return Fail(err, err_len, "jax_flash_mla_sm90_fp8: " #prefix " returned %d", rc);     \
    }                                                                                       \
    return 0;                                                                               \
  }
JF_MLA_SM90_FP8_VARIANTS_SM_90A(JF_DEFINE_MLA_FP8_VARIANT)
#undef JF_DEFINE_MLA_FP8_VARIANT

using LaunchFn = int (*)(const JfMlaDecodeArgs&, cudaStream_t, char*, size_t);
using LaunchFp8Fn = int (*)(const JfMlaFp8Sm90Args&, cudaStream_t, char*, size_t);

// The FP8 variant (export.py exports one, or none under --only).
LaunchFp8Fn FindFp8Variant() {
#define JF_MATCH_MLA_FP8_VARIANT(arch_tag, prefix) return Launch_##prefix;
  JF_MLA_SM90_FP8_VARIANTS_SM_90A(JF_MATCH_MLA_FP8_VARIANT)
#undef JF_MATCH_MLA_FP8_VARIANT
  return nullptr;
}

LaunchFn FindVariant(JfDtype dtype) {
#define JF_MATCH_MLA_VARIANT(arch_tag, dtype_enum, prefix) \
  if (dtype == dtype_enum) return Launch_##prefix;
  JF_MLA_SM90_VARIANTS_SM_90A(JF_MATCH_MLA_VARIANT)
#undef JF_MATCH_MLA_VARIANT
  return nullptr;
}

// The extents both kernels rely on; a message naming the first that fails.
template <typename Args>
int ValidateExtents(const Args* a, char* err, size_t err_len) {
  if (a->batch < 0 || a->heads <= 0 || a->rows < 0 || a->rows % a->heads != 0) {
    return Fail(err, err_len,
                "jax_flash_mla_sm90: need batch >= 0, heads > 0 and rows a multiple of heads; got "
                "batch=%d rows=%d heads=%d",
                a->batch, a->rows, a->heads);
  }
  if (a->num_pages <= 0 || a->split_pages <= 0 || a->max_pages <= 0 ||
      a->max_pages % a->split_pages != 0) {
    return Fail(err, err_len,
                "jax_flash_mla_sm90: need num_pages > 0 and max_pages a positive multiple of "
                "split_pages; got num_pages=%d max_pages=%d split_pages=%d",
                a->num_pages, a->max_pages, a->split_pages);
  }
  if (int64_t{a->batch} * (a->max_pages / a->split_pages) > kMaxGridY) {
    return Fail(err, err_len, "jax_flash_mla_sm90: batch x splits must be <= %d, got %d x %d",
                kMaxGridY, a->batch, a->max_pages / a->split_pages);
  }
  if (!(a->scale == a->scale)) return Fail(err, err_len, "jax_flash_mla_sm90: scale is NaN");
  return 0;
}

template <typename Args>
int ValidateIndexPointers(const Args* a, char* err, size_t err_len) {
  if (a->page_table == nullptr || a->q_lens == nullptr || a->kv_lens == nullptr ||
      a->lse == nullptr) {
    return Fail(err, err_len, "jax_flash_mla_sm90: a table, length or lse pointer is null");
  }
  return 0;
}

// Every value the kernel relies on; a message naming the first that fails.
int Validate(const JfMlaDecodeArgs* a, char* err, size_t err_len) {
  if (a == nullptr) return Fail(err, err_len, "jax_flash_mla_sm90: args is null");
  if (FindVariant(a->dtype) == nullptr) {
    return Fail(err, err_len, "jax_flash_mla_sm90: no kernel for JfDtype %d",
                static_cast<int>(a->dtype));
  }
  if (int rc = ValidateExtents(a, err, err_len)) return rc;
  if (a->batch == 0 || a->rows == 0) return 0;
  const void* vectors[] = {a->q, a->cache, a->o};
  for (const void* ptr : vectors) {
    if (!jax_flash_launch::IsAligned(ptr, kOperandAlign)) {
      return Fail(err, err_len, "jax_flash_mla_sm90: q, cache and o must be %d-byte aligned",
                  static_cast<int>(kOperandAlign));
    }
  }
  return ValidateIndexPointers(a, err, err_len);
}

int ValidateFp8(const JfMlaFp8Sm90Args* args, char* err, size_t err_len) {
  if (args == nullptr) return Fail(err, err_len, "jax_flash_mla_sm90_fp8: args is null");
  if (FindFp8Variant() == nullptr) {
    return Fail(err, err_len, "jax_flash_mla_sm90_fp8: this build holds no FP8-cache kernel");
  }
  const JfMlaDecodeArgs* a = &args->cache.mla;
  if (a->dtype != JF_BFLOAT16) {
    return Fail(err, err_len, "jax_flash_mla_sm90_fp8: o must be bfloat16 (JfDtype %d), got %d",
                static_cast<int>(JF_BFLOAT16), static_cast<int>(a->dtype));
  }
  if (int rc = ValidateExtents(a, err, err_len)) return rc;
  if (a->batch == 0 || a->rows == 0) return 0;
  // TMA boxes: 16-byte aligned bases (the rows are 512, 128 and 256 bytes).
  const void* boxes[] = {a->q, args->q_rope, a->cache, args->cache.scales, args->cache.rope, a->o};
  for (const void* ptr : boxes) {
    if (!jax_flash_launch::IsAligned(ptr, kOperandAlign)) {
      return Fail(err, err_len,
                  "jax_flash_mla_sm90_fp8: q codes, q_rope, latent, scales, rope and o must be "
                  "%d-byte aligned",
                  static_cast<int>(kOperandAlign));
    }
  }
  if (args->q_scales == nullptr) {
    return Fail(err, err_len, "jax_flash_mla_sm90_fp8: q_scales is null");
  }
  static_assert(kPage * sizeof(float) % kOperandAlign == 0, "a page's scales are whole TMA rows");
  return ValidateIndexPointers(a, err, err_len);
}

}  // namespace

extern "C" int jax_flash_mla_sm90_can_implement(const JfMlaDecodeArgs* args) {
  char unused[8];
  if (Validate(args, unused, sizeof unused) != 0) return 0;
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess && IsHopper(device);
}

extern "C" int jax_flash_mla_sm90(const JfMlaDecodeArgs* args, void* stream, char* err,
                                  size_t err_len) {
  if (int rc = Validate(args, err, err_len)) return rc;
  if (args->batch == 0 || args->rows == 0) return 0;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess || !IsHopper(device)) {
    return Fail(err, err_len, "jax_flash_mla_sm90: device %d is not compute capability 9.x",
                device);
  }
  if (int rc = FindVariant(args->dtype)(*args, static_cast<cudaStream_t>(stream), err, err_len)) {
    return rc;
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    return Fail(err, err_len, "jax_flash_mla_sm90: launch failed: %s", cudaGetErrorString(e));
  }
  return 0;
}

extern "C" int jax_flash_mla_sm90_fp8_available(void) { return FindFp8Variant() != nullptr; }

extern "C" int jax_flash_mla_sm90_fp8(const JfMlaFp8Sm90Args* args, void* stream, char* err,
                                      size_t err_len) {
  if (int rc = ValidateFp8(args, err, err_len)) return rc;
  if (args->cache.mla.batch == 0 || args->cache.mla.rows == 0) return 0;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess || !IsHopper(device)) {
    return Fail(err, err_len, "jax_flash_mla_sm90_fp8: device %d is not compute capability 9.x",
                device);
  }
  if (int rc = FindFp8Variant()(*args, static_cast<cudaStream_t>(stream), err, err_len)) {
    return rc;
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    return Fail(err, err_len, "jax_flash_mla_sm90_fp8: launch failed: %s",
                cudaGetErrorString(e));
  }
  return 0;
}
