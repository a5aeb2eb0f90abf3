// The disk tier's engines (native/src/internal/disk_tier.h) on the store's access pattern:
// `make bench-disk-tier` (BENCH_DISK_TIER_ARGS passes options; --help lists them).
//
// One run = one engine, one row size, one fsync setting, in a fresh directory:
//   load    all `ids` rows Put in batches of `batch` (the rows a full memory tier evicted),
//   churn   `batches` steps of the store with a memory tier of `memory` rows (FIFO): a step draws
//           `batch` distinct ids Zipf(s) over the ids, Gets the ones not in memory (take: they move
//           up) and Puts as many evicted rows (oldest in memory first, never one of this step),
//   expiry  a ForEach over the rows on disk picks half of them (by a hash of the id); Erase,
//   reclaim Reclaim(0) after the expiry.
// Reported: Get and Put rows/s over the churn, load rows/s, bytes on disk per row / row bytes
// after load, after churn and after reclaim, and RssAnon growth per million rows on disk (the
// engine's in-memory index; file pages LMDB maps count as RssFile and are reported apart).
// The engines run alternately (round r: slotfile first when r is even), each run from a cold
// page cache for its data file (fdatasync + POSIX_FADV_DONTNEED after the load), in a child
// process of its own.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "internal/disk_tier.h"
#include "internal/hash.h"

using namespace prefixrec::internal;

namespace {

struct Args {
  uint64_t ids = 4000000;
  uint64_t memory = 400000;
  size_t batch = 20000;
  int batches = 300;
  int fsync_batches = 40;
  int rounds = 2;
  double zipf_s = 1.1;
  int read_threads = 1;
  std::vector<size_t> row_bytes = {148, 276};
  std::string dir = "build/bench-disk-tier";
};

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// kB of a field of /proc/self/status.
uint64_t StatusKb(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.compare(0, n, field) == 0) return std::strtoull(line.c_str() + n + 1, nullptr, 10);
  }
  return 0;
}

// Zipf(s) ranks 0..n-1 by inverse CDF (a table of n doubles built once).
class Zipf {
 public:
  Zipf(uint64_t n, double s) : cdf_(n) {
    double sum = 0;
    for (uint64_t k = 0; k < n; ++k) cdf_[k] = (sum += std::pow(static_cast<double>(k + 1), -s));
    for (double& c : cdf_) c /= sum;
  }
  uint64_t Draw(std::mt19937_64& rng) const {
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    return static_cast<uint64_t>(std::lower_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin());
  }

 private:
  std::vector<double> cdf_;
};

int64_t IdOfRank(uint64_t rank) { return static_cast<int64_t>(Mix64(rank + 1) >> 1); }

void FillRow(uint8_t* row, size_t row_bytes, int64_t id, uint32_t step) {
  std::memcpy(row, &id, 8);
  const uint32_t header[3] = {1u | 0x80000000u, step, 1700000000u};
  std::memcpy(row + 8, header, sizeof header);
  for (size_t b = 20; b + 4 <= row_bytes; b += 4) {
    const float v = static_cast<float>(static_cast<double>((id >> (b % 13)) & 0xffff) * 1e-4);
    std::memcpy(row + b, &v, 4);
  }
}

void DropCache(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  fdatasync(fd);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  close(fd);
}

struct Result {
  double load_rows_s = 0, get_rows_s = 0, put_rows_s = 0, reclaim_s = 0;
  double scan_rows_s = 0;
  double disk_load = 0, disk_churn = 0, disk_expired = 0, disk_reclaim = 0;  // bytes on disk per row / row bytes
  double anon_per_m = 0, file_per_m = 0;                   // RSS kB growth per million rows
  double miss_rate = 0;
  uint64_t rows_after = 0;
};

