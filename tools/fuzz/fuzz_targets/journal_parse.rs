//! The journal block and record parser on arbitrary bytes, then replay of
//! a ring built from them over a small image: check (and, when clean, the
//! dump + restore round trip) and repair, whose result must check clean
//! with an empty journal.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    dedup_tools::fuzzing::fuzz_journal(data);
});
