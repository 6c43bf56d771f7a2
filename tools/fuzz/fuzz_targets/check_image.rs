//! Superblock and block parsing, then a full check (and, for images check
//! calls clean, a dump + restore round trip) on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    dedup_tools::fuzzing::fuzz_image(data);
});
