// Making communicators, shared by the C++ API (csrc/api.cc) and the Python module
// (csrc/module.cc). Nothing here touches Python: a caller that holds the GIL must release it
// first, since making a communicator blocks on the other ranks.
#pragma once

#include <chrono>
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

// The communicator of group `group_id` on `store`, made on first use: torch creates one backend
// per device type of a group, each with its own PrefixStore("<device>/", group_store), and
// they must share one communicator (one set of connections, one operation order).
// With `connect` false (enable_reconfigure=True) the handle has no communicator until the
// first reconfigure() (reconfigure.cc).
std::shared_ptr<CommHandle> shared_communicator(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& group_id,
    bool connect = true);

} // namespace xccl_rs
