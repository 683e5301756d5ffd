// Accelerator (XPU, CUDA, ...) tensors through host staging, with c10's device-generic stream,
// event and copy interfaces only, so that one code path serves every device type.
//
// The Rust core runs large collectives in chunks (src/pipeline.rs: chunk k of an op is the byte
// range [k*c, (k+1)*c) of each of its buffers); the staging moves the same chunks, so that the
// copies overlap the communication. The life of a job on device tensors, and the thread each
// step runs on:
//   caller    stage(): a placeholder address range per device tensor (the core's op buffers
//             point into it); add_op(): which ranges of which buffers each op uses, and its
//             chunk size; seal(): records `issued` on the caller's current stream. The call
//             returns: the caller's thread allocates no host memory and makes no copies.
//   progress  host_buffers(): the pinned host memory and the two copy streams. A contiguous
//             tensor of a chunked op gets no host buffer of its size: its chunks take turns in
//             a window of chunk-sized slots (three sets, so that chunk k+1 copies out and
//             chunk k-1 copies back while the host works on chunk k), and wait_chunk() tells
//             the core where each chunk is. Other tensors (strided ones, ops that are not
//             chunked, windows that would not be smaller) get a whole buffer, and the core
//             moves its op buffers there for the whole job (src/pipeline.rs).
//             First wait_chunk(): the copy-out stream waits for `issued` (so the copies follow
//             the work queued before the collective). For each chunk: wait_chunk() enqueues
//             its device->host copies on it if they are not yet, with an event after them,
//             blocks until the event has fired, then enqueues the next chunk's copies (one
//             chunk ahead, not all at once: device.cc says why); the host algorithm runs on it;
//             copy_back_chunk() enqueues its host->device copies on the copy-back stream,
//             then (windowed chunks) the event that frees the chunk's window set. At the end finish() records `outputs_ready` on that stream; the work completes.
//   caller    Work.wait(): waits for the host algorithm, then makes the current stream wait
//             for `outputs_ready` (it does not wait for the copies themselves).
// So while the host works on chunk k, the device copies chunk k+1 out and chunk k-1 back, on
// two streams (two directions of the link). As with NCCL, work the caller queues after the
// collective and before Work.wait() runs concurrently with it: it must not write the inputs.
// Device tensors are recorded on the stream that copies them, so the caching allocator cannot
// hand their memory out while a copy is pending, whatever the caller does.
// Non-contiguous device tensors are copied whole (a strided copy cannot be cut into byte ranges).
#pragma once

#include <cstdint>
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

// An address range as the core sees it: for a staged tensor, a placeholder (above).
struct HostRange {
  size_t ptr;
  size_t bytes;
};

// The pinned host memory behind a placeholder range.
struct HostBinding {
  size_t placeholder;
  size_t bytes;
  size_t host;
};

// A buffer of an op as the core sees it: a host address range, and whether the op writes it.
struct OpBuffer {
  size_t ptr;
  size_t bytes;
  bool output;
};

class DeviceStaging {
 public:
  explicit DeviceStaging(c10::Device device);

  c10::Device device() const {
    return device_;
  }
  const c10::Stream& copy_stream() const {
    return copy_stream_;
  }

  // A host buffer the job reads: its contents come from `t`. Returns its placeholder range.
  HostRange stage_in(const at::Tensor& t) {
    return stage(t, /*read=*/true, /*write=*/false);
  }
  // A host buffer the job writes; its bytes go back into `t` when the job succeeds. `read`: the
  // job also reads it (in-place ops), so it starts as a copy of `t`. Returns its placeholder range.
  HostRange stage_out(const at::Tensor& t, bool read) {
    return stage(t, read, /*write=*/true);
  }
  // Op `index` of the job uses these buffers (those inside staged buffers are recorded), in
  // chunks of `chunk_bytes` (SIZE_MAX: one chunk).
  void add_op(size_t index, const std::vector<OpBuffer>& buffers, size_t chunk_bytes);
  // Records `issued` on the caller's current stream; call once, after the last add_op.
  void seal();

