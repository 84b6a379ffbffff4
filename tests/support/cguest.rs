//! C guests: builds the C SDK (`libhyptrace.a`, guest/c-sdk, a nested `cargo build`
//! from guest/ so its .cargo/config.toml applies; the SDK's build script fails if
//! include/hyptrace.h is not what cbindgen generates) and links a C source against it
//! with gcc as a freestanding static image, each once per test binary: the example
//! (guest/examples/c/main.c) and the test guests under tests/support/c/.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};

// `strip_var`: which variables a nested guest build must not inherit (shared with
// crates/payload/build.rs).
include!("../../crates/payload/guest_build_env.rs");

/// Builds the C SDK and the example C guest under `<target_dir>/c-guest` and returns
/// the ELF's path (cached per test binary).
///
/// `target_dir` is the root package's target directory (the parent of the directory
/// holding the `hyptrace` binary).
pub fn c_guest(target_dir: &Path) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    linked(target_dir, &root.join("guest/examples/c/main.c"), "c-guest")
}

/// Builds the test C guest `tests/support/c/<name>.c` (as [`c_guest`]) and returns the
/// ELF's path.
pub fn c_test_guest(target_dir: &Path, name: &str) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let source = root.join("tests/support/c").join(format!("{name}.c"));
    linked(target_dir, &source, name)
}

/// `source` linked against the C SDK as `<target_dir>/c-guest/<elf>.elf`, once per test
/// binary.
fn linked(target_dir: &Path, source: &Path, elf: &str) -> Result<PathBuf, String> {
    static LIB: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    static ELVES: Mutex<Option<HashMap<String, Result<PathBuf, String>>>> = Mutex::new(None);
    let lib = LIB.get_or_init(|| build_sdk(target_dir)).clone()?;
    let mut elves = ELVES.lock().unwrap_or_else(|e| e.into_inner());
    elves
        .get_or_insert_with(HashMap::new)
        .entry(elf.to_string())
        .or_insert_with(|| {
            link(
                &lib,
                source,
                &target_dir.join("c-guest").join(format!("{elf}.elf")),
            )
        })
        .clone()
}

fn output(cmd: &mut Command, what: &str) -> Result<(), String> {
    let o = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed ({}):\n{}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ))
    }
}

/// Builds `libhyptrace.a` under `<target_dir>/c-guest`; returns its path.
fn build_sdk(target_dir: &Path) -> Result<PathBuf, String> {
    let guest = Path::new(env!("CARGO_MANIFEST_DIR")).join("guest");
    let out = target_dir.join("c-guest");
    let cargo = std::env::var_os("CARGO")
        .or_else(|| option_env!("CARGO").map(Into::into))
        .unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(&guest)
        .args(["build", "--release", "-p", "hyptrace-c-sdk", "--target-dir"])
        .arg(&out);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(strip_var) {
            cmd.env_remove(&name);
        }
    }
    output(&mut cmd, "building the C SDK (guest/c-sdk)")?;
    let lib = out.join("x86_64-unknown-linux-gnu/release/libhyptrace.a");
    if !lib.is_file() {
        return Err(format!("the C SDK build left no {}", lib.display()));
    }
    Ok(lib)
}

/// Compiles `source` and links it against `lib` into `elf`.
fn link(lib: &Path, source: &Path, elf: &Path) -> Result<PathBuf, String> {
    let guest = Path::new(env!("CARGO_MANIFEST_DIR")).join("guest");
    let mut gcc = Command::new("gcc");
    gcc.args([
        "-std=c11",
        "-ffreestanding",
        "-nostdlib",
        "-static",
        "-fno-pic",
        "-no-pie",
        "-O2",
        "-mno-red-zone",
        "-fno-stack-protector",
        "-fno-asynchronous-unwind-tables",
        "-Wall",
        "-Wextra",
        "-Wpedantic",
        "-Werror",
        "-Wl,--build-id=none",
        "-Wl,--gc-sections",
        "-Wl,--no-warn-rwx-segments",
    ])
    .arg("-I")
    .arg(guest.join("c-sdk/include"))
    .arg(format!("-Wl,-T,{}", guest.join("link.ld").display()))
    .arg(source)
    .arg(lib)
    .arg("-o")
    .arg(elf);
    output(
        &mut gcc,
        &format!("compiling the C guest {} (gcc)", source.display()),
    )?;
    Ok(elf.to_path_buf())
}
