//! The parsers of `dmsetup status` and of the `stats` message.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    dedup_tools::fuzzing::fuzz_stats(data);
});