  // Thread that runs the job, first: allocates the pinned host memory (from the device
  // runtime's caching host allocator), a window of chunk-sized slots for the chunks of large
  // contiguous tensors, whole buffers for the others, and says which placeholder range each
  // whole buffer stands for.
  std::vector<HostBinding> host_buffers();
  // Progress thread: returns when chunk `chunk` of op `op`'s inputs is on the host, with where
  // its windowed ranges are (placeholder range -> window memory).
  std::vector<HostBinding> wait_chunk(size_t op, size_t chunk);
  // Progress thread: chunk `chunk` of op `op`'s outputs is final; enqueues its copies back.
  void copy_back_chunk(size_t op, size_t chunk);
  // Progress thread, after the job succeeded: the remaining copies back (non-contiguous
  // tensors), then `outputs_ready`. Throws on a device error.
  void finish();

  // Caller: the current stream of the device waits for `outputs_ready`.
  void make_current_stream_wait();

 private:
  struct Buffer {
    at::Tensor device;       // the user's tensor
    size_t placeholder;      // where the core's op buffers point (src/pipeline.rs)
    bool read;
    bool write;
    bool windowed = false;   // its chunks go through the window (host_buffers())
    at::Tensor device_bytes; // the tensor's bytes, flat, when contiguous (copied by chunks)
    at::Tensor host;         // its whole pinned host buffer, contiguous (not windowed)
    bool recorded = false;   // device memory recorded on the copy-back stream
  };
  // A byte range of a staged buffer that an op uses.
  struct View {
    size_t buffer;
    size_t offset; // bytes from the buffer's start
    size_t bytes;
    bool output;
    size_t slot = 0; // its slot in a window set (windowed buffers)
  };
  struct OpPlan {
    size_t chunk_bytes = SIZE_MAX;
    size_t chunks = 1;
    std::vector<View> views;
    size_t first_event = 0; // index of chunk 0 in copy_order_ and chunk_events_
    bool windowed = false;  // some of its views go through the window
  };

  HostRange stage(const at::Tensor& t, bool read, bool write);
  // Decides which buffers go through the window and allocates it, or their whole buffers.
  void plan_window();
  // Where chunk number `index` of the job (in copy_order_) keeps `view` in the window.
  size_t window_offset(size_t index, const View& view) const;
  // Copies chunk `chunk` (the job's chunk number `index`) of `view` between device and host.
  void copy_range(const OpPlan& plan, const View& view, size_t chunk, size_t index, bool to_host);
  const OpPlan* plan_of(size_t op) const;
  // First wait_chunk: the copy-out stream waits for `issued`; whole copies of strided tensors.
  void begin_copies_out();
  // Enqueues the device->host copies of the chunks up to copy_order_[index] not yet enqueued.
  void launch_copies_out_through(size_t index);

  c10::Device device_;
  c10::impl::VirtualGuardImpl impl_;
  c10::Stream caller_stream_;
  c10::Stream copy_out_stream_; // device -> host (from host_buffers())
  c10::Stream copy_stream_;     // host -> device, the copies back (from host_buffers())
  c10::Event issued_;           // the caller's stream at the call
  c10::Event outputs_ready_;    // after every copy back
  size_t next_placeholder_; // the next free placeholder address
  bool sealed_ = false;
  bool launched_ = false;
  bool results_back_ = false;
  std::vector<Buffer> buffers_;
  std::vector<OpPlan> ops_;
  std::vector<std::pair<size_t, size_t>> copy_order_; // (op, chunk), in the order the core uses them
  size_t next_copy_out_ = 0;                           // copy_order_'s first chunk not enqueued yet
  std::vector<c10::Event> chunk_events_;               // after each chunk's copies to the host
  // The window: `sets` sets of `slots` slots of `slot_bytes` bytes of pinned memory; the job's
  // chunk number i uses set i % sets. A set is reused only after the copies back of the chunk
  // that used it before (set_free_, on the copy-back stream).
  at::Tensor window_;
  size_t window_sets_ = 0;
  size_t window_slots_ = 0;
  size_t slot_bytes_ = 0;
  std::vector<c10::Event> set_free_;
  std::vector<bool> set_used_;
};

} // namespace xccl_rs
