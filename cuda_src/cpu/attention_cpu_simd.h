// Vector code of the CPU attention kernels: instruction sets chosen at run
// time, and the register-blocked tile product every matrix product of the
// forward and backward goes through.
//
// The kernels' hot code is compiled once per instruction set (AVX-512, AVX2 +
// FMA, and the baseline ISA), each copy with its own vector width and block
// shape; run_with_isa() picks the copy for this CPU. A copy is built by
// inlining everything below one entry function that carries the ISA as its
// target (`flatten`), so the tile code itself is ISA-agnostic templates.
// Define JAX_FLASH_CPU_CLONES=0 to build the baseline copy only.
#ifndef JAX_FLASH_CPU_ATTENTION_CPU_SIMD_H_
#define JAX_FLASH_CPU_ATTENTION_CPU_SIMD_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>

#ifndef JAX_FLASH_CPU_CLONES
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JAX_FLASH_CPU_CLONES 1
#else
#define JAX_FLASH_CPU_CLONES 0
#endif
#endif

#define JF_ALWAYS_INLINE inline __attribute__((always_inline))

namespace jax_flash_cpu {

// Float vectors of N lanes (GCC vector extensions: one register, or a few of
// the ISA's narrower ones).
template <int N>
struct FloatVector {
  typedef float type __attribute__((vector_size(N * sizeof(float))));
};

// An instruction set: its vector width in floats and the tile product's block
// of kBlockRows rows x kBlockVectors vectors of C, held in registers (32
// vector registers on AVX-512, 16 on the others).
template <int kLanesT, int kBlockVectorsT>
struct Isa {
  static constexpr int kLanes = kLanesT;
  static constexpr int kBlockRows = 4;
  static constexpr int kBlockVectors = kBlockVectorsT;
  using Vec = typename FloatVector<kLanes>::type;
};
using IsaAvx512 = Isa<16, 4>;
using IsaAvx2 = Isa<8, 2>;
using IsaBaseline = Isa<4, 2>;

// Rows of every tile buffer are padded to a multiple of this many floats (the
// widest vector), with zeros where the padding is read.
constexpr int kPadFloats = 16;

constexpr int round_up(int n, int to) { return (n + to - 1) / to * to; }

template <class V>
JF_ALWAYS_INLINE V load_vec(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class V>
JF_ALWAYS_INLINE void store_vec(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

// x in every lane. Written as x times a vector of ones, which GCC turns into
// one broadcast where the target is only known after inlining; building the
// vector lane by lane there gives a chain of masked inserts.
template <class V>
JF_ALWAYS_INLINE V broadcast(float x) {
  V ones;
  for (int i = 0; i < static_cast<int>(sizeof(V) / sizeof(float)); ++i) ones[i] = 1.0f;
  return x * ones;
}

// How tile_product writes C: C = alpha * A B, or C += alpha * A B (one fused
// multiply-add per element, so alpha = 1 adds the block's sum exactly once).
enum class Store { kSet, kAdd };

// C[i][0, kVecs * lanes) of rows [0, 4): sum over k in [0, depth) of
// A(i, k) * B[k][...], A read at a[i * a_row + k * a_col]. Each element is one
// chain of fused multiply-adds in increasing k from zero, whatever the block
// shape, so results do not depend on the ISA's blocking or on other rows.
template <class IsaT, int kVecs>
JF_ALWAYS_INLINE void product_block(const float* __restrict a, int64_t a_row, int64_t a_col,
                                    const float* __restrict b, int64_t ldb, int depth,
                                    float* __restrict c, int64_t ldc, float alpha, Store store) {
  using V = typename IsaT::Vec;
  constexpr int kL = IsaT::kLanes;
  constexpr int kR = IsaT::kBlockRows;
  V acc[kR][kVecs];
  for (int r = 0; r < kR; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[r][v] = V{};
  }
  for (int k = 0; k < depth; ++k) {
    const float* bk = b + k * ldb;
    V bv[kVecs];
    for (int v = 0; v < kVecs; ++v) bv[v] = load_vec<V>(bk + v * kL);
    for (int r = 0; r < kR; ++r) {
      const V ar = broadcast<V>(a[r * a_row + k * a_col]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] += ar * bv[v];
    }
  }
  const V alpha_v = broadcast<V>(alpha);
  for (int r = 0; r < kR; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      float* cp = c + r * ldc + v * kL;
      if (store == Store::kSet) {
        store_vec(cp, alpha_v * acc[r][v]);
      } else {
        store_vec(cp, alpha_v * acc[r][v] + load_vec<V>(cp));
      }
    }
  }
}

// C (rows x width, row stride ldc) = or += alpha * A B with A(i, k) at
// a[i * a_row + k * a_col] and B row-major (row stride ldb). rows must be a
// multiple of 4 and width of the ISA's lanes; the buffers hold that much.
template <class IsaT>
JF_ALWAYS_INLINE void tile_product(const float* a, int64_t a_row, int64_t a_col,
                                   const float* b, int64_t ldb, int depth, float* c,
                                   int64_t ldc, int rows, int width, float alpha, Store store) {
  constexpr int kL = IsaT::kLanes;
  constexpr int kR = IsaT::kBlockRows;
  constexpr int kV = IsaT::kBlockVectors;
  for (int c0 = 0; c0 < width; c0 += kV * kL) {
    const int vecs = (width - c0) / kL < kV ? (width - c0) / kL : kV;
    for (int r0 = 0; r0 < rows; r0 += kR) {
      const float* ab = a + r0 * a_row;
      float* cb = c + r0 * ldc + c0;
      const float* bb = b + c0;
      if (vecs == kV) {
        product_block<IsaT, kV>(ab, a_row, a_col, bb, ldb, depth, cb, ldc, alpha, store);
      } else if constexpr (kV == 4) {
        if (vecs == 3) {
          product_block<IsaT, 3>(ab, a_row, a_col, bb, ldb, depth, cb, ldc, alpha, store);
        } else if (vecs == 2) {
          product_block<IsaT, 2>(ab, a_row, a_col, bb, ldb, depth, cb, ldc, alpha, store);
        } else {
          product_block<IsaT, 1>(ab, a_row, a_col, bb, ldb, depth, cb, ldc, alpha, store);
        }
      } else {
        product_block<IsaT, 1>(ab, a_row, a_col, bb, ldb, depth, cb, ldc, alpha, store);
      }
    }
  }
}

// ---- choosing the instruction set at run time --------------------------------

enum class CpuIsa { kBaseline, kAvx2, kAvx512 };

// The widest instruction set this CPU runs, capped by the environment
// variable JAX_FLASH_CPU_ISA ("avx2" or "baseline"), which lets the tests run
// the narrower copies on a wider CPU.
inline CpuIsa detect_isa() {
  const char* cap = std::getenv("JAX_FLASH_CPU_ISA");
  if (cap != nullptr && std::strcmp(cap, "baseline") == 0) return CpuIsa::kBaseline;
#if JAX_FLASH_CPU_CLONES
  __builtin_cpu_init();
  const bool avx2_only = cap != nullptr && std::strcmp(cap, "avx2") == 0;
  if (!avx2_only && __builtin_cpu_supports("x86-64-v4")) return CpuIsa::kAvx512;
  if (__builtin_cpu_supports("x86-64-v3")) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kBaseline;
}

inline CpuIsa cpu_isa() {
  static const CpuIsa isa = detect_isa();
  return isa;
}

// fn(IsaT{}) compiled for each instruction set, everything it calls inlined.
#if JAX_FLASH_CPU_CLONES
template <class Fn>
__attribute__((target("arch=x86-64-v4,prefer-vector-width=512"), flatten, noinline)) void
run_avx512(const Fn& fn) {
  fn(IsaAvx512{});
}
template <class Fn>
__attribute__((target("arch=x86-64-v3"), flatten, noinline)) void run_avx2(const Fn& fn) {
  fn(IsaAvx2{});
}
#endif
template <class Fn>
__attribute__((flatten, noinline)) void run_baseline(const Fn& fn) {
  fn(IsaBaseline{});
}

// Calls fn with the instruction set of this CPU (an IsaAvx512, IsaAvx2 or
// IsaBaseline value), in the copy of fn compiled for it.
template <class Fn>
void run_with_isa(const Fn& fn) {
#if JAX_FLASH_CPU_CLONES
  switch (cpu_isa()) {
    case CpuIsa::kAvx512:
      run_avx512(fn);
      return;
    case CpuIsa::kAvx2:
      run_avx2(fn);
      return;
    case CpuIsa::kBaseline:
      break;
  }
#endif
  run_baseline(fn);
}

}  // namespace jax_flash_cpu

#endif  // JAX_FLASH_CPU_ATTENTION_CPU_SIMD_H_
