//! Generates the C header from the crate's `extern "C"` API with cbindgen and checks it
//! against the committed include/hyptrace.h (the header C guests build against). A
//! difference fails the build; `HYPTRACE_BLESS_HEADER=1` rewrites the committed header.
use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=include/hyptrace.h");
    println!("cargo:rerun-if-env-changed=HYPTRACE_BLESS_HEADER");
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let generated = out.join("hyptrace.h");
    cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .generate()
        .expect("cbindgen could not generate the header")
        .write_to_file(&generated);
    let new = std::fs::read_to_string(&generated).expect("generated header");
    let committed = dir.join("include/hyptrace.h");
    let old = std::fs::read_to_string(&committed).unwrap_or_default();
    if new != old {
        if std::env::var_os("HYPTRACE_BLESS_HEADER").is_some_and(|v| v == "1") {
            std::fs::write(&committed, &new).expect("writing include/hyptrace.h");
        } else {
            panic!(
                "guest/c-sdk/include/hyptrace.h is not what cbindgen generates from the \
                 source ({}); rebuild with HYPTRACE_BLESS_HEADER=1 to update it",
                generated.display()
            );
        }
    }
}
