// The forward's online softmax, shared by the contiguous forward
// (attention_cpu_fwd.cc) and the paged one (paged_cpu.cc): the state of one
// query row (RowSoftmax), and the step of a tile of query rows over one key
// tile (ForwardRows).
#ifndef JAX_FLASH_CPU_ATTENTION_CPU_ROWS_H_
#define JAX_FLASH_CPU_ATTENTION_CPU_ROWS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention_cpu_simd.h"
#include "attention_cpu_tiles.h"

namespace jax_flash_cpu {

// ---- one query row of the online softmax -------------------------------------

// A query row's running state: the maximum log2 logit seen and the sum of the
// weights relative to it. The caller keeps the weighted sum of value rows.
struct RowSoftmax {
  float max = kNegInf;
  float sum = 0.0f;

  // Turns the row's log2 logits s[a, e) of a key tile (-inf for keys of other
  // documents) into weights relative to the row's new maximum, and s[0, a)
  // and s[e, width) into zeros; returns the factor by which the caller scales
  // the row's accumulated output before adding the weighted value rows. A
  // NaN logit stays NaN through the maximum, the sum and the output: the row
  // saw a NaN or Inf. A tile without a key of the row changes nothing.
  float take_weights(float* __restrict s, int a, int e, int width) {
    const float tile_max = row_max(s + a, e - a);
    if (tile_max == kNegInf) return skip(s, width);
    const float new_max = max_or_nan(tile_max, max);
    const float rescale = exp2_poly(max - new_max);
    for (int j = a; j < e; ++j) s[j] = exp2_poly(s[j] - new_max);
    std::fill(s, s + a, 0.0f);
    std::fill(s + e, s + width, 0.0f);
    return update(s, width, new_max, rescale);
  }

  // The same where s[a, e) is finite or -inf and the state is not NaN
  // (width a multiple of kLanes): fewer steps, the same bits.
  float take_finite_weights(float* __restrict s, int a, int e, int width) {
    std::fill(s, s + a, kNegInf);
    std::fill(s + e, s + width, kNegInf);
    const float tile_max = row_max_not_nan(s, width);
    if (tile_max == kNegInf) return skip(s, width);
    const float new_max = std::max(tile_max, max);
    const float rescale = exp2_poly_not_nan(max - new_max);
    for (int j = 0; j < width; ++j) s[j] = exp2_poly_not_nan(s[j] - new_max);
    return update(s, width, new_max, rescale);
  }

  // Writes the row's output (acc / sum) and natural-log lse; zeros and -inf
  // for a row that saw no key (a row that saw one has sum >= 1, its
  // maximum's 2^0, or NaN).
  template <class Codec>
  void store(const float* acc, int dim_v, typename Codec::Storage* out, float* lse) const {
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

 private:
  static float skip(float* s, int width) {
    std::fill(s, s + width, 0.0f);
    return 1.0f;
  }
  float update(const float* s, int width, float new_max, float rescale) {
    sum = sum * rescale + row_sum(s, width);
    max = new_max;
    return rescale;
  }
};

// ---- a tile of query rows against one key tile ---------------------------------

// The buffers and steps of a forward task: up to kRows query rows against key
// tiles of up to kCols keys, head dims up to kMaxDim. The caller loads
// q_tile once and kt_tile / v_tile per key tile (row strides ld_q, ld_v,
// kCols; zeros in every padding column and row), then calls attend(). Per key
// tile: S = Q K^T for the whole tile (tile_product), each row's online-softmax
// step on the keys it sees (the scores become weights, zero elsewhere), then
// O += P V for the whole tile. A tile whose scores are all finite takes the
// short path (take_finite_weights), with the bits of the general one.
template <int kRows, int kCols, int kMaxDim>
struct ForwardRows {
  alignas(64) float q_tile[kRows * kMaxDim];
  alignas(64) float kt_tile[kMaxDim * kCols];
  alignas(64) float v_tile[kCols * kMaxDim];
  alignas(64) float o_acc[kRows * kMaxDim];
  alignas(64) float scores[kRows * kCols];
  // A V tile holding a NaN or Inf: the tile with those entries zeroed, and
  // which rows were finite (add_non_finite_values).
  alignas(64) float v_finite_tile[kCols * kMaxDim];
  bool v_row_finite[kCols];
  alignas(64) float partial[kMaxDim];
  RowSoftmax state[kRows];
  const Logits logits;
  const int dim, dim_v, ld_q, ld_v;
  int live = 0;       // query rows
  int live_rows = 0;  // rows the products cover: live rounded up to the block rows
  uint32_t q_largest = 0;

  ForwardRows(const Geometry& g, int live_count, int block_rows)
      : logits(g), dim(static_cast<int>(g.head_dim)), dim_v(static_cast<int>(g.head_dim_v)),
        ld_q(round_up(dim, kPadFloats)), ld_v(round_up(dim_v, kPadFloats)), live(live_count),
        live_rows(round_up(live_count, block_rows)) {}

  // After q_tile is loaded (rows [0, live_rows), padding zero).
  void begin() {
    q_largest = 0;
    for (int i = 0; i < live_rows * ld_q; ++i) q_largest = std::max(q_largest, magnitude(q_tile[i]));
    std::fill(o_acc, o_acc + live_rows * ld_v, 0.0f);
  }

