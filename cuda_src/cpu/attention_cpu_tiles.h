// Shared pieces of the CPU attention kernels (attention_cpu_fwd.cc,
// attention_cpu_bwd.cc): problem geometry and mask spans, tile loads and the
// small matrix products, the thread pool, and the tile-shape dispatch.
#ifndef JAX_FLASH_CPU_ATTENTION_CPU_TILES_H_
#define JAX_FLASH_CPU_ATTENTION_CPU_TILES_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>

#include "attention_cpu.h"
#include "jax_flash/kernel_api.h"

// The per-tile workers are compiled twice, for AVX2+FMA (x86-64-v3) and for the
// baseline ISA, and glibc picks one at load time (an ifunc): about 1.8x faster
// on current CPUs while wheels still target generic x86-64. `flatten` inlines
// every helper so they are built for the clone's ISA too. Define
// JAX_FLASH_CPU_CLONES=0 to build the baseline only.
#ifndef JAX_FLASH_CPU_CLONES
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    defined(__GLIBC__)
#define JAX_FLASH_CPU_CLONES 1
#else
#define JAX_FLASH_CPU_CLONES 0
#endif
#endif
#if JAX_FLASH_CPU_CLONES
#define JF_CPU_HOT \
  __attribute__((target_clones("arch=x86-64-v3", "default"), flatten))
#else
#define JF_CPU_HOT
#endif

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

// Turns a raw q.k product into the logit in log2 units, and gives the
// derivative of the (natural) logit with respect to scale * q.k: 1 without a
// cap, 1 - tanh^2 with one.
struct Logits {
  bool capped;
  float in;       // multiplies q.k inside tanh (scale / softcap), or scale_log2
  float out_log2; // softcap * log2(e)

  explicit Logits(const Geometry& g)
      : capped(g.softcap > 0.0f),
        in(capped ? g.scale / g.softcap : g.scale * kLog2e),
        out_log2(g.softcap * kLog2e) {}

