// XcclRsBackend: checks each c10d call's tensors and turns it into OpRequests for the Rust core
// (see src/op.rs for the buffer layout of each kind). Argument errors that only this rank can
// see (its list lengths, its sizes) also abort the group, so that peers already waiting in the
// collective fail at once with this rank's message instead of at the timeout.
#include "xccl_rs/backend.h"

#include <numeric>
#include <random>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "xccl_rs/errors.h"
#include "xccl_rs/profile.h"

namespace xccl_rs {

namespace {

// The core's element type of a tensor; types it cannot reduce but can move travel as bytes.
DType wire_dtype(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return DType::Float64;
    case at::kFloat: return DType::Float32;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kChar: return DType::Int8;
    case at::kByte: return DType::UInt8;
    case at::kShort: return DType::Int16;
    case at::kInt: return DType::Int32;
    case at::kLong: return DType::Int64;
    case at::kBool: return DType::Bool;
    case at::kUInt16: return DType::UInt16;
    case at::kUInt32: return DType::UInt32;
    case at::kUInt64: return DType::UInt64;
    case at::kFloat8_e4m3fn: return DType::Float8E4M3FN;
    case at::kFloat8_e5m2: return DType::Float8E5M2;
    case at::kFloat8_e4m3fnuz: return DType::Float8E4M3FNUZ;
    case at::kFloat8_e5m2fnuz: return DType::Float8E5M2FNUZ;
    default: return DType::Bytes;
  }
}

// A host tensor's bytes.
BufferView view_of(const at::Tensor& t) {
  return BufferView{BufferPlace::Host, 0, reinterpret_cast<size_t>(t.data_ptr()), static_cast<size_t>(t.nbytes())};
}

// All the bytes of the job's staged tensor number `tensor`.
BufferView staged(size_t tensor, const at::Tensor& t) {
  return BufferView{BufferPlace::Staged, tensor, 0, static_cast<size_t>(t.nbytes())};
}

// Bytes [offset, offset + bytes) of `whole` (either place: `start` is an address or an offset).
BufferView sub_view(const BufferView& whole, size_t offset, size_t bytes) {
  return BufferView{whole.place, whole.tensor, whole.start + offset, bytes};
}

// Consecutive equal byte ranges of one contiguous tensor (its rows, when split by rank).
rust::Vec<BufferView> split_views(const BufferView& whole, int parts) {
  rust::Vec<BufferView> views;
  const size_t each = whole.bytes / static_cast<size_t>(parts);
  for (int i = 0; i < parts; ++i) {
    views.push_back(sub_view(whole, each * static_cast<size_t>(i), each));
  }
  return views;
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes() << " " << c10::toString(t.scalar_type());
  return s.str();
}

OpRequest request(OpKind kind, const at::Tensor* like) {
  OpRequest r;
  r.kind = kind;
  r.dtype = like ? wire_dtype(like->scalar_type()) : DType::UInt8;
  r.reduce_op = ReduceOp::Sum;
  r.premul_factor = 1.0;
  r.root = 0;
  r.tag = 0;
  return r;
}

} // namespace

// Seals a job's device staging (its tensors are all added; records the call's event) and
// returns it for the Rust core, which plans and runs its copies, with the descriptions of its
// tensors; null for a job on host tensors.
static std::unique_ptr<StagingHandle> seal_staging(WorkState& state, rust::Vec<StagedTensor>& described) {
  if (!state.staging) {
    return nullptr;
  }
  state.staging->seal();
  for (const auto& t : state.staging->tensors()) {
    described.push_back(StagedTensor{static_cast<size_t>(t.device.nbytes()), t.device.is_contiguous(), t.read, t.write});
  }
  return std::make_unique<StagingHandle>(StagingHandle{state.staging});
}

CommHandle::~CommHandle() {
  try {
    if (comm.has_value()) {
      (*comm)->shutdown();
    }
  } catch (...) {
  }
}

// Builds one submission: stages tensors, keeps them alive, collects OpRequests.
class XcclRsBackend::Job {
 public:
  Job(XcclRsBackend& backend, const char* what, OpKind kind, std::shared_ptr<WorkState> state)
      : backend_(backend), what_(what), kind_(kind), state_(std::move(state)) {}

