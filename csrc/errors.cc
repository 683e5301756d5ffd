// The one mapping from the core's error kinds to torch's exceptions (see errors.h).
#include "xccl_rs/errors.h"

#include <c10/util/Exception.h>

#include "xccl_rs/src/ffi.rs.h"

namespace xccl_rs {

std::exception_ptr make_error(ErrorKind kind, const std::string& message) {
  try {
    if (kind == ErrorKind::InvalidArgument) {
      TORCH_CHECK_VALUE(false, message);
    }
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

void raise_error(ErrorKind kind, const std::string& message) {
  std::rethrow_exception(make_error(kind, message));
}

void raise_core_error(const rust::Error& e) {
  raise_error(take_error_kind(), e.what());
}

} // namespace xccl_rs
