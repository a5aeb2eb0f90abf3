// File helpers shared by the disk tier's engines (native/src/disk_tier*.cc): errors as
// StoreError, whole reads and writes that retry EINTR and short transfers, the checksum of a
// file and a small file replaced atomically.
#ifndef PREFIXREC_INTERNAL_DISK_TIER_IO_H_
#define PREFIXREC_INTERNAL_DISK_TIER_IO_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "internal/disk_tier.h"

namespace prefixrec::internal::disk_tier_io {

[[noreturn]] void Fail(const std::string& what, const std::string& path);      // kIo with errno
[[noreturn]] void Corrupt(const std::string& what, const std::string& path);   // kCorruptFile

// kInvalidArgument unless `dir` is non-empty and the options are in range.
void CheckOptions(const std::string& dir, const DiskTierOptions& options);
// mkdir if missing (one level; the parent must exist).
void MakeDir(const std::string& dir);
// Removes `path` if it exists.
void RemoveIfExists(const std::string& path);
bool Exists(const std::string& path);
// Every byte of iov[0..count) at `offset` (retries EINTR and short transfers; a read that meets
// the end of the file is kCorruptFile).
void ReadVec(int fd, uint64_t offset, struct iovec* iov, int count, const std::string& path);
void WriteVec(int fd, uint64_t offset, struct iovec* iov, int count, const std::string& path);
// The Checksum (internal/hash.h) of a file's first `bytes` bytes, read sequentially.
uint64_t FileChecksum(int fd, uint64_t bytes, const std::string& path);
// Writes `bytes` to `path` through a temporary file, fsync and rename, then fsyncs `dir`.
void ReplaceFile(const std::string& dir, const std::string& path, const std::vector<uint8_t>& bytes);
// The whole of a small file; false if it does not exist.
bool ReadSmallFile(const std::string& path, std::vector<uint8_t>* bytes);
uint64_t AllocatedBytes(int fd, const std::string& path);
uint64_t FileSize(int fd, const std::string& path);

}  // namespace prefixrec::internal::disk_tier_io

#endif  // PREFIXREC_INTERNAL_DISK_TIER_IO_H_
