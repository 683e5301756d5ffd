# cmake -P: builds the Rust core with cargo, as a static library whose cxx bridge C++ (the
# header xccl_rs/src/ffi.rs.h, rust/cxx.h, the glue ffi.rs.cc) build.rs writes to EXPORT and
# does not compile (XCCL_RS_BRIDGE_EXPORT): CMakeLists.txt compiles it with csrc/. build.rs
# reruns when one of those copies is missing (a fresh build directory).
# In: CARGO, TARGET_DIR, EXPORT, ROOT (the crate).
execute_process(
  COMMAND "${CMAKE_COMMAND}" -E env "CARGO_TARGET_DIR=${TARGET_DIR}" "XCCL_RS_BRIDGE_EXPORT=${EXPORT}"
          "${CARGO}" rustc --release --lib --features cpp --crate-type staticlib
  WORKING_DIRECTORY "${ROOT}"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "xccl_rs: cargo failed to build the Rust core (exit ${rc})")
endif()
if(NOT EXISTS "${EXPORT}/ffi.rs.cc")
  message(FATAL_ERROR "xccl_rs: cargo did not write the bridge's C++ to ${EXPORT}; `touch build.rs` and rebuild")
endif()
