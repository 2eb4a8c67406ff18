// Shared pieces of the CPU attention kernels (attention_cpu_fwd.cc,
// attention_cpu_bwd.cc, paged_cpu.cc): problem geometry and mask spans, tile
// loads, the online softmax of one query row, the thread pool, and the
// tile-shape dispatch. The matrix products are attention_cpu_simd.h's.
#ifndef JAX_FLASH_CPU_ATTENTION_CPU_TILES_H_
#define JAX_FLASH_CPU_ATTENTION_CPU_TILES_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

#include "attention_cpu.h"
#include "attention_cpu_simd.h"
#include "jax_flash/kernel_api.h"

namespace jax_flash_cpu {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kMaxHeadDim = 512;
// Below this many multiply-adds per thread, spawning a thread costs more than
// it saves.
constexpr double kMinMacsPerThread = 4e6;
constexpr int kMaxThreads = 256;

// ---- problem geometry and mask ----------------------------------------------

struct Geometry {
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v;
  int64_t group;  // query heads per key/value head
  int64_t diag_offset, window_left, window_right;
  float scale;
  float softcap;  // > 0: logits are softcap * tanh(scale * q.k / softcap)

  explicit Geometry(const JfProblem& p)
      : batch(p.batch), seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k),
        heads_q(p.heads_q), heads_kv(p.heads_kv), head_dim(p.head_dim),
        head_dim_v(p.head_dim_v), group(p.heads_q / p.heads_kv),
        diag_offset(p.diag_offset), window_left(p.window_left),
        window_right(p.window_right), scale(p.scale), softcap(p.softcap) {}

  // Element offsets of row (b, t, h) in each layout.
  int64_t q_off(int64_t b, int64_t t, int64_t h) const {
    return ((b * seqlen_q + t) * heads_q + h) * head_dim;
  }
  int64_t o_off(int64_t b, int64_t t, int64_t h) const {
    return ((b * seqlen_q + t) * heads_q + h) * head_dim_v;
  }
  int64_t k_off(int64_t b, int64_t s, int64_t h) const {
    return ((b * seqlen_k + s) * heads_kv + h) * head_dim;
  }
  int64_t v_off(int64_t b, int64_t s, int64_t h) const {
    return ((b * seqlen_k + s) * heads_kv + h) * head_dim_v;
  }
  int64_t stat_off(int64_t b, int64_t h, int64_t t) const {
    return (b * heads_q + h) * seqlen_q + t;
  }
};

// Logits from the scaled products x = q.k * in (the tile products apply
// `in`): in log2 units, and the derivative of the (natural) logit with respect
// to scale * q.k: 1 without a cap, 1 - tanh^2 with one.
struct Logits {
  bool capped;
  float in;        // multiplies q.k: scale * log2(e), or scale / softcap under a cap
  float out_log2;  // softcap * log2(e)

  explicit Logits(const Geometry& g)
      : capped(g.softcap > 0.0f),
        in(capped ? g.scale / g.softcap : g.scale * kLog2e),
        out_log2(g.softcap * kLog2e) {}

  // The forward's logit: NaN where x is not finite (a NaN or Inf in q or k,
  // or an overflow), so that it reaches exactly the rows that see it, as in
  // reference.py; a cap would turn an Inf into a finite logit.
  float log2_logit_or_nan(float x) const {
    const float logit = capped ? out_log2 * std::tanh(x) : x;
    return select(is_finite(x), logit, std::numeric_limits<float>::quiet_NaN());
  }
  // The log2 logit, and into *slope the derivative factor described above.
  float log2_logit(float x, float* slope) const {
    if (!capped) {
      *slope = 1.0f;
      return x;
    }
    const float t = std::tanh(x);
    *slope = 1.0f - t * t;
    return out_log2 * t;
  }
};

// Valid prefix lengths of batch b; a null pointer means the whole sequence,
// and values outside [0, seqlen] are clamped, which the mask formula implies.
inline int64_t valid_len(const int32_t* lens, int64_t b, int64_t seqlen) {
  if (lens == nullptr) return seqlen;
  return std::min<int64_t>(std::max<int64_t>(lens[b], 0), seqlen);
}

// Keys [lo, hi) that query row i may attend, before the q_len check. Both
// bounds are non-decreasing in i, which the tile range computations rely on.
struct KeySpan {
  int64_t lo, hi;
};

inline KeySpan key_span(const Geometry& g, int64_t kv_len, int64_t i) {
  KeySpan span{0, kv_len};
  if (g.window_left >= 0) {
    span.lo = std::max(span.lo, i + g.diag_offset - g.window_left);
  }
  if (g.window_right >= 0) {
    span.hi = std::min(span.hi, i + g.diag_offset + g.window_right + 1);
  }
  return span;
}

// Query rows [lo, hi) that see at least one key in [j0, j1).
inline KeySpan query_span(const Geometry& g, int64_t q_len, int64_t kv_len,
                          int64_t j0, int64_t j1) {
  j1 = std::min(j1, kv_len);
  KeySpan span{0, j1 > j0 ? q_len : 0};
  if (g.window_right >= 0) {
    span.lo = std::max(span.lo, j0 - g.diag_offset - g.window_right);
  }
  if (g.window_left >= 0) {
    span.hi = std::min(span.hi, j1 - g.diag_offset + g.window_left);
  }
  return span;
}

