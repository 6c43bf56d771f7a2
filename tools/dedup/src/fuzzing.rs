//! Entry points shared by the cargo-fuzz targets (tools/fuzz) and the
//! deterministic robustness tests: every parser of untrusted input, run on
//! arbitrary bytes. They must return, never panic.

use crate::check::{check, CheckOptions, Severity};
use crate::device::{BlockDev, MemDev};
use crate::fingerprint::Hasher;
use crate::ondisk::*;

/// Images up to this many blocks are zero-extended by `expand_image`.
const EXPAND_MAX: u64 = 1 << 13;

/// A fuzz input as an image: when a superblock slot carries the magic and
/// names more blocks than the input holds (at most EXPAND_MAX), the input
/// is the start of the image and the rest reads as zeros. Most of an image
/// is never written: what the tools write is at the start (the trees, then
/// the journal's run, which is not written), so the cargo-fuzz corpora
/// keep the start only.
pub fn expand_image(data: &[u8]) -> Vec<u8> {
    let have = (data.len() / BLOCK_SIZE) as u64;
    let named = (0..SB_SLOTS.min(have))
        .map(|s| {
            Superblock::decode(
                data[s as usize * BLOCK_SIZE..][..BLOCK_SIZE]
                    .try_into()
                    .unwrap(),
            )
        })
        .filter(|sb| sb.magic == SB_MAGIC)
        .map(|sb| sb.metadata_blocks)
        .filter(|&n| n > have && n <= EXPAND_MAX)
        .max();
    let Some(n) = named else {
        return data.to_vec();
    };
    // Zeroed by the allocator, touched only where the input is copied.
    let mut v = vec![0u8; n as usize * BLOCK_SIZE];
    v[..data.len()].copy_from_slice(data);
    v
}

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
    if need > EXPAND_MAX {
        return;
    }
    // The state: the trees with the journal replayed.
    let (dsb, journal) = crate::dump::DumpSuperblock::of_state(&dev, &sb);
    let mut json = Vec::new();
    crate::dump::write_dump_with_journal(&mut json, &dsb, &contents, journal.as_ref())
        .expect("dump to memory");
    let dump = crate::dump::parse_dump(&json[..]).expect("our own dump parses");
    assert_eq!(dump.journal, journal, "the journal part reads back");
    let spec = crate::dump::validate(&dump, None, 10).expect("a clean image gives a valid dump");
    let mut copy = MemDev::new(need);
    crate::dump::restore_to(&mut copy, spec, false).expect("a valid dump restores");
    let (r2, c2) = check(&copy, &opts).expect("the copy checks");
    assert!(r2.clean(), "{:?}", r2.problems);
    assert_eq!(c2.expect("collected"), contents);
    // The copy's journal is new and empty.
    let j2 = r2.journal.expect("restore writes version 2");
    assert_eq!((j2.blocks_in_epoch, j2.epoch), (0, 1));
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

/// Header bytes of a `fuzz_journal` input before its blocks.
pub const JOURNAL_FUZZ_HEAD: usize = 16;
/// Where `fuzz_journal` puts its ring, and how long it is.
const FUZZ_RUN: (u64, u64) = (40, 16);

/// The state `fuzz_journal` replays over (generation 3): 300 logical blocks
/// over 60 data blocks, 120 mapped onto 50, a run of 16 blocks at 40.
pub fn journal_fuzz_base() -> crate::writer::ImageSpec {
    use crate::writer::{test_fingerprint, ImageSpec};
    let (logical, data) = (300u64, 60u64);
    let mut sb = Superblock::new_formatted(
        required_blocks(logical, data),
        data,
        logical,
        "sha256",
        32,
        1,
    );
    sb.header.txn = 3;
    sb.journal_start = FUZZ_RUN.0;
    sb.journal_blocks = FUZZ_RUN.1;
    sb.journal_seq = 1;
    sb.journal_id = 0x00f0_220f;
    let maps: Vec<(u64, u64)> = (0..120u64).map(|i| (i * 2, i % 50)).collect();
    ImageSpec::consistent(sb, &maps, test_fingerprint)
}

