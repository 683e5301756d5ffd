// The Python module xccl_rs._C: the backend creator that torch.distributed calls for each
// group (through python/xccl_rs/__init__.py), and the communicator registry that lets the
// backends torch creates per device type of one group share one communicator.
#include <map>
#include <mutex>
#include <utility>

#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
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
  auto store_ref = std::make_unique<StoreRef>(StoreRef{store});
  rust::Box<RustComm> comm = [&]() {
    pybind11::gil_scoped_release no_gil; // rendezvous blocks on peers
    try {
      return new_comm(std::move(store_ref), rank, size, static_cast<uint64_t>(timeout.count()));
    } catch (const std::exception& e) {
      C10_THROW_ERROR(DistBackendError, e.what());
    }
  }();
  auto handle = std::shared_ptr<CommHandle>(new CommHandle{std::move(comm), store});
  registry[key] = handle;
  return handle;
}

c10::intrusive_ptr<c10d::Backend> create_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& group_id) {
  TORCH_CHECK_VALUE(size > 0 && rank >= 0 && rank < size, "xccl_rs: rank ", rank, " is not in a group of size ", size);
  if (timeout.count() <= 0) {
    timeout = std::chrono::minutes(30); // c10d's default when the group leaves it unset
  }
  auto comm = communicator_for(store, rank, size, timeout, group_id);
  return c10::make_intrusive<XcclRsBackend>(std::move(comm), rank, size, timeout);
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
  m.attr("torch_version_built") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
}
