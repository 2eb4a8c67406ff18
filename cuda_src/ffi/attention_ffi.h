// XLA FFI handlers shared by every backend.
//
// A backend supplies two launch functions with the kernel_api.h signature
// (plus its execution context); this header decodes and validates the XLA
// buffers into JfFwdArgs / JfBwdArgs. Leading dimensions before the last
// three are folded into the batch, which is how `vmap` reaches the kernels.
#ifndef JAX_FLASH_ATTENTION_FFI_H_
#define JAX_FLASH_ATTENTION_FFI_H_

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "jax_flash/kernel_api.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash {

namespace ffi = xla::ffi;

inline std::string ShapeString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + ")";
}

inline ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("jax_flash: " + message);
}

inline bool ToJfDtype(ffi::DataType type, JfDtype* out) {
  switch (type) {
    case ffi::DataType::F16: *out = JF_FLOAT16; return true;
    case ffi::DataType::BF16: *out = JF_BFLOAT16; return true;
    case ffi::DataType::F32: *out = JF_FLOAT32; return true;
    default: return false;
  }
}

// Reads [..., seq, heads, dim]; leading dimensions multiply into `batch`.
inline ffi::Error ReadTokens(const char* name, ffi::AnyBuffer::Dimensions dims,
                             int64_t* batch, int64_t* seq, int64_t* heads,
                             int64_t* dim) {
  if (dims.size() < 4) {
    return Invalid(std::string(name) + " must have rank >= 4 ([batch, seq, heads, dim]), got shape " +
                   ShapeString(dims));
  }
  int64_t b = 1;
  for (size_t i = 0; i + 3 < dims.size(); ++i) b *= dims[i];
  *batch = b;
  *seq = dims[dims.size() - 3];
  *heads = dims[dims.size() - 2];
  *dim = dims[dims.size() - 1];
  return ffi::Error::Success();
}

inline ffi::Error ExpectShape(const char* name, ffi::AnyBuffer::Dimensions dims,
                              int64_t batch, int64_t d1, int64_t d2,
                              int64_t d3) {
  int64_t b, x, y, z;
  if (ffi::Error e = ReadTokens(name, dims, &b, &x, &y, &z); e.failure()) return e;
  if (b != batch || x != d1 || y != d2 || z != d3) {
    return Invalid(std::string(name) + " has shape " + ShapeString(dims) +
                   ", expected leading batch " + std::to_string(batch) +
                   " then (" + std::to_string(d1) + ", " + std::to_string(d2) +
                   ", " + std::to_string(d3) + ")");
  }
  return ffi::Error::Success();
}

// Checks a [..., rows] int32 / [..., heads, seq] float32 side buffer.
inline ffi::Error ExpectElements(const char* name, const ffi::AnyBuffer& buf,
                                 ffi::DataType type, int64_t count) {
  if (buf.element_type() != type) {
    return Invalid(std::string(name) + " has the wrong element type");
  }
  if (static_cast<int64_t>(buf.element_count()) != count) {
    return Invalid(std::string(name) + " has " + std::to_string(buf.element_count()) +
                   " elements, expected " + std::to_string(count));
  }
  return ffi::Error::Success();
}

inline bool FitsInt32(int64_t x) { return x >= 0 && x <= INT32_MAX; }

// The attributes added in ABI v2; a v1 call gets the defaults.
struct Options {
  float softcap = 0.0f;
  int32_t deterministic = 0;
};

// Rows of dq_semaphore per (batch, head): the smallest query tile of any
// GPU backward kernel is 32 rows.
constexpr int64_t kSemaphoreRows = 32;

