//! `hyptrace`: thin wrapper over `hyptrace_host::cli`.
fn main() {
    std::process::exit(hyptrace_host::cli::main());
}
