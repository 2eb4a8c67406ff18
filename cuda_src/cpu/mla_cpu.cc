// MLA decoding (jax_flash.mla_decode) on the CPU, in both cache formats
// (kernel_api.h: JfMlaDecodeArgs, JfMlaFp8DecodeArgs; docs/mla.md).
//
// MLA is multi-query attention with 576-wide keys whose first 512 columns are
// also the values. One task per (sequence, block of query rows); row r of a
// sequence is token r / heads and head r % heads, so every key tile, one page
// of 64 keys, is read and widened once for all the heads of a block.
//
// The bfloat16 / float16 cache runs the contiguous forward's tile code
// (ForwardRows, attention_cpu_rows.h) with one kv head of head dim 576 and V
// the first 512 columns of each key. The FP8 cache computes what
// mla_fp8.fp8_reference defines: queries quantised per token and head, the
// logit as the latent codes' product times both scales plus the bfloat16 RoPE
// product, and P times the keys' scales requantised to e4m3 per row and page
// before it multiplies the latent codes (against the running maximum: a
// block's amax scale is scale invariant, so the codes are the final ones up to
// float32 rounding).
//
// Batch invariant as the paged kernel (paged_cpu.cc): tiles sit at whole pages
// from each sequence's first key, every row keeps its own softmax state and
// each product element is one chain over its row, so a sequence's result is
// the same bits in any batch, slot or page placement.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention_cpu_rows.h"
#include "attention_cpu_simd.h"
#include "attention_cpu_tiles.h"
#include "jax_flash/kernel_api.h"

namespace jax_flash_cpu {
namespace {

constexpr int kPage = 64;  // keys per page, and per key tile
constexpr int kLatent = 512;
constexpr int kRope = 64;
constexpr int kWidth = kLatent + kRope;
constexpr int kRowsPerTask = 64;
constexpr float kFp8Max = 448.0f;

// ---- float8_e4m3fn ---------------------------------------------------------------

// The value of an e4m3fn code (no infinities; S.1111.111 is NaN).
inline float e4m3_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xfu, mantissa = code & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) {  // subnormal: mantissa * 2^-9, exact
    return bits_float(float_bits(static_cast<float>(mantissa) * 0x1p-9f) | sign);
  }
  return bits_float(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

// x in [-448, 448] (or NaN) rounded to the nearest e4m3fn value, ties to even:
// the cast of mla_fp8.quantize_rows after its clip.
inline float round_to_e4m3(float x) {
  const uint32_t bits = float_bits(x);
  const uint32_t magnitude_bits = bits & 0x7fffffffu;
  if (magnitude_bits >= 0x7f800000u) return x;
  if (magnitude_bits < 0x3c800000u) {  // below 2^-6: subnormal steps of 2^-9
    return std::nearbyint(x * 512.0f) * (1.0f / 512.0f);
  }
  const uint32_t rounded =
      (magnitude_bits + 0x7ffffu + ((magnitude_bits >> 20) & 1u)) & ~0xfffffu;
  return bits_float((bits & 0x80000000u) | rounded);
}

// mla_fp8.quantize_rows on x[0, n): x becomes its codes' values; returns the
// scale, max(amax / 448, the smallest normal float) (1 for a zero row). A NaN
// (or Inf) makes the row's codes NaN, as in XLA.
inline float quantize_row(float* x, int n) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = max_or_nan(std::fabs(x[i]), amax);
  const float scale =
      amax > 0.0f ? std::max(amax * (1.0f / kFp8Max), std::numeric_limits<float>::min()) : 1.0f;
  const float inverse = 1.0f / scale;
  for (int i = 0; i < n; ++i) {
    const float y = x[i] * inverse;
    x[i] = round_to_e4m3(y != y ? y : std::clamp(y, -kFp8Max, kFp8Max));
  }
  return scale;
}

// ---- one sequence ----------------------------------------------------------------

// A sequence's table row and lengths, clipped to the table and to the query
// rows (so that a bad length inside jit reads nothing outside them).
struct MlaSequence {
  const int32_t* pages;
  int64_t kv_len, q_len;
  int64_t first_token;  // the cache position of query token 0
  int64_t heads;

