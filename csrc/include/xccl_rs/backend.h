// XcclRsBackend: the c10d::Backend of xccl_rs. It validates tensors, turns each c10d call into
// plain OpRequests (pointers, byte counts, dtype, op, root) and hands them to the Rust core.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "rust/cxx.h"
#include "xccl_rs/src/ffi.rs.h"
#include "xccl_rs/hooks.h"
#include "xccl_rs/version.h"
#include "xccl_rs/work.h"

// Whether a c10d call is synchronous (torch passes async_op down as opts.asyncOp).
#define XCCL_RS_CALLER_WAITS(opts) (!(opts).asyncOp)

namespace xccl_rs {

// One Rust communicator, shared by the backends that torch creates for each device type of a
// group, so that a group has one set of connections and one operation order.
struct CommHandle {
  // Empty until the first reconfigure() when the group was made with enable_reconfigure=True;
  // reconfigure() replaces it.
  std::optional<rust::Box<RustComm>> comm;
  c10::intrusive_ptr<c10d::Store> store; // keeps the rendezvous store (and its identity) alive
  // The communicators of child groups (split.cc) by key, made by `make` on first use.
  std::shared_ptr<CommHandle> child(const std::string& key, const std::function<std::shared_ptr<CommHandle>()>& make);
  std::mutex children_mu;
  std::map<std::string, std::weak_ptr<CommHandle>> children;
  ~CommHandle();
};

// torch's child groups reach the backend (split_group, shrink_group, merge_remote_group).
#if XCCL_RS_TORCH_AT_LEAST(2, 15)
#define XCCL_RS_HAS_CHILD_GROUPS 1
#endif

class XcclRsBackend : public c10d::Backend {
 public:
  XcclRsBackend(std::shared_ptr<CommHandle> comm, int rank, int size, std::chrono::milliseconds timeout);

  const std::string getBackendName() const override {
    return "xccl_rs";
  }
  bool supportsCoalescing() const override {
    return true;
  }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  uint64_t getSequenceNumberForGroup() override;
  void setSequenceNumberForGroup() override {}
#if XCCL_RS_TORCH_AT_LEAST(2, 9)
  void setTimeout(std::chrono::milliseconds timeout) override;
#endif
  void shutdown() override;
  // Stops the running op and fails queued ones at once; peers are told (fault tolerance below).
  void abort() override;

  // torch's fault-tolerance API (torch >= 2.15; reconfigure.cc).
#ifdef C10D_BACKEND_HAS_RECONFIGURE
  bool supportsReconfigure() const override {
    return true;
  }
  c10d::ReconfigureHandle get_reconfigure_handle() const override;
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override;
  c10d::ErrorType getError() override;
#endif
#ifdef XCCL_RS_HAS_CHILD_GROUPS
  // Child groups (split.cc).
  bool supportsSplitting() const override {
    return true;
  }
  bool isInitialized() override {
    return comm_->comm.has_value();
  }
  // What torch copies (and changes) for a child: the name and this group's timeout.
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>(getBackendName(), timeout_);
  }
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) override;
  c10::intrusive_ptr<c10d::Backend> merge(
      const c10::intrusive_ptr<c10d::Store>& store,
      const c10::intrusive_ptr<Options>& opts,
      const int& rank,
      const int& size) override;
  bool supportsShrinking() const override {
    return true;
  }
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranks_to_exclude,
      int shrink_flags,
      const c10::intrusive_ptr<Options>& opts_override) override;
#endif
#if XCCL_RS_HAS_ABORT_HOOKS
  void registerAbortHook(int64_t hook_id, c10d::AbortHook hook) override;
  void unregisterAbortHook(int64_t hook_id) override;
#endif
#if XCCL_RS_HAS_COMPLETION_HOOKS
  bool supportsAbortHooks() const override {
    return true;
  }
  bool supportsCompletionHooks() const override {
    return true;
  }
  void registerCompletionHook(int64_t hook_id, c10d::CompletionHook hook) override;
  void unregisterCompletionHook(int64_t hook_id) override;
