// Completion and waiting for xccl_rs jobs (see work.h).
#include "xccl_rs/work.h"

#include <atomic>
#include <chrono>
#include <thread>

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include "xccl_rs/errors.h"
#include "xccl_rs/src/ffi.rs.h"

namespace xccl_rs {

std::shared_ptr<WorkState> new_work_state(const std::string& what) {
  static std::atomic<uint64_t> next_key{1};
  auto state = std::make_shared<WorkState>();
  state->what = what;
  state->completion_key = next_key.fetch_add(1, std::memory_order_relaxed);
  state->future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()));
  return state;
}

PinnedBlock staging_alloc_pinned(StagingHandle& handle, size_t bytes) {
  const auto [block, address] = handle.staging->alloc_pinned(bytes);
  return PinnedBlock{block, address};
}

size_t staging_adopt(StagingHandle& handle, size_t address, size_t bytes) {
  return handle.staging->adopt(address, bytes);
}

bool staging_register_host(StagingHandle& handle, size_t address, size_t bytes) {
  return register_host(handle.staging->device(), address, bytes);
}

bool staging_can_register_host(const StagingHandle& handle) {
  return can_register_host(handle.staging->device());
}

void staging_unregister_host(size_t address) {
  unregister_host(address);
}

void staging_copy(StagingHandle& handle, Toward toward, size_t tensor, size_t tensor_offset, size_t block,
                  size_t block_offset, size_t bytes) {
  handle.staging->copy(toward == Toward::Host, tensor, tensor_offset, block, block_offset, bytes);
}

size_t staging_record(StagingHandle& handle, Toward toward) {
  return handle.staging->record(toward == Toward::Host);
}

void staging_synchronize(StagingHandle& handle, size_t event) {
  handle.staging->synchronize(event);
}

void staging_stream_wait(StagingHandle& handle, Toward toward, size_t event) {
  handle.staging->stream_wait(toward == Toward::Host, event);
}

void staging_finish(StagingHandle& handle) {
  handle.staging->finish();
}

namespace {

// Completes the future; for staged device outputs it must run with the copy stream current,
// so that a device-aware future orders its users after the copies back.
void complete_future(WorkState& state, const std::exception_ptr& failure) {
  try {
    if (failure) {
      state.future->setError(failure);
    } else {
      state.future->markCompleted(c10::IValue(state.outputs));
    }
  } catch (...) {
    // A future callback threw: it must not unwind into the Rust progress thread.
  }
}

// work_done calls still running (wait_for_completions).
std::atomic<int> completions_running{0};

// Counts a work_done call while it runs, up to the last of its references being dropped.
struct CountedCompletion {
  CountedCompletion() {
    completions_running.fetch_add(1, std::memory_order_relaxed);
  }
  ~CountedCompletion() {
    completions_running.fetch_sub(1, std::memory_order_release);
  }
};

void complete_work(std::unique_ptr<WorkDone> done, ErrorKind kind, rust::Str error, int64_t source_rank,
                   int64_t started_unix_us);

} // namespace

void work_done(std::unique_ptr<WorkDone> done, ErrorKind kind, rust::Str error, int64_t source_rank,
               int64_t started_unix_us) {
  CountedCompletion counted;
  // Every reference this thread holds to the work's tensors is dropped inside.
  complete_work(std::move(done), kind, error, source_rank, started_unix_us);
}

