// xccl_rs for C++ (libtorch) programs: the public API of libxccl_rs.so, found with
// `find_package(xccl_rs)` (target xccl_rs::xccl_rs; see docs/cpp.md). It needs torch's headers
// only: the library must be used with the torch (major.minor) it was built against, which the
// CMake package checks.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

// The library is built with hidden visibility; these are the symbols it exports.
#define XCCL_RS_API __attribute__((visibility("default")))

namespace xccl_rs {

struct Options {
  // How long a collective (and the rendezvous) may take; zero or negative means c10d's
  // default, 30 minutes.
  std::chrono::milliseconds timeout{0};
  // The group's name, as torch reports it (Backend::getGroupUid, ProcessGroup::getGroupName).
  // It names the group; it does not separate store keys (see create_backend).
  std::string group_name;
  // This rank's accelerator, with its index (e.g. cuda:1), for accelerator tensors; unset
  // means the device of each call's tensors.
  std::optional<c10::Device> device;
};

// A c10d::Backend for `rank` of `size` ranks. It is collective: it blocks until every rank
// has called it on the same store (the ranks exchange addresses through it), or fails with a
// c10::DistBackendError after the timeout. Each call makes its own communicator (its own
// connections), and the rendezvous keys are fixed: one store (or c10d::PrefixStore) serves
// one xccl_rs group, so wrap the store in a PrefixStore per group.
XCCL_RS_API c10::intrusive_ptr<c10d::Backend> create_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout);

XCCL_RS_API c10::intrusive_ptr<c10d::Backend> create_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const Options& options);

// A c10d::ProcessGroup whose CPU, CUDA and XPU tensors are all served by one backend made by
// create_backend (the same rules apply), named options.group_name.
XCCL_RS_API c10::intrusive_ptr<c10d::ProcessGroup> new_process_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const Options& options);

// The torch the library was compiled against, "major.minor".
XCCL_RS_API std::string torch_version_built();

} // namespace xccl_rs