/// The journal's parser and replay on arbitrary bytes.
///
/// Every 4 KiB of the input is decoded as a journal block: encoding it
/// again gives the same bytes (resealed), and records that parse encode
/// back to the bytes they came from. Then the input becomes the ring of
/// `journal_fuzz_base`'s image: byte 0 is how many blocks to place (at
/// most 16), byte 1 the epoch (byte 2's top bit: counted down from
/// 2^64 - 1, so that the sequence numbers wrap; its bit 6: the superblock
/// has UNFLUSHED_APPENDS, so that UNFLUSHED blocks replay, unchecked
/// without a data device); each block of 4 KiB that
/// follows the 16-byte head is placed at the next sequence number, made to
/// continue the journal (type, location, id, epoch, sequence, checksum)
/// unless its byte 0 & 3 is 2 (only resealed) or 3 (as it is). The image
/// then goes through `fuzz_image` (check, and dump + restore when clean)
/// and repair, whose result must check clean with an empty journal.
pub fn fuzz_journal(data: &[u8]) {
    for chunk in data.chunks(BLOCK_SIZE) {
        let mut b = zero_block();
        b[..chunk.len()].copy_from_slice(chunk);
        let jb = JournalBlock::decode(&b);
        seal(&mut b);
        assert!(*jb.encode() == *b, "decode + encode keeps the bytes");
        let _ = not_continuing_any(&b);
        if let Ok(recs) = jb.records(300, 60, true) {
            let bytes: Vec<u8> = recs.iter().flat_map(|r| r.encode()).collect();
            assert_eq!(&bytes[..], &jb.payload[..jb.used as usize]);
            let again = JournalBlock::new(
                jb.header.blocknr,
                jb.header.txn,
                jb.journal_id,
                jb.epoch,
                jb.seq,
                &recs,
                jb.is_end(),
            );
            assert_eq!(
                (again.used, again.flags | (jb.flags & JF_UNFLUSHED)),
                (jb.used, jb.flags)
            );
            for r in &recs {
                assert_eq!(Record::decode(&r.encode()), Ok((*r, r.size())));
            }
        }
        for off in (0..JOURNAL_PAYLOAD).step_by(8).take(8) {
            if let Ok((r, n)) = Record::decode(&jb.payload[off..]) {
                assert_eq!(&r.encode()[..], &jb.payload[off..off + n]);
            }
        }
    }
    let Some((dev, sb, n)) = journal_fuzz_image(data) else {
        return;
    };
    let replay = crate::journal::replay(&dev, &sb).expect("a version 2 superblock");
    // Nothing but the blocks placed continues it.
    assert!(replay.continued <= n, "{} > {n}", replay.continued);
    let _ = crate::journal::Overlay::of(&replay.appends);
    fuzz_image(&dev.bytes);
    repair_round(&dev, None);
}

/// The image `fuzz_journal` makes of its input (see there), its superblock
/// and the number of ring blocks placed.
pub fn journal_fuzz_image(data: &[u8]) -> Option<(MemDev, Superblock, u64)> {
    let head = data.get(..JOURNAL_FUZZ_HEAD)?;
    let base = journal_fuzz_base();
    let mut sb = base.sb.clone();
    sb.journal_seq = if head[2] & 0x80 != 0 {
        u64::MAX - head[1] as u64
    } else {
        head[1] as u64
    };
    let mut spec = base;
    spec.sb = sb;
    let blocks = spec.sb.metadata_blocks;
    let mut dev = MemDev::new(blocks);
    let (mut sb, _) = crate::writer::write_image(&mut dev, &spec).ok()?;
    if head[2] & 0x40 != 0 {
        // The writer writes the bit clear, as the tools must; the kernel's
        // superblocks carry it.
        sb.flags |= SB_UNFLUSHED_APPENDS;
        *dev.block_mut(sb.slot()) = *sb.encode();
    }
    let n = (head[0] as u64).min(FUZZ_RUN.1);
    for (i, chunk) in data[JOURNAL_FUZZ_HEAD..]
        .chunks(BLOCK_SIZE)
        .take(n as usize)
        .enumerate()
    {
        let seq = sb.journal_seq.wrapping_add(i as u64);
        let at = sb.journal_block(seq);
        let b = dev.block_mut(at);
        b.fill(0);
        b[..chunk.len()].copy_from_slice(chunk);
        match chunk[0] & 3 {
            3 => {}
            2 => seal(b),
            _ => {
                let mut jb = JournalBlock::decode(b);
                jb.header.btype = BT_JOURNAL;
                jb.header.blocknr = at;
                jb.journal_id = sb.journal_id;
                jb.epoch = sb.journal_seq;
                jb.seq = seq;
                *b = *jb.encode();
            }
        }
    }
    Some((dev, sb, n))
}

