// The files of the store and of its quantized exports (persistence.cc, quantized.cc): written
// through a temporary file that is fsynced and renamed into place (FileWriter), read through a
// buffered reader that checksums what it reads and checks the 16-byte trailer (FileReader):
// a 64-bit checksum of everything before it and an end magic. A damaged or cut-short file is a
// StoreError(kCorruptFile) naming the file (and where it went wrong).
#ifndef PREFIXREC_INTERNAL_FILE_IO_H_
#define PREFIXREC_INTERNAL_FILE_IO_H_

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "internal/crash_point.h"
#include "internal/hash.h"
#include "prefixrec/store_error.h"

namespace prefixrec::internal {

constexpr char kEndMagic[8] = {'P', 'R', 'X', 'E', 'N', 'D', '0', '1'};
constexpr size_t kTrailerBytes = 16;

inline bool LittleEndian() {
  const uint16_t probe = 1;
  uint8_t first;
  std::memcpy(&first, &probe, 1);
  return first == 1;
}

[[noreturn]] inline void IoError(const std::string& what, const std::string& path) {
  throw StoreError(ErrorCode::kIo, what + " " + path + ": " + std::strerror(errno));
}

[[noreturn]] inline void Corrupt(const std::string& path, const std::string& what) {
  throw StoreError(ErrorCode::kCorruptFile, "corrupt store file " + path + ": " + what);
}

inline void MakeDirectory(const std::string& dir) {
  struct stat info;
  if (stat(dir.c_str(), &info) == 0) {
    if (!S_ISDIR(info.st_mode)) {
      throw StoreError(ErrorCode::kIo, "expected a directory but found a file: " + dir);
    }
    return;
  }
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) IoError("cannot create directory", dir);
}

// Removes `<name>.tmp.<pid>` files a crashed writer of `path` left in its directory.
inline void RemoveStaleTemps(const std::string& path) {
  size_t slash = path.find_last_of('/');
  std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  std::string prefix = (slash == std::string::npos ? path : path.substr(slash + 1)) + ".tmp.";
  DIR* handle = opendir(dir.c_str());
  if (handle == nullptr) return;  // the open of the new temporary file reports why
  while (const dirent* entry = readdir(handle)) {
    std::string name = entry->d_name;
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    if (name.find_first_not_of("0123456789", prefix.size()) != std::string::npos) continue;
    unlink((dir + "/" + name).c_str());  // best effort: a leftover is only wasted space
  }
  closedir(handle);
}

// Buffered writer to a temporary file that becomes `path` on Commit(). `crash_prefix` names its
// crash points (`<prefix>.written`, `.synced`, `.renamed`).
class FileWriter {
 public:
  FileWriter(const std::string& path, std::string crash_prefix)
      : path_(path),
        temp_(path + ".tmp." + std::to_string(getpid())),
        crash_prefix_(std::move(crash_prefix)),
        buffer_(1 << 20) {
    RemoveStaleTemps(path);
    fd_ = open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) IoError("cannot create", temp_);
  }
  ~FileWriter() {
    if (fd_ >= 0) {
      close(fd_);
      unlink(temp_.c_str());
    }
  }

  void Write(const void* data, size_t n) {
    if (n == 0) return;
    checksum_.Update(data, n);
    const auto* p = static_cast<const uint8_t*>(data);
    if (used_ + n > buffer_.size()) Flush();
    if (n >= buffer_.size()) {
      WriteAll(p, n);
      return;
    }
    std::memcpy(buffer_.data() + used_, p, n);
    used_ += n;
  }
  template <typename T>
  void Put(const T& value) {
    Write(&value, sizeof(T));
  }

  // Writes the trailer, syncs and renames into place. Returns the file size.
  uint64_t Commit() {
    uint64_t digest = checksum_.Digest();
    Flush();
    WriteAll(reinterpret_cast<const uint8_t*>(&digest), 8);
    WriteAll(reinterpret_cast<const uint8_t*>(kEndMagic), 8);
    CrashPoint(crash_prefix_ + ".written");
    if (fsync(fd_) != 0) IoError("cannot fsync", temp_);
    CrashPoint(crash_prefix_ + ".synced");
    if (close(fd_) != 0) {
      fd_ = -1;
      unlink(temp_.c_str());
      IoError("cannot close", temp_);
    }
    fd_ = -1;
    if (rename(temp_.c_str(), path_.c_str()) != 0) {
      unlink(temp_.c_str());
      IoError("cannot rename into", path_);
    }
    CrashPoint(crash_prefix_ + ".renamed");
    std::string dir = path_.substr(0, path_.find_last_of('/'));
    int dir_fd = open(dir.empty() ? "/" : dir.c_str(), O_RDONLY | O_CLOEXEC);
    if (dir_fd >= 0) {
      fsync(dir_fd);  // best effort: some file systems refuse fsync on directories
      close(dir_fd);
    }
    return written_;
  }

 private:
  void Flush() {
    WriteAll(buffer_.data(), used_);
    used_ = 0;
  }
  void WriteAll(const uint8_t* p, size_t n) {
    while (n > 0) {
      ssize_t w = write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        IoError("cannot write", temp_);
      }
      p += w;
      n -= static_cast<size_t>(w);
      written_ += static_cast<uint64_t>(w);
    }
  }

  std::string path_, temp_, crash_prefix_;
  int fd_ = -1;
  std::vector<uint8_t> buffer_;
  size_t used_ = 0;
  uint64_t written_ = 0;
  Checksum checksum_;
};

