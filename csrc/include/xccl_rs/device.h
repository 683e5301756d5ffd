// Accelerator (XPU, CUDA, ...) tensors through host staging, with c10's device-generic stream,
// event and copy interfaces only, so that one code path serves every device type.
//
// The life of a job on device tensors, and the thread each step runs on:
//   caller    stage_in/stage_out: device->host copies into pinned host buffers, enqueued on the
//             caller's current stream (so they follow the work already queued there); seal()
//             records `inputs_staged` after the last one. The call returns at once.
//   progress  wait_inputs(): blocks until `inputs_staged` has fired; then the host algorithm
//             runs on the host buffers; then copy_results_back(): host->device copies on the
//             copy stream, `outputs_ready` recorded after them, and the work completes.
//   caller    Work.wait(): waits for the host algorithm, then makes the current stream wait
//             for `outputs_ready` (it does not wait for the copies themselves).
// Device tensors are recorded on the copy stream, so the caching allocator cannot hand their
// memory out while a copy back is pending, whatever the caller does with them.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace xccl_rs {

class DeviceStaging {
 public:
  explicit DeviceStaging(c10::Device device);

  c10::Device device() const {
    return device_;
  }
  const c10::Stream& copy_stream() const {
    return copy_stream_;
  }

  // A host copy of `t` that the job reads.
  at::Tensor stage_in(const at::Tensor& t);
  // A host buffer the job writes; its bytes go back into `t` when the job succeeds. `read`:
  // the job also reads it (in-place ops), so it starts as a copy of `t`.
  at::Tensor stage_out(const at::Tensor& t, bool read);
  // Records `inputs_staged` on the caller's stream; call once, after the last stage_*.
  void seal();

  // Progress thread: returns when the host buffers hold the inputs. Throws on a device error.
  void wait_inputs();
  // Progress thread: enqueues the host->device copies on the copy stream and records
  // `outputs_ready` after them. Throws on a device error.
  void copy_results_back();

  // Caller: the current stream of the device waits for `outputs_ready`.
  void make_current_stream_wait();

 private:
  c10::Device device_;
  c10::impl::VirtualGuardImpl impl_;
  c10::Stream caller_stream_;
  c10::Stream copy_stream_;
  c10::Event inputs_staged_;
  c10::Event outputs_ready_;
  bool sealed_ = false;
  bool results_back_ = false;
  std::vector<at::Tensor> inputs_;                             // host copies the job reads
  std::vector<std::pair<at::Tensor, at::Tensor>> outputs_;     // (device tensor, host buffer)
};

} // namespace xccl_rs
