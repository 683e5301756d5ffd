// Host staging of accelerator tensors: the device primitives (see device.h).
#include "xccl_rs/device.h"

#include <dlfcn.h>

#include <ATen/EmptyTensor.h>
#include <ATen/core/CachingHostAllocator.h>
#include <c10/util/Exception.h>

namespace xccl_rs {

namespace {

// Pinned (page-locked) host memory from the caching host allocator of `device_type`'s
// runtime: copies to and from it run asynchronously, and the allocator keeps a block until
// the copies that use it have finished. Taken from that device type's allocator
// (at::getHostAllocator, in every torch we support), not with pinned_memory(true), which asks
// the build's accelerator (at::getAccelerator: CUDA in a CUDA build, whatever the tensor's device).
at::Tensor pinned_bytes(size_t bytes, c10::DeviceType device_type) {
  return at::detail::empty_generic({static_cast<int64_t>(bytes)}, at::getHostAllocator(device_type),
                                   c10::DispatchKeySet(c10::DispatchKey::CPU), at::kByte, at::MemoryFormat::Contiguous);
}

// The CUDA runtime calls that register host memory, from the libcudart a CUDA build of torch
// has loaded (xccl_rs is built without CUDA's headers or libraries); null where none is loaded.
struct CudaRuntime {
  int (*host_register)(void*, size_t, unsigned int) = nullptr;
  int (*host_unregister)(void*) = nullptr;
  int (*get_last_error)() = nullptr;
};

// cudaHostRegisterPortable: page-locked for every CUDA context of the process.
constexpr unsigned int kCudaHostRegisterPortable = 1;

const CudaRuntime& cuda_runtime() {
  static const CudaRuntime runtime = [] {
    for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"}) {
      void* lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD); // only one already loaded: torch's
      if (lib == nullptr) {
        continue;
      }
      CudaRuntime r;
      r.host_register = reinterpret_cast<decltype(r.host_register)>(dlsym(lib, "cudaHostRegister"));
      r.host_unregister = reinterpret_cast<decltype(r.host_unregister)>(dlsym(lib, "cudaHostUnregister"));
      r.get_last_error = reinterpret_cast<decltype(r.get_last_error)>(dlsym(lib, "cudaGetLastError"));
      if (r.host_register != nullptr && r.host_unregister != nullptr && r.get_last_error != nullptr) {
        return r;
      }
    }
    return CudaRuntime{};
  }();
  return runtime;
}

} // namespace

bool can_register_host(c10::Device device) {
  return device.type() == c10::DeviceType::CUDA && cuda_runtime().host_register != nullptr;
}

bool register_host(c10::Device device, size_t address, size_t bytes) {
  const CudaRuntime& cuda = cuda_runtime();
  if (!can_register_host(device) || bytes == 0) {
    return false;
  }
  c10::DeviceGuard device_guard(device);
  if (cuda.host_register(reinterpret_cast<void*>(address), bytes, kCudaHostRegisterPortable) != 0) {
    cuda.get_last_error();
    return false;
  }
  return true;
}

void unregister_host(size_t address) {
  const CudaRuntime& cuda = cuda_runtime();
  if (cuda.host_unregister != nullptr && cuda.host_unregister(reinterpret_cast<void*>(address)) != 0) {
    cuda.get_last_error();
  }
}

DeviceStaging::DeviceStaging(c10::Device device)
    : device_(device),
      impl_(device.type()),
      caller_stream_(impl_.getStream(device)),
      // Placeholders until ensure_streams().
      to_host_(c10::Stream::DEFAULT, device),
      to_device_(c10::Stream::DEFAULT, device),
      outputs_ready_(device.type()) {}

size_t DeviceStaging::add(const at::Tensor& t, bool read, bool write) {
  TORCH_INTERNAL_ASSERT(!sealed_, "xccl_rs: staging after seal");
  tensors_.push_back(Tensor{t, read, write});
  return tensors_.size() - 1;
}

void DeviceStaging::seal() {
  TORCH_INTERNAL_ASSERT(!sealed_, "xccl_rs: seal called twice");
  sealed_ = true;
  c10::DeviceGuard device_guard(device_);
  // Everything the collective copies follows the work queued before it on this stream.
  events_.emplace_back(device_.type());
  events_[0].record(caller_stream_);
}

void DeviceStaging::ensure_streams() {
  TORCH_INTERNAL_ASSERT(sealed_, "xccl_rs: staging used before seal");
  if (!streams_) {
    to_host_ = impl_.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
    to_device_ = impl_.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
    streams_ = true;
  }
}

