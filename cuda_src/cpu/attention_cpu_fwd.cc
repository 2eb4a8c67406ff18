// FlashAttention forward on the CPU: one task per (batch, query head, query
// tile) runs the online softmax over the key tiles its rows can see.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention_cpu_tiles.h"

namespace jax_flash_cpu {
namespace {

// kRows query rows x kCols keys per tile; head dims up to kMaxDim. The three
// instantiations keep every buffer at 32 KiB. kSegments adds the packed-
// document mask (kernel_api.h): the key range shrinks to the union of the
// rows' kv_bounds, and ids are compared on every key visited.
template <class Codec, int kRows, int kCols, int kMaxDim, bool kSegments>
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
    // Packed documents whose V tile holds a NaN or Inf: the tile with those
    // entries zeroed, and which rows were finite.
    [[maybe_unused]] alignas(64) float v_finite_tile[kSegments ? kCols * kMaxDim : 1];
    [[maybe_unused]] bool v_row_finite[kSegments ? kCols : 1];
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
    const int32_t* q_ids = nullptr;
    const int32_t* kv_ids = nullptr;
    const int32_t* kv_bounds = nullptr;
    if constexpr (kSegments) {
      q_ids = args.q_segment_ids + b * g.seqlen_q;
      kv_ids = args.kv_segment_ids + b * g.seqlen_k;
      kv_bounds = args.kv_bounds + b * g.seqlen_q * 2;
      const KeySpan docs =
          bounds_union(args.kv_bounds, g.seqlen_q, b, i0, i0 + live);
      k_lo = std::max(k_lo, docs.lo);
      k_hi = std::min(k_hi, docs.hi);
    }
    if (k_hi > k_lo) {
      load_rows<Codec>(q + g.q_off(b, i0, h), g.heads_q * dim, live, kRows,
                       dim, dim, q_tile);
      std::fill(o_acc, o_acc + live * dim_v, 0.0f);
      std::fill(run_max, run_max + kRows, kNegInf);
      std::fill(run_sum, run_sum + kRows, 0.0f);
    }
    const Logits logits(g);
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += kCols) {
      const int cols = static_cast<int>(std::min<int64_t>(kCols, k_hi - j0));
      load_rows_transposed<Codec, kCols>(k + g.k_off(b, j0, hk),
                                         g.heads_kv * dim, cols, dim, kt_tile);
      load_rows<Codec>(v + g.v_off(b, j0, hk), g.heads_kv * dim_v, cols, cols,
                       dim_v, dim_v, v_tile);
      [[maybe_unused]] bool v_finite = true;
      if constexpr (kSegments) {
        v_finite = all_finite(v_tile, cols, dim_v, dim_v);
        if (!v_finite) {
          for (int j = 0; j < cols; ++j) {
            v_row_finite[j] = all_finite(v_tile + j * dim_v, 1, dim_v, dim_v);
          }
          load_rows<Codec, FiniteOrZero>(v + g.v_off(b, j0, hk), g.heads_kv * dim_v,
                                         cols, cols, dim_v, dim_v, v_finite_tile);
        }
      }
      matmul_abt<kRows, kCols>(q_tile, kt_tile, dim, scores);
      for (int r = 0; r < live; ++r) {
        KeySpan span = key_span(g, kv_len, i0 + r);
        if constexpr (kSegments) {
          span.lo = std::max<int64_t>(span.lo, kv_bounds[(i0 + r) * 2]);
          span.hi = std::min<int64_t>(span.hi, kv_bounds[(i0 + r) * 2 + 1]);
        }
        const int a = static_cast<int>(std::max<int64_t>(span.lo - j0, 0));
        const int e = static_cast<int>(std::min<int64_t>(span.hi - j0, cols));
        if (e <= a) continue;
        float* s = scores + r * kCols;
        // A NaN logit (log2_logit_or_nan) stays NaN through the row's max,
        // sum and output: the row saw a NaN or Inf.
        float tile_max;
        if constexpr (kSegments) {
          // Keys of other documents become -inf, i.e. exact zeros after exp2.
          const int32_t id = q_ids[i0 + r];
          const int32_t* ids = kv_ids + j0;
          for (int j = a; j < e; ++j) {
            s[j] = select(ids[j] == id, logits.log2_logit_or_nan(s[j]), kNegInf);
          }
          tile_max = row_max(s + a, e - a);
          if (tile_max == kNegInf) continue;  // none of its document here
        } else {
          if (logits.capped) {
            for (int j = a; j < e; ++j) s[j] = logits.log2_logit_or_nan(s[j]);
          } else {
            for (int j = a; j < e; ++j) s[j] = logits.uncapped_log2_logit_or_nan(s[j]);
          }
          tile_max = row_max(s + a, e - a);
        }
        const float new_max = max_or_nan(tile_max, run_max[r]);
        const float rescale = exp2_poly(run_max[r] - new_max);
        for (int j = a; j < e; ++j) s[j] = exp2_poly(s[j] - new_max);
        run_sum[r] = run_sum[r] * rescale + row_sum(s + a, e - a);
        run_max[r] = new_max;
        float* acc = o_acc + r * dim_v;
        if (rescale != 1.0f) {
          for (int d = 0; d < dim_v; ++d) acc[d] *= rescale;
        }
        if constexpr (kSegments) {
          if (!v_finite) {
            // Another document's NaN or Inf value times its zero weight
            // would be NaN. A row whose own keys here are finite takes the
            // tile with those values zeroed (the same sums as without
            // them); one that sees a NaN or Inf adds its own keys' runs.
            const int32_t id = q_ids[i0 + r];
            const int32_t* ids = kv_ids + j0;
            bool sees_non_finite = false;
            for (int j = a; j < e; ++j) {
              sees_non_finite |= ids[j] == id && !v_row_finite[j];
            }
            if (!sees_non_finite) {
              add_tile_sum(s, 1, a, e, v_finite_tile, dim_v, partial, acc);
              continue;
            }
            for (int j = a; j < e;) {
              int end = j;
              while (end < e && (ids[end] == id) == (ids[j] == id)) ++end;
              if (ids[j] == id) add_tile_sum(s, 1, j, end, v_tile, dim_v, partial, acc);
              j = end;
            }
            continue;
          }
        }
        add_tile_sum(s, 1, a, e, v_tile, dim_v, partial, acc);
      }
    }

