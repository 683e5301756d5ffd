// The emulated XPU's memory: a device allocator (host memory, filled with 0xFF bytes so that
// a read of bytes nobody wrote shows up as NaN), and the host ("pinned") allocator that torch
// looks up with at::getHostAllocator(at::kXPU), with counters the tests read.
#pragma once

#include <cstdint>

namespace xpu_emu {

struct HostMemoryStats {
  int64_t allocations;   // since the last reset
  int64_t current_bytes; // in use now
  int64_t peak_bytes;    // since the last reset
};
HostMemoryStats host_memory_stats();
void reset_host_memory_stats();

} // namespace xpu_emu