/// Inputs of `fuzz_journal` that reach its replay with whole appends:
/// consistent changes of `journal_fuzz_base` (so that check finds the
/// result clean and dump + restore run), a torn tail, sequence numbers
/// that wrap around the ring and past 2^64, a malformed record.
pub fn journal_fuzz_seeds() -> Vec<Vec<u8>> {
    use crate::writer::{append_blocks, test_fingerprint, ImageSpec};
    let base = journal_fuzz_base();
    let step = |from: &ImageSpec, k: u64| {
        let mut maps = from.mappings.clone();
        maps.retain(|m| m.0 % 7 != k);
        maps.extend((0..5).map(|i| (1 + 2 * (i + 5 * k), 50 + (i + k) % 10)));
        maps.sort_unstable();
        maps.dedup_by_key(|m| m.0);
        let mut sb = from.sb.clone();
        sb.unique_writes += 5;
        ImageSpec::consistent(sb, &maps, test_fingerprint)
    };
    let s1 = step(&base, 1);
    let s2 = step(&s1, 2);
    let mut big = s2.clone();
    big.mappings = (0..300).map(|l| (l, l % 60)).collect();
    let big = ImageSpec::consistent(big.sb, &big.mappings, test_fingerprint);
    let input = |epoch: u8, down: bool, appends: &[Vec<Record>], torn: usize| {
        let mut sb = base.sb.clone();
        sb.journal_seq = if down {
            u64::MAX - epoch as u64
        } else {
            epoch as u64
        };
        let mut blocks = Vec::new();
        let mut seq = sb.journal_seq;
        for recs in appends {
            let b = append_blocks(&sb, seq, 4, recs);
            seq = seq.wrapping_add(b.len() as u64);
            blocks.extend(b);
        }
        for b in blocks.iter_mut().rev().take(torn) {
            b.flags = 0;
        }
        let mut v = vec![0u8; JOURNAL_FUZZ_HEAD];
        v[0] = blocks.len() as u8;
        v[1] = epoch;
        v[2] = if down { 0x80 } else { 0 };
        for b in blocks {
            let mut e = b.encode();
            e[0] = 0; // "make it continue": the harness seals it
            v.extend_from_slice(&e[..]);
        }
        v
    };
    let a1 = base.changes_to(&s1);
    let a2 = s1.changes_to(&s2);
    let a3 = s2.changes_to(&big);
    let mut bad = a2.clone();
    bad.insert(0, Record::Map { lba: 7, value: 61 });
    vec![
        input(1, false, &[], 0),
        input(1, false, &[a1.clone(), a2.clone()], 0),
        input(1, false, &[a1.clone(), a2.clone(), a3.clone()], 1),
        input(14, false, &[a1.clone(), a2.clone(), a3], 0),
        input(1, true, &[a1.clone(), a2], 0),
        input(3, false, &[a1, bad], 0),
    ]
}

/// `not_continuing` against a superblock the block names itself.
fn not_continuing_any(b: &Block) -> Option<String> {
    let jb = JournalBlock::decode(b);
    let mut sb = Superblock::new_formatted(JOURNAL_BLOCKS + 100, 60, 300, "sha256", 32, 1);
    sb.journal_start = FUZZ_RUN.0;
    sb.journal_blocks = FUZZ_RUN.1;
    sb.journal_id = jb.journal_id;
    sb.journal_seq = jb.epoch;
    crate::journal::not_continuing(&sb, b, jb.seq)
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
    // What repair writes has an empty journal.
    if let Some(j) = report.journal.as_ref() {
        assert_eq!(j.blocks_in_epoch, 0, "{j:?}");
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds reach what they are for.
    #[test]
    fn journal_seeds_replay_as_intended() {
        let seeds = journal_fuzz_seeds();
        let opts = CheckOptions::default();
        let mut seen = Vec::new();
        for s in &seeds {
            let (dev, sb, _) = journal_fuzz_image(s).unwrap();
            let (r, _) = check(&dev, &opts).unwrap();
            let j = r.journal.clone().unwrap();
            seen.push((
                r.clean(),
                j.appends,
                j.torn_blocks,
                j.damage.is_some(),
                sb.journal_seq,
            ));
        }
        assert_eq!(
            seen,
            [
                (true, 0, 0, false, 1),
                (true, 2, 0, false, 1),
                (true, 2, 2, false, 1),
                (true, 3, 0, false, 14),
                (true, 2, 0, false, u64::MAX - 1),
                (false, 1, 0, true, 3),
            ]
        );
        // The wrapping one crosses the ring's end.
        let (_, sb, n) = journal_fuzz_image(&seeds[3]).unwrap();
        assert!(sb.journal_seq % 16 + n > 16, "{n}");
    }

    #[test]
    fn compact_images_are_expanded() {
        let mut d = MemDev::new(JOURNAL_BLOCKS + 10);
        crate::writer::format(&mut d, 10, 10, "sha256", 32, 1).unwrap();
        let short = &d.bytes[..3 * BLOCK_SIZE];
        assert_eq!(expand_image(short), d.bytes);
        assert_eq!(expand_image(&d.bytes[..100]), &d.bytes[..100]);
        let garbage = vec![7u8; 3 * BLOCK_SIZE];
        assert_eq!(expand_image(&garbage), garbage);
    }
}
