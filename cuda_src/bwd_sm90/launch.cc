// jax_flash_bwd_sm90: C-ABI launcher for the AOT-compiled Hopper (WGMMA, TMA,
// warp-specialised) backward kernels (cuda_src/bwd_sm90/kernel.py, exported
// by export.py).
//
// Build (OBJ = the export.py --out directory, DSL = site-packages/
// nvidia_cutlass_dsl):
//
//   nvcc -std=c++17 -O2 -shared -Xcompiler -fPIC -cudart static
//        -I cuda_src/include -I $OBJ cuda_src/bwd_sm90/launch.cc $OBJ/*.o
//        $DSL/cu13/lib/libcuda_dialect_runtime_static.a
//        -Xlinker --exclude-libs,ALL -o libjax_flash_bwd_sm90.so
//
// The objects' symbols carry their prefix (jf_bwd90_sm90a_<dtype>_hd<d>, or
// ..._hd<d>v<dv> where V is narrower, and jf_bwd90det_... for the
// deterministic variants), so
// this links next to the sm80 family in one library; the static DSL runtime
// must then be linked once. The TMA descriptors are encoded on the host by
// the exported wrapper on every call (cuTensorMapEncodeTiled via that
// runtime), which neither allocates nor synchronises.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "jax_flash/kernel_api.h"
#include "bwd_launch_common.h"  // first: it sets up the module loaders' error hook
#include "bwd_sm90_variants_sm_90a.h"

