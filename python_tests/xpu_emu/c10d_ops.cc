// The c10d ops (torch.distributed's dispatcher ops: c10d::allreduce_, ...) on XPU tensors.
//
// A torch built with XPU registers them for the XPU key (each calls the group's XPU backend);
// a torch built without XPU registers them for CPU, CUDA and PrivateUse1 only, so an XPU
// tensor would reach the boxed CPU fallback (kernels.cc) and the collective would run on CPU
// copies. Here each one maps the group's PrivateUse1 slot to the backend the group has for
// XPU (the same object) and redispatches to torch's PrivateUse1 kernel, which calls that
// backend with the XPU tensors unchanged — what the XPU kernel of an XPU build does.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

namespace xpu_emu {
namespace {

void via_private_use1(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  for (size_t i = 0; i < n && !pg; ++i) {
    const c10::IValue& v = (*stack)[stack->size() - n + i];
    if (v.isCustomClass()) {
      pg = v.toCustomClass<c10d::ProcessGroup>();
    }
  }
  TORCH_CHECK(pg, "xpu_emu: ", schema.name(), " has no process group argument");
  auto backend = pg->getBackend(c10::DeviceType::XPU);
  // CUSTOM: the type torch gives a registered third-party backend such as xccl_rs. Setting it
  // again is harmless: setBackend keeps the backend already registered for a backend type.
  // (Not guarded by hasBackendForDeviceType, which torch 2.11 lacks.)
  pg->setBackend(c10::DeviceType::PrivateUse1, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  TORCH_CHECK(pg->getBackend(c10::DeviceType::PrivateUse1).get() == backend.get(), "xpu_emu: ", schema.name(),
              ": the group's XPU backend is not its CUSTOM backend; the emulator cannot route it");
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), stack);
}

TORCH_LIBRARY_IMPL(c10d, XPU, m) {
  for (const char* name :
       {"allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "allgather_", "_allgather_base_",
        "allgather_coalesced_", "allgather_into_tensor_coalesced_", "gather_into_tensor_", "reduce_scatter_",
        "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "gather_", "scatter_", "alltoall_",
        "alltoall_base_", "send", "recv_", "recv_any_source_", "barrier"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&via_private_use1>());
  }
}

} // namespace
} // namespace xpu_emu
