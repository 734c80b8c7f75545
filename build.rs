//! Compiles tollgate's own protocol (`proto/tollgate/region/v1/region.proto`) with protox, a
//! protobuf compiler in Rust, so that building needs no `protoc`; every other protocol comes
//! precompiled from crates (`proto/README.md`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/tollgate/region/v1/region.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