  // "xccl_rs: allgather #5 on rank 1": the start of every message about this call.
  std::string prefix() const {
    return std::string("xccl_rs: ") + what_ + " #" + std::to_string(backend_.comm().next_seq()) + " on rank " +
        std::to_string(backend_.getRank());
  }

  // An argument error every rank sees the same way (dtype, op, device): raise here only.
  [[noreturn]] void reject(const std::string& message) const {
    TORCH_CHECK_VALUE(false, prefix(), ": ", message);
  }

  // An argument error of this rank alone: peers are already in the collective, so abort them.
  [[noreturn]] void reject_and_abort(const std::string& message) const {
    const std::string full = prefix() + ": " + message;
    backend_.comm().abort_op(kind_, full);
    TORCH_CHECK_VALUE(false, full);
  }

  void check(const at::Tensor& t) const {
    if (!t.defined()) {
      reject_and_abort("got an undefined tensor");
    }
    if (t.layout() != c10::kStrided) {
      reject("sparse and other non-strided tensors are not supported (got layout " + c10::str(t.layout()) + ")");
    }
    if (t.device().is_meta()) {
      reject("got a tensor on the meta device, which holds no data");
    }
    if (!t.device().is_cpu() && !c10::impl::hasDeviceGuardImpl(t.device().type())) {
      reject("got a tensor on " + t.device().str() + ", which is neither the host nor an accelerator with streams");
    }
  }

