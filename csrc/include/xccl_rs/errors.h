// How errors of the Rust core become torch's exceptions, in one place: the bridge's ErrorKind
// (src/ffi.rs) decides the exception, for the errors Rust functions return (a rust::Error,
// whose text carries the kind: src/bridge.rs) and for the errors of finished work.
#pragma once

#include <cstdint>
#include <exception>
#include <string>

#include "rust/cxx.h"

namespace xccl_rs {

enum class ErrorKind : std::uint8_t; // src/ffi.rs; cxx defines it in xccl_rs/src/ffi.rs.h

// InvalidArgument: c10::ValueError (Python ValueError); every other kind:
// c10::DistBackendError (torch.distributed.DistBackendError).
std::exception_ptr make_error(ErrorKind kind, const std::string& message);

[[noreturn]] void raise_error(ErrorKind kind, const std::string& message);

// For the rust::Error a bridge function threw: raises the exception of the kind its text
// names, with the text after the kind tag as the message.
[[noreturn]] void raise_core_error(const rust::Error& e);

} // namespace xccl_rs
