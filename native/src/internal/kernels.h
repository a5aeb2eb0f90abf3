// Inner loops of the batch operations that are worth hand-shaping.
#ifndef PREFIXREC_INTERNAL_KERNELS_H_
#define PREFIXREC_INTERNAL_KERNELS_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace prefixrec::internal {

// dst[0 .. dim) = src[0 .. dim): a fixed-size copy for common small dims.
inline void CopyRow(float* dst, const float* src, size_t dim) {
  switch (dim) {
    case 4: std::memcpy(dst, src, 4 * sizeof(float)); return;
    case 8: std::memcpy(dst, src, 8 * sizeof(float)); return;
    case 16: std::memcpy(dst, src, 16 * sizeof(float)); return;
    case 18: std::memcpy(dst, src, 18 * sizeof(float)); return;
    case 32: std::memcpy(dst, src, 32 * sizeof(float)); return;
    default: break;
  }
  for (size_t j = 0; j < dim; ++j) dst[j] = src[j];  // inlined; memcpy is a call here
}

template <size_t kDim>
inline void GatherRowsOf(float* dst, const float* rows, const uint32_t* inverse, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    std::memcpy(dst + i * kDim, rows + static_cast<size_t>(inverse[i]) * kDim, kDim * sizeof(float));
  }
}

// dst[i * dim .. (i + 1) * dim) = rows[inverse[i] * dim ..] for i < count. Plain stores: streaming
// (non-temporal) stores were tried for big outputs and measured slower on the target VM. Common
// small dims get a copy of fixed size (a few vector moves, no loop).
inline void GatherRows(float* dst, const float* rows, const uint32_t* inverse, size_t count,
                       size_t dim) {
  switch (dim) {
    case 4: return GatherRowsOf<4>(dst, rows, inverse, count);
    case 8: return GatherRowsOf<8>(dst, rows, inverse, count);
    case 16: return GatherRowsOf<16>(dst, rows, inverse, count);
    case 18: return GatherRowsOf<18>(dst, rows, inverse, count);
    case 32: return GatherRowsOf<32>(dst, rows, inverse, count);
    default: break;
  }
  for (size_t i = 0; i < count; ++i) {
    const float* src = rows + static_cast<size_t>(inverse[i]) * dim;
    float* to = dst + i * dim;
    for (size_t j = 0; j < dim; ++j) to[j] = src[j];  // inlined; memcpy is a call here
  }
}

// One Adagrad step on a row: acc += g * g; w -= lr * g / sqrt(acc). Square root and division
// are exact in IEEE arithmetic and FMA contraction is off, so every instruction set gives the same
// bits; on x86-64 an AVX-512 (16 floats a step) or AVX2 (8) copy is chosen at load time where the
// CPU has it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
__attribute__((target_clones("avx512f", "avx2", "default")))
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

// out[index[i] * dim ..] += values[i * dim ..] for i < n (every index already checked to be in
// range): the per-row gradient of a gather, summed over the occurrences of each row.
template <typename Index>
inline void AddRowsAt(float* out, const float* values, const Index* index, size_t n, size_t dim) {
  for (size_t i = 0; i < n; ++i) {
    float* dst = out + static_cast<size_t>(index[i]) * dim;
    const float* src = values + i * dim;
    for (size_t j = 0; j < dim; ++j) dst[j] += src[j];
  }
}

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_KERNELS_H_
