// The disk tier on LMDB (internal/disk_tier.h), kept beside the slot file for the C++ tests and
// the engine benchmark (benchmarks/disk_tier_bench.cc). Compiled to nothing unless
// PREFIXREC_DISK_TIER_LMDB is defined: the Python extension neither builds nor links it.
#if defined(PREFIXREC_DISK_TIER_LMDB)

#include <fcntl.h>
#include <lmdb.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <vector>

#include "internal/disk_tier.h"
#include "internal/disk_tier_io.h"
#include "internal/hash.h"
#include "prefixrec/store_error.h"

namespace prefixrec::internal {
namespace {

using namespace disk_tier_io;

constexpr uint64_t kLmdbMagic = 0x31424d4c54445250ULL;  // "PRDTLMB1"

void Check(int rc, const char* what, const std::string& dir) {
  if (rc == MDB_SUCCESS) return;
  const ErrorCode code = (rc == MDB_CORRUPTED || rc == MDB_INVALID || rc == MDB_VERSION_MISMATCH ||
                          rc == MDB_PAGE_NOTFOUND)
                             ? ErrorCode::kCorruptFile
                             : ErrorCode::kIo;
  throw StoreError(code, std::string("disk tier (lmdb) ") + dir + ": " + what + ": " + mdb_strerror(rc));
}

// A transaction aborted unless committed.
class Txn {
 public:
  Txn(MDB_env* env, bool read_only, const std::string& dir) : dir_(dir) {
    Check(mdb_txn_begin(env, nullptr, read_only ? MDB_RDONLY : 0, &txn_), "cannot begin a transaction", dir);
  }
  ~Txn() {
    if (txn_ != nullptr) mdb_txn_abort(txn_);
  }
  void Commit() {
    MDB_txn* txn = txn_;
    txn_ = nullptr;
    Check(mdb_txn_commit(txn), "cannot commit", dir_);
  }
  MDB_txn* get() const { return txn_; }

 private:
  MDB_txn* txn_ = nullptr;
  const std::string& dir_;
};

class LmdbTier final : public DiskTier {
 public:
  LmdbTier(const std::string& dir, const DiskTierOptions& options)
      : DiskTier(options.row_bytes),
        dir_(dir),
        data_path_(dir + "/data.mdb"),
        marker_path_(dir + "/disk_tier.lmdb.meta"),
        options_(options) {}

  ~LmdbTier() override {
    try {
      Close();
    } catch (...) {
    }
    if (env_ != nullptr) mdb_env_close(env_);
  }

  void Open(DiskTierOpen mode) {
    MakeDir(dir_);
    if (mode == DiskTierOpen::kCreate) {
      RemoveIfExists(marker_path_);
      RemoveIfExists(data_path_);
      RemoveIfExists(dir_ + "/lock.mdb");
    } else {
      // LMDB maps its file: a truncated or damaged one would fault, not fail. The marker written
      // by Close holds the file's size and checksum, checked before LMDB sees the file.
      std::vector<uint8_t> marker;
      if (!ReadSmallFile(marker_path_, &marker)) Corrupt("was not closed cleanly (no disk_tier.lmdb.meta)", dir_);
      uint64_t fields[5] = {};
      if (marker.size() != sizeof fields) Corrupt("metadata is truncated", marker_path_);
      std::memcpy(fields, marker.data(), sizeof fields);
      Checksum sum;
      sum.Update(fields, 4 * sizeof(uint64_t));
      if (fields[0] != kLmdbMagic || sum.Digest() != fields[4]) Corrupt("metadata fails its checksum", marker_path_);
      if (fields[1] != row_bytes_) {
        throw StoreError(ErrorCode::kIncompatible, "disk tier " + dir_ + " holds rows of another size");
      }
      int fd = open(data_path_.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        if (errno == ENOENT) Corrupt("has no data.mdb", dir_);
        Fail("cannot open", data_path_);
      }
      try {
        if (FileSize(fd, data_path_) != fields[2]) Corrupt("size does not match its metadata (truncated?)", data_path_);
        if (FileChecksum(fd, fields[2], data_path_) != fields[3]) Corrupt("fails its checksum", data_path_);
      } catch (...) {
        close(fd);
        throw;
      }
      close(fd);
    }
    OpenEnv();
    if (mode == DiskTierOpen::kReopen) RemoveIfExists(marker_path_);
    opened_ = true;
  }

  const char* name() const override { return "lmdb"; }

