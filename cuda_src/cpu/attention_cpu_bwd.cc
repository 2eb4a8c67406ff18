// FlashAttention backward on the CPU: one task per (batch, key/value head)
// walks its key tiles and, inside each, the query tiles that can see them.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "attention_cpu_tiles.h"

namespace jax_flash_cpu {
namespace {

// One task owns (batch b, key/value head hk): it writes dK and dV of that head
// and dQ of the query heads in its group, so no two tasks touch the same
// output. Key tiles are the outer loop; dK and dV accumulate on the stack.
// kSegments adds the packed-document mask (kernel_api.h): each key tile's
// query range shrinks to the union of its keys' q_bounds, and ids are
// compared on every pair visited.
//
// NaN semantics: the tiles hold q, k, v and dO with their NaNs and Infs
// zeroed, so that a pair the mask hides (P = dS = 0) adds exact zeros to dQ,
// dK and dV whatever its rows hold. What a row sees still reaches it: a NaN
// or Inf that the row's forward saw made its lse or out, hence delta, NaN,
// which turns its visible P or dS NaN; a NaN or Inf in its dO reaches the dV
// of its visible keys through dv_weight.
template <class Codec, int kRows, int kCols, int kMaxDim, bool kSegments>
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
    const Logits logits(g);

    alignas(64) float q_tile[kRows * kMaxDim];
    alignas(64) float do_tile[kRows * kMaxDim];
    alignas(64) float k_tile[kCols * kMaxDim];
    alignas(64) float kt_tile[kMaxDim * kCols];
    alignas(64) float vt_tile[kMaxDim * kCols];
    alignas(64) float dk_acc[kCols * kMaxDim];
    alignas(64) float dv_acc[kCols * kMaxDim];
    alignas(64) float scores[kRows * kCols];
    alignas(64) float dv_weight[kRows * kCols];  // P, NaN where the row's dO is not finite
    alignas(64) float dscores[kRows * kCols];
    alignas(64) float partial[kMaxDim];
    float lse_log2[kRows], delta[kRows];
    bool dout_finite[kRows];
    int32_t tile_ids[kCols] = {};  // segment ids of the current key tile

    for (int64_t h = h_first; h < h_first + g.group; ++h) {
      for (int64_t t = 0; t < g.seqlen_q; ++t) {
        float* dq = args.dq_accum + g.q_off(b, t, h);
        std::fill(dq, dq + dim, 0.0f);
      }
    }

