// The three phases of EmbeddingStore::ApplyGradients (internal/store_impl.h), each checked on
// its own against a plain reference, and ValidateOptions' max_rows bound.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "internal/hash.h"
#include "internal/scratch.h"
#include "internal/store_impl.h"
#include "prefixrec/store_error.h"

namespace prefixrec {
namespace {

constexpr int kDim = 3;

// SGD with lr 0.5 and zero initial rows: an update leaves exactly -0.5 * (summed gradient).
StoreOptions SgdOptions() {
  StoreOptions o;
  o.dim = kDim;
  o.optimizer.kind = OptimizerKind::kSgd;
  o.optimizer.learning_rate = 0.5f;
  o.initializer.kind = InitializerKind::kZeros;
  o.num_shards = 8;
  o.num_threads = 2;
  return o;
}

// A batch large enough for two threads (ThreadsFor), with repeats, negative ids and gradients
// whose sums are exact in float32 whatever the order.
struct Batch {
  std::vector<int64_t> ids;
  std::vector<float> grads;
};
Batch MakeBatch(size_t n) {
  Batch b;
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int64_t>((i * 7919) % 1000) - 300;
    b.ids.push_back(id);
    for (int j = 0; j < kDim; ++j) b.grads.push_back(0.25f * static_cast<float>(i % 5) - j);
  }
  return b;
}

TEST_CASE("PartitionGradients groups every position by part, whole shards per part") {
  EmbeddingStore::Impl store(SgdOptions());
  const Batch b = MakeBatch(20000);
  const size_t n = b.ids.size();
  const int threads = store.ThreadsFor(n);
  REQUIRE(threads == 2);
  internal::ScratchLease scratch;
  const auto p = store.PartitionGradients(b.ids.data(), n, threads, *scratch);
  CHECK(p.parts == 2);
  CHECK(p.tasks == EmbeddingStore::Impl::RangeTasks(threads));
  REQUIRE(p.cursor.size() == p.tasks * (p.parts + 1));
  for (size_t i = 0; i < n; ++i) {
    const uint64_t h = internal::HashId(b.ids[i]);
    REQUIRE(p.hash[i] == static_cast<uint32_t>(h));
    REQUIRE(p.shard_of[i] == store.ShardOf(h));
  }
  std::vector<int> seen(n, 0);
  std::map<size_t, size_t> part_of_shard;
  std::vector<size_t> per_part(p.parts, 0);
  for (size_t t = 0; t < p.tasks; ++t) {
    const size_t range_begin = n * t / p.tasks, range_end = n * (t + 1) / p.tasks;
    const size_t* starts = p.cursor.data() + t * (p.parts + 1);
    CHECK(starts[0] == range_begin);
    CHECK(starts[p.parts] == range_end);
    for (size_t part = 0; part < p.parts; ++part) {
      for (size_t k = starts[part]; k < starts[part + 1]; ++k) {
        const uint32_t i = p.order[k];
        REQUIRE(i >= range_begin);
        REQUIRE(i < range_end);
        if (k > starts[part]) REQUIRE(p.order[k - 1] < i);  // input order kept
        ++seen[i];
        ++per_part[part];
        const auto [it, added] = part_of_shard.emplace(p.shard_of[i], part);
        REQUIRE(it->second == part);  // a shard belongs to one part only
      }
    }
  }
  for (size_t i = 0; i < n; ++i) REQUIRE(seen[i] == 1);  // a permutation
  CHECK(per_part[0] > 0);
  CHECK(per_part[1] > 0);
}

TEST_CASE("SumGradients sums each distinct id once, first occurrence kept") {
  EmbeddingStore::Impl store(SgdOptions());
  const Batch b = MakeBatch(20000);
  const size_t n = b.ids.size();
  const int threads = store.ThreadsFor(n);
  internal::ScratchLease scratch;
  const auto p = store.PartitionGradients(b.ids.data(), n, threads, *scratch);
  const auto groups = store.SumGradients(p, b.ids.data(), b.grads.data(), threads, *scratch);
  REQUIRE(groups.size() == p.parts);

  std::map<int64_t, std::vector<float>> want;
  std::map<int64_t, size_t> first;
  for (size_t i = 0; i < n; ++i) {
    auto [it, added] = want.emplace(b.ids[i], std::vector<float>(kDim, 0.0f));
    if (added) first[b.ids[i]] = i;
    for (int j = 0; j < kDim; ++j) it->second[j] += b.grads[i * kDim + j];
  }
  std::set<int64_t> got_ids;
  for (const auto& g : groups) {
    CHECK(g.first_bad == SIZE_MAX);
    for (size_t d = 0; d < g.distinct; ++d) {
      const int64_t id = g.key[d];
      CAPTURE(id);
      REQUIRE(got_ids.insert(id).second);  // no id in two places
      REQUIRE(want.count(id) == 1);
      CHECK(g.first[d] == first[id]);
      for (int j = 0; j < kDim; ++j) CHECK(g.sums[d * kDim + j] == want[id][j]);
    }
  }
  CHECK(got_ids.size() == want.size());
}

TEST_CASE("SumGradients refuses a non-finite gradient, naming the first such row") {
  EmbeddingStore::Impl store(SgdOptions());
  Batch b = MakeBatch(20000);
  b.grads[15000 * kDim] = std::numeric_limits<float>::infinity();
  b.grads[123 * kDim + 1] = std::nanf("");
  const size_t n = b.ids.size();
  const int threads = store.ThreadsFor(n);
  internal::ScratchLease scratch;
  const auto p = store.PartitionGradients(b.ids.data(), n, threads, *scratch);
  std::string message;
  try {
    store.SumGradients(p, b.ids.data(), b.grads.data(), threads, *scratch);
  } catch (const StoreError& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    message = e.what();
  }
  CHECK(message == "grads row 123 (id " + std::to_string(b.ids[123]) +
                       ") contains nan; gradients must be finite");
}

TEST_CASE("UpdateRows updates each distinct id that has a row once, and no other") {
  EmbeddingStore::Impl store(SgdOptions());
  const Batch b = MakeBatch(20000);
  const size_t n = b.ids.size();
  // Rows for the ids up to 599 only (ids -300 .. 699 are in the batch).
  std::vector<int64_t> admitted;
  for (int64_t id = -300; id < 600; ++id) admitted.push_back(id);
  std::vector<float> rows(admitted.size() * kDim);
  store.LookupDistinct(admitted.data(), admitted.size(), /*train=*/true, 1000.0, rows.data());
  REQUIRE(store.rows.load() == admitted.size());

  const int threads = store.ThreadsFor(n);
  internal::ScratchLease scratch;
  const auto p = store.PartitionGradients(b.ids.data(), n, threads, *scratch);
  const auto groups = store.SumGradients(p, b.ids.data(), b.grads.data(), threads, *scratch);
  const uint64_t updated = store.UpdateRows(p, groups, /*step=*/7, 2000.0, /*l2=*/0.0f, threads);
  CHECK(updated == admitted.size());
  CHECK(store.rows.load() == admitted.size());  // no row added for the other ids

  std::map<int64_t, std::vector<float>> sums;
  for (size_t i = 0; i < n; ++i) {
    auto& sum = sums.emplace(b.ids[i], std::vector<float>(kDim, 0.0f)).first->second;
    for (int j = 0; j < kDim; ++j) sum[j] += b.grads[i * kDim + j];
  }
  store.LookupDistinct(admitted.data(), admitted.size(), /*train=*/false, 2000.0, rows.data());
  for (size_t k = 0; k < admitted.size(); ++k) {
    const int64_t id = admitted[k];
    CAPTURE(id);
    for (int j = 0; j < kDim; ++j) CHECK(rows[k * kDim + j] == -0.5f * sums[id][j]);
    const uint64_t h = internal::HashId(id);
    const auto& shard = *store.shards[store.ShardOf(h)];
    const uint32_t row = shard.Find(id, static_cast<uint32_t>(h));
    REQUIRE(row != internal::Shard::kEmpty);
    CHECK(shard.Header(row)->update_count() == 1);
    CHECK(shard.Header(row)->step == 7);
  }
}

TEST_CASE("ValidateOptions refuses a max_rows the Python facade refuses") {
  StoreOptions o = SgdOptions();
  o.max_rows = uint64_t{1} << 63;
  std::string message;
  try {
    ValidateOptions(o);
  } catch (const StoreError& e) {
    message = e.what();
  }
  CHECK(message == "max_rows must be in 0..2**63-1 (0: unbounded), got 9223372036854775808");
  o.max_rows = (uint64_t{1} << 63) - 1;
  CHECK_NOTHROW(ValidateOptions(o));
  o.max_rows = 0;
  CHECK_NOTHROW(ValidateOptions(o));
}

}  // namespace
}  // namespace prefixrec