  MlaSequence(const JfMlaDecodeArgs& args, int64_t b)
      : pages(args.page_table + b * args.max_pages),
        kv_len(valid_len(args.kv_lens, b, int64_t{args.max_pages} * kPage)),
        q_len(valid_len(args.q_lens, b, args.rows / args.heads)),
        first_token(kv_len - q_len),
        heads(args.heads) {}

  // The keys of query row r, for ForwardRows::attend: the cache up to its token.
  KeySpan span(int64_t r) const {
    return KeySpan{0, std::min(kv_len, first_token + r / heads + 1)};
  }
  // The first pool row of the page holding keys [j0, j0 + 64), or -1 for a page
  // id outside the pool, whose keys read as zeros.
  int64_t page_row(const JfMlaDecodeArgs& args, int64_t j0) const {
    const int64_t page = pages[j0 / kPage];
    return page >= 0 && page < args.num_pages ? page * kPage : -1;
  }
};

// Rows [r0, r0 + kRowsPerTask) of a sequence: how many exist, how many are
// live (tokens < q_len), and the keys the live ones see, [0, keys).
struct RowBlock {
  int rows, live;
  int64_t keys;

  RowBlock(const JfMlaDecodeArgs& args, const MlaSequence& seq, int64_t r0)
      : rows(static_cast<int>(std::min<int64_t>(kRowsPerTask, args.rows - r0))),
        live(static_cast<int>(std::clamp<int64_t>(seq.q_len * seq.heads - r0, 0, rows))),
        keys(live > 0 ? std::max<int64_t>(seq.span(r0 + live - 1).hi, 0) : 0) {}
};

// The keys of a block's row r (ForwardRows::attend's Keys): no documents.
struct RowsOf {
  const MlaSequence& seq;
  int64_t r0;
  KeySpan span(int r) const { return seq.span(r0 + r); }
  bool same_document(int, int) const { return true; }
};

// ---- the bfloat16 / float16 cache --------------------------------------------------

template <class Codec, class IsaT>
JF_ALWAYS_INLINE void attend_rows(const JfMlaDecodeArgs& args, const Geometry& g, int64_t b,
                                  int64_t r0) {
  using T = typename Codec::Storage;
  const MlaSequence seq(args, b);
  const RowBlock block(args, seq, r0);
  const T* cache = static_cast<const T*>(args.cache);
  const int64_t first_row = b * args.rows + r0;
  ForwardRows<kRowsPerTask, kPage, kWidth> t(g, block.live, IsaT::kBlockRows);
  if (block.keys > 0) {
    load_tile<Codec>(static_cast<const T*>(args.q) + first_row * kWidth, kWidth, block.live,
                     t.live_rows, kWidth, t.ld_q, t.q_tile);
    t.begin();
  }
  const RowsOf keys{seq, r0};
  for (int64_t j0 = 0; j0 < block.keys; j0 += kPage) {
    const int cols = static_cast<int>(std::min<int64_t>(kPage, block.keys - j0));
    const int64_t row = seq.page_row(args, j0);
    for (int d = 0; d < kWidth; ++d) std::fill_n(t.kt_tile + d * kPage, kPage, 0.0f);
    if (row < 0) {
      std::fill_n(t.v_tile, cols * t.ld_v, 0.0f);
    } else {
      const T* page = cache + row * kWidth;
      for (int c = 0; c < cols; ++c) {
        const T* key = page + c * kWidth;
        for (int d = 0; d < kWidth; ++d) t.kt_tile[d * kPage + c] = Codec::load(key[d]);
      }
      load_tile<Codec>(page, kWidth, cols, cols, kLatent, t.ld_v, t.v_tile);
    }
    t.template attend<IsaT, false>(j0, cols, keys);
  }
  T* o = static_cast<T*>(args.o);
  for (int r = 0; r < block.rows; ++r) {
    t.template store<Codec>(r, o + (first_row + r) * kLatent, args.lse + first_row + r);
  }
}

// ---- the FP8 cache ------------------------------------------------------------------

// The buffers of one FP8 task: the queries' codes and RoPE columns, one page's
// codes (transposed as keys, row-major as values), RoPE columns and scales.
struct Fp8Rows {
  alignas(64) float q_codes[kRowsPerTask * kLatent];
  alignas(64) float q_rope[kRowsPerTask * kRope];
  alignas(64) float kt_codes[kLatent * kPage];
  alignas(64) float kt_rope[kRope * kPage];
  alignas(64) float v_codes[kPage * kLatent];  // finite or zero: a NaN code reaches
                                               // its rows through the logits
  alignas(64) float o_acc[kRowsPerTask * kLatent];
  alignas(64) float scores[kRowsPerTask * kPage];
  float q_scale[kRowsPerTask];
  float k_scale[kPage];         // as stored: a NaN or Inf reaches the logits
  float k_scale_finite[kPage];  // for P: zero weights of unseen keys stay zero
  RowSoftmax state[kRowsPerTask];

