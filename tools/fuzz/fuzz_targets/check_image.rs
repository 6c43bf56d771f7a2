//! Superblock and block parsing, then a full check (and, for images check
//! calls clean, a dump + restore round trip) on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // A compact image (its start) reads as the whole one: see expand_image.
    dedup_tools::fuzzing::fuzz_image_owned(dedup_tools::fuzzing::expand_image(data));
});
