// The operators' parallel loops on a team of threads that stays awake for a moment after
// each loop, then sleeps.
//
// Why: a decode step of a small model is ~150 loops of 10-100 us each. Under OpenMP with
// OMP_WAIT_POLICY=PASSIVE (what shared machines set) every loop wakes a sleeping thread,
// about 45 us here, so the kernels gave such loops one thread and the second core idled.
// This team's threads spin for kSpinMicros after each loop, as llama.cpp's threads do
// between a graph's operations: the next loop of the same step finds them awake (about a
// microsecond to start), and once the engine stops stepping they sleep.
//
// A loop is split as at::parallel_for splits it (at most one chunk a thread, each at least
// `grain`), and callers write chunks whose results do not depend on the split, so a
// result's bits never depend on the thread count. A loop from a thread that already runs
// one (another Python thread, or a chunk itself) runs inline, whole. Chunks must not throw.
#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pagefleet {

class Team {
 public:
  static constexpr int64_t kSpinMicros = 500;

  // The process's team, sized for at::get_num_threads(); made anew after a fork (threads do
  // not survive one) or when the thread count grows.
  static Team& get() {
    static std::once_flag registered;
    std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, [] { instance() = nullptr; }); });
    const int wanted = std::max(1, at::get_num_threads());
    static std::mutex making;  // Python threads may ask at once
    std::lock_guard<std::mutex> lock(making);
    Team*& team = instance();
    if (team == nullptr || team->num_threads_ < wanted) {
      team = new Team(wanted);  // a replaced team is left running: a loop may still hold it
    }
    return *team;
  }

  // fn(begin, end) over [0, n), as at::parallel_for(0, n, grain, fn).
  template <typename F>
  void parallel_for(int64_t n, int64_t grain, const F& fn) {
    if (n <= 0) return;
    const int64_t threads = std::min<int64_t>({at::get_num_threads(), num_threads_, 0xFF});
    const int64_t num_chunks = std::min(threads, (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
    if (num_chunks <= 1 || in_loop()) {  // in_loop first: a chunk's own thread may hold call_mutex_
      fn(0, n);
      return;
    }
    std::unique_lock<std::mutex> caller(call_mutex_, std::try_to_lock);
    if (!caller.owns_lock()) {  // another thread's loop has the team
      fn(0, n);
      return;
    }
    const int64_t chunk = (n + num_chunks - 1) / num_chunks;
    auto run_chunk = [&](int64_t index) {
      const int64_t begin = index * chunk, end = std::min(n, begin + chunk);
      if (begin < end) fn(begin, end);
    };
    job_ = [](const void* context, int64_t index) { (*static_cast<const decltype(run_chunk)*>(context))(index); };
    context_ = &run_chunk;
    pending_.store(static_cast<int>(num_chunks - 1), std::memory_order_relaxed);
    publish(num_chunks);
    in_loop() = true;
    run_chunk(0);
    in_loop() = false;
    for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) pause(spins);
  }

 private:
  // The published loop: generation in the high bits, its number of chunks in the low byte.
  static constexpr uint64_t kGenerationStep = 1 << 8;

  explicit Team(int num_threads) : num_threads_(num_threads) {
    for (int index = 1; index < num_threads; ++index) std::thread([this, index] { work(index); }).detach();
  }

  static Team*& instance() {
    static Team* team = nullptr;
    return team;
  }

  static bool& in_loop() {
    static thread_local bool inside = false;
    return inside;
  }

  // A spin that gives way: the first spins pause the core (a job is picked up within
  // nanoseconds), later ones yield it, so a thread that needs this core (OpenMP's, which
  // oneDNN's float matmuls run on, or another process's) gets it at once rather than at the
  // end of the spinner's time slice. Spinning with pauses alone made a float32 decode step,
  // whose matmuls are OpenMP's, 3x slower.
  static void pause(int spins) {
#if defined(__x86_64__)
    if (spins < 64) {
      _mm_pause();
      return;
    }
#endif
    std::this_thread::yield();
  }

  // One store (only the caller holding call_mutex_ writes the word), then a wake-up for
  // any sleeper: a sleeper counts itself before it tests the word, so none is missed.
  void publish(int64_t num_chunks) {
    const uint64_t generation = (word_.load(std::memory_order_relaxed) >> 8) + 1;
    word_.store(generation * kGenerationStep | static_cast<uint64_t>(num_chunks), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
  }

  void work(int64_t index) {
    in_loop() = true;
    uint64_t seen = 0;  // the word at construction, which a loop may have replaced before this thread ran
    for (;;) {
      uint64_t word = wait_for_change(seen);
      seen = word;
      if (static_cast<int64_t>(word & 0xFF) > index) {
        job_(context_, index);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  uint64_t wait_for_change(uint64_t seen) {
    auto published = [&](uint64_t word) { return word != seen; };
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
    for (int spins = 1;; ++spins) {
      const uint64_t word = word_.load(std::memory_order_acquire);
      if (published(word)) return word;
      pause(spins);
      if (spins % 64 == 0 && std::chrono::steady_clock::now() > deadline) break;
    }
    std::unique_lock<std::mutex> lock(sleep_mutex_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    uint64_t word;
    wake_.wait(lock, [&] { return published(word = word_.load(std::memory_order_seq_cst)); });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return word;
  }

  const int num_threads_;
  std::mutex call_mutex_;
  void (*job_)(const void*, int64_t) = nullptr;
  const void* context_ = nullptr;
  std::atomic<uint64_t> word_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
};

// at::parallel_for's contract on the team.
template <typename F>
void team_parallel_for(int64_t n, int64_t grain, const F& fn) {
  Team::get().parallel_for(n, grain, fn);
}

}  // namespace pagefleet
