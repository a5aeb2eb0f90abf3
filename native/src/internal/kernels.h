// Inner loops of the batch operations that are worth hand-shaping.
#ifndef PREFIXREC_INTERNAL_KERNELS_H_
#define PREFIXREC_INTERNAL_KERNELS_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace prefixrec::internal {

// dst[i * dim .. (i + 1) * dim) = rows[inverse[i] * dim ..] for i < count. Plain stores: streaming
// (non-temporal) stores were tried for big outputs and measured slower on the target VM.
inline void GatherRows(float* dst, const float* rows, const uint32_t* inverse, size_t count,
                       size_t dim) {
  for (size_t i = 0; i < count; ++i) {
    const float* src = rows + static_cast<size_t>(inverse[i]) * dim;
    float* to = dst + i * dim;
    for (size_t j = 0; j < dim; ++j) to[j] = src[j];  // inlined; memcpy is a call here
  }
}

// One Adagrad step on a row: acc += g * g; w -= lr * g / sqrt(acc). Square root and division
// are exact in IEEE arithmetic and FMA contraction is off, so every instruction set gives the same
// bits; on x86-64 an AVX2 copy (8 floats a step) is chosen at load time where the CPU has it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
__attribute__((target_clones("avx2", "default")))
#endif
inline void AdagradRow(float* w, float* acc, const float* g, size_t dim, float lr) {
  for (size_t j = 0; j < dim; ++j) {
    acc[j] += g[j] * g[j];
    w[j] -= lr * g[j] / std::sqrt(acc[j]);
  }
}

// True if no value is NaN or +-Inf (exponent bits all ones); branch-free so it vectorises.
inline bool AllFinite(const float* values, size_t n) {
  uint32_t bad = 0;
  for (size_t j = 0; j < n; ++j) {
    uint32_t bits;
    std::memcpy(&bits, values + j, sizeof(bits));
    bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_KERNELS_H_
