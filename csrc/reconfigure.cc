// torch's fault-tolerance API on XcclRsBackend (torch >= 2.15): abort and completion hooks, getError, and
// reconfigure, which replaces the group's communicator with a new one over the ranks whose
// handles it is given (identity, shrink, scale down and up, late join, split and merge).
//
// A handle is "xccl_rs:<rank>:<uuid>:<instance>": the rank and reconfigure uuid of this
// generation, and a random id of this backend, so that it is unique per process and per
// generation (it is compared as a whole string). Reconfigure does not use the handles as
// addresses: the new ranks meet through the group's own store under "xccl_rs_reconfigure/<uuid>/",
// the way gloo and NCCL's reconfigure do, and the new rank 0 claims the uuid there first, so
// that a reused uuid fails before anything changes.
#include "xccl_rs/backend.h"

#include <algorithm>
#include <unordered_set>
#include <variant>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "xccl_rs/communicator.h"

namespace xccl_rs {

#if XCCL_RS_HAS_ABORT_HOOKS
void XcclRsBackend::registerAbortHook(int64_t hook_id, c10d::AbortHook hook) {
  abort_hooks_->add(hook_id, std::move(hook));
}

void XcclRsBackend::unregisterAbortHook(int64_t hook_id) {
  abort_hooks_->remove(hook_id);
}
#endif

#if XCCL_RS_HAS_COMPLETION_HOOKS

void XcclRsBackend::registerCompletionHook(int64_t hook_id, c10d::CompletionHook hook) {
  completion_hooks_->add(hook_id, [hook = std::move(hook)](uint64_t key, std::optional<float> duration_ms) {
    c10d::CompletionHookArgs args;
    args.completionKey = key;
    args.duration_ms = duration_ms;
    hook(args);
  });
}

void XcclRsBackend::unregisterCompletionHook(int64_t hook_id) {
  completion_hooks_->remove(hook_id);
}
#endif

#ifdef C10D_BACKEND_HAS_RECONFIGURE
c10d::ErrorType XcclRsBackend::getError() {
  if (!comm_->comm.has_value()) {
    return c10d::ErrorType::SUCCESS;
  }
  switch ((*comm_->comm)->error_kind()) {
    case ErrorKind::Success: return c10d::ErrorType::SUCCESS;
    case ErrorKind::Timeout: return c10d::ErrorType::TIMEOUT;
    case ErrorKind::Remote: return c10d::ErrorType::REMOTE_ERROR;
    default: return c10d::ErrorType::COMM_ERROR;
  }
}

c10d::ReconfigureHandle XcclRsBackend::get_reconfigure_handle() const {
  return c10::str("xccl_rs:", getRank(), ":", reconfigure_uuid_, ":", std::hex, instance_id_);
}

namespace {

// The new members in rank order: a list as given; a set sorted (the backend chooses).
std::vector<std::string> ordered_handles(const c10d::ReconfigureOptions& opts) {
  std::vector<std::string> handles;
  if (const auto* list = std::get_if<std::vector<c10d::ReconfigureHandle>>(&opts.handles)) {
    handles = *list;
  } else {
    const auto& set = std::get<std::unordered_set<c10d::ReconfigureHandle>>(opts.handles);
    handles.assign(set.begin(), set.end());
    std::sort(handles.begin(), handles.end());
  }
  TORCH_CHECK_VALUE(!handles.empty(), "xccl_rs: reconfigure needs at least one handle");
  for (const auto& h : handles) {
    TORCH_CHECK_VALUE(h.rfind("xccl_rs:", 0) == 0 && std::count(h.begin(), h.end(), ':') == 3,
                      "xccl_rs: reconfigure: \"", h, "\" is not an xccl_rs handle (get_reconfigure_handle())");
  }
  auto sorted = handles;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK_VALUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                    "xccl_rs: reconfigure handles must be unique");
  return handles;
}

} // namespace

c10::intrusive_ptr<c10d::Work> XcclRsBackend::reconfigure(const c10d::ReconfigureOptions& opts) {
  const auto handles = ordered_handles(opts);
  const auto mine = get_reconfigure_handle();
  const auto it = std::find(handles.begin(), handles.end(), mine);
  TORCH_CHECK_VALUE(it != handles.end(), "xccl_rs: reconfigure: this rank's handle ", mine,
                    " is not one of the new group's ", handles.size());
  const int rank = static_cast<int>(it - handles.begin());
  const int size = static_cast<int>(handles.size());
  auto store = c10::make_intrusive<c10d::PrefixStore>(c10::str("xccl_rs_reconfigure/", opts.uuid), comm_->store);
  if (rank == 0) {
    // compareSet returns the value now stored: ours if the key was unclaimed.
    const std::vector<uint8_t> ours(mine.begin(), mine.end());
    const auto claimed = store->compareSet("claimed", {}, ours);
    TORCH_CHECK(claimed == ours, "xccl_rs: reconfigure uuid ", opts.uuid,
                " was already used; each reconfigure() requires a unique uuid");
  }
  // The old generation goes first: its queued work (failed already, if it failed) completes,
  // its connections and shared memory close.
  if (comm_->comm.has_value()) {
    (*comm_->comm)->shutdown();
  }
  const auto connect_timeout = checked_timeout(rank, size, opts.timeout.value_or(timeout_));
  try {
    comm_->comm = connect(store, rank, size, connect_timeout);
  } catch (...) {
    // No half-made group: later ops say "not initialized, call reconfigure()", and a
    // reconfigure with a fresh uuid may try again.
    comm_->comm.reset();
    throw;
  }
  (*comm_->comm)->set_timeout_ms(static_cast<uint64_t>(timeout_.count()));
  rank_ = rank;
  size_ = size;
  reconfigure_uuid_ = opts.uuid;
  coalescing_ = false;
  listen_for_failure();
  auto state = new_work_state("reconfigure");
  state->done = true;
  state->future->markCompleted(c10::IValue(state->outputs));
  return c10::make_intrusive<XcclRsWork>(rank, c10d::OpType::UNKNOWN, state);
}
#endif

} // namespace xccl_rs
