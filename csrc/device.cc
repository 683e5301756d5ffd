// Host staging of accelerator tensors (see device.h for the protocol and its threads).
#include "xccl_rs/device.h"

#include <c10/util/Exception.h>

namespace xccl_rs {

namespace {

// Pinned (page-locked) host memory from the device runtime's caching host allocator: copies
// to and from it run asynchronously, and the allocator keeps a block until the copies that
// use it have finished.
at::Tensor pinned_like(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true), at::MemoryFormat::Contiguous);
}

} // namespace

DeviceStaging::DeviceStaging(c10::Device device)
    : device_(device),
      impl_(device.type()),
      caller_stream_(impl_.getStream(device)),
      copy_stream_(impl_.getStreamFromGlobalPool(device, /*isHighPriority=*/false)),
      inputs_staged_(device.type()),
      outputs_ready_(device.type()) {}

at::Tensor DeviceStaging::stage_in(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(!sealed_, "xccl_rs: staging after seal");
  at::Tensor host = pinned_like(t);
  host.copy_(t, /*non_blocking=*/true); // on the caller's current stream; any strides
  inputs_.push_back(host);
  return host;
}

at::Tensor DeviceStaging::stage_out(const at::Tensor& t, bool read) {
  TORCH_INTERNAL_ASSERT(!sealed_, "xccl_rs: staging after seal");
  at::Tensor host = pinned_like(t);
  if (read) {
    host.copy_(t, /*non_blocking=*/true);
  }
  outputs_.emplace_back(t, host);
  return host;
}

void DeviceStaging::seal() {
  TORCH_INTERNAL_ASSERT(!sealed_, "xccl_rs: seal called twice");
  sealed_ = true;
  // Also for write-only outputs: the job may overwrite them only after the work queued before
  // it (which may still read them) has run.
  inputs_staged_.record(caller_stream_);
}

void DeviceStaging::wait_inputs() {
  TORCH_INTERNAL_ASSERT(sealed_, "xccl_rs: wait_inputs before seal");
  c10::DeviceGuard device_guard(device_);
  inputs_staged_.synchronize();
}

void DeviceStaging::copy_results_back() {
  c10::DeviceGuard device_guard(device_);
  c10::StreamGuard stream_guard(copy_stream_);
  // The copy stream starts after the caller's stream reached the staging point, so the copies
  // back cannot overtake work that was queued before the collective.
  inputs_staged_.block(copy_stream_);
  for (auto& [device_tensor, host] : outputs_) {
    device_tensor.copy_(host, /*non_blocking=*/true);
    impl_.recordDataPtrOnStream(device_tensor.storage().data_ptr(), copy_stream_);
  }
  outputs_ready_.record(copy_stream_);
  results_back_ = true;
  // The host buffers can go: the caching host allocator keeps each block until the copies
  // that use it have finished.
  inputs_.clear();
  outputs_.clear();
}

void DeviceStaging::make_current_stream_wait() {
  if (!results_back_) {
    return; // the job failed before its results came back: nothing to order against
  }
  outputs_ready_.block(impl_.getStream(device_));
}

} // namespace xccl_rs
