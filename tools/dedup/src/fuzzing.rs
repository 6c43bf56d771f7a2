//! Entry points shared by the cargo-fuzz targets (tools/fuzz) and the
//! deterministic robustness tests: every parser of untrusted input, run on
//! arbitrary bytes. They must return, never panic.

use crate::check::{check, CheckOptions, Severity};
use crate::device::{BlockDev, MemDev};
use crate::fingerprint::Hasher;
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

/// Repair's salvage path on arbitrary bytes as a metadata image: it must
/// return, and whatever it plans must write, check clean (unless the device
/// is smaller than the kernel requires for its sizes) and read back as
/// planned; repairing the result must change nothing. When the sizes are
/// small, the same again with a data device, whose digests every live
/// block must then carry.
pub fn fuzz_repair(data: &[u8]) {
    let dev = MemDev::from_bytes(data.to_vec());
    repair_round(&dev, None);
    if let Ok(c) = crate::salvage::choose_superblock(&dev) {
        if c.sb.data_blocks <= 64 && Hasher::from_name(&c.sb.hash()).is_some() {
            let mut d = MemDev::new(c.sb.data_blocks);
            for p in 0..c.sb.data_blocks {
                // A zero block now and then, as a discarded one reads.
                if p % 7 != 3 {
                    d.block_mut(p)[..8].copy_from_slice(&(p + 1).to_le_bytes());
                }
            }
            repair_round(&dev, Some(&d));
        }
    }
}

fn repair_round(dev: &MemDev, data: Option<&MemDev>) {
    use crate::repair::{plan, write};
    let Ok(p) = plan(dev, data.map(|d| d as &(dyn BlockDev + Sync))) else {
        return;
    };
    let _ = crate::repair::render(&p, "fuzz", false);
    let _ = serde_json::to_string(&p.changes).expect("changes serialize");
    let mut copy = dev.clone();
    let report = match write(&mut copy, &p) {
        Ok(r) => r,
        // The trees do not fit: the device is smaller than the kernel
        // requires, and the old state is left as it was.
        Err(e) if e.contains("metadata device full") => return,
        Err(e) => panic!("repair write failed: {e}"),
    };
    if !report.clean() {
        assert!(
            report
                .problems
                .iter()
                .all(|x| x.severity == Severity::Warning || x.code == "device_too_small"),
            "{:?}",
            report.problems
        );
        return;
    }
    if let (Some(d), Some(h)) = (data, Hasher::from_name(&p.spec.sb.hash())) {
        for &(pba, fp) in &p.spec.fingerprints {
            let mut b = zero_block();
            d.read_block(pba, &mut b).expect("in range");
            assert_eq!(fp, h.record(&b[..]), "pba {pba}");
        }
    }
    let again = match plan(&copy, None) {
        Ok(a) => a,
        // The repair wrote DD_MAX_TXN, the last generation the kernel
        // accepts: another has no generation left to write, and says so.
        Err(e) if p.summary.generation_after == MAX_TXN => {
            assert!(e.0.contains("cannot be advanced"), "{e}");
            return;
        }
        Err(e) => panic!("a repaired device can be planned again: {e}"),
    };
    assert_eq!(again.changed(), 0, "{:#?}", again.changes);
    assert_eq!(again.spec.mappings, p.spec.mappings);
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
