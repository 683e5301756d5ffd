// Streams, devices and events of the emulated XPU (runtime.h), and its DeviceGuardImpl.
#include "runtime.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <vector>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace xpu_emu {

namespace {

constexpr int kPoolStreams = 32; // ids 1..32, handed out round robin, as CUDA's pool
constexpr c10::StreamId kFirstNewStream = 1000;

std::atomic<int64_t> g_delay_us{[] {
  const char* v = std::getenv("XCCL_RS_XPU_EMU_POOL_DELAY_US");
  return v ? std::atoll(v) : 0LL;
}()};

std::mutex g_failure_mu;
std::string g_failure;

thread_local c10::DeviceIndex t_device = 0;
// This thread's current stream id per device.
thread_local std::map<c10::DeviceIndex, c10::StreamId> t_streams;

std::mutex g_workers_mu;
// Leaked on purpose: the workers outlive static destruction (runtime.h).
auto* g_workers = new std::map<std::pair<c10::DeviceIndex, c10::StreamId>, StreamWorker*>();
std::atomic<uint32_t> g_next_pool{0};
std::atomic<c10::StreamId> g_next_new{kFirstNewStream};

void check_device(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count(), "xpu_emu: no device xpu:", int(index), " (", int(device_count()),
              " emulated devices; XCCL_RS_XPU_EMU_DEVICES)");
}

} // namespace

c10::DeviceIndex device_count() {
  static const c10::DeviceIndex n = [] {
    const char* v = std::getenv("XCCL_RS_XPU_EMU_DEVICES");
    return static_cast<c10::DeviceIndex>(v ? std::max(1, std::atoi(v)) : 1);
  }();
  return n;
}

c10::DeviceIndex current_device() {
  return t_device;
}

void set_device(c10::DeviceIndex index) {
  check_device(index);
  t_device = index;
}

StreamWorker::StreamWorker(bool delayed) : delayed_(delayed), thread_([this] { run(); }) {
  thread_.detach();
}

void StreamWorker::enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
    ++enqueued_;
  }
  cv_.notify_all();
}

void StreamWorker::synchronize() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = enqueued_;
    cv_.wait(lock, [&] { return done_ >= target; });
  }
  throw_if_failed();
}

bool StreamWorker::idle() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_ == enqueued_;
}

void StreamWorker::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !queue_.empty(); });
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    if (delayed_) {
      const int64_t us = g_delay_us.load();
      if (us > 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(us));
      }
    }
    try {
      task();
    } catch (const std::exception& e) {
      record_failure(e.what());
    }
    task = nullptr; // release what the task holds (tensors) before it counts as done
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++done_;
    }
    cv_.notify_all();
  }
}

StreamWorker& worker(const c10::Stream& stream) {
  TORCH_CHECK(stream.device_type() == c10::DeviceType::XPU, "xpu_emu: not an XPU stream: ", stream);
  check_device(stream.device_index());
  std::lock_guard<std::mutex> lock(g_workers_mu);
  auto& w = (*g_workers)[{stream.device_index(), stream.id()}];
  if (w == nullptr) {
    w = new StreamWorker(/*delayed=*/stream.id() != 0);
  }
  return *w;
}

c10::Stream current_stream(c10::DeviceIndex device) {
  check_device(device);
  auto it = t_streams.find(device);
  const c10::StreamId id = it == t_streams.end() ? 0 : it->second;
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::XPU, device), id);
}

c10::Stream exchange_stream(const c10::Stream& stream) {
  c10::Stream old = current_stream(stream.device_index());
  t_streams[stream.device_index()] = stream.id();
  return old;
}

c10::Stream pool_stream(c10::DeviceIndex device) {
  check_device(device);
  const c10::StreamId id = 1 + g_next_pool.fetch_add(1) % kPoolStreams;
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::XPU, device), id);
}

c10::Stream new_stream(c10::DeviceIndex device) {
  check_device(device);
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::XPU, device), g_next_new.fetch_add(1));
}