  // The host staging of this job's accelerator tensors, created on the first one. A rank is
  // bound to one device: the group's bound device (init_process_group(device_id=...)), else
  // the first device it used.
  DeviceStaging& staging(const at::Tensor& t) {
    const c10::Device device = t.device();
    auto& bound = backend_.device_;
    if (!bound) {
      bound = backend_.getBoundDeviceId().value_or(device); // both always carry an index
    }
    if (*bound != device) {
      reject_and_abort(
          "got a tensor on " + device.str() + ", but this rank uses " + bound->str() +
          " (one device per rank: set it with init_process_group(device_id=...) or torch.cuda/xpu.set_device)");
    }
    if (!state_->staging) {
      state_->staging = std::make_shared<DeviceStaging>(device);
      // A device-aware future: its users' streams wait for the copies back, as with NCCL.
      state_->future = c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device});
    } else if (state_->staging->device() != device) {
      reject_and_abort("got tensors on " + state_->staging->device().str() + " and " + device.str() + " in one operation");
    }
    return *state_->staging;
  }

  void same_kind(const at::Tensor& t, const at::Tensor& like, const std::string& role) const {
    if (t.scalar_type() != like.scalar_type()) {
      reject_and_abort(role + " has dtype " + c10::toString(t.scalar_type()) + ", expected " + c10::toString(like.scalar_type()));
    }
  }

  // `t`, one tensor of a list with one per rank, must match `like` (the call's other tensor,
  // named `like_name`) in dtype and element count.
  void like_other(const at::Tensor& t, const at::Tensor& like, const char* role, const char* like_name) const {
    same_kind(t, like, role);
    if (t.numel() != like.numel()) {
      reject_and_abort(std::string(role) + " has shape " + shape_of(t) + " but " + like_name + " has " + shape_of(like));
    }
  }

  // `list` (one tensor per rank, each like the call's input `in`) as the outputs of `r`.
  void outputs_like(OpRequest& r, std::vector<at::Tensor>& list, const at::Tensor& in) {
    for (auto& out : list) {
      like_other(out, in, "an output tensor", "the input");
      r.outputs.push_back(output_only(out));
    }
  }

  // `list` (one tensor per rank, each like the call's output `out`) as the inputs of `r`.
  void inputs_like(OpRequest& r, std::vector<at::Tensor>& list, const at::Tensor& out) {
    for (auto& in : list) {
      like_other(in, out, "an input tensor", "the output");
      r.inputs.push_back(input(in));
    }
  }

  // `whole` holds one `part` per rank (all_gather_into_tensor's output, reduce_scatter_tensor's
  // input): the same dtype and the group's size times the elements. `part_name` names the part
  // in the message ("the input's").
  void stacked(const at::Tensor& whole, const at::Tensor& part, const std::string& whole_name, const char* part_name) const {
    same_kind(whole, part, whole_name);
    const int size = backend_.getSize();
    if (whole.numel() != part.numel() * size) {
      reject_and_abort(whole_name + " has shape " + shape_of(whole) + ", expected " + std::to_string(size) + " times " +
                       part_name + " " + std::to_string(part.numel()) + " elements");
    }
  }

  // A list of `n` tensors (`name`) that must hold one per rank.
  void one_per_rank(size_t n, const char* name) const {
    if (static_cast<int>(n) != backend_.getSize()) {
      reject_and_abort(std::string(name) + " has " + std::to_string(n) + " tensors, expected " +
                       std::to_string(backend_.getSize()) + " (one per rank)");
    }
  }

  // A coalesced call's lists of outputs and inputs, which pair up.
  void paired(size_t outputs, size_t inputs) const {
    if (outputs != inputs) {
      reject_and_abort("got " + std::to_string(outputs) + " outputs for " + std::to_string(inputs) + " inputs");
    }
  }

  // A rooted call's list of lists (`lists`, whose tensors are `role`s): on the root, one list of
  // one tensor per rank; elsewhere none. Whether this rank is the root.
  bool root_list(const std::vector<std::vector<at::Tensor>>& lists, int root, const char* role) const {
    if (root == backend_.getRank()) {
      if (lists.size() != 1 || static_cast<int>(lists[0].size()) != backend_.getSize()) {
        reject_and_abort(std::string("the root needs one ") + role + " list of " + std::to_string(backend_.getSize()) +
                         " tensors");
      }
      return true;
    }
    if (!lists.empty() && !lists[0].empty()) {
      reject_and_abort("only the root (rank " + std::to_string(root) + ") passes " + role + " tensors");
    }
    return false;
  }

  // The bytes of a tensor the op only reads: the tensor's own when contiguous, else a
  // contiguous copy's; an accelerator tensor is staged (its host memory is allocated by the
  // thread that runs the job, src/staging/).
  BufferView input(const at::Tensor& t) {
    check(t);
    profile_.input(t);
    if (!t.device().is_cpu()) {
      return staged(staging(t).add(t, /*read=*/true, /*write=*/false), t);
    }
    at::Tensor c = t.is_contiguous() ? t : t.contiguous();
    state_->keep_alive.push_back(c);
    return view_of(c);
  }

  // A tensor the op only reads that is still part of the result (the future's value), like a
  // reduce's tensor on the ranks other than the root.
  BufferView unchanged_result(const at::Tensor& t) {
    BufferView v = input(t);
    state_->outputs.push_back(t);
    return v;
  }

  // A tensor the op reads and writes (in place): non-contiguous ones are staged and copied
  // back; accelerator tensors are staged to the host and back.
  BufferView output(const at::Tensor& t) {
    return output(t, /*read=*/true);
  }
  // A tensor the op only writes: an accelerator tensor's old values are not copied to the host.
  BufferView output_only(const at::Tensor& t) {
    return output(t, /*read=*/false);
  }

  BufferView output(const at::Tensor& t, bool read) {
    check(t);
    profile_.output(t);
    state_->outputs.push_back(t);
    if (!t.device().is_cpu()) {
      return staged(staging(t).add(t, read, /*write=*/true), t);
    }
    if (t.is_contiguous()) {
      state_->keep_alive.push_back(t);
      return view_of(t);
    }
    at::Tensor c = t.contiguous();
    state_->copy_back.emplace_back(t, c);
    state_->keep_alive.push_back(c);
    return view_of(c);
  }

  // Whether the core defines the op on the dtype is its own check, when the job is submitted
  // (an InvalidArgument error: a ValueError on every rank, the group goes on).
  void set_reduction(OpRequest& r, const c10d::ReduceOp& op) const {
    switch (op.op_) {
      case c10d::ReduceOp::SUM: r.reduce_op = ReduceOp::Sum; break;
      case c10d::ReduceOp::AVG: r.reduce_op = ReduceOp::Avg; break;
      case c10d::ReduceOp::PRODUCT: r.reduce_op = ReduceOp::Product; break;
      case c10d::ReduceOp::MIN: r.reduce_op = ReduceOp::Min; break;
      case c10d::ReduceOp::MAX: r.reduce_op = ReduceOp::Max; break;
      case c10d::ReduceOp::BAND: r.reduce_op = ReduceOp::BAnd; break;
      case c10d::ReduceOp::BOR: r.reduce_op = ReduceOp::BOr; break;
      case c10d::ReduceOp::BXOR: r.reduce_op = ReduceOp::BXor; break;
      case c10d::ReduceOp::PREMUL_SUM: {
        r.reduce_op = ReduceOp::PreMulSum;
        auto* s = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
        if (s == nullptr) {
          reject("ReduceOp.PREMUL_SUM without a factor (build it with torch.distributed._make_nccl_premul_sum)");
        }
        r.premul_factor = s->tensor_factor.defined() ? s->tensor_factor.to(at::kDouble).item<double>() : s->double_factor;
        break;
      }
      default: reject("unsupported reduce op code " + std::to_string(static_cast<int>(op.op_)));
    }
  }

  void add(OpRequest r) {
    ops_.push_back(std::move(r));
  }

  rust::Vec<OpRequest>& ops() {
    return ops_;
  }
  const std::shared_ptr<WorkState>& state() const {
    return state_;
  }
  const OpProfile& profile() const {
    return profile_;
  }
  const char* what() const {
    return what_;
  }
  OpKind kind() const {
    return kind_;
  }
  int group_size() const {
    return backend_.getSize();
  }

 private:
  XcclRsBackend& backend_;
  const char* what_;
  OpKind kind_;
  std::shared_ptr<WorkState> state_;
  rust::Vec<OpRequest> ops_;
  OpProfile profile_; // the call's tensors, while a profiler is on
};