namespace {

using jax_flash_launch::BwdLaunchArgs;
using jax_flash_launch::Fail;

#define JF_BWD_SM90_SEG_ARGS(PREFIX)                                                \
  , reinterpret_cast<PREFIX##_Tensor_mQSeg_t*>(const_cast<SegIds*>(&a.q_seg)),      \
      reinterpret_cast<PREFIX##_Tensor_mKVSeg_t*>(const_cast<SegIds*>(&a.kv_seg)),  \
      reinterpret_cast<PREFIX##_Tensor_mQBounds_t*>(const_cast<Bounds*>(&a.q_bounds))
#define JF_BWD_DEFINE_LAUNCH(ARCH, DTYPE, HDIM, HDIM_V, PREFIX, DQ_TILE_ROWS, KV_TILE, TURN_CHAINS, QUERY_TILE) \
  JF_BWD_DEFINE_LAUNCH_WITH("jax_flash_bwd_sm90", PREFIX, JF_BWD_NO_SEG_ARGS)
#define JF_BWD_DEFINE_SEG_LAUNCH(ARCH, DTYPE, HDIM, HDIM_V, PREFIX, DQ_TILE_ROWS, KV_TILE, TURN_CHAINS, QUERY_TILE) \
  JF_BWD_DEFINE_LAUNCH_WITH("jax_flash_bwd_sm90", PREFIX, JF_BWD_SM90_SEG_ARGS)
JF_BWD_SM90_VARIANTS_SM90A(JF_BWD_DEFINE_LAUNCH)
JF_BWD_SM90_DET_VARIANTS_SM90A(JF_BWD_DEFINE_LAUNCH)
JF_BWD_SM90_SEG_VARIANTS_SM90A(JF_BWD_DEFINE_SEG_LAUNCH)
JF_BWD_SM90_CAP_VARIANTS_SM90A(JF_BWD_DEFINE_LAUNCH)
#undef JF_BWD_DEFINE_SEG_LAUNCH
#undef JF_BWD_DEFINE_LAUNCH
#undef JF_BWD_SM90_SEG_ARGS

using LaunchFn = int (*)(const BwdLaunchArgs&, cudaStream_t, char*, size_t);

struct Variant {
  LaunchFn launch;       // nullptr: none serves the problem
  int32_t dq_tile_rows;  // kernel_api.h: dq_accum in query tiles of these rows, or 0
  int32_t kv_tile;       // keys per CTA
  int32_t turn_chains;   // tile_config.py: det_turn_chains
};

// No variant is both deterministic and packed-document, nor soft-capped and
// either (kernel.py says why): those problems run on the sm80 backward.
Variant FindVariant(int arch, const JfProblem& p) {
  const bool deterministic = p.deterministic == 1, segments = p.has_segments == 1, softcap = p.softcap != 0.0f;
#define JF_BWD_MATCH(ARCH, DTYPE, HDIM, HDIM_V, PREFIX, DQ_TILE_ROWS, KV_TILE, TURN_CHAINS, QUERY_TILE) \
  if (p.dtype == DTYPE && p.head_dim == HDIM && p.head_dim_v == HDIM_V) return {&Launch_##PREFIX, DQ_TILE_ROWS, KV_TILE, TURN_CHAINS};
  if (arch != 90 || (deterministic && segments) || (softcap && (deterministic || segments))) return {};
  if (softcap) {
    JF_BWD_SM90_CAP_VARIANTS_SM90A(JF_BWD_MATCH)
  } else if (segments) {
    JF_BWD_SM90_SEG_VARIANTS_SM90A(JF_BWD_MATCH)
  } else if (deterministic) {
    JF_BWD_SM90_DET_VARIANTS_SM90A(JF_BWD_MATCH)
  } else {
    JF_BWD_SM90_VARIANTS_SM90A(JF_BWD_MATCH)
  }
#undef JF_BWD_MATCH
  return {};
}

constexpr const char* kWho = "jax_flash_bwd_sm90";

// The CTAs of the deterministic kernel that may wait on each other both ways
// (the rotated order, dsl_common.rotated_order) must all be resident at
// once: at most half the SMs, leaving room for one more such kernel
// running alongside.
int ResidentCtas(int* resident, char* err, size_t err_len) {
  int device = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = jax_flash_launch::CachedDeviceAttribute<cudaDevAttrMultiProcessorCount>(device, &sms);
  if (e != cudaSuccess) return Fail(err, err_len, "jax_flash_bwd_sm90: SM count: %s", cudaGetErrorString(e));
  *resident = std::max(1, sms / 2);
  return 0;
}

}  // namespace

extern "C" int jax_flash_bwd_sm90_can_implement(const JfProblem* p) {
  if (p == nullptr) return 0;
  if (p->dtype != JF_FLOAT16 && p->dtype != JF_BFLOAT16) return 0;
  if (FindVariant(90, *p).launch == nullptr) return 0;
  if (p->batch > 65535 || p->heads_kv > 65535) return 0;
  int arch = 0;
  if (jax_flash_launch::CurrentBwdArch(/*has_sm80=*/false, kWho, nullptr, 0, &arch) != 0) return 0;
  return arch == 90 ? 1 : 0;
}

extern "C" int jax_flash_bwd_sm90_has_variant(int32_t dtype, int32_t head_dim, int32_t head_dim_v,
                                              int32_t deterministic, int32_t has_segments,
                                              int32_t softcap) {
  JfProblem p{};
  p.dtype = static_cast<JfDtype>(dtype);
  p.head_dim = head_dim;
  p.head_dim_v = head_dim_v;
  p.deterministic = deterministic;
  p.has_segments = has_segments;
  p.softcap = softcap ? 1.0f : 0.0f;
  return FindVariant(90, p).launch != nullptr ? 1 : 0;
}

extern "C" int jax_flash_bwd_sm90_dq_tile_rows(int32_t head_dim, int32_t head_dim_v) {
  // Every kind of variant of the same head dims shares its tile (tile_config.py).
#define JF_BWD_ROWS(ARCH, DTYPE, HDIM, HDIM_V, PREFIX, DQ_TILE_ROWS, KV_TILE, TURN_CHAINS, QUERY_TILE) \
  if (head_dim == HDIM && head_dim_v == HDIM_V) return DQ_TILE_ROWS;
  JF_BWD_SM90_VARIANTS_SM90A(JF_BWD_ROWS)
#undef JF_BWD_ROWS
  return 0;
}

// The deterministic kernels write the first turn of each dQ accumulator's
// tile instead of adding it, so dq_accum is not zeroed for them: the caller
// keeps the query tiles (of this many rows, one dq_semaphore entry each)
// whose count of turns is nonzero. 0: no deterministic kernel of these dims.
extern "C" int jax_flash_bwd_sm90_deterministic_query_tile(int32_t head_dim, int32_t head_dim_v) {
#define JF_BWD_QUERY_TILE(ARCH, DTYPE, HDIM, HDIM_V, PREFIX, DQ_TILE_ROWS, KV_TILE, TURN_CHAINS, QUERY_TILE) \
  if (head_dim == HDIM && head_dim_v == HDIM_V) return QUERY_TILE;
  JF_BWD_SM90_DET_VARIANTS_SM90A(JF_BWD_QUERY_TILE)
#undef JF_BWD_QUERY_TILE
  return 0;
}

// Groups of KV tiles the rotated order may split a head into: two beat the
// unrotated order, four lost for four times the dQ scratch
// (docs/kernel-evidence.md).
constexpr int64_t kMaxRotationGroups = 2;

extern "C" int jax_flash_bwd_sm90_deterministic_dq_chains(int32_t head_dim, int32_t head_dim_v, int32_t seqlen_k) {
  // The rotated order splits a head's KV tiles into groups of resident CTAs,
  // each with turn_chains accumulators of its own (dsl_common.rotated_order).
  JfProblem p{};
  p.dtype = JF_BFLOAT16;  // both dtypes share their tiles
  p.head_dim = head_dim;
  p.head_dim_v = head_dim_v;
  p.deterministic = 1;
  const Variant variant = FindVariant(90, p);
  int resident = 0;
  if (variant.launch == nullptr || seqlen_k <= 0 || ResidentCtas(&resident, nullptr, 0) != 0) return 1;
  const int64_t kv_tiles = (int64_t{seqlen_k} + variant.kv_tile - 1) / variant.kv_tile;
  const int64_t groups = (kv_tiles + resident - 1) / resident;
  const int64_t chains = groups * variant.turn_chains;
  return groups <= kMaxRotationGroups && chains <= JF_MAX_DQ_CHAINS ? int(chains) : 1;
}

extern "C" int jax_flash_bwd_sm90(const JfBwdArgs* args, void* stream_ptr, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) err[0] = '\0';
  if (args == nullptr) return Fail(err, err_len, "jax_flash_bwd_sm90: args is NULL");
  const JfProblem& p = args->problem;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);

  if (p.dtype != JF_FLOAT16 && p.dtype != JF_BFLOAT16)
    return Fail(err, err_len, "jax_flash_bwd_sm90: dtype must be float16 or bfloat16, got JfDtype %d", int(p.dtype));
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0)
    return Fail(err, err_len, "jax_flash_bwd_sm90: batch, seqlen_q, seqlen_k must be >= 0, got %d, %d, %d",
                p.batch, p.seqlen_q, p.seqlen_k);
  if (p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0)
    return Fail(err, err_len, "jax_flash_bwd_sm90: heads_q (%d) must be a positive multiple of heads_kv (%d)",
                p.heads_q, p.heads_kv);
  if (FindVariant(90, p).launch == nullptr)
    return Fail(err, err_len,
                "jax_flash_bwd_sm90: no variant for head_dim %d, head_dim_v %d, deterministic %d, "
                "has_segments %d, softcap %g (built: bwd_sm90_variants_sm_90a.h)",
                p.head_dim, p.head_dim_v, p.deterministic, p.has_segments, double(p.softcap));
  if (args->dq_tile_rows != FindVariant(90, p).dq_tile_rows)
    return Fail(err, err_len,
                "jax_flash_bwd_sm90: the head_dim %d, head_dim_v %d kernels take dq_accum with dq_tile_rows %d "
                "(jax_flash_bwd_sm90_dq_tile_rows), got %d",
                p.head_dim, p.head_dim_v, int(FindVariant(90, p).dq_tile_rows), int(args->dq_tile_rows));
  if (!(p.scale == p.scale) || p.scale == INFINITY || p.scale == -INFINITY)
    return Fail(err, err_len, "jax_flash_bwd_sm90: scale must be finite");
  if (jax_flash_launch::CheckOptions(p, "jax_flash_bwd_sm90", err, err_len) != 0) return 1;
  if (p.heads_kv > 65535 || p.batch > 65535)
    return Fail(err, err_len, "jax_flash_bwd_sm90: batch (%d) and heads_kv (%d) must be <= 65535", p.batch,
                p.heads_kv);

  const jax_flash_launch::BwdSizes sizes = jax_flash_launch::SizesOf(p);
  if (sizes.q_elems == 0 && sizes.kv_elems == 0) return 0;
  const bool seg = p.has_segments == 1;
  if (jax_flash_launch::CheckBwdOperands(args, sizes, seg, kWho, err, err_len) != 0) return 1;
  bool done = false;
  // The deterministic kernels need no zeroed dq_accum
  // (jax_flash_bwd_sm90_deterministic_query_tile).
  const bool zero_dq = p.deterministic != 1;
  if (jax_flash_launch::ZeroBwdOutputs(args, sizes, stream, kWho, err, err_len, &done, zero_dq) != 0) return 1;
  if (done) return 0;

  int arch = 0;
  if (jax_flash_launch::CurrentBwdArch(/*has_sm80=*/false, kWho, err, err_len, &arch) != 0) return 1;
  const Variant variant = FindVariant(arch, p);
  if (variant.launch == nullptr)
    return Fail(err, err_len, "jax_flash_bwd_sm90: no kernel for compute capability %d.x (needs 9.x)",
                arch > 0 ? arch / 10 : -arch);

  jax_flash_launch::BwdLaunchArgs launch_args = jax_flash_launch::MakeBwdLaunchArgs(args);
  if (variant.dq_tile_rows > 0) {
    // One (batch, chain, head) after another, each as tiles x rows rows.
    const size_t rows = jax_flash_launch::DqTileChainRows(p, variant.dq_tile_rows);
    const size_t per_head = rows / (size_t(p.batch) * p.heads_q);
    if (args->dq_chains * rows > size_t(INT32_MAX))
      return Fail(err, err_len, "jax_flash_bwd_sm90: %zu dq_accum rows exceed int32", args->dq_chains * rows);
    launch_args.dq.shape[0] = p.batch * args->dq_chains * p.heads_q;
    launch_args.dq.shape[1] = int32_t(per_head);
    launch_args.dq.shape[2] = 1;
    launch_args.dq.stride[0] = int64_t(per_head) * p.head_dim;
    launch_args.dq.stride[1] = p.head_dim;
  } else if (p.deterministic == 1) {
    // Every chain of dq_accum, as batch entries after the first chain's.
    launch_args.dq.shape[0] = p.batch * args->dq_chains;
  }
  if (p.deterministic == 1 && ResidentCtas(&launch_args.deterministic, err, err_len) != 0) return 1;
  if (variant.launch(launch_args, stream, err, err_len) != 0) return 1;
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Fail(err, err_len, "jax_flash_bwd_sm90: kernel launch: %s", cudaGetErrorString(e));
  return 0;
}
