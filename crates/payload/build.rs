//! Builds the guest payload (guest/, its own cargo workspace) with a nested
//! `cargo build --release` and leaves the ELF at `$OUT_DIR/hyptrace-guest.elf` for
//! `include_bytes!`.
//!
//! The nested cargo runs from guest/ so that guest/.cargo/config.toml (target rustflags)
//! applies, with its own target dir under OUT_DIR, and without the variables the outer
//! cargo sets for build scripts (CARGO_*, RUSTFLAGS, RUSTC_WRAPPER, ...), which would
//! otherwise leak into it (clippy-driver, coverage flags, the outer target dir...).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

// `strip_var`: which variables the nested guest build must not inherit (shared with the
// tests, which build the adversarial guest the same way).
include!("guest_build_env.rs");

fn rerun_if_exists(p: &Path) {
    if p.exists() {
        println!("cargo:rerun-if-changed={}", p.display());
    }
}

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest
        .parent()
        .and_then(|p| p.parent())
        .expect("crates/payload/ is two levels below the workspace root")
        .to_path_buf();
    let guest = root.join("guest");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());

    for p in [
        "src",
        "Cargo.toml",
        "Cargo.lock",
        "build.rs",
        "link.ld",
        ".cargo/config.toml",
        "rt",
    ] {
        rerun_if_exists(&guest.join(p));
    }
    for krate in ["abi", "writer"] {
        for p in ["src", "Cargo.toml"] {
            rerun_if_exists(&root.join("crates").join(krate).join(p));
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=guest_build_env.rs");

    let target_dir = out.join("guest-target");
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(&guest)
        .args(["build", "--release", "--target-dir"])
        .arg(&target_dir)
        // Build-script stdout is parsed for `cargo:` directives: keep the child off it.
        .stdout(std::io::stderr());
    for (name, _) in env::vars_os() {
        if name.to_str().is_some_and(strip_var) {
            cmd.env_remove(&name);
        }
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cargo:?} for the guest: {e}"));
    assert!(
        status.success(),
        "building the guest payload (guest/) failed: {status}"
    );

    let elf = target_dir.join("x86_64-unknown-linux-gnu/release/hyptrace-guest");
    let dest = out.join("hyptrace-guest.elf");
    std::fs::copy(&elf, &dest)
        .unwrap_or_else(|e| panic!("cannot copy {} to {}: {e}", elf.display(), dest.display()));
}