  // Loads page `row` of the pool (-1: zeros) for keys [0, cols).
  void load_page(const JfMlaFp8DecodeArgs& args, int64_t row, int cols) {
    std::fill_n(kt_codes, kLatent * kPage, 0.0f);
    std::fill_n(kt_rope, kRope * kPage, 0.0f);
    std::fill_n(v_codes, kPage * kLatent, 0.0f);
    std::fill_n(k_scale, kPage, 0.0f);
    if (row < 0) return;
    const uint8_t* codes = static_cast<const uint8_t*>(args.mla.cache) + row * kLatent;
    const uint16_t* rope = static_cast<const uint16_t*>(args.rope) + row * kRope;
    for (int c = 0; c < cols; ++c) {
      for (int d = 0; d < kLatent; ++d) {
        const float x = e4m3_to_float(codes[c * kLatent + d]);
        kt_codes[d * kPage + c] = x;
        v_codes[c * kLatent + d] = FiniteOrZero::apply(x);
      }
      for (int d = 0; d < kRope; ++d) kt_rope[d * kPage + c] = bf16_to_float(rope[c * kRope + d]);
      k_scale[c] = args.scales[row + c];
    }
  }

  // One page of keys [j0, j0 + cols) for rows [0, live), the first
  // live_rows of which the products cover.
  template <class IsaT>
  JF_ALWAYS_INLINE void attend(int64_t j0, int cols, int live, int live_rows, float log2_scale,
                               const RowsOf& keys) {
    for (int j = 0; j < kPage; ++j) k_scale_finite[j] = FiniteOrZero::apply(k_scale[j]);
    // logit = scale * (sq * sk * (q_codes . k_codes) + q_rope . k_rope)
    tile_product<IsaT>(q_codes, kLatent, 1, kt_codes, kPage, kLatent, scores, kPage, live_rows,
                       kPage, 1.0f, Store::kSet);
    for (int r = 0; r < live_rows; ++r) {
      float* s = scores + r * kPage;
      for (int j = 0; j < kPage; ++j) s[j] = s[j] * q_scale[r] * k_scale[j];
    }
    tile_product<IsaT>(q_rope, kRope, 1, kt_rope, kPage, kRope, scores, kPage, live_rows, kPage,
                       1.0f, Store::kAdd);
    for (int r = 0; r < live_rows; ++r) {
      float* s = scores + r * kPage;
      const KeySpan span = r < live ? keys.span(r) : KeySpan{0, 0};
      const int a = static_cast<int>(std::clamp<int64_t>(span.lo - j0, 0, cols));
      const int e = static_cast<int>(std::clamp<int64_t>(span.hi - j0, a, cols));
      if (e <= a) {  // nothing of this row here, or a padding row
        std::fill_n(s, kPage, 0.0f);
        continue;
      }
      // A NaN or Inf in a seen key or query makes the logit NaN (fp8_reference).
      for (int j = a; j < e; ++j) {
        const float x = s[j] * log2_scale;
        s[j] = select(is_finite(x), x, std::numeric_limits<float>::quiet_NaN());
      }
      const float rescale = state[r].take_weights(s, a, e, kPage);
      if (rescale != 1.0f) {
        for (int d = 0; d < kLatent; ++d) o_acc[r * kLatent + d] *= rescale;
      }
      // P times the keys' scales, requantised over the page: the values the FP8
      // product multiplies (codes times the block's scale).
      for (int j = 0; j < kPage; ++j) s[j] *= k_scale_finite[j];
      const float block_scale = quantize_row(s, kPage);
      for (int j = 0; j < kPage; ++j) s[j] *= block_scale;
    }
    tile_product<IsaT>(scores, kPage, 1, v_codes, kLatent, cols, o_acc, kLatent, live_rows,
                       kLatent, 1.0f, Store::kAdd);
  }
};

template <class IsaT>
JF_ALWAYS_INLINE void attend_fp8_rows(const JfMlaFp8DecodeArgs& args, int64_t b, int64_t r0) {
  const JfMlaDecodeArgs& mla = args.mla;
  const MlaSequence seq(mla, b);
  const RowBlock block(mla, seq, r0);
  const int64_t first_row = b * mla.rows + r0;
  const int live_rows = round_up(block.live, IsaT::kBlockRows);
  Fp8Rows t;
  const uint16_t* q = static_cast<const uint16_t*>(mla.q) + first_row * kWidth;
  std::fill_n(t.q_codes, kRowsPerTask * kLatent, 0.0f);
  std::fill_n(t.q_rope, kRowsPerTask * kRope, 0.0f);
  std::fill_n(t.o_acc, kRowsPerTask * kLatent, 0.0f);
  std::fill_n(t.q_scale, kRowsPerTask, 0.0f);
  for (int r = 0; r < block.live && block.keys > 0; ++r) {
    const uint16_t* row = q + r * kWidth;
    for (int d = 0; d < kLatent; ++d) t.q_codes[r * kLatent + d] = bf16_to_float(row[d]);
    for (int d = 0; d < kRope; ++d) t.q_rope[r * kRope + d] = bf16_to_float(row[kLatent + d]);
    t.q_scale[r] = quantize_row(t.q_codes + r * kLatent, kLatent);
  }
  const RowsOf keys{seq, r0};
  const float log2_scale = mla.scale * kLog2e;
  for (int64_t j0 = 0; j0 < block.keys; j0 += kPage) {
    const int cols = static_cast<int>(std::min<int64_t>(kPage, block.keys - j0));
    t.load_page(args, seq.page_row(mla, j0), cols);
    t.template attend<IsaT>(j0, cols, block.live, live_rows, log2_scale, keys);
  }
  uint16_t* o = static_cast<uint16_t*>(mla.o);
  for (int r = 0; r < block.rows; ++r) {
    uint16_t* out = o + (first_row + r) * kLatent;
    float* lse = mla.lse + first_row + r;
    if (r < block.live) {
      t.state[r].store<BF16>(t.o_acc + r * kLatent, kLatent, out, lse);
    } else {
      RowSoftmax::store_empty<BF16>(kLatent, out, lse);
    }
  }
}

// ---- tasks ----------------------------------------------------------------------------

// Calls task(b, r0) for every block of rows, on the thread pool.
template <class Task>
void for_each_block(const JfMlaDecodeArgs& args, const Task& task) {
  const int64_t blocks = (args.rows + kRowsPerTask - 1) / kRowsPerTask;
  const double macs = 1.0 * args.batch * args.rows * args.max_pages * kPage * (kWidth + kLatent);
  parallel_for(int64_t{args.batch} * blocks, macs, [&](int64_t index) {
    task(index / blocks, index % blocks * kRowsPerTask);
  });
}

// The problem as the contiguous forward's tile code sees it: one kv head.
Geometry mla_geometry(const JfMlaDecodeArgs& args) {
  JfProblem p{};
  p.dtype = args.dtype;
  p.batch = args.batch;
  p.seqlen_q = args.rows / args.heads;
  p.seqlen_k = args.max_pages * kPage;
  p.heads_q = args.heads;
  p.heads_kv = 1;
  p.head_dim = kWidth;
  p.head_dim_v = kLatent;
  p.scale = args.scale;
  p.window_left = -1;
  p.window_right = 0;
  return Geometry(p);
}

template <class Codec>
void run_cache(const JfMlaDecodeArgs& args) {
  const Geometry g = mla_geometry(args);
  for_each_block(args, [&](int64_t b, int64_t r0) {
    run_with_isa([&](auto isa) { attend_rows<Codec, decltype(isa)>(args, g, b, r0); });
  });
}

// ---- argument checks ------------------------------------------------------------------

template <class... Rest>
int fail(char* err, size_t err_len, const char* entry, const char* format, Rest... rest) {
  if (err != nullptr && err_len > 0) {
    const int n = std::snprintf(err, err_len, "%s: ", entry);
    if (n >= 0 && static_cast<size_t>(n) < err_len) {
      std::snprintf(err + n, err_len - n, format, rest...);
    }
  }
  return 1;
}

int check(const JfMlaDecodeArgs* args, const char* entry, char* err, size_t err_len) {
  if (args == nullptr) return fail(err, err_len, entry, "args is null");
  std::underlying_type_t<JfDtype> dtype;  // an enum outside its range is undefined
  std::memcpy(&dtype, &args->dtype, sizeof dtype);
  if (dtype != JF_FLOAT16 && dtype != JF_BFLOAT16) {
    return fail(err, err_len, entry, "dtype must be float16 or bfloat16, got %lld",
                static_cast<long long>(dtype));
  }
  if (args->batch < 0 || args->heads <= 0 || args->rows <= 0 || args->rows % args->heads) {
    return fail(err, err_len, entry,
                "batch must be >= 0 and rows a positive multiple of heads > 0, got %d, %d, %d",
                args->batch, args->rows, args->heads);
  }
  if (args->num_pages <= 0 || args->max_pages <= 0 || args->split_pages != args->max_pages) {
    return fail(err, err_len, entry,
                "num_pages and max_pages must be > 0 and split_pages max_pages (the CPU kernel "
                "runs each sequence as one split), got %d, %d, %d",
                args->num_pages, args->max_pages, args->split_pages);
  }
  if (!std::isfinite(args->scale)) {
    return fail(err, err_len, entry, "scale must be finite, got %g",
                static_cast<double>(args->scale));
  }
  const bool no_rows = args->batch == 0;  // XLA may pass null for empty buffers
  const struct {
    const char* name;
    const void* ptr;
    bool empty;
  } operands[] = {{"q", args->q, no_rows},
                  {"cache", args->cache, false},
                  {"page_table", args->page_table, no_rows},
                  {"q_lens", args->q_lens, no_rows},
                  {"kv_lens", args->kv_lens, no_rows},
                  {"o", args->o, no_rows},
                  {"lse", args->lse, no_rows}};
  for (const auto& op : operands) {
    if (op.ptr == nullptr && !op.empty) return fail(err, err_len, entry, "%s is null", op.name);
  }
  return 0;
}

}  // namespace
}  // namespace jax_flash_cpu

