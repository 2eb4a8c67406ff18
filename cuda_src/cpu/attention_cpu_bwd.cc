// FlashAttention backward on the CPU.
//
// The default schedule gives one task each (batch, key/value head): it walks
// its key tiles and, inside each, the query tiles that see them, writing dK
// and dV of that head and dQ of the query heads in its group, so no two tasks
// touch the same output. When there are too few of those tasks to keep the
// threads busy (one head of a long sequence on many cores), a split schedule
// runs instead: one task per key tile computes its dK and dV, then one task
// per query tile recomputes P and dS to sum its dQ. Both add the same
// products in the same order, so the results are the same bits.
//
// NaN semantics: the tiles hold q, k, v and dO with their NaNs and Infs
// zeroed, so that a pair the mask hides (P = dS = 0) adds exact zeros to dQ,
// dK and dV whatever its rows hold. What a row sees still reaches it: a NaN
// or Inf that the row's forward saw made its lse or out, hence delta, NaN,
// which turns its visible P or dS NaN; a NaN or Inf in its dO reaches the dV
// of its visible keys through the weights of dV.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "attention_cpu_simd.h"
#include "attention_cpu_tiles.h"

namespace jax_flash_cpu {
namespace {

// The tiles of one (key tile, query tile) pair and the steps shared by both
// schedules. kSegments adds the packed-document mask (kernel_api.h): ids are
// compared on every pair visited.
template <class Codec, int kRows, int kCols, int kMaxDim, bool kSegments>
struct BackwardTiles {
  using T = typename Codec::Storage;

  const JfBwdArgs& args;
  const Geometry& g;
  const Logits logits;
  const int64_t b, hk;
  const int dim, dim_v, ld_q, ld_v;
  const int64_t q_len, kv_len;

  // The key tile: K row-major, and K and V transposed.
  alignas(64) float k_tile[kCols * kMaxDim];
  alignas(64) float kt_tile[kMaxDim * kCols];
  alignas(64) float vt_tile[kMaxDim * kCols];
  int32_t key_ids[kCols] = {};
  int64_t j0 = 0;
  int cols = 0;
  // The query tile of head h: rows [i0, i0 + rows).
  alignas(64) float q_tile[kRows * kMaxDim];
  alignas(64) float do_tile[kRows * kMaxDim];
  float lse_log2[kRows], delta[kRows];
  bool dout_finite[kRows];
  int64_t h = 0, i0 = 0;
  int rows = 0;
  // The pair: scaled logits then P for dV (NaN where the row's dO is not
  // finite), and dO V^T then dS.
  alignas(64) float weights[kRows * kCols];
  alignas(64) float dscores[kRows * kCols];

  BackwardTiles(const JfBwdArgs& args, const Geometry& g, int64_t b, int64_t hk)
      : args(args), g(g), logits(g), b(b), hk(hk), dim(static_cast<int>(g.head_dim)),
        dim_v(static_cast<int>(g.head_dim_v)), ld_q(round_up(dim, kPadFloats)),
        ld_v(round_up(dim_v, kPadFloats)), q_len(valid_len(args.q_lens, b, g.seqlen_q)),
        kv_len(valid_len(args.kv_lens, b, g.seqlen_k)) {}

  int key_width() const { return round_up(cols, kPadFloats); }

  void load_keys(int64_t first_key) {
    j0 = first_key;
    cols = static_cast<int>(std::min<int64_t>(kCols, g.seqlen_k - j0));
    const T* k_src = static_cast<const T*>(args.k) + g.k_off(b, j0, hk);
    const T* v_src = static_cast<const T*>(args.v) + g.v_off(b, j0, hk);
    load_tile<Codec, FiniteOrZero>(k_src, g.heads_kv * dim, cols, kCols, dim, ld_q, k_tile);
    load_tile_transposed<Codec, FiniteOrZero>(k_src, g.heads_kv * dim, cols, dim, kCols,
                                              kt_tile);
    load_tile_transposed<Codec, FiniteOrZero>(v_src, g.heads_kv * dim_v, cols, dim_v, kCols,
                                              vt_tile);
    if constexpr (kSegments) {
      std::copy(args.kv_segment_ids + b * g.seqlen_k + j0,
                args.kv_segment_ids + b * g.seqlen_k + j0 + cols, key_ids);
    }
  }

