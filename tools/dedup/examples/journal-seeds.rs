//! Write the starting corpus of the `journal_parse` fuzz target (see
//! `dedup_tools::fuzzing::fuzz_journal`): one file per seed in DIR.
//!
//!   cargo run --example journal-seeds -- DIR

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: journal-seeds DIR");
        std::process::exit(16);
    };
    let dir = std::path::Path::new(&dir);
    for (i, seed) in dedup_tools::fuzzing::journal_fuzz_seeds()
        .iter()
        .enumerate()
    {
        let p = dir.join(format!("seed-{i}"));
        if let Err(e) = std::fs::write(&p, seed) {
            eprintln!("journal-seeds: {}: {e}", p.display());
            std::process::exit(8);
        }
    }
}
