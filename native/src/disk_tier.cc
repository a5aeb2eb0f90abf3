// The disk tier's slot-file engine and the file helpers its engines share (internal/disk_tier.h).
#include "internal/disk_tier.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "internal/crash_point.h"
#include "internal/disk_tier_io.h"
#include "internal/hash.h"
#include "internal/shard.h"
#include "prefixrec/store_error.h"

namespace prefixrec::internal {

namespace disk_tier_io {

void Fail(const std::string& what, const std::string& path) {
  throw StoreError(ErrorCode::kIo, what + " " + path + ": " + std::strerror(errno));
}
void Corrupt(const std::string& what, const std::string& path) {
  throw StoreError(ErrorCode::kCorruptFile, "disk tier " + path + ": " + what);
}

void MakeDir(const std::string& dir) {
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) Fail("cannot create directory", dir);
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) Fail("cannot stat", dir);
  if (!S_ISDIR(st.st_mode)) {
    throw StoreError(ErrorCode::kInvalidArgument, "disk tier directory " + dir + " is not a directory");
  }
}

void RemoveIfExists(const std::string& path) {
  if (unlink(path.c_str()) != 0 && errno != ENOENT) Fail("cannot remove", path);
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

namespace {
// Moves past `done` bytes of the vector; returns the new start index.
int Advance(struct iovec* iov, int count, int start, size_t done) {
  while (start < count && done >= iov[start].iov_len) {
    done -= iov[start].iov_len;
    ++start;
  }
  if (start < count && done > 0) {
    iov[start].iov_base = static_cast<uint8_t*>(iov[start].iov_base) + done;
    iov[start].iov_len -= done;
  }
  return start;
}
}  // namespace

void ReadVec(int fd, uint64_t offset, struct iovec* iov, int count, const std::string& path) {
  int start = 0;
  while (start < count) {
    const int n = std::min(count - start, IOV_MAX);
    const ssize_t r = preadv(fd, iov + start, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      Fail("cannot read", path);
    }
    if (r == 0) Corrupt("ends before its last row (truncated)", path);
    offset += static_cast<uint64_t>(r);
    start = Advance(iov, count, start, static_cast<size_t>(r));
  }
}

void WriteVec(int fd, uint64_t offset, struct iovec* iov, int count, const std::string& path) {
  int start = 0;
  while (start < count) {
    const int n = std::min(count - start, IOV_MAX);
    const ssize_t r = pwritev(fd, iov + start, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      Fail("cannot write", path);
    }
    offset += static_cast<uint64_t>(r);
    start = Advance(iov, count, start, static_cast<size_t>(r));
  }
}

uint64_t FileChecksum(int fd, uint64_t bytes, const std::string& path) {
  Checksum checksum;
  std::vector<uint8_t> buffer(size_t{1} << 20);
  for (uint64_t at = 0; at < bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer.size(), bytes - at));
    struct iovec iov = {buffer.data(), n};
    ReadVec(fd, at, &iov, 1, path);
    checksum.Update(buffer.data(), n);
    at += n;
  }
  return checksum.Digest();
}

void ReplaceFile(const std::string& dir, const std::string& path, const std::vector<uint8_t>& bytes) {
  const std::string tmp = path + ".tmp";
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) Fail("cannot create", tmp);
  try {
    struct iovec iov = {const_cast<uint8_t*>(bytes.data()), bytes.size()};
    WriteVec(fd, 0, &iov, 1, tmp);
    if (fsync(fd) != 0) Fail("cannot fsync", tmp);
  } catch (...) {
    close(fd);
    throw;
  }
  if (close(fd) != 0) Fail("cannot close", tmp);
  if (rename(tmp.c_str(), path.c_str()) != 0) Fail("cannot rename to", path);
  int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) Fail("cannot open directory", dir);
  const int synced = fsync(dfd);
  close(dfd);
  if (synced != 0) Fail("cannot fsync directory", dir);
}

bool ReadSmallFile(const std::string& path, std::vector<uint8_t>* bytes) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return false;
    Fail("cannot open", path);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    Fail("cannot stat", path);
  }
  if (st.st_size > (int64_t{1} << 34)) {
    close(fd);
    Corrupt("is too large to be a disk tier's metadata", path);
  }
  bytes->assign(static_cast<size_t>(st.st_size), 0);
  try {
    struct iovec iov = {bytes->data(), bytes->size()};
    ReadVec(fd, 0, &iov, 1, path);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  return true;
}