  // Rows [first_row, first_row + count) of query head `head`, padded with
  // zero rows to a multiple of `pad`.
  void load_queries(int64_t head, int64_t first_row, int count, int pad) {
    h = head;
    i0 = first_row;
    rows = count;
    const int padded = round_up(rows, pad);
    const T* q = static_cast<const T*>(args.q);
    const T* dout = static_cast<const T*>(args.dout);
    load_tile<Codec, FiniteOrZero>(q + g.q_off(b, i0, h), g.heads_q * dim, rows, padded, dim,
                                   ld_q, q_tile);
    for (int r = 0; r < rows; ++r) {
      const T* src = dout + g.o_off(b, i0 + r, h);
      bool finite = true;
      for (int d = 0; d < dim_v; ++d) finite &= is_finite(Codec::load(src[d]));
      dout_finite[r] = finite;
    }
    load_tile<Codec, FiniteOrZero>(dout + g.o_off(b, i0, h), g.heads_q * dim_v, rows, padded,
                                   dim_v, ld_v, do_tile);
    for (int r = 0; r < rows; ++r) {
      lse_log2[r] = args.lse[g.stat_off(b, h, i0 + r)] * kLog2e;
      delta[r] = args.delta[g.stat_off(b, h, i0 + r)];
    }
  }

  // P (into weights) and dS (into dscores) of the loaded pair, for rows up
  // to a multiple of the ISA's block rows. Masked entries, padding and rows
  // whose lse says they saw nothing are exact zeros. A NaN lse (the row saw
  // a NaN) makes its visible P NaN.
  template <class IsaT>
  JF_ALWAYS_INLINE void scores_and_gradients() {
    const int padded = round_up(rows, IsaT::kBlockRows);
    const int width = key_width();
    tile_product<IsaT>(q_tile, ld_q, 1, kt_tile, kCols, dim, weights, kCols, padded, width,
                       logits.in, Store::kSet);
    tile_product<IsaT>(do_tile, ld_v, 1, vt_tile, kCols, dim_v, dscores, kCols, padded, width,
                       1.0f, Store::kSet);
    for (int r = 0; r < padded; ++r) {
      float* w = weights + r * kCols;
      float* ds = dscores + r * kCols;
      int a = 0, e = 0;
      if (r < rows && i0 + r < q_len && lse_log2[r] != kNegInf) {
        const KeySpan span = key_span(g, kv_len, i0 + r);
        a = static_cast<int>(std::clamp<int64_t>(span.lo - j0, 0, cols));
        e = static_cast<int>(std::clamp<int64_t>(span.hi - j0, a, cols));
      }
      if (e <= a) {
        std::fill(w, w + width, 0.0f);
        std::fill(ds, ds + width, 0.0f);
        continue;
      }
      const float row_lse = lse_log2[r], row_delta = delta[r];
      if (!logits.capped && !kSegments && dout_finite[r] && is_finite(row_lse) &&
          is_finite(row_delta)) {
        // The same bits as the general loop below, with nothing to select.
        for (int j = a; j < e; ++j) {
          const float p = exp2_poly_not_nan(w[j] - row_lse);
          w[j] = p;
          ds[j] = p * (ds[j] - row_delta);
        }
      } else {
        const float nan_if_dout_bad =
            dout_finite[r] ? 1.0f : std::numeric_limits<float>::quiet_NaN();
        int32_t id = 0;
        if constexpr (kSegments) id = args.q_segment_ids[b * g.seqlen_q + i0 + r];
        for (int j = a; j < e; ++j) {
          const bool seen = !kSegments || key_ids[j] == id;
          float slope;
          const float logit = logits.log2_logit(w[j], &slope);
          const float p = select(seen, exp2_poly(logit - row_lse), 0.0f);
          w[j] = select(seen, p * nan_if_dout_bad, 0.0f);
          ds[j] = select(seen, p * (ds[j] - row_delta) * slope, 0.0f);
        }
      }
      std::fill(w, w + a, 0.0f);
      std::fill(w + e, w + width, 0.0f);
      std::fill(ds, ds + a, 0.0f);
      std::fill(ds + e, ds + width, 0.0f);
    }
  }

