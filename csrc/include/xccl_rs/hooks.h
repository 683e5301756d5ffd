// A backend's hooks (torch >= 2.15): abort hooks (Backend.register_abort_hook), run when its group
// fails, by a timeout, a dead peer or abort(), on the thread that finds the failure, whether or
// not anyone waits for the failed op (the Rust core calls group_failed through a
// FailureListener); completion hooks (register_completion_hook, what torch's flight recorder
// retires its entries with), run once per Work that succeeds, on the thread that completes it.
#pragma once

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
  // logged and the others still run.
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