XcclRsBackend::XcclRsBackend(std::shared_ptr<CommHandle> comm, int rank, int size, std::chrono::milliseconds timeout)
    : c10d::Backend(rank, size), comm_(std::move(comm)), timeout_(timeout), instance_id_(std::random_device{}()) {
  instance_id_ = instance_id_ << 32 | std::random_device{}();
  listen_for_failure();
}

void XcclRsBackend::set_global_ranks(const std::vector<int64_t>& ranks) {
  // No list: the default group, whose members are the world (ProcessGroupNCCL's reading).
  global_rank_start_ = 0;
  global_rank_stride_ = ranks.empty() ? 1 : 0;
  if (static_cast<int>(ranks.size()) != getSize()) {
    return;
  }
  const int64_t stride = ranks.size() > 1 ? ranks[1] - ranks[0] : 1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (stride <= 0 || ranks[i] != ranks[0] + static_cast<int64_t>(i) * stride) {
      return;
    }
  }
  global_rank_start_ = static_cast<int>(ranks[0]);
  global_rank_stride_ = static_cast<int>(stride);
}

RustComm& XcclRsBackend::comm() const {
  TORCH_CHECK(comm_->comm.has_value(), "xccl_rs: this group has not been initialized. Call reconfigure() before issuing "
              "collectives when enable_reconfigure=True.");
  return **comm_->comm;
}

void XcclRsBackend::listen_for_failure() {
  if (comm_->comm.has_value()) {
    (*comm_->comm)->listen_for_failure(std::make_unique<FailureListener>(FailureListener{abort_hooks_}));
  }
}

XcclRsBackend::Job XcclRsBackend::begin(const char* what, OpKind kind) {
  (void)comm(); // a clear error before anything else when there is no communicator yet
  return Job(*this, what, kind, coalescing_ ? coalesced_state_ : new_job_state(what));
}