void synchronize_device(c10::DeviceIndex device) {
  std::vector<StreamWorker*> ws;
  {
    std::lock_guard<std::mutex> lock(g_workers_mu);
    for (auto& [key, w] : *g_workers) {
      if (key.first == device) {
        ws.push_back(w);
      }
    }
  }
  for (auto* w : ws) {
    w->synchronize();
  }
  throw_if_failed();
}

void enqueue_current(c10::DeviceIndex device, std::function<void()> task) {
  worker(current_stream(device)).enqueue(std::move(task));
}

void set_pool_delay_us(int64_t us) {
  g_delay_us = us;
}

int64_t pool_delay_us() {
  return g_delay_us.load();
}

void record_failure(const std::string& what) {
  std::lock_guard<std::mutex> lock(g_failure_mu);
  if (g_failure.empty()) {
    g_failure = what;
  }
}

void throw_if_failed() {
  std::lock_guard<std::mutex> lock(g_failure_mu);
  TORCH_CHECK(g_failure.empty(), "xpu_emu: a task on an emulated stream failed: ", g_failure);
}

namespace {

EventHandle& handle(void* event) {
  return *static_cast<EventHandle*>(event);
}

struct Guard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return c10::DeviceType::XPU;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(c10::DeviceType::XPU, current_device());
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.is_xpu(), "xpu_emu: not an XPU device: ", d);
    if (d.has_index()) {
      set_device(d.index());
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index() && d.index() >= 0 && d.index() < device_count()) {
      t_device = d.index();
    }
  }
  c10::Stream getStream(c10::Device d) const override {
    return current_stream(d.has_index() ? d.index() : current_device());
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::XPU, d.has_index() ? d.index() : current_device()));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*isHighPriority*/) const override {
    return pool_stream(d.has_index() ? d.index() : current_device());
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    return new_stream(d.has_index() ? d.index() : current_device());
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return exchange_stream(s);
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return device_count();
  }

  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<EventHandle*>(event); // queued records and waits hold their own reference
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag /*flag*/) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "xpu_emu: event of device ",
                int(device_index), " recorded on a stream of device ", int(stream.device_index()));
    if (*event == nullptr) {
      *event = new EventHandle(std::make_shared<EventState>());
    }
    EventHandle state = handle(*event);
    uint64_t version;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      version = ++state->recorded;
      state->pending.insert(version);
    }
    worker(stream).enqueue([state, version] {
      {
        std::lock_guard<std::mutex> lock(state->mu);
        state->pending.erase(version);
      }
      state->cv.notify_all();
    });
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) {
      return; // never recorded: nothing to wait for
    }
    EventHandle state = handle(event);
    uint64_t version;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      version = state->recorded;
    }
    // The stream stops here until that record has run (its worker thread waits).
    worker(stream).enqueue([state, version] {
      std::unique_lock<std::mutex> lock(state->mu);
      state->cv.wait(lock, [&] { return state->done(version); });
    });
  }
  bool queryEvent(void* event) const override {
    if (event == nullptr) {
      return true;
    }
    EventHandle state = handle(event);
    std::lock_guard<std::mutex> lock(state->mu);
    return state->done(state->recorded);
  }
  void synchronizeEvent(void* event) const override {
    if (event == nullptr) {
      return;
    }
    EventHandle state = handle(event);
    {
      std::unique_lock<std::mutex> lock(state->mu);
      const uint64_t version = state->recorded;
      state->cv.wait(lock, [&] { return state->done(version); });
    }
    throw_if_failed();
  }
  bool queryStream(const c10::Stream& stream) const override {
    return worker(stream).idle();
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    worker(stream).synchronize();
  }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    synchronize_device(device_index);
  }
  // Memory lifetimes need no bookkeeping: every queued task holds the tensors it uses.
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const c10::Stream& /*stream*/) const override {}
};

C10_REGISTER_GUARD_IMPL(XPU, Guard);

} // namespace
} // namespace xpu_emu
