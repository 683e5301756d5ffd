// Making communicators, and the registry that lets the backends torch creates per device type of
// one group share one communicator (see communicator.h).
#include "xccl_rs/communicator.h"

#include "xccl_rs/errors.h"

#include <map>
#include <mutex>
#include <utility>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

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

} // namespace

std::chrono::milliseconds checked_timeout(int rank, int size, std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(size > 0 && rank >= 0 && rank < size, "xccl_rs: rank ", rank, " is not in a group of size ", size);
  return timeout.count() > 0 ? timeout : std::chrono::minutes(30); // c10d's default when unset
}

rust::Box<RustComm> connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout) {
  auto store_ref = std::make_unique<StoreRef>(StoreRef{store});
  try {
    return new_comm(std::move(store_ref), rank, size, static_cast<uint64_t>(timeout.count()));
  } catch (const rust::Error& e) {
    raise_core_error(e);
  }
}

std::shared_ptr<CommHandle> new_communicator(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout) {
  return std::shared_ptr<CommHandle>(new CommHandle{connect(store, rank, size, timeout), store});
}

std::shared_ptr<CommHandle> unconnected_communicator(const c10::intrusive_ptr<c10d::Store>& store) {
  return std::shared_ptr<CommHandle>(new CommHandle{std::nullopt, store});
}

std::shared_ptr<CommHandle> shared_communicator(
    const std::string& group_id,
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::function<std::shared_ptr<CommHandle>()>& make) {
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
  auto handle = make();
  registry[key] = handle;
  return handle;
}

} // namespace xccl_rs
