// Store callbacks for the Rust rendezvous (src/rendezvous.rs).
#include "xccl_rs/store.h"

#include <chrono>
#include <string>
#include <vector>

namespace xccl_rs {

void store_set(const StoreRef& store, rust::Str key, rust::Slice<const uint8_t> value) {
  std::vector<uint8_t> bytes(value.begin(), value.end());
  store.store->set(std::string(key), bytes);
}

rust::Vec<uint8_t> store_get(const StoreRef& store, rust::Str key, uint64_t timeout_ms) {
  const std::string k(key);
  store.store->wait({k}, std::chrono::milliseconds(timeout_ms));
  rust::Vec<uint8_t> out;
  for (uint8_t b : store.store->get(k)) {
    out.push_back(b);
  }
  return out;
}

} // namespace xccl_rs
