//! Entry points shared by the cargo-fuzz targets (tools/fuzz) and the
//! deterministic robustness tests: every parser of untrusted input, run on
//! arbitrary bytes. They must return, never panic.

use crate::check::{check, CheckOptions};
use crate::device::MemDev;
use crate::ondisk::*;

/// Superblock and block-header parsing on the first bytes, then a full
/// check (with content collection, as dump does) of the bytes as an image.
pub fn fuzz_image(data: &[u8]) {
    fuzz_image_owned(data.to_vec())
}

/// fuzz_image without copying the input.
pub fn fuzz_image_owned(data: Vec<u8>) {
    if data.len() >= BLOCK_SIZE {
        let b: &Block = data[..BLOCK_SIZE].try_into().unwrap();
        let _ = classify_slot(0, b);
        let _ = classify_slot(1, b);
        let sb = Superblock::decode(b);
        let _ = sb.hash();
        for id in ArrayId::ALL {
            let g = sb.geometry(id);
            let _ = g.leaf_count(g.nr_leaves.saturating_sub(1));
            let _ = g.entry_range(0, g.height);
        }
        let _ = required_blocks(sb.logical_blocks, sb.data_blocks);
        let _ = Header::decode(&b[..]);
    }
    let dev = MemDev::from_bytes(data);
    let opts = CheckOptions {
        collect: true,
        max_problems: 100,
        ..CheckOptions::default()
    };
    let Ok((report, contents)) = check(&dev, &opts) else {
        return;
    };
    let _ = crate::check::render(&report, "fuzz");
    let _ = serde_json::to_string(&report).expect("a report serializes");
    if !report.clean() {
        return;
    }
    // Differential property: what check calls clean, dump + restore
    // reproduce exactly, and the copy checks clean too.
    let contents = contents.expect("collected");
    let sbi = report.superblock.expect("clean means a superblock");
    let sb = Superblock::decode(dev.block(sbi.slot));
    let need = required_blocks(sb.logical_blocks, sb.data_blocks);
    if need > 4096 {
        return;
    }
    let mut json = Vec::new();
    crate::dump::write_dump(
        &mut json,
        &crate::dump::DumpSuperblock::from_sb(&sb),
        &contents,
    )
    .expect("dump to memory");
    let dump = crate::dump::parse_dump(&json[..]).expect("our own dump parses");
    let spec = crate::dump::validate(&dump, None, 10).expect("a clean image gives a valid dump");
    let mut copy = MemDev::new(need);
    crate::dump::restore_to(&mut copy, spec, false).expect("a valid dump restores");
    let (r2, c2) = check(&copy, &opts).expect("the copy checks");
    assert!(r2.clean(), "{:?}", r2.problems);
    assert_eq!(c2.expect("collected"), contents);
}

/// The dump reader and its validation.
pub fn fuzz_dump(data: &[u8]) {
    if let Ok(d) = crate::dump::parse_dump(data) {
        if let Ok(spec) = crate::dump::validate(&d, None, 10) {
            // Write it if it is small enough to hold in memory.
            let need = required_blocks(spec.sb.logical_blocks, spec.sb.data_blocks);
            if need <= 4096 {
                let mut dev = MemDev::new(need);
                crate::dump::restore_to(&mut dev, spec, false)
                    .expect("a validated dump restores and checks clean");
            }
        }
    }
}

/// The dmsetup output parsers.
pub fn fuzz_stats(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (a, b) = text.split_at(text.find('\n').unwrap_or(text.len()));
    if let Ok(st) = crate::stats::parse_status(a) {
        let msg = crate::stats::parse_message(b).ok();
        let s = crate::stats::combine("fuzz", &st[0], msg.as_ref());
        let _ = crate::stats::render(&s);
    }
    let _ = crate::stats::parse_message(&text);
}
