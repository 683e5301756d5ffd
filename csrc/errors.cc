// The one mapping from the core's error kinds to torch's exceptions (see errors.h).
#include "xccl_rs/errors.h"

#include <charconv>
#include <string_view>
#include <system_error>

#include <c10/util/Exception.h>

#include "xccl_rs/src/ffi.rs.h"

namespace xccl_rs {

namespace {

// Ends the kind tag of a bridge error's text: the ErrorKind's code in decimal, this character,
// then the text the user reads (src/bridge.rs, KIND_TAG_END, writes it).
constexpr char kKindTagEnd = '\x1f';

bool is_error_kind(std::uint8_t code) {
  switch (static_cast<ErrorKind>(code)) {
    case ErrorKind::InvalidArgument:
    case ErrorKind::Timeout:
    case ErrorKind::Remote:
    case ErrorKind::Communication:
      return true;
    default:
      return false; // Success is no error, and no other code exists
  }
}

} // namespace

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
  const std::string_view text(e.what());
  const auto tag_end = text.find(kKindTagEnd);
  std::uint8_t code = 0;
  if (tag_end != std::string_view::npos) {
    const auto [end, ec] = std::from_chars(text.data(), text.data() + tag_end, code);
    if (ec == std::errc() && end == text.data() + tag_end && is_error_kind(code)) {
      raise_error(static_cast<ErrorKind>(code), std::string(text.substr(tag_end + 1)));
    }
  }
  // Every Result of the bridge is a BridgeError, so this is a bug of the bridge itself.
  TORCH_INTERNAL_ASSERT(false, "xccl_rs: a bridge error without its kind: ", text);
}

} // namespace xccl_rs
