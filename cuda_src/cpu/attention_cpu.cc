// FlashAttention forward and backward on the CPU, implementing the C ABI in
// jax_flash/kernel_api.h.
//
// Each worker walks tiles of queries against tiles of keys with the online
// softmax, so memory stays O(N): all tile buffers are fixed-size arrays on the
// worker's stack (about 260 KiB in the backward) and nothing is allocated on
// the heap except by std::thread itself. Inputs are widened to float on load;
// every accumulation is float32 in an order fixed by the tiling alone, so
// results are bitwise identical run to run and for any thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <thread>
#include <type_traits>

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
namespace {

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

  explicit Geometry(const JfProblem& p)
      : batch(p.batch), seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k),
        heads_q(p.heads_q), heads_kv(p.heads_kv), head_dim(p.head_dim),
        head_dim_v(p.head_dim_v), group(p.heads_q / p.heads_kv),
        diag_offset(p.diag_offset), window_left(p.window_left),
        window_right(p.window_right), scale(p.scale) {}

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

// ---- tile loads and small matrix products -----------------------------------

// dst[r * ld + d] = src row r, for r < rows; rows up to pad_rows are zeroed so
// that padding contributes exact zeros to every product.
template <class Codec>
void load_rows(const typename Codec::Storage* src, int64_t src_stride,
               int rows, int pad_rows, int width, int ld, float* dst) {
  for (int r = 0; r < rows; ++r) {
    const typename Codec::Storage* s = src + r * src_stride;
    float* d = dst + r * ld;
    for (int c = 0; c < width; ++c) d[c] = Codec::load(s[c]);
  }
  for (int r = rows; r < pad_rows; ++r) {
    std::fill(dst + r * ld, dst + r * ld + width, 0.0f);
  }
}

// Transposed load: dst[c * kCols + r] = src row r, column c.
template <class Codec, int kCols>
void load_rows_transposed(const typename Codec::Storage* src,
                          int64_t src_stride, int rows, int width,
                          float* dst) {
  for (int c = 0; c < width; ++c) {
    std::fill(dst + c * kCols + rows, dst + (c + 1) * kCols, 0.0f);
  }
  for (int r = 0; r < rows; ++r) {
    const typename Codec::Storage* s = src + r * src_stride;
    for (int c = 0; c < width; ++c) dst[c * kCols + r] = Codec::load(s[c]);
  }
}

// c[i][j] = sum_d a[i][d] * bt[d][j] for a kRows x kCols tile. Four d steps are
// fused per pass over a row of c to cut its loads and stores; the sum is still
// accumulated in increasing d, exactly as a plain loop would.
template <int kRows, int kCols>
void matmul_abt(const float* __restrict a, const float* __restrict bt,
                int depth, float* __restrict c) {
  for (int i = 0; i < kRows; ++i) {
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

inline float row_max(const float* __restrict x, int n) {
  float part[kLanes];
  std::fill(part, part + kLanes, kNegInf);
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      part[l] = select(x[j + l] > part[l], x[j + l], part[l]);
    }
  }
  for (int l = 0; j < n; ++j, ++l) part[l] = std::max(part[l], x[j]);
  float best = kNegInf;
  for (float v : part) best = std::max(best, v);
  return best;
}

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

// ---- forward ----------------------------------------------------------------

// kRows query rows x kCols keys per tile; head dims up to kMaxDim. The three
// instantiations keep every buffer at 32 KiB.
template <class Codec, int kRows, int kCols, int kMaxDim>
struct ForwardTile {
  using T = typename Codec::Storage;

