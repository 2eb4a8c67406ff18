// Attention against a paged KV cache on the CPU (kernel_api.h:
// JfPagedFwdArgs, with each sequence's keys in one split).
//
// One task per (sequence, kv head, block of query rows). A block's rows are
// the GQA group's query heads of consecutive new tokens, token-major, so each
// key tile is read from its pages and widened once for the whole group: a
// decode step's rows are its group's heads, a prefill chunk's run over its
// tokens. The tile code (online softmax, products, loads) is the contiguous
// forward's: ForwardRows, attention_cpu_rows.h.
//
// Batch invariant by construction: key tiles sit at multiples of their width
// from each sequence's first key, every row keeps its own softmax state and
// takes from a tile only the keys it sees (RowSoftmax: zero weights
// elsewhere, which add exact zeros), and a row's products do not depend on the
// other rows of its block (tile_product). A token's result is then the same
// bits in any batch, slot or page placement, and as a decode step or as a row
// of a prefill chunk.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "attention_cpu_rows.h"
#include "attention_cpu_simd.h"
#include "attention_cpu_tiles.h"
#include "jax_flash/kernel_api.h"

namespace jax_flash_cpu {
namespace {

// One sequence of the batch: its row of the page table and its lengths,
// clipped to the table and to the query rows (so that a bad length inside
// jit reads nothing outside them), with the geometry of its diagonal.
struct PagedSequence {
  const int32_t* pages;
  int64_t kv_len, q_len;
  Geometry g;  // diag_offset: this sequence's bottom right

  PagedSequence(const JfPagedFwdArgs& args, const Geometry& shared, int64_t b)
      : pages(args.page_table + b * args.max_pages),
        kv_len(valid_len(args.kv_lens, b, int64_t{args.max_pages} * args.page_size)),
        q_len(valid_len(args.q_lens, b, shared.seqlen_q)),
        g(shared) {
    g.diag_offset = kv_len - q_len + shared.diag_offset;
  }

  // Calls fn(offset from j0, count, pool row of the first key) for each run
  // of keys [j0, j1) that lies in one page, in order; the pool row is
  // page * page_size + row, or -1 for a page id outside the pool, whose keys
  // read as zeros.
  template <class Fn>
  void for_each_page_run(const JfPagedFwdArgs& args, int64_t j0, int64_t j1, const Fn& fn) const {
    const int64_t page_size = args.page_size;
    for (int64_t j = j0; j < j1;) {
      const int64_t page = pages[j / page_size];
      const int64_t row = j % page_size;
      const int64_t count = std::min(page_size - row, j1 - j);
      const bool in_pool = page >= 0 && page < args.num_pages;
      fn(static_cast<int>(j - j0), static_cast<int>(count),
         in_pool ? page * page_size + row : int64_t{-1});
      j += count;
    }
  }
};

template <class Codec, int kRows, int kCols, int kMaxDim>
struct PagedTile {
  using T = typename Codec::Storage;

  // The keys of row r, for ForwardRows::attend.
  struct Keys {
    const PagedSequence& seq;
    int64_t r0, group;
    KeySpan span(int r) const { return key_span(seq.g, seq.kv_len, (r0 + r) / group); }
    bool same_document(int, int) const { return true; }
  };