    for (int64_t j0 = 0; j0 < g.seqlen_k; j0 += kCols) {
      const int cols =
          static_cast<int>(std::min<int64_t>(kCols, g.seqlen_k - j0));
      KeySpan rows_span = query_span(g, q_len, kv_len, j0, j0 + cols);
      if constexpr (kSegments) {
        const KeySpan docs = bounds_union(args.q_bounds, g.seqlen_k, b, j0,
                                          std::min(j0 + cols, kv_len));
        rows_span.lo = std::max(rows_span.lo, docs.lo);
        rows_span.hi = std::min(rows_span.hi, docs.hi);
        if (rows_span.hi > rows_span.lo) {
          std::copy(args.kv_segment_ids + b * g.seqlen_k + j0,
                    args.kv_segment_ids + b * g.seqlen_k + j0 + cols,
                    tile_ids);
        }
      }
      std::fill(dk_acc, dk_acc + cols * dim, 0.0f);
      std::fill(dv_acc, dv_acc + cols * dim_v, 0.0f);
      if (rows_span.hi > rows_span.lo) {
        const T* k_src = k + g.k_off(b, j0, hk);
        load_rows<Codec, FiniteOrZero>(k_src, g.heads_kv * dim, cols, kCols,
                                       dim, dim, k_tile);
        load_rows_transposed<Codec, kCols, FiniteOrZero>(
            k_src, g.heads_kv * dim, cols, dim, kt_tile);
        load_rows_transposed<Codec, kCols, FiniteOrZero>(
            v + g.v_off(b, j0, hk), g.heads_kv * dim_v, cols, dim_v, vt_tile);
      }
      for (int64_t h = h_first; h < h_first + g.group; ++h) {
        for (int64_t i0 = rows_span.lo; i0 < rows_span.hi; i0 += kRows) {
          const int rows =
              static_cast<int>(std::min<int64_t>(kRows, rows_span.hi - i0));
          load_rows<Codec, FiniteOrZero>(q + g.q_off(b, i0, h), g.heads_q * dim,
                                         rows, kRows, dim, dim, q_tile);
          for (int r = 0; r < rows; ++r) {
            const T* src = dout + g.o_off(b, i0 + r, h);
            bool finite = true;
            for (int d = 0; d < dim_v; ++d) finite &= is_finite(Codec::load(src[d]));
            dout_finite[r] = finite;
          }
          load_rows<Codec, FiniteOrZero>(dout + g.o_off(b, i0, h),
                                         g.heads_q * dim_v, rows, kRows, dim_v,
                                         dim_v, do_tile);
          for (int r = 0; r < rows; ++r) {
            lse_log2[r] = args.lse[g.stat_off(b, h, i0 + r)] * kLog2e;
            delta[r] = args.delta[g.stat_off(b, h, i0 + r)];
          }
          matmul_abt<kRows, kCols>(q_tile, kt_tile, dim, scores);
          matmul_abt<kRows, kCols>(do_tile, vt_tile, dim_v, dscores);
          // P from the saved lse; masked entries, padding and rows whose lse
          // says they saw nothing become exact zeros, and so do their dS. A
          // NaN lse (the row saw a NaN) makes its visible P NaN.
          for (int r = 0; r < kRows; ++r) {
            const float* qk = scores + r * kCols;
            float* ds = dscores + r * kCols;
            float* w = dv_weight + r * kCols;
            const float nan_if_dout_bad =
                r < rows && !dout_finite[r]
                    ? std::numeric_limits<float>::quiet_NaN()
                    : 1.0f;
            int a = 0, e = 0;
            if (r < rows && lse_log2[r] != kNegInf) {
              const KeySpan span = key_span(g, kv_len, i0 + r);
              a = static_cast<int>(std::clamp<int64_t>(span.lo - j0, 0, cols));
              e = static_cast<int>(std::clamp<int64_t>(span.hi - j0, a, cols));
            }
            const float row_lse = r < rows ? lse_log2[r] : 0.0f;
            const float row_delta = r < rows ? delta[r] : 0.0f;
            int32_t id = 0;
            if constexpr (kSegments) {
              if (r < rows) id = args.q_segment_ids[b * g.seqlen_q + i0 + r];
            }
            for (int j = 0; j < kCols; ++j) {
              bool seen = j >= a && j < e;
              if constexpr (kSegments) seen = seen && tile_ids[j] == id;
              float slope;
              const float logit = logits.log2_logit(qk[j], &slope);
              const float pj = select(seen, exp2_poly(logit - row_lse), 0.0f);
              w[j] = select(seen, pj * nan_if_dout_bad, 0.0f);
              ds[j] = select(seen, pj * (ds[j] - row_delta) * slope, 0.0f);
            }
          }
          // dV += P^T dO and dK += dS^T Q (scaled once at the end).
          for (int j = 0; j < cols; ++j) {
            add_tile_sum(dv_weight + j, kCols, 0, rows, do_tile, dim_v, partial,
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

template <class Codec, int kRows, int kCols, int kMaxDim, bool kSegments>
void backward(const JfBwdArgs& args, const Geometry& g) {
  const int64_t tasks = g.batch * g.heads_kv;
  const double macs = 2.0 * g.batch * g.heads_q * g.seqlen_q * g.seqlen_k *
                       (g.head_dim + g.head_dim_v);
  parallel_for(tasks, macs, [&](int64_t task) {
    BackwardGroup<Codec, kRows, kCols, kMaxDim, kSegments>::run(
        args, g, task / g.heads_kv, task % g.heads_kv);
  });
}

struct BackwardLaunch {
  template <class Codec, class Shape>
  static void call(const JfBwdArgs& args, const Geometry& g) {
    if (args.problem.has_segments) {
      backward<Codec, Shape::kRows, Shape::kCols, Shape::kMaxDim, true>(args,
                                                                         g);
    } else {
      backward<Codec, Shape::kRows, Shape::kCols, Shape::kMaxDim, false>(args,
                                                                          g);
    }
  }
};

}  // namespace

void backward_cpu(const JfBwdArgs& args, const Geometry& g) {
  dispatch<BackwardLaunch>(args, g);
}

}  // namespace jax_flash_cpu
