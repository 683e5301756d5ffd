// A libtorch program on xccl_rs: one process per rank, a c10d::ProcessGroup served by xccl_rs
// over a c10d::TCPStore, and an AVG all_reduce checked against the arithmetic.
//
//   allreduce_avg RANK SIZE PORT [HOST]
//
// Rank 0 serves the store on HOST:PORT (default host 127.0.0.1); PORT 0 lets it pick a free
// port, which it prints as "port N" for the others to use. Exits 0 when the result matches,
// 1 when it does not, 2 on an error.
#include <chrono>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <xccl_rs/xccl_rs.h>

namespace {

constexpr int64_t kCount = 1001; // odd: not a multiple of any chunk or vector width

int run(int rank, int size, int port, const std::string& host) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(port);
  store_options.isServer = rank == 0;
  store_options.waitWorkers = false; // rank 0 must print its port before the others connect
  store_options.timeout = std::chrono::seconds(60);
  auto store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
  if (rank == 0) {
    std::cout << "port " << store->getPort() << std::endl;
  }

  // The backend, then a process group that routes CPU tensors to it.
  auto backend = xccl_rs::create_backend(store, rank, size, std::chrono::seconds(60));
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);

  // Rank r holds (i + 1) * (r + 1); the average over ranks is (i + 1) * (size + 1) / 2.
  auto index = at::arange(kCount, at::kFloat) + 1;
  std::vector<at::Tensor> tensors{index * (rank + 1)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::AVG;
  pg->allreduce(tensors, options)->wait();

  const auto expected = index * ((size + 1) / 2.0);
  if (!at::allclose(tensors[0], expected)) {
    std::cerr << "rank " << rank << ": AVG all_reduce gave " << tensors[0].slice(0, 0, 4) << ", expected "
              << expected.slice(0, 0, 4) << std::endl;
    return 1;
  }
  std::cout << "rank " << rank << ": AVG all_reduce of " << kCount << " floats over " << size
            << " ranks is right (xccl_rs built against torch " << xccl_rs::torch_version_built() << ")" << std::endl;
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: " << argv[0] << " RANK SIZE PORT [HOST]" << std::endl;
    return 2;
  }
  try {
    return run(std::atoi(argv[1]), std::atoi(argv[2]), std::atoi(argv[3]), argc > 4 ? argv[4] : "127.0.0.1");
  } catch (const std::exception& e) {
    std::cerr << "rank " << argv[1] << ": " << e.what() << std::endl;
    return 2;
  }
}
