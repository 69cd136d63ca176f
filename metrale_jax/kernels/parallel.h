// Shared by the CPU kernels of metrale_jax/kernels: blocks of work over XLA's intra-op pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace metrale {

// Runs fn(b) for b in [0, blocks): on the caller's thread, helped by up to `threads - 1`
// tasks on XLA's pool; blocks are claimed from a shared counter, and the caller returns once
// every block has run (tasks that start later find none left and only drop their reference).
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t blocks = 0;
  std::function<void(int64_t)> fn;

  void drain() {
    for (int64_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) < blocks;) {
      fn(b);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline void parallel_blocks(xla::ffi::ThreadPool& pool, int64_t threads, int64_t blocks,
                            std::function<void(int64_t)> fn) {
  const int64_t tasks = std::min<int64_t>(threads, blocks) - 1;
  if (tasks <= 0) {
    for (int64_t b = 0; b < blocks; ++b) fn(b);
    return;
  }
  auto work = std::make_shared<Work>();
  work->blocks = blocks;
  work->fn = std::move(fn);
  for (int64_t t = 0; t < tasks; ++t) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < blocks) std::this_thread::yield();
}

}  // namespace metrale