std::shared_ptr<WorkState> XcclRsBackend::new_job_state(const char* what) {
  auto state = new_work_state(what);
  state->completion_hooks = completion_hooks_;
  return state;
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::launch(Job& job, c10d::OpType type, bool caller_waits) {
  if (coalescing_) {
    for (auto& op : job.ops()) {
      coalesced_ops_.push_back(std::move(op));
    }
    return c10::make_intrusive<XcclRsWork>(getRank(), type, coalesced_state_);
  }
  if (!named_) { // torch names a group after creating its backend
    comm().set_group_name(getGroupUid());
    named_ = true;
  }
  auto done = std::make_unique<WorkDone>(WorkDone{job.state()});
  rust::Vec<StagedTensor> staged;
  auto staging = seal_staging(*job.state(), staged);
  auto submit = [&] {
    try {
      comm().submit(std::move(job.ops()), std::move(staged), std::move(staging), std::move(done), caller_waits);
    } catch (const rust::Error& e) {
      raise_core_error(e);
    }
  };
  if (job.profile().on()) {
    const auto kind = job.kind();
    const bool p2p = kind == OpKind::Send || kind == OpKind::Recv || kind == OpKind::RecvAnySource;
    const OpIssuer issuer{{getGroupUid(), getGroupDesc()}, getRank(), getSize(), global_rank_start_, global_rank_stride_};
    profiled_call(job.profile(), issuer, job.what(), kind, static_cast<int64_t>(comm().next_seq()), p2p,
                  job.state()->profile_end, submit);
  } else {
    submit();
  }
  return c10::make_intrusive<XcclRsWork>(getRank(), type, job.state());
}

void XcclRsBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "xccl_rs: startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  coalesced_state_ = new_job_state("coalesced operations");
  coalesced_ops_.clear();
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "xccl_rs: endCoalescing called without startCoalescing");
  coalescing_ = false;
  auto state = std::move(coalesced_state_);
  auto done = std::make_unique<WorkDone>(WorkDone{state});
  rust::Vec<StagedTensor> staged;
  auto staging = seal_staging(*state, staged);
  try {
    comm().submit(std::move(coalesced_ops_), std::move(staged), std::move(staging), std::move(done), false);
  } catch (const rust::Error& e) {
    raise_core_error(e);
  }
  coalesced_ops_ = rust::Vec<OpRequest>();
  return c10::make_intrusive<XcclRsWork>(getRank(), c10d::OpType::COALESCED, state);
}

uint64_t XcclRsBackend::getSequenceNumberForGroup() {
  return comm().next_seq();
}

#if XCCL_RS_TORCH_AT_LEAST(2, 9)
void XcclRsBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout; // also for a communicator that reconfigure() makes later
  if (comm_->comm.has_value()) {
    (*comm_->comm)->set_timeout_ms(static_cast<uint64_t>(timeout.count()));
  }
}
#endif

void XcclRsBackend::shutdown() {
  if (comm_->comm.has_value()) {
    (*comm_->comm)->shutdown();
  }
}

void XcclRsBackend::abort() {
  if (comm_->comm.has_value()) {
    (*comm_->comm)->abort_group("the group was aborted (Backend.abort()) on rank " + std::to_string(getRank()));
  }
}

// ---- all-reduce, broadcast, reduce ----

c10::intrusive_ptr<c10d::Work> XcclRsBackend::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  auto job = begin("allreduce", OpKind::AllReduce);
  if (tensors.size() != 1) {
    job.reject("takes exactly one tensor per rank, got " + std::to_string(tensors.size()));
  }
  auto r = request(OpKind::AllReduce, &tensors[0]);
  job.set_reduction(r, opts.reduceOp);
  r.outputs.push_back(job.output(tensors[0]));
  job.add(std::move(r));
  return launch(job, c10d::OpType::ALLREDUCE, XCCL_RS_CALLER_WAITS(opts));
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  auto job = begin("allreduce_coalesced", OpKind::AllReduce);
  for (auto& t : tensors) {
    auto r = request(OpKind::AllReduce, &t);
    job.set_reduction(r, opts.reduceOp);
    r.outputs.push_back(job.output(t));
    job.add(std::move(r));
  }
  return launch(job, c10d::OpType::ALLREDUCE_COALESCED, XCCL_RS_CALLER_WAITS(opts));
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  auto job = begin("broadcast", OpKind::Broadcast);
  if (tensors.size() != 1 || opts.rootTensor != 0) {
    job.reject("takes exactly one tensor per rank");
  }
  auto r = request(OpKind::Broadcast, &tensors[0]);
  r.root = opts.rootRank;
  // Only the root's values are read, and they do not change: the root's accelerator tensor is
  // not copied back, the others' are not copied to the host.
  const bool is_root = opts.rootRank == getRank();
  r.outputs.push_back(is_root ? job.unchanged_result(tensors[0]) : job.output_only(tensors[0]));
  job.add(std::move(r));
  return launch(job, c10d::OpType::BROADCAST, XCCL_RS_CALLER_WAITS(opts));
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  auto job = begin("reduce", OpKind::Reduce);
  if (tensors.size() != 1 || opts.rootTensor != 0) {
    job.reject("takes exactly one tensor per rank");
  }
  auto r = request(OpKind::Reduce, &tensors[0]);
  r.root = opts.rootRank;
  job.set_reduction(r, opts.reduceOp);
  // Only the root's tensor changes: elsewhere it is an input only (nothing copied back).
  r.outputs.push_back(opts.rootRank == getRank() ? job.output(tensors[0]) : job.unchanged_result(tensors[0]));
  job.add(std::move(r));
  return launch(job, c10d::OpType::REDUCE, XCCL_RS_CALLER_WAITS(opts));
}

