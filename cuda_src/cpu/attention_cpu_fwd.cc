// FlashAttention forward on the CPU: one task per (batch, query head, query
// tile) runs the online softmax over the key tiles its rows can see
// (ForwardRows, attention_cpu_rows.h).
#include <algorithm>
#include <cstdint>

#include "attention_cpu_rows.h"
#include "attention_cpu_simd.h"
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

  // The keys row r of the tile at i0 may see, for ForwardRows::attend.
  struct Keys {
    const Geometry& g;
    int64_t kv_len, i0, j0 = 0;
    const int32_t* q_ids = nullptr;      // of the batch row
    const int32_t* kv_ids = nullptr;
    const int32_t* kv_bounds = nullptr;

    KeySpan span(int r) const {
      KeySpan span = key_span(g, kv_len, i0 + r);
      if constexpr (kSegments) {
        span.lo = std::max<int64_t>(span.lo, kv_bounds[(i0 + r) * 2]);
        span.hi = std::min<int64_t>(span.hi, kv_bounds[(i0 + r) * 2 + 1]);
      }
      return span;
    }
    bool same_document(int r, int j) const { return kv_ids[j0 + j] == q_ids[i0 + r]; }
  };

  template <class IsaT>
  JF_ALWAYS_INLINE static void run(const JfFwdArgs& args, const Geometry& g, int64_t b,
                                   int64_t h, int64_t i0) {
    const T* q = static_cast<const T*>(args.q);
    const T* k = static_cast<const T*>(args.k);
    const T* v = static_cast<const T*>(args.v);
    T* o = static_cast<T*>(args.o);
    const int64_t hk = h / g.group;
    const int64_t q_len = valid_len(args.q_lens, b, g.seqlen_q);
    const int rows = static_cast<int>(std::min<int64_t>(kRows, g.seqlen_q - i0));
    const int live = static_cast<int>(std::clamp<int64_t>(q_len - i0, 0, rows));
    Keys keys{g, valid_len(args.kv_lens, b, g.seqlen_k), i0};
    ForwardRows<kRows, kCols, kMaxDim> t(g, live, IsaT::kBlockRows);

    // Key span of the whole tile: the union of its live rows' spans.
    int64_t k_lo = 0, k_hi = 0;
    if (live > 0) {
      k_lo = std::max<int64_t>(key_span(g, keys.kv_len, i0).lo, 0);
      k_hi = key_span(g, keys.kv_len, i0 + live - 1).hi;
    }
    if constexpr (kSegments) {
      keys.q_ids = args.q_segment_ids + b * g.seqlen_q;
      keys.kv_ids = args.kv_segment_ids + b * g.seqlen_k;
      keys.kv_bounds = args.kv_bounds + b * g.seqlen_q * 2;
      const KeySpan docs = bounds_union(args.kv_bounds, g.seqlen_q, b, i0, i0 + live);
      k_lo = std::max(k_lo, docs.lo);
      k_hi = std::min(k_hi, docs.hi);
    }
    if (k_hi > k_lo) {
      load_tile<Codec>(q + g.q_off(b, i0, h), g.heads_q * t.dim, live, t.live_rows, t.dim,
                       t.ld_q, t.q_tile);
      t.begin();
    }
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += kCols) {
      const int cols = static_cast<int>(std::min<int64_t>(kCols, k_hi - j0));
      load_tile_transposed<Codec>(k + g.k_off(b, j0, hk), g.heads_kv * t.dim, cols, t.dim,
                                  kCols, t.kt_tile);
      load_tile<Codec>(v + g.v_off(b, j0, hk), g.heads_kv * t.dim_v, cols, cols, t.dim_v,
                       t.ld_v, t.v_tile);
      keys.j0 = j0;
      t.template attend<IsaT, kSegments>(j0, cols, keys);
    }
    for (int r = 0; r < rows; ++r) {
      t.template store<Codec>(r, o + g.o_off(b, i0 + r, h),
                              args.lse + g.stat_off(b, h, i0 + r));
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
    // The last query tiles first: under a causal mask they see the most keys,
    // and the threads then finish together.
    const int64_t qt = q_tiles - 1 - task % q_tiles;
    const int64_t h = (task / q_tiles) % g.heads_q;
    const int64_t b = task / (q_tiles * g.heads_q);
    run_with_isa([&](auto isa) {
      ForwardTile<Codec, kRows, kCols, kMaxDim, kSegments>::template run<decltype(isa)>(
          args, g, b, h, qt * kRows);
    });
  });
}

struct ForwardLaunch {
  template <class Codec, class Shape>
  static void call(const JfFwdArgs& args, const Geometry& g) {
    if (args.problem.has_segments) {
      forward<Codec, Shape::kRows, Shape::kCols, Shape::kMaxDim, true>(args, g);
    } else {
      forward<Codec, Shape::kRows, Shape::kCols, Shape::kMaxDim, false>(args, g);
    }
  }
};

}  // namespace

void forward_cpu(const JfFwdArgs& args, const Geometry& g) {
  dispatch<ForwardLaunch>(args, g);
}

}  // namespace jax_flash_cpu