uint64_t AllocatedBytes(int fd, const std::string& path) {
  struct stat st;
  if (fstat(fd, &st) != 0) Fail("cannot stat", path);
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

uint64_t FileSize(int fd, const std::string& path) {
  struct stat st;
  if (fstat(fd, &st) != 0) Fail("cannot stat", path);
  return static_cast<uint64_t>(st.st_size);
}

void CheckOptions(const std::string& dir, const DiskTierOptions& options) {
  if (dir.empty()) throw StoreError(ErrorCode::kInvalidArgument, "disk tier directory is empty");
  if (options.row_bytes < sizeof(RowHeader) || options.row_bytes % 4 != 0 ||
      options.row_bytes > (size_t{1} << 24)) {
    throw StoreError(ErrorCode::kInvalidArgument,
                     "disk tier row_bytes must be a multiple of 4 in [20, 2**24], got " +
                         std::to_string(options.row_bytes));
  }
  if (options.read_threads < 1 || options.read_threads > 64) {
    throw StoreError(ErrorCode::kInvalidArgument, "disk tier read_threads must be in [1, 64]");
  }
}

}  // namespace disk_tier_io

namespace {

using namespace disk_tier_io;

int64_t RowId(const uint8_t* row) {
  int64_t id;
  std::memcpy(&id, row, sizeof id);
  return id;
}

// Little-endian field writer / reader of the metadata file.
void Append64(std::vector<uint8_t>* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
uint64_t Load64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

constexpr uint64_t kSlotMagic = 0x31544c5354445250ULL;  // "PRDTSLT1"

class SlotFileTier final : public DiskTier {
 public:
  SlotFileTier(const std::string& dir, const DiskTierOptions& options)
      : DiskTier(options.row_bytes),
        dir_(dir),
        path_(dir + "/disk_tier.slots"),
        meta_path_(dir + "/disk_tier.meta"),
        options_(options) {}

  ~SlotFileTier() override {
    try {
      Close();
    } catch (...) {
    }
    if (fd_ >= 0) close(fd_);
  }

  void Open(DiskTierOpen mode) {
    MakeDir(dir_);
    if (mode == DiskTierOpen::kCreate) {
      RemoveIfExists(meta_path_);
      fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd_ < 0) Fail("cannot create", path_);
      Rehash(64);
      opened_ = true;
      return;
    }
    std::vector<uint8_t> meta;
    if (!ReadSmallFile(meta_path_, &meta)) Corrupt("was not closed cleanly (no disk_tier.meta)", dir_);
    if (meta.size() < 48) Corrupt("metadata is truncated", meta_path_);
    Checksum meta_sum;
    meta_sum.Update(meta.data(), meta.size() - 8);
    if (meta_sum.Digest() != Load64(meta.data() + meta.size() - 8)) Corrupt("metadata fails its checksum", meta_path_);
    if (Load64(meta.data()) != kSlotMagic) Corrupt("metadata has a wrong magic", meta_path_);
    if (Load64(meta.data() + 8) != row_bytes_) {
      throw StoreError(ErrorCode::kIncompatible, "disk tier " + dir_ + " holds rows of " +
                                                     std::to_string(Load64(meta.data() + 8)) + " bytes, not " +
                                                     std::to_string(row_bytes_));
    }
    const uint64_t slots = Load64(meta.data() + 16);
    const uint64_t holes = Load64(meta.data() + 24);
    const uint64_t data_sum = Load64(meta.data() + 32);
    if (holes > slots || slots >= (uint64_t{1} << 32) || meta.size() != 48 + holes * 4) {
      Corrupt("metadata has an inconsistent slot count", meta_path_);
    }
    fd_ = open(path_.c_str(), O_RDWR | O_CLOEXEC);
    if (fd_ < 0) {
      if (errno == ENOENT) Corrupt("has no disk_tier.slots", dir_);
      Fail("cannot open", path_);
    }
    if (FileSize(fd_, path_) != slots * row_bytes_) Corrupt("size does not match its metadata (truncated?)", path_);
    std::vector<bool> is_free(slots, false);
    free_.reserve(holes);
    for (uint64_t h = 0; h < holes; ++h) {
      uint32_t slot = 0;
      std::memcpy(&slot, meta.data() + 40 + h * 4, 4);  // written little-endian on this host
      if (slot >= slots || is_free[slot]) Corrupt("metadata lists a bad free slot", meta_path_);
      is_free[slot] = true;
      free_.push_back(slot);
    }
    slot_count_ = static_cast<uint32_t>(slots);
    Rehash(std::max<size_t>(64, static_cast<size_t>(static_cast<double>(slots - holes) / kMaxLoad) + 16));
    // One sequential pass: the checksum of the whole file and the index of its live slots.
    Checksum sum;
    const size_t batch = std::max<size_t>(1, (size_t{1} << 20) / row_bytes_);
    std::vector<uint8_t> buffer(batch * row_bytes_);
    for (uint64_t first = 0; first < slots; first += batch) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(batch, slots - first));
      struct iovec iov = {buffer.data(), n * row_bytes_};
      ReadVec(fd_, first * row_bytes_, &iov, 1, path_);
      sum.Update(buffer.data(), n * row_bytes_);
      for (size_t k = 0; k < n; ++k) {
        const uint32_t slot = static_cast<uint32_t>(first + k);
        if (is_free[slot]) continue;
        const int64_t id = RowId(buffer.data() + k * row_bytes_);
        if (FindPos(id, HashId(id)) != kNone) Corrupt("holds an id twice", path_);
        InsertIndex(id, slot);
      }
    }
    if (sum.Digest() != data_sum) Corrupt("fails its checksum", path_);
    // Open again: a crash from here on leaves no metadata, so it cannot be reopened as clean.
    RemoveIfExists(meta_path_);
    opened_ = true;
  }

  const char* name() const override { return "slotfile"; }

  void Put(const int64_t* ids, const uint8_t* rows, size_t n) override {
    CheckOpen();
    for (size_t i = 0; i < n; ++i) {
      if (RowId(rows + i * row_bytes_) != ids[i]) {
        throw StoreError(ErrorCode::kInvalidArgument,
                         "disk tier Put: row " + std::to_string(i) + " holds id " +
                             std::to_string(RowId(rows + i * row_bytes_)) + ", not " + std::to_string(ids[i]));
      }
    }
    if (size_ + n > kMaxRows) throw StoreError(ErrorCode::kInvalidArgument, "disk tier is full");
    std::vector<std::pair<uint32_t, uint32_t>> writes;  // (slot, batch index)
    writes.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t hash = HashId(ids[i]);
      size_t pos = FindPos(ids[i], hash);
      uint32_t slot;
      if (pos != kNone) {
        slot = slot_of_[pos];
      } else {
        slot = AllocSlot();
        InsertIndex(ids[i], slot);
      }
      writes.emplace_back(slot, static_cast<uint32_t>(i));
    }
    std::sort(writes.begin(), writes.end());
    // The later of two rows for one slot wins: drop every entry followed by one of its slot.
    size_t kept = 0;
    for (size_t k = 0; k < writes.size(); ++k) {
      if (k + 1 < writes.size() && writes[k + 1].first == writes[k].first) continue;
      writes[kept++] = writes[k];
    }
    writes.resize(kept);
    std::vector<struct iovec> iov;
    for (size_t k = 0; k < writes.size();) {
      size_t end = k + 1;
      while (end < writes.size() && writes[end].first == writes[end - 1].first + 1) ++end;
      iov.clear();
      for (size_t j = k; j < end; ++j) {
        iov.push_back({const_cast<uint8_t*>(rows + size_t{writes[j].second} * row_bytes_), row_bytes_});
      }
      WriteVec(fd_, uint64_t{writes[k].first} * row_bytes_, iov.data(), static_cast<int>(iov.size()), path_);
      k = end;
    }
    writes_ += writes.size();
    CrashPoint("tier.put.written");
    if (options_.sync_every_put) Sync();
  }

  size_t Get(const int64_t* ids, size_t n, uint8_t* out, uint8_t* found, bool take) override {
    CheckOpen();
    std::vector<std::pair<uint32_t, uint32_t>> reads;  // (slot, batch index)
    reads.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const size_t pos = FindPos(ids[i], HashId(ids[i]));
      found[i] = pos != kNone;
      if (pos != kNone) reads.emplace_back(slot_of_[pos], static_cast<uint32_t>(i));
    }
    std::sort(reads.begin(), reads.end());
    ReadSlots(reads, out);
    if (take) {
      for (const auto& read : reads) EraseId(ids[read.second]);
    }
    reads_ += reads.size();
    return reads.size();
  }

  size_t Erase(const int64_t* ids, size_t n) override {
    CheckOpen();
    size_t erased = 0;
    for (size_t i = 0; i < n; ++i) erased += EraseId(ids[i]);
    return erased;
  }

  bool Contains(int64_t id) const override {
    CheckOpen();
    return FindPos(id, HashId(id)) != kNone;
  }
  uint64_t Count() const override {
    CheckOpen();
    return size_;
  }
  uint64_t BytesOnDisk() const override { return fd_ < 0 ? 0 : AllocatedBytes(fd_, path_); }
  uint64_t IndexBytes() const override {
    return capacity_ * (sizeof(int64_t) + sizeof(uint32_t)) + free_.capacity() * sizeof(uint32_t);
  }

  uint64_t RowsRead() const override { return reads_; }
  uint64_t RowsWritten() const override { return writes_; }

  bool NeedsReclaim() const override {
    return static_cast<double>(slot_count_) > 1.25 * static_cast<double>(size_) + static_cast<double>(kSlotChunk);
  }

  DiskTierReclaim Reclaim(uint64_t max_rows) override {
    CheckOpen();
    DiskTierReclaim result;
    const uint64_t before = uint64_t{slot_count_} * row_bytes_;
    std::sort(free_.begin(), free_.end());
    // Holes free_[lo, hi_hole) below `end`; the slot end - 1 is the next one to move down.
    size_t lo = 0, hi_hole = free_.size();
    uint32_t end = slot_count_;
    std::vector<std::pair<uint32_t, uint32_t>> moves;  // (from, to)
    for (;;) {
      while (hi_hole > lo && free_[hi_hole - 1] == end - 1) {
        --hi_hole;
        --end;
      }
      if (hi_hole == lo || (max_rows != 0 && moves.size() >= max_rows)) break;
      moves.emplace_back(end - 1, free_[lo]);
      ++lo;
      --end;
    }
    // Moves in batches: read the rows of the tail (their ids are in their headers), write each
    // into its hole, then point the index at the hole.
    const size_t batch = 4096;
    std::vector<uint8_t> buffer(batch * row_bytes_);
    std::vector<std::pair<uint32_t, uint32_t>> part;
    for (size_t k = 0; k < moves.size(); k += batch) {
      const size_t n = std::min(batch, moves.size() - k);
      part.clear();
      for (size_t j = 0; j < n; ++j) part.emplace_back(moves[k + j].first, static_cast<uint32_t>(j));
      std::sort(part.begin(), part.end());
      ReadSlots(part, buffer.data());
      part.clear();
      for (size_t j = 0; j < n; ++j) part.emplace_back(moves[k + j].second, static_cast<uint32_t>(j));
      std::sort(part.begin(), part.end());
      std::vector<struct iovec> iov;
      for (size_t a = 0; a < part.size();) {
        size_t b = a + 1;
        while (b < part.size() && part[b].first == part[b - 1].first + 1) ++b;
        iov.clear();
        for (size_t j = a; j < b; ++j) iov.push_back({buffer.data() + size_t{part[j].second} * row_bytes_, row_bytes_});
        WriteVec(fd_, uint64_t{part[a].first} * row_bytes_, iov.data(), static_cast<int>(iov.size()), path_);
        a = b;
      }
      for (size_t j = 0; j < n; ++j) {
        const int64_t id = RowId(buffer.data() + j * row_bytes_);
        const size_t pos = FindPos(id, HashId(id));
        if (pos == kNone || slot_of_[pos] != moves[k + j].first) Corrupt("slot holds a row the index does not know", path_);
        slot_of_[pos] = moves[k + j].second;
      }
    }
    result.rows_moved = moves.size();
    reads_ += moves.size();
    writes_ += moves.size();
    // The holes still free: those below `end` that were not filled.
    std::vector<uint32_t> still(free_.begin() + static_cast<std::ptrdiff_t>(lo),
                                free_.begin() + static_cast<std::ptrdiff_t>(hi_hole));
    std::reverse(still.begin(), still.end());  // AllocSlot pops the lowest first
    free_.swap(still);
    free_.shrink_to_fit();
    CrashPoint("tier.reclaim.moved");
    if (end != slot_count_) {
      if (ftruncate(fd_, static_cast<off_t>(uint64_t{end} * row_bytes_)) != 0) Fail("cannot truncate", path_);
      slot_count_ = end;
    }
    result.bytes_freed = before - uint64_t{slot_count_} * row_bytes_;
    return result;
  }

  void Sync() override {
    CheckOpen();
    if (fdatasync(fd_) != 0) Fail("cannot fdatasync", path_);
  }

  void ForEach(size_t batch_rows, const std::function<void(const uint8_t*, size_t)>& visit) const override {
    CheckOpen();
    // Buffers of at most the file's slots, not zero-filled: a block of 64k rows asked of a
    // shard's small tier made every save and export clear ~20 MB a shard.
    batch_rows = static_cast<size_t>(std::clamp<uint64_t>(batch_rows, 1, std::max<uint64_t>(slot_count_, 1)));
    std::unique_ptr<uint8_t[]> buffer(new uint8_t[batch_rows * row_bytes_]);
    std::unique_ptr<uint8_t[]> live(new uint8_t[batch_rows * row_bytes_]);
    for (uint64_t first = 0; first < slot_count_; first += batch_rows) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(batch_rows, slot_count_ - first));
      struct iovec iov = {buffer.get(), n * row_bytes_};
      ReadVec(fd_, first * row_bytes_, &iov, 1, path_);
      size_t k = 0;
      for (size_t j = 0; j < n; ++j) {
        const uint8_t* row = buffer.get() + j * row_bytes_;
        const int64_t id = RowId(row);
        const size_t pos = FindPos(id, HashId(id));
        // A free slot keeps the bytes of a row that left: live only if the index points here.
        if (pos == kNone || slot_of_[pos] != first + j) continue;
        std::memcpy(live.get() + k * row_bytes_, row, row_bytes_);
        ++k;
      }
      reads_ += k;
      if (k > 0) visit(live.get(), k);
    }
  }

  void Close() override {
    if (fd_ < 0 || closed_ || !opened_) return;  // a failed Open leaves the directory as it was
    Sync();
    std::vector<uint8_t> meta;
    Append64(&meta, kSlotMagic);
    Append64(&meta, row_bytes_);
    Append64(&meta, slot_count_);
    Append64(&meta, free_.size());
    Append64(&meta, FileChecksum(fd_, uint64_t{slot_count_} * row_bytes_, path_));
    for (uint32_t slot : free_) {
      uint8_t bytes[4];
      std::memcpy(bytes, &slot, 4);
      meta.insert(meta.end(), bytes, bytes + 4);
    }
    Checksum sum;
    sum.Update(meta.data(), meta.size());
    Append64(&meta, sum.Digest());
    ReplaceFile(dir_, meta_path_, meta);
    closed_ = true;
    close(fd_);
    fd_ = -1;
  }

 private:
  static constexpr size_t kNone = ~size_t{0};
  static constexpr uint32_t kEmptySlot = 0xffffffffu;
  static constexpr double kMaxLoad = 0.85;
  static constexpr size_t kMaxRows = (size_t{1} << 32) - 2;

  void CheckOpen() const {
    if (fd_ < 0 || closed_ || !opened_) throw StoreError(ErrorCode::kInvalidArgument, "disk tier " + dir_ + " is closed");
  }

  // The low 32 bits of the hash: the store picks a row's shard, and so its tier, by the high
  // bits, so within one tier those bits are nearly equal (16 shards: the top 4 are the same)
  // and would crowd every id into one part of the table.
  static size_t HomeIn(uint64_t hash, size_t capacity) {
    return static_cast<size_t>(((hash & 0xffffffffULL) * static_cast<uint64_t>(capacity)) >> 32);
  }
  size_t Home(uint64_t hash) const { return HomeIn(hash, capacity_); }
  size_t Next(size_t i) const { return i + 1 == capacity_ ? 0 : i + 1; }

  size_t FindPos(int64_t id, uint64_t hash) const {
    if (capacity_ == 0) return kNone;
    for (size_t i = Home(hash);; i = Next(i)) {
      if (slot_of_[i] == kEmptySlot) return kNone;
      if (id_of_[i] == id) return i;
    }
  }

  void InsertIndex(int64_t id, uint32_t slot) {
    if (static_cast<double>(size_ + 1) > kMaxLoad * static_cast<double>(capacity_)) {
      Rehash(std::max<size_t>(capacity_ + 64, capacity_ + capacity_ / 4));
    }
    size_t i = Home(HashId(id));
    while (slot_of_[i] != kEmptySlot) i = Next(i);
    id_of_[i] = id;
    slot_of_[i] = slot;
    ++size_;
  }

  void Rehash(size_t capacity) {
    if (capacity >= (size_t{1} << 32)) throw StoreError(ErrorCode::kInvalidArgument, "disk tier is full");
    std::vector<int64_t> ids(capacity);
    std::vector<uint32_t> slots(capacity, kEmptySlot);
    for (size_t j = 0; j < capacity_; ++j) {
      if (slot_of_[j] == kEmptySlot) continue;
      size_t i = HomeIn(HashId(id_of_[j]), capacity);
      while (slots[i] != kEmptySlot) i = i + 1 == capacity ? 0 : i + 1;
      ids[i] = id_of_[j];
      slots[i] = slot_of_[j];
    }
    id_of_.swap(ids);
    slot_of_.swap(slots);
    capacity_ = capacity;
  }

  // Removes `id` from the index (backward-shift deletion) and frees its slot; 1 if it was there.
  size_t EraseId(int64_t id) {
    size_t hole = FindPos(id, HashId(id));
    if (hole == kNone) return 0;
    free_.push_back(slot_of_[hole]);
    for (size_t j = Next(hole); slot_of_[j] != kEmptySlot; j = Next(j)) {
      const size_t home = Home(HashId(id_of_[j]));
      const size_t from_home = j >= home ? j - home : j + capacity_ - home;
      const size_t from_hole = j >= hole ? j - hole : j + capacity_ - hole;
      if (from_home >= from_hole) {
        id_of_[hole] = id_of_[j];
        slot_of_[hole] = slot_of_[j];
        hole = j;
      }
    }
    slot_of_[hole] = kEmptySlot;
    --size_;
    return 1;
  }

  uint32_t AllocSlot() {
    if (!free_.empty()) {
      const uint32_t slot = free_.back();
      free_.pop_back();
      return slot;
    }
    return slot_count_++;
  }

  // Reads the slots of `reads` (sorted by slot) into out + index * row_bytes, adjacent slots in
  // one preadv, split over up to read_threads threads.
  void ReadSlots(const std::vector<std::pair<uint32_t, uint32_t>>& reads, uint8_t* out) const {
    auto run = [&](size_t from, size_t to) {
      std::vector<struct iovec> iov;
      for (size_t k = from; k < to;) {
        size_t end = k + 1;
        while (end < to && reads[end].first == reads[end - 1].first + 1) ++end;
        iov.clear();
        for (size_t j = k; j < end; ++j) iov.push_back({out + size_t{reads[j].second} * row_bytes_, row_bytes_});
        ReadVec(fd_, uint64_t{reads[k].first} * row_bytes_, iov.data(), static_cast<int>(iov.size()), path_);
        k = end;
      }
    };
    const size_t threads = std::min<size_t>(static_cast<size_t>(options_.read_threads), reads.size() / 64 + 1);
    if (threads <= 1) {
      run(0, reads.size());
      return;
    }
    std::vector<std::thread> pool;
    std::vector<std::exception_ptr> errors(threads);
    for (size_t t = 0; t < threads; ++t) {
      const size_t from = reads.size() * t / threads, to = reads.size() * (t + 1) / threads;
      pool.emplace_back([&, t, from, to] {
        try {
          run(from, to);
        } catch (...) {
          errors[t] = std::current_exception();
        }
      });
    }
    for (auto& thread : pool) thread.join();
    for (auto& error : errors) {
      if (error) std::rethrow_exception(error);
    }
  }

  std::string dir_, path_, meta_path_;
  DiskTierOptions options_;
  int fd_ = -1;
  bool opened_ = false;
  bool closed_ = false;
  uint32_t slot_count_ = 0;        // slots in the file (live + free)
  std::vector<uint32_t> free_;     // free slots below slot_count_; AllocSlot takes from the back
  std::vector<int64_t> id_of_;     // index: id of each entry
  std::vector<uint32_t> slot_of_;  // index: slot of each entry, kEmptySlot if the entry is empty
  size_t capacity_ = 0;
  size_t size_ = 0;
  mutable uint64_t reads_ = 0;  // ForEach (const) counts its reads too
  uint64_t writes_ = 0;
};

}  // namespace

std::unique_ptr<DiskTier> OpenSlotFileTier(const std::string& dir, const DiskTierOptions& options,
                                           DiskTierOpen mode) {
  CheckOptions(dir, options);
  auto tier = std::make_unique<SlotFileTier>(dir, options);
  tier->Open(mode);
  return tier;
}

}  // namespace prefixrec::internal
