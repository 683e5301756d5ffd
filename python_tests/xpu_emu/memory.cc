// Allocators of the emulated XPU (memory.h).
#include "memory.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include "runtime.h"

namespace xpu_emu {

namespace {

constexpr size_t kAlign = 64;

void* aligned(size_t n) {
  void* p = std::aligned_alloc(kAlign, std::max<size_t>(kAlign, (n + kAlign - 1) / kAlign * kAlign));
  TORCH_CHECK(p != nullptr, "xpu_emu: out of memory allocating ", n, " bytes");
  return p;
}

struct DeviceAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = aligned(n);
    std::memset(p, 0xFF, n); // uninitialised device memory reads as NaN / -1
    return {p, p, &std::free, c10::Device(c10::DeviceType::XPU, current_device())};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &std::free;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

DeviceAllocator g_device_allocator;

std::atomic<int64_t> g_allocations{0};
std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};

// A header before each block remembers its size for the counters.
void free_host(void* ctx) {
  auto* base = static_cast<char*>(ctx);
  int64_t n;
  std::memcpy(&n, base, sizeof n);
  g_current -= n;
  std::free(base);
}

// Not caching: every tensor's block is freed when the tensor dies. A block stays valid while
// a queued copy uses it because the copy's task holds the tensor (runtime.h), which is what
// record_event guarantees on a real device.
struct HostAllocator final : public at::HostAllocator {
  c10::DataPtr allocate(size_t n) override {
    auto* base = static_cast<char*>(aligned(n + kAlign));
    const auto bytes = static_cast<int64_t>(n);
    std::memcpy(base, &bytes, sizeof bytes);
    ++g_allocations;
    const int64_t now = g_current += bytes;
    int64_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
    }
    return {base + kAlign, base, &free_host, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr; // data and context differ
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool record_event(void* /*ptr*/, void* /*ctx*/, c10::Stream /*stream*/) override {
    return true;
  }
  void empty_cache() override {}
  at::HostStats get_stats() override {
    return {};
  }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};

HostAllocator g_host_allocator;

struct Register {
  Register() {
    c10::SetAllocator(c10::DeviceType::XPU, &g_device_allocator);
    at::setHostAllocator(at::kXPU, &g_host_allocator);
  }
} g_register;

} // namespace

HostMemoryStats host_memory_stats() {
  return {g_allocations.load(), g_current.load(), g_peak.load()};
}

void reset_host_memory_stats() {
  g_allocations = 0;
  g_peak = g_current.load();
}

} // namespace xpu_emu
