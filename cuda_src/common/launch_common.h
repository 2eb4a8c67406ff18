// Host-side pieces that every kernel family's launch.cc needs the same way:
// error reporting through the C ABI's err buffer, the per-device compute
// capability, and loading each exported CuTe DSL module once per process.
//
// Include this before the generated variants headers: it defines
// CUTE_DSL_CUDA_ERROR_CHECK, which those headers use in their module loaders.

#ifndef JAX_FLASH_COMMON_LAUNCH_COMMON_H_
#define JAX_FLASH_COMMON_LAUNCH_COMMON_H_

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <mutex>

#include "jax_flash/kernel_api.h"

namespace jax_flash_launch {

// Writes the message into err (when there is room) and returns the C ABI's
// failure code, so that a check can `return Fail(...)`.
inline int Fail(char* err, size_t err_len, const char* fmt, ...) {
  if (err != nullptr && err_len > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
  }
  return 1;
}

inline bool IsAligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// The generated module loaders report each CUDA call's status through
// CUTE_DSL_CUDA_ERROR_CHECK; by default that prints and carries on. Keep the
// first failure instead, so the launcher can return it as an error message.
inline thread_local cudaError_t g_module_load_error = cudaSuccess;
inline void RecordLoadError(cudaError_t err) {
  if (err != cudaSuccess && g_module_load_error == cudaSuccess) g_module_load_error = err;
}

// A device's attributes never change, so each process asks once per device
// and attribute; later launches read a relaxed atomic instead of calling the
// runtime. Devices past kMaxCachedDevices are simply asked every time.
constexpr int kMaxCachedDevices = 64;

template <cudaDeviceAttr kAttribute>
inline cudaError_t CachedDeviceAttribute(int device, int* value) {
  static std::atomic<int> cache[kMaxCachedDevices];  // 0: not asked yet
  const bool cacheable = device >= 0 && device < kMaxCachedDevices;
  if (cacheable) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached != 0) {
      *value = cached;
      return cudaSuccess;
    }
  }
  cudaError_t e = cudaDeviceGetAttribute(value, kAttribute, device);
  if (e == cudaSuccess && cacheable) cache[device].store(*value, std::memory_order_relaxed);
  return e;
}

inline cudaError_t ComputeCapabilityMajor(int device, int* major) {
  return CachedDeviceAttribute<cudaDevAttrComputeCapabilityMajor>(device, major);
}

// One exported variant: its module is loaded on first use, once per process,
// and a failed load stays failed (every later launch reports the same error).
template <typename Module>
struct LoadedModule {
  std::once_flag once;
  Module module{};
  cudaError_t status = cudaSuccess;
};

template <typename Module, typename LoadFn>
cudaError_t EnsureLoaded(LoadedModule<Module>& m, LoadFn load) {
  std::call_once(m.once, [&] {
    // Clear an error left by unrelated earlier work, so that it is not
    // mistaken for (and cached as) this module's load failure.
    cudaGetLastError();
    g_module_load_error = cudaSuccess;
    load(&m.module);
    m.status = g_module_load_error;
    if (m.status == cudaSuccess) m.status = cudaGetLastError();
  });
  return m.status;
}

// The options every entry point checks: softcap finite and >= 0 (0: off),
// deterministic 0 or 1.
inline int CheckOptions(const JfProblem& p, const char* who, char* err, size_t err_len) {
  if (!(p.softcap >= 0.0f) || p.softcap == INFINITY)
    return Fail(err, err_len, "%s: softcap must be finite and >= 0, got %g", who, double(p.softcap));
  if (p.deterministic != 0 && p.deterministic != 1)
    return Fail(err, err_len, "%s: deterministic must be 0 or 1, got %d", who, p.deterministic);
  return 0;
}

}  // namespace jax_flash_launch

#define CUTE_DSL_CUDA_ERROR_CHECK(err) ::jax_flash_launch::RecordLoadError(err)

#endif  // JAX_FLASH_COMMON_LAUNCH_COMMON_H_
