// torch.profiler records of xccl_rs ops (see profile.h).
#include "xccl_rs/profile.h"

#include <memory>

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include "xccl_rs/src/ffi.rs.h"

namespace xccl_rs {
namespace {

int64_t elements(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) {
    n += t.numel();
  }
  return n;
}

// The range from the call to the completion: asynchronous, since the progress thread ends it
// (torch's own Work does the same for its profiling title). Its end also records the range of
// the job's execution, whose start only the thread that ran it knows: an event reported with its
// times, as torch's delegated backends report theirs, on the thread that ends the range. Both
// run with the caller's profiler state (wrapPropagateTLSState), which that thread lacks.
std::function<void(int64_t)> start_range(const std::string& title, const std::vector<at::Tensor>& inputs) {
  auto range = std::make_shared<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (!range->isActive()) {
    return {};
  }
  range->_setAsync();
  std::vector<c10::IValue> shapes(inputs.begin(), inputs.end());
  range->before(title, c10::ArrayRef<const c10::IValue>(shapes.data(), shapes.size()));
  return at::wrapPropagateTLSState([range, run = title + ":run"](int64_t started_unix_us) {
    range->end();
    try {
      torch::autograd::profiler::reportBackendEventToActiveKinetoProfiler(
          started_unix_us, c10::getTime() / 1000, -1, at::RecordScope::USER_SCOPE, run, "xccl_rs");
    } catch (const std::exception&) {
      // On-demand (global) profiling takes no reported events; the call's range stands alone.
    }
  });
}

} // namespace

OpProfile::OpProfile() : on_(at::hasCallbacks()) {}

void profiled_call(const OpProfile& profile, const OpIssuer& issuer, const char* what, OpKind kind, int64_t seq,
                   bool is_p2p, std::function<void(int64_t started_unix_us)>& range_end,
                   const std::function<void()>& submit) {
  // An op in place (all_reduce, broadcast, a receive) reads what it writes: recorded as both,
  // as ProcessGroupNCCL records it.
  const auto& out = profile.outputs();
  const auto& in = profile.inputs().empty() ? out : profile.inputs();
  const auto dtype = !in.empty() ? in.front().scalar_type() : !out.empty() ? out.front().scalar_type() : at::kByte;
  range_end = start_range(std::string("xccl_rs:") + std::string(op_label(kind)), in);
  RECORD_PARAM_COMMS_DATA(
      std::make_tuple(seq, is_p2p),
      issuer.group,
      in,
      out,
      issuer.rank,
      what,
      elements(in),
      elements(out),
      dtype,
      profile.in_splits(),
      profile.out_splits(),
      issuer.global_rank_start,
      issuer.global_rank_stride,
      issuer.size);
  submit();
}

} // namespace xccl_rs
