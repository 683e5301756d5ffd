// The bridge's entry to a backend's abort hooks (see hooks.h).
#include "xccl_rs/hooks.h"

#include "xccl_rs/src/ffi.rs.h"

namespace xccl_rs {

void group_failed(const FailureListener& listener, ErrorKind /*kind*/, rust::Str /*message*/) {
  if (auto hooks = listener.hooks.lock()) {
    hooks->run();
  }
}

} // namespace xccl_rs