  // dV += P^T dO and dK += dS^T Q (dK is scaled once at the end).
  template <class IsaT>
  JF_ALWAYS_INLINE void add_key_gradients(float* dk_acc, float* dv_acc) {
    const int key_rows = round_up(cols, IsaT::kBlockRows);
    tile_product<IsaT>(weights, 1, kCols, do_tile, ld_v, rows, dv_acc, ld_v, key_rows, ld_v,
                       1.0f, Store::kAdd);
    tile_product<IsaT>(dscores, 1, kCols, q_tile, ld_q, rows, dk_acc, ld_q, key_rows, ld_q,
                       1.0f, Store::kAdd);
  }

  // dq_tile (row stride ld_q) = dS K for the loaded pair.
  template <class IsaT>
  JF_ALWAYS_INLINE void query_gradient(float* dq_tile) {
    tile_product<IsaT>(dscores, kCols, 1, k_tile, ld_q, cols, dq_tile, ld_q,
                       round_up(rows, IsaT::kBlockRows), ld_q, 1.0f, Store::kSet);
  }

  // The query rows that visit key tile [first_key, first_key + kCols): those
  // that see one of its keys, in packed documents widened to the hull of its
  // keys' q_bounds. Both schedules add a pair's dQ exactly for these rows.
  KeySpan query_rows(int64_t first_key) const {
    const int64_t last_key = std::min<int64_t>(first_key + kCols, g.seqlen_k);
    KeySpan span = query_span(g, q_len, kv_len, first_key, last_key);
    if constexpr (kSegments) {
      const KeySpan docs = bounds_union(args.q_bounds, g.seqlen_k, b, first_key,
                                        std::min(last_key, kv_len));
      span.lo = std::max(span.lo, docs.lo);
      span.hi = std::min(span.hi, docs.hi);
    }
    return span;
  }

  // Writes dK (scaled) and dV of the loaded key tile.
  void store_key_gradients(const float* dk_acc, const float* dv_acc) const {
    T* dk = static_cast<T*>(args.dk);
    T* dv = static_cast<T*>(args.dv);
    for (int j = 0; j < cols; ++j) {
      T* dk_out = dk + g.k_off(b, j0 + j, hk);
      T* dv_out = dv + g.v_off(b, j0 + j, hk);
      for (int d = 0; d < dim; ++d) dk_out[d] = Codec::store(g.scale * dk_acc[j * ld_q + d]);
      for (int d = 0; d < dim_v; ++d) dv_out[d] = Codec::store(dv_acc[j * ld_v + d]);
    }
  }

  // dq_accum rows [lo, hi) of the loaded query tile += scale * dq_tile.
  void add_to_dq(const float* dq_tile, int lo, int hi) const {
    for (int r = lo; r < hi; ++r) {
      float* dq = args.dq_accum + g.q_off(b, i0 + r, h);
      for (int d = 0; d < dim; ++d) dq[d] += g.scale * dq_tile[r * ld_q + d];
    }
  }
};

template <class Codec, int kRows, int kCols, int kMaxDim, bool kSegments>
struct Backward {
  using Tiles = BackwardTiles<Codec, kRows, kCols, kMaxDim, kSegments>;

