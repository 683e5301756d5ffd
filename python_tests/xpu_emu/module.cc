// The emulator's Python module: what torch.xpu cannot provide on a torch built without XPU
// (the loader, __init__.py, patches torch.xpu with these), and the tests' controls.
#include <chrono>
#include <thread>

#include <torch/csrc/Stream.h>
#include <torch/extension.h>

#include "memory.h"
#include "runtime.h"

namespace py = pybind11;
using namespace xpu_emu;

namespace {
c10::DeviceIndex resolve(int index) {
  return index < 0 ? current_device() : static_cast<c10::DeviceIndex>(index);
}
} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "An emulated XPU device for the xccl_rs tests (python_tests/xpu_emu)";
  m.def("device_count", [] { return static_cast<int>(device_count()); });
  m.def("current_device", [] { return static_cast<int>(current_device()); });
  m.def("set_device", [](int index) { set_device(static_cast<c10::DeviceIndex>(index)); });
  m.def(
      "synchronize",
      [](int index) {
        py::gil_scoped_release no_gil;
        synchronize_device(resolve(index));
      },
      py::arg("index") = -1);
  m.def(
      "current_stream",
      [](int index) { return py::reinterpret_steal<py::object>(THPStream_Wrap(current_stream(resolve(index)))); },
      py::arg("index") = -1);
  m.def(
      "exchange_stream",
      [](int64_t stream_id, int device_index) {
        const c10::Stream s(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::XPU, resolve(device_index)), stream_id);
        return exchange_stream(s).id();
      },
      "Makes the stream current on its device; returns the previous one's id (torch.Stream's "
      "`with` asks the build's accelerator, not the stream's device type).");
  m.def(
      "sleep_ms",
      [](double ms) {
        const auto us = static_cast<int64_t>(ms * 1000);
        enqueue_current(current_device(), [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
      },
      "Holds the current stream for `ms` milliseconds (like torch.cuda._sleep).");
  m.def("set_pool_delay_us", &set_pool_delay_us, "Delay before each task of a non-default stream.");
  m.def("pool_delay_us", &pool_delay_us);
  m.def("host_memory_stats", [] {
    const auto s = host_memory_stats();
    py::dict d;
    d["allocations"] = s.allocations;
    d["current_bytes"] = s.current_bytes;
    d["peak_bytes"] = s.peak_bytes;
    return d;
  });
  m.def("reset_host_memory_stats", &reset_host_memory_stats);
}