  // Query rows [r0, r0 + kRows) of sequence b's kv head hk, where row r is
  // query head hk * group + r % group of new token r / group.
  template <class IsaT>
  JF_ALWAYS_INLINE static void run(const JfPagedFwdArgs& args, const Geometry& shared,
                                   int64_t b, int64_t hk, int64_t r0) {
    const PagedSequence seq(args, shared, b);
    const Geometry& g = seq.g;
    const T* q = static_cast<const T*>(args.q);
    const T* k_pages = static_cast<const T*>(args.k_pages);
    const T* v_pages = static_cast<const T*>(args.v_pages);
    T* o = static_cast<T*>(args.o);
    const int rows = static_cast<int>(std::min<int64_t>(kRows, g.seqlen_q * g.group - r0));
    const int live = static_cast<int>(std::clamp<int64_t>(seq.q_len * g.group - r0, 0, rows));
    const auto token = [&](int r) { return (r0 + r) / g.group; };
    const auto head = [&](int r) { return hk * g.group + (r0 + r) % g.group; };
    const Keys keys{seq, r0, g.group};
    ForwardRows<kRows, kCols, kMaxDim> t(g, live, IsaT::kBlockRows);
    const int dim = t.dim, dim_v = t.dim_v;

    // The keys any live row sees, from the tile boundary at or below them.
    int64_t k_lo = 0, k_hi = 0;
    if (live > 0) {
      k_lo = std::max<int64_t>(keys.span(0).lo, 0) / kCols * kCols;
      k_hi = keys.span(live - 1).hi;
    }
    if (k_hi > k_lo) {
      for (int r = 0; r < live; ++r) {
        load_tile<Codec>(q + g.q_off(b, token(r), head(r)), 0, 1, 1, dim, t.ld_q,
                         t.q_tile + r * t.ld_q);
      }
      std::fill(t.q_tile + live * t.ld_q, t.q_tile + t.live_rows * t.ld_q, 0.0f);
      t.begin();
    }
    const int64_t key_stride = g.heads_kv * dim, value_stride = g.heads_kv * dim_v;
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += kCols) {
      const int cols = static_cast<int>(std::min<int64_t>(kCols, k_hi - j0));
      seq.for_each_page_run(args, j0, j0 + cols, [&](int c0, int count, int64_t first_row) {
        if (first_row < 0) {
          for (int d = 0; d < dim; ++d) std::fill_n(t.kt_tile + d * kCols + c0, count, 0.0f);
          std::fill_n(t.v_tile + c0 * t.ld_v, count * t.ld_v, 0.0f);
          return;
        }
        const T* k_rows = k_pages + (first_row * g.heads_kv + hk) * dim;
        for (int c = 0; c < count; ++c) {
          const T* src = k_rows + c * key_stride;
          for (int d = 0; d < dim; ++d) t.kt_tile[d * kCols + c0 + c] = Codec::load(src[d]);
        }
        load_tile<Codec>(v_pages + (first_row * g.heads_kv + hk) * dim_v, value_stride, count,
                         count, dim_v, t.ld_v, t.v_tile + c0 * t.ld_v);
      });
      // Columns past the keys: their products are never read, but come from
      // initialised memory.
      for (int d = 0; d < dim && cols < kCols; ++d) {
        std::fill(t.kt_tile + d * kCols + cols, t.kt_tile + (d + 1) * kCols, 0.0f);
      }
      t.template attend<IsaT, false>(j0, cols, keys);
    }

