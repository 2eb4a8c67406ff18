// jax_flash_fwd_sm80: host launcher for the ahead-of-time exported CuTe DSL
// forward kernels (cuda_src/fwd_sm80/kernel.py, exported by export.py).
//
// Build (verified on the CPU machine with nvcc 13.0; both arches are always
// linked into the same library, and every exported symbol carries its own
// family/arch/dtype/head-dim prefix, so the 60 objects never collide; the
// jf_fwdseg_* variants are the packed-document ones, run when has_segments,
// the jf_fwdpaged_* ones read K / V from a paged cache: jax_flash_fwd_sm80_paged):
//
//   python -m cuda_src.fwd_sm80.export --arch sm_80  --out BUILD/fwd_sm_80
//   python -m cuda_src.fwd_sm80.export --arch sm_90a --out BUILD/fwd_sm_90a
//   DSL=$(python -c "import nvidia_cutlass_dsl; print(list(nvidia_cutlass_dsl.__path__)[0])")
//   INC="-I cuda_src/include -I BUILD/fwd_sm_80 -I BUILD/fwd_sm_90a"
//   OBJS="BUILD/fwd_sm_80/*.o BUILD/fwd_sm_90a/*.o $DSL/cu13/lib/libcuda_dialect_runtime_static.a"
//   nvcc -std=c++17 -O2 -shared -Xcompiler -fPIC -cudart static $INC cuda_src/fwd_sm80/launch.cc $OBJS -Xlinker --exclude-libs,ALL -o libjax_flash_fwd_sm80.so
//
// (nvcc does not take -Wl,...; -Xlinker passes --exclude-libs,ALL through.)
// The result needs only libc/libstdc++ and the driver at run time.

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/kernel_api.h"
#include "launch_common.h"  // first: it sets up the module loaders' error hook
#include "fwd_launch_common.h"
#include "fwd_sm80_variants_sm_80.h"
#include "fwd_sm80_variants_sm_90a.h"