  float log2_logit(float qk) const {
    return capped ? out_log2 * std::tanh(qk * in) : qk * in;
  }
  // The forward's logit: NaN where the product is not finite (a NaN or Inf
  // in q or k, or an overflow), so that it reaches exactly the rows that see
  // it, as in reference.py; a cap would turn an Inf into a finite logit.
  float log2_logit_or_nan(float qk) const {
    const float x = qk * in;
    return finite_or_nan(x, capped ? out_log2 * std::tanh(x) : x);
  }
  // The same without a cap, free of the call to tanh so that loops over it
  // vectorise.
  float uncapped_log2_logit_or_nan(float qk) const {
    const float x = qk * in;
    return finite_or_nan(x, x);
  }
  static float finite_or_nan(float x, float logit) {
    return select(is_finite(x), logit, std::numeric_limits<float>::quiet_NaN());
  }
  // The log2 logit, and into *slope the derivative factor described above.
  float log2_logit(float qk, float* slope) const {
    if (!capped) {
      *slope = 1.0f;
      return qk * in;
    }
    const float t = std::tanh(qk * in);
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

// ---- tile loads and small matrix products -----------------------------------

// A loaded value, or 0 where it is not finite (the backward's tiles: see
// attention_cpu_bwd.cc).
struct AsLoaded {
  static float apply(float x) { return x; }
};
struct FiniteOrZero {
  static float apply(float x) { return select(is_finite(x), x, 0.0f); }
};

// dst[r * ld + d] = src row r, for r < rows; rows up to pad_rows are zeroed so
// that padding contributes exact zeros to every product.
template <class Codec, class Filter = AsLoaded>
void load_rows(const typename Codec::Storage* src, int64_t src_stride,
               int rows, int pad_rows, int width, int ld, float* dst) {
  for (int r = 0; r < rows; ++r) {
    const typename Codec::Storage* s = src + r * src_stride;
    float* d = dst + r * ld;
    for (int c = 0; c < width; ++c) d[c] = Filter::apply(Codec::load(s[c]));
  }
  for (int r = rows; r < pad_rows; ++r) {
    std::fill(dst + r * ld, dst + r * ld + width, 0.0f);
  }
}

// Transposed load: dst[c * kCols + r] = src row r, column c.
template <class Codec, int kCols, class Filter = AsLoaded>
void load_rows_transposed(const typename Codec::Storage* src,
                          int64_t src_stride, int rows, int width,
                          float* dst) {
  for (int c = 0; c < width; ++c) {
    std::fill(dst + c * kCols + rows, dst + (c + 1) * kCols, 0.0f);
  }
  for (int r = 0; r < rows; ++r) {
    const typename Codec::Storage* s = src + r * src_stride;
    for (int c = 0; c < width; ++c) {
      dst[c * kCols + r] = Filter::apply(Codec::load(s[c]));
    }
  }
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

// c[i][j] = sum_d a[i][d] * bt[d][j] for the first `rows` rows of a kRows x
// kCols tile. Four d steps are fused per pass over a row of c to cut its loads
// and stores; the sum is still accumulated in increasing d, exactly as a plain
// loop would, so a row's products do not depend on the other rows.
template <int kRows, int kCols>
void matmul_abt(const float* __restrict a, const float* __restrict bt,
                int depth, float* __restrict c, int rows = kRows) {
  for (int i = 0; i < rows; ++i) {
    const float* ai = a + i * depth;
    float* ci = c + i * kCols;
    for (int j = 0; j < kCols; ++j) ci[j] = 0.0f;
    int d = 0;
    for (; d + 4 <= depth; d += 4) {
      const float a0 = ai[d], a1 = ai[d + 1], a2 = ai[d + 2], a3 = ai[d + 3];
      const float* b0 = bt + d * kCols;
      const float* b1 = b0 + kCols;
      const float* b2 = b1 + kCols;
      const float* b3 = b2 + kCols;
      for (int j = 0; j < kCols; ++j) {
        ci[j] = ci[j] + a0 * b0[j] + a1 * b1[j] + a2 * b2[j] + a3 * b3[j];
      }
    }
    for (; d < depth; ++d) {
      const float a0 = ai[d];
      const float* b0 = bt + d * kCols;
      for (int j = 0; j < kCols; ++j) ci[j] += a0 * b0[j];
    }
  }
}

// out[d] += sum_{k in [k0, k1)} w[k * w_stride] * m[k][d], summed in
// increasing k (four rows per pass over out).
inline void accumulate_rows(const float* __restrict w, int w_stride, int k0,
                            int k1, const float* __restrict m, int width,
                            float* __restrict out) {
  int k = k0;
  for (; k + 4 <= k1; k += 4) {
    const float w0 = w[k * w_stride], w1 = w[(k + 1) * w_stride];
    const float w2 = w[(k + 2) * w_stride], w3 = w[(k + 3) * w_stride];
    const float* m0 = m + k * width;
    const float* m1 = m0 + width;
    const float* m2 = m1 + width;
    const float* m3 = m2 + width;
    for (int d = 0; d < width; ++d) {
      out[d] = out[d] + w0 * m0[d] + w1 * m1[d] + w2 * m2[d] + w3 * m3[d];
    }
  }
  for (; k < k1; ++k) {
    const float w0 = w[k * w_stride];
    const float* m0 = m + k * width;
    for (int d = 0; d < width; ++d) out[d] += w0 * m0[d];
  }
}

// out += sum_{k in [k0, k1)} w[k * w_stride] * m[k][d], with the tile's sum
// formed in `partial` first: a dK row collects thousands of query rows, and
// summing per tile keeps its rounding error near that of a pairwise sum.
inline void add_tile_sum(const float* __restrict w, int w_stride, int k0,
                         int k1, const float* __restrict m, int width,
                         float* __restrict partial, float* __restrict out) {
  std::fill(partial, partial + width, 0.0f);
  accumulate_rows(w, w_stride, k0, k1, m, width, partial);
  for (int d = 0; d < width; ++d) out[d] += partial[d];
}

// Reductions over a row in kLanes interleaved partial results combined in a
// fixed order: they vectorise without reassociation flags and stay
// deterministic.
constexpr int kLanes = 8;

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

// ---- one query row of the forward's online softmax -------------------------

// A query row's running state: the maximum log2 logit seen, the sum of the
// weights relative to it, and the weighted sum of value rows in `acc`.
struct RowSoftmax {
  float max = kNegInf;
  float sum = 0.0f;
  float* acc;  // head_dim_v floats, zeroed by the caller

  // Takes the keys [a, e) of a tile into the row: `s` holds their raw q.k
  // products (overwritten), `v_tile` their value rows (width dim_v). A NaN
  // logit (Logits::log2_logit_or_nan) stays NaN through the max, sum and
  // output: the row saw a NaN or Inf. Only keys [a, e) are read, so nothing
  // the row does not see reaches it.
  void add_keys(const Logits& logits, float* __restrict s, int a, int e,
                const float* __restrict v_tile, int dim_v,
                float* __restrict partial) {
    if (logits.capped) {
      for (int j = a; j < e; ++j) s[j] = logits.log2_logit_or_nan(s[j]);
    } else {
      for (int j = a; j < e; ++j) s[j] = logits.uncapped_log2_logit_or_nan(s[j]);
    }
    take_weights(s, a, e, row_max(s + a, e - a), dim_v);
    add_tile_sum(s, 1, a, e, v_tile, dim_v, partial, acc);
  }

  // Turns the log2 logits s[a, e) (their maximum tile_max) into weights
  // relative to the row's new maximum, and rescales the sum and acc to it;
  // the caller then adds the weighted value rows to acc.
  void take_weights(float* __restrict s, int a, int e, float tile_max,
                    int dim_v) {
    const float new_max = max_or_nan(tile_max, max);
    const float rescale = exp2_poly(max - new_max);
    for (int j = a; j < e; ++j) s[j] = exp2_poly(s[j] - new_max);
    sum = sum * rescale + row_sum(s + a, e - a);
    max = new_max;
    if (rescale != 1.0f) {
      for (int d = 0; d < dim_v; ++d) acc[d] *= rescale;
    }
  }

  // Writes the row's output and natural-log lse; zeros and -inf for a row
  // that saw no key (a row that saw one has sum >= 1, its maximum's 2^0, or
  // NaN).
  template <class Codec>
  void store(int dim_v, typename Codec::Storage* out, float* lse) const {
    if (sum != 0.0f) {
      const float inv = 1.0f / sum;
      for (int d = 0; d < dim_v; ++d) out[d] = Codec::store(acc[d] * inv);
      *lse = (max + std::log2(sum)) * kLn2;
    } else {
      store_empty<Codec>(dim_v, out, lse);
    }
  }

  template <class Codec>
  static void store_empty(int dim_v, typename Codec::Storage* out, float* lse) {
    for (int d = 0; d < dim_v; ++d) out[d] = Codec::store(0.0f);
    *lse = kNegInf;
  }
};

// ---- work distribution ------------------------------------------------------

// Runs fn(task) for task in [0, num_tasks) on up to hardware_concurrency()
// threads, the caller among them. Tasks write disjoint outputs, so which
// thread runs a task never changes a result.
template <class Fn>
void parallel_for(int64_t num_tasks, double total_macs, const Fn& fn) {
  const double hw = std::max(1u, std::thread::hardware_concurrency());
  const double by_work = 1.0 + total_macs / kMinMacsPerThread;
  const int nthreads = static_cast<int>(std::min(
      {hw, by_work, static_cast<double>(num_tasks), double{kMaxThreads}}));
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