Result Run(const Args& args, const Zipf& zipf, const char* engine, size_t row_bytes, bool sync) {
  const std::string dir = args.dir + "/" + engine;
  std::system(("rm -rf '" + dir + "'").c_str());
  DiskTierOptions options;
  options.row_bytes = row_bytes;
  options.sync_every_put = sync;
  options.read_threads = args.read_threads;
  // Load: ranks memory..ids-1 on disk (the hottest `memory` ranks start in memory), in a
  // shuffled order, as a full memory tier would evict them.
  std::vector<uint64_t> order;
  order.reserve(args.ids - args.memory);
  for (uint64_t k = args.memory; k < args.ids; ++k) order.push_back(k);
  std::mt19937_64 rng(7);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int64_t> ids;
  std::vector<uint8_t> rows(args.batch * row_bytes);
  // RSS is counted from here: the benchmark's own buffers exist already.
  const uint64_t anon0 = StatusKb("RssAnon:"), file0 = StatusKb("RssFile:");
  std::unique_ptr<DiskTier> tier;
  std::string data_file;
  if (std::string(engine) == "slotfile") {
    tier = OpenSlotFileTier(dir, options, DiskTierOpen::kCreate);
    data_file = dir + "/disk_tier.slots";
  } else {
    tier = OpenLmdbTier(dir, options, DiskTierOpen::kCreate);
    data_file = dir + "/data.mdb";
  }
  Result r;
  double t0 = Now();
  // with fsync on, every load batch is synced too (sync_every_put)
  uint64_t loaded = 0;
  for (size_t at = 0; at < order.size(); at += args.batch) {
    const size_t n = std::min(args.batch, order.size() - at);
    ids.resize(n);
    for (size_t i = 0; i < n; ++i) {
      ids[i] = IdOfRank(order[at + i]);
      FillRow(rows.data() + i * row_bytes, row_bytes, ids[i], 0);
    }
    tier->Put(ids.data(), rows.data(), n);
    loaded += n;
  }
  tier->Sync();
  r.load_rows_s = static_cast<double>(loaded) / (Now() - t0);
  r.disk_load = static_cast<double>(tier->BytesOnDisk()) / static_cast<double>(tier->Count() * row_bytes);
  r.anon_per_m = static_cast<double>(StatusKb("RssAnon:") - anon0) * 1024.0 / (static_cast<double>(loaded) / 1e6) / 1e6;
  DropCache(data_file);

  // Churn.
  std::deque<int64_t> fifo;
  std::unordered_set<int64_t> resident;
  for (uint64_t k = 0; k < args.memory; ++k) {
    fifo.push_back(IdOfRank(k));
    resident.insert(IdOfRank(k));
  }
  std::unordered_set<int64_t> step_ids;
  std::vector<int64_t> missing, evict;
  std::vector<uint8_t> out(args.batch * row_bytes), found(args.batch), put_rows(args.batch * row_bytes);
  double get_s = 0, put_s = 0;
  uint64_t got = 0, put = 0, asked = 0;
  const int batches = sync ? args.fsync_batches : args.batches;
  for (int b = 0; b < batches; ++b) {
    step_ids.clear();
    missing.clear();
    while (step_ids.size() < args.batch) {
      const int64_t id = IdOfRank(zipf.Draw(rng));
      if (step_ids.insert(id).second && resident.count(id) == 0) missing.push_back(id);
    }
    asked += step_ids.size();
    double t = Now();
    const size_t hits = tier->Get(missing.data(), missing.size(), out.data(), found.data(), true);
    get_s += Now() - t;
    got += hits;
    if (hits != missing.size()) {
      std::fprintf(stderr, "%s: %zu of %zu missing ids not on disk\n", engine, missing.size() - hits, missing.size());
      std::exit(1);
    }
    for (int64_t id : missing) {
      fifo.push_back(id);
      resident.insert(id);
    }
    // Evict as many, oldest first, never a row of this step.
    evict.clear();
    std::vector<int64_t> keep;
    while (evict.size() < missing.size() && !fifo.empty()) {
      const int64_t id = fifo.front();
      fifo.pop_front();
      if (step_ids.count(id)) {
        keep.push_back(id);
        continue;
      }
      evict.push_back(id);
      resident.erase(id);
    }
    for (auto it = keep.rbegin(); it != keep.rend(); ++it) fifo.push_front(*it);
    for (size_t i = 0; i < evict.size(); ++i) FillRow(put_rows.data() + i * row_bytes, row_bytes, evict[i], b + 1);
    t = Now();
    tier->Put(evict.data(), put_rows.data(), evict.size());
    put_s += Now() - t;
    put += evict.size();
  }
  r.get_rows_s = static_cast<double>(got) / get_s;
  r.put_rows_s = static_cast<double>(put) / put_s;
  r.miss_rate = static_cast<double>(got) / static_cast<double>(asked);
  r.file_per_m = static_cast<double>(StatusKb("RssFile:") - std::min(StatusKb("RssFile:"), file0)) * 1024.0 /
                 (static_cast<double>(loaded) / 1e6) / 1e6;
  tier->Sync();
  r.disk_churn = static_cast<double>(tier->BytesOnDisk()) / static_cast<double>(tier->Count() * row_bytes);
  // Expiry: a streaming scan picks half the rows on disk (by a hash of the id), Erase drops them.
  std::vector<int64_t> expired;
  double t = Now();
  uint64_t scanned = 0;
  tier->ForEach(4096, [&](const uint8_t* data, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      int64_t id;
      std::memcpy(&id, data + i * row_bytes, 8);
      if (Mix64(static_cast<uint64_t>(id)) % 2 == 0) expired.push_back(id);
    }
    scanned += n;
  });
  r.scan_rows_s = static_cast<double>(scanned) / (Now() - t);
  for (size_t at = 0; at < expired.size(); at += args.batch) {
    tier->Erase(expired.data() + at, std::min(args.batch, expired.size() - at));
  }
  tier->Sync();
  r.disk_expired = static_cast<double>(tier->BytesOnDisk()) / static_cast<double>(tier->Count() * row_bytes);
  t = Now();
  tier->Reclaim(0);
  r.reclaim_s = Now() - t;
  r.disk_reclaim = static_cast<double>(tier->BytesOnDisk()) / static_cast<double>(tier->Count() * row_bytes);
  r.rows_after = tier->Count();
  tier.reset();
  std::system(("rm -rf '" + dir + "'").c_str());
  return r;
}