  // The default schedule: everything of (b, hk).
  template <class IsaT>
  JF_ALWAYS_INLINE static void whole_head(const JfBwdArgs& args, const Geometry& g, int64_t b,
                                          int64_t hk) {
    Tiles t(args, g, b, hk);
    alignas(64) float dk_acc[kCols * kMaxDim];
    alignas(64) float dv_acc[kCols * kMaxDim];
    alignas(64) float dq_tile[kRows * kMaxDim];
    const int64_t h_first = hk * g.group;
    for (int64_t h = h_first; h < h_first + g.group; ++h) {
      for (int64_t i = 0; i < g.seqlen_q; ++i) {
        float* dq = args.dq_accum + g.q_off(b, i, h);
        std::fill(dq, dq + t.dim, 0.0f);
      }
    }
    for (int64_t j0 = 0; j0 < g.seqlen_k; j0 += kCols) {
      t.load_keys(j0);
      std::fill(dk_acc, dk_acc + kCols * t.ld_q, 0.0f);
      std::fill(dv_acc, dv_acc + kCols * t.ld_v, 0.0f);
      const KeySpan span = t.query_rows(j0);
      for (int64_t h = h_first; h < h_first + g.group; ++h) {
        for (int64_t i0 = span.lo; i0 < span.hi; i0 += kRows) {
          t.load_queries(h, i0, static_cast<int>(std::min<int64_t>(kRows, span.hi - i0)),
                         IsaT::kBlockRows);
          t.template scores_and_gradients<IsaT>();
          t.template add_key_gradients<IsaT>(dk_acc, dv_acc);
          t.template query_gradient<IsaT>(dq_tile);
          t.add_to_dq(dq_tile, 0, t.rows);
        }
      }
      t.store_key_gradients(dk_acc, dv_acc);
    }
  }

  // The split schedule, first half: dK and dV of key tile j0 of (b, hk), the
  // query tiles as whole_head walks them.
  template <class IsaT>
  JF_ALWAYS_INLINE static void key_tile(const JfBwdArgs& args, const Geometry& g, int64_t b,
                                        int64_t hk, int64_t j0) {
    Tiles t(args, g, b, hk);
    alignas(64) float dk_acc[kCols * kMaxDim];
    alignas(64) float dv_acc[kCols * kMaxDim];
    t.load_keys(j0);
    std::fill(dk_acc, dk_acc + kCols * t.ld_q, 0.0f);
    std::fill(dv_acc, dv_acc + kCols * t.ld_v, 0.0f);
    const KeySpan span = t.query_rows(j0);
    for (int64_t h = hk * g.group; h < (hk + 1) * g.group; ++h) {
      for (int64_t i0 = span.lo; i0 < span.hi; i0 += kRows) {
        t.load_queries(h, i0, static_cast<int>(std::min<int64_t>(kRows, span.hi - i0)),
                       IsaT::kBlockRows);
        t.template scores_and_gradients<IsaT>();
        t.template add_key_gradients<IsaT>(dk_acc, dv_acc);
      }
    }
    t.store_key_gradients(dk_acc, dv_acc);
  }

