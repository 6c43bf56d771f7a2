//! The JSON dump reader and the validation restore does before writing.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    dedup_tools::fuzzing::fuzz_dump(data);
});