  // Keys [j0, j0 + cols) from the loaded kt_tile and v_tile. keys.span(r)
  // gives the keys row r may see ([lo, hi), absolute); keys.same_document(r,
  // j) whether key j0 + j is in row r's document (kSegments only).
  template <class IsaT, bool kSegments, class Keys>
  JF_ALWAYS_INLINE void attend(int64_t j0, int cols, const Keys& keys) {
    const int width = round_up(cols, kPadFloats);
    uint32_t k_largest = 0;
    for (int d = 0; d < dim; ++d) {
      for (int j = 0; j < width; ++j) k_largest = std::max(k_largest, magnitude(kt_tile[d * kCols + j]));
    }
    const bool finite_scores =
        !logits.capped && products_are_finite(q_largest, k_largest, dim, logits.in);
    // Scaled logits x = q.k * logits.in for every row and key of the tile.
    tile_product<IsaT>(q_tile, ld_q, 1, kt_tile, kCols, dim, scores, kCols, live_rows, width,
                       logits.in, Store::kSet);
    for (int r = 0; r < live_rows; ++r) {
      float* s = scores + r * kCols;
      const KeySpan span = r < live ? keys.span(r) : KeySpan{0, 0};
      const int a = static_cast<int>(std::clamp<int64_t>(span.lo - j0, 0, cols));
      const int e = static_cast<int>(std::clamp<int64_t>(span.hi - j0, a, cols));
      if (e <= a) {  // nothing of this row here, or a padding row
        std::fill(s, s + width, 0.0f);
        continue;
      }
      // Keys of other documents become -inf, i.e. exact zeros after exp2.
      float rescale;
      if (finite_scores && state[r].max == state[r].max) {
        if constexpr (kSegments) {
          for (int j = a; j < e; ++j) s[j] = select(keys.same_document(r, j), s[j], kNegInf);
        }
        rescale = state[r].take_finite_weights(s, a, e, width);
      } else {
        for (int j = a; j < e; ++j) {
          const float logit = logits.log2_logit_or_nan(s[j]);
          s[j] = kSegments ? select(keys.same_document(r, j), logit, kNegInf) : logit;
        }
        rescale = state[r].take_weights(s, a, e, width);
      }
      if (rescale != 1.0f) {
        float* acc = o_acc + r * ld_v;
        for (int d = 0; d < dim_v; ++d) acc[d] *= rescale;
      }
    }
    if (all_finite(v_tile, cols, dim_v, ld_v)) {
      tile_product<IsaT>(scores, kCols, 1, v_tile, ld_v, cols, o_acc, ld_v, live_rows, ld_v,
                         1.0f, Store::kAdd);
    } else {
      add_non_finite_values<IsaT, kSegments>(j0, cols, keys);
    }
  }

  // Writes row r's output and lse (rows past `live` saw nothing).
  template <class Codec>
  void store(int r, typename Codec::Storage* out, float* lse) const {
    if (r < live) {
      state[r].template store<Codec>(o_acc + r * ld_v, dim_v, out, lse);
    } else {
      RowSoftmax::store_empty<Codec>(dim_v, out, lse);
    }
  }

 private:
  // O += P V for a V tile that holds a NaN or Inf, which a zero weight would
  // turn into NaN: rows that see only finite values take the tile with the
  // others zeroed (the same sums as without them); a row that sees one adds
  // its own keys, run by run.
  template <class IsaT, bool kSegments, class Keys>
  JF_ALWAYS_INLINE void add_non_finite_values(int64_t j0, int cols, const Keys& keys) {
    for (int j = 0; j < cols; ++j) {
      v_row_finite[j] = all_finite(v_tile + j * ld_v, 1, dim_v, ld_v);
      for (int d = 0; d < ld_v; ++d) {
        v_finite_tile[j * ld_v + d] = FiniteOrZero::apply(v_tile[j * ld_v + d]);
      }
    }
    for (int r = 0; r < live; ++r) {
      const KeySpan span = keys.span(r);
      const int a = static_cast<int>(std::clamp<int64_t>(span.lo - j0, 0, cols));
      const int e = static_cast<int>(std::clamp<int64_t>(span.hi - j0, a, cols));
      const auto seen = [&](int j) { return !kSegments || keys.same_document(r, j); };
      bool sees_non_finite = false;
      for (int j = a; j < e; ++j) sees_non_finite |= seen(j) && !v_row_finite[j];
      if (!sees_non_finite) continue;
      float* s = scores + r * kCols;
      for (int j = a; j < e;) {
        int end = j;
        while (end < e && seen(end) == seen(j)) ++end;
        if (seen(j)) add_tile_sum(s, 1, j, end, v_tile, ld_v, partial, o_acc + r * ld_v);
        j = end;
      }
      std::fill(s, s + kCols, 0.0f);  // taken: the product below adds zeros
    }
    tile_product<IsaT>(scores, kCols, 1, v_finite_tile, ld_v, cols, o_acc, ld_v, live_rows,
                       ld_v, 1.0f, Store::kAdd);
  }
};

}  // namespace jax_flash_cpu

#endif  // JAX_FLASH_CPU_ATTENTION_CPU_ROWS_H_