// Buffered reader that checksums what it reads and never reads into the trailer.
class FileReader {
 public:
  explicit FileReader(const std::string& path) : path_(path), buffer_(1 << 20) {
    fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) IoError("cannot open", path);
    struct stat info;
    if (fstat(fd_, &info) != 0) IoError("cannot stat", path);
    uint64_t size = static_cast<uint64_t>(info.st_size);
    if (size < kTrailerBytes + 8) {
      Corrupt(path, "file has " + std::to_string(size) + " bytes, too short for a header");
    }
    body_ = size - kTrailerBytes;
  }
  ~FileReader() { close(fd_); }
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  const std::string& path() const { return path_; }
  uint64_t remaining() const { return body_ - consumed_; }
  uint64_t offset() const { return consumed_; }  // bytes read so far: where the next read starts

  void Read(void* out, size_t n) {
    if (n == 0) return;
    if (n > remaining()) {
      Corrupt(path_, "truncated: needed " + std::to_string(n) + " bytes at offset " +
                         std::to_string(consumed_) + " but only " + std::to_string(remaining()) +
                         " remain before the trailer");
    }
    auto* p = static_cast<uint8_t*>(out);
    size_t left = n;
    while (left > 0) {
      if (start_ == end_) Fill();
      size_t take = std::min(left, end_ - start_);
      std::memcpy(p, buffer_.data() + start_, take);
      start_ += take;
      p += take;
      left -= take;
    }
    checksum_.Update(out, n);
    consumed_ += n;
  }
  template <typename T>
  T Get() {
    T value;
    Read(&value, sizeof(T));
    return value;
  }
  // Refuses counts that cannot fit in what is left of the file.
  void CheckCount(uint64_t count, uint64_t bytes_each, const char* what) {
    if (bytes_each != 0 && count > remaining() / bytes_each) {
      Corrupt(path_, std::string(what) + " count " + std::to_string(count) + " does not fit in the " +
                         std::to_string(remaining()) + " bytes left");
    }
  }

  void VerifyTrailer() {
    if (remaining() != 0) {
      Corrupt(path_, std::to_string(remaining()) + " unexpected bytes before the trailer");
    }
    uint8_t trailer[kTrailerBytes];
    size_t have = end_ - start_;
    std::memcpy(trailer, buffer_.data() + start_, std::min(have, kTrailerBytes));
    size_t got = std::min(have, kTrailerBytes);
    while (got < kTrailerBytes) {
      ssize_t r = read(fd_, trailer + got, kTrailerBytes - got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) Corrupt(path_, "truncated trailer");
      got += static_cast<size_t>(r);
    }
    if (std::memcmp(trailer + 8, kEndMagic, 8) != 0) Corrupt(path_, "end marker missing (truncated?)");
    uint64_t stored;
    std::memcpy(&stored, trailer, 8);
    if (stored != checksum_.Digest()) Corrupt(path_, "checksum mismatch");
  }

 private:
  void Fill() {
    // Never buffer past the body so the trailer is read by VerifyTrailer, unhashed.
    start_ = 0;
    end_ = 0;
    uint64_t want = std::min<uint64_t>(buffer_.size(), body_ - file_pos_ + kTrailerBytes);
    while (end_ < want) {
      ssize_t r = read(fd_, buffer_.data() + end_, want - end_);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) IoError("cannot read", path_);
      if (r == 0) Corrupt(path_, "file shrank while reading");
      end_ += static_cast<size_t>(r);
    }
    file_pos_ += end_;
  }

  std::string path_;
  int fd_ = -1;
  uint64_t body_ = 0, consumed_ = 0, file_pos_ = 0;
  std::vector<uint8_t> buffer_;
  size_t start_ = 0, end_ = 0;
  Checksum checksum_;
};

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_FILE_IO_H_
