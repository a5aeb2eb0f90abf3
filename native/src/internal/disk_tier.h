// The disk tier of one shard: rows that do not fit the shard's memory budget, kept on local disk
// as the same fixed-size byte blocks the shard holds (RowHeader + floats, internal/shard.h), so
// a row moves between the tiers, and into snapshots and deltas, as one piece.
//
// The tier is a plain id -> row map with batched calls; every policy stays with the store:
//   - which rows move down (the store never hands the rows of the current step to Put),
//   - the dirty bit (RowHeader::count bit 31) travels inside the row, so a row updated and then
//     evicted before a delta export is still found dirty by a ForEach during that export (and
//     written back clean with Put afterwards); tombstones stay in the shard's `tombstones`,
//   - expiry: the store streams the rows with ForEach, collects the ids to drop and calls Erase.
//
// Concurrency: not thread-safe. One shard's tier is used under that shard's exclusive lock (a
// Get with take = false also under a shared one if no other call runs); a tier may use its own
// threads inside one call (DiskTierOptions::read_threads).
//
// Durability: the tier extends memory, it is not a second copy of the store. After a crash the
// store restores from its last snapshot and opens its tiers with kCreate (which discards what
// was there). A tier closed cleanly (Close) reopens with kReopen to the same rows; a directory
// that was not closed cleanly, or whose files are damaged or truncated, gives
// StoreError(kCorruptFile), never a crash or half-written rows. Sync() makes the writes so far
// reach the disk (fdatasync); DiskTierOptions::sync_every_put does so at the end of every Put.
//
// Errors: every failure is a StoreError (store_error.h): kInvalidArgument for bad arguments
// (checked before anything changes), kIo for a refused read/write/fsync, kCorruptFile for a
// damaged directory. After a kIo error in the middle of a batch the tier may hold part of it.
#ifndef PREFIXREC_INTERNAL_DISK_TIER_H_
#define PREFIXREC_INTERNAL_DISK_TIER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace prefixrec::internal {

struct DiskTierOptions {
  size_t row_bytes = 0;          // bytes of one row: 20-byte header + floats (multiple of 4)
  bool sync_every_put = false;   // fdatasync at the end of every Put (else only on Sync/Close)
  int read_threads = 1;          // threads one Get may use for its reads (1..64)
};

enum class DiskTierOpen {
  kCreate,  // start empty: whatever the directory held for this tier is discarded
  kReopen,  // the rows of the last clean Close; kCorruptFile if there is none or it is damaged
};

struct DiskTierReclaim {
  uint64_t rows_moved = 0;    // rows rewritten to fill holes
  uint64_t bytes_freed = 0;   // bytes the data file shrank by
};

class DiskTier {
 public:
  virtual ~DiskTier() = default;

  // The engine's name (for benchmarks and stats).
  virtual const char* name() const = 0;
  size_t row_bytes() const { return row_bytes_; }

  // Stores n rows (rows: n * row_bytes bytes, row i at rows + i * row_bytes), replacing rows of
  // the same ids. The id in each row's header must be ids[i] (kInvalidArgument otherwise, before
  // anything is written). A batch naming an id twice keeps the later row.
  virtual void Put(const int64_t* ids, const uint8_t* rows, size_t n) = 0;

  // Looks up n ids: found[i] = 1 and the row at out + i * row_bytes for a stored id, found[i] = 0
  // (its out bytes untouched) otherwise. take = true removes the found rows (they moved up to
  // memory). Returns the number found. Reads are sorted by position on disk.
  virtual size_t Get(const int64_t* ids, size_t n, uint8_t* out, uint8_t* found, bool take) = 0;

  // Removes the stored ones of n ids; returns how many were removed.
  virtual size_t Erase(const int64_t* ids, size_t n) = 0;

  virtual bool Contains(int64_t id) const = 0;
  virtual uint64_t Count() const = 0;
  // Bytes the tier's files take on disk (allocated blocks).
  virtual uint64_t BytesOnDisk() const = 0;
  // Bytes of the tier's in-memory index and buffers (the store adds them to its own count).
  virtual uint64_t IndexBytes() const = 0;
  // Rows read (Get, ForEach) and written (Put, Reclaim's moves) since the tier was opened.
  virtual uint64_t RowsRead() const = 0;
  virtual uint64_t RowsWritten() const = 0;

  // Gives back disk space of rows that moved up, expired or were erased, rewriting at most
  // max_rows rows (0: no limit). Each engine states its bound (see its Open function).
  virtual DiskTierReclaim Reclaim(uint64_t max_rows) = 0;
  // True when the engine's bound asks for a Reclaim.
  virtual bool NeedsReclaim() const = 0;

  // Makes every write so far durable (fdatasync).
  virtual void Sync() = 0;

  // Calls visit(rows, n) for every stored row, in batches of at most batch_rows rows read
  // sequentially (memory: one batch, never all rows). visit must not call the tier.
  virtual void ForEach(size_t batch_rows,
                       const std::function<void(const uint8_t* rows, size_t n)>& visit) const = 0;

  // Syncs and marks the directory closed cleanly so kReopen finds these rows. The tier is
  // unusable afterwards. The destructor closes an open tier (ignoring errors).
  virtual void Close() = 0;

 protected:
  explicit DiskTier(size_t row_bytes) : row_bytes_(row_bytes) {}
  size_t row_bytes_;
};

// The slot file (the SSDHASH design): one file of fixed-size slots, an in-memory open-addressing
// id -> slot table (12 bytes an entry at <= 85% load: 14-18 bytes a row of RSS), a list of free
// slots (4 bytes a hole) reused before the file grows, batched pread/pwrite sorted by offset
// with adjacent slots coalesced.
// Disk bound: the file never holds more slots than the most rows ever stored at once; a Put
// fills holes first. NeedsReclaim() is true when slots > 1.25 * rows + kSlotChunk; Reclaim moves
// the last live slots into the lowest holes and truncates, so after Reclaim(0)
// file bytes == rows * row_bytes exactly.
// Files in `dir`: disk_tier.slots (the rows) and disk_tier.meta (written by Close: slot count,
// free slots and a checksum of both files; removed while the tier is open).
std::unique_ptr<DiskTier> OpenSlotFileTier(const std::string& dir, const DiskTierOptions& options,
                                           DiskTierOpen mode);
constexpr uint64_t kSlotChunk = 4096;

// Compacts the tier once its engine's bound asks for it (NeedsReclaim). The store calls it
// after every call that takes rows out of a tier (Erase, Get with take): rows that moved up
// leave holes the next eviction refills, but rows that expired or were removed may never be
// replaced, and without this the file would stay at the most rows it ever held.
inline void ReclaimIfNeeded(DiskTier* tier) {
  if (tier != nullptr && tier->NeedsReclaim()) tier->Reclaim(0);
}

#if defined(PREFIXREC_DISK_TIER_LMDB)
// LMDB (a B+tree in one memory-mapped file, copy-on-write pages, one writer): key = id (8 bytes,
// MDB_INTEGERKEY), value = the row. Free pages are reused inside the file; Reclaim compacts it
// into a new file (mdb_env_copy2 with MDB_CP_COMPACT) and renames it over: bound after Reclaim =
// the B+tree's own page fill. Built only with -DPREFIXREC_DISK_TIER_LMDB and -llmdb (the C++
// tests and the benchmark; Debian liblmdb-dev); the extension does not link it.
std::unique_ptr<DiskTier> OpenLmdbTier(const std::string& dir, const DiskTierOptions& options,
                                       DiskTierOpen mode);
#endif

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_DISK_TIER_H_