// ---- all-gather ----

c10::intrusive_ptr<c10d::Work> XcclRsBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto job = begin("allgather", OpKind::AllGather);
  if (inputs.size() != 1 || outputs.size() != 1) {
    job.reject("takes one input tensor and one output list per rank");
  }
  const at::Tensor& in = inputs[0];
  job.one_per_rank(outputs[0].size(), "the output list");
  auto r = request(OpKind::AllGather, &in);
  r.inputs.push_back(job.input(in));
  job.outputs_like(r, outputs[0], in);
  job.add(std::move(r));
  return launch(job, c10d::OpType::ALLGATHER, XCCL_RS_CALLER_WAITS(opts));
}

namespace {
// An all-gather into one tensor, `output` holding every rank's `input` in rank order; the
// names say which tensors they are in a message.
void add_allgather_into(XcclRsBackend::Job& job, at::Tensor& output, at::Tensor& input, const std::string& output_name,
                        const char* input_name) {
  job.stacked(output, input, output_name, input_name);
  auto r = request(OpKind::AllGather, &input);
  r.inputs.push_back(job.input(input));
  r.outputs = split_views(job.output_only(output), job.group_size());
  job.add(std::move(r));
}

// A reduce-scatter of one tensor, `input` holding one `output` per rank in rank order.
void add_reduce_scatter_of(XcclRsBackend::Job& job, at::Tensor& output, at::Tensor& input, const c10d::ReduceOp& op,
                           const std::string& input_name, const char* output_name) {
  auto r = request(OpKind::ReduceScatter, &output);
  job.set_reduction(r, op);
  job.stacked(input, output, input_name, output_name);
  r.inputs = split_views(job.input(input), job.group_size());
  r.outputs.push_back(job.output_only(output));
  job.add(std::move(r));
}
} // namespace

c10::intrusive_ptr<c10d::Work> XcclRsBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  auto job = begin("all_gather_into_tensor", OpKind::AllGather);
  add_allgather_into(job, output, input, "the output", "the input's");
  return launch(job, c10d::OpType::_ALLGATHER_BASE, XCCL_RS_CALLER_WAITS(opts));
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto job = begin("allgather_into_tensor_coalesced", OpKind::AllGather);
  job.paired(outputs.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    add_allgather_into(job, outputs[i], inputs[i], "output " + std::to_string(i), "its input's");
  }
  return launch(job, c10d::OpType::COALESCED, XCCL_RS_CALLER_WAITS(opts));
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  // outputLists[r][i] receives input i of rank r (gloo's layout).
  auto job = begin("allgather_coalesced", OpKind::AllGather);
  if (static_cast<int>(outputLists.size()) != getSize()) {
    job.reject_and_abort("expected one output list per rank (" + std::to_string(getSize()) + "), got " +
                         std::to_string(outputLists.size()));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto r = request(OpKind::AllGather, &inputs[i]);
    r.inputs.push_back(job.input(inputs[i]));
    for (auto& list : outputLists) {
      if (list.size() != inputs.size() || list[i].numel() != inputs[i].numel()) {
        job.reject_and_abort("output lists must match the inputs in length and sizes");
      }
      job.same_kind(list[i], inputs[i], "an output tensor");
      r.outputs.push_back(job.output_only(list[i]));
    }
    job.add(std::move(r));
  }
  return launch(job, c10d::OpType::ALLGATHER_COALESCED, XCCL_RS_CALLER_WAITS(opts));
}

