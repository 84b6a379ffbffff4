// Included by crates/payload/build.rs and tests/support/adversary.rs: the environment rule for a
// nested `cargo build` of the guest workspace.

/// Variables kept from the CARGO_* family: they say where and how to reach registries.
fn keep_cargo_var(name: &str) -> bool {
    name == "CARGO_HOME"
        || name.starts_with("CARGO_NET_")
        || name.starts_with("CARGO_HTTP_")
        || name.starts_with("CARGO_REGISTRIES_")
        || name.starts_with("CARGO_REGISTRY_")
}

/// Whether a nested guest build must not inherit `name`: the variables the outer cargo
/// sets for build scripts and tests (CARGO_*, RUSTFLAGS, RUSTC_WRAPPER, OUT_DIR...),
/// which would leak into it (clippy-driver, coverage flags, the outer target dir...).
fn strip_var(name: &str) -> bool {
    (name.starts_with("CARGO") && !keep_cargo_var(name))
        || name.starts_with("__CARGO")
        || matches!(
            name,
            "RUSTFLAGS"
                | "RUSTDOCFLAGS"
                | "RUSTC"
                | "RUSTDOC"
                | "RUSTC_WRAPPER"
                | "RUSTC_WORKSPACE_WRAPPER"
                | "RUSTC_LINKER"
                | "TARGET"
                | "HOST"
                | "OUT_DIR"
                | "OPT_LEVEL"
                | "PROFILE"
                | "DEBUG"
                | "NUM_JOBS"
        )
}
