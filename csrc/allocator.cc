// Tensors in this rank's shared-memory heap (src/transport/shm/heap.rs): torch's backend
// allocator interface (Backend::getMemAllocator, allocateTensor, supportsTensorAlloc) over
// the core's alloc_shared. Collectives on such tensors read the peers' tensors in place when
// every rank's lies in its heap (src/algorithms/host/allreduce_zero_copy.rs). The memory is
// CPU memory; an accelerator tensor is staged whatever it is allocated from.
#include <ATen/ops/from_blob.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include "xccl_rs/backend.h"
#include "xccl_rs/errors.h"

namespace xccl_rs {

namespace {

void free_block(void* block) {
  // Dropping the Box frees the range (its pages go back to the system).
  (void)rust::Box<SharedBlock>::from_raw(static_cast<SharedBlock*>(block));
}

// A c10::Allocator over the heap of the group's current communicator (reconfigure() may
// replace it; memory already handed out stays valid, owned by its tensor).
class HeapAllocator final : public c10::Allocator {
 public:
  explicit HeapAllocator(std::shared_ptr<CommHandle> comm) : comm_(std::move(comm)) {}

  c10::DataPtr allocate(size_t bytes) override {
    TORCH_CHECK(comm_->comm.has_value(), "xccl_rs: this group has not been initialized (enable_reconfigure=True before reconfigure())");
    try {
      rust::Box<SharedBlock> block = (*comm_->comm)->alloc_shared(bytes);
      void* data = reinterpret_cast<void*>(block->address());
      return {data, block.into_raw(), &free_block, c10::Device(c10::DeviceType::CPU)};
    } catch (const rust::Error& e) {
      raise_core_error(e);
    }
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr; // the context, not the data pointer, owns the memory
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  std::shared_ptr<CommHandle> comm_;
};

} // namespace

bool XcclRsBackend::supportsTensorAlloc(c10::DeviceIndex /*device*/) {
  return comm_->comm.has_value() && (*comm_->comm)->has_heap();
}

std::shared_ptr<c10::Allocator> XcclRsBackend::getMemAllocator() {
  return std::make_shared<HeapAllocator>(comm_);
}

at::Tensor XcclRsBackend::allocateTensor(long size, at::TensorOptions options) {
  TORCH_CHECK_VALUE(
      !options.has_device() || options.device().is_cpu(),
      "xccl_rs: allocate_tensor makes CPU tensors in shared memory; got device ", options.device(),
      " (accelerator tensors are staged through host memory whatever they are allocated from)");
  TORCH_CHECK_VALUE(size >= 0, "xccl_rs: allocate_tensor: negative size ", size);
  TORCH_CHECK_VALUE(supportsTensorAlloc(-1), "xccl_rs: rank ", getRank(),
                    ": this group has no shared-memory heap (its ranks are not all on one host, XCCL_RS_TRANSPORT=tcp, "
                    "or XCCL_RS_SHM_HEAP_BYTES=0)");
  const auto item = static_cast<size_t>(options.dtype().itemsize());
  TORCH_CHECK_VALUE(static_cast<uint64_t>(size) <= SIZE_MAX / item, "xccl_rs: allocate_tensor: ", size, " elements overflow");
  c10::DataPtr memory = HeapAllocator(comm_).allocate(static_cast<size_t>(size) * item);
  void* data = memory.get();
  // The storage owns the block through the deleter; it has no allocator, so it cannot be
  // resized (a resize would need memory from a heap that may be gone by then).
  void* block = memory.release_context();
  try {
    return at::from_blob(data, {size}, [block](void*) { free_block(block); }, options.device(c10::DeviceType::CPU));
  } catch (...) {
    free_block(block);
    throw;
  }
}

uint64_t XcclRsBackend::zero_copy_ops() const {
  return comm_->comm.has_value() ? (*comm_->comm)->zero_copy_ops() : 0;
}

rust::Vec<OpStatsRow> XcclRsBackend::stats() const {
  return comm_->comm.has_value() ? (*comm_->comm)->stats() : rust::Vec<OpStatsRow>{};
}

} // namespace xccl_rs
