// The Python module xccl_rs._C: the backend creator that torch.distributed calls for each
// group (through python/xccl_rs/__init__.py), and the communicator registry that lets the
// backends torch creates per device type of one group share one communicator.
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include "xccl_rs/backend.h"
#include "xccl_rs/store.h"

namespace xccl_rs {
namespace {

// torch hands each device type of a group its own PrefixStore("<device>/", group_store). The
// group store's address plus the group id identify the group; our CommHandle keeps that store
// alive, so the address cannot be reused by another group while the entry can still match.
using GroupKey = std::pair<std::string, const c10d::Store*>;

std::mutex registry_mu;
std::map<GroupKey, std::weak_ptr<CommHandle>> registry;

const c10d::Store* group_identity(const c10::intrusive_ptr<c10d::Store>& store) {
  if (auto* prefix = dynamic_cast<c10d::PrefixStore*>(store.get())) {
    return prefix->getUnderlyingStore().get();
  }
  return store.get();
}

std::shared_ptr<CommHandle> new_communicator(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout);

std::shared_ptr<CommHandle> communicator_for(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& group_id) {
  const GroupKey key{group_id, group_identity(store)};
  std::lock_guard<std::mutex> lock(registry_mu);
  for (auto it = registry.begin(); it != registry.end();) {
    it = it->second.expired() ? registry.erase(it) : std::next(it);
  }
  if (auto it = registry.find(key); it != registry.end()) {
    if (auto existing = it->second.lock()) {
      return existing;
    }
  }
  auto handle = new_communicator(store, rank, size, timeout);
  registry[key] = handle;
  return handle;
}

std::shared_ptr<CommHandle> new_communicator(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout) {
  auto store_ref = std::make_unique<StoreRef>(StoreRef{store});
  rust::Box<RustComm> comm = [&]() {
    pybind11::gil_scoped_release no_gil; // rendezvous blocks on peers
    try {
      return new_comm(std::move(store_ref), rank, size, static_cast<uint64_t>(timeout.count()));
    } catch (const std::exception& e) {
      C10_THROW_ERROR(DistBackendError, e.what());
    }
  }();
  return std::shared_ptr<CommHandle>(new CommHandle{std::move(comm), store});
}

std::chrono::milliseconds checked(int rank, int size, std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(size > 0 && rank >= 0 && rank < size, "xccl_rs: rank ", rank, " is not in a group of size ", size);
  return timeout.count() > 0 ? timeout : std::chrono::minutes(30); // c10d's default when unset
}

c10::intrusive_ptr<c10d::Backend> create_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& group_id) {
  timeout = checked(rank, size, timeout);
  auto comm = communicator_for(store, rank, size, timeout, group_id);
  return c10::make_intrusive<XcclRsBackend>(std::move(comm), rank, size, timeout);
}

// A private group: a ProcessGroup whose every device type is served by one xccl_rs backend,
// built on any store, with no default process group and nothing registered with torch. It
// never shares a communicator (each call connects anew), so rebuilding a group under the same
// name with a new store prefix always gets fresh connections.
c10::intrusive_ptr<c10d::ProcessGroup> new_process_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& name,
    std::optional<c10::Device> device) {
  timeout = checked(rank, size, timeout);
  auto backend = c10::make_intrusive<XcclRsBackend>(new_communicator(store, rank, size, timeout), rank, size, timeout);
  if (device) {
    backend->setBoundDeviceId(device); // the rank's accelerator (see Job::staging)
  }
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  for (auto device : {c10::DeviceType::CPU, c10::DeviceType::CUDA, c10::DeviceType::XPU}) {
    pg->setBackend(device, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  }
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  pg->setGroupName(name);
  return pg;
}

} // namespace
} // namespace xccl_rs

PYBIND11_MODULE(xccl_rs_cxx, m) {
  m.doc() = "xccl_rs native module: the c10d backend creator";
  m.def(
      "create_backend",
      &xccl_rs::create_backend,
      pybind11::arg("store"),
      pybind11::arg("rank"),
      pybind11::arg("size"),
      pybind11::arg("timeout"),
      pybind11::arg("group_id") = "",
      "Create an xccl_rs c10d Backend over `store` for this rank.");
  m.def(
      "new_process_group",
      &xccl_rs::new_process_group,
      pybind11::arg("store"),
      pybind11::arg("rank"),
      pybind11::arg("size"),
      pybind11::arg("timeout"),
      pybind11::arg("name"),
      pybind11::arg("device") = std::nullopt,
      "Create a private ProcessGroup served by xccl_rs over `store` (see xccl_rs.new_group).");
  m.attr("torch_version_built") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
}
