// FlashAttention forward and backward on the CPU, implementing the C ABI in
// jax_flash/kernel_api.h.
//
// Each worker walks tiles of queries against tiles of keys with the online
// softmax, so memory stays O(N): all tile buffers are fixed-size arrays on the
// worker's stack (about 260 KiB in the backward) and nothing is allocated on
// the heap except by std::thread itself. Inputs are widened to float on load;
// every accumulation is float32 in an order fixed by the tiling alone, so
// results are bitwise identical run to run and for any thread count.
//
// The forward and backward kernels live in attention_cpu_fwd.cc and
// attention_cpu_bwd.cc; this file checks the arguments and dispatches.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "attention_cpu_tiles.h"
#include "jax_flash/kernel_api.h"

namespace jax_flash_cpu {
namespace {

// ---- argument checks --------------------------------------------------------

// Writes "<entry>: <message>" into err and returns 1, so checks read as
// `return fail(...)`.
template <class... Rest>
int fail(char* err, size_t err_len, const char* entry, const char* format,
         Rest... rest) {
  if (err != nullptr && err_len > 0) {
    const int n = std::snprintf(err, err_len, "%s: ", entry);
    if (n >= 0 && static_cast<size_t>(n) < err_len) {
      std::snprintf(err + n, err_len - n, format, rest...);
    }
  }
  return 1;
}

// Checks what both directions share; returns 0 or the fail() code.
int check_problem(const JfProblem& p, const char* entry, char* err,
                  size_t err_len) {
  // Read as an integer: loading an enum outside its range is undefined.
  std::underlying_type_t<JfDtype> dtype;
  std::memcpy(&dtype, &p.dtype, sizeof dtype);
  if (dtype != JF_FLOAT16 && dtype != JF_BFLOAT16 && dtype != JF_FLOAT32) {
    return fail(err, err_len, entry, "unknown dtype %lld",
                static_cast<long long>(dtype));
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0) {
    return fail(err, err_len, entry,
                "batch, seqlen_q and seqlen_k must be >= 0, got %d, %d, %d",
                p.batch, p.seqlen_q, p.seqlen_k);
  }
  if (p.heads_q <= 0 || p.heads_kv <= 0) {
    return fail(err, err_len, entry,
                "heads_q and heads_kv must be > 0, got %d, %d", p.heads_q,
                p.heads_kv);
  }
  if (p.heads_q % p.heads_kv != 0) {
    return fail(err, err_len, entry,
                "heads_q (%d) must be a multiple of heads_kv (%d)", p.heads_q,
                p.heads_kv);
  }
  if (p.head_dim <= 0 || p.head_dim > kMaxHeadDim || p.head_dim_v <= 0 ||
      p.head_dim_v > kMaxHeadDim) {
    return fail(err, err_len, entry,
                "head_dim and head_dim_v must be in [1, %d], got %d, %d",
                kMaxHeadDim, p.head_dim, p.head_dim_v);
  }
  if (!std::isfinite(p.scale)) {
    return fail(err, err_len, entry, "scale must be finite, got %g",
                static_cast<double>(p.scale));
  }
  if (p.has_segments != 0 && p.has_segments != 1) {
    return fail(err, err_len, entry, "has_segments must be 0 or 1, got %d",
                p.has_segments);
  }
  if (!std::isfinite(p.softcap) || p.softcap < 0.0f) {
    return fail(err, err_len, entry, "softcap must be finite and >= 0, got %g",
                static_cast<double>(p.softcap));
  }
  if (p.deterministic != 0 && p.deterministic != 1) {
    return fail(err, err_len, entry, "deterministic must be 0 or 1, got %d",
                p.deterministic);
  }
  return 0;
}

// A pointer may be null only where its array is empty. Returns 0 or the
// fail() code naming the first missing one.
struct Operand {
  const char* name;
  const void* ptr;
  bool empty;
};

template <size_t kCount>
int check_pointers(const Operand (&operands)[kCount], const char* entry,
                   char* err, size_t err_len) {
  for (const Operand& op : operands) {
    if (op.ptr == nullptr && !op.empty) {
      return fail(err, err_len, entry, "%s is null", op.name);
    }
  }
  return 0;
}

int run_forward(const JfFwdArgs* args, char* err, size_t err_len) {
  constexpr const char* kEntry = "jax_flash_fwd_cpu";
  if (args == nullptr) return fail(err, err_len, kEntry, "args is null");
  if (const int rc = check_problem(args->problem, kEntry, err, err_len)) {
    return rc;
  }
  if (args->sinks != nullptr) {
    return fail(err, err_len, kEntry, "takes no sinks (only jax_flash_fwd_sm90 adds them)");
  }
  const Geometry g(args->problem);
  const bool no_q = g.batch == 0 || g.seqlen_q == 0;
  const bool no_k = g.batch == 0 || g.seqlen_k == 0;
  // Segment arrays are read only where has_segments says they are set.
  const bool no_seg = args->problem.has_segments == 0;
  const Operand operands[] = {
      {"q", args->q, no_q},
      {"k", args->k, no_k},
      {"v", args->v, no_k},
      {"o", args->o, no_q},
      {"lse", args->lse, no_q},
      {"q_segment_ids", args->q_segment_ids, no_seg || no_q},
      {"kv_segment_ids", args->kv_segment_ids, no_seg || no_k},
      {"kv_bounds", args->kv_bounds, no_seg || no_q}};
  if (const int rc = check_pointers(operands, kEntry, err, err_len)) return rc;
  if (!no_q) forward_cpu(*args, g);
  if (err != nullptr && err_len > 0) err[0] = '\0';
  return 0;
}

int run_backward(const JfBwdArgs* args, char* err, size_t err_len) {
  constexpr const char* kEntry = "jax_flash_bwd_cpu";
  if (args == nullptr) return fail(err, err_len, kEntry, "args is null");
  if (const int rc = check_problem(args->problem, kEntry, err, err_len)) {
    return rc;
  }
  const Geometry g(args->problem);
  const bool no_q = g.batch == 0 || g.seqlen_q == 0;
  const bool no_k = g.batch == 0 || g.seqlen_k == 0;
  const bool no_seg = args->problem.has_segments == 0;
  const Operand operands[] = {
      {"q", args->q, no_q},         {"k", args->k, no_k},
      {"v", args->v, no_k},         {"dout", args->dout, no_q},
      {"lse", args->lse, no_q},     {"delta", args->delta, no_q},
      {"dq_accum", args->dq_accum, no_q}, {"dk", args->dk, no_k},
      {"dv", args->dv, no_k},
      {"q_segment_ids", args->q_segment_ids, no_seg || no_q},
      {"kv_segment_ids", args->kv_segment_ids, no_seg || no_k},
      {"q_bounds", args->q_bounds, no_seg || no_k}};
  if (const int rc = check_pointers(operands, kEntry, err, err_len)) return rc;
  const int chains = args->dq_chains;
  if (chains < 1 || chains > JF_MAX_DQ_CHAINS || (chains > 1 && args->problem.deterministic != 1)) {
    return fail(err, err_len, kEntry, "dq_chains must be 1, or up to %d with deterministic = 1; got %d",
                JF_MAX_DQ_CHAINS, chains);
  }
  if (args->dq_tile_rows != 0) {
    return fail(err, err_len, kEntry, "dq_accum must be in q's layout (dq_tile_rows 0), got dq_tile_rows %d",
                int(args->dq_tile_rows));
  }
  if (!no_q || !no_k) backward_cpu(*args, g);
  if (!no_q && chains > 1) {  // one pass fills the first; the sum needs zeros after it
    const size_t q_elems = size_t(g.batch) * g.seqlen_q * g.heads_q * g.head_dim;
    std::fill(args->dq_accum + q_elems, args->dq_accum + chains * q_elems, 0.0f);
  }
  if (err != nullptr && err_len > 0) err[0] = '\0';
  return 0;
}

}  // namespace
}  // namespace jax_flash_cpu

extern "C" int jax_flash_fwd_cpu(const JfFwdArgs* args, char* err,
                                 size_t err_len) {
  return jax_flash_cpu::run_forward(args, err, err_len);
}

extern "C" int jax_flash_bwd_cpu(const JfBwdArgs* args, char* err,
                                 size_t err_len) {
  return jax_flash_cpu::run_backward(args, err, err_len);
}