// Validates q, k, v, q_lens, kv_lens and fills the shared problem description.
inline ffi::Error MakeProblem(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                              const ffi::AnyBuffer& v,
                              const ffi::AnyBuffer& q_lens,
                              const ffi::AnyBuffer& kv_lens, float scale,
                              int32_t diag_offset, int32_t window_left,
                              int32_t window_right, const Options& options,
                              JfProblem* p) {
  int64_t batch, seq_q, heads_q, dim;
  if (auto e = ReadTokens("q", q.dimensions(), &batch, &seq_q, &heads_q, &dim); e.failure()) return e;
  int64_t kb, seq_k, heads_kv, kdim;
  if (auto e = ReadTokens("k", k.dimensions(), &kb, &seq_k, &heads_kv, &kdim); e.failure()) return e;
  int64_t vb, vseq, vheads, dim_v;
  if (auto e = ReadTokens("v", v.dimensions(), &vb, &vseq, &vheads, &dim_v); e.failure()) return e;
  if (kb != batch || vb != batch) {
    return Invalid("q, k and v must share their batch dimensions: q " + ShapeString(q.dimensions()) +
                   ", k " + ShapeString(k.dimensions()) + ", v " + ShapeString(v.dimensions()));
  }
  if (kdim != dim) {
    return Invalid("k head_dim must equal q head_dim " + std::to_string(dim) + ", got " +
                   std::to_string(kdim));
  }
  if (vseq != seq_k || vheads != heads_kv) {
    return Invalid("v shape " + ShapeString(v.dimensions()) + " does not match k shape " +
                   ShapeString(k.dimensions()));
  }
  if (heads_kv == 0 || heads_q % heads_kv != 0) {
    return Invalid("heads_q (" + std::to_string(heads_q) + ") must be a multiple of heads_kv (" +
                   std::to_string(heads_kv) + ")");
  }
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type()) {
    return Invalid("q, k and v must share one dtype");
  }
  JfDtype dtype;
  if (!ToJfDtype(q.element_type(), &dtype)) {
    return Invalid("q dtype must be float16, bfloat16 or float32");
  }
  for (int64_t x : {batch, seq_q, seq_k, heads_q, heads_kv, dim, dim_v}) {
    if (!FitsInt32(x)) return Invalid("a dimension exceeds the int32 range");
  }
  if (auto e = ExpectElements("q_lens", q_lens, ffi::DataType::S32, batch); e.failure()) return e;
  if (auto e = ExpectElements("kv_lens", kv_lens, ffi::DataType::S32, batch); e.failure()) return e;
  *p = JfProblem{dtype,
                 static_cast<int32_t>(batch),
                 static_cast<int32_t>(seq_q),
                 static_cast<int32_t>(seq_k),
                 static_cast<int32_t>(heads_q),
                 static_cast<int32_t>(heads_kv),
                 static_cast<int32_t>(dim),
                 static_cast<int32_t>(dim_v),
                 scale,
                 diag_offset,
                 window_left,
                 window_right};
  if (!(options.softcap >= 0.0f) || options.softcap == INFINITY) {
    return Invalid("softcap must be finite and >= 0, got " + std::to_string(options.softcap));
  }
  if (options.deterministic != 0 && options.deterministic != 1) {
    return Invalid("deterministic must be 0 or 1, got " + std::to_string(options.deterministic));
  }
  p->softcap = options.softcap;
  p->deterministic = options.deterministic;
  return ffi::Error::Success();
}

inline ffi::Error CheckLike(const char* name, const ffi::AnyBuffer& buf,
                            ffi::DataType type, int64_t batch, int64_t d1,
                            int64_t d2, int64_t d3) {
  if (buf.element_type() != type) {
    return Invalid(std::string(name) + " has the wrong element type");
  }
  return ExpectShape(name, buf.dimensions(), batch, d1, d2, d3);
}

inline ffi::Error CheckStats(const char* name, const ffi::AnyBuffer& buf,
                             const JfProblem& p) {
  return ExpectElements(name, buf, ffi::DataType::F32,
                        int64_t{p.batch} * p.heads_q * p.seqlen_q);
}

// The packed-document operands: all four empty (no segments) or all sized
// [batch, seqlen_q], [batch, seqlen_k], [batch, seqlen_q * 2], [batch, seqlen_k * 2].
struct SegmentBuffers {
  const ffi::AnyBuffer& q_ids;
  const ffi::AnyBuffer& kv_ids;
  const ffi::AnyBuffer& kv_bounds;
  const ffi::AnyBuffer& q_bounds;
};

