// The disk tier's engines (internal/disk_tier.h): the slot file, and LMDB when built with
// PREFIXREC_DISK_TIER_LMDB (the Makefile's C++ test build does).
#include "internal/disk_tier.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "prefixrec/store_error.h"

namespace prefixrec::internal {
namespace {

constexpr size_t kRowBytes = 84;  // dim 8 with Adagrad: 20 + 16 * 4

using Opener = std::function<std::unique_ptr<DiskTier>(const std::string&, const DiskTierOptions&, DiskTierOpen)>;

struct Engine {
  const char* name;
  Opener open;
  const char* data_file;  // the file holding the rows, inside the tier's directory
};

std::vector<Engine> Engines() {
  std::vector<Engine> engines = {{"slotfile", OpenSlotFileTier, "disk_tier.slots"}};
#if defined(PREFIXREC_DISK_TIER_LMDB)
  engines.push_back({"lmdb", OpenLmdbTier, "data.mdb"});
#endif
  return engines;
}

// A fresh directory under /tmp, removed with its files at the end of the test.
class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/disk_tier_test.XXXXXX";
    char* made = mkdtemp(pattern);
    REQUIRE(made != nullptr);
    path_ = made;
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

DiskTierOptions Options(int threads = 1) {
  DiskTierOptions options;
  options.row_bytes = kRowBytes;
  options.read_threads = threads;
  return options;
}

// A row for `id` whose bytes depend on id and version.
std::vector<uint8_t> MakeRow(int64_t id, uint32_t version) {
  std::vector<uint8_t> row(kRowBytes);
  std::memcpy(row.data(), &id, 8);
  for (size_t b = 8; b < kRowBytes; ++b) {
    row[b] = static_cast<uint8_t>((static_cast<uint64_t>(id) * 131 + version * 31 + b * 7) >> (b % 5));
  }
  return row;
}

void PutRows(DiskTier& tier, const std::vector<int64_t>& ids, uint32_t version) {
  std::vector<uint8_t> rows;
  for (int64_t id : ids) {
    auto row = MakeRow(id, version);
    rows.insert(rows.end(), row.begin(), row.end());
  }
  tier.Put(ids.data(), rows.data(), ids.size());
}

// Every stored row, by id, through ForEach in small batches.
std::map<int64_t, std::vector<uint8_t>> AllRows(const DiskTier& tier) {
  std::map<int64_t, std::vector<uint8_t>> rows;
  tier.ForEach(7, [&](const uint8_t* data, size_t n) {
    CHECK(n <= 7);
    for (size_t i = 0; i < n; ++i) {
      int64_t id;
      std::memcpy(&id, data + i * kRowBytes, 8);
      CHECK(rows.count(id) == 0);
      rows[id] = std::vector<uint8_t>(data + i * kRowBytes, data + (i + 1) * kRowBytes);
    }
  });
  return rows;
}

ErrorCode CodeOf(const std::function<void()>& call) {
  try {
    call();
  } catch (const StoreError& error) {
    return error.code();
  }
  FAIL("no StoreError");
  return ErrorCode::kIo;
}

uint64_t FileSize(const std::string& path) {
  struct stat st;
  REQUIRE(stat(path.c_str(), &st) == 0);
  return static_cast<uint64_t>(st.st_size);
}

TEST_CASE("disk tier: put, get, take and erase round trips") {
  for (const Engine& engine : Engines()) {
    const std::string engine_name = engine.name;
    CAPTURE(engine_name);
    TempDir dir;
    auto tier = engine.open(dir.path(), Options(), DiskTierOpen::kCreate);
    PutRows(*tier, {1, 2, 3, -5, int64_t{1} << 62}, 0);
    CHECK(tier->Count() == 5);
    CHECK(tier->Contains(-5));
    CHECK_FALSE(tier->Contains(4));

    std::vector<int64_t> ask = {3, 4, -5, 3};
    std::vector<uint8_t> out(ask.size() * kRowBytes, 0xee), found(ask.size());
    CHECK(tier->Get(ask.data(), ask.size(), out.data(), found.data(), false) == 3);
    CHECK(found == std::vector<uint8_t>{1, 0, 1, 1});
    CHECK(std::memcmp(out.data(), MakeRow(3, 0).data(), kRowBytes) == 0);
    CHECK(out[kRowBytes] == 0xee);  // a missing id's bytes are untouched
    CHECK(std::memcmp(out.data() + 2 * kRowBytes, MakeRow(-5, 0).data(), kRowBytes) == 0);
    CHECK(std::memcmp(out.data() + 3 * kRowBytes, MakeRow(3, 0).data(), kRowBytes) == 0);
    CHECK(tier->Count() == 5);

    // take: the rows move up and leave the tier
    CHECK(tier->Get(ask.data(), ask.size(), out.data(), found.data(), true) == 3);
    CHECK(tier->Count() == 3);
    CHECK_FALSE(tier->Contains(3));
    CHECK_FALSE(tier->Contains(-5));

    // a later Put replaces, and within one batch the later row of an id wins
    std::vector<int64_t> ids = {1, 1};
    std::vector<uint8_t> rows = MakeRow(1, 1);
    auto second = MakeRow(1, 2);
    rows.insert(rows.end(), second.begin(), second.end());
    tier->Put(ids.data(), rows.data(), 2);
    CHECK(tier->Count() == 3);
    CHECK(AllRows(*tier).at(1) == MakeRow(1, 2));

    // a row whose header names another id is refused before anything changes
    std::vector<int64_t> bad = {7, 8};
    std::vector<uint8_t> bad_rows = MakeRow(7, 0);
    auto other = MakeRow(9, 0);
    bad_rows.insert(bad_rows.end(), other.begin(), other.end());
    CHECK(CodeOf([&] { tier->Put(bad.data(), bad_rows.data(), 2); }) == ErrorCode::kInvalidArgument);
    CHECK_FALSE(tier->Contains(7));

    std::vector<int64_t> gone = {2, 2, 99};
    CHECK(tier->Erase(gone.data(), gone.size()) == 1);
    CHECK(tier->Count() == 2);
    auto all = AllRows(*tier);
    CHECK(all.size() == 2);
    CHECK(all.at(int64_t{1} << 62) == MakeRow(int64_t{1} << 62, 0));
    tier->Sync();
  }
}

TEST_CASE("disk tier: bad options and directories are refused with kInvalidArgument") {
  for (const Engine& engine : Engines()) {
    const std::string engine_name = engine.name;
    CAPTURE(engine_name);
    TempDir dir;
    DiskTierOptions options = Options();
    options.row_bytes = 18;
    CHECK(CodeOf([&] { engine.open(dir.path(), options, DiskTierOpen::kCreate); }) == ErrorCode::kInvalidArgument);
    options.row_bytes = 86;
    CHECK(CodeOf([&] { engine.open(dir.path(), options, DiskTierOpen::kCreate); }) == ErrorCode::kInvalidArgument);
    CHECK(CodeOf([&] { engine.open(dir.path(), Options(0), DiskTierOpen::kCreate); }) == ErrorCode::kInvalidArgument);
    CHECK(CodeOf([&] { engine.open("", Options(), DiskTierOpen::kCreate); }) == ErrorCode::kInvalidArgument);
    const std::string file = dir.sub("plain");
    close(open(file.c_str(), O_CREAT | O_WRONLY, 0644));
    CHECK(CodeOf([&] { engine.open(file, Options(), DiskTierOpen::kCreate); }) == ErrorCode::kInvalidArgument);
    CHECK(CodeOf([&] { engine.open(dir.sub("missing/parent"), Options(), DiskTierOpen::kCreate); }) == ErrorCode::kIo);
  }
}

TEST_CASE("disk tier: slot file reuses the slots of rows that left before it grows") {
  TempDir dir;
  auto tier = OpenSlotFileTier(dir.path(), Options(), DiskTierOpen::kCreate);
  std::vector<int64_t> ids;
  for (int64_t id = 0; id < 1000; ++id) ids.push_back(id);
  PutRows(*tier, ids, 0);
  const uint64_t size = FileSize(dir.sub("disk_tier.slots"));
  CHECK(size == 1000 * kRowBytes);
  std::vector<int64_t> odd;
  for (int64_t id = 1; id < 1000; id += 2) odd.push_back(id);
  std::vector<uint8_t> out(odd.size() * kRowBytes), found(odd.size());
  CHECK(tier->Get(odd.data(), odd.size(), out.data(), found.data(), true) == 500);
  std::vector<int64_t> fresh;
  for (int64_t id = 5000; id < 5500; ++id) fresh.push_back(id);
  PutRows(*tier, fresh, 0);
  CHECK(FileSize(dir.sub("disk_tier.slots")) == size);
  CHECK(tier->Count() == 1000);
  PutRows(*tier, {9000}, 0);
  CHECK(FileSize(dir.sub("disk_tier.slots")) == size + kRowBytes);
  CHECK(AllRows(*tier).at(5123) == MakeRow(5123, 0));
}

TEST_CASE("disk tier: slot file reclaim meets its bound and keeps every row") {
  TempDir dir;
  auto tier = OpenSlotFileTier(dir.path(), Options(), DiskTierOpen::kCreate);
  std::vector<int64_t> ids;
  for (int64_t id = 0; id < 20000; ++id) ids.push_back(id * 7919);
  PutRows(*tier, ids, 3);
  std::mt19937_64 rng(41);
  std::vector<int64_t> drop, keep;
  for (int64_t id : ids) (rng() % 10 < 7 ? drop : keep).push_back(id);
  CHECK_FALSE(tier->NeedsReclaim());
  tier->Erase(drop.data(), drop.size());
  CHECK(tier->NeedsReclaim());  // 20000 slots > 1.25 * ~6000 + 4096

  // a bounded step moves at most max_rows rows
  DiskTierReclaim step = tier->Reclaim(100);
  CHECK(step.rows_moved <= 100);
  CHECK(step.bytes_freed >= step.rows_moved * kRowBytes);
  DiskTierReclaim rest = tier->Reclaim(0);
  CHECK(rest.rows_moved + step.rows_moved <= keep.size());
  CHECK_FALSE(tier->NeedsReclaim());
  CHECK(FileSize(dir.sub("disk_tier.slots")) == keep.size() * kRowBytes);
  CHECK(tier->BytesOnDisk() <= keep.size() * kRowBytes + 4096);
  auto all = AllRows(*tier);
  REQUIRE(all.size() == keep.size());
  for (int64_t id : keep) CHECK(all.at(id) == MakeRow(id, 3));
  std::vector<uint8_t> out(keep.size() * kRowBytes), found(keep.size());
  CHECK(tier->Get(keep.data(), keep.size(), out.data(), found.data(), false) == keep.size());
  for (size_t i = 0; i < keep.size(); i += 97) {
    CHECK(std::memcmp(out.data() + i * kRowBytes, MakeRow(keep[i], 3).data(), kRowBytes) == 0);
  }
  CHECK(tier->Reclaim(0).rows_moved == 0);
}

TEST_CASE("disk tier: every engine's reclaim gives space back") {
  for (const Engine& engine : Engines()) {
    const std::string engine_name = engine.name;
    CAPTURE(engine_name);
    TempDir dir;
    auto tier = engine.open(dir.path(), Options(), DiskTierOpen::kCreate);
    std::vector<int64_t> ids;
    for (int64_t id = 0; id < 30000; ++id) ids.push_back(id);
    PutRows(*tier, ids, 1);
    std::vector<int64_t> drop(ids.begin(), ids.begin() + 27000);
    tier->Erase(drop.data(), drop.size());
    tier->Reclaim(0);
    CHECK(tier->Count() == 3000);
    // within 2x the payload plus a few pages for either engine
    CHECK(tier->BytesOnDisk() <= 2 * 3000 * kRowBytes + 64 * 1024);
    auto all = AllRows(*tier);
    REQUIRE(all.size() == 3000);
    CHECK(all.at(29999) == MakeRow(29999, 1));
  }
}

TEST_CASE("disk tier: a clean close reopens to the same rows; anything else is kCorruptFile") {
  for (const Engine& engine : Engines()) {
    const std::string engine_name = engine.name;
    CAPTURE(engine_name);
    TempDir dir;
    std::vector<int64_t> ids;
    for (int64_t id = 0; id < 3000; ++id) ids.push_back(id * 3 - 1000);
    {
      auto tier = engine.open(dir.path(), Options(), DiskTierOpen::kCreate);
      PutRows(*tier, ids, 5);
      std::vector<int64_t> drop(ids.begin(), ids.begin() + 1000);
      tier->Erase(drop.data(), drop.size());
      tier->Close();
      CHECK(CodeOf([&] { tier->Count(); }) == ErrorCode::kInvalidArgument);
    }
    std::map<int64_t, std::vector<uint8_t>> expected;
    for (size_t i = 1000; i < ids.size(); ++i) expected[ids[i]] = MakeRow(ids[i], 5);
    {
      auto tier = engine.open(dir.path(), Options(), DiskTierOpen::kReopen);
      CHECK(tier->Count() == 2000);
      CHECK(AllRows(*tier) == expected);
      // the reopened tier is open: a crash now (no Close) must not read as clean
      const std::string copy = dir.sub("copy");
      REQUIRE(std::system(("mkdir '" + copy + "' && cp '" + dir.path() + "'/" + engine.data_file + " '" +
                           copy + "'/").c_str()) == 0);
      CHECK(CodeOf([&] { engine.open(copy, Options(), DiskTierOpen::kReopen); }) == ErrorCode::kCorruptFile);
      PutRows(*tier, {424242}, 1);  // the slot of a removed row
      expected[424242] = MakeRow(424242, 1);
    }  // the destructor closes cleanly
    {
      auto tier = engine.open(dir.path(), Options(), DiskTierOpen::kReopen);
      CHECK(AllRows(*tier) == expected);
    }
    DiskTierOptions wider = Options();
    wider.row_bytes = kRowBytes + 4;
    CHECK(CodeOf([&] { engine.open(dir.path(), wider, DiskTierOpen::kReopen); }) == ErrorCode::kIncompatible);
    // still closed cleanly after the refused open
    CHECK(engine.open(dir.path(), Options(), DiskTierOpen::kReopen)->Count() == 2001);
    // kCreate discards
    CHECK(engine.open(dir.path(), Options(), DiskTierOpen::kCreate)->Count() == 0);
    CHECK(CodeOf([&] { engine.open(dir.sub("never"), Options(), DiskTierOpen::kReopen); }) == ErrorCode::kCorruptFile);
  }
}

TEST_CASE("disk tier: a truncated or damaged directory gives kCorruptFile, not a crash") {
  for (const Engine& engine : Engines()) {
    const std::string engine_name = engine.name;
    CAPTURE(engine_name);
    // Each damage applied to a fresh, cleanly closed tier.
    const std::vector<std::pair<const char*, std::function<void(const std::string&)>>> damages = {
        {"data truncated by a row", [&](const std::string& d) {
           const std::string f = d + "/" + engine.data_file;
           REQUIRE(truncate(f.c_str(), static_cast<off_t>(FileSize(f) - kRowBytes)) == 0);
         }},
        {"data truncated to nothing", [&](const std::string& d) {
           REQUIRE(truncate((d + "/" + engine.data_file).c_str(), 0) == 0);
         }},
        {"one data byte flipped", [&](const std::string& d) {
           const std::string f = d + "/" + engine.data_file;
           int fd = open(f.c_str(), O_RDWR);
           REQUIRE(fd >= 0);
           uint8_t byte = 0;
           const off_t at = static_cast<off_t>(FileSize(f) / 3);
           REQUIRE(pread(fd, &byte, 1, at) == 1);
           byte ^= 0x10;
           REQUIRE(pwrite(fd, &byte, 1, at) == 1);
           close(fd);
         }},
        {"data removed", [&](const std::string& d) { REQUIRE(unlink((d + "/" + engine.data_file).c_str()) == 0); }},
        {"metadata garbage", [&](const std::string& d) {
           const std::string meta = d + (std::string(engine.name) == "lmdb" ? "/disk_tier.lmdb.meta" : "/disk_tier.meta");
           REQUIRE(std::system(("head -c 300 /dev/urandom > '" + meta + "'").c_str()) == 0);
         }},
        {"metadata truncated", [&](const std::string& d) {
           const std::string meta = d + (std::string(engine.name) == "lmdb" ? "/disk_tier.lmdb.meta" : "/disk_tier.meta");
           REQUIRE(truncate(meta.c_str(), static_cast<off_t>(FileSize(meta) - 3)) == 0);
         }},
    };
    for (const auto& [what, damage] : damages) {
      const std::string damage_name = what;
      CAPTURE(damage_name);
      TempDir dir;
      {
        auto tier = engine.open(dir.path(), Options(), DiskTierOpen::kCreate);
        std::vector<int64_t> ids;
        for (int64_t id = 0; id < 500; ++id) ids.push_back(id);
        PutRows(*tier, ids, 2);
        tier->Close();
      }
      damage(dir.path());
      CHECK(CodeOf([&] { engine.open(dir.path(), Options(), DiskTierOpen::kReopen); }) == ErrorCode::kCorruptFile);
      // and kCreate still starts over in it
      CHECK(engine.open(dir.path(), Options(), DiskTierOpen::kCreate)->Count() == 0);
    }
  }
}

TEST_CASE("disk tier: random operations agree with an unordered_map (seed 41)") {
  for (const Engine& engine : Engines()) {
    for (int threads : {1, 3}) {
      const std::string engine_name = engine.name;
    CAPTURE(engine_name);
      CAPTURE(threads);
      TempDir dir;
      auto tier = engine.open(dir.path(), Options(threads), DiskTierOpen::kCreate);
      std::unordered_map<int64_t, std::vector<uint8_t>> reference;
      std::mt19937_64 rng(41);
      uint32_t version = 0;
      auto random_ids = [&](size_t n) {
        std::vector<int64_t> ids;
        for (size_t i = 0; i < n; ++i) ids.push_back(static_cast<int64_t>(rng() % 3000) - 1500);
        return ids;
      };
      for (int op = 0; op < 400; ++op) {
        const int kind = static_cast<int>(rng() % 10);
        const size_t n = 1 + rng() % 300;
        if (kind < 4) {  // Put (ids may repeat: the later wins)
          auto ids = random_ids(n);
          ++version;
          std::vector<uint8_t> rows;
          for (size_t i = 0; i < ids.size(); ++i) {
            auto row = MakeRow(ids[i], version * 1000 + static_cast<uint32_t>(i));
            rows.insert(rows.end(), row.begin(), row.end());
            reference[ids[i]] = row;
          }
          tier->Put(ids.data(), rows.data(), ids.size());
        } else if (kind < 8) {  // Get, keeping or taking
          auto ids = random_ids(n);
          const bool take = kind >= 6;
          std::vector<uint8_t> out(ids.size() * kRowBytes), found(ids.size());
          size_t expected_hits = 0;
          for (int64_t id : ids) expected_hits += reference.count(id);
          CHECK(tier->Get(ids.data(), ids.size(), out.data(), found.data(), take) == expected_hits);
          for (size_t i = 0; i < ids.size(); ++i) {
            auto it = reference.find(ids[i]);
            REQUIRE(static_cast<bool>(found[i]) == (it != reference.end()));
            if (found[i]) CHECK(std::memcmp(out.data() + i * kRowBytes, it->second.data(), kRowBytes) == 0);
          }
          if (take) {
            for (int64_t id : ids) reference.erase(id);
          }
        } else if (kind == 8) {  // Erase
          auto ids = random_ids(n);
          size_t expected = 0;
          for (int64_t id : ids) expected += reference.erase(id);
          CHECK(tier->Erase(ids.data(), ids.size()) == expected);
        } else {  // reclaim, or close and reopen
          if (rng() % 2 == 0) {
            tier->Reclaim(rng() % 2 == 0 ? 0 : 50);
          } else {
            tier->Close();
            tier = engine.open(dir.path(), Options(threads), DiskTierOpen::kReopen);
          }
        }
        REQUIRE(tier->Count() == reference.size());
        const int64_t probe = static_cast<int64_t>(rng() % 3000) - 1500;
        CHECK(tier->Contains(probe) == (reference.count(probe) == 1));
      }
      auto all = AllRows(*tier);
      REQUIRE(all.size() == reference.size());
      for (const auto& [id, row] : reference) CHECK(all.at(id) == row);
    }
  }
}

}  // namespace
}  // namespace prefixrec::internal
