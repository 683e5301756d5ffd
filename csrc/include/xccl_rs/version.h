// The torch version the bridge is compiled against, for code that must differ between versions.
#pragma once

#include <torch/version.h>

#define XCCL_RS_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