template <typename Args>
ffi::Error ReadSegments(const SegmentBuffers& seg, Args* args) {
  JfProblem& p = args->problem;
  const size_t present = (seg.q_ids.element_count() > 0) + (seg.kv_ids.element_count() > 0) +
                         (seg.kv_bounds.element_count() > 0) +
                         (seg.q_bounds.element_count() > 0);
  if (present == 0) {
    p.has_segments = 0;
    return ffi::Error::Success();
  }
  const int64_t rows_q = int64_t{p.batch} * p.seqlen_q;
  const int64_t rows_k = int64_t{p.batch} * p.seqlen_k;
  if (auto e = ExpectElements("q_segment_ids", seg.q_ids, ffi::DataType::S32, rows_q); e.failure()) return e;
  if (auto e = ExpectElements("kv_segment_ids", seg.kv_ids, ffi::DataType::S32, rows_k); e.failure()) return e;
  if (auto e = ExpectElements("kv_bounds", seg.kv_bounds, ffi::DataType::S32, 2 * rows_q); e.failure()) return e;
  if (auto e = ExpectElements("q_bounds", seg.q_bounds, ffi::DataType::S32, 2 * rows_k); e.failure()) return e;
  p.has_segments = 1;
  args->q_segment_ids = static_cast<const int32_t*>(seg.q_ids.untyped_data());
  args->kv_segment_ids = static_cast<const int32_t*>(seg.kv_ids.untyped_data());
  args->kv_bounds = static_cast<const int32_t*>(seg.kv_bounds.untyped_data());
  args->q_bounds = static_cast<const int32_t*>(seg.q_bounds.untyped_data());
  return ffi::Error::Success();
}

// The attention sinks (v3): float32 [*batch, heads_q, 1], or no elements
// for none; `sinks` is null where the call has no such operand.
inline ffi::Error ReadSinks(const ffi::AnyBuffer* sinks, JfFwdArgs* args) {
  if (sinks == nullptr || sinks->element_count() == 0) return ffi::Error::Success();
  const JfProblem& p = args->problem;
  if (auto e = ExpectElements("sinks", *sinks, ffi::DataType::F32, int64_t{p.batch} * p.heads_q);
      e.failure())
    return e;
  args->sinks = static_cast<const float*>(sinks->untyped_data());
  return ffi::Error::Success();
}

// Decodes the forward call. `launch(const JfFwdArgs&) -> ffi::Error`.
template <typename Launch>
ffi::Error AttentionForward(Launch&& launch, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer q_lens,
                            ffi::AnyBuffer kv_lens, const SegmentBuffers& segments,
                            ffi::Result<ffi::AnyBuffer> o,
                            ffi::Result<ffi::AnyBuffer> lse, float scale,
                            int32_t diag_offset, int32_t window_left,
                            int32_t window_right, const Options& options,
                            const ffi::AnyBuffer* sinks = nullptr) {
  JfFwdArgs args{};
  if (auto e = MakeProblem(q, k, v, q_lens, kv_lens, scale, diag_offset, window_left,
                           window_right, options, &args.problem);
      e.failure())
    return e;
  const JfProblem& p = args.problem;
  if (auto e = CheckLike("o", *o, q.element_type(), p.batch, p.seqlen_q, p.heads_q, p.head_dim_v);
      e.failure())
    return e;
  if (auto e = CheckStats("lse", *lse, p); e.failure()) return e;
  if (auto e = ReadSegments(segments, &args); e.failure()) return e;
  if (auto e = ReadSinks(sinks, &args); e.failure()) return e;
  args.q = q.untyped_data();
  args.k = k.untyped_data();
  args.v = v.untyped_data();
  args.q_lens = static_cast<const int32_t*>(q_lens.untyped_data());
  args.kv_lens = static_cast<const int32_t*>(kv_lens.untyped_data());
  args.o = o->untyped_data();
  args.lse = static_cast<float*>(lse->untyped_data());
  return launch(args);
}

// dq_accum in query tiles: [*batch, chains, heads_q, ceil(seqlen_q / rows),
// rows, head_dim] (kernel_api.h: dq_tile_rows). Sets *chains and *rows.
inline ffi::Error ReadDqTiles(const ffi::AnyBuffer& dq, const JfProblem& p, int64_t* chains,
                              int32_t* rows) {
  const auto dims = dq.dimensions();
  const size_t n = dims.size();
  int64_t lead = 1;
  for (size_t i = 0; i + 5 < n; ++i) lead *= dims[i];
  const int64_t tile_rows = dims[n - 2];
  const bool fits = tile_rows > 0 && tile_rows <= INT32_MAX && dims[n - 1] == p.head_dim &&
                    dims[n - 3] == (p.seqlen_q + tile_rows - 1) / tile_rows && dims[n - 4] == p.heads_q &&
                    lead == p.batch;
  if (!fits) {
    return Invalid("dq_accum in query tiles must have shape [*batch, chains, heads_q, ceil(seqlen_q / "
                   "rows), rows, head_dim] with batch " + std::to_string(p.batch) + ", heads_q " +
                   std::to_string(p.heads_q) + ", seqlen_q " + std::to_string(p.seqlen_q) + ", head_dim " +
                   std::to_string(p.head_dim) + ", got " + ShapeString(dims));
  }
  if (dq.element_type() != ffi::DataType::F32) return Invalid("dq_accum has the wrong element type");
  *chains = dims[n - 5];
  *rows = static_cast<int32_t>(tile_rows);
  return ffi::Error::Success();
}