  void Put(const int64_t* ids, const uint8_t* rows, size_t n) override {
    CheckOpen();
    for (size_t i = 0; i < n; ++i) {
      int64_t id;
      std::memcpy(&id, rows + i * row_bytes_, sizeof id);
      if (id != ids[i]) throw StoreError(ErrorCode::kInvalidArgument, "disk tier Put: a row's id is not its id");
    }
    std::vector<uint32_t> order = SortedOrder(ids, n);  // stable: the later row of an id wins
    Txn txn(env_, false, dir_);
    for (uint32_t i : order) {
      uint64_t key = static_cast<uint64_t>(ids[i]);
      MDB_val k{sizeof key, &key}, v{row_bytes_, const_cast<uint8_t*>(rows + size_t{i} * row_bytes_)};
      Check(mdb_put(txn.get(), dbi_, &k, &v, 0), "cannot put", dir_);
    }
    txn.Commit();
  }

  size_t Get(const int64_t* ids, size_t n, uint8_t* out, uint8_t* found, bool take) override {
    CheckOpen();
    std::vector<uint32_t> order = SortedOrder(ids, n);
    Txn txn(env_, !take, dir_);
    size_t hits = 0;
    for (uint32_t i : order) {
      uint64_t key = static_cast<uint64_t>(ids[i]);
      MDB_val k{sizeof key, &key}, v;
      const int rc = mdb_get(txn.get(), dbi_, &k, &v);
      found[i] = rc == MDB_SUCCESS;
      if (rc == MDB_NOTFOUND) continue;
      Check(rc, "cannot get", dir_);
      if (v.mv_size != row_bytes_) Corrupt("holds a row of the wrong size", data_path_);
      std::memcpy(out + size_t{i} * row_bytes_, v.mv_data, row_bytes_);
      ++hits;
    }
    if (take) {
      for (uint32_t i : order) {
        if (!found[i]) continue;
        uint64_t key = static_cast<uint64_t>(ids[i]);
        MDB_val k{sizeof key, &key};
        const int rc = mdb_del(txn.get(), dbi_, &k, nullptr);
        if (rc != MDB_NOTFOUND) Check(rc, "cannot delete", dir_);  // NOTFOUND: an id asked twice
      }
      txn.Commit();
    }
    return hits;
  }

  size_t Erase(const int64_t* ids, size_t n) override {
    CheckOpen();
    std::vector<uint32_t> order = SortedOrder(ids, n);
    Txn txn(env_, false, dir_);
    size_t erased = 0;
    for (uint32_t i : order) {
      uint64_t key = static_cast<uint64_t>(ids[i]);
      MDB_val k{sizeof key, &key};
      const int rc = mdb_del(txn.get(), dbi_, &k, nullptr);
      if (rc == MDB_NOTFOUND) continue;
      Check(rc, "cannot delete", dir_);
      ++erased;
    }
    txn.Commit();
    return erased;
  }

  bool Contains(int64_t id) const override {
    CheckOpen();
    Txn txn(env_, true, dir_);
    uint64_t key = static_cast<uint64_t>(id);
    MDB_val k{sizeof key, &key}, v;
    const int rc = mdb_get(txn.get(), dbi_, &k, &v);
    if (rc == MDB_NOTFOUND) return false;
    Check(rc, "cannot get", dir_);
    return true;
  }

  uint64_t Count() const override {
    CheckOpen();
    Txn txn(env_, true, dir_);
    MDB_stat stat;
    Check(mdb_stat(txn.get(), dbi_, &stat), "cannot stat", dir_);
    return stat.ms_entries;
  }

  uint64_t BytesOnDisk() const override {
    struct stat st;
    if (stat(data_path_.c_str(), &st) != 0) Fail("cannot stat", data_path_);
    return static_cast<uint64_t>(st.st_blocks) * 512;
  }
  uint64_t IndexBytes() const override { return 0; }
  uint64_t RowsRead() const override { return 0; }     // not counted: a comparison engine
  uint64_t RowsWritten() const override { return 0; }  // the B+tree's pages are the file's (page cache)

  bool NeedsReclaim() const override {
    return static_cast<double>(BytesOnDisk()) >
           2.0 * static_cast<double>(Count() * (row_bytes_ + 16)) + static_cast<double>(16 << 20);
  }

  // Compacts the whole file (max_rows is not honoured: LMDB copies the tree in one go).
  DiskTierReclaim Reclaim(uint64_t /*max_rows*/) override {
    CheckOpen();
    const uint64_t before = BytesOnDisk();
    const uint64_t rows = Count();
    const std::string copy_dir = dir_ + "/compact.tmp";
    MakeDir(copy_dir);
    RemoveIfExists(copy_dir + "/data.mdb");
    RemoveIfExists(copy_dir + "/lock.mdb");
    Check(mdb_env_copy2(env_, copy_dir.c_str(), MDB_CP_COMPACT), "cannot compact", dir_);
    mdb_env_close(env_);
    env_ = nullptr;
    if (rename((copy_dir + "/data.mdb").c_str(), data_path_.c_str()) != 0) Fail("cannot rename to", data_path_);
    RemoveIfExists(copy_dir + "/lock.mdb");
    rmdir(copy_dir.c_str());
    OpenEnv();
    DiskTierReclaim result;
    result.rows_moved = rows;
    const uint64_t after = BytesOnDisk();
    result.bytes_freed = before > after ? before - after : 0;
    return result;
  }

