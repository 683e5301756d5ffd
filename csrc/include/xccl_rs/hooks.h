// A backend's hooks (torch >= 2.15): abort hooks (Backend.register_abort_hook), run when its group
// fails, by a timeout, a dead peer or abort(), on the thread that finds the failure, whether or
// not anyone waits for the failed op (the Rust core calls group_failed through a
// FailureListener); completion hooks (register_completion_hook, what torch's flight recorder
// retires its entries with), run once per Work that succeeds, on the thread that completes it.
// A failure's hooks run on a C++ thread of their own, which Python's exit waits for (the Rust
// core's wait_for_failure_hooks): a script that ends on the error then exits after torch's flight
// recorder has written its trace.
#pragma once

#include <cxxabi.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <c10/util/Logging.h>

#include "rust/cxx.h"

namespace xccl_rs {

template <typename... Args>
class Hooks {
 public:
  using Hook = std::function<void(Args...)>;

  void add(int64_t id, Hook hook) {
    std::lock_guard<std::mutex> lock(mu_);
    hooks_[id] = std::move(hook);
  }

  void remove(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    hooks_.erase(id);
  }

  // Runs a snapshot of the hooks (a hook may register or remove hooks); one that throws is
  // logged and the others still run. A forced unwind (pthread_exit: a hook that took the GIL
  // while Python finalizes) is not an error of the hook's: it ends the thread, so it goes on.
  void run(Args... args) {
    std::vector<Hook> snapshot;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& entry : hooks_) {
        snapshot.push_back(entry.second);
      }
    }
    for (const auto& hook : snapshot) {
      try {
        hook(args...);
      } catch (abi::__forced_unwind&) {
        throw;
      } catch (const std::exception& e) {
        LOG(ERROR) << "xccl_rs: a hook raised: " << e.what();
      } catch (...) {
        LOG(ERROR) << "xccl_rs: a hook raised";
      }
    }
  }

 private:
  std::mutex mu_;
  std::map<int64_t, Hook> hooks_;
};

using AbortHooks = Hooks<>;
// (completion key, duration in ms)
using CompletionHooks = Hooks<uint64_t, std::optional<float>>;

struct FailureListener {
  std::weak_ptr<AbortHooks> hooks; // the backend's; gone with it
};

enum class ErrorKind : std::uint8_t; // src/ffi.rs

void group_failed(const FailureListener& listener, ErrorKind kind, rust::Str message);

} // namespace xccl_rs