// ---- gather, scatter ----

c10::intrusive_ptr<c10d::Work> XcclRsBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  auto job = begin("gather", OpKind::Gather);
  if (inputs.size() != 1) {
    job.reject("takes exactly one input tensor per rank");
  }
  const at::Tensor& in = inputs[0];
  auto r = request(OpKind::Gather, &in);
  r.root = opts.rootRank;
  r.inputs.push_back(job.input(in));
  if (job.root_list(outputs, opts.rootRank, "output")) {
    job.outputs_like(r, outputs[0], in);
  }
  job.add(std::move(r));
  return launch(job, c10d::OpType::GATHER, XCCL_RS_CALLER_WAITS(opts));
}

#if XCCL_RS_TORCH_AT_LEAST(2, 14)
c10::intrusive_ptr<c10d::Work> XcclRsBackend::gather_single(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::GatherOptions& opts) {
  auto job = begin("gather", OpKind::Gather);
  auto r = request(OpKind::Gather, &input);
  r.root = opts.rootRank;
  r.inputs.push_back(job.input(input));
  if (opts.rootRank == getRank()) {
    job.stacked(output, input, "the output", "the input's");
    r.outputs = split_views(job.output_only(output), getSize());
  }
  job.add(std::move(r));
  return launch(job, c10d::OpType::GATHER, XCCL_RS_CALLER_WAITS(opts));
}
#endif

c10::intrusive_ptr<c10d::Work> XcclRsBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  auto job = begin("scatter", OpKind::Scatter);
  if (outputs.size() != 1) {
    job.reject("takes exactly one output tensor per rank");
  }
  const at::Tensor& out = outputs[0];
  auto r = request(OpKind::Scatter, &out);
  r.root = opts.rootRank;
  if (job.root_list(inputs, opts.rootRank, "input")) {
    job.inputs_like(r, inputs[0], out);
  }
  r.outputs.push_back(job.output_only(out));
  job.add(std::move(r));
  return launch(job, c10d::OpType::SCATTER, XCCL_RS_CALLER_WAITS(opts));
}

// ---- reduce-scatter ----

c10::intrusive_ptr<c10d::Work> XcclRsBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  auto job = begin("reduce_scatter", OpKind::ReduceScatter);
  if (outputs.size() != 1 || inputs.size() != 1) {
    job.reject("takes one output tensor and one input list per rank");
  }
  const at::Tensor& out = outputs[0];
  auto r = request(OpKind::ReduceScatter, &out);
  job.set_reduction(r, opts.reduceOp);
  job.one_per_rank(inputs[0].size(), "the input list");
  job.inputs_like(r, inputs[0], out);
  r.outputs.push_back(job.output_only(out));
  job.add(std::move(r));
  return launch(job, c10d::OpType::REDUCE_SCATTER, XCCL_RS_CALLER_WAITS(opts));
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  auto job = begin("reduce_scatter_tensor", OpKind::ReduceScatter);
  add_reduce_scatter_of(job, output, input, opts.reduceOp, "the input", "the output's");
  return launch(job, c10d::OpType::_REDUCE_SCATTER_BASE, XCCL_RS_CALLER_WAITS(opts));
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  auto job = begin("reduce_scatter_tensor_coalesced", OpKind::ReduceScatter);
  job.paired(outputs.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    add_reduce_scatter_of(job, outputs[i], inputs[i], opts.reduceOp, "input " + std::to_string(i), "its output's");
  }
  return launch(job, c10d::OpType::COALESCED, XCCL_RS_CALLER_WAITS(opts));
}

// ---- all-to-all ----

