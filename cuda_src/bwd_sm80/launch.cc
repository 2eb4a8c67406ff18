// jax_flash_bwd_sm80: C-ABI launcher for the AOT-compiled CuTe DSL backward
// kernels (cuda_src/bwd_sm80/kernel.py, exported by export.py).
//
// Build (verified; OBJ_80 / OBJ_90A are the export.py --out directories of
// the two arches, DSL = site-packages/nvidia_cutlass_dsl):
//
//   nvcc -std=c++17 -O2 -shared -Xcompiler -fPIC -cudart static
//        -I cuda_src/include -I $OBJ_80 -I $OBJ_90A
//        cuda_src/bwd_sm80/launch.cc $OBJ_80/*.o $OBJ_90A/*.o
//        $DSL/cu13/lib/libcuda_dialect_runtime_static.a
//        -Xlinker --exclude-libs,ALL -o libjax_flash_bwd_sm80.so
//
// (-Xlinker X is nvcc's spelling of -Wl,X.) The exported objects' own
// symbols stay visible; adding -Xlinker --version-script=F with F =
// "{ global: jax_flash_*; local: *; };" leaves only the entry points
// (checked with nm -D).
//
// All 40 variants of both arches link into one library without duplicate
// symbols: each object's symbols carry its function_prefix
// (jf_bwd_<arch>_<dtype>_hd<d>, or jf_bwdseg_... for the packed-document
// variants that run when has_segments is 1), and the static DSL runtime is
// linked once.
//
// Compute capability 8.x runs the sm_80 objects, 9.x the sm_90a ones.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "jax_flash/kernel_api.h"
#include "bwd_launch_common.h"  // first: it sets up the module loaders' error hook
#include "bwd_sm80_variants_sm_80.h"
#include "bwd_sm80_variants_sm_90a.h"

namespace {

using jax_flash_launch::BwdLaunchArgs;
using jax_flash_launch::Fail;

#define JF_BWD_SM80_SEG_ARGS(PREFIX)                                                \
  , reinterpret_cast<PREFIX##_Tensor_mQSeg_t*>(const_cast<SegIds*>(&a.q_seg)),      \
      reinterpret_cast<PREFIX##_Tensor_mKVSeg_t*>(const_cast<SegIds*>(&a.kv_seg)),  \
      reinterpret_cast<PREFIX##_Tensor_mQBounds_t*>(const_cast<Bounds*>(&a.q_bounds))
#define JF_BWD_DEFINE_LAUNCH(ARCH, DTYPE, HDIM, PREFIX) \
  JF_BWD_DEFINE_LAUNCH_WITH("jax_flash_bwd_sm80", PREFIX, JF_BWD_NO_SEG_ARGS)
#define JF_BWD_DEFINE_SEG_LAUNCH(ARCH, DTYPE, HDIM, PREFIX) \
  JF_BWD_DEFINE_LAUNCH_WITH("jax_flash_bwd_sm80", PREFIX, JF_BWD_SM80_SEG_ARGS)
JF_BWD_SM80_VARIANTS_SM80(JF_BWD_DEFINE_LAUNCH)
JF_BWD_SM80_VARIANTS_SM90A(JF_BWD_DEFINE_LAUNCH)
JF_BWD_SM80_SEG_VARIANTS_SM80(JF_BWD_DEFINE_SEG_LAUNCH)
JF_BWD_SM80_SEG_VARIANTS_SM90A(JF_BWD_DEFINE_SEG_LAUNCH)
#undef JF_BWD_DEFINE_SEG_LAUNCH
#undef JF_BWD_DEFINE_LAUNCH
#undef JF_BWD_SM80_SEG_ARGS

using LaunchFn = int (*)(const BwdLaunchArgs&, cudaStream_t, char*, size_t);

LaunchFn FindVariant(int arch, JfDtype dtype, int head_dim, bool has_segments) {
#define JF_BWD_MATCH(ARCH, DTYPE, HDIM, PREFIX) \
  if (dtype == DTYPE && head_dim == HDIM) return &Launch_##PREFIX;
  if (arch == 80 && !has_segments) {
    JF_BWD_SM80_VARIANTS_SM80(JF_BWD_MATCH)
  } else if (arch == 90 && !has_segments) {
    JF_BWD_SM80_VARIANTS_SM90A(JF_BWD_MATCH)
  } else if (arch == 80) {
    JF_BWD_SM80_SEG_VARIANTS_SM80(JF_BWD_MATCH)
  } else if (arch == 90) {
    JF_BWD_SM80_SEG_VARIANTS_SM90A(JF_BWD_MATCH)
  }
#undef JF_BWD_MATCH
  return nullptr;
}

constexpr const char* kWho = "jax_flash_bwd_sm80";

}  // namespace

