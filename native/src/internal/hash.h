// Integer mixing, counter-based random numbers and the file checksum used by the store.
#ifndef PREFIXREC_INTERNAL_HASH_H_
#define PREFIXREC_INTERNAL_HASH_H_

#include <cstdint>
#include <cstring>

namespace prefixrec::internal {

// splitmix64's finaliser: a bijection on 64 bits with full avalanche.
inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

inline uint64_t HashId(int64_t id) { return Mix64(static_cast<uint64_t>(id) + 0x9e3779b97f4a7c15ULL); }

// Uniform double in [0, 1) from 53 random bits.
inline double UnitDouble(uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

inline uint64_t RotateLeft(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// 64-bit streaming checksum over 32-byte blocks in four independent lanes (so it runs at memory
// speed), finished with a full avalanche. Detects corruption; it is not a cryptographic hash.
class Checksum {
 public:
  void Update(const void* data, size_t n) {
    if (n == 0) return;  // data may be null (an empty vector's data())
    const auto* p = static_cast<const uint8_t*>(data);
    total_ += n;
    if (tail_size_ > 0) {
      size_t take = n < kBlock - tail_size_ ? n : kBlock - tail_size_;
      std::memcpy(tail_ + tail_size_, p, take);
      tail_size_ += take;
      p += take;
      n -= take;
      if (tail_size_ < kBlock) return;
      Block(tail_);
      tail_size_ = 0;
    }
    while (n >= kBlock) {
      Block(p);
      p += kBlock;
      n -= kBlock;
    }
    if (n > 0) {
      std::memcpy(tail_, p, n);
      tail_size_ = n;
    }
  }

  uint64_t Digest() const {
    uint64_t h = RotateLeft(lane_[0], 1) + RotateLeft(lane_[1], 7) + RotateLeft(lane_[2], 12) +
                 RotateLeft(lane_[3], 18);
    h ^= total_ * kPrime2;
    for (size_t i = 0; i < tail_size_; ++i) h = Mix64(h ^ (uint64_t{tail_[i]} << ((i % 8) * 8)) ^ i);
    return Mix64(h);
  }

 private:
  static constexpr size_t kBlock = 32;
  static constexpr uint64_t kPrime1 = 0x9e3779b185ebca87ULL;
  static constexpr uint64_t kPrime2 = 0xc2b2ae3d27d4eb4fULL;

  void Block(const uint8_t* p) {
    for (int lane = 0; lane < 4; ++lane) {
      uint64_t word;
      std::memcpy(&word, p + lane * 8, 8);
      lane_[lane] = RotateLeft(lane_[lane] + word * kPrime2, 31) * kPrime1;
    }
  }

  uint64_t lane_[4] = {0x243f6a8885a308d3ULL, 0x13198a2e03707344ULL, 0xa4093822299f31d0ULL,
                       0x082efa98ec4e6c89ULL};
  uint8_t tail_[kBlock] = {};
  size_t tail_size_ = 0;
  uint64_t total_ = 0;
};

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_HASH_H_
