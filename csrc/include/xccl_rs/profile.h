// What torch.profiler sees of an xccl_rs op, recorded the way ProcessGroupGloo and
// ProcessGroupNCCL record theirs:
// - a `record_param_comms` event around the call (torch's RECORD_PARAM_COMMS_DATA): the
//   collective's name, input and output element counts, dtype, split sizes, the group's name,
//   ranks and size, and the op's sequence number;
// - an asynchronous `xccl_rs:<op>` range (gloo's `gloo:all_reduce`), from the call to the op's
//   completion on the progress thread, whose Input Dims are the op's tensors.
// Nothing is recorded, and no tensor list is kept, while no profiler is on.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

namespace xccl_rs {

enum class OpKind : std::uint8_t; // src/ffi.rs

// The tensors of one call, collected only while a profiler is on.
class OpProfile {
 public:
  OpProfile();

  bool on() const {
    return on_;
  }
  void input(const at::Tensor& t) {
    if (on_) {
      inputs_.push_back(t);
    }
  }
  void output(const at::Tensor& t) {
    if (on_) {
      outputs_.push_back(t);
    }
  }
  // Split sizes of an all-to-all (rows per rank), recorded as torch records them.
  void splits(std::vector<int64_t> in, std::vector<int64_t> out) {
    in_splits_ = std::move(in);
    out_splits_ = std::move(out);
  }

  const std::vector<at::Tensor>& inputs() const {
    return inputs_;
  }
  const std::vector<at::Tensor>& outputs() const {
    return outputs_;
  }
  const std::vector<int64_t>& in_splits() const {
    return in_splits_;
  }
  const std::vector<int64_t>& out_splits() const {
    return out_splits_;
  }

 private:
  bool on_;
  std::vector<at::Tensor> inputs_;
  std::vector<at::Tensor> outputs_;
  std::vector<int64_t> in_splits_;
  std::vector<int64_t> out_splits_;
};

// Who issued the op, for the record.
struct OpIssuer {
  std::tuple<std::string, std::string> group; // (name, description)
  int rank;
  int size;
  int global_rank_start; // the group's global ranks, when they are start + i * stride
  int global_rank_stride;
};

// Starts the op's `xccl_rs:<op>` range (from the call to the completion), sets `range_end` to
// the callback that ends it and records the `xccl_rs:<op>:run` range (from when the job started
// running, given to it, to the completion, on the thread that ran the job: the progress thread,
// or the caller's when it ran the job itself); then runs `submit` inside the `record_param_comms`
// event of the call `what` (our name of the call: "allreduce", "all_gather_into_tensor", ...).
// `range_end` runs when the op completes, on any thread; it is set before the op is submitted,
// so a completion cannot miss it.
void profiled_call(const OpProfile& profile, const OpIssuer& issuer, const char* what, OpKind kind, int64_t seq,
                   bool is_p2p, std::function<void(int64_t started_unix_us)>& range_end,
                   const std::function<void()>& submit);

} // namespace xccl_rs