  // The split schedule, second half: dQ of query rows [i0, i0 + kRows) of
  // head h, summed over the key tiles that whole_head visits them with, in
  // its order.
  template <class IsaT>
  JF_ALWAYS_INLINE static void query_tile(const JfBwdArgs& args, const Geometry& g, int64_t b,
                                          int64_t h, int64_t i0) {
    Tiles t(args, g, b, h / g.group);
    alignas(64) float dq_tile[kRows * kMaxDim];
    const int rows = static_cast<int>(std::min<int64_t>(kRows, g.seqlen_q - i0));
    for (int r = 0; r < rows; ++r) {
      float* dq = args.dq_accum + g.q_off(b, i0 + r, h);
      std::fill(dq, dq + t.dim, 0.0f);
    }
    const int live = static_cast<int>(std::clamp<int64_t>(t.q_len - i0, 0, rows));
    if (live == 0) return;
    const int64_t k_lo = std::max<int64_t>(key_span(g, t.kv_len, i0).lo, 0);
    const int64_t k_hi = key_span(g, t.kv_len, i0 + live - 1).hi;
    bool loaded = false;
    for (int64_t j0 = k_lo / kCols * kCols; j0 < k_hi; j0 += kCols) {
      const KeySpan span = t.query_rows(j0);
      const int lo = static_cast<int>(std::clamp<int64_t>(span.lo - i0, 0, live));
      const int hi = static_cast<int>(std::clamp<int64_t>(span.hi - i0, lo, live));
      if (hi <= lo) continue;
      if (!loaded) t.load_queries(h, i0, live, IsaT::kBlockRows);
      loaded = true;
      t.load_keys(j0);
      t.template scores_and_gradients<IsaT>();
      t.template query_gradient<IsaT>(dq_tile);
      t.add_to_dq(dq_tile, lo, hi);
    }
  }
};

// Whether the split schedule keeps the threads busier than the default one
// loses to its extra products: per pair the default computes 5 products (Q
// K^T, dO V^T, dV, dK, dQ), the split one 7 (Q K^T and dO V^T twice).
inline bool split_schedule(const Geometry& g, double macs) {
  const int64_t heads = g.batch * g.heads_kv;
  const int threads = thread_count(heads * g.seqlen_k, macs);
  const int64_t rounds = (heads + threads - 1) / threads;
  const double busy = static_cast<double>(heads) / (rounds * threads);
  return busy < 5.0 / 7.0;
}

template <class Codec, int kRows, int kCols, int kMaxDim, bool kSegments>
void backward(const JfBwdArgs& args, const Geometry& g) {
  using Kernel = Backward<Codec, kRows, kCols, kMaxDim, kSegments>;
  const double macs = 2.0 * g.batch * g.heads_q * g.seqlen_q * g.seqlen_k *
                      (g.head_dim + g.head_dim_v);
  if (!split_schedule(g, macs)) {
    parallel_for(g.batch * g.heads_kv, macs, [&](int64_t task) {
      run_with_isa([&](auto isa) {
        Kernel::template whole_head<decltype(isa)>(args, g, task / g.heads_kv,
                                                   task % g.heads_kv);
      });
    });
    return;
  }
  // Key tiles first, which under a causal mask see the most query rows;
  // query tiles last first, which see the most keys.
  const int64_t k_tiles = (g.seqlen_k + kCols - 1) / kCols;
  parallel_for(g.batch * g.heads_kv * k_tiles, macs, [&](int64_t task) {
    const int64_t kt = task % k_tiles, head = task / k_tiles;
    run_with_isa([&](auto isa) {
      Kernel::template key_tile<decltype(isa)>(args, g, head / g.heads_kv, head % g.heads_kv,
                                               kt * kCols);
    });
  });
  const int64_t q_tiles = (g.seqlen_q + kRows - 1) / kRows;
  parallel_for(g.batch * g.heads_q * q_tiles, macs / 2, [&](int64_t task) {
    const int64_t qt = q_tiles - 1 - task % q_tiles, head = task / q_tiles;
    run_with_isa([&](auto isa) {
      Kernel::template query_tile<decltype(isa)>(args, g, head / g.heads_q, head % g.heads_q,
                                                 qt * kRows);
    });
  });
}

struct BackwardLaunch {
  template <class Codec, class Shape>
  static void call(const JfBwdArgs& args, const Geometry& g) {
    if (args.problem.has_segments) {
      backward<Codec, Shape::kRows, Shape::kCols, Shape::kMaxDim, true>(args, g);
    } else {
      backward<Codec, Shape::kRows, Shape::kCols, Shape::kMaxDim, false>(args, g);
    }
  }
};

}  // namespace

void backward_cpu(const JfBwdArgs& args, const Geometry& g) {
  dispatch<BackwardLaunch>(args, g);
}

}  // namespace jax_flash_cpu
