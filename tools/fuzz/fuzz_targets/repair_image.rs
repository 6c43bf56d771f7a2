//! Repair's salvage path on arbitrary bytes as a metadata image (and, when
//! the sizes are small, with a data device): what it plans must write,
//! check clean and need no second repair.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    dedup_tools::fuzzing::fuzz_repair(data);
});