  JF_CPU_HOT static void run(const JfFwdArgs& args, const Geometry& g,
                             int64_t b, int64_t h, int64_t i0) {
    const T* q = static_cast<const T*>(args.q);
    const T* k = static_cast<const T*>(args.k);
    const T* v = static_cast<const T*>(args.v);
    T* o = static_cast<T*>(args.o);
    const int dim = static_cast<int>(g.head_dim);
    const int dim_v = static_cast<int>(g.head_dim_v);
    const int64_t hk = h / g.group;
    const int64_t q_len = valid_len(args.q_lens, b, g.seqlen_q);
    const int64_t kv_len = valid_len(args.kv_lens, b, g.seqlen_k);
    const int rows =
        static_cast<int>(std::min<int64_t>(kRows, g.seqlen_q - i0));
    const int live =
        static_cast<int>(std::clamp<int64_t>(q_len - i0, 0, rows));

    alignas(64) float q_tile[kRows * kMaxDim];
    alignas(64) float kt_tile[kMaxDim * kCols];
    alignas(64) float v_tile[kCols * kMaxDim];
    alignas(64) float o_acc[kRows * kMaxDim];
    alignas(64) float scores[kRows * kCols];
    alignas(64) float partial[kMaxDim];
    float run_max[kRows], run_sum[kRows];

    // Key span of the whole tile: the union of its live rows' spans.
    int64_t k_lo = 0, k_hi = 0;
    if (live > 0) {
      k_lo = std::max<int64_t>(key_span(g, kv_len, i0).lo, 0);
      k_hi = key_span(g, kv_len, i0 + live - 1).hi;
    }
    if (k_hi > k_lo) {
      load_rows<Codec>(q + g.q_off(b, i0, h), g.heads_q * dim, live, kRows,
                       dim, dim, q_tile);
      std::fill(o_acc, o_acc + live * dim_v, 0.0f);
      std::fill(run_max, run_max + kRows, kNegInf);
      std::fill(run_sum, run_sum + kRows, 0.0f);
    }
    const float scale_log2 = g.scale * kLog2e;
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += kCols) {
      const int cols = static_cast<int>(std::min<int64_t>(kCols, k_hi - j0));
      load_rows_transposed<Codec, kCols>(k + g.k_off(b, j0, hk),
                                         g.heads_kv * dim, cols, dim, kt_tile);
      load_rows<Codec>(v + g.v_off(b, j0, hk), g.heads_kv * dim_v, cols, cols,
                       dim_v, dim_v, v_tile);
      matmul_abt<kRows, kCols>(q_tile, kt_tile, dim, scores);
      for (int r = 0; r < live; ++r) {
        const KeySpan span = key_span(g, kv_len, i0 + r);
        const int a = static_cast<int>(std::max<int64_t>(span.lo - j0, 0));
        const int e = static_cast<int>(std::min<int64_t>(span.hi - j0, cols));
        if (e <= a) continue;
        float* s = scores + r * kCols;
        for (int j = a; j < e; ++j) s[j] *= scale_log2;
        const float new_max = std::max(run_max[r], row_max(s + a, e - a));
        const float rescale = exp2_poly(run_max[r] - new_max);
        for (int j = a; j < e; ++j) s[j] = exp2_poly(s[j] - new_max);
        run_sum[r] = run_sum[r] * rescale + row_sum(s + a, e - a);
        run_max[r] = new_max;
        float* acc = o_acc + r * dim_v;
        if (rescale != 1.0f) {
          for (int d = 0; d < dim_v; ++d) acc[d] *= rescale;
        }
        add_tile_sum(s, 1, a, e, v_tile, dim_v, partial, acc);
      }
    }

    // Rows that saw a key have run_sum >= 1 (their maximum contributes 2^0).
    for (int r = 0; r < rows; ++r) {
      T* out = o + g.o_off(b, i0 + r, h);
      float* lse = args.lse + g.stat_off(b, h, i0 + r);
      if (k_hi > k_lo && r < live && run_sum[r] > 0.0f) {
        const float inv = 1.0f / run_sum[r];
        const float* acc = o_acc + r * dim_v;
        for (int d = 0; d < dim_v; ++d) out[d] = Codec::store(acc[d] * inv);
        *lse = (run_max[r] + std::log2(run_sum[r])) * kLn2;
      } else {
        for (int d = 0; d < dim_v; ++d) out[d] = Codec::store(0.0f);
        *lse = kNegInf;
      }
    }
  }
};

template <class Codec, int kRows, int kCols, int kMaxDim>
void forward(const JfFwdArgs& args, const Geometry& g) {
  const int64_t q_tiles = (g.seqlen_q + kRows - 1) / kRows;
  const int64_t tasks = g.batch * g.heads_q * q_tiles;
  const double macs = 1.0 * g.batch * g.heads_q * g.seqlen_q * g.seqlen_k *
                       (g.head_dim + g.head_dim_v);
  parallel_for(tasks, macs, [&](int64_t task) {
    const int64_t qt = task % q_tiles;
    const int64_t h = (task / q_tiles) % g.heads_q;
    const int64_t b = task / (q_tiles * g.heads_q);
    ForwardTile<Codec, kRows, kCols, kMaxDim>::run(args, g, b, h, qt * kRows);
  });
}

// ---- backward ---------------------------------------------------------------

