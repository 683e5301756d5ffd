#![cfg_attr(not(feature = "bridge"), allow(dead_code))]
//! Builds the C++ bridge (feature `bridge`) against the torch of the Python interpreter that
//! builds us: asks that torch for its version, include and library paths, C++ standard and
//! ABI, and fails with a readable message when torch is missing or too old. Without the
//! feature the crate is the pure Rust core and needs no torch.

use std::path::PathBuf;
use std::process::Command;

/// Prints, one per line: version, include dir, lib dir, cxx11 abi flag, python include dir.
const PROBE: &str = r#"
import os, sys, sysconfig
import torch
root = os.path.dirname(torch.__file__)
print(torch.__version__.split('+')[0])
print(os.path.join(root, 'include'))
print(os.path.join(root, 'lib'))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(sysconfig.get_paths()['include'])
"#;

struct Torch {
    version: (u32, u32),
    include: PathBuf,
    lib: PathBuf,
    cxx11_abi: bool,
    python_include: PathBuf,
}

fn candidates() -> Vec<String> {
    // pip runs the build with the target environment's interpreter; setuptools-rust passes it
    // as PYO3_PYTHON. XCCL_RS_PYTHON overrides both.
    let mut c: Vec<String> = ["XCCL_RS_PYTHON", "PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .filter(|s| !s.is_empty())
        .collect();
    c.push("python3".into());
    c
}

fn probe(python: &str, isolated: bool) -> Result<Torch, String> {
    let mut cmd = Command::new(python);
    if isolated {
        // pip's build isolation hides the environment's site-packages through PYTHONPATH;
        // -E ignores that, so the torch we must match (the installed one) is found.
        cmd.arg("-E");
    }
    let out = cmd.arg("-c").arg(PROBE).output().map_err(|e| format!("cannot run {python}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{python} cannot import torch: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let lines: Vec<&str> = text.lines().collect();
    if lines.len() < 5 {
        return Err(format!("unexpected probe output from {python}: {text}"));
    }
    let mut v = lines[0].split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    Ok(Torch {
        version: (v.next().unwrap_or(0), v.next().unwrap_or(0)),
        include: lines[1].into(),
        lib: lines[2].into(),
        cxx11_abi: lines[3] == "1",
        python_include: lines[4].into(),
    })
}

fn find_torch() -> Torch {
    let mut errors = Vec::new();
    for python in candidates() {
        for isolated in [false, true] {
            match probe(&python, isolated) {
                Ok(t) => return t,
                Err(e) => errors.push(e),
            }
        }
    }
    panic!(
        "\n\nxccl_rs: could not find torch to build against.\n{}\n\
         Install torch (>= 2.8) in the Python environment first, or point XCCL_RS_PYTHON at an \
         interpreter that has it.\n",
        errors.join("\n")
    );
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for v in ["XCCL_RS_PYTHON", "PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    if std::env::var_os("CARGO_FEATURE_BRIDGE").is_none() {
        return;
    }
    build_bridge();
}

#[cfg(feature = "bridge")]
fn build_bridge() {
    println!("cargo:rerun-if-env-changed=XCCL_RS_BRIDGE_EXPORT");
    if let Some(dir) = std::env::var_os("XCCL_RS_BRIDGE_EXPORT").filter(|d| !d.is_empty()) {
        export_bridge(PathBuf::from(dir));
        return;
    }
    let torch = find_torch();
    if torch.version < (2, 8) {
        panic!("\n\nxccl_rs needs torch >= 2.8, found {}.{}\n", torch.version.0, torch.version.1);
    }
    // torch >= 2.12 headers require C++20; older ones build with it too.
    let std_flag = "-std=c++20";
    let sources = ["csrc/backend.cc", "csrc/device.cc", "csrc/work.cc", "csrc/store.cc", "csrc/module.cc"];
    let mut build = cxx_build::bridge("src/ffi.rs");
    build
        .files(sources)
        .include("csrc/include")
        .include(&torch.include)
        .include(torch.include.join("torch/csrc/api/include"))
        .include(&torch.python_include)
        .flag(std_flag)
        .flag("-fvisibility=hidden")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-missing-field-initializers")
        .define("_GLIBCXX_USE_CXX11_ABI", if torch.cxx11_abi { "1" } else { "0" })
        .define("TORCH_EXTENSION_NAME", "_C")
        .opt_level(2);
    build.compile("xccl_rs_bridge");
    for f in sources.iter().chain(["csrc/include/xccl_rs/backend.h", "csrc/include/xccl_rs/device.h", "csrc/include/xccl_rs/work.h", "csrc/include/xccl_rs/store.h", "src/ffi.rs"].iter()) {
        println!("cargo:rerun-if-changed={f}");
    }
    let lib = torch.lib.display().to_string();
    println!("cargo:rustc-link-search=native={lib}");
    for l in ["c10", "torch_cpu", "torch", "torch_python"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    // Find torch's libraries next to the installed package ($ORIGIN/../torch/lib), or where we
    // built against. In practice `import torch` has already loaded them by the time we load.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib:{lib}");
    println!("cargo:rustc-env=XCCL_RS_TORCH_VERSION={}.{}", torch.version.0, torch.version.1);
}

/// Cross-building for a machine whose torch differs (scripts/gpu/): generates the cxx bridge's
/// C++ (header, glue source, `rust/cxx.h`) and copies it to `dir`, but compiles no C++ and links
/// no torch. Built as a staticlib, the crate then leaves the bridge's C++ symbols undefined; the
/// other machine compiles `csrc/` and the glue against its own torch and links them in.
#[cfg(feature = "bridge")]
fn export_bridge(dir: PathBuf) {
    let _ = cxx_build::bridge("src/ffi.rs"); // writes the generated files into OUT_DIR
    let generated = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("cxxbridge");
    let copies = [
        ("include/xccl_rs/src/ffi.rs.h", "include/xccl_rs/src/ffi.rs.h"),
        ("include/rust/cxx.h", "include/rust/cxx.h"),
        ("sources/xccl_rs/src/ffi.rs.cc", "ffi.rs.cc"),
    ];
    for (from, to) in copies {
        let to = dir.join(to);
        std::fs::create_dir_all(to.parent().unwrap()).expect("create the export directory");
        std::fs::copy(generated.join(from), &to).unwrap_or_else(|e| panic!("copy {from} to {}: {e}", to.display()));
    }
    println!("cargo:rerun-if-changed=src/ffi.rs");
}

#[cfg(not(feature = "bridge"))]
fn build_bridge() {}
