// ATen kernels of the emulated XPU. Allocation and views run at once (they touch no data);
// copies, fill_ and zero_ are tasks on the current stream (runtime.h); every other op takes
// the boxed CPU fallback, whose copies to the CPU wait for the current stream and whose
// results go back as tasks on it, so that it too runs in stream order.
#include <cstdio>
#include <cstdlib>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "runtime.h"

namespace xpu_emu {
namespace {

c10::DeviceIndex index_of(std::optional<c10::Device> device) {
  return device && device->has_index() ? device->index() : current_device();
}

at::Tensor empty_memory_format(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> /*layout*/, std::optional<at::Device> device,
                               std::optional<bool> /*pin_memory*/, std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::XPU, index_of(device)));
  return at::detail::empty_generic(size, c10::GetAllocator(c10::DeviceType::XPU),
                                   c10::DispatchKeySet(c10::DispatchKey::XPU), c10::dtype_or_default(dtype),
                                   memory_format);
}

at::Tensor empty_strided(at::IntArrayRef size, at::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> /*layout*/, std::optional<at::Device> device,
                         std::optional<bool> /*pin_memory*/) {
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::XPU, index_of(device)));
  return at::detail::empty_strided_generic(size, stride, c10::GetAllocator(c10::DeviceType::XPU),
                                           c10::DispatchKeySet(c10::DispatchKey::XPU), c10::dtype_or_default(dtype));
}

// A CPU tensor over the same memory (device memory is host memory); only tasks use it.
at::Tensor host_view(const at::Tensor& t) {
  if (t.is_cpu()) {
    return t;
  }
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), at::TensorOptions().dtype(t.dtype()).device(at::kCPU));
}

// Like cudaMemcpyAsync on the current stream of the XPU side's device: a copy that involves
// the host and is not non_blocking also waits for it. The task holds both tensors, so their
// memory stays valid until it has run.
void copy_on_stream(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK((src.is_cpu() || src.is_xpu()) && (dst.is_cpu() || dst.is_xpu()), "xpu_emu: cannot copy from ",
              src.device(), " to ", dst.device());
  if (dst.numel() == 0) {
    return;
  }
  const c10::DeviceIndex device = dst.is_xpu() ? dst.device().index() : src.device().index();
  static const bool trace = std::getenv("XCCL_RS_XPU_EMU_TRACE") != nullptr;
  if (trace) {
    std::fprintf(stderr, "xpu_emu: copy %s %p -> %s %p, %zu bytes, on stream %lld%s\n", src.device().str().c_str(),
                 src.data_ptr(), dst.device().str().c_str(), dst.data_ptr(), static_cast<size_t>(dst.nbytes()),
                 static_cast<long long>(current_stream(device).id()), non_blocking ? "" : " (blocking)");
  }
  enqueue_current(device, [src, dst] { host_view(dst).copy_(host_view(src)); });
  if (!non_blocking && (src.is_cpu() || dst.is_cpu())) {
    worker(current_stream(device)).synchronize();
  }
}

at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  copy_on_stream(src, self, non_blocking);
  return self;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  copy_on_stream(self, dst, non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) {
    dst.resize_(self.sizes());
  }
  // The CPU fallback writes its results back through here: in stream order, not waiting.
  copy_on_stream(self, dst, /*non_blocking=*/true);
  return dst;
}

at::Tensor& fill_(at::Tensor& self, const at::Scalar& value) {
  if (self.numel() > 0) {
    at::Tensor t = self;
    enqueue_current(self.device().index(), [t, value] { host_view(t).fill_(value); });
  }
  return self;
}

at::Tensor& zero_(at::Tensor& self) {
  if (self.numel() > 0) {
    at::Tensor t = self;
    enqueue_current(self.device().index(), [t] { host_view(t).zero_(); });
  }
  return self;
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  // Only ATen ops have CPU kernels that mean the same thing (c10d ops: c10d_ops.cc).
  TORCH_CHECK(op.schema().name().rfind("aten::", 0) == 0, "xpu_emu: no XPU kernel for ", op.schema().name());
  at::native::cpu_fallback(op, stack);
}

TORCH_LIBRARY_IMPL(aten, XPU, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("resize_", at::native::resize_);
  m.impl("copy_", copy_);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("fill_.Scalar", fill_);
  m.impl("zero_", zero_);
}

TORCH_LIBRARY_IMPL(_, XPU, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}

} // namespace
} // namespace xpu_emu
