// Work shared among threads by claiming: each thread takes the next item as it finishes one.
//
// at::parallel_for splits a range statically, so a call ends when its slowest share does. On a
// machine whose cores also run the front end (router, Ray, HTTP), a thread preempted mid-call
// held a decode matmul up by half its time; claimed items let the other threads take up its
// share. Which thread computes an item never changes what the item computes.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace cachesvc_claim {

// Calls body(claim) once on each of up to `max_threads` threads (at most the pool's size, and
// one when already inside a parallel region); claim() returns 0, 1, ..., n - 1 across all
// threads, then -1. A body sets up its per-thread scratch once and loops on claim().
template <typename Body>
void claim_items(int64_t n, int64_t max_threads, const Body& body) {
  std::atomic<int64_t> next{0};
  auto claim = [&]() -> int64_t {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  };
  const int64_t threads =
      std::min<int64_t>({static_cast<int64_t>(at::get_num_threads()), n, max_threads});
  if (threads <= 1 || at::in_parallel_region()) {
    body(claim);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) body(claim);
  });
}

}  // namespace cachesvc_claim
