//! Compiles the Perfetto trace protos subset (proto/perfetto_trace.proto) into Rust with
//! prost-build, parsed by protox (pure Rust: no protoc binary needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/perfetto_trace.proto";
    println!("cargo:rerun-if-changed={proto}");
    println!("cargo:rerun-if-changed=build.rs");
    let fds = protox::compile([proto], ["proto"])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