  void Sync() override {
    CheckOpen();
    Check(mdb_env_sync(env_, 1), "cannot sync", dir_);
  }

  void ForEach(size_t batch_rows, const std::function<void(const uint8_t*, size_t)>& visit) const override {
    CheckOpen();
    batch_rows = std::max<size_t>(1, batch_rows);
    std::vector<uint8_t> buffer(batch_rows * row_bytes_);
    Txn txn(env_, true, dir_);
    MDB_cursor* cursor = nullptr;
    Check(mdb_cursor_open(txn.get(), dbi_, &cursor), "cannot open a cursor", dir_);
    size_t k = 0;
    try {
      MDB_val key, value;
      for (int rc = mdb_cursor_get(cursor, &key, &value, MDB_FIRST); rc != MDB_NOTFOUND;
           rc = mdb_cursor_get(cursor, &key, &value, MDB_NEXT)) {
        Check(rc, "cannot read", dir_);
        if (value.mv_size != row_bytes_) Corrupt("holds a row of the wrong size", data_path_);
        std::memcpy(buffer.data() + k * row_bytes_, value.mv_data, row_bytes_);
        if (++k == batch_rows) {
          visit(buffer.data(), k);
          k = 0;
        }
      }
      if (k > 0) visit(buffer.data(), k);
    } catch (...) {
      mdb_cursor_close(cursor);
      throw;
    }
    mdb_cursor_close(cursor);
  }

  void Close() override {
    if (env_ == nullptr || closed_ || !opened_) return;
    Sync();
    mdb_env_close(env_);
    env_ = nullptr;
    closed_ = true;
    int fd = open(data_path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) Fail("cannot open", data_path_);
    uint64_t fields[5] = {kLmdbMagic, row_bytes_, 0, 0, 0};
    try {
      fields[2] = FileSize(fd, data_path_);
      fields[3] = FileChecksum(fd, fields[2], data_path_);
    } catch (...) {
      close(fd);
      throw;
    }
    close(fd);
    Checksum sum;
    sum.Update(fields, 4 * sizeof(uint64_t));
    fields[4] = sum.Digest();
    std::vector<uint8_t> marker(reinterpret_cast<uint8_t*>(fields), reinterpret_cast<uint8_t*>(fields) + sizeof fields);
    ReplaceFile(dir_, marker_path_, marker);
  }

 private:
  void CheckOpen() const {
    if (env_ == nullptr || closed_ || !opened_) {
      throw StoreError(ErrorCode::kInvalidArgument, "disk tier " + dir_ + " is closed");
    }
  }

  void OpenEnv() {
    Check(mdb_env_create(&env_), "cannot create the environment", dir_);
    // Address space only: the file grows as rows arrive.
    Check(mdb_env_set_mapsize(env_, size_t{1} << 40), "cannot set the map size", dir_);
    unsigned flags = MDB_NORDAHEAD | MDB_NOTLS;
    if (!options_.sync_every_put) flags |= MDB_NOSYNC | MDB_NOMETASYNC;
    Check(mdb_env_open(env_, dir_.c_str(), flags, 0644), "cannot open", dir_);
    Txn txn(env_, false, dir_);
    Check(mdb_dbi_open(txn.get(), nullptr, MDB_INTEGERKEY | MDB_CREATE, &dbi_), "cannot open the table", dir_);
    txn.Commit();
  }

  static std::vector<uint32_t> SortedOrder(const int64_t* ids, size_t n) {
    std::vector<uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(), [ids](uint32_t a, uint32_t b) {
      return static_cast<uint64_t>(ids[a]) < static_cast<uint64_t>(ids[b]);
    });
    return order;
  }

  std::string dir_, data_path_, marker_path_;
  DiskTierOptions options_;
  MDB_env* env_ = nullptr;
  MDB_dbi dbi_ = 0;
  bool opened_ = false;
  bool closed_ = false;
};

}  // namespace

std::unique_ptr<DiskTier> OpenLmdbTier(const std::string& dir, const DiskTierOptions& options,
                                       DiskTierOpen mode) {
  disk_tier_io::CheckOptions(dir, options);
  auto tier = std::make_unique<LmdbTier>(dir, options);
  tier->Open(mode);
  return tier;
}

}  // namespace prefixrec::internal

#endif  // PREFIXREC_DISK_TIER_LMDB