namespace {
// Byte ranges of tensor `t`'s contiguous bytes `whole`, cut along dim 0 by `splits` (rows), or
// equally by rank.
rust::Vec<BufferView> split_rows(
    XcclRsBackend::Job& job,
    const at::Tensor& t,
    const BufferView& whole,
    const std::vector<int64_t>& splits,
    int size,
    const char* role) {
  if (splits.empty()) {
    if (t.numel() % size != 0 || (t.dim() > 0 && t.size(0) % size != 0)) {
      job.reject_and_abort(std::string("the ") + role + " of shape " + shape_of(t) +
                           " cannot be split equally among " + std::to_string(size) + " ranks");
    }
    return split_views(whole, size);
  }
  if (static_cast<int>(splits.size()) != size) {
    job.reject_and_abort(std::string(role) + " split sizes have " + std::to_string(splits.size()) + " entries, expected " +
                         std::to_string(size));
  }
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  int64_t total = 0;
  for (int64_t s : splits) {
    if (s < 0) {
      job.reject_and_abort(std::string(role) + " split sizes must not be negative");
    }
    total += s;
  }
  if (total != rows) {
    job.reject_and_abort(std::string(role) + " split sizes add up to " + std::to_string(total) + " but the " + role +
                         " has " + std::to_string(rows) + " rows");
  }
  const size_t row_bytes = rows == 0 ? 0 : whole.bytes / static_cast<size_t>(rows);
  rust::Vec<BufferView> views;
  size_t offset = 0;
  for (int64_t s : splits) {
    const size_t bytes = static_cast<size_t>(s) * row_bytes;
    views.push_back(sub_view(whole, offset, bytes));
    offset += bytes;
  }
  return views;
}
} // namespace

c10::intrusive_ptr<c10d::Work> XcclRsBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplits,
    std::vector<int64_t>& inputSplits,
    const c10d::AllToAllOptions& opts) {
  auto job = begin("all_to_all_single", OpKind::AllToAll);
  job.same_kind(output, input, "the output tensor");
  auto r = request(OpKind::AllToAll, &input);
  r.inputs = split_rows(job, input, job.input(input), inputSplits, getSize(), "input");
  r.outputs = split_rows(job, output, job.output_only(output), outputSplits, getSize(), "output");
  job.add(std::move(r));
  return launch(job, c10d::OpType::ALLTOALL_BASE, XCCL_RS_CALLER_WAITS(opts));
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  auto job = begin("alltoall", OpKind::AllToAll);
  if (static_cast<int>(outputs.size()) != getSize() || static_cast<int>(inputs.size()) != getSize()) {
    job.reject_and_abort("needs one input and one output tensor per rank (" + std::to_string(getSize()) + "), got " +
                         std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
  }
  auto r = request(OpKind::AllToAll, &inputs[0]);
  for (int i = 0; i < getSize(); ++i) {
    job.same_kind(inputs[i], inputs[0], "an input tensor");
    job.same_kind(outputs[i], inputs[0], "an output tensor");
    r.inputs.push_back(job.input(inputs[i]));
    r.outputs.push_back(job.output_only(outputs[i]));
  }
  job.add(std::move(r));
  return launch(job, c10d::OpType::ALLTOALL, XCCL_RS_CALLER_WAITS(opts));
}

// ---- point-to-point, barrier ----

c10::intrusive_ptr<c10d::Work> XcclRsBackend::point_to_point(
    OpKind kind,
    c10d::OpType type,
    std::vector<at::Tensor>& tensors,
    int peer,
    int tag) {
  auto job = begin(kind == OpKind::Send ? "send" : "recv", kind);
  if (tensors.size() != 1) {
    job.reject("takes exactly one tensor");
  }
  auto r = request(kind, &tensors[0]);
  r.root = peer;
  r.tag = tag;
  if (kind == OpKind::Send) {
    r.inputs.push_back(job.input(tensors[0]));
  } else {
    r.outputs.push_back(job.output_only(tensors[0]));
  }
  job.add(std::move(r));
  return launch(job, type);
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  return point_to_point(OpKind::Send, c10d::OpType::SEND, tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return point_to_point(OpKind::Recv, c10d::OpType::RECV, tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return point_to_point(OpKind::RecvAnySource, c10d::OpType::RECVANYSOURCE, tensors, -1, tag);
}

c10::intrusive_ptr<c10d::Work> XcclRsBackend::barrier(const c10d::BarrierOptions& opts) {
  auto job = begin("barrier", OpKind::Barrier);
  job.add(request(OpKind::Barrier, nullptr));
  return launch(job, c10d::OpType::BARRIER, XCCL_RS_CALLER_WAITS(opts));
}


} // namespace xccl_rs
