# The torch of a Python interpreter, as the imported target xccl_rs::torch (headers, libtorch,
# C++ standard, C++ ABI), read from python/xccl_rs/torch_build_flags.py: the one description of
# xccl_rs's C++ flags, which build.rs and scripts/gpu/build.sh read too.
#
# Not find_package(Torch): with torch's CUDA wheel and no CUDA toolkit (a CPU machine, CI), its
# Caffe2Config.cmake stops with a FATAL_ERROR ("uses CUDA but I cannot find the CUDA libraries").
#
# Used by CMakeLists.txt and by the installed xccl_rsConfig.cmake. In:
#   XCCL_RS_PYTHON                 (cache) the interpreter; empty: _xccl_rs_default_python, else
#                                  the Python3 that find_package finds
#   _xccl_rs_flags_script          the path of torch_build_flags.py
# Out: XCCL_RS_TORCH_* (VERSION, VERSION_MAJOR, ..., see the script), the target xccl_rs::torch,
# and XCCL_RS_TORCH_ERROR (empty when all went well).
set(XCCL_RS_TORCH_ERROR "")
if(NOT XCCL_RS_PYTHON)
  if(_xccl_rs_default_python AND EXISTS "${_xccl_rs_default_python}")
    set(_xccl_rs_python "${_xccl_rs_default_python}")
  else()
    find_package(Python3 QUIET COMPONENTS Interpreter)
    set(_xccl_rs_python "${Python3_EXECUTABLE}")
  endif()
  # FORCE: replaces an empty entry that an earlier failed search left.
  set(XCCL_RS_PYTHON "${_xccl_rs_python}" CACHE FILEPATH "A Python interpreter with the torch of xccl_rs" FORCE)
endif()

if(NOT XCCL_RS_PYTHON)
  set(XCCL_RS_TORCH_ERROR "xccl_rs: no Python interpreter found: set XCCL_RS_PYTHON to a Python with torch (>= 2.8)")
else()
  execute_process(
    COMMAND "${XCCL_RS_PYTHON}" "${_xccl_rs_flags_script}" --format cmake
    OUTPUT_VARIABLE _xccl_rs_flags ERROR_VARIABLE _xccl_rs_err RESULT_VARIABLE _xccl_rs_rc)
  if(NOT _xccl_rs_rc EQUAL 0)
    string(STRIP "${_xccl_rs_err}" _xccl_rs_err)
    string(CONCAT XCCL_RS_TORCH_ERROR "xccl_rs: ${XCCL_RS_PYTHON} cannot describe its torch:\n${_xccl_rs_err}\n"
                                      "Set XCCL_RS_PYTHON to a Python with torch (>= 2.8).")
  else()
    cmake_language(EVAL CODE "${_xccl_rs_flags}") # set(XCCL_RS_TORCH_<KEY> ...) lines
  endif()
endif()

if(NOT XCCL_RS_TORCH_ERROR AND NOT TARGET xccl_rs::torch)
  add_library(xccl_rs::torch INTERFACE IMPORTED)
  set_target_properties(xccl_rs::torch PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${XCCL_RS_TORCH_INCLUDE_DIRS}")
  # The script's compiler flags, in CMake's terms: the standard as a compile feature (so that it
  # merges with the consumer's own), defines as definitions.
  foreach(_flag IN LISTS XCCL_RS_TORCH_CXX_FLAGS)
    if(_flag MATCHES "^-std=(c|gnu)\\+\\+([0-9]+)$")
      set_property(TARGET xccl_rs::torch APPEND PROPERTY INTERFACE_COMPILE_FEATURES "cxx_std_${CMAKE_MATCH_2}")
    elseif(_flag MATCHES "^-D(.+)$")
      set_property(TARGET xccl_rs::torch APPEND PROPERTY INTERFACE_COMPILE_DEFINITIONS "${CMAKE_MATCH_1}")
    else()
      set_property(TARGET xccl_rs::torch APPEND PROPERTY INTERFACE_COMPILE_OPTIONS "${_flag}")
    endif()
  endforeach()
  # libtorch only (c10, torch_cpu, torch): a C++ program does not need torch_python.
  foreach(_lib IN LISTS XCCL_RS_TORCH_CPP_LIBRARIES)
    set(_path "${XCCL_RS_TORCH_LIBRARY_DIR}/${CMAKE_SHARED_LIBRARY_PREFIX}${_lib}${CMAKE_SHARED_LIBRARY_SUFFIX}")
    if(NOT EXISTS "${_path}")
      set(XCCL_RS_TORCH_ERROR "xccl_rs: torch's ${_path} is missing (the torch of ${XCCL_RS_PYTHON})")
    endif()
    set_property(TARGET xccl_rs::torch APPEND PROPERTY INTERFACE_LINK_LIBRARIES "${_path}")
  endforeach()
endif()