extern "C" int jax_flash_mla_decode_cpu(const JfMlaDecodeArgs* args, char* err, size_t err_len) {
  using namespace jax_flash_cpu;
  if (const int rc = check(args, "jax_flash_mla_decode_cpu", err, err_len)) return rc;
  if (args->dtype == JF_FLOAT16) {
    run_cache<F16>(*args);
  } else {
    run_cache<BF16>(*args);
  }
  if (err != nullptr && err_len > 0) err[0] = '\0';
  return 0;
}

extern "C" int jax_flash_mla_fp8_decode_cpu(const JfMlaFp8DecodeArgs* args, char* err,
                                            size_t err_len) {
  using namespace jax_flash_cpu;
  constexpr const char* kEntry = "jax_flash_mla_fp8_decode_cpu";
  if (args == nullptr) return fail(err, err_len, kEntry, "args is null");
  if (const int rc = check(&args->mla, kEntry, err, err_len)) return rc;
  if (args->mla.dtype != JF_BFLOAT16) return fail(err, err_len, kEntry, "q must be bfloat16");
  if (args->scales == nullptr || args->rope == nullptr) {
    return fail(err, err_len, kEntry, "scales and rope must not be null");
  }
  for_each_block(args->mla, [&](int64_t b, int64_t r0) {
    run_with_isa([&](auto isa) { attend_fp8_rows<decltype(isa)>(*args, b, r0); });
  });
  if (err != nullptr && err_len > 0) err[0] = '\0';
  return 0;
}