// One task owns (batch b, key/value head hk): it writes dK and dV of that head
// and dQ of the query heads in its group, so no two tasks touch the same
// output. Key tiles are the outer loop; dK and dV accumulate on the stack.
template <class Codec, int kRows, int kCols, int kMaxDim>
struct BackwardGroup {
  using T = typename Codec::Storage;

  JF_CPU_HOT static void run(const JfBwdArgs& args, const Geometry& g,
                             int64_t b, int64_t hk) {
    const T* q = static_cast<const T*>(args.q);
    const T* k = static_cast<const T*>(args.k);
    const T* v = static_cast<const T*>(args.v);
    const T* dout = static_cast<const T*>(args.dout);
    T* dk = static_cast<T*>(args.dk);
    T* dv = static_cast<T*>(args.dv);
    const int dim = static_cast<int>(g.head_dim);
    const int dim_v = static_cast<int>(g.head_dim_v);
    const int64_t q_len = valid_len(args.q_lens, b, g.seqlen_q);
    const int64_t kv_len = valid_len(args.kv_lens, b, g.seqlen_k);
    const int64_t h_first = hk * g.group;
    const float scale_log2 = g.scale * kLog2e;

    alignas(64) float q_tile[kRows * kMaxDim];
    alignas(64) float do_tile[kRows * kMaxDim];
    alignas(64) float k_tile[kCols * kMaxDim];
    alignas(64) float kt_tile[kMaxDim * kCols];
    alignas(64) float vt_tile[kMaxDim * kCols];
    alignas(64) float dk_acc[kCols * kMaxDim];
    alignas(64) float dv_acc[kCols * kMaxDim];
    alignas(64) float probs[kRows * kCols];
    alignas(64) float dscores[kRows * kCols];
    alignas(64) float partial[kMaxDim];
    float lse_log2[kRows], delta[kRows];

    for (int64_t h = h_first; h < h_first + g.group; ++h) {
      for (int64_t t = 0; t < g.seqlen_q; ++t) {
        float* dq = args.dq_accum + g.q_off(b, t, h);
        std::fill(dq, dq + dim, 0.0f);
      }
    }

    for (int64_t j0 = 0; j0 < g.seqlen_k; j0 += kCols) {
      const int cols =
          static_cast<int>(std::min<int64_t>(kCols, g.seqlen_k - j0));
      const KeySpan rows_span = query_span(g, q_len, kv_len, j0, j0 + cols);
      std::fill(dk_acc, dk_acc + cols * dim, 0.0f);
      std::fill(dv_acc, dv_acc + cols * dim_v, 0.0f);
      if (rows_span.hi > rows_span.lo) {
        const T* k_src = k + g.k_off(b, j0, hk);
        load_rows<Codec>(k_src, g.heads_kv * dim, cols, kCols, dim, dim,
                         k_tile);
        load_rows_transposed<Codec, kCols>(k_src, g.heads_kv * dim, cols, dim,
                                           kt_tile);
        load_rows_transposed<Codec, kCols>(v + g.v_off(b, j0, hk),
                                           g.heads_kv * dim_v, cols, dim_v,
                                           vt_tile);
      }
      for (int64_t h = h_first; h < h_first + g.group; ++h) {
        for (int64_t i0 = rows_span.lo; i0 < rows_span.hi; i0 += kRows) {
          const int rows =
              static_cast<int>(std::min<int64_t>(kRows, rows_span.hi - i0));
          load_rows<Codec>(q + g.q_off(b, i0, h), g.heads_q * dim, rows, kRows,
                           dim, dim, q_tile);
          load_rows<Codec>(dout + g.o_off(b, i0, h), g.heads_q * dim_v, rows,
                           kRows, dim_v, dim_v, do_tile);
          for (int r = 0; r < rows; ++r) {
            lse_log2[r] = args.lse[g.stat_off(b, h, i0 + r)] * kLog2e;
            delta[r] = args.delta[g.stat_off(b, h, i0 + r)];
          }
          matmul_abt<kRows, kCols>(q_tile, kt_tile, dim, probs);
          matmul_abt<kRows, kCols>(do_tile, vt_tile, dim_v, dscores);
          // P from the saved lse; masked entries, padding and rows whose lse
          // says they saw nothing become exact zeros, and so do their dS.
          for (int r = 0; r < kRows; ++r) {
            float* p = probs + r * kCols;
            float* ds = dscores + r * kCols;
            int a = 0, e = 0;
            if (r < rows && lse_log2[r] > kNegInf) {
              const KeySpan span = key_span(g, kv_len, i0 + r);
              a = static_cast<int>(std::clamp<int64_t>(span.lo - j0, 0, cols));
              e = static_cast<int>(std::clamp<int64_t>(span.hi - j0, a, cols));
            }
            const float row_lse = r < rows ? lse_log2[r] : 0.0f;
            const float row_delta = r < rows ? delta[r] : 0.0f;
            for (int j = 0; j < kCols; ++j) {
              const bool seen = j >= a && j < e;
              const float pj =
                  select(seen, exp2_poly(p[j] * scale_log2 - row_lse), 0.0f);
              p[j] = pj;
              ds[j] = select(seen, pj * (ds[j] - row_delta), 0.0f);
            }
          }
          // dV += P^T dO and dK += dS^T Q (scaled once at the end).
          for (int j = 0; j < cols; ++j) {
            add_tile_sum(probs + j, kCols, 0, rows, do_tile, dim_v, partial,
                         dv_acc + j * dim_v);
            add_tile_sum(dscores + j, kCols, 0, rows, q_tile, dim, partial,
                         dk_acc + j * dim);
          }
          // dQ += scale * dS K, into the rows this task owns.
          for (int r = 0; r < rows; ++r) {
            std::fill(partial, partial + dim, 0.0f);
            accumulate_rows(dscores + r * kCols, 1, 0, cols, k_tile, dim,
                            partial);
            float* dq = args.dq_accum + g.q_off(b, i0 + r, h);
            for (int d = 0; d < dim; ++d) dq[d] += g.scale * partial[d];
          }
        }
      }
      for (int j = 0; j < cols; ++j) {
        T* dk_out = dk + g.k_off(b, j0 + j, hk);
        T* dv_out = dv + g.v_off(b, j0 + j, hk);
        const float* dk_src = dk_acc + j * dim;
        const float* dv_src = dv_acc + j * dim_v;
        for (int d = 0; d < dim; ++d) {
          dk_out[d] = Codec::store(g.scale * dk_src[d]);
        }
        for (int d = 0; d < dim_v; ++d) dv_out[d] = Codec::store(dv_src[d]);
      }
    }
  }
};

