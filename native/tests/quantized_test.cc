// Quantized exports (prefixrec/quantized.h): the float16 conversion at its edges, and the
// serving table's hash (linear probing, backward-shift removal, swap-with-last rows) against a
// std::map over many deltas of upserts and removals.
#include "prefixrec/quantized.h"

#include <doctest/doctest.h>
#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "prefixrec/store_error.h"

namespace prefixrec {
namespace {

class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/quantized_test.XXXXXX";
    char* made = mkdtemp(pattern);
    REQUIRE(made != nullptr);
    path_ = made;
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::vector<float> Dequantized(QuantFormat format, const std::vector<float>& row) {
  std::vector<uint8_t> stored(QuantRowBytes(format, row.size()));
  QuantizeRows(format, row.data(), 1, row.size(), nullptr, stored.data());
  std::vector<float> out(row.size());
  DequantizeRow(format, stored.data(), row.size(), out.data());
  return out;
}

TEST_CASE("float16 rounds to nearest even and keeps its subnormals") {
  const std::vector<float> row = {0.0f, -0.0f, 1.0f, 65504.0f, -65504.0f, 0x1.0p-24f, 0x1.0p-14f,
                                  1.0f + 0x1.0p-11f, 1.0f + 0x1.8p-11f, 0x1.0p-26f, 3.0e-8f};
  const std::vector<float> want = {0.0f, -0.0f, 1.0f, 65504.0f, -65504.0f, 0x1.0p-24f, 0x1.0p-14f,
                                   1.0f,  // a tie: to the even neighbour
                                   1.0f + 0x1.0p-10f, 0.0f, 0x1.0p-25f * 2};
  const std::vector<float> got = Dequantized(QuantFormat::kFloat16, row);
  for (size_t j = 0; j < row.size(); ++j) CHECK_MESSAGE(got[j] == want[j], j);
  CHECK(std::signbit(got[1]));
}

TEST_CASE("int8 and int4: equal values exact, the range covered to its ends") {
  for (QuantFormat format : {QuantFormat::kInt8, QuantFormat::kInt4}) {
    const std::vector<float> constant(5, -2.75f);
    CHECK(Dequantized(format, constant) == constant);
    const std::vector<float> ends = {-1.0f, 3.0f, 0.5f};
    const std::vector<float> got = Dequantized(format, ends);
    CHECK(got[0] == -1.0f);
    CHECK(std::fabs(got[1] - 3.0f) < 1e-6f);
  }
}

TEST_CASE("a table follows deltas of upserts and removals as a map does") {
  TempDir dir;
  const QuantFormat format = QuantFormat::kInt8;
  const uint32_t dim = 3;
  const size_t row_bytes = QuantRowBytes(format, dim);
  std::mt19937_64 rng(7);
  std::map<int64_t, std::vector<uint8_t>> model;
  auto row_for = [&](int64_t id, int version) {
    std::vector<float> values = {static_cast<float>(id % 97), static_cast<float>(version),
                                 static_cast<float>((id * 7 + version) % 13)};
    std::vector<uint8_t> out(row_bytes);
    QuantizeRows(format, values.data(), 1, dim, &id, out.data());
    return out;
  };
  QuantizedContents snap;
  snap.format = format;
  snap.dim = dim;
  for (int64_t id = -50; id < 50; ++id) {
    snap.ids.push_back(id * 3);
    std::vector<uint8_t> row = row_for(id * 3, 0);
    snap.rows.insert(snap.rows.end(), row.begin(), row.end());
    model[id * 3] = row;
  }
  WriteQuantizedSnapshot(dir.sub("snap"), snap);
  auto table = QuantizedTable::Load(dir.sub("snap"));
  for (int version = 1; version <= 60; ++version) {
    // ids from a small range: removals and upserts collide in the probe runs
    std::map<int64_t, bool> change;  // id -> removed?
    const int n = 1 + static_cast<int>(rng() % 80);
    for (int k = 0; k < n; ++k) change[static_cast<int64_t>(rng() % 400) - 200] = (rng() % 3) == 0;
    QuantizedContents delta;
    delta.format = format;
    delta.dim = dim;
    delta.sequence = static_cast<uint64_t>(version);
    for (const auto& [id, removed] : change) {
      if (removed) {
        delta.tombstones.push_back(id);
        model.erase(id);
      } else {
        std::vector<uint8_t> row = row_for(id, version);
        delta.ids.push_back(id);
        delta.rows.insert(delta.rows.end(), row.begin(), row.end());
        model[id] = row;
      }
    }
    const std::string path = dir.sub("delta-" + std::to_string(version));
    WriteQuantizedDelta(path, delta);
    CHECK(table->ApplyDelta(path) == static_cast<uint64_t>(version));
    REQUIRE(table->size() == model.size());
    std::vector<int64_t> probe;
    for (int64_t id = -210; id < 210; ++id) probe.push_back(id);
    std::vector<float> got(probe.size() * dim);
    table->Lookup(probe.data(), probe.size(), got.data());
    for (size_t i = 0; i < probe.size(); ++i) {
      auto it = model.find(probe[i]);
      std::vector<float> want(dim, 0.0f);
      if (it != model.end()) DequantizeRow(format, it->second.data(), dim, want.data());
      for (uint32_t j = 0; j < dim; ++j) REQUIRE_MESSAGE(got[i * dim + j] == want[j], probe[i]);
    }
  }
  CHECK_THROWS_AS(table->ApplyDelta(dir.sub("delta-3")), StoreError);  // out of order
}

}  // namespace
}  // namespace prefixrec