// Decodes the backward call. `launch(const JfBwdArgs&) -> ffi::Error`.
template <typename Launch>
ffi::Error AttentionBackward(Launch&& launch, ffi::AnyBuffer q, ffi::AnyBuffer k,
                             ffi::AnyBuffer v, ffi::AnyBuffer dout,
                             ffi::AnyBuffer lse, ffi::AnyBuffer delta,
                             ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                             const SegmentBuffers& segments,
                             ffi::Result<ffi::AnyBuffer> dq_accum,
                             ffi::Result<ffi::AnyBuffer> dk,
                             ffi::Result<ffi::AnyBuffer> dv,
                             ffi::AnyBuffer* dq_semaphore, float scale,
                             int32_t diag_offset, int32_t window_left,
                             int32_t window_right, const Options& options) {
  JfBwdArgs args{};
  if (auto e = MakeProblem(q, k, v, q_lens, kv_lens, scale, diag_offset, window_left,
                           window_right, options, &args.problem);
      e.failure())
    return e;
  const JfProblem& p = args.problem;
  const ffi::DataType type = q.element_type();
  if (auto e = CheckLike("dout", dout, type, p.batch, p.seqlen_q, p.heads_q, p.head_dim_v); e.failure())
    return e;
  if (auto e = CheckStats("lse", lse, p); e.failure()) return e;
  if (auto e = CheckStats("delta", delta, p); e.failure()) return e;
  // dq_accum: q's shape, [chains, *q.shape], or in query tiles (ReadDqTiles).
  const size_t q_rank = q.dimensions().size(), dq_rank = dq_accum->dimensions().size();
  int64_t chains = dq_rank == q_rank + 1 ? dq_accum->dimensions()[0] : 1;
  if (dq_rank == q_rank + 2) {
    if (auto e = ReadDqTiles(*dq_accum, p, &chains, &args.dq_tile_rows); e.failure()) return e;
  }
  if (chains < 1 || chains > JF_MAX_DQ_CHAINS || (chains > 1 && !p.deterministic)) {
    return Invalid("dq_accum must have q's shape " + ShapeString(q.dimensions()) +
                   (p.deterministic ? ", or that after a leading 1 to " + std::to_string(JF_MAX_DQ_CHAINS)
                                    : std::string()) +
                   ", got " + ShapeString(dq_accum->dimensions()));
  }
  if (dq_rank != q_rank + 2) {
    if (auto e = CheckLike("dq_accum", *dq_accum, ffi::DataType::F32, chains * p.batch, p.seqlen_q,
                           p.heads_q, p.head_dim);
        e.failure())
      return e;
  }
  args.dq_chains = static_cast<int32_t>(chains);
  if (auto e = CheckLike("dk", *dk, type, p.batch, p.seqlen_k, p.heads_kv, p.head_dim); e.failure())
    return e;
  if (auto e = CheckLike("dv", *dv, type, p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v); e.failure())
    return e;
  if (auto e = ReadSegments(segments, &args); e.failure()) return e;
  if (p.deterministic) {
    if (dq_semaphore == nullptr) return Invalid("deterministic needs the dq_semaphore output");
    const int64_t tiles = (int64_t{p.seqlen_q} + kSemaphoreRows - 1) / kSemaphoreRows;
    if (auto e = ExpectElements("dq_semaphore", *dq_semaphore, ffi::DataType::S32,
                                int64_t{p.batch} * p.heads_q * chains * tiles);
        e.failure())
      return e;
    args.dq_semaphore = static_cast<int32_t*>(dq_semaphore->untyped_data());
  }
  args.q = q.untyped_data();
  args.k = k.untyped_data();
  args.v = v.untyped_data();
  args.dout = dout.untyped_data();
  args.lse = static_cast<const float*>(lse.untyped_data());
  args.delta = static_cast<const float*>(delta.untyped_data());
  args.q_lens = static_cast<const int32_t*>(q_lens.untyped_data());
  args.kv_lens = static_cast<const int32_t*>(kv_lens.untyped_data());
  args.dq_accum = static_cast<float*>(dq_accum->untyped_data());
  args.dk = dk->untyped_data();
  args.dv = dv->untyped_data();
  return launch(args);
}