// ---- packed documents -------------------------------------------------------

// Union of the non-empty [first, last) bounds of positions [p0, p1) of batch b
// (kernel_api.h's kv_bounds or q_bounds, `seqlen` rows per batch): every
// partner of those positions lies inside it. Empty when none has a partner.
inline KeySpan bounds_union(const int32_t* bounds, int64_t seqlen, int64_t b,
                            int64_t p0, int64_t p1) {
  KeySpan span{std::numeric_limits<int64_t>::max(), 0};
  for (int64_t p = p0; p < p1; ++p) {
    const int32_t* row = bounds + (b * seqlen + p) * 2;
    if (row[1] > row[0]) {
      span.lo = std::min<int64_t>(span.lo, row[0]);
      span.hi = std::max<int64_t>(span.hi, row[1]);
    }
  }
  return span.hi > 0 ? span : KeySpan{0, 0};
}

// ---- tile loads --------------------------------------------------------------

// A loaded value, or 0 where it is not finite (the backward's tiles: see
// attention_cpu_bwd.cc).
struct AsLoaded {
  static float apply(float x) { return x; }
};
struct FiniteOrZero {
  static float apply(float x) { return select(is_finite(x), x, 0.0f); }
};

// The bits of |x|: ordered as the magnitudes for finite x, and at least
// 0x7f800000 for an Inf or NaN. The loads return the largest of a tile's.
inline uint32_t magnitude(float x) { return float_bits(x) & 0x7fffffffu; }
inline bool is_finite_magnitude(uint32_t m) { return m < 0x7f800000u; }

// dst[r * ld + c] = src row r, column c, for r < rows and c < width; the
// columns up to ld and the rows up to pad_rows are zeroed, so that padding
// adds exact zeros to every product. Returns the largest magnitude() loaded.
template <class Codec, class Filter = AsLoaded>
uint32_t load_tile(const typename Codec::Storage* src, int64_t src_stride, int rows,
                   int pad_rows, int width, int ld, float* dst) {
  uint32_t largest = 0;
  for (int r = 0; r < rows; ++r) {
    const typename Codec::Storage* s = src + r * src_stride;
    float* d = dst + r * ld;
    for (int c = 0; c < width; ++c) {
      d[c] = Filter::apply(Codec::load(s[c]));
      largest = std::max(largest, magnitude(d[c]));
    }
    std::fill(d + width, d + ld, 0.0f);
  }
  std::fill(dst + rows * ld, dst + pad_rows * ld, 0.0f);
  return largest;
}

// Transposed: dst[c * ld + r] = src row r, column c, for r < rows and c <
// width, and zeros for r in [rows, ld). Returns the largest magnitude().
template <class Codec, class Filter = AsLoaded>
uint32_t load_tile_transposed(const typename Codec::Storage* src, int64_t src_stride,
                              int rows, int width, int ld, float* dst) {
  uint32_t largest = 0;
  for (int c = 0; c < width; ++c) std::fill(dst + c * ld + rows, dst + (c + 1) * ld, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const typename Codec::Storage* s = src + r * src_stride;
    for (int c = 0; c < width; ++c) {
      const float x = Filter::apply(Codec::load(s[c]));
      dst[c * ld + r] = x;
      largest = std::max(largest, magnitude(x));
    }
  }
  return largest;
}

// Whether rows [0, rows) of a width-wide tile (row stride ld) are all finite.
inline bool all_finite(const float* tile, int rows, int width, int ld) {
  uint32_t non_finite = 0;
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < width; ++c) {
      non_finite |= static_cast<uint32_t>(!is_finite(tile[r * ld + c]));
    }
  }
  return non_finite == 0;
}

// Whether every scaled product q.k * in of rows of magnitude at most
// q_largest and k_largest (magnitude() bits) is finite, and so is each partial
// sum on the way: |sum| <= dim * max|q| * max|k|. Then the forward's scores
// need no check for NaN or Inf.
inline bool products_are_finite(uint32_t q_largest, uint32_t k_largest, int dim, float in) {
  if (!is_finite_magnitude(q_largest) || !is_finite_magnitude(k_largest)) return false;
  const double bound = static_cast<double>(dim) * bits_float(q_largest) *
                       bits_float(k_largest) * std::max(1.0, std::fabs(double{in}));
  return bound < 1e37;  // float's largest is 3.4e38; margin for rounding
}

// out[d] += sum_{k in [k0, k1)} w[k * w_stride] * m[k][d], the tile's sum
// formed in `partial` first and summed in increasing k: the forward's rare
// path for rows that see a NaN or Inf value.
inline void add_tile_sum(const float* __restrict w, int w_stride, int k0, int k1,
                         const float* __restrict m, int width, float* __restrict partial,
                         float* __restrict out) {
  std::fill(partial, partial + width, 0.0f);
  for (int k = k0; k < k1; ++k) {
    const float wk = w[k * w_stride];
    const float* mk = m + k * width;
    for (int d = 0; d < width; ++d) partial[d] += wk * mk[d];
  }
  for (int d = 0; d < width; ++d) out[d] += partial[d];
}

