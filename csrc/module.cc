// The Python module xccl_rs._C: pybind11 glue only. The backend creator that torch.distributed
// calls for each device type of each group (through python/xccl_rs/__init__.py) shares one
// communicator per group (communicator.h); the private-group helper is the C++ API's
// new_process_group (api.cc). Both block on the other ranks, so they run without the GIL.
#include <optional>
#include <string>

#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "xccl_rs/backend.h"
#include "xccl_rs/communicator.h"
#include "xccl_rs/errors.h"
#include "xccl_rs/process_group.h"
#include "xccl_rs/src/ffi.rs.h"
#include "xccl_rs/xccl_rs.h"

namespace xccl_rs {
namespace {

// How long Python's exit waits for completions still running (work.h wait_for_completions):
// one takes far less; the bound keeps a wedged one from holding the exit.
constexpr std::chrono::milliseconds kCompletionsWaitAtExit{5000};

c10::intrusive_ptr<c10d::Backend> create_shared_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& group_id,
    bool enable_reconfigure) {
  timeout = checked_timeout(rank, size, timeout);
  // enable_reconfigure: no rendezvous now; the first reconfigure() connects (reconfigure.cc).
  auto comm = shared_communicator(group_id, store, [&] {
    return enable_reconfigure ? unconnected_communicator(store) : new_communicator(store, rank, size, timeout);
  });
  return c10::make_intrusive<XcclRsBackend>(std::move(comm), rank, size, timeout);
}

// A private group (xccl_rs.new_group): no default process group, nothing registered with
// torch. It never shares a communicator (each call connects anew), so rebuilding a group under
// the same name with a new store prefix always gets fresh connections.
c10::intrusive_ptr<c10d::ProcessGroup> new_private_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& name,
    std::optional<c10::Device> device) {
  return new_process_group(store, rank, size, Options{timeout, name, device});
}

} // namespace
} // namespace xccl_rs

PYBIND11_MODULE(xccl_rs_cxx, m) {
  using no_gil = pybind11::call_guard<pybind11::gil_scoped_release>; // the rendezvous blocks on peers
  m.doc() = "xccl_rs native module: the c10d backend creator";
  m.def(
      "create_backend",
      &xccl_rs::create_shared_backend,
      pybind11::arg("store"),
      pybind11::arg("rank"),
      pybind11::arg("size"),
      pybind11::arg("timeout"),
      pybind11::arg("group_id") = "",
      pybind11::arg("enable_reconfigure") = false,
      no_gil(),
      "Create an xccl_rs c10d Backend over `store` for this rank.");
  m.def(
      "new_process_group",
      &xccl_rs::new_private_group,
      pybind11::arg("store"),
      pybind11::arg("rank"),
      pybind11::arg("size"),
      pybind11::arg("timeout"),
      pybind11::arg("name"),
      pybind11::arg("device") = std::nullopt,
      no_gil(),
      "Create a private ProcessGroup served by xccl_rs over `store` (see xccl_rs.new_group).");
  m.def(
      "named_process_group",
      &xccl_rs::new_named_process_group,
      pybind11::arg("store"),
      pybind11::arg("rank"),
      pybind11::arg("size"),
      "An empty ProcessGroup whose name() is 'xccl_rs' (the caller registers its backends).");
  m.def(
      "host_identity",
      [] {
        try {
          return std::string(xccl_rs::host_identity());
        } catch (const rust::Error& e) {
          xccl_rs::raise_core_error(e); // an invalid XCCL_RS_HOST_ID, say
        }
      },
      "Which ranks share memory: ranks with equal identities (the core's rule).");
  m.def(
      "zero_copy_ops",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) -> uint64_t {
        auto* ours = dynamic_cast<xccl_rs::XcclRsBackend*>(backend.get());
        TORCH_CHECK_VALUE(ours != nullptr, "xccl_rs.zero_copy_ops: ", backend->getBackendName(), " is not an xccl_rs backend");
        return ours->zero_copy_ops();
      },
      pybind11::arg("backend"),
      "Collectives of this backend so far that read the peers' tensors in place.");
  m.def(
      "stats",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) {
        auto* ours = dynamic_cast<xccl_rs::XcclRsBackend*>(backend.get());
        TORCH_CHECK_VALUE(ours != nullptr, "xccl_rs.stats: ", backend->getBackendName(), " is not an xccl_rs backend");
        pybind11::list rows;
        for (const auto& r : ours->stats()) {
          pybind11::dict row;
          row["op"] = std::string(r.op);
          row["path"] = std::string(r.path);
          row["ops"] = r.ops;
          row["bytes"] = r.bytes;
          row["seconds"] = static_cast<double>(r.nanos) / 1e9;
          rows.append(row);
        }
        return rows;
      },
      pybind11::arg("backend"),
      "The backend's statistics so far: one dict per (op, path) that ran (op, path, ops, bytes, seconds).");
  m.def(
      "set_global_ranks",
      [](const c10::intrusive_ptr<c10d::Backend>& backend, const std::vector<int64_t>& ranks) {
        if (auto* ours = dynamic_cast<xccl_rs::XcclRsBackend*>(backend.get())) {
          ours->set_global_ranks(ranks);
        }
      },
      pybind11::arg("backend"),
      pybind11::arg("ranks"),
      "Tells the backend its members' global ranks (torch.profiler's records carry them).");
  m.def(
      "wait_for_failure_hooks",
      [] {
        try {
          pybind11::gil_scoped_release no_gil_while_waiting; // the hooks may need the GIL
          const bool hooks_done = xccl_rs::wait_for_failure_hooks();
          // So may the last completions, which drop their tensors (work.h).
          return xccl_rs::wait_for_completions(xccl_rs::kCompletionsWaitAtExit) && hooks_done;
        } catch (const rust::Error& e) {
          xccl_rs::raise_core_error(e); // an invalid XCCL_RS_FAILURE_HOOKS_WAIT_MS
        }
      },
      "Waits (at most XCCL_RS_FAILURE_HOOKS_WAIT_MS) until no group's abort hooks are running, "
      "then until no work's completion is (which may drop tensors that Python objects own); "
      "True when none are. Registered with atexit on import.");
  m.attr("torch_version_built") = xccl_rs::torch_version_built();
}
