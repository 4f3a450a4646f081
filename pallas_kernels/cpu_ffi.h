// What the CPU FFI kernels share (docs/kernels.md#cpu-ffi-kernels): buffer types, the row and slot checks of
// the pool contract, and a parallel loop over work items on XLA's intra-op threads.

#ifndef JAXHYBRID_PALLAS_KERNELS_CPU_FFI_H_
#define JAXHYBRID_PALLAS_KERNELS_CPU_FFI_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxhybrid_cpu {

namespace ffi = xla::ffi;

using F32Buffer = ffi::Buffer<ffi::F32>;
using I32Buffer = ffi::Buffer<ffi::S32>;
using F32Result = ffi::ResultBuffer<ffi::F32>;

// Work items smaller than this many state floats in all run on the calling thread: handing them to other
// threads costs more than it saves.
constexpr int64_t kMinParallelFloats = 1 << 16;

inline std::vector<int64_t> Dims(const F32Buffer& b) { return {b.dimensions().begin(), b.dimensions().end()}; }
inline std::vector<int64_t> Dims(const I32Buffer& b) { return {b.dimensions().begin(), b.dimensions().end()}; }

// Runs work(item, scratch) for item in [0, n) on the calling thread and, for enough work, on XLA's intra-op
// threads. The caller claims items too and waits only for items already claimed, so a helper that never gets a
// thread (the pool busy, or the caller its only thread) delays nothing; such a late helper finds no item left
// and touches no buffer.
struct ParallelState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable all_done;
};

template <typename Work>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t item_floats, size_t scratch_floats, const Work& work) {
  auto state = std::make_shared<ParallelState>();
  auto drain = [state, n, scratch_floats, work]() {
    std::vector<float> scratch;
    int64_t finished = 0;
    for (int64_t item; (item = state->next.fetch_add(1)) < n; ++finished) {
      if (scratch.empty()) scratch.resize(scratch_floats);
      work(item, scratch.data());
    }
    if (finished > 0 && state->done.fetch_add(finished) + finished == n) {
      std::lock_guard<std::mutex> lock(state->mutex);
      state->all_done.notify_all();
    }
  };
  int64_t helpers = 0;
  if (n > 1 && n * item_floats >= kMinParallelFloats) {
    int64_t threads = pool.num_threads();
    helpers = std::min({threads, n, n * item_floats / kMinParallelFloats}) - 1;
  }
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = drain;  // Schedule takes its task by value
    pool.Schedule(std::move(task));
  }
  drain();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->all_done.wait(lock, [&] { return state->done.load() == n; });
}

// Rows are packed by cu_seqlens inside [0, tokens); a slot other than the null slot 0 belongs to one row only
// (two rows writing one slot would race).
inline ffi::Error CheckRows(const char* op, int64_t tokens, int64_t rows, int64_t num_slots, const int32_t* cu,
                            const int32_t* slots) {
  const std::string name(op);
  if (cu[0] < 0 || cu[rows] > tokens) return ffi::Error::InvalidArgument(name + ": cu_seqlens outside [0, T]");
  std::vector<char> taken(num_slots, 0);
  for (int64_t r = 0; r < rows; ++r) {
    if (cu[r + 1] < cu[r]) return ffi::Error::InvalidArgument(name + ": cu_seqlens must not decrease");
    if (slots[r] < 0 || slots[r] >= num_slots) return ffi::Error::InvalidArgument(name + ": slot outside the pool");
    if (slots[r] > 0 && taken[slots[r]]++) {
      return ffi::Error::InvalidArgument(name + ": slot " + std::to_string(slots[r]) + " aimed at by two rows");
    }
  }
  return ffi::Error::Success();
}

// A verify's rows (as CheckRows) and ReplaySSM trackers: each row's ring_start inside the ring of `entries`,
// committed at most `entries`.
inline ffi::Error CheckVerifyRows(const char* op, int64_t tokens, int64_t rows, int64_t num_slots, int64_t entries,
                                  const int32_t* cu, const int32_t* slots, const int32_t* ring_start,
                                  const int32_t* committed) {
  if (auto error = CheckRows(op, tokens, rows, num_slots, cu, slots); error.failure()) return error;
  for (int64_t r = 0; r < rows; ++r) {
    if (ring_start[r] < 0 || ring_start[r] >= entries || committed[r] < 0 || committed[r] > entries) {
      return ffi::Error::InvalidArgument(std::string(op) + ": ring_start or committed outside the ring");
    }
  }
  return ffi::Error::Success();
}

// Outputs of tokens outside every row are zero, as the reference's.
inline void ZeroPaddingOutputs(int64_t tokens, int64_t rows, int64_t per_token, const int32_t* cu, float* o) {
  std::fill(o, o + cu[0] * per_token, 0.0f);
  std::fill(o + cu[rows] * per_token, o + tokens * per_token, 0.0f);
}

// XLA aliases the pools it donates; where it did not, the results start as copies of the inputs.
inline void AliasOrCopy(const F32Buffer& in, F32Result& out) {
  if (out->typed_data() != in.typed_data()) {
    std::memcpy(out->typed_data(), in.typed_data(), in.element_count() * sizeof(float));
  }
}

}  // namespace jaxhybrid_cpu

#endif  // JAXHYBRID_PALLAS_KERNELS_CPU_FFI_H_