extern "C" int jax_flash_bwd_sm80(const JfBwdArgs* args, void* stream_ptr, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) err[0] = '\0';
  if (args == nullptr) return Fail(err, err_len, "jax_flash_bwd_sm80: args is NULL");
  const JfProblem& p = args->problem;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);

  if (p.dtype != JF_FLOAT16 && p.dtype != JF_BFLOAT16)
    return Fail(err, err_len, "jax_flash_bwd_sm80: dtype must be float16 or bfloat16, got JfDtype %d", int(p.dtype));
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0)
    return Fail(err, err_len, "jax_flash_bwd_sm80: batch, seqlen_q, seqlen_k must be >= 0, got %d, %d, %d",
                p.batch, p.seqlen_q, p.seqlen_k);
  if (p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0)
    return Fail(err, err_len, "jax_flash_bwd_sm80: heads_q (%d) must be a positive multiple of heads_kv (%d)",
                p.heads_q, p.heads_kv);
  if (p.head_dim != p.head_dim_v)
    return Fail(err, err_len, "jax_flash_bwd_sm80: head_dim_v (%d) must equal head_dim (%d)", p.head_dim_v,
                p.head_dim);
  if (p.head_dim != 64 && p.head_dim != 96 && p.head_dim != 128 && p.head_dim != 192 && p.head_dim != 256)
    return Fail(err, err_len, "jax_flash_bwd_sm80: head_dim must be one of 64, 96, 128, 192, 256, got %d",
                p.head_dim);
  if (!(p.scale == p.scale) || p.scale == INFINITY || p.scale == -INFINITY)
    return Fail(err, err_len, "jax_flash_bwd_sm80: scale must be finite");
  if (jax_flash_launch::CheckOptions(p, "jax_flash_bwd_sm80", err, err_len) != 0) return 1;
  if (p.has_segments != 0 && p.has_segments != 1)
    return Fail(err, err_len, "jax_flash_bwd_sm80: has_segments must be 0 or 1, got %d", p.has_segments);
  if (p.heads_kv > 65535 || p.batch > 65535)
    return Fail(err, err_len, "jax_flash_bwd_sm80: batch (%d) and heads_kv (%d) must be <= 65535", p.batch,
                p.heads_kv);
  if (args->dq_tile_rows != 0)
    return Fail(err, err_len,
                "jax_flash_bwd_sm80: dq_accum must be in q's layout (dq_tile_rows 0), got dq_tile_rows %d",
                int(args->dq_tile_rows));

  const jax_flash_launch::BwdSizes sizes = jax_flash_launch::SizesOf(p);
  if (sizes.q_elems == 0 && sizes.kv_elems == 0) return 0;
  const bool seg = p.has_segments == 1;
  if (jax_flash_launch::CheckBwdOperands(args, sizes, seg, kWho, err, err_len) != 0) return 1;
  bool done = false;
  if (jax_flash_launch::ZeroBwdOutputs(args, sizes, stream, kWho, err, err_len, &done) != 0) return 1;
  if (done) return 0;

  int arch = 0;
  if (jax_flash_launch::CurrentBwdArch(/*has_sm80=*/true, kWho, err, err_len, &arch) != 0) return 1;
  LaunchFn launch = FindVariant(arch, p.dtype, p.head_dim, seg);
  if (launch == nullptr)
    return Fail(err, err_len, "jax_flash_bwd_sm80: no kernel for compute capability %d.x (needs 8.x or 9.x)",
                arch > 0 ? arch / 10 : -arch);

  if (launch(jax_flash_launch::MakeBwdLaunchArgs(args), stream, err, err_len) != 0) return 1;
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Fail(err, err_len, "jax_flash_bwd_sm80: kernel launch: %s", cudaGetErrorString(e));
  return 0;
}