namespace {

using jax_flash_launch::EnsureLoaded;
using jax_flash_launch::Fail;
using jax_flash_launch::LoadedModule;

constexpr int kMaxGridYZ = 65535;  // grid = (query tiles, heads_q, batch)
constexpr uintptr_t kOperandAlign = 16;  // kernels use 16-byte vector copies

enum class Arch { kUnknown = 0, kSm80 = 1, kSm90a = 2, kUnsupported = 3 };

Arch DeviceArch(int device) {
  int major = 0;
  if (jax_flash_launch::ComputeCapabilityMajor(device, &major) != cudaSuccess) return Arch::kUnknown;
  // Cubins run only within their major version: 8.x takes the sm_80 objects
  // (8.6/8.9 have 99 KiB of shared memory per block, too little for the
  // head-dim-256 tile, whose launch then fails with a CUDA error), 9.0 the
  // sm_90a objects; anything else has no kernel here.
  return major == 8 ? Arch::kSm80 : major == 9 ? Arch::kSm90a : Arch::kUnsupported;
}

using jax_flash_launch::Prod;

#define JF_FWD_ENTRY "jax_flash_fwd_sm80"

JF_FWD_SM80_VARIANTS_SM_80(JF_DEFINE_FWD_VARIANT)
JF_FWD_SM80_VARIANTS_SM_90A(JF_DEFINE_FWD_VARIANT)
JF_FWD_SM80_SEG_VARIANTS_SM_80(JF_DEFINE_FWD_SEG_VARIANT)
JF_FWD_SM80_SEG_VARIANTS_SM_90A(JF_DEFINE_FWD_SEG_VARIANT)
#undef JF_FWD_ENTRY

using LaunchFn = int (*)(const JfFwdArgs&, cudaStream_t, char*, size_t);

LaunchFn FindVariant(Arch arch, JfDtype dtype, int head_dim, bool has_segments) {
#define JF_MATCH_VARIANT(arch_tag, dtype_enum, hd, prefix) \
  if (dtype == dtype_enum && head_dim == hd) return Launch_##prefix;
  if (arch == Arch::kSm80 && !has_segments) {
    JF_FWD_SM80_VARIANTS_SM_80(JF_MATCH_VARIANT)
  } else if (arch == Arch::kSm90a && !has_segments) {
    JF_FWD_SM80_VARIANTS_SM_90A(JF_MATCH_VARIANT)
  } else if (arch == Arch::kSm80) {
    JF_FWD_SM80_SEG_VARIANTS_SM_80(JF_MATCH_VARIANT)
  } else if (arch == Arch::kSm90a) {
    JF_FWD_SM80_SEG_VARIANTS_SM_90A(JF_MATCH_VARIANT)
  }
#undef JF_MATCH_VARIANT
  return nullptr;
}

int Validate(const JfFwdArgs* args, char* err, size_t err_len) {
  if (args == nullptr) return Fail(err, err_len, "jax_flash_fwd_sm80: args is null");
  const JfProblem& p = args->problem;
  if (p.dtype != JF_FLOAT16 && p.dtype != JF_BFLOAT16) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80: dtype must be float16 or bfloat16, got JfDtype %d",
                static_cast<int>(p.dtype));
  }
  if (p.head_dim != p.head_dim_v) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80: head_dim_v must equal head_dim, got %d and %d",
                p.head_dim_v, p.head_dim);
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80: sizes must be >= 0, got batch=%d seqlen_q=%d seqlen_k=%d",
                p.batch, p.seqlen_q, p.seqlen_k);
  }
  if (p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80: need heads_q, heads_kv > 0 and heads_q %% heads_kv == 0, "
                "got heads_q=%d heads_kv=%d",
                p.heads_q, p.heads_kv);
  }
  if (p.heads_q > kMaxGridYZ || p.batch > kMaxGridYZ) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80: heads_q and batch must be <= %d, got %d and %d",
                kMaxGridYZ, p.heads_q, p.batch);
  }
  if (p.has_segments != 0 && p.has_segments != 1) {
    return Fail(err, err_len, "jax_flash_fwd_sm80: has_segments must be 0 or 1, got %d",
                p.has_segments);
  }
  if (jax_flash_launch::CheckOptions(p, "jax_flash_fwd_sm80", err, err_len) != 0) return 1;
  if (args->sinks != nullptr) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80: takes no sinks (only jax_flash_fwd_sm90 adds them)");
  }
  const bool has_q = p.batch > 0 && p.seqlen_q > 0;
  const bool has_kv = p.batch > 0 && p.seqlen_k > 0;
  const bool seg = p.has_segments == 1;
  struct Operand {
    const char* name;
    const void* ptr;
    bool needed;
    bool vector;
  } operands[] = {
      {"q", args->q, has_q, true},          {"k", args->k, has_q && has_kv, true},
      {"v", args->v, has_q && has_kv, true}, {"o", args->o, has_q, true},
      {"lse", args->lse, has_q, false},     {"q_lens", args->q_lens, has_q, false},
      {"kv_lens", args->kv_lens, has_q, false},
      {"q_segment_ids", args->q_segment_ids, seg && has_q, false},
      {"kv_segment_ids", args->kv_segment_ids, seg && has_q && has_kv, false},
      {"kv_bounds", args->kv_bounds, seg && has_q, false},
  };
  for (const Operand& op : operands) {
    if (!op.needed) continue;
    if (op.ptr == nullptr) {
      return Fail(err, err_len, "jax_flash_fwd_sm80: %s is null", op.name);
    }
    if (op.vector && !jax_flash_launch::IsAligned(op.ptr, kOperandAlign)) {
      return Fail(err, err_len, "jax_flash_fwd_sm80: %s must be %d-byte aligned", op.name,
                  static_cast<int>(kOperandAlign));
    }
  }
  return 0;
}

// ---- Paged K / V (kernel_api.h: JfPagedFwdArgs) ------------------------------