bool wait_for_completions(std::chrono::milliseconds bound) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  while (completions_running.load(std::memory_order_acquire) > 0) {
    if (std::chrono::steady_clock::now() >= deadline) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

namespace {

void complete_work(std::unique_ptr<WorkDone> done, ErrorKind kind, rust::Str error, int64_t source_rank,
                   int64_t started_unix_us) {
  auto state = done->state;
  std::exception_ptr failure;
  if (kind != ErrorKind::Success) {
    failure = make_error(kind, std::string(error));
  } else {
    try {
      for (auto& [user, staged] : state->copy_back) {
        user.copy_(staged);
      }
    } catch (const std::exception& e) {
      failure = make_error(
          ErrorKind::Communication,
          std::string("xccl_rs: ") + state->what + ": copying the result into a non-contiguous output failed: " + e.what());
    }
  }
  // The core queued the copies back of staged outputs before reporting success (finish()).
  const bool copied_back = !failure && state->staging && state->staging->results_back();
  const std::chrono::duration<float, std::milli> took = std::chrono::steady_clock::now() - state->issued;
  // The op's profiler ranges end before its waiters wake: a caller that leaves the profiler as
  // soon as wait() returns must find them recorded.
  if (state->profile_end) {
    try {
      state->profile_end(started_unix_us);
    } catch (const std::exception& e) {
      LOG(WARNING) << "xccl_rs: ending the profiler's range of " << state->what << " failed: " << e.what();
    }
  }
  {
    std::lock_guard<std::mutex> lock(state->mu);
    state->duration_ms = took.count();
    state->error = failure;
    state->source_rank = source_rank;
    state->done = true;
    // The job no longer needs its buffers; the outputs stay for result() and the future.
    state->keep_alive.clear();
    state->copy_back.clear();
  }
  state->cv.notify_all();
  if (copied_back) {
    // The copies back are enqueued; a device-aware future records its events on the stream
    // current while it is marked completed: the copy stream.
    c10::DeviceGuard device_guard(state->staging->device());
    c10::StreamGuard stream_guard(state->staging->copy_stream());
    complete_future(*state, failure);
  } else {
    complete_future(*state, failure);
  }
  // Only success is reported (a failed or timed-out op must not read as finished).
  if (!failure) {
    if (auto hooks = state->completion_hooks.lock()) {
      hooks->run(state->completion_key, took.count());
    }
  }
}

} // namespace

XcclRsWork::XcclRsWork(int rank, c10d::OpType type, std::shared_ptr<WorkState> state)
    : c10d::Work(rank, type), state_(std::move(state)) {}

// Done means the job finished *and* its future is completed: the future is completed right
// after `done` is set (outside the lock, so that its callbacks may use this Work), and a
// caller who saw the work completed may read the future's value at once.
bool XcclRsWork::isCompleted() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->done) {
      return false;
    }
  }
  return state_->future->completed();
}

#if XCCL_RS_HAS_COMPLETION_HOOKS
float XcclRsWork::getDuration() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  TORCH_CHECK(state_->done, "xccl_rs: getDuration() of a job that has not finished");
  return state_->duration_ms;
}
#endif

bool XcclRsWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done && !state_->error;
}

std::exception_ptr XcclRsWork::exception() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->error;
}

int XcclRsWork::sourceRank() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  TORCH_CHECK(state_->source_rank >= 0, "xccl_rs: sourceRank() is only defined for a finished recv from any source");
  return static_cast<int>(state_->source_rank);
}

std::vector<at::Tensor> XcclRsWork::result() {
  return state_->outputs;
}

bool XcclRsWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(state_->mu);
  if (timeout == ::kNoTimeout) {
    state_->cv.wait(lock, [&] { return state_->done; });
  } else if (!state_->cv.wait_for(lock, timeout, [&] { return state_->done; })) {
    C10_THROW_ERROR(
        DistBackendError,
        "xccl_rs: " + state_->what + ": Work.wait timed out after " + std::to_string(timeout.count()) +
            " ms (the operation is still running; it fails by itself at the group timeout)");
  }
  const std::exception_ptr error = state_->error;
  lock.unlock();
  // See isCompleted: the future completes (with the value or the error) just after `done`.
  // (Its wait() also makes the current stream wait for a device future's events, which
  // make_current_stream_wait repeats.)
  if (!state_->future->completed()) {
    state_->future->wait();
  }
  if (error) {
    std::rethrow_exception(error);
  }
  if (state_->staging) {
    state_->staging->make_current_stream_wait();
  }
  return true;
}

void XcclRsWork::synchronize() {
  wait();
}

c10::intrusive_ptr<c10::ivalue::Future> XcclRsWork::getFuture() {
  return state_->future;
}

} // namespace xccl_rs
