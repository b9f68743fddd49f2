//! Compiles the .proto files with protox (pure Rust, no protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/tandem/v1/tandem.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
