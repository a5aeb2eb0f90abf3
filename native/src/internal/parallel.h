// Runs independent tasks (one per shard, or per range of a batch) on a few threads.
#ifndef PREFIXREC_INTERNAL_PARALLEL_H_
#define PREFIXREC_INTERNAL_PARALLEL_H_

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace prefixrec::internal {

// One ParallelFor call's shared state. Lives on the caller's stack; workers only touch it between
// registering (under the pool's mutex, while the job is published) and deregistering.
struct ParallelJob {
  void (*run_one)(const void* task, size_t i) = nullptr;
  const void* task = nullptr;
  size_t tasks = 0;
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;

  void Drain() {
    for (size_t i = next.fetch_add(1); i < tasks; i = next.fetch_add(1)) {
      try {
        run_one(task, i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
      }
    }
  }
};

// A process-wide set of sleeping worker threads that help one ParallelFor call at a time (a
// batch of ~100k ids takes a few milliseconds, so starting threads on every call, ~50-100us
// each, was a visible share). A call that finds the pool busy (another thread's call, or a
// nested call) starts its own threads instead, so calls never wait for each other. After fork()
// the child gets a fresh pool (the parent's threads do not exist there); the old one is leaked.
class WorkerPool {
 public:
  // The pool of this process, or null if none could be made.
  static WorkerPool* Get() {
    static std::atomic<WorkerPool*> pool{nullptr};
    static std::mutex make_mu;
    WorkerPool* p = pool.load(std::memory_order_acquire);
    if (p != nullptr && p->pid_ == getpid()) return p;
    std::lock_guard<std::mutex> lock(make_mu);
    p = pool.load(std::memory_order_acquire);
    if (p == nullptr || p->pid_ != getpid()) {
      p = new WorkerPool();  // a parent's pool is leaked in a forked child on purpose
      pool.store(p, std::memory_order_release);
    }
    return p;
  }

  // Runs the job with up to `helpers` pool threads besides the caller. False if the pool is busy.
  bool Run(ParallelJob* job, size_t helpers) {
    bool expected = false;
    if (!busy_.compare_exchange_strong(expected, true, std::memory_order_acquire)) return false;
    try {
      EnsureWorkers(helpers);
    } catch (...) {
      busy_.store(false, std::memory_order_release);
      return false;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      wanted_ = helpers;
      ++generation_;
    }
    wake_.notify_all();
    job->Drain();
    {
      std::unique_lock<std::mutex> lock(mu_);
      job_ = nullptr;  // late workers no longer join
      done_.wait(lock, [&] { return active_ == 0; });
    }
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  WorkerPool() : pid_(getpid()) {}

  void EnsureWorkers(size_t count) {
    std::lock_guard<std::mutex> lock(mu_);
    while (workers_ < count) {
      std::thread([this] { Loop(); }).detach();  // lives as long as the process
      ++workers_;
    }
  }

  void Loop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (job_ == nullptr || wanted_ == 0) continue;
      --wanted_;
      ParallelJob* job = job_;
      ++active_;
      lock.unlock();
      job->Drain();
      lock.lock();
      if (--active_ == 0) done_.notify_all();
    }
  }

  const pid_t pid_;
  std::atomic<bool> busy_{false};
  std::mutex mu_;
  std::condition_variable wake_, done_;
  ParallelJob* job_ = nullptr;
  size_t wanted_ = 0;      // helpers still allowed to join the current job
  size_t active_ = 0;      // helpers inside the current job
  size_t workers_ = 0;
  uint64_t generation_ = 0;
};

// Calls task(i) for i in [0, tasks) on up to `threads` threads (the caller's included) and
// rethrows the first exception after all of them finished.
template <typename Task>
void ParallelFor(int threads, size_t tasks, const Task& task) {
  size_t workers = std::min<size_t>(threads > 0 ? static_cast<size_t>(threads) : 1, tasks);
  if (workers <= 1) {
    for (size_t i = 0; i < tasks; ++i) task(i);
    return;
  }
  ParallelJob job;
  job.run_one = [](const void* t, size_t i) { (*static_cast<const Task*>(t))(i); };
  job.task = &task;
  job.tasks = tasks;
  WorkerPool* pool = WorkerPool::Get();
  if (pool == nullptr || !pool->Run(&job, workers - 1)) {
    std::vector<std::thread> started;
    started.reserve(workers - 1);
    try {
      for (size_t w = 1; w < workers; ++w) started.emplace_back([&job] { job.Drain(); });
    } catch (...) {
      // could not start a thread: the caller does the remaining work alone
    }
    job.Drain();
    for (auto& t : started) t.join();
  }
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_PARALLEL_H_
