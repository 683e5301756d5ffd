// XcclRsWork: the c10d::Work of one xccl_rs job, and WorkDone, its completion side, which the
// Rust progress thread calls through the bridge when the job finishes.
#pragma once
#include <chrono>

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
// Backend.hpp for its feature macros, version.h for the torch version: every file that sees
// XcclRsWork must see the same class, whichever header it includes first.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "rust/cxx.h"
#include "xccl_rs/device.h"
#include "xccl_rs/hooks.h"
#include "xccl_rs/version.h"

namespace xccl_rs {

// What a Work and its completion share. Tensors stay referenced here until the job is done, so
// the memory the Rust core reads and writes cannot be freed underneath it.
struct WorkState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  int64_t source_rank = -1;
  std::vector<at::Tensor> outputs;    // the future's value and Work::result()
  std::vector<at::Tensor> keep_alive; // every tensor the job's buffers point into
  // Non-contiguous outputs: (the user's tensor, the contiguous staging copy the job wrote).
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::string what; // "allreduce" etc., for messages
  // Accelerator tensors: their host staging (null for a job on host tensors only).
  std::shared_ptr<DeviceStaging> staging;
  // Told when the job succeeds (the backend's completion hooks), with this key and the time
  // from the call to the completion.
  std::weak_ptr<CompletionHooks> completion_hooks;
  uint64_t completion_key = 0;
  std::chrono::steady_clock::time_point issued = std::chrono::steady_clock::now();
  float duration_ms = 0; // from the call to the completion, once done
  // Ends the op's torch.profiler ranges (profile.h), given when the job started running;
  // empty while no profiler is on.
  std::function<void(int64_t started_unix_us)> profile_end;
};

struct WorkDone {
  std::shared_ptr<WorkState> state;
};

// The staging of a job's accelerator tensors, as the Rust core holds it.
struct StagingHandle {
  std::shared_ptr<DeviceStaging> staging;
};

struct PinnedBlock;                  // src/ffi.rs
enum class ErrorKind : std::uint8_t; // src/ffi.rs
enum class Toward : std::uint8_t;    // src/ffi.rs

// The staging primitives (device.h), as the bridge declares them (src/ffi.rs). Called on the
// thread that runs the job; each throws (cxx turns that into the Rust Err) on a device error.
PinnedBlock staging_alloc_pinned(StagingHandle& handle, size_t bytes);
size_t staging_adopt(StagingHandle& handle, size_t address, size_t bytes);
bool staging_register_host(StagingHandle& handle, size_t address, size_t bytes);
bool staging_can_register_host(const StagingHandle& handle);
void staging_unregister_host(size_t address);
void staging_copy(StagingHandle& handle, Toward toward, size_t tensor, size_t tensor_offset, size_t block,
                  size_t block_offset, size_t bytes);
size_t staging_record(StagingHandle& handle, Toward toward);
void staging_synchronize(StagingHandle& handle, size_t event);
void staging_stream_wait(StagingHandle& handle, Toward toward, size_t event);
void staging_finish(StagingHandle& handle);

// Called on the progress thread: copies non-contiguous host outputs back, then completes the
// work and its future (with the exception of `kind`, errors.h, unless it is Success). Never throws.
void work_done(std::unique_ptr<WorkDone> done, ErrorKind kind, rust::Str error, int64_t source_rank,
               int64_t started_unix_us);

// Waits, at most `bound`, until no work_done call is running; true when none is. Python's exit
// calls it (module.cc, through atexit) before the interpreter finalizes: a completion may drop
// the last reference to a tensor that a Python object owns, which takes the GIL, and a thread
// that asks for the GIL while the interpreter finalizes is ended in the middle of C++ frames
// (a "terminate called" abort at exit, after the script's last op returned).
bool wait_for_completions(std::chrono::milliseconds bound);

class XcclRsWork : public c10d::Work {
 public:
  XcclRsWork(int rank, c10d::OpType type, std::shared_ptr<WorkState> state);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  // As with NCCL: the current stream waits for the results (the host waits for the host-side
  // algorithm; accelerators cannot wait on host work through c10's generic interfaces).
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
#if XCCL_RS_HAS_COMPLETION_HOOKS
  // Never reused (a job can complete after its Work is gone): what completion hooks report.
  uint64_t getCompletionKey() const override {
    return state_->completion_key;
  }
  // From the call to the completion (host time; device copies back may still run).
  float getDuration() const override;
#endif

 private:
  std::shared_ptr<WorkState> state_;
};

// A new state whose future will hold a list of tensors.
std::shared_ptr<WorkState> new_work_state(const std::string& what);

} // namespace xccl_rs
