// Accelerator (XPU, CUDA, ...) tensors staged through host memory: the device primitives that
// the Rust core's staging (src/staging/) calls. The core owns the protocol (which tensors go
// through a window of chunk-sized slots, the order of every copy, event and wait); this class
// only holds a job's tensors and offers pinned memory, copies of byte ranges on two streams,
// and events, with c10's device-generic stream, event and copy interfaces only, so that one
// code path serves every device type.
//
// The life of a job on device tensors, and the thread each step runs on:
//   caller    add(): each device tensor of the job, numbered; the core's op buffers name byte
//             ranges of them. seal(): records event 0, `issued`, on the caller's current
//             stream. The call returns: the caller's thread allocates no host memory and makes
//             no copies.
//   job       the primitives, in the order the core decides (src/staging/job.rs): the first
//             one creates the two copy streams (to the host, back to the device);
//             alloc_pinned(), copy(), record(), synchronize(), stream_wait(); finish() after
//             the last copy back records `outputs_ready` on the copy-back stream.
//   caller    Work.wait(): waits for the job, then make_current_stream_wait(): the current
//             stream waits for `outputs_ready` (not for the copies themselves).
// As with NCCL, work the caller queues after the collective and before Work.wait() runs
// concurrently with it: it must not write the inputs. Device tensors are recorded on the
// stream that copies them, so the caching allocator cannot hand their memory out while a copy
// is pending, whatever the caller does; pinned blocks come from the device runtime's caching
// host allocator, which keeps a block until the copies that use it have run.
#pragma once

#include <cstdint>
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
  // A staged tensor as the core sees it (src/staging/mod.rs StagedTensor).
  struct Tensor {
    at::Tensor device; // the user's tensor
    bool read;         // the job reads it: copied to the host
    bool write;        // the job writes it: copied back when the job succeeds
    bool recorded_to_host = false;   // its memory recorded on the to-host stream
    bool recorded_to_device = false; // ... on the copy-back stream
  };

  explicit DeviceStaging(c10::Device device);

  c10::Device device() const {
    return device_;
  }
  // The copy-back stream (a device-aware future is completed with it current).
  const c10::Stream& copy_stream() const {
    return to_device_;
  }
  const std::vector<Tensor>& tensors() const {
    return tensors_;
  }

  // Caller: a tensor of the job; returns its number. `read`/`write` as in Tensor.
  size_t add(const at::Tensor& t, bool read, bool write);
  // Caller, once, after the last add(): records event 0 (`issued`) on the current stream.
  void seal();

  // The thread that runs the job (each throws on a device error or a range out of bounds):
  // `bytes` of pinned host memory: (block number, address).
  std::pair<size_t, size_t> alloc_pinned(size_t bytes);
  // A block on `bytes` of host memory at `address` that register_host() registered and that
  // stays registered and mapped until the job ends (the core's shared staging arena, or a
  // peer's, src/staging/shared.rs): its number.
  size_t adopt(size_t address, size_t bytes);
  // Queues a copy of `bytes` bytes between byte `tensor_offset` of tensor `tensor` and byte
  // `block_offset` of pinned block `block`, on the to-host stream or the copy-back stream. A
  // non-contiguous tensor is copied whole only (offset 0, all its bytes).
  void copy(bool to_host, size_t tensor, size_t tensor_offset, size_t block, size_t block_offset, size_t bytes);
  // Records a new event on a stream; returns its number.
  size_t record(bool to_host);
  void synchronize(size_t event);
  void stream_wait(bool to_host, size_t event);
  // After the last copy back: records `outputs_ready` on the copy-back stream; releases the
  // job's pinned memory and tensors.
  void finish();
  bool results_back() const {
    return results_back_;
  }

  // Caller: the current stream of the device waits for `outputs_ready`.
  void make_current_stream_wait();

 private:
  // The first primitive on the job's thread takes the copy streams from the pool (the first
  // use of a pool creates its streams: milliseconds the caller's thread should not pay).
  void ensure_streams();
  c10::Stream& stream(bool to_host) {
    return to_host ? to_host_ : to_device_;
  }

  c10::Device device_;
  c10::impl::VirtualGuardImpl impl_;
  c10::Stream caller_stream_;
  c10::Stream to_host_;   // device -> host copies
  c10::Stream to_device_; // host -> device copies
  bool streams_ = false;
  bool sealed_ = false;
  bool results_back_ = false;
  std::vector<Tensor> tensors_;
  std::vector<at::Tensor> blocks_;   // pinned host memory, flat bytes
  std::vector<c10::Event> events_;   // events_[0]: `issued`
  c10::Event outputs_ready_;         // after every copy back
};

// Page-locks `bytes` of host memory at `address`, shared memory mapped by this process, for
// `device`'s runtime where it has a way to: CUDA's cudaHostRegister (portable: for every device
// of the process), from the CUDA runtime that torch loaded. Returns false where the runtime has
// none (XPU in torch today, a CPU-only torch) or refused (its error is cleared, so it does not
// surface in a later call).
bool register_host(c10::Device device, size_t address, size_t bytes);
// Whether register_host() has a way to register memory for `device` (it may still refuse).
bool can_register_host(c10::Device device);
// Ends a registration that register_host() made. Never throws.
void unregister_host(size_t address);

} // namespace xccl_rs
