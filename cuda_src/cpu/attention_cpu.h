// Scalar numerics of the CPU attention kernels: conversions between float
// and the 16-bit storage types (round to nearest even, written out so the
// kernels need nothing beyond the standard library) and a branch-free exp2.
// Internal to the CPU kernels; a header so tests can reach the converters.
#ifndef JAX_FLASH_CPU_ATTENTION_CPU_H_
#define JAX_FLASH_CPU_ATTENTION_CPU_H_

#include <cstdint>
#include <cstring>

namespace jax_flash_cpu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Subnormal or zero: mantissa * 2^-24 is exact in float and stays normal,
    // so this holds even if the process flushes float denormals.
    return bits_float(float_bits(static_cast<float>(mantissa) * 0x1p-24f) |
                      sign);
  }
  if (exponent == 0x1f) {
    return bits_float(sign | 0x7f800000u | (mantissa << 13));
  }
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t float_to_half(float f) {
  uint32_t x = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {  // inf stays inf, NaN stays a quiet NaN
    return sign | (x > 0x7f800000u ? 0x7e00u | ((x >> 13) & 0x3ffu) : 0x7c00u);
  }
  // 65520 is the midpoint between 65504 (odd mantissa) and 2^16: ties to inf.
  if (x >= 0x477ff000u) return sign | 0x7c00u;
  if (x >= 0x38800000u) {  // normal half: rebias the exponent, round the tail
    x += 0xc8000fffu + ((x >> 13) & 1u);
    return sign | static_cast<uint16_t>(x >> 13);
  }
  // 2^-25 is the midpoint between 0 and the smallest subnormal: ties to 0.
  if (x <= 0x33000000u) return sign;
  const uint32_t exponent = x >> 23;
  const uint32_t mantissa = (x & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exponent;  // 14..24 for this range
  uint32_t h = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

inline float bf16_to_float(uint16_t b) {
  return bits_float(static_cast<uint32_t>(b) << 16);
}

inline uint16_t float_to_bf16(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((x >> 16) | 0x40u);
  }
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

struct F16 {
  using Storage = uint16_t;
  static float load(Storage v) { return half_to_float(v); }
  static Storage store(float v) { return float_to_half(v); }
};
struct BF16 {
  using Storage = uint16_t;
  static float load(Storage v) { return bf16_to_float(v); }
  static Storage store(float v) { return float_to_bf16(v); }
};
struct F32 {
  using Storage = float;
  static float load(Storage v) { return v; }
  static Storage store(float v) { return v; }
};

// c ? a : b through bit masks. A plain ?: on floats is a branch to GCC's
// if-converter under the default -ftrapping-math, which stops loops over it
// from vectorising.
inline float select(bool c, float a, float b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return bits_float((float_bits(a) & mask) | (float_bits(b) & ~mask));
}

inline bool is_finite(float x) {
  return (float_bits(x) & 0x7f800000u) != 0x7f800000u;
}

// x unless x is NaN, else y; branch-free.
inline float nan_or(float x, float y) { return select(x != x, x, y); }

// 2^x for x that is not NaN, branch-free so loops over it vectorise: x = n +
// f with n = round(x) (from a truncating conversion, which no compiler flag
// folds away), then a degree-7 Taylor polynomial of 2^f for |f| <= 1/2
// (truncation error ~5e-9, below half an ulp). x <= -126.5 (including -inf)
// gives exactly 0, which is how masked and unseen scores vanish. A NaN gives
// 0 too: exp2_poly below is the version for scores that may be NaN.
inline float exp2_poly_not_nan(float x) {
  x = select(x > -127.0f, x, -127.0f);
  x = select(x < 127.0f, x, 127.0f);
  const int32_t biased = static_cast<int32_t>(x + 127.5f);  // round(x) + 127
  const float f = x - static_cast<float>(biased - 127);
  float p = 1.5252733804059841e-05f;  // ln2^7 / 7!
  p = p * f + 1.5403530393381609e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  return p * bits_float(static_cast<uint32_t>(biased) << 23);
}

// 2^x as exp2_poly_not_nan, and NaN for NaN, so that a NaN score reaches its
// row's sum and output.
inline float exp2_poly(float x) { return nan_or(x, exp2_poly_not_nan(x)); }

}  // namespace jax_flash_cpu

#endif  // JAX_FLASH_CPU_ATTENTION_CPU_H_
