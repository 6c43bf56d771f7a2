//! Repair's salvage path on arbitrary bytes as a metadata image (and, when
//! the sizes are small, with a data device): what it plans must write,
//! check clean and need no second repair.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // A compact image (its start) reads as the whole one: see expand_image.
    dedup_tools::fuzzing::fuzz_repair(&dedup_tools::fuzzing::expand_image(data));
});
