// Host staging of accelerator tensors (see device.h for the protocol and its threads).
#include "xccl_rs/device.h"

#include <algorithm>

#include <ATen/EmptyTensor.h>
#include <c10/util/Exception.h>

#include <ATen/core/CachingHostAllocator.h>

namespace xccl_rs {

namespace {

// Pinned (page-locked) host memory from the caching host allocator of `device_type`'s
// runtime: copies to and from it run asynchronously, and the allocator keeps a block until
// the copies that use it have finished. Taken from that device type's allocator
// (at::getHostAllocator, in every torch we support), not with pinned_memory(true), which asks
// the build's accelerator (at::getAccelerator: CUDA in a CUDA build, whatever the tensor's device).
at::Tensor pinned(at::IntArrayRef sizes, at::ScalarType dtype, c10::DeviceType device_type) {
  return at::detail::empty_generic(sizes, at::getHostAllocator(device_type), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   dtype, at::MemoryFormat::Contiguous);
}

at::Tensor pinned_like(const at::Tensor& t) {
  return pinned(t.sizes(), t.scalar_type(), t.device().type());
}

// Placeholder addresses start here: above every user-space address (x86-64 with 5-level
// paging ends below 2^57, AArch64 below 2^52), so a placeholder never coincides with a host
// tensor of the same job (mixed jobs have both). They are never dereferenced.
constexpr size_t kPlaceholderBase = size_t{1} << 60;
constexpr size_t kPlaceholderAlign = 64;

// The device-to-host copies are queued at most this many chunks ahead of the chunk the host
// waits for, not all at once: on a device that several processes share, one process's queued
// copies run in its time slice, and copies queued far ahead delay the other ranks' first
// chunks, which every rank waits for. (The H200 with 4 ranks, every chunk queued at the call:
// chunk 0 reached the host 1-3 ms after the call, behind the other ranks' copies.)
constexpr size_t kCopyAhead = 1;

// Window sets: the chunk the host works on, the kCopyAhead chunks copying out, and the chunk
// copying back.
constexpr size_t kWindowSets = kCopyAhead + 2;

// Slots start at multiples of this (chunk sizes are multiples of 64 KiB already).
constexpr size_t kSlotAlign = 64;

// The bytes of a contiguous tensor, flat.
at::Tensor bytes_of(const at::Tensor& t) {
  return t.reshape({-1}).view(at::kByte);
}

// Chunk k of a range of `bytes` bytes in chunks of `chunk` bytes: (start, length) (src/pipeline.rs).
std::pair<size_t, size_t> chunk_range(size_t bytes, size_t chunk, size_t k) {
  if (chunk == SIZE_MAX) {
    return {0, k == 0 ? bytes : 0};
  }
  const size_t start = std::min(bytes, k * chunk);
  return {start, std::min(chunk, bytes - start)};
}

} // namespace

DeviceStaging::DeviceStaging(c10::Device device)
    : device_(device),
      impl_(device.type()),
      caller_stream_(impl_.getStream(device)),
      // Placeholders until host_buffers() (the first use of a stream pool creates its streams,
      // milliseconds that the caller's thread should not pay).
      copy_out_stream_(c10::Stream::DEFAULT, device),
      copy_stream_(c10::Stream::DEFAULT, device),
      issued_(device.type()),
      outputs_ready_(device.type()),
      next_placeholder_(kPlaceholderBase) {}

HostRange DeviceStaging::stage(const at::Tensor& t, bool read, bool write) {
  TORCH_INTERNAL_ASSERT(!sealed_, "xccl_rs: staging after seal");
  const auto bytes = static_cast<size_t>(t.nbytes());
  const size_t placeholder = next_placeholder_;
  // Every buffer its own range, also an empty one.
  next_placeholder_ += (std::max<size_t>(bytes, 1) + kPlaceholderAlign - 1) / kPlaceholderAlign * kPlaceholderAlign;
  buffers_.push_back(Buffer{t, placeholder, read, write});
  return HostRange{placeholder, bytes};
}

std::vector<HostBinding> DeviceStaging::host_buffers() {
  c10::DeviceGuard device_guard(device_); // no runtime context on another device for this thread
  copy_out_stream_ = impl_.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
  copy_stream_ = impl_.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
  // The job's chunks in the order the core uses them (op by op, chunk by chunk), an event each.
  for (size_t op = 0; op < ops_.size(); ++op) {
    OpPlan& plan = ops_[op];
    if (plan.views.empty()) {
      continue;
    }
    plan.first_event = copy_order_.size();
    for (size_t k = 0; k < plan.chunks; ++k) {
      copy_order_.emplace_back(op, k);
    }
  }
  chunk_events_.reserve(copy_order_.size());
  for (size_t i = 0; i < copy_order_.size(); ++i) {
    chunk_events_.emplace_back(device_.type());
  }
  plan_window();
  std::vector<HostBinding> table;
  for (auto& b : buffers_) {
    if (b.device.is_contiguous()) {
      b.device_bytes = bytes_of(b.device);
    }
    if (b.windowed) {
      continue;
    }
    b.host = pinned_like(b.device);
    table.push_back(HostBinding{
        b.placeholder, static_cast<size_t>(b.device.nbytes()), reinterpret_cast<size_t>(b.host.data_ptr())});
  }
  return table;
}

void DeviceStaging::plan_window() {
  // Candidates: contiguous buffers used by chunked ops only.
  std::vector<bool> candidate(buffers_.size(), false);
  std::vector<bool> excluded(buffers_.size(), false);
  for (const auto& plan : ops_) {
    for (const auto& v : plan.views) {
      const bool ok = plan.chunk_bytes != SIZE_MAX && buffers_[v.buffer].device.is_contiguous();
      (ok ? candidate : excluded)[v.buffer] = true;
    }
  }
  size_t slots = 0;
  size_t slot_bytes = 0;
  size_t whole_bytes = 0;
  for (const auto& plan : ops_) {
    size_t in_op = 0;
    for (const auto& v : plan.views) {
      if (candidate[v.buffer] && !excluded[v.buffer]) {
        ++in_op;
        slot_bytes = std::max(slot_bytes, std::min(v.bytes, plan.chunk_bytes));
      }
    }
    slots = std::max(slots, in_op);
  }
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (candidate[i] && !excluded[i]) {
      whole_bytes += static_cast<size_t>(buffers_[i].device.nbytes());
    }
  }
  slot_bytes = (slot_bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
  const size_t sets = std::min(kWindowSets, copy_order_.size());
  // Only where it saves memory (small jobs, one or two chunks, keep their whole buffers).
  if (slots == 0 || sets * slots * slot_bytes >= whole_bytes) {
    return;
  }
  for (size_t i = 0; i < buffers_.size(); ++i) {
    buffers_[i].windowed = candidate[i] && !excluded[i];
  }
  for (auto& plan : ops_) {
    size_t next = 0;
    for (auto& v : plan.views) {
      if (buffers_[v.buffer].windowed) {
        v.slot = next++;
        plan.windowed = true;
      }
    }
  }
  window_sets_ = sets;
  window_slots_ = slots;
  slot_bytes_ = slot_bytes;
  window_ = pinned({static_cast<int64_t>(sets * slots * slot_bytes)}, at::kByte, device_.type());
  set_used_.assign(sets, false);
  for (size_t i = 0; i < sets; ++i) {
    set_free_.emplace_back(device_.type());
  }
}

size_t DeviceStaging::window_offset(size_t index, const View& view) const {
  return ((index % window_sets_) * window_slots_ + view.slot) * slot_bytes_;
}

void DeviceStaging::add_op(size_t index, const std::vector<OpBuffer>& buffers, size_t chunk_bytes) {
  TORCH_INTERNAL_ASSERT(!sealed_, "xccl_rs: add_op after seal");
  if (ops_.size() <= index) {
    ops_.resize(index + 1);
  }
  OpPlan& plan = ops_[index];
  size_t piece = 0;
  for (const auto& ob : buffers) {
    piece = std::max(piece, ob.bytes);
    if (ob.bytes == 0) {
      continue;
    }
    for (size_t i = 0; i < buffers_.size(); ++i) {
      const size_t base = buffers_[i].placeholder;
      const auto len = static_cast<size_t>(buffers_[i].device.nbytes());
      if (ob.ptr >= base && ob.ptr - base + ob.bytes <= len) {
        plan.views.push_back(View{i, ob.ptr - base, ob.bytes, ob.output});
        break;
      }
    }
    // A buffer in no staged tensor is a host tensor of a mixed job: nothing to copy.
  }
  plan.chunk_bytes = chunk_bytes;
  plan.chunks = chunk_bytes == SIZE_MAX ? 1 : std::max<size_t>(1, (piece + chunk_bytes - 1) / chunk_bytes);
}

const DeviceStaging::OpPlan* DeviceStaging::plan_of(size_t op) const {
  return op < ops_.size() && !ops_[op].views.empty() ? &ops_[op] : nullptr;
}

void DeviceStaging::copy_range(const OpPlan& plan, const View& view, size_t chunk, size_t index, bool to_host) {
  const Buffer& b = buffers_[view.buffer];
  const auto [start, len] = chunk_range(view.bytes, plan.chunk_bytes, chunk);
  if (len == 0) {
    return;
  }
  const auto n = static_cast<int64_t>(len);
  at::Tensor device = b.device_bytes.narrow(0, static_cast<int64_t>(view.offset + start), n);
  at::Tensor host = b.windowed ? window_.narrow(0, static_cast<int64_t>(window_offset(index, view)), n)
                               : bytes_of(b.host).narrow(0, static_cast<int64_t>(view.offset + start), n);
  if (to_host) {
    host.copy_(device, /*non_blocking=*/true);
  } else {
    device.copy_(host, /*non_blocking=*/true);
  }
}

void DeviceStaging::seal() {
  TORCH_INTERNAL_ASSERT(!sealed_, "xccl_rs: seal called twice");
  sealed_ = true;
  c10::DeviceGuard device_guard(device_);
  // Everything the collective copies follows the work queued before it on this stream.
  issued_.record(caller_stream_);
}

void DeviceStaging::begin_copies_out() {
  launched_ = true;
  c10::DeviceGuard device_guard(device_);
  c10::StreamGuard stream_guard(copy_out_stream_);
  issued_.block(copy_out_stream_);
  for (auto& b : buffers_) {
    if (b.read) {
      impl_.recordDataPtrOnStream(b.device.storage().data_ptr(), copy_out_stream_);
      if (!b.device_bytes.defined()) {
        b.host.copy_(b.device, /*non_blocking=*/true); // whole, any strides
      }
    }
  }
}

void DeviceStaging::launch_copies_out_through(size_t index) {
  if (next_copy_out_ > index || next_copy_out_ == copy_order_.size()) {
    return;
  }
  c10::DeviceGuard device_guard(device_);
  c10::StreamGuard stream_guard(copy_out_stream_);
  for (; next_copy_out_ <= index && next_copy_out_ < copy_order_.size(); ++next_copy_out_) {
    const auto [op, k] = copy_order_[next_copy_out_];
    const OpPlan& plan = ops_[op];
    const size_t set = plan.windowed ? next_copy_out_ % window_sets_ : 0;
    if (plan.windowed && set_used_[set]) {
      set_free_[set].block(copy_out_stream_); // the set's last chunk has been copied back
    }
    for (const auto& v : plan.views) {
      const Buffer& b = buffers_[v.buffer];
      if (b.read && b.device_bytes.defined()) {
        copy_range(plan, v, k, next_copy_out_, /*to_host=*/true);
      }
    }
    // Also for chunks with nothing to copy (write-only outputs): the job may overwrite them
    // only after the work queued before it (which may still read them) has run.
    chunk_events_[next_copy_out_].record(copy_out_stream_);
  }
}

std::vector<HostBinding> DeviceStaging::wait_chunk(size_t op, size_t chunk) {
  TORCH_INTERNAL_ASSERT(sealed_, "xccl_rs: wait_chunk before seal");
  const OpPlan* plan = plan_of(op);
  if (plan == nullptr) {
    return {};
  }
  if (!launched_) {
    begin_copies_out();
  }
  TORCH_INTERNAL_ASSERT(chunk < plan->chunks, "xccl_rs: chunk ", chunk, " of an op of ", plan->chunks, " chunks");
  const size_t index = plan->first_event + chunk;
  launch_copies_out_through(index);
  {
    c10::DeviceGuard device_guard(device_);
    chunk_events_[index].synchronize();
  }
  // The next chunks copy while the host works on this one.
  launch_copies_out_through(index + kCopyAhead);
  std::vector<HostBinding> window;
  if (plan->windowed) {
    const auto base = reinterpret_cast<size_t>(window_.data_ptr());
    for (const auto& v : plan->views) {
      const Buffer& b = buffers_[v.buffer];
      const auto [start, len] = chunk_range(v.bytes, plan->chunk_bytes, chunk);
      if (b.windowed && len > 0) {
        window.push_back(HostBinding{b.placeholder + v.offset + start, len, base + window_offset(index, v)});
      }
    }
  }
  return window;
}

void DeviceStaging::copy_back_chunk(size_t op, size_t chunk) {
  const OpPlan* plan = plan_of(op);
  if (plan == nullptr) {
    return;
  }
  const size_t index = plan->first_event + chunk;
  c10::DeviceGuard device_guard(device_);
  c10::StreamGuard stream_guard(copy_stream_);
  // The chunk's event has fired (wait_chunk), so the work queued before the collective is done.
  for (const auto& v : plan->views) {
    Buffer& b = buffers_[v.buffer];
    if (!v.output || !b.write || !b.device_bytes.defined()) {
      continue;
    }
    if (!b.recorded) {
      impl_.recordDataPtrOnStream(b.device.storage().data_ptr(), copy_stream_);
      b.recorded = true;
    }
    copy_range(*plan, v, chunk, index, /*to_host=*/false);
  }
  if (plan->windowed) {
    // The host is done with this set (it read and wrote it), and its copies back are queued.
    const size_t set = index % window_sets_;
    set_free_[set].record(copy_stream_);
    set_used_[set] = true;
  }
}

void DeviceStaging::finish() {
  c10::DeviceGuard device_guard(device_);
  c10::StreamGuard stream_guard(copy_stream_);
  issued_.block(copy_stream_);
  for (auto& b : buffers_) {
    if (b.write && !b.device_bytes.defined()) {
      b.device.copy_(b.host, /*non_blocking=*/true); // whole, any strides
    }
    if (b.write && !b.recorded) {
      impl_.recordDataPtrOnStream(b.device.storage().data_ptr(), copy_stream_);
      b.recorded = true;
    }
  }
  outputs_ready_.record(copy_stream_);
  results_back_ = true;
  // The host buffers can go: the caching host allocator keeps each block until the copies
  // that use it have finished.
  buffers_.clear();
  chunk_events_.clear();
  window_ = at::Tensor();
}

void DeviceStaging::make_current_stream_wait() {
  if (!results_back_) {
    return; // the job failed before its results came back: nothing to order against
  }
  outputs_ready_.block(impl_.getStream(device_));
}

} // namespace xccl_rs