// The forward's operands up to q_bounds, shared by every version.
template <typename Binding>
auto BindForwardOperands(Binding&& binding) {
  return std::forward<Binding>(binding).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()            // k
      .template Arg<ffi::AnyBuffer>()            // v
      .template Arg<ffi::AnyBuffer>()            // q_lens
      .template Arg<ffi::AnyBuffer>()            // kv_lens
      .template Arg<ffi::AnyBuffer>()            // q_segment_ids
      .template Arg<ffi::AnyBuffer>()            // kv_segment_ids
      .template Arg<ffi::AnyBuffer>()            // kv_bounds
      .template Arg<ffi::AnyBuffer>();           // q_bounds
}

// The forward's results and its v1 attributes, after its operands.
template <typename Binding>
auto BindForwardResults(Binding&& binding) {
  return std::forward<Binding>(binding).template Ret<ffi::AnyBuffer>()  // o
      .template Ret<ffi::AnyBuffer>()            // lse
      .template Attr<float>("scale")
      .template Attr<int32_t>("diag_offset")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right");
}

// Binds the argument list shared by every backend's forward handler (v1:
// without the Options attributes).
template <typename Binding>
auto BindForwardV1(Binding&& binding) {
  return BindForwardResults(BindForwardOperands(std::forward<Binding>(binding)));
}

template <typename Binding>
auto BindBackwardV1(Binding&& binding) {
  return std::forward<Binding>(binding).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()            // k
      .template Arg<ffi::AnyBuffer>()            // v
      .template Arg<ffi::AnyBuffer>()            // dout
      .template Arg<ffi::AnyBuffer>()            // lse
      .template Arg<ffi::AnyBuffer>()            // delta
      .template Arg<ffi::AnyBuffer>()            // q_lens
      .template Arg<ffi::AnyBuffer>()            // kv_lens
      .template Arg<ffi::AnyBuffer>()            // q_segment_ids
      .template Arg<ffi::AnyBuffer>()            // kv_segment_ids
      .template Arg<ffi::AnyBuffer>()            // kv_bounds
      .template Arg<ffi::AnyBuffer>()            // q_bounds
      .template Ret<ffi::AnyBuffer>()            // dq_accum
      .template Ret<ffi::AnyBuffer>()            // dk
      .template Ret<ffi::AnyBuffer>()            // dv
      .template Attr<float>("scale")
      .template Attr<int32_t>("diag_offset")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right");
}

// v2 adds softcap to the forward; dq_semaphore (a fourth output), softcap
// and deterministic to the backward.
template <typename Binding>
auto BindForwardV2(Binding&& binding) {
  return BindForwardV1(std::forward<Binding>(binding)).template Attr<float>("softcap");
}

// v3 (the CUDA forward only) adds the sinks operand after q_bounds
// (ReadSinks).
template <typename Binding>
auto BindForwardV3(Binding&& binding) {
  return BindForwardResults(
             BindForwardOperands(std::forward<Binding>(binding)).template Arg<ffi::AnyBuffer>())
      .template Attr<float>("softcap");
}

template <typename Binding>
auto BindBackward(Binding&& binding) {
  return BindBackwardV1(std::forward<Binding>(binding))
      .template Ret<ffi::AnyBuffer>()  // dq_semaphore
      .template Attr<float>("softcap")
      .template Attr<int32_t>("deterministic");
}

// Runs a kernel_api.h entry point and turns its status into an ffi::Error.
template <typename Fn>
ffi::Error CallKernel(Fn&& fn) {
  char err[512] = {0};
  if (fn(err, sizeof(err)) != 0) {
    return ffi::Error::Internal(std::string("jax_flash: ") + err);
  }
  return ffi::Error::Success();
}

}  // namespace jax_flash

#endif  // JAX_FLASH_ATTENTION_FFI_H_
