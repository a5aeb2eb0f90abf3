// Large heap blocks that Linux may back with transparent huge pages.
#ifndef PREFIXREC_INTERNAL_MEMORY_H_
#define PREFIXREC_INTERNAL_MEMORY_H_

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace prefixrec::internal {

// Random access over gigabytes of rows is dominated by TLB misses with 4 KiB pages; blocks of
// 2 MiB or more are 2 MiB-aligned and marked MADV_HUGEPAGE (the common THP "madvise" setting),
// so every whole 2 MiB of them can be one huge page.
// Untouched pages cost nothing.
class LargeBlock {
 public:
  static constexpr size_t kHugePage = size_t{2} << 20;
  static constexpr size_t kSmallPage = size_t{4} << 10;

  LargeBlock() = default;
  explicit LargeBlock(size_t bytes) {
    if (bytes >= kHugePage) {
      // Rounded to 4 KiB, not 2 MiB: the kernel backs the whole 2 MiB pages of the range with
      // huge pages and the tail with small ones, and a 3 MiB hash table takes 3 MiB, not 4.
      size_ = (bytes + kSmallPage - 1) & ~(kSmallPage - 1);
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
      size_ = (bytes + kHugePage - 1) & ~(kHugePage - 1);  // aligned_alloc needs a multiple
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

  // Grows or shrinks a block of less than 2 MiB in place or by realloc (which moves big blocks
  // by remapping their pages, without copying). False, with the block unchanged, for blocks of
  // 2 MiB or more on either side (those are huge-page mapped) or when realloc fails.
  bool Resize(size_t bytes) {
    if (mapped_ || size_ >= kHugePage || bytes >= kHugePage || bytes == 0) return false;
    void* grown = std::realloc(data_, bytes);
    if (grown == nullptr) return false;
    data_ = static_cast<uint8_t*>(grown);
    size_ = bytes;
    return true;
  }

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

// A few recently freed large blocks, kept for the next output of a similar size. Lookup outputs
// are fresh arrays of megabytes that the caller drops after one use; mapping and faulting in new
// pages for each (the kernel zeroes every page) cost ~0.3 ms per MiB, as much as the lookup
// itself at dim 64. General-purpose allocators keep such blocks too (glibc raises its mmap
// threshold after a free). Contents of a reused block are stale: callers overwrite all of it.
// The lock is only try-locked, so no caller ever waits (nor deadlocks after fork()).
class BlockCache {
 public:
  // A block of at least `bytes` (for 2 MiB or more, a cached one when one fits without wasting
  // more than half of it).
  static LargeBlock Take(size_t bytes) {
    Cache& cache = Shared();
    if (bytes >= LargeBlock::kHugePage) {
      std::unique_lock<std::mutex> lock(cache.mu, std::try_to_lock);
      if (lock.owns_lock()) {
        size_t best = cache.blocks.size();
        for (size_t i = 0; i < cache.blocks.size(); ++i) {
          const size_t size = cache.blocks[i].size();
          if (size >= bytes && size <= 2 * bytes + LargeBlock::kHugePage &&
              (best == cache.blocks.size() || size < cache.blocks[best].size())) {
            best = i;
          }
        }
        if (best != cache.blocks.size()) {
          LargeBlock block = std::move(cache.blocks[best]);
          cache.blocks.erase(cache.blocks.begin() + static_cast<std::ptrdiff_t>(best));
          cache.bytes -= block.size();
          return block;
        }
      }
    }
    return LargeBlock(bytes);
  }

  // Keeps `block` for a later Take, or frees it (cache full, or busy).
  static void Give(LargeBlock&& block) {
    if (block.size() < LargeBlock::kHugePage || block.size() > kMaxBytes) return;
    Cache& cache = Shared();
    std::unique_lock<std::mutex> lock(cache.mu, std::try_to_lock);
    if (!lock.owns_lock()) return;
    while (!cache.blocks.empty() &&
           (cache.blocks.size() >= kKeep || cache.bytes + block.size() > kMaxBytes)) {
      cache.bytes -= cache.blocks.front().size();  // oldest out
      cache.blocks.erase(cache.blocks.begin());
    }
    try {
      cache.blocks.push_back(std::move(block));
      cache.bytes += cache.blocks.back().size();
    } catch (...) {
      // out of memory: the block is simply freed
    }
  }

 private:
  static constexpr size_t kKeep = 4;
  static constexpr size_t kMaxBytes = size_t{128} << 20;
  struct Cache {
    std::mutex mu;
    std::vector<LargeBlock> blocks;
    size_t bytes = 0;
  };
  static Cache& Shared() {
    static Cache* cache = new Cache();  // never destroyed: no destruction-order issues at exit
    return *cache;
  }
};

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_MEMORY_H_