    for (int r = 0; r < rows; ++r) {
      t.template store<Codec>(r, o + g.o_off(b, token(r), head(r)),
                              args.lse + g.stat_off(b, head(r), token(r)));
    }
  }
};

struct PagedLaunch {
  template <class Codec, class Shape>
  static void call(const JfPagedFwdArgs& args, const Geometry& g) {
    const int64_t blocks = (g.seqlen_q * g.group + Shape::kRows - 1) / Shape::kRows;
    const int64_t tasks = g.batch * g.heads_kv * blocks;
    const double macs = 1.0 * g.batch * g.heads_q * g.seqlen_q * g.seqlen_k *
                        (g.head_dim + g.head_dim_v);
    parallel_for(tasks, macs, [&](int64_t task) {
      const int64_t block = task % blocks;
      const int64_t hk = (task / blocks) % g.heads_kv;
      const int64_t b = task / (blocks * g.heads_kv);
      run_with_isa([&](auto isa) {
        PagedTile<Codec, Shape::kRows, Shape::kCols, Shape::kMaxDim>::template run<
            decltype(isa)>(args, g, b, hk, block * Shape::kRows);
      });
    });
  }
};

// ---- argument checks --------------------------------------------------------

constexpr const char* kEntry = "jax_flash_paged_fwd_cpu";

// Writes "<entry>: <message>" into err and returns 1.
template <class... Rest>
int fail(char* err, size_t err_len, const char* format, Rest... rest) {
  if (err != nullptr && err_len > 0) {
    const int n = std::snprintf(err, err_len, "%s: ", kEntry);
    if (n >= 0 && static_cast<size_t>(n) < err_len) {
      std::snprintf(err + n, err_len - n, format, rest...);
    }
  }
  return 1;
}

int check(const JfPagedFwdArgs& args, char* err, size_t err_len) {
  const JfProblem& p = args.problem;
  std::underlying_type_t<JfDtype> dtype;  // an enum outside its range is undefined
  std::memcpy(&dtype, &p.dtype, sizeof dtype);
  if (dtype != JF_FLOAT16 && dtype != JF_BFLOAT16 && dtype != JF_FLOAT32) {
    return fail(err, err_len, "unknown dtype %lld", static_cast<long long>(dtype));
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.heads_q <= 0 || p.heads_kv <= 0 ||
      p.heads_q % p.heads_kv != 0) {
    return fail(err, err_len,
                "batch and seqlen_q must be >= 0 and heads_q a positive multiple of heads_kv, "
                "got %d, %d, %d, %d", p.batch, p.seqlen_q, p.heads_q, p.heads_kv);
  }
  if (p.head_dim <= 0 || p.head_dim > kMaxHeadDim || p.head_dim_v <= 0 ||
      p.head_dim_v > kMaxHeadDim) {
    return fail(err, err_len, "head_dim and head_dim_v must be in [1, %d], got %d, %d",
                kMaxHeadDim, p.head_dim, p.head_dim_v);
  }
  if (!std::isfinite(p.scale) || !std::isfinite(p.softcap) || p.softcap < 0.0f) {
    return fail(err, err_len, "scale must be finite and softcap finite and >= 0, got %g, %g",
                static_cast<double>(p.scale), static_cast<double>(p.softcap));
  }
  if (p.has_segments != 0) return fail(err, err_len, "packed documents are not supported");
  if (args.num_pages < 0 || args.page_size <= 0 || args.max_pages <= 0 ||
      int64_t{p.seqlen_k} != int64_t{args.max_pages} * args.page_size) {
    return fail(err, err_len,
                "num_pages must be >= 0, page_size and max_pages > 0 and seqlen_k their "
                "product, got %d, %d, %d, %d", args.num_pages, args.page_size, args.max_pages,
                p.seqlen_k);
  }
  if (args.split_pages != args.max_pages) {
    return fail(err, err_len, "the CPU kernel runs each sequence as one split: split_pages "
                "must be max_pages %d, got %d", args.max_pages, args.split_pages);
  }
  const bool no_rows = p.batch == 0 || p.seqlen_q == 0;
  const bool no_pages = args.num_pages == 0;
  const struct {
    const char* name;
    const void* ptr;
    bool empty;
  } operands[] = {{"q", args.q, no_rows},
                  {"k_pages", args.k_pages, no_pages},
                  {"v_pages", args.v_pages, no_pages},
                  {"page_table", args.page_table, p.batch == 0},
                  {"q_lens", args.q_lens, p.batch == 0},
                  {"kv_lens", args.kv_lens, p.batch == 0},
                  {"o", args.o, no_rows},
                  {"lse", args.lse, no_rows}};
  for (const auto& op : operands) {
    if (op.ptr == nullptr && !op.empty) return fail(err, err_len, "%s is null", op.name);
  }
  return 0;
}

int run_paged_forward(const JfPagedFwdArgs* args, char* err, size_t err_len) {
  if (args == nullptr) return fail(err, err_len, "args is null");
  if (const int rc = check(*args, err, err_len)) return rc;
  const Geometry g(args->problem);
  if (g.batch > 0 && g.seqlen_q > 0) dispatch<PagedLaunch>(*args, g);
  if (err != nullptr && err_len > 0) err[0] = '\0';
  return 0;
}

}  // namespace
}  // namespace jax_flash_cpu

extern "C" int jax_flash_paged_fwd_cpu(const JfPagedFwdArgs* args, char* err, size_t err_len) {
  return jax_flash_cpu::run_paged_forward(args, err, err_len);
}