template <class Codec, int kRows, int kCols, int kMaxDim>
void backward(const JfBwdArgs& args, const Geometry& g) {
  const int64_t tasks = g.batch * g.heads_kv;
  const double macs = 2.0 * g.batch * g.heads_q * g.seqlen_q * g.seqlen_k *
                       (g.head_dim + g.head_dim_v);
  parallel_for(tasks, macs, [&](int64_t task) {
    BackwardGroup<Codec, kRows, kCols, kMaxDim>::run(args, g, task / g.heads_kv,
                                                     task % g.heads_kv);
  });
}

template <int kRowsT, int kColsT, int kMaxDimT>
struct TileShape {
  static constexpr int kRows = kRowsT, kCols = kColsT, kMaxDim = kMaxDimT;
};

struct ForwardLaunch {
  template <class Codec, class Shape>
  static void call(const JfFwdArgs& args, const Geometry& g) {
    forward<Codec, Shape::kRows, Shape::kCols, Shape::kMaxDim>(args, g);
  }
};

struct BackwardLaunch {
  template <class Codec, class Shape>
  static void call(const JfBwdArgs& args, const Geometry& g) {
    backward<Codec, Shape::kRows, Shape::kCols, Shape::kMaxDim>(args, g);
  }
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
  const Geometry g(args->problem);
  const bool no_q = g.batch == 0 || g.seqlen_q == 0;
  const bool no_k = g.batch == 0 || g.seqlen_k == 0;
  const Operand operands[] = {{"q", args->q, no_q},   {"k", args->k, no_k},
                              {"v", args->v, no_k},   {"o", args->o, no_q},
                              {"lse", args->lse, no_q}};
  if (const int rc = check_pointers(operands, kEntry, err, err_len)) return rc;
  if (!no_q) dispatch<ForwardLaunch>(*args, g);
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
  const Operand operands[] = {
      {"q", args->q, no_q},         {"k", args->k, no_k},
      {"v", args->v, no_k},         {"dout", args->dout, no_q},
      {"lse", args->lse, no_q},     {"delta", args->delta, no_q},
      {"dq_accum", args->dq_accum, no_q}, {"dk", args->dk, no_k},
      {"dv", args->dv, no_k}};
  if (const int rc = check_pointers(operands, kEntry, err, err_len)) return rc;
  if (!no_q || !no_k) dispatch<BackwardLaunch>(*args, g);
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
