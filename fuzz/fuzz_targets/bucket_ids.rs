#![no_main]
//! Fuzz target: see ../checks.rs for what it checks.

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::bucket_ids(data));
