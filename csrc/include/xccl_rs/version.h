// The torch version the bridge is compiled against, for code that must differ between versions.
#pragma once

#include <torch/version.h>

#define XCCL_RS_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// torch's hooks on a backend: abort hooks (registerAbortHook) from 2.14; completion hooks,
// supportsAbortHooks and Work::getCompletionKey from 2.15. torch 2.14 and 2.15 both define
// C10D_BACKEND_HAS_HOOKS, so the version tells them apart.
#define XCCL_RS_HAS_ABORT_HOOKS XCCL_RS_TORCH_AT_LEAST(2, 14)
#define XCCL_RS_HAS_COMPLETION_HOOKS XCCL_RS_TORCH_AT_LEAST(2, 15)
