// Working memory of batch calls, kept between calls.
#ifndef PREFIXREC_INTERNAL_SCRATCH_H_
#define PREFIXREC_INTERNAL_SCRATCH_H_

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "internal/memory.h"

namespace prefixrec::internal {

// A batch call needs a few megabytes of temporary arrays (dedup tables, gathered rows, gradient
// sums). Fresh memory costs a page fault per 4 KiB on first touch, which took longer than the
// work itself, so the arrays of finished calls are kept and handed to the next call. Contents
// are not preserved; memory of 2 MiB or more is huge-page advised (see LargeBlock).
class ScratchSet {
 public:
  // Makes buffers 0 .. count-1 exist. Call before tasks use Get concurrently (with distinct
  // indices, which is then safe).
  void Reserve(size_t count) {
    if (blocks_.size() < count) blocks_.resize(count);
  }

  // Buffer `index` (< the reserved count) with room for at least `count` values of T,
  // uninitialised.
  template <typename T>
  T* Get(size_t index, size_t count) {
    LargeBlock& block = blocks_.at(index);
    const size_t bytes = std::max<size_t>(count * sizeof(T), 1);
    if (block.size() < bytes) {
      const size_t grown = std::max(bytes, block.size() + block.size() / 2);
      block = LargeBlock();  // free first: peak memory stays one copy
      block = LargeBlock(grown);
    }
    return reinterpret_cast<T*>(block.data());
  }

  size_t Bytes() const {
    size_t total = 0;
    for (const LargeBlock& block : blocks_) total += block.size();
    return total;
  }

 private:
  std::vector<LargeBlock> blocks_;
};

// Process-wide free list of ScratchSets. A lease takes one (or makes one) and gives it back when
// it ends; sets beyond kKeep or bigger than kMaxKeptBytes are freed instead of kept. The list's
// lock is only ever try-locked, so no call can wait on it (nor deadlock after fork()).
class ScratchLease {
 public:
  ScratchLease() {
    Pool& pool = Shared();
    std::unique_lock<std::mutex> lock(pool.mu, std::try_to_lock);
    if (lock.owns_lock() && !pool.free.empty()) {
      set_ = std::move(pool.free.back());
      pool.free.pop_back();
    }
    if (!set_) set_.reset(new ScratchSet());
  }
  ~ScratchLease() {
    if (set_->Bytes() > kMaxKeptBytes) return;
    Pool& pool = Shared();
    std::unique_lock<std::mutex> lock(pool.mu, std::try_to_lock);
    if (!lock.owns_lock() || pool.free.size() >= kKeep) return;
    try {
      pool.free.push_back(std::move(set_));
    } catch (...) {
      // out of memory: the set is simply freed
    }
  }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;

  ScratchSet& operator*() const { return *set_; }
  ScratchSet* operator->() const { return set_.get(); }

 private:
  static constexpr size_t kKeep = 4;
  static constexpr size_t kMaxKeptBytes = size_t{256} << 20;
  struct Pool {
    std::mutex mu;
    std::vector<std::unique_ptr<ScratchSet>> free;
  };
  static Pool& Shared() {
    static Pool* pool = new Pool();  // never destroyed: no destruction-order issues at exit
    return *pool;
  }
  std::unique_ptr<ScratchSet> set_;
};

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_SCRATCH_H_
