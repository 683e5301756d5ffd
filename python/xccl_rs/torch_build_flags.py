"""How to compile C++ against the torch of this interpreter: the one description of xccl_rs's
C++ flags, read by every build of it (build.rs for pip and cargo, scripts/gpu/build.sh, and the
CMake package in cmake/). Run it as a script (it imports torch, not xccl_rs):

    python torch_build_flags.py [--format lines|cmake|json]

``lines`` (the default) prints one ``key<TAB>value<TAB>value...`` line per item, for build.rs
and shell scripts; ``cmake`` prints ``set(XCCL_RS_TORCH_<KEY> ...)`` commands; ``json`` a dict.

The flags are what torch's own ``torch.utils.cpp_extension`` would use, without its CUDA and
ninja machinery:
- C++20: torch >= 2.12 headers refuse anything older, and older headers accept it.
- ``_GLIBCXX_USE_CXX11_ABI`` as torch was built.
- Where torch exports them (torch 2.8 does, 2.15 does not), pybind11's ABI tags
  (``PYBIND11_COMPILER_TYPE``, ``PYBIND11_STDLIB``, ``PYBIND11_BUILD_ABI``) as torch reports them. pybind11 2.x shares its type registry only
  between modules with equal tags, and the tags follow the compiler (g++ 12 says _cxxabi1017,
  torch 2.8 reports _cxxabi1018): with other tags, our module cannot see torch's
  ``c10d::Store`` type, and the backend creator rejects torch's PrefixStore. Newer pybind11
  decides compatibility itself, and torch stops exporting the tags.
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig

MIN_TORCH = (2, 8)
# A C++ program links libtorch (CPP_LIBRARIES); the Python extension also torch_python.
CPP_LIBRARIES = ["c10", "torch_cpu", "torch"]
LIBRARIES = [*CPP_LIBRARIES, "torch_python"]
PYBIND11_TAGS = ["COMPILER_TYPE", "STDLIB", "BUILD_ABI"]


def describe() -> dict:
    import torch

    root = os.path.dirname(torch.__file__)
    release = torch.__version__.split("+")[0]
    major, minor = (int(p) for p in release.split(".")[:2])
    if (major, minor) < MIN_TORCH:
        raise SystemExit(f"xccl_rs needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found {torch.__version__}")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    defines = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    for tag in PYBIND11_TAGS:
        value = getattr(torch._C, f"_PYBIND11_{tag}", None)
        if value is not None:
            defines.append(f'-DPYBIND11_{tag}="{value}"')
    include = os.path.join(root, "include")
    return {
        "version": release,
        "version_major": major,
        "version_minor": minor,
        "cxx11_abi": abi,
        "root": root,
        "include_dirs": [include, os.path.join(include, "torch", "csrc", "api", "include")],
        "python_include": sysconfig.get_paths()["include"],
        "library_dir": os.path.join(root, "lib"),
        "libraries": LIBRARIES,
        "cpp_libraries": CPP_LIBRARIES,
        "cxx_flags": ["-std=c++20", *defines],
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
    }


def as_lines(d: dict) -> str:
    rows = []
    for key, value in d.items():
        values = value if isinstance(value, list) else [value]
        rows.append("\t".join([key, *(str(v) for v in values)]))
    return "\n".join(rows)


def as_cmake(d: dict) -> str:
    def quote(v) -> str:
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    rows = []
    for key, value in d.items():
        values = value if isinstance(value, list) else [value]
        rows.append(f"set(XCCL_RS_TORCH_{key.upper()} {' '.join(quote(v) for v in values)})")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=["lines", "cmake", "json"], default="lines")
    fmt = parser.parse_args().format
    d = describe()
    print({"lines": as_lines, "cmake": as_cmake, "json": json.dumps}[fmt](d))


if __name__ == "__main__":
    main()
