// The emulated XPU's runtime: devices, streams (a worker thread each) and events.
//
// Device memory is host memory (memory.cc), so the stream order is the only thing that
// keeps a reader from seeing stale bytes: every kernel and copy that touches device memory
// runs as a task on a stream's worker thread, in the order the stream got them, and events
// really wait. An injectable delay (set_pool_delay_us) slows the tasks of every stream but the
// default one, so a copy on a side stream that nobody waits for is caught reading or writing
// late; sleep() holds one stream, like torch.cuda._sleep.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

namespace xpu_emu {

// Devices: XCCL_RS_XPU_EMU_DEVICES (default 1).
c10::DeviceIndex device_count();
c10::DeviceIndex current_device();
void set_device(c10::DeviceIndex index);

// A stream: one worker thread that runs the stream's tasks in order. Never destroyed (a
// queued task may outlive any owner; the threads end with the process).
class StreamWorker {
 public:
  explicit StreamWorker(bool delayed);
  void enqueue(std::function<void()> task);
  // Returns when every task enqueued before the call has run; rethrows a task's failure.
  void synchronize();
  bool idle();

 private:
  void run();
  const bool delayed_; // a pool stream: the injected delay applies
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t enqueued_ = 0;
  uint64_t done_ = 0;
  std::thread thread_;
};

StreamWorker& worker(const c10::Stream& stream);
// The calling thread's current stream of `device` (the default stream unless exchanged).
c10::Stream current_stream(c10::DeviceIndex device);
c10::Stream exchange_stream(const c10::Stream& stream);
c10::Stream pool_stream(c10::DeviceIndex device);
c10::Stream new_stream(c10::DeviceIndex device);
void synchronize_device(c10::DeviceIndex device);

// Enqueues `task` on the current stream of `device`.
void enqueue_current(c10::DeviceIndex device, std::function<void()> task);

// Microseconds each task of a non-default stream waits before it runs (default:
// XCCL_RS_XPU_EMU_POOL_DELAY_US, else 0).
void set_pool_delay_us(int64_t us);
int64_t pool_delay_us();

// A failed task makes every later synchronize throw (like a sticky device error).
void record_failure(const std::string& what);
void throw_if_failed();

// An event: versions recorded on streams; waiting for a version waits for that record.
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;       // the newest version
  std::set<uint64_t> pending;  // versions recorded whose stream has not reached them
  bool done(uint64_t version) {
    return pending.count(version) == 0;
  }
};
using EventHandle = std::shared_ptr<EventState>; // the guard's void* points to one of these

} // namespace xpu_emu
