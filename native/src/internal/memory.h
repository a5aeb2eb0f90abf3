// Large heap blocks that Linux may back with transparent huge pages.
#ifndef PREFIXREC_INTERNAL_MEMORY_H_
#define PREFIXREC_INTERNAL_MEMORY_H_

#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace prefixrec::internal {

// Random access over gigabytes of rows is dominated by TLB misses with 4 KiB pages; blocks of
// 2 MiB or more are 2 MiB-aligned and marked MADV_HUGEPAGE (the common THP "madvise" setting).
// Untouched pages cost nothing.
class LargeBlock {
 public:
  static constexpr size_t kHugePage = size_t{2} << 20;

  LargeBlock() = default;
  explicit LargeBlock(size_t bytes) {
    if (bytes >= kHugePage) {
      size_ = (bytes + kHugePage - 1) & ~(kHugePage - 1);
#if defined(__linux__)
      // Mapped directly, not through malloc: freed memory goes back to the system at once
      // instead of staying in the (per-thread) malloc arena that happened to allocate it.
      size_t mapped = size_ + kHugePage;
      void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (raw == MAP_FAILED) throw std::bad_alloc();
      uintptr_t start = reinterpret_cast<uintptr_t>(raw);
      uintptr_t aligned = (start + kHugePage - 1) & ~(uintptr_t{kHugePage} - 1);
      if (aligned > start) munmap(raw, aligned - start);
      size_t tail = (start + mapped) - (aligned + size_);
      if (tail > 0) munmap(reinterpret_cast<void*>(aligned + size_), tail);
      data_ = reinterpret_cast<uint8_t*>(aligned);
      mapped_ = true;
#if defined(MADV_HUGEPAGE)
      madvise(data_, size_, MADV_HUGEPAGE);
#endif
#else
      data_ = static_cast<uint8_t*>(std::aligned_alloc(kHugePage, size_));
#endif
    } else {
      size_ = bytes;
      data_ = static_cast<uint8_t*>(std::malloc(bytes > 0 ? bytes : 1));
    }
    if (data_ == nullptr) throw std::bad_alloc();
  }
  ~LargeBlock() { Release(); }
  LargeBlock(LargeBlock&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        mapped_(std::exchange(other.mapped_, false)) {}
  LargeBlock& operator=(LargeBlock&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(mapped_, other.mapped_);
    return *this;
  }
  LargeBlock(const LargeBlock&) = delete;
  LargeBlock& operator=(const LargeBlock&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void Release() {
#if defined(__linux__)
    if (mapped_) {
      munmap(data_, size_);
      return;
    }
#endif
    std::free(data_);
  }

  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;
};

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_MEMORY_H_
