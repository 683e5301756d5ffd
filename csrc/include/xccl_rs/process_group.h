// A c10d::ProcessGroup whose getBackendName() is "xccl_rs" (torch's own answers "custom" for
// every backend registered from outside torch): what DDP's logging data, ProcessGroup.name() and
// the flight recorder read. Private groups (api.cc) and init_process_group groups served by
// xccl_rs alone (python/xccl_rs/__init__.py) are made of it.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace xccl_rs {

// Without backends: the caller registers them (ProcessGroup::setBackend) and the default.
c10::intrusive_ptr<c10d::ProcessGroup> new_named_process_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size);

} // namespace xccl_rs
