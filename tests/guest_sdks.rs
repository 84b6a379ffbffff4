//! The guest SDKs' build instructions work as written (issue 26, item 6): the build
//! block of docs/sdk-c.md, taken from the document and run as it stands from the
//! repository's root, builds the C SDK and the example without a warning and records it;
//! and guest/template/, copied out of the repository with its dependencies pointed at the
//! checkout as its README says, builds and runs under `hyptrace run --guest`. VM tests
//! skip without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1 (and the C block without
//! trace-cmd unless HYPTRACE_REQUIRE_TRACE_CMD=1).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use hyptrace::env::{self, kvm_available, trace_cmd_available, vm_lock, TempDir};

// `strip_var`: what a nested cargo must not inherit from the one running the tests.
include!("../crates/payload/guest_build_env.rs");

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The directory of the hyptrace under test, first on PATH: the documents call it
/// `hyptrace`.
fn path_with_hyptrace() -> std::ffi::OsString {
    let bin_dir = Path::new(BIN).parent().expect("bin dir");
    let mut dirs = vec![bin_dir.to_path_buf()];
    dirs.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    std::env::join_paths(dirs).expect("PATH")
}

/// `cmd` without the variables of the cargo running the tests, `hyptrace` on PATH.
fn clean(mut cmd: Command) -> Command {
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(strip_var) {
            cmd.env_remove(&name);
        }
    }
    cmd.env("PATH", path_with_hyptrace()).stdin(Stdio::null());
    cmd
}

fn text(o: &Output) -> String {
    format!("{}\n{}", env::stdout(o), env::stderr(o))
}

/// The shell block right after `## Build` in docs/sdk-c.md, as the document has it.
fn sdk_c_build_block() -> String {
    let doc = std::fs::read_to_string(repo().join("docs/sdk-c.md")).expect("docs/sdk-c.md");
    let (_, after) = doc
        .split_once("\n## Build\n")
        .expect("a `## Build` section");
    let (_, from) = after.split_once("```sh\n").expect("a ```sh block in it");
    let (block, _) = from.split_once("\n```").expect("the block's end");
    block.to_string()
}

/// docs/sdk-c.md's build block, run verbatim by bash (`-e`: any failing command fails it)
/// from the repository's root with the hyptrace under test on PATH: no warning from the
/// compiler or the linker, and trace-cmd prints every event of the example on both vCPUs.
/// Its temporary directory (`mktemp -d`) is under this test's own (TMPDIR); the SDK goes
/// where the document says, guest/target (cargo locks it; no other test builds there).
#[test]
fn sdk_c_build_block_works_verbatim() {
    if !kvm_available(KRATE, "sdk_c_build_block_works_verbatim") || !trace_cmd_available() {
        return;
    }
    let block = sdk_c_build_block();
    assert!(
        block.contains("gcc ") && block.contains("hyptrace record"),
        "{block}"
    );
    let tmp = TempDir::new("sdk-c-doc");
    let _vm = vm_lock();
    let mut cmd = Command::new("bash");
    cmd.args(["-e", "-u", "-o", "pipefail", "-c", &block])
        .current_dir(repo());
    let o = clean(cmd).env("TMPDIR", tmp.path()).output().expect("bash");
    let all = text(&o);
    assert!(o.status.success(), "the block failed:\n{block}\n{all}");
    // cargo's, gcc's and ld's warnings all say `warning:`.
    assert!(!env::stderr(&o).contains("warning:"), "{all}");
    let out = env::stdout(&o);
    let samples = out.lines().filter(|l| l.contains("sample:")).count();
    assert_eq!(samples, 2000, "{all}");
    for want in ["seq=999 cpu=0", "seq=999 cpu=1", "tag=c1-999"] {
        assert!(out.contains(want), "{want} not in {out}");
    }
}

/// Copies `from` into `to` (files and directories; `target` left out).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir") {
        let e = e.expect("entry");
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if e.file_type().expect("type").is_dir() {
            if e.file_name() != "target" {
                copy_tree(&src, &dst);
            }
        } else {
            std::fs::copy(&src, &dst).expect("copy");
        }
    }
}

/// guest/template copied out of the repository into a temporary directory, its three
/// dependencies pointed at the checkout the way its README does it (`path = "../../` →
/// the checkout), built there with `cargo build --release` (its own target directory,
/// under this test binary's target, shared with no other test), and run: every
/// `myguest:step` event of both vCPUs comes out with its fields, and the accounting is
/// exact (exit 0: no MISMATCH), with either doorbell (`--doorbell port|mmio`).
#[test]
fn the_rust_template_builds_and_runs_out_of_the_repository() {
    if !kvm_available(
        KRATE,
        "the_rust_template_builds_and_runs_out_of_the_repository",
    ) {
        return;
    }
    let template = repo().join("guest/template");
    let readme = std::fs::read_to_string(template.join("README.md")).expect("README.md");
    assert!(readme.contains(r#"s|path = "../../|path = "#), "{readme}");
    let tmp = TempDir::new("rust-template");
    let dir = tmp.path().join("my-guest");
    copy_tree(&template, &dir);
    let manifest = dir.join("Cargo.toml");
    let toml = std::fs::read_to_string(&manifest).expect("Cargo.toml");
    let checkout = format!("path = \"{}/", repo().display());
    let fixed = toml.replace("path = \"../../", &checkout);
    assert_eq!(fixed.matches(&checkout).count(), 3, "{fixed}");
    std::fs::write(&manifest, fixed).expect("Cargo.toml");

    let target: PathBuf = Path::new(BIN)
        .parent()
        .and_then(Path::parent)
        .expect("<target>/<profile>/hyptrace")
        .join("template-guest");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .args(["build", "--release", "--target-dir"])
        .arg(&target)
        .current_dir(&dir);
    let o = clean(build).output().expect("cargo");
    assert!(o.status.success(), "building the template:\n{}", text(&o));
    let elf = target.join("x86_64-unknown-linux-gnu/release/my-guest");

    let _vm = vm_lock();
    // Both doorbells: the template rings where its entry rcx says (docs/abi.md).
    for doorbell in ["port", "mmio"] {
        let o = env::run(
            BIN,
            &[
                "run",
                "--guest",
                elf.to_str().expect("utf-8"),
                "--vcpus",
                "2",
                "--events",
                "50",
                "--doorbell",
                doorbell,
            ],
        );
        let (out, err) = (env::stdout(&o), env::stderr(&o));
        assert_eq!(o.status.code(), Some(0), "--doorbell {doorbell}: {err}");
        for cpu in 0..2 {
            let steps = out
                .lines()
                .filter(|l| l.contains("step:") && l.contains(&format!(" cpu={cpu}")))
                .count();
            assert_eq!(steps, 50, "cpu {cpu}: {out}");
            assert!(out.contains(&format!("i=49 cpu={cpu}")), "{out}");
            let line = format!("cpu {cpu}: attempted 50 skipped 0 written 50 read 50 lost 0");
            assert!(err.contains(&line), "{line} not in {err}");
        }
    }
}
