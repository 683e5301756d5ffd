// The C++ API (include/xccl_rs/xccl_rs.h): backends and process groups for libtorch programs.
// csrc/module.cc offers the same to Python.
#include "xccl_rs/xccl_rs.h"

#include <utility>

#include <torch/version.h>

#include "xccl_rs/communicator.h"
#include "xccl_rs/process_group.h"

namespace xccl_rs {

namespace {

class XcclRsProcessGroup final : public c10d::ProcessGroup {
 public:
  using c10d::ProcessGroup::ProcessGroup;
  const std::string getBackendName() const override {
    return "xccl_rs";
  }
};

} // namespace

c10::intrusive_ptr<c10d::ProcessGroup> new_named_process_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size) {
  return c10::make_intrusive<XcclRsProcessGroup>(store, rank, size);
}

c10::intrusive_ptr<c10d::Backend> create_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout) {
  return create_backend(store, rank, size, Options{timeout, "", std::nullopt});
}

c10::intrusive_ptr<c10d::Backend> create_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const Options& options) {
  const auto timeout = checked_timeout(rank, size, options.timeout);
  auto backend = c10::make_intrusive<XcclRsBackend>(new_communicator(store, rank, size, timeout), rank, size, timeout);
  if (options.device) {
    backend->setBoundDeviceId(options.device); // the rank's accelerator (see Job::staging)
  }
  if (!options.group_name.empty()) {
    backend->setGroupUid(options.group_name);
  }
  return backend;
}

c10::intrusive_ptr<c10d::ProcessGroup> new_process_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const Options& options) {
  auto backend = create_backend(store, rank, size, options);
  auto pg = new_named_process_group(store, rank, size);
  for (auto device : {c10::DeviceType::CPU, c10::DeviceType::CUDA, c10::DeviceType::XPU}) {
    pg->setBackend(device, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  }
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  pg->setGroupName(options.group_name);
  return pg;
}

std::string torch_version_built() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
}

} // namespace xccl_rs