std::pair<size_t, size_t> DeviceStaging::alloc_pinned(size_t bytes) {
  c10::DeviceGuard device_guard(device_); // no runtime context on another device for this thread
  ensure_streams();
  blocks_.push_back(pinned_bytes(bytes, device_.type()));
  return {blocks_.size() - 1, reinterpret_cast<size_t>(blocks_.back().data_ptr())};
}

size_t DeviceStaging::adopt(size_t address, size_t bytes) {
  blocks_.push_back(at::from_blob(reinterpret_cast<void*>(address), {static_cast<int64_t>(bytes)},
                                  at::TensorOptions().dtype(at::kByte).device(at::kCPU)));
  return blocks_.size() - 1;
}

void DeviceStaging::copy(bool to_host, size_t tensor, size_t tensor_offset, size_t block, size_t block_offset, size_t bytes) {
  TORCH_CHECK(tensor < tensors_.size() && block < blocks_.size(), "xccl_rs: staging copy of tensor ", tensor, " and block ",
              block, ": out of range");
  Tensor& t = tensors_[tensor];
  const auto tensor_bytes = static_cast<size_t>(t.device.nbytes());
  const auto block_bytes = static_cast<size_t>(blocks_[block].nbytes());
  TORCH_CHECK(tensor_offset <= tensor_bytes && bytes <= tensor_bytes - tensor_offset && block_offset <= block_bytes &&
                  bytes <= block_bytes - block_offset,
              "xccl_rs: staging copy of ", bytes, " bytes at ", tensor_offset, " of a tensor of ", tensor_bytes, " and at ",
              block_offset, " of a block of ", block_bytes);
  c10::DeviceGuard device_guard(device_);
  ensure_streams();
  c10::StreamGuard stream_guard(stream(to_host));
  bool& recorded = to_host ? t.recorded_to_host : t.recorded_to_device;
  if (!recorded) {
    impl_.recordDataPtrOnStream(t.device.storage().data_ptr(), stream(to_host));
    recorded = true;
  }
  const auto n = static_cast<int64_t>(bytes);
  at::Tensor host = blocks_[block].narrow(0, static_cast<int64_t>(block_offset), n);
  at::Tensor device;
  if (t.device.is_contiguous()) {
    device = t.device.reshape({-1}).view(at::kByte).narrow(0, static_cast<int64_t>(tensor_offset), n);
  } else {
    // A strided copy cannot be cut into byte ranges: whole, into a contiguous host image.
    TORCH_CHECK(tensor_offset == 0 && bytes == tensor_bytes, "xccl_rs: a non-contiguous tensor is staged whole");
    device = t.device;
    host = host.view(t.device.scalar_type()).view(t.device.sizes());
  }
  if (to_host) {
    host.copy_(device, /*non_blocking=*/true);
  } else {
    device.copy_(host, /*non_blocking=*/true);
  }
}

size_t DeviceStaging::record(bool to_host) {
  c10::DeviceGuard device_guard(device_);
  ensure_streams();
  events_.emplace_back(device_.type());
  events_.back().record(stream(to_host));
  return events_.size() - 1;
}

void DeviceStaging::synchronize(size_t event) {
  TORCH_CHECK(event < events_.size(), "xccl_rs: staging event ", event, " out of range");
  c10::DeviceGuard device_guard(device_);
  events_[event].synchronize();
}

void DeviceStaging::stream_wait(bool to_host, size_t event) {
  TORCH_CHECK(event < events_.size(), "xccl_rs: staging event ", event, " out of range");
  c10::DeviceGuard device_guard(device_);
  ensure_streams();
  events_[event].block(stream(to_host));
}

void DeviceStaging::finish() {
  c10::DeviceGuard device_guard(device_);
  ensure_streams();
  for (auto& t : tensors_) {
    // An output nothing was copied into (an empty chunk) still follows the copy-back stream.
    if (t.write && !t.recorded_to_device) {
      impl_.recordDataPtrOnStream(t.device.storage().data_ptr(), to_device_);
      t.recorded_to_device = true;
    }
  }
  outputs_ready_.record(to_device_);
  results_back_ = true;
  // The host memory can go: the caching host allocator keeps each block until the copies
  // that use it have finished.
  blocks_.clear();
  tensors_.clear();
  events_.clear();
}

void DeviceStaging::make_current_stream_wait() {
  if (!results_back_) {
    return; // the job failed before its results came back: nothing to order against
  }
  outputs_ready_.block(impl_.getStream(device_));
}

} // namespace xccl_rs
