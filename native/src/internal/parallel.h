// Runs independent tasks (one per shard) on a few short-lived threads.
#ifndef PREFIXREC_INTERNAL_PARALLEL_H_
#define PREFIXREC_INTERNAL_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace prefixrec::internal {

// Calls task(i) for i in [0, tasks) on up to `threads` threads (the caller's included) and
// rethrows the first exception after all threads joined. Threads are started per call: a batch
// is ~100k ids, so the ~50us start-up is noise, and there is no pool to shut down or fork-protect.
template <typename Task>
void ParallelFor(int threads, size_t tasks, const Task& task) {
  size_t workers = std::min<size_t>(threads > 0 ? static_cast<size_t>(threads) : 1, tasks);
  if (workers <= 1) {
    for (size_t i = 0; i < tasks; ++i) task(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto run = [&] {
    for (size_t i = next.fetch_add(1); i < tasks; i = next.fetch_add(1)) {
      try {
        task(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (size_t w = 1; w < workers; ++w) pool.emplace_back(run);
  run();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_PARALLEL_H_