// ---- row reductions -------------------------------------------------------------

// Reductions over a row in kLanes interleaved partial results combined in a
// fixed order: they vectorise without reassociation flags and stay
// deterministic. Rows are padded to a multiple of kPadFloats.
constexpr int kLanes = 16;

inline float row_sum(const float* __restrict x, int n) {
  float part[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += x[j + l];
  }
  for (int l = 0; j < n; ++j, ++l) part[l] += x[j];
  float total = 0.0f;
  for (float v : part) total += v;
  return total;
}

// The larger of a and b, NaN if either is. Both comparisons always run (|,
// not ||): a branch would stop loops over it from vectorising.
inline float max_or_nan(float a, float b) {
  return select((a > b) | (a != a), a, b);
}

// NaN if any x is.
inline float row_max(const float* __restrict x, int n) {
  float part[kLanes];
  std::fill(part, part + kLanes, kNegInf);
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] = max_or_nan(x[j + l], part[l]);
  }
  for (int l = 0; j < n; ++j, ++l) part[l] = max_or_nan(x[j], part[l]);
  float best = kNegInf;
  for (float v : part) best = max_or_nan(v, best);
  return best;
}

// The same for x without NaN, n a multiple of kLanes.
inline float row_max_not_nan(const float* __restrict x, int n) {
  float part[kLanes];
  std::fill(part, part + kLanes, kNegInf);
  for (int j = 0; j < n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] = select(x[j + l] > part[l], x[j + l], part[l]);
  }
  float best = kNegInf;
  for (float v : part) best = select(v > best, v, best);
  return best;
}

// ---- work distribution ------------------------------------------------------

// The CPUs this process may run on (its affinity mask: taskset, cgroups'
// cpusets), else the machine's.
inline int usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// How many threads parallel_for runs num_tasks tasks of total_macs work on.
inline int thread_count(int64_t num_tasks, double total_macs) {
  static const int cpus = usable_cpus();
  const double by_work = 1.0 + total_macs / kMinMacsPerThread;
  return static_cast<int>(std::min({static_cast<double>(cpus), by_work,
                                    static_cast<double>(num_tasks), double{kMaxThreads}}));
}

// Runs fn(task) for task in [0, num_tasks) on thread_count() threads, the
// caller among them, tasks taken in order. Tasks write disjoint outputs, so
// which thread runs a task never changes a result.
template <class Fn>
void parallel_for(int64_t num_tasks, double total_macs, const Fn& fn) {
  const int nthreads = thread_count(num_tasks, total_macs);
  std::atomic<int64_t> next{0};
  auto worker = [&]() noexcept {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) <
                    num_tasks;) {
      fn(t);
    }
  };
  std::thread pool[kMaxThreads];
  int started = 0;
  for (; started + 1 < nthreads; ++started) {
    try {
      pool[started] = std::thread(worker);
    } catch (...) {
      break;  // fewer threads: the remaining tasks run on those we have
    }
  }
  worker();
  for (int i = 0; i < started; ++i) pool[i].join();
}

// ---- tile-shape dispatch ----------------------------------------------------

template <int kRowsT, int kColsT, int kMaxDimT>
struct TileShape {
  static constexpr int kRows = kRowsT, kCols = kColsT, kMaxDim = kMaxDimT;
};

// Picks the tile shape from the wider head dim (so every buffer stays 32 KiB),
// then the element type.
template <class Launch, class Shape, class Args>
void dispatch_dtype(const Args& args, const Geometry& g) {
  switch (args.problem.dtype) {
    case JF_FLOAT16:
      Launch::template call<F16, Shape>(args, g);
      break;
    case JF_BFLOAT16:
      Launch::template call<BF16, Shape>(args, g);
      break;
    case JF_FLOAT32:
      Launch::template call<F32, Shape>(args, g);
      break;
  }
}

template <class Launch, class Args>
void dispatch(const Args& args, const Geometry& g) {
  const int64_t widest = std::max(g.head_dim, g.head_dim_v);
  if (widest <= 128) {
    dispatch_dtype<Launch, TileShape<64, 64, 128>>(args, g);
  } else if (widest <= 256) {
    dispatch_dtype<Launch, TileShape<32, 32, 256>>(args, g);
  } else {
    dispatch_dtype<Launch, TileShape<16, 16, kMaxHeadDim>>(args, g);
  }
}

// The two directions (attention_cpu_fwd.cc, attention_cpu_bwd.cc), for
// arguments that attention_cpu.cc has checked.
void forward_cpu(const JfFwdArgs& args, const Geometry& g);
void backward_cpu(const JfBwdArgs& args, const Geometry& g);

}  // namespace jax_flash_cpu

#endif  // JAX_FLASH_CPU_ATTENTION_CPU_TILES_H_
