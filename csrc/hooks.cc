// The bridge's entry to a backend's abort hooks (see hooks.h).
#include "xccl_rs/hooks.h"

#include <system_error>
#include <thread>

#include "xccl_rs/src/ffi.rs.h"

namespace xccl_rs {

void group_failed(const FailureListener& listener, ErrorKind /*kind*/, rust::Str /*message*/) {
  auto hooks = listener.hooks.lock();
  if (!hooks) {
    return;
  }
  // The hooks run on a C++ thread of their own. A hook that needs the interpreter while Python
  // finalizes (a Python abort hook) is ended by pthread_exit, a forced unwind: that ends a C++
  // thread cleanly, but could not unwind the Rust thread that called us, whose frames cannot.
  try {
    std::thread([hooks] { hooks->run(); }).join();
  } catch (const std::system_error&) {
    hooks->run(); // no thread to be had: run them here
  }
}

} // namespace xccl_rs