// Fills the generated descriptors (dynamic modes only) and launches.
#define JF_DEFINE_FWD_PAGED_VARIANT(arch_tag, dtype_enum, hd, prefix)                        \
  LoadedModule<prefix##_Kernel_Module_t> g_##prefix;                                      \
  int Launch_##prefix(const JfPagedFwdArgs& a, cudaStream_t stream, char* err,            \
                      size_t err_len) {                                                   \
    cudaError_t load = EnsureLoaded(g_##prefix, prefix##_Kernel_Module_Load);             \
    if (load != cudaSuccess) {                                                            \
      return Fail(err, err_len, "jax_flash_fwd_sm80_paged: loading " #prefix ": %s",      \
                  cudaGetErrorString(load));                                              \
    }                                                                                     \
    const JfProblem& p = a.problem;                                                       \
    const int64_t h = p.head_dim;                                                         \
    const int32_t outs = p.batch * (a.max_pages / a.split_pages);  /* <= kMaxGridYZ */     \
    prefix##_Tensor_mQ_t q = {const_cast<void*>(a.q),                                     \
                              {p.batch, p.seqlen_q, p.heads_q},                           \
                              {Prod(p.seqlen_q, p.heads_q, h), Prod(p.heads_q, h)}};      \
    prefix##_Tensor_mK_t k = {const_cast<void*>(a.k_pages),                               \
                              {a.num_pages, a.page_size, p.heads_kv},                     \
                              {Prod(a.page_size, p.heads_kv, h), Prod(p.heads_kv, h)}};   \
    prefix##_Tensor_mV_t v = {const_cast<void*>(a.v_pages),                               \
                              {a.num_pages, a.page_size, p.heads_kv},                     \
                              {Prod(a.page_size, p.heads_kv, h), Prod(p.heads_kv, h)}};   \
    prefix##_Tensor_mO_t o = {a.o,                                                        \
                              {outs, p.seqlen_q, p.heads_q},                              \
                              {Prod(p.seqlen_q, p.heads_q, h), Prod(p.heads_q, h)}};      \
    prefix##_Tensor_mLSE_t lse = {a.lse,                                                  \
                                  {outs, p.heads_q, p.seqlen_q},                          \
                                  {Prod(p.heads_q, p.seqlen_q), p.seqlen_q}};             \
    prefix##_Tensor_mQLens_t q_lens = {const_cast<int32_t*>(a.q_lens), {p.batch}};        \
    prefix##_Tensor_mKVLens_t kv_lens = {const_cast<int32_t*>(a.kv_lens), {p.batch}};     \
    prefix##_Tensor_mPageTable_t table = {const_cast<int32_t*>(a.page_table),             \
                                          {p.batch, a.max_pages}, {a.max_pages}};         \
    int32_t rc = cute_dsl_##prefix##_wrapper(                                             \
        &g_##prefix.module, &q, &k, &v, &o, &lse, &q_lens, &kv_lens, p.scale, p.softcap,  \
        p.diag_offset, p.window_left, p.window_right, stream, &table, a.split_pages);     \
    if (rc != 0) {                                                                        \
      return Fail(err, err_len, "jax_flash_fwd_sm80_paged: " #prefix " returned %d", rc); \
    }                                                                                     \
    return 0;                                                                             \
  }
JF_FWD_SM80_PAGED_VARIANTS_SM_80(JF_DEFINE_FWD_PAGED_VARIANT)
JF_FWD_SM80_PAGED_VARIANTS_SM_90A(JF_DEFINE_FWD_PAGED_VARIANT)
#undef JF_DEFINE_FWD_PAGED_VARIANT

using PagedLaunchFn = int (*)(const JfPagedFwdArgs&, cudaStream_t, char*, size_t);

PagedLaunchFn FindPagedVariant(Arch arch, JfDtype dtype, int head_dim) {
#define JF_MATCH_PAGED_VARIANT(arch_tag, dtype_enum, hd, prefix) \
  if (dtype == dtype_enum && head_dim == hd) return Launch_##prefix;
  if (arch == Arch::kSm80) {
    JF_FWD_SM80_PAGED_VARIANTS_SM_80(JF_MATCH_PAGED_VARIANT)
  } else if (arch == Arch::kSm90a) {
    JF_FWD_SM80_PAGED_VARIANTS_SM_90A(JF_MATCH_PAGED_VARIANT)
  }
#undef JF_MATCH_PAGED_VARIANT
  return nullptr;
}

