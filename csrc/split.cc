// Child groups of a group, where torch routes them to the backend: split_group (split), the
// remote merge of ProcessGroup.merge_remote_group (merge) and shrink_group (shrink). Each child
// is a new communicator: over the store the caller namespaced for it (split, merge), or over
// this group's store under a fresh prefix (shrink). torch keeps one backend per device type of
// a group, and may ask each of them for its child; the first one asked connects, and the
// others share that communicator (CommHandle::child), as the parents share theirs.
#include "xccl_rs/backend.h"

#include <algorithm>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "xccl_rs/communicator.h"

namespace xccl_rs {

std::shared_ptr<CommHandle> CommHandle::child(const std::string& key, const std::function<std::shared_ptr<CommHandle>()>& make) {
  std::lock_guard<std::mutex> lock(children_mu);
  if (auto existing = children[key].lock()) {
    return existing;
  }
  auto made = make();
  children[key] = made;
  return made;
}

#ifdef XCCL_RS_HAS_CHILD_GROUPS
c10::intrusive_ptr<c10d::Backend> XcclRsBackend::child(
    const std::string& key,
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const c10::intrusive_ptr<Options>& opts) {
  auto timeout = checked_timeout(rank, size, opts && opts->timeout.count() > 0 ? opts->timeout : timeout_);
  auto comm = comm_->child(key, [&] { return new_communicator(store, rank, size, timeout); });
  auto backend = c10::make_intrusive<XcclRsBackend>(std::move(comm), rank, size, timeout);
  if (auto device = getBoundDeviceId()) {
    backend->setBoundDeviceId(device);
  }
  if (opts && !opts->group_name.empty()) {
    backend->setGroupUid(opts->group_name);
  }
  return backend;
}

c10::intrusive_ptr<c10d::Backend> XcclRsBackend::split(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  const auto it = std::find(ranks.begin(), ranks.end(), getRank());
  TORCH_CHECK_VALUE(it != ranks.end(), "xccl_rs: split: rank ", getRank(), " is not one of the new group's ranks");
  const int rank = static_cast<int>(it - ranks.begin());
  return child(c10::str("split/", split_count_++), store, rank, static_cast<int>(ranks.size()), opts);
}

c10::intrusive_ptr<c10d::Backend> XcclRsBackend::merge(
    const c10::intrusive_ptr<c10d::Store>& store,
    const c10::intrusive_ptr<Options>& opts,
    const int& rank,
    const int& size) {
  return child(c10::str("merge/", merge_count_++), store, rank, size, opts);
}

c10::intrusive_ptr<c10d::Backend> XcclRsBackend::shrink(
    const std::vector<int64_t>& ranks_to_exclude,
    int shrink_flags,
    const c10::intrusive_ptr<Options>& opts_override) {
  std::vector<int64_t> excluded(ranks_to_exclude);
  std::sort(excluded.begin(), excluded.end());
  excluded.erase(std::unique(excluded.begin(), excluded.end()), excluded.end());
  for (auto r : excluded) {
    TORCH_CHECK_VALUE(r >= 0 && r < getSize(), "xccl_rs: shrink: rank ", r, " is not in this group of ", getSize());
    TORCH_CHECK_VALUE(r != getRank(), "xccl_rs: shrink: rank ", r, " excludes itself (only the remaining ranks shrink)");
  }
  TORCH_CHECK(comm_->comm.has_value(), "xccl_rs: shrink: this group has not been initialized");
  constexpr int kShrinkAbort = 0x01; // torch.distributed.SHRINK_ABORT
  if (shrink_flags & kShrinkAbort) {
    abort(); // ops of the parent still running or queued fail now instead of at their timeout
  }
  const int below = static_cast<int>(std::count_if(excluded.begin(), excluded.end(), [&](int64_t r) { return r < getRank(); }));
  const int size = getSize() - static_cast<int>(excluded.size());
  // The survivors call shrink in the same order, so their counters agree; the prefix nests
  // under this group's own, so shrinking a shrunk group never reuses a key.
  const auto key = c10::str("shrink/", shrink_count_++);
  auto store = c10::make_intrusive<c10d::PrefixStore>(c10::str("xccl_rs_", key), comm_->store);
  return child(key, store, getRank() - below, size, opts_override);
}
#endif

} // namespace xccl_rs
