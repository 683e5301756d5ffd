#![cfg_attr(not(feature = "cpp"), allow(dead_code))]
//! Builds the C++ bridge (feature `cpp`; `bridge` adds the Python module) against the torch of the Python interpreter that
//! builds us: asks that torch for its version, include and library paths, C++ standard and
//! ABI, and fails with a readable message when torch is missing or too old. Without the
//! feature the crate is the pure Rust core and needs no torch.

use std::path::PathBuf;
use std::process::Command;

/// The one description of the C++ flags (python/xccl_rs/torch_build_flags.py), asked of a
/// Python interpreter with torch; setup.py runs it once and hands us its output in a file
/// (XCCL_RS_TORCH_FLAGS), so that the package's metadata and the build agree on the torch.
const FLAGS_SCRIPT: &str = "python/xccl_rs/torch_build_flags.py";

struct Torch {
    version: (u32, u32),
    include_dirs: Vec<PathBuf>,
    lib: PathBuf,
    python_include: PathBuf,
    cxx_flags: Vec<String>,
}

impl Torch {
    /// Parses the script's `lines` format: `key<TAB>value<TAB>value...`.
    fn parse(text: &str) -> Result<Torch, String> {
        let mut rows = std::collections::HashMap::new();
        for line in text.lines() {
            let mut parts = line.split('\t');
            if let Some(key) = parts.next() {
                rows.insert(key.to_string(), parts.map(str::to_string).collect::<Vec<_>>());
            }
        }
        let one = |key: &str| -> Result<String, String> {
            rows.get(key).and_then(|v| v.first().cloned()).ok_or_else(|| format!("no `{key}` in the torch flags: {text}"))
        };
        let number = |key: &str| -> Result<u32, String> { one(key)?.parse().map_err(|e| format!("{key}: {e}")) };
        Ok(Torch {
            version: (number("version_major")?, number("version_minor")?),
            include_dirs: rows.get("include_dirs").cloned().unwrap_or_default().into_iter().map(PathBuf::from).collect(),
            lib: one("library_dir")?.into(),
            python_include: one("python_include")?.into(),
            cxx_flags: rows.get("cxx_flags").cloned().unwrap_or_default(),
        })
    }
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
    let script = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR")).join(FLAGS_SCRIPT);
    let out = cmd.arg(&script).output().map_err(|e| format!("cannot run {python}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{python} cannot describe its torch: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Torch::parse(&String::from_utf8_lossy(&out.stdout))
}

fn find_torch() -> Torch {
    if let Some(file) = std::env::var_os("XCCL_RS_TORCH_FLAGS").filter(|f| !f.is_empty()) {
        println!("cargo:rerun-if-changed={}", file.to_string_lossy());
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("XCCL_RS_TORCH_FLAGS={}: {e}", file.to_string_lossy()));
        return Torch::parse(&text).unwrap_or_else(|e| panic!("XCCL_RS_TORCH_FLAGS={}: {e}", file.to_string_lossy()));
    }
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
    println!("cargo:rerun-if-changed={FLAGS_SCRIPT}");
    for v in ["XCCL_RS_PYTHON", "PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE", "XCCL_RS_TORCH_FLAGS"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    build_ofi_shim();
    if std::env::var_os("CARGO_FEATURE_CPP").is_none() {
        return;
    }
    build_bridge();
}

/// The OFI transport's C shim (src/transport/ofi/shim.c), in every build: it compiles
/// libfabric's inline calls against the vendored headers and opens libfabric.so.1 at run time,
/// so neither the build nor a machine that never asks for `ofi` needs libfabric.
fn build_ofi_shim() {
    const DIR: &str = "src/transport/ofi";
    println!("cargo:rerun-if-changed={DIR}/shim.c");
    println!("cargo:rerun-if-changed={DIR}/include");
    cc::Build::new()
        .file(format!("{DIR}/shim.c"))
        .include(format!("{DIR}/include"))
        .flag("-fvisibility=hidden")
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile("xccl_rs_ofi_shim");
    // dlopen lives in libc from glibc 2.34, in libdl before.
    println!("cargo:rustc-link-lib=dl");
}

#[cfg(feature = "cpp")]
fn build_bridge() {
    println!("cargo:rerun-if-env-changed=XCCL_RS_BRIDGE_EXPORT");
    if let Some(dir) = std::env::var_os("XCCL_RS_BRIDGE_EXPORT").filter(|d| !d.is_empty()) {
        export_bridge(PathBuf::from(dir));
        return;
    }
    let torch = find_torch(); // the script refuses torch older than 2.8
    // The Python extension (`bridge`) adds its pybind11 module; `cpp` alone needs no Python.
    let python = cfg!(feature = "bridge");
    let mut sources = vec![
        "csrc/api.cc",
        "csrc/communicator.cc",
        "csrc/backend.cc",
        "csrc/allocator.cc",
        "csrc/reconfigure.cc",
        "csrc/split.cc",
        "csrc/hooks.cc",
        "csrc/device.cc",
        "csrc/work.cc",
        "csrc/store.cc",
        "csrc/errors.cc",
        "csrc/profile.cc",
    ];
    if python {
        sources.push("csrc/module.cc");
    }
    // cxx writes the bridge's glue (ffi.rs.cc and the headers) into OUT_DIR; we compile it.
    let _ = cxx_build::bridge("src/ffi.rs");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let generated = out.join("cxxbridge");
    let glue = generated.join("sources/xccl_rs/src/ffi.rs.cc");
    let unity = write_unity_source(&out, &sources, &glue);
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file(&unity)
        .include(generated.join("include"))
        .include(generated.join("crate"))
        .include("include")
        .include("csrc/include")
        .includes(&torch.include_dirs)
        .flag("-fvisibility=hidden")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-missing-field-initializers")
        .opt_level(2)
        // Line tables for backtraces, not cargo's full debug info: that makes a TU full of
        // torch's templates much slower to compile.
        .debug(false)
        .flag("-g1");
    if python {
        build.include(&torch.python_include).define("TORCH_EXTENSION_NAME", "_C");
    }
    for flag in &torch.cxx_flags {
        build.flag(flag); // C++ standard, C++ ABI, pybind11's ABI tags
    }
    build.compile("xccl_rs_bridge");
    // Directories: cargo reruns us when any file under them changes (sources and headers).
    for dir in ["csrc", "include", "src/ffi.rs"] {
        println!("cargo:rerun-if-changed={dir}");
    }
    let lib = torch.lib.display().to_string();
    println!("cargo:rustc-link-search=native={lib}");
    for l in ["c10", "torch_cpu", "torch"].into_iter().chain(python.then_some("torch_python")) {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    // Find torch's libraries next to the installed package ($ORIGIN/../torch/lib), or where we
    // built against. In practice `import torch` has already loaded them by the time we load.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib:{lib}");
    println!("cargo:rustc-env=XCCL_RS_TORCH_VERSION={}.{}", torch.version.0, torch.version.1);
    println!("cargo:rerun-if-env-changed=XCCL_RS_PORTABLE");
    if std::env::var_os("XCCL_RS_PORTABLE").is_some_and(|v| v == "1") {
        link_portable(&torch);
    }
}

/// XCCL_RS_PORTABLE=1 (scripts/build_wheels.sh): the extension needs no newer glibc and
/// libstdc++ than torch's own wheels (manylinux_2_28), though it is built on a newer system.
/// tools/manylinux_shim.cc (which says why each of its wraps is sound) is linked in, as an
/// object so that it is always loaded, with `-Wl,--wrap=X` for each `__wrap_X` it defines.
/// Off by default: a build for this machine needs none of it.
#[cfg(feature = "cpp")]
fn link_portable(torch: &Torch) {
    const SHIM: &str = "tools/manylinux_shim.cc";
    println!("cargo:rerun-if-changed={SHIM}");
    let text = std::fs::read_to_string(SHIM).unwrap_or_else(|e| panic!("{SHIM}: {e}"));
    let mut build = cc::Build::new();
    // C++17: the shim itself must reference nothing newer. Only torch's C++ ABI of its flags.
    build.cpp(true).file(SHIM).flag("-std=c++17").opt_level(2).debug(false);
    for flag in torch.cxx_flags.iter().filter(|f| f.starts_with("-D_GLIBCXX_USE_CXX11_ABI")) {
        build.flag(flag);
    }
    for object in build.compile_intermediates() {
        println!("cargo:rustc-cdylib-link-arg={}", object.display());
    }
    for symbol in wrapped_symbols(&text) {
        println!("cargo:rustc-cdylib-link-arg=-Wl,--wrap={symbol}");
    }
    // Before glibc 2.34 the pthread functions live in libpthread.so.0 and dlsym in libdl.so.2.
    println!("cargo:rustc-cdylib-link-arg=-Wl,--push-state,--no-as-needed,-l:libpthread.so.0,-l:libdl.so.2,--pop-state");
}

/// The X of every `__wrap_X` the shim defines (a name followed by `(` or `=`), in order.
#[cfg(feature = "cpp")]
fn wrapped_symbols(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (i, _) in text.match_indices("__wrap_") {
        let rest = &text[i + "__wrap_".len()..];
        let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let after = rest[name.len()..].trim_start();
        if !name.is_empty() && (after.starts_with('(') || after.starts_with('=')) && !out.contains(&name) {
            out.push(name);
        }
    }
    out
}

/// One translation unit that includes every C++ source and the cxx glue. Each of them includes
/// torch's headers, whose parsing is most of the build (about 25 s a file here); compiled
/// together they are parsed once, which makes a cold build of the bridge 3x cheaper in CPU time
/// (62 s against 175 s on this project's 2-core machine). The sources keep their own file-local
/// names in anonymous namespaces that differ (the build fails if two collide).
#[cfg(feature = "cpp")]
fn write_unity_source(out: &std::path::Path, sources: &[&str], glue: &std::path::Path) -> PathBuf {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    // The glue first: it specializes cxx's templates, which must precede their first use.
    let mut text = String::from("// Generated by build.rs: the bridge as one translation unit.\n");
    text += &format!("#include \"{}\"\n", glue.display());
    for source in sources {
        text += &format!("#include \"{}\"\n", root.join(source).display());
    }
    let path = out.join("xccl_rs_bridge_unity.cc");
    // Rewritten only when it changes, so that cc's timestamps stay meaningful.
    if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
        std::fs::write(&path, text).expect("write the unity source");
    }
    path
}

/// Cross-building for a machine whose torch differs (scripts/gpu/): generates the cxx bridge's
/// C++ (header, glue source, `rust/cxx.h`) and copies it to `dir`, but compiles no C++ and links
/// no torch. Built as a staticlib, the crate then leaves the bridge's C++ symbols undefined; the
/// other machine compiles `csrc/` and the glue against its own torch and links them in.
#[cfg(feature = "cpp")]
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
        // Only a changed file is rewritten: cargo reruns us when a file named below is newer
        // than our last run, and one we rewrote every time would be.
        let text = std::fs::read(generated.join(from)).unwrap_or_else(|e| panic!("read {from}: {e}"));
        if std::fs::read(&to).ok().as_deref() != Some(text.as_slice()) {
            std::fs::write(&to, &text).unwrap_or_else(|e| panic!("write {}: {e}", to.display()));
        }
    }
    println!("cargo:rerun-if-changed=src/ffi.rs");
    // A copy that has gone (a fresh CMake build directory) is missing: cargo reruns us.
    for (_, to) in copies {
        println!("cargo:rerun-if-changed={}", dir.join(to).display());
    }
}

#[cfg(not(feature = "cpp"))]
fn build_bridge() {}