// Every value the kernel relies on (the device aside); a message naming the
// first that fails. Any positive page size serves: each key is its own copy
// row (paged_loads.py).
int ValidatePaged(const JfPagedFwdArgs* a, char* err, size_t err_len) {
  if (a == nullptr) return Fail(err, err_len, "jax_flash_fwd_sm80_paged: args is null");
  const JfProblem& p = a->problem;
  if (jax_flash_launch::CheckOptions(p, "jax_flash_fwd_sm80_paged", err, err_len) != 0) return 1;
  if (FindPagedVariant(Arch::kSm80, p.dtype, p.head_dim) == nullptr ||
      p.head_dim_v != p.head_dim) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80_paged: no kernel for JfDtype %d, head_dim %d, head_dim_v %d "
                "(float16 or bfloat16, head_dim == head_dim_v in 64, 96, 128, 192, 256)",
                static_cast<int>(p.dtype), p.head_dim, p.head_dim_v);
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.heads_q <= 0 || p.heads_kv <= 0 ||
      p.heads_q % p.heads_kv != 0 || p.heads_q > kMaxGridYZ) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80_paged: need batch, seqlen_q >= 0, 0 < heads_kv, heads_q a "
                "multiple of heads_kv up to %d; got batch=%d seqlen_q=%d heads_q=%d heads_kv=%d",
                kMaxGridYZ, p.batch, p.seqlen_q, p.heads_q, p.heads_kv);
  }
  if (a->page_size <= 0 || a->num_pages <= 0 || a->split_pages <= 0 || a->max_pages <= 0 ||
      a->max_pages % a->split_pages != 0 ||
      int64_t{a->max_pages} * a->page_size > INT32_MAX) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80_paged: need page_size, num_pages > 0, max_pages a positive "
                "multiple of split_pages and max_pages * page_size < 2^31; got page_size=%d "
                "num_pages=%d max_pages=%d split_pages=%d",
                a->page_size, a->num_pages, a->max_pages, a->split_pages);
  }
  if (int64_t{p.batch} * (a->max_pages / a->split_pages) > kMaxGridYZ) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80_paged: batch x splits must be <= %d, got %d x %d", kMaxGridYZ,
                p.batch, a->max_pages / a->split_pages);
  }
  if (p.batch == 0 || p.seqlen_q == 0) return 0;
  const void* vectors[] = {a->q, a->k_pages, a->v_pages, a->o};
  for (const void* ptr : vectors) {
    if (ptr == nullptr || !jax_flash_launch::IsAligned(ptr, kOperandAlign)) {
      return Fail(err, err_len,
                  "jax_flash_fwd_sm80_paged: q, pages and o must be non-null and %d-byte aligned",
                  static_cast<int>(kOperandAlign));
    }
  }
  if (a->page_table == nullptr || a->q_lens == nullptr || a->kv_lens == nullptr ||
      a->lse == nullptr) {
    return Fail(err, err_len, "jax_flash_fwd_sm80_paged: a table, length or lse pointer is null");
  }
  return 0;
}

}  // namespace

extern "C" int jax_flash_fwd_sm80_paged_can_implement(const JfPagedFwdArgs* args) {
  char unused[8];
  if (ValidatePaged(args, unused, sizeof unused) != 0) return 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  return FindPagedVariant(DeviceArch(device), args->problem.dtype, args->problem.head_dim) !=
         nullptr;
}

extern "C" int jax_flash_fwd_sm80_paged(const JfPagedFwdArgs* args, void* stream, char* err,
                                        size_t err_len) {
  if (int rc = ValidatePaged(args, err, err_len)) return rc;
  const JfProblem& p = args->problem;
  if (p.batch == 0 || p.seqlen_q == 0) return 0;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    return Fail(err, err_len, "jax_flash_fwd_sm80_paged: cudaGetDevice: %s",
                cudaGetErrorString(e));
  }
  PagedLaunchFn launch = FindPagedVariant(DeviceArch(device), p.dtype, p.head_dim);
  if (launch == nullptr) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80_paged: device %d is not compute capability 8.x or 9.x",
                device);
  }
  if (int rc = launch(*args, static_cast<cudaStream_t>(stream), err, err_len)) return rc;
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    return Fail(err, err_len, "jax_flash_fwd_sm80_paged: launch failed: %s",
                cudaGetErrorString(e));
  }
  return 0;
}

extern "C" int jax_flash_fwd_sm80(const JfFwdArgs* args, void* stream, char* err,
                                  size_t err_len) {
  if (int rc = Validate(args, err, err_len)) return rc;
  const JfProblem& p = args->problem;
  // An empty key set still needs o = 0 and lse = -inf: the kernel handles it
  // (no KV tile is visited), so only an empty query set skips the launch.
  if (p.batch == 0 || p.seqlen_q == 0) return 0;

  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    return Fail(err, err_len, "jax_flash_fwd_sm80: cudaGetDevice: %s", cudaGetErrorString(e));
  }
  const Arch arch = DeviceArch(device);
  if (arch == Arch::kUnknown || arch == Arch::kUnsupported) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80: device %d is not compute capability 8.x or 9.x",
                device);
  }
  LaunchFn launch = FindVariant(arch, p.dtype, p.head_dim, p.has_segments == 1);
  if (launch == nullptr) {
    return Fail(err, err_len,
                "jax_flash_fwd_sm80: no kernel for head_dim %d (supported: 64, 96, 128, "
                "192, 256)",
                p.head_dim);
  }
  if (int rc = launch(*args, static_cast<cudaStream_t>(stream), err, err_len)) return rc;
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    return Fail(err, err_len, "jax_flash_fwd_sm80: launch failed: %s", cudaGetErrorString(e));
  }
  return 0;
}
