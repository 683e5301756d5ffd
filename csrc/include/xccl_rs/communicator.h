// Making communicators, shared by the C++ API (csrc/api.cc) and the Python module
// (csrc/module.cc). Nothing here touches Python: a caller that holds the GIL must release it
// first, since making a communicator blocks on the other ranks.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "xccl_rs/backend.h"

namespace xccl_rs {

// Checks rank and size; returns the timeout, c10d's default (30 min) when unset (<= 0).
std::chrono::milliseconds checked_timeout(int rank, int size, std::chrono::milliseconds timeout);

// The rendezvous of `size` ranks over `store`: a connected Rust communicator.
rust::Box<RustComm> connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout);

// A new communicator: the rendezvous of `size` ranks over `store`.
std::shared_ptr<CommHandle> new_communicator(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout);

// A handle with no communicator yet (enable_reconfigure=True): the first reconfigure() connects
// (reconfigure.cc).
std::shared_ptr<CommHandle> unconnected_communicator(const c10::intrusive_ptr<c10d::Store>& store);

// The communicator of group `group_id` on `store`, made by `make` on first use: torch creates
// one backend per device type of a group, each with its own PrefixStore("<device>/",
// group_store), and they must share one communicator (one set of connections, one order).
std::shared_ptr<CommHandle> shared_communicator(
    const std::string& group_id,
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::function<std::shared_ptr<CommHandle>()>& make);

} // namespace xccl_rs