    // Rows that saw a key have run_sum >= 1 (their maximum contributes 2^0),
    // or NaN.
    for (int r = 0; r < rows; ++r) {
      T* out = o + g.o_off(b, i0 + r, h);
      float* lse = args.lse + g.stat_off(b, h, i0 + r);
      if (k_hi > k_lo && r < live && run_sum[r] != 0.0f) {
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

template <class Codec, int kRows, int kCols, int kMaxDim, bool kSegments>
void forward(const JfFwdArgs& args, const Geometry& g) {
  const int64_t q_tiles = (g.seqlen_q + kRows - 1) / kRows;
  const int64_t tasks = g.batch * g.heads_q * q_tiles;
  const double macs = 1.0 * g.batch * g.heads_q * g.seqlen_q * g.seqlen_k *
                       (g.head_dim + g.head_dim_v);
  parallel_for(tasks, macs, [&](int64_t task) {
    const int64_t qt = task % q_tiles;
    const int64_t h = (task / q_tiles) % g.heads_q;
    const int64_t b = task / (q_tiles * g.heads_q);
    ForwardTile<Codec, kRows, kCols, kMaxDim, kSegments>::run(args, g, b, h,
                                                              qt * kRows);
  });
}

struct ForwardLaunch {
  template <class Codec, class Shape>
  static void call(const JfFwdArgs& args, const Geometry& g) {
    if (args.problem.has_segments) {
      forward<Codec, Shape::kRows, Shape::kCols, Shape::kMaxDim, true>(args, g);
    } else {
      forward<Codec, Shape::kRows, Shape::kCols, Shape::kMaxDim, false>(args,
                                                                         g);
    }
  }
};

}  // namespace

void forward_cpu(const JfFwdArgs& args, const Geometry& g) {
  dispatch<ForwardLaunch>(args, g);
}

}  // namespace jax_flash_cpu