// Run() in a child process, so each run's RSS growth starts from the same heap (a process that
// freed an earlier run's index would reuse that memory and show no growth).
Result RunInChild(const Args& args, const Zipf& zipf, const char* engine, size_t row_bytes, bool sync) {
  int fds[2];
  if (pipe(fds) != 0) std::exit(1);
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    const Result r = Run(args, zipf, engine, row_bytes, sync);
    const ssize_t written = write(fds[1], &r, sizeof r);
    _exit(written == static_cast<ssize_t>(sizeof r) ? 0 : 1);
  }
  close(fds[1]);
  Result r;
  const ssize_t got = read(fds[0], &r, sizeof r);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (got != static_cast<ssize_t>(sizeof r) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "run %s %zu failed\n", engine, row_bytes);
    std::exit(1);
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--ids") args.ids = std::stoull(next());
    else if (a == "--memory") args.memory = std::stoull(next());
    else if (a == "--batch") args.batch = std::stoull(next());
    else if (a == "--batches") args.batches = std::stoi(next());
    else if (a == "--fsync-batches") args.fsync_batches = std::stoi(next());
    else if (a == "--rounds") args.rounds = std::stoi(next());
    else if (a == "--zipf") args.zipf_s = std::stod(next());
    else if (a == "--read-threads") args.read_threads = std::stoi(next());
    else if (a == "--row-bytes") {
      args.row_bytes.clear();
      std::string list = next();
      for (size_t at = 0; at < list.size();) {
        size_t comma = list.find(',', at);
        if (comma == std::string::npos) comma = list.size();
        args.row_bytes.push_back(std::stoull(list.substr(at, comma - at)));
        at = comma + 1;
      }
    } else if (a == "--dir") args.dir = next();
    else {
      std::printf("usage: disk-tier [--ids N] [--memory ROWS] [--batch N] [--batches N] [--fsync-batches N]\n"
                  "       [--rounds N] [--zipf S] [--read-threads N] [--row-bytes 148,276] [--dir DIR]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  std::system(("mkdir -p '" + args.dir + "'").c_str());
  std::printf("ids %llu, memory %llu rows, batch %zu distinct, Zipf s=%.2f, %d batches (%d with fsync), "
              "%d rounds, read threads %d\n",
              static_cast<unsigned long long>(args.ids), static_cast<unsigned long long>(args.memory), args.batch,
              args.zipf_s, args.batches, args.fsync_batches, args.rounds, args.read_threads);
  const Zipf zipf(args.ids, args.zipf_s);
  std::printf("| round | engine | row B | fsync | load Put rows/s | churn miss rate | Get rows/s | Put rows/s | "
              "disk/row after load | after churn | after expiring half | after reclaim | reclaim s | scan rows/s | RssAnon B/row | RssFile B/row |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const char* engines[2] = {"slotfile", "lmdb"};
  for (int round = 0; round < args.rounds; ++round) {
    for (size_t row_bytes : args.row_bytes) {
      for (bool sync : {false, true}) {
        for (int e = 0; e < 2; ++e) {
          const char* engine = engines[(e + round) % 2];
          const Result r = RunInChild(args, zipf, engine, row_bytes, sync);
          std::printf("| %d | %s | %zu | %s | %.0f | %.3f | %.0f | %.0f | %.3f | %.3f | %.3f | %.3f | %.2f | %.0f | %.1f | %.1f |\n",
                      round, engine, row_bytes, sync ? "on" : "off", r.load_rows_s, r.miss_rate, r.get_rows_s,
                      r.put_rows_s, r.disk_load, r.disk_churn, r.disk_expired, r.disk_reclaim, r.reclaim_s, r.scan_rows_s, r.anon_per_m,
                      r.file_per_m);
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}