#endif

  // Tensors in this rank's shared-memory heap, which collectives read in place (allocator.cc).
  bool supportsTensorAlloc(c10::DeviceIndex device) override;
  std::shared_ptr<c10::Allocator> getMemAllocator() override;
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;
  // Collectives so far that read peers' tensors in place (diagnostics, tests).
  uint64_t zero_copy_ops() const;
  // The group's statistics so far (src/stats.rs), one row per (op kind, algorithm).
  rust::Vec<OpStatsRow> stats() const;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts)
      override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplits,
      std::vector<int64_t>& inputSplits,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

#if XCCL_RS_TORCH_AT_LEAST(2, 14)
  // torch 2.14 renamed several ops and made each pair of names forward to each other by default
  // (all_gather_single and _allgather_base, reduce_scatter_single and _reduce_scatter_base,
  // all_to_all_single and alltoall_base, their _coalesced forms, gather_single and
  // gather_into_tensor): overriding one name of a pair serves both. The old names are
  // overridden above; gather_single is new.
  c10::intrusive_ptr<c10d::Work> gather_single(at::Tensor& output, at::Tensor& input, const c10d::GatherOptions& opts)
      override;
#endif

  // The group's members' global ranks, indexed by group rank (torch's global_ranks_in_group,
  // empty for the default group), for torch.profiler's records; kept when they are evenly
  // spaced, as torch records them.
  void set_global_ranks(const std::vector<int64_t>& ranks);

 // Builds one submission (backend.cc); public so that file-local helpers can take it.
  class Job;

 private:
  Job begin(const char* what, OpKind kind);
  // Submits the job (or adds it to the coalesced batch). `caller_waits`: the c10d call is
  // synchronous, so the job may run on this thread when the group is idle.
  c10::intrusive_ptr<c10d::Work> launch(Job& job, c10d::OpType type, bool caller_waits = false);
  // send, recv and recvAnysource (peer -1): one tensor to or from one peer.
  c10::intrusive_ptr<c10d::Work> point_to_point(
      OpKind kind,
      c10d::OpType type,
      std::vector<at::Tensor>& tensors,
      int peer,
      int tag);

  // The group's communicator; throws when there is none yet (enable_reconfigure=True before
  // the first reconfigure()).
  RustComm& comm() const;
  // Makes the abort hooks hear the current communicator's failure.
  void listen_for_failure();

  std::shared_ptr<CommHandle> comm_;
  std::chrono::milliseconds timeout_;
  // The group's global ranks as start + i * stride, for profiler records (set_global_ranks);
  // stride 0: not known.
  int global_rank_start_ = 0;
  int global_rank_stride_ = 0;
  // Whether the communicator knows the group's name (its statistics lines carry it).
  bool named_ = false;
  std::shared_ptr<AbortHooks> abort_hooks_ = std::make_shared<AbortHooks>();
  std::shared_ptr<CompletionHooks> completion_hooks_ = std::make_shared<CompletionHooks>();
  // A new job's state, told the completion hooks.
  std::shared_ptr<WorkState> new_job_state(const char* what);
#ifdef XCCL_RS_HAS_CHILD_GROUPS
  // A child group's backend over `store`, its communicator shared under `key` (split.cc).
  c10::intrusive_ptr<c10d::Backend> child(
      const std::string& key,
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      const c10::intrusive_ptr<Options>& opts);
#endif
  // How many children of each kind this backend made: the keys its siblings share.
  uint64_t split_count_ = 0;
  uint64_t merge_count_ = 0;
  uint64_t shrink_count_ = 0;
  // This backend's identity in reconfigure handles, and the uuid of its current generation.
  uint64_t instance_id_;
  int64_t reconfigure_uuid_ = -1;
  // The accelerator this rank's tensors live on, once known (see Job::staging).
  std::optional<c10::Device> device_;
  bool coalescing_ = false;
  std::shared_ptr<WorkState> coalesced_state_;
  rust::Vec<OpRequest> coalesced_ops_;
};

} // namespace xccl_rs
