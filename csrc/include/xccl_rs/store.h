// The c10d Store as the Rust core sees it: set a key, get a key with a timeout.
#pragma once

#include <cstdint>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "rust/cxx.h"

namespace xccl_rs {

struct StoreRef {
  c10::intrusive_ptr<c10d::Store> store;
};

void store_set(const StoreRef& store, rust::Str key, rust::Slice<const uint8_t> value);
rust::Vec<uint8_t> store_get(const StoreRef& store, rust::Str key, uint64_t timeout_ms);

} // namespace xccl_rs
