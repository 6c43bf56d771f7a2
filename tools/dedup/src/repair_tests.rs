//! Tests of repair: images built by the writer, damaged, repaired, then
//! checked; every mapping that was salvageable must still be there with
//! the same physical block.

use super::*;
use crate::check::{check, Report};
use crate::device::MemDev;
use crate::fingerprint::Hasher;
use crate::writer::{write_image, Layout};

const LOGICAL: u64 = 2000; // map: 4 leaves, height 1
const DATA: u64 = 300; // refcounts: 1 leaf (the root); fingerprints: 3 leaves, height 1

/// Content of data block `pba` in the test data device.
fn content(pba: u64) -> Box<Block> {
    let mut b = zero_block();
    for (i, chunk) in b.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&(pba * 1_000_003 + i as u64 + 1).to_le_bytes());
    }
    b
}

fn data_dev() -> MemDev {
    let mut d = MemDev::new(DATA);
    for p in 0..DATA {
        d.write_block(p, &content(p)).unwrap();
    }
    d
}

fn fp_of(pba: u64) -> [u8; FP_SIZE] {
    Hasher::Sha256.record(&content(pba)[..])
}

/// LBA i + 300 -> PBA i % 250 for i < 1200: 3 map leaves, refcount 4 or 5.
fn sample_mappings() -> Vec<(u64, u64)> {
    (0..1200u64).map(|i| (i + 300, i % 250)).collect()
}

fn spec_with(mappings: &[(u64, u64)], hash: &str, fp_size: u32) -> ImageSpec {
    let blocks = required_blocks(LOGICAL, DATA) + 8;
    let mut sb = Superblock::new_formatted(blocks, DATA, LOGICAL, hash, fp_size, 1_700_000_000);
    sb.header.txn = 5;
    sb.unique_writes = 250;
    sb.duplicate_writes = 950;
    let h = Hasher::from_name(hash).unwrap();
    ImageSpec::consistent(sb, mappings, |p| h.record(&content(p)[..]))
}

fn build(spec: &ImageSpec) -> (MemDev, Layout) {
    let mut d = MemDev::new(spec.sb.metadata_blocks);
    let (_, layout) = write_image(&mut d, spec).unwrap();
    (d, layout)
}

fn sample() -> (MemDev, Layout, ImageSpec) {
    let spec = spec_with(&sample_mappings(), "sha256", 32);
    let (d, l) = build(&spec);
    (d, l, spec)
}

fn run_check(d: &MemDev) -> (Report, check::Contents) {
    let opts = CheckOptions {
        collect: true,
        ..CheckOptions::default()
    };
    let (r, c) = check(d, &opts).unwrap();
    (r, c.unwrap())
}

fn child(d: &MemDev, nr: u64, slot: usize) -> u64 {
    le64(&d.block(nr)[..], HEADER_SIZE + slot * 8)
}

fn flip(d: &mut MemDev, nr: u64, off: usize) {
    d.block_mut(nr)[off] ^= 0x10;
}

fn set_sealed(d: &mut MemDev, nr: u64, off: usize, bytes: &[u8]) {
    d.block_mut(nr)[off..off + bytes.len()].copy_from_slice(bytes);
    seal(d.block_mut(nr));
}

/// Plan, write, check: the result must be clean; returns the plan and
/// what check then reads.
fn repair_ok(d: &mut MemDev, data: Option<&MemDev>) -> (Plan, check::Contents, Report) {
    let p = plan(d, data.map(|x| x as &(dyn BlockDev + Sync))).unwrap();
    let report = write(d, &p).unwrap();
    assert!(report.clean(), "{:#?}", report.problems);
    let (r, c) = run_check(d);
    assert!(r.clean());
    (p, c, report)
}

fn codes(p: &Plan) -> Vec<&'static str> {
    p.changes.iter().map(|c| c.code).collect()
}

fn messages(p: &Plan) -> String {
    p.changes
        .iter()
        .map(|c| c.message.as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every expected mapping is present, with the same physical block, and
/// nothing else is mapped.
fn assert_mappings(c: &check::Contents, expect: impl Iterator<Item = (u64, u64)>) {
    let want: Vec<(u64, u64)> = expect.collect();
    assert_eq!(c.mappings, want);
}

#[test]
fn clean_image_rewrites_to_the_same_content() {
    let (mut d, _, spec) = sample();
    let before = d.clone();
    let (p, c, _) = repair_ok(&mut d, None);
    assert_eq!(p.changed(), 0, "{}", messages(&p));
    assert_eq!(c.mappings, spec.mappings);
    let s = &p.summary;
    assert_eq!((s.generation_before, s.slot_before), (5, 1));
    assert_eq!((s.generation_after, s.slot_after), (6, 0));
    assert_eq!((s.mapped_after, s.live_after), (1200, 250));
    assert_eq!(s.fingerprints_kept, 250);
    // The old state is untouched: slot 1 and every block it uses.
    for b in 1..d.nr_blocks() {
        if b == 1 || p.in_use.get(b as usize) == Some(&true) {
            assert_eq!(d.block(b), before.block(b), "block {b}");
        }
    }
    let sb = Superblock::decode(d.block(0));
    assert_eq!(sb.generation(), 6);
    assert_eq!(
        (sb.unique_writes, sb.duplicate_writes, sb.format_time),
        (250, 950, 1_700_000_000)
    );
    // Repairing again changes nothing either.
    let (p2, c2, _) = repair_ok(&mut d, None);
    assert_eq!(p2.changed(), 0);
    assert_eq!(p2.summary.generation_after, 7);
    assert_eq!(c2, c);
}

#[test]
fn bad_checksum_on_a_map_leaf() {
    let (mut d, l, _) = sample();
    let leaf1 = child(&d, l.map_root, 1); // LBAs 508..1016
    flip(&mut d, leaf1, 1000);
    assert!(!run_check(&d).0.clean());
    let (p, c, _) = repair_ok(&mut d, None);
    let lost = p.changes.iter().find(|c| c.code == "map_lost").unwrap();
    assert_eq!(
        (lost.first, lost.last, lost.count),
        (Some(508), Some(1015), 508)
    );
    assert!(
        lost.message.starts_with(&format!(
            "map: logical blocks 508-1015 lost (map leaf at metadata block {leaf1}: checksum mismatch"
        )),
        "{}",
        lost.message
    );
    assert_mappings(
        &c,
        sample_mappings()
            .into_iter()
            .filter(|m| !(508..1016).contains(&m.0)),
    );
    // LBAs 508..1016 held i = 208..716: each PBA lost 2 or 3 references.
    assert!(p.summary.refcounts_changed > 0);
    assert!(messages(&p).contains("refcount"), "{}", messages(&p));
    assert_eq!(p.summary.mapped_after, 1200 - 508);
    assert!(messages(&p).contains("superblock: mapped_blocks 1200 -> 692"));
    // Every block still has a reference: used_data_blocks unchanged.
    assert_eq!(p.summary.live_after, 250);
}

#[test]
fn refcount_changes_are_listed_block_by_block() {
    let (mut d, l, _) = sample();
    // PBA 12: 1200 entries over 250 blocks -> refcount 5 for PBA < 200.
    set_sealed(
        &mut d,
        l.refcount_root,
        HEADER_SIZE + 12 * 4,
        &3u32.to_le_bytes(),
    );
    set_sealed(
        &mut d,
        l.refcount_root,
        HEADER_SIZE + 40 * 4,
        &0u32.to_le_bytes(),
    );
    set_sealed(
        &mut d,
        l.refcount_root,
        HEADER_SIZE + 41 * 4,
        &0u32.to_le_bytes(),
    );
    set_sealed(
        &mut d,
        l.refcount_root,
        HEADER_SIZE + 270 * 4,
        &9u32.to_le_bytes(),
    );
    let (p, c, _) = repair_ok(&mut d, None);
    let m = messages(&p);
    assert!(m.contains("refcount of physical block 12: 3 -> 5"), "{m}");
    assert!(
        m.contains("refcounts 0 -> 5 of physical blocks 40-41 (2 blocks)"),
        "{m}"
    );
    assert!(m.contains("refcount of physical block 270: 9 -> 0"), "{m}");
    assert_eq!(p.summary.refcounts_changed, 4);
    assert_eq!(c.mappings, sample_mappings_sorted());
    // The refcount said free: the records of 40 and 41 are not trusted.
    assert_eq!(p.summary.placeholders, 2);
    assert!(m.contains("fingerprint of physical blocks 40-41 (2 blocks): lost (its refcount was 0"));
}

fn sample_mappings_sorted() -> Vec<(u64, u64)> {
    let mut v = sample_mappings();
    v.sort_unstable();
    v
}

#[test]
fn bad_checksum_on_the_refcount_leaf() {
    let (mut d, l, _) = sample();
    flip(&mut d, l.refcount_root, 77);
    let (p, c, _) = repair_ok(&mut d, None);
    assert_eq!(codes(&p), vec!["refcount_lost"], "{}", messages(&p));
    assert!(messages(&p).contains(
        "refcount: records of physical blocks 0-299 lost (refcount leaf at metadata block"
    ));
    assert!(messages(&p).contains("(250 of these blocks are live)"));
    assert_eq!(c.mappings, sample_mappings_sorted());
    // The map vouches for the records: kept, none replaced.
    assert_eq!(p.summary.fingerprints_kept, 250);
}

#[test]
fn bad_checksum_on_a_fingerprint_leaf_gives_placeholders() {
    let (mut d, l, _) = sample();
    let leaf1 = child(&d, l.fingerprint_root, 1); // PBAs 127..254
    flip(&mut d, leaf1, 2000);
    let (p, c, after) = repair_ok(&mut d, None);
    assert_eq!(c.mappings, sample_mappings_sorted());
    assert_eq!(p.summary.placeholders, 123); // PBAs 127..250
    let m = messages(&p);
    assert!(
        m.contains(&format!(
            "fingerprint of physical blocks 127-249 (123 blocks): lost (fingerprint leaf at metadata block {leaf1}: checksum mismatch"
        )),
        "{m}"
    );
    assert!(m.contains("placeholder record written"));
    for &(pba, _, fp) in c.blocks.iter().filter(|b| b.0 >= 127) {
        assert!(fingerprint::is_placeholder(pba, &fp, 32));
    }
    for &(pba, _, fp) in c.blocks.iter().filter(|b| b.0 < 127) {
        assert_eq!(fp, fp_of(pba));
    }
    // check says so, as a warning.
    assert!(after.has("placeholder_fingerprint"));
    assert_eq!(after.summary.unwrap().placeholder_fingerprints, 123);

    // A later repair with the data device recomputes them.
    let data = data_dev();
    let (p2, c2, after2) = repair_ok(&mut d, Some(&data));
    assert_eq!(p2.summary.fingerprints_replaced, 123);
    assert_eq!(p2.summary.fingerprints_verified, 127);
    for &(pba, _, fp) in &c2.blocks {
        assert_eq!(fp, fp_of(pba), "pba {pba}");
    }
    assert!(!after2.has("placeholder_fingerprint"));
    assert_eq!(c2.mappings, sample_mappings_sorted());
}

#[test]
fn lost_fingerprints_recomputed_with_data() {
    let (mut d, l, _) = sample();
    let leaf0 = child(&d, l.fingerprint_root, 0);
    flip(&mut d, leaf0, 50);
    // An intact record that disagrees with its data block.
    let leaf1 = child(&d, l.fingerprint_root, 1);
    set_sealed(
        &mut d,
        leaf1,
        HEADER_SIZE + (200 - 127) * FP_SIZE,
        &[0xAB; 32],
    );
    let data = data_dev();
    let (p, c, _) = repair_ok(&mut d, Some(&data));
    assert_eq!(p.summary.fingerprints_recomputed, 127);
    assert_eq!(p.summary.fingerprints_replaced, 1);
    assert_eq!(p.summary.placeholders, 0);
    for &(pba, _, fp) in &c.blocks {
        assert_eq!(fp, fp_of(pba), "pba {pba}");
    }
    let m = messages(&p);
    assert!(
        m.contains("fingerprint of physical blocks 0-126 (127 blocks): lost"),
        "{m}"
    );
    assert!(m.contains("recomputed from the data device"));
    // PBA 200 is read by LBAs 300 + 200, + 450, + 700, + 950.
    assert!(
        m.contains(
            "fingerprint of physical block 200: the record does not match the data, replaced"
        ),
        "{m}"
    );
    assert!(m.contains("check the content of logical blocks 500, 750, 1000, 1250 (4 blocks)"));
}

#[test]
fn unreadable_or_zero_data_blocks() {
    let (mut d, l, _) = sample();
    let leaf0 = child(&d, l.fingerprint_root, 0);
    flip(&mut d, leaf0, 50);
    let mut data = data_dev();
    data.block_mut(3).fill(0);
    // A data device one block short is refused as the wrong device.
    let short = MemDev::new(DATA - 1);
    let e = plan(&d, Some(&short)).unwrap_err();
    assert!(e.0.contains("wrong device"), "{e}");
    let (p, _, _) = repair_ok(&mut d, Some(&data));
    let m = messages(&p);
    assert!(m.contains("note: ") || p.changes.iter().any(|c| !c.changed));
    assert!(m.contains("data of physical block 3: all zeros"), "{m}");
    // The zero block's digest is still what the kernel would compute.
    assert_eq!(p.summary.fingerprints_recomputed, 127);
}

#[test]
fn map_entries_beyond_the_data_device_are_dropped() {
    let (mut d, l, _) = sample();
    let leaf0 = child(&d, l.map_root, 0);
    for (lba, v) in [
        (400u64, DATA + 5),
        (401, DATA + 6),
        (402, u64::MAX),
        (450, DATA + 1),
    ] {
        set_sealed(
            &mut d,
            leaf0,
            HEADER_SIZE + lba as usize * 8,
            &v.to_le_bytes(),
        );
    }
    let (p, c, _) = repair_ok(&mut d, None);
    let m = messages(&p);
    assert!(
        m.contains("map: logical blocks 400-402, 450 (4 blocks) dropped (the first points at physical block 304): beyond the data device (300 blocks)"),
        "{m}"
    );
    assert_eq!(
        codes(&p)
            .iter()
            .filter(|&&c| c == "map_beyond_data")
            .count(),
        1
    );
    assert_eq!(p.summary.mappings_dropped, 4);
    assert_mappings(
        &c,
        sample_mappings_sorted()
            .into_iter()
            .filter(|m| ![400, 401, 402, 450].contains(&m.0)),
    );
}

#[test]
fn block_claimed_twice_is_dropped_from_both_places() {
    let (mut d, l, _) = sample();
    // Child 2 of the map root points at leaf 1 as well: which one holds
    // LBAs 508..1016 and which 1016..1524 is unknowable.
    let leaf1 = child(&d, l.map_root, 1);
    set_sealed(&mut d, l.map_root, HEADER_SIZE + 16, &leaf1.to_le_bytes());
    let (p, c, _) = repair_ok(&mut d, None);
    let lost: Vec<_> = p
        .changes
        .iter()
        .filter(|c| c.code == "map_lost")
        .map(|c| (c.first.unwrap(), c.last.unwrap()))
        .collect();
    assert_eq!(lost, vec![(508, 1015), (1016, 1523)]);
    assert!(messages(&p).contains("2 places of the map tree at level 0 point at it"));
    assert_mappings(
        &c,
        sample_mappings_sorted().into_iter().filter(|m| m.0 < 508),
    );
    // The block stays reserved for the old state while the new one is written.
    assert!(p.in_use[leaf1 as usize]);
}

#[test]
fn blocks_of_a_later_transaction_are_not_trusted() {
    let (mut d, l, _) = sample();
    let leaf2 = child(&d, l.map_root, 2);
    set_sealed(&mut d, leaf2, 16, &6u64.to_le_bytes());
    let (p, c, _) = repair_ok(&mut d, None);
    assert!(messages(&p).contains("written by transaction 6, not by one of 1..=5"));
    assert_mappings(
        &c,
        sample_mappings_sorted().into_iter().filter(|m| m.0 < 1016),
    );
}

#[test]
fn oddities_are_cleaned_and_reported() {
    let (mut d, l, _) = sample();
    let leaf = child(&d, l.map_root, 3); // absent: LBAs past 1524 unmapped
    assert_eq!(leaf, 0);
    // A child pointer past the array's end, reserved bits, leaf tail.
    set_sealed(
        &mut d,
        l.map_root,
        HEADER_SIZE + 8 * 100,
        &3u64.to_le_bytes(),
    );
    set_sealed(&mut d, l.refcount_root, 28, &1u32.to_le_bytes());
    let (p, c, _) = repair_ok(&mut d, None);
    let m = messages(&p);
    assert!(
        m.contains("child 100 (block 3) lies beyond the end of the array"),
        "{m}"
    );
    assert!(m.contains("reserved header fields"), "{m}");
    assert_eq!(c.mappings, sample_mappings_sorted());
}

#[test]
fn stale_fingerprints_are_dropped() {
    let (mut d, l, _) = sample();
    let leaf1 = child(&d, l.fingerprint_root, 1);
    // PBA 251 is free (refcount 0) but has a record.
    set_sealed(&mut d, leaf1, HEADER_SIZE + (251 - 127) * FP_SIZE, &[7; 32]);
    assert!(run_check(&d).0.clean());
    let (p, _, _) = repair_ok(&mut d, None);
    assert_eq!(codes(&p), vec!["stale_dropped"]);
    assert!(messages(&p).contains("fingerprint: 1 record of free physical blocks dropped"));
}

#[test]
fn damaged_newest_slot_falls_back_and_is_replaced() {
    let (mut d, _, spec) = sample();
    // Generation 6 in slot 0 with the same roots, then torn.
    let mut sb = Superblock::decode(d.block(1));
    sb.header.txn = 6;
    *d.block_mut(0) = *sb.encode();
    flip(&mut d, 0, 300);
    let r = run_check(&d).0;
    assert!(r.clean() && r.has("other_slot_bad"));
    let (p, c, _) = repair_ok(&mut d, None);
    assert_eq!(p.summary.slot_before, 1);
    assert_eq!((p.summary.generation_after, p.summary.slot_after), (6, 0));
    assert!(messages(&p).contains("superblock: slot 0 is damaged (checksum mismatch"));
    assert!(messages(&p).contains("the repaired superblock replaces it"));
    assert_eq!(c.mappings, spec.mappings);
}

#[test]
fn newest_slot_with_impossible_fields_is_skipped() {
    let (mut d, _, spec) = sample();
    let mut sb = Superblock::decode(d.block(1));
    sb.header.txn = 6;
    sb.block_size = 8192;
    *d.block_mut(0) = *sb.encode();
    let (p, c, _) = repair_ok(&mut d, None);
    assert_eq!(p.summary.source, "fallback");
    assert_eq!(p.summary.slot_before, 1);
    // Newer than 6, and not in slot 1, which holds the starting state.
    assert_eq!((p.summary.generation_after, p.summary.slot_after), (8, 0));
    assert!(
        messages(&p).contains(
            "the newest valid slot, 0, cannot be used: slot 0 (generation 6): block_size is 8192"
        ),
        "{}",
        messages(&p)
    );
    assert_eq!(c.mappings, spec.mappings);
}

#[test]
fn newest_slot_above_the_txn_limit_is_skipped_and_replaced() {
    let (mut d, _, spec) = sample();
    // Slot 0: the same state, sealed, with a generation past DD_MAX_TXN.
    let mut sb = Superblock::decode(d.block(1));
    sb.header.txn = MAX_TXN + 1;
    *d.block_mut(0) = *sb.encode();
    let r = run_check(&d).0;
    assert_eq!(r.superblock.as_ref().unwrap().slot, 0);
    assert!(r.has("txn_too_large"));
    let (p, c, _) = repair_ok(&mut d, None);
    assert_eq!(p.summary.source, "fallback");
    assert_eq!((p.summary.slot_before, p.summary.generation_before), (1, 5));
    // Newer than the usable slot, and written over the one above the limit.
    assert_eq!((p.summary.generation_after, p.summary.slot_after), (6, 0));
    assert!(
        messages(&p).contains(
            "the newest valid slot, 0, cannot be used: slot 0 (generation 18446744069414584320): \
             generation 18446744069414584320 is above 18446744069414584319"
        ),
        "{}",
        messages(&p)
    );
    assert_eq!(Superblock::decode(d.block(0)).generation(), 6);
    assert_eq!(c.mappings, spec.mappings);
}

#[test]
fn only_slot_above_the_txn_limit_is_refused() {
    let (mut d, _, _) = sample();
    let mut sb = Superblock::decode(d.block(1));
    sb.header.txn = u64::MAX; // odd: stays in slot 1; slot 0 is zero
    *d.block_mut(1) = *sb.encode();
    assert!(run_check(&d).0.has("txn_too_large"));
    let e = plan(&d, None).unwrap_err();
    assert!(e.0.contains("no usable superblock"), "{e}");
    assert!(e.0.contains(&format!("is above {MAX_TXN}")), "{e}");
    assert!(
        e.0.contains("dedup restore --force --generation N FILE DEV"),
        "{e}"
    );
}

#[test]
fn repaired_generation_never_passes_the_txn_limit() {
    // One below the limit: the repaired superblock is exactly at it.
    let mut spec = spec_with(&sample_mappings(), "sha256", 32);
    spec.sb.header.txn = MAX_TXN - 1;
    let (mut d, _) = build(&spec);
    // The fuzz property (plan, write, plan again) holds here too.
    crate::fuzzing::fuzz_repair(&d.bytes);
    let (p, c, _) = repair_ok(&mut d, None);
    assert_eq!(
        (p.summary.generation_after, p.summary.slot_after),
        (MAX_TXN, 1)
    );
    assert_eq!(c.mappings, spec.mappings);

    // At the limit: the next generation would be refused by the kernel.
    let e = plan(&d, None).unwrap_err();
    assert!(
        e.0.contains(&format!(
            "generation {MAX_TXN} cannot be advanced: the repaired superblock would be generation {}",
            MAX_TXN + 1
        )),
        "{e}"
    );
}

#[test]
fn only_slot_damaged_is_salvaged_when_its_roots_check_out() {
    let (mut d, _, spec) = sample();
    flip(&mut d, 1, 170); // zero_writes: the fields that matter are intact
    let r = check(&d, &CheckOptions::default()).unwrap().0;
    assert!(r.has("no_valid_superblock"));
    let (p, c, _) = repair_ok(&mut d, None);
    assert_eq!(p.summary.source, "damaged");
    assert_eq!((p.summary.generation_after, p.summary.slot_after), (6, 0));
    assert!(messages(&p).contains("no slot is valid; slot 1 is damaged"));
    assert_eq!(c.mappings, spec.mappings);

    // A damaged slot whose root pointers are wrong is not trusted.
    let (mut d, l, _) = sample();
    let mut b = *d.block(1);
    b[112..120].copy_from_slice(&(l.map_root - 1).to_le_bytes());
    b[0] ^= 1;
    *d.block_mut(1) = b;
    let e = plan(&d, None).unwrap_err();
    assert!(e.0.contains("its roots do not lead to intact trees"), "{e}");
}

#[test]
fn refusals_are_one_line() {
    // Garbage, zeros, a data device, a truncated image, too small.
    let data = data_dev();
    let e = plan(&data, None).unwrap_err();
    assert!(e.0.contains("neither slot holds dm-dedup metadata"), "{e}");
    let e = plan(&MemDev::new(8), None).unwrap_err();
    assert!(e.0.contains("neither slot"), "{e}");
    let e = plan(&MemDev::new(1), None).unwrap_err();
    assert!(e.0.contains("too small"), "{e}");
    let (d, _, _) = sample();
    let mut t = d.clone();
    t.bytes.truncate(t.bytes.len() - 3 * BLOCK_SIZE);
    let e = plan(&t, None).unwrap_err();
    assert!(e.0.contains("truncated"), "{e}");
    assert!(!e.0.contains('\n'));
    // --data with a hash this tool cannot compute.
    let mut spec = spec_with(&sample_mappings(), "sha256", 32);
    spec.sb.hash_name = [0; HASH_NAME_LEN];
    spec.sb.hash_name[..3].copy_from_slice(b"sm3");
    let (d, _) = build(&spec);
    let e = plan(&d, Some(&data)).unwrap_err();
    assert!(e.0.contains("'sm3' cannot be computed"), "{e}");
    assert!(plan(&d, None).is_ok());
}

#[test]
fn short_digest_placeholders() {
    let spec = spec_with(&sample_mappings(), "xxhash64", 8);
    let (mut d, l) = build(&spec);
    let leaf0 = child(&d, l.fingerprint_root, 0);
    flip(&mut d, leaf0, 50);
    let (p, c, after) = repair_ok(&mut d, None);
    assert_eq!(p.summary.placeholders, 127);
    assert!(after.problems.iter().all(|p| p.code != "fingerprint_tail"));
    assert_eq!(c.mappings, spec.mappings);
    // and with the data: the real xxhash64 digests
    let data = data_dev();
    let (p, c, _) = repair_ok(&mut d, Some(&data));
    assert_eq!(p.summary.fingerprints_replaced, 127);
    for &(pba, _, fp) in &c.blocks {
        assert_eq!(fp, Hasher::Xxhash64.record(&content(pba)[..]));
    }
}

#[test]
fn dropping_everything_still_writes_a_valid_state() {
    let (mut d, l, _) = sample();
    flip(&mut d, l.map_root, 40);
    let (p, c, _) = repair_ok(&mut d, None);
    assert!(c.mappings.is_empty() && c.blocks.is_empty());
    assert_eq!(p.summary.logical_blocks_in_lost_ranges, LOGICAL);
    let m = messages(&p);
    assert!(
        m.contains("refcounts 5 -> 0 of physical blocks 0-199 (200 blocks)"),
        "{m}"
    );
    assert!(
        m.contains("refcounts 4 -> 0 of physical blocks 200-249 (50 blocks)"),
        "{m}"
    );
}

#[test]
fn an_unreadable_journal_block_is_a_loss_not_a_torn_tail() {
    // A whole append, then the blocks of another, whose last block cannot
    // be read.
    let mut j = Journaled::new(None);
    j.append(grow);
    let recs = j.last().changes_to(&j.next_state(shrink));
    let blocks = j.blocks_of(&recs);
    for b in &blocks {
        j.dev.write_block(b.header.blocknr, &b.encode()).unwrap();
    }
    let bad = blocks.last().unwrap().header.blocknr;
    let d = crate::check::tests::BadSector {
        inner: j.dev.clone(),
        bad,
    };
    let p = plan(&d, None).unwrap();
    assert!(p.changed() > 0, "{:#?}", messages(&p));
    assert_eq!(codes(&p), ["journal_replayed", "journal_unreadable"]);
    let m = messages(&p);
    assert!(m.contains("cannot be read: injected read error"), "{m}");
    assert!(m.contains("may have been acknowledged"), "{m}");
    assert!(!m.contains("never acknowledged"), "{m}");
}

/// A device that fails every write after the first `left`.
struct Failing {
    inner: MemDev,
    left: usize,
}

impl BlockDev for Failing {
    fn nr_blocks(&self) -> u64 {
        self.inner.nr_blocks()
    }
    fn read_block(&self, nr: u64, buf: &mut Block) -> std::io::Result<()> {
        self.inner.read_block(nr, buf)
    }
    fn write_block(&mut self, nr: u64, buf: &Block) -> std::io::Result<()> {
        if self.left == 0 {
            return Err(std::io::Error::other("injected failure"));
        }
        self.left -= 1;
        self.inner.write_block(nr, buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn interrupted_repair_leaves_the_device_as_it_was() {
    let (mut d, l, _) = sample();
    let leaf1 = child(&d, l.map_root, 1);
    flip(&mut d, leaf1, 1000);
    let before = run_check(&d);
    let p = plan(&d, None).unwrap();
    for left in [0, 1, 5] {
        let mut f = Failing {
            inner: d.clone(),
            left,
        };
        let e = write(&mut f, &p).unwrap_err();
        assert!(e.contains("opens as before"), "{e}");
        let after = run_check(&f.inner);
        assert_eq!(after.0.problems, before.0.problems);
        assert_eq!(after.1, before.1);
    }
}

#[test]
fn render_lists_every_change() {
    let (mut d, l, _) = sample();
    let leaf1 = child(&d, l.map_root, 1);
    flip(&mut d, leaf1, 1000);
    let p = plan(&d, None).unwrap();
    let text = render(&p, "meta.img", true);
    assert!(text.starts_with("repairing meta.img: starting from superblock slot 1 (generation 5)"));
    for c in &p.changes {
        assert!(text.contains(&c.message));
    }
    assert!(text.contains("would write generation 6 to superblock slot 0"));
    let v = serde_json::to_value(&p.changes).unwrap();
    assert_eq!(v[0]["code"], "map_lost");
    assert_eq!(v[0]["first"], 508);
}

/// Repair writes a superblock the kernel loads read-write: needs_check and
/// bits the kernel does not know are cleared, each said as a change.
#[test]
fn flags_are_cleared() {
    let mut spec = spec_with(&sample_mappings(), "sha256", 32);
    spec.sb.flags = SB_NEEDS_CHECK | 0x4;
    let (mut d, _) = build(&spec);
    let (r, _) = run_check(&d);
    assert!(!r.clean() && r.has("needs_check"), "{:#?}", r.problems);
    let (p, c, _) = repair_ok(&mut d, None);
    let cs = codes(&p);
    assert!(
        cs.contains(&"needs_check") && cs.contains(&"unknown_flags"),
        "{cs:?}"
    );
    assert!(messages(&p).contains("unknown flags 0x4 cleared"));
    assert_mappings(&c, sample_mappings().into_iter());
    let (r, _) = run_check(&d);
    assert_eq!(r.superblock.unwrap().flags, 0);
    // UNFLUSHED_APPENDS is known: written clear (the new journal is
    // empty), and not a change.
    let (mut d, _, _) = sample();
    let mut sb = Superblock::decode(d.block(1));
    sb.flags = SB_UNFLUSHED_APPENDS;
    *d.block_mut(1) = *sb.encode();
    let p = plan(&d, None).unwrap();
    assert_eq!(p.changed(), 0, "{}", messages(&p));
    assert_eq!(p.spec.sb.flags, 0);
    write(&mut d, &p).unwrap();
    let (r, _) = run_check(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(r.superblock.unwrap().flags, 0);
}

// ---------------------------------------------------------------------
// Format version 2: the journal.

use crate::journal::tests::{contents_of, data_device, grow, shrink, Journaled};

#[test]
fn repair_replays_the_journal_into_the_trees() {
    let mut j = Journaled::new(None);
    j.append(grow);
    j.append(shrink);
    let before = j.sb.clone();
    let p = plan(&j.dev, None).unwrap();
    // Replaying changes nothing of the state: a note, not a change.
    assert_eq!(p.changed(), 0, "{}", messages(&p));
    assert_eq!(codes(&p), ["journal_replayed"]);
    assert!(
        messages(&p).contains("journal: 2 appends (2 blocks, sequence 1 to 2, "),
        "{}",
        messages(&p)
    );
    assert_eq!(p.summary.journal_appends_replayed, 2);
    assert_eq!(p.summary.mapped_before, j.last().sb.mapped_blocks);
    let (_, c, _) = repair_ok(&mut j.dev, None);
    assert_eq!(c, contents_of(j.last()));
    // The new superblock: same run and id, the epoch two rings on, its
    // counters the journal's, and nothing follows it.
    let (r, _) = run_check(&j.dev);
    let sbi = r.superblock.as_ref().unwrap();
    assert_eq!(sbi.generation, 6);
    assert_eq!(
        (sbi.journal_start, sbi.journal_blocks, sbi.journal_id),
        (
            before.journal_start,
            before.journal_blocks,
            before.journal_id
        )
    );
    assert_eq!(sbi.journal_seq, 1 + 2 * before.journal_blocks);
    assert_eq!(sbi.unique_writes, j.last().sb.unique_writes);
    assert_eq!(r.journal.as_ref().unwrap().blocks_in_epoch, 0);
    // Again: nothing to do.
    let again = plan(&j.dev, None).unwrap();
    assert_eq!((again.changed(), again.changes.len()), (0, 0));
}

#[test]
fn repair_discards_a_damaged_journal_tail() {
    let mut j = Journaled::new(None);
    j.append(grow);
    let a2 = j.append(shrink);
    let a3 = j.append(|m| m.push((1999, 299)));
    // The second append's record at offset 16 of an unknown type.
    j.edit(a2, |b| b.payload[16 + 7] = 0x7f);
    let (r, _) = run_check(&j.dev);
    assert_eq!(r.errors, 1);
    let p = plan(&j.dev, None).unwrap();
    assert_eq!(
        codes(&p),
        ["journal_replayed", "journal_damaged"],
        "{}",
        messages(&p)
    );
    let ch = p
        .changes
        .iter()
        .find(|c| c.code == "journal_damaged")
        .unwrap();
    assert!(ch.changed);
    assert_eq!((ch.first, ch.last, ch.count), (Some(a2), Some(a3), 2));
    let recs3 = j.states[2].changes_to(&j.states[3]).len();
    assert!(
        ch.message.contains(&format!(
            "journal: block {} (sequence {a2}, record at offset 16) is damaged: unknown record \
             type 127; dropped from the append that starts at sequence {a2} on: 2 blocks \
             (sequence {a2} to {a3}, {} records that still read, 2 blocks with END); the state \
             is the one after sequence 1",
            j.sb.journal_block(a2),
            1 + recs3
        )),
        "{}",
        ch.message
    );
    assert_eq!(p.summary.journal_blocks_dropped, 2);
    assert_eq!(p.summary.journal_appends_replayed, 1);
    let (_, c, _) = repair_ok(&mut j.dev, None);
    assert_eq!(c, contents_of(&j.states[1]));
    assert_eq!(plan(&j.dev, None).unwrap().changed(), 0);

    // An append without its final COUNTERS record: dropped from there.
    let mut k = Journaled::new(None);
    k.append(grow);
    let recs = k.last().changes_to(&k.next_state(shrink));
    k.append_records(&recs[..recs.len() - 1]);
    let p = plan(&k.dev, None).unwrap();
    assert!(
        messages(&p).contains("an append that does not end with its counters"),
        "{}",
        messages(&p)
    );
    let (_, c, _) = repair_ok(&mut k.dev, None);
    assert_eq!(c, contents_of(&k.states[1]));
}

#[test]
fn repair_keeps_a_torn_tail_out_and_says_so() {
    let mut j = Journaled::new(None);
    j.append(grow);
    let recs = j.last().changes_to(&j.next_state(shrink));
    let mut b = j.blocks_of(&recs).remove(0);
    b.flags = 0;
    j.dev.write_block(b.header.blocknr, &b.encode()).unwrap();
    let p = plan(&j.dev, None).unwrap();
    assert_eq!(p.changed(), 0);
    assert_eq!(codes(&p), ["journal_replayed", "journal_torn"]);
    assert!(messages(&p).contains("journal: 1 block from sequence 2 after the last END ignored"));
    let (_, c, _) = repair_ok(&mut j.dev, None);
    assert_eq!(c, contents_of(&j.states[1]));
}

#[test]
fn repair_makes_a_new_run_when_the_old_one_cannot_be_used() {
    // The run over the trees (the kernel refuses it), and impossible
    // journal fields.
    for (f, code_why) in [
        (
            (|sb: &mut Superblock| sb.journal_start = 2) as fn(&mut Superblock),
            "shares blocks with the trees",
        ),
        (|sb| sb.journal_id = 0, "the journal id is 0"),
        (|sb| sb.journal_blocks = 3, "fewer than 16"),
    ] {
        let (mut d, l, spec) = sample();
        let mut sb = Superblock::decode(d.block(1));
        f(&mut sb);
        *d.block_mut(1) = *sb.encode();
        let (r, _) = run_check(&d);
        assert!(!r.clean());
        let p = plan(&d, None).unwrap();
        assert!(codes(&p).contains(&"journal_run"), "{}", messages(&p));
        assert!(messages(&p).contains(code_why), "{}", messages(&p));
        let (_, c, _) = repair_ok(&mut d, None);
        assert_mappings(&c, spec.mappings.iter().copied());
        let (r, _) = run_check(&d);
        let sbi = r.superblock.unwrap();
        // As long as the sizes ask for (the device has 8 blocks more).
        assert_eq!(
            (sbi.version, sbi.journal_blocks),
            (2, journal_size(LOGICAL, DATA))
        );
        assert_ne!(sbi.journal_id, 0);
        // After the new trees, which avoid the old ones.
        assert!(sbi.journal_start > 2 + l.tree_blocks);
        assert_eq!(plan(&d, None).unwrap().changed(), 0);
    }
}

#[test]
fn repair_of_a_version_1_device_keeps_version_1() {
    let mut spec = spec_with(&sample_mappings(), "sha256", 32);
    spec.sb.version = FORMAT_VERSION_V1;
    let (mut d, l) = build(&spec);
    assert_eq!(l.journal_blocks, 0);
    let leaf1 = child(&d, l.map_root, 1);
    flip(&mut d, leaf1, 1000);
    let (_, _, _) = repair_ok(&mut d, None);
    let (r, _) = run_check(&d);
    let sbi = r.superblock.unwrap();
    assert_eq!((sbi.version, sbi.journal_blocks, sbi.journal_id), (1, 0, 0));
    // Journal fields on a version 1 superblock are cleared.
    let (mut d, _) = build(&spec);
    let mut sb = Superblock::decode(d.block(1));
    sb.journal_seq = 9;
    *d.block_mut(1) = *sb.encode();
    let p = plan(&d, None).unwrap();
    assert!(messages(&p).contains("version 1 has no journal"));
    repair_ok(&mut d, None);
    let (r, _) = run_check(&d);
    assert_eq!(r.superblock.unwrap().journal_seq, 0);
}

#[test]
fn an_interrupted_repair_leaves_the_journal_too() {
    let mut j = Journaled::new(None);
    j.append(grow);
    let a2 = j.append(shrink);
    j.edit(a2, |b| b.used = 4040);
    let before = run_check(&j.dev);
    let p = plan(&j.dev, None).unwrap();
    // Up to the last tree block: the superblock write fails.
    let trees = crate::writer::spec_tree_blocks(&p.spec) as usize;
    for left in [0, 1, 5, trees] {
        let mut f = Failing {
            inner: j.dev.clone(),
            left,
        };
        assert!(write(&mut f, &p).is_err());
        let after = run_check(&f.inner);
        assert_eq!(after.0.problems, before.0.problems);
        assert_eq!(after.1, before.1);
    }
}

#[test]
fn a_new_epoch_that_a_stale_block_would_continue_moves_on() {
    // The block at epoch 1 + 2 * 16 already carries that epoch (a kernel
    // ran from it once): the repaired superblock must not replay it.
    let mut j = Journaled::new(Some((70, 16, 1)));
    let mut later = j.sb.clone();
    later.journal_seq = 33;
    let stale = crate::writer::append_blocks(
        &later,
        33,
        9,
        &[
            Record::Map { lba: 7, value: 3 },
            Record::Counters(Counters::default()),
        ],
    );
    j.dev
        .write_block(stale[0].header.blocknr, &stale[0].encode())
        .unwrap();
    let (_, c, _) = repair_ok(&mut j.dev, None);
    assert_eq!(c, contents_of(&j.states[0]));
    let (r, _) = run_check(&j.dev);
    assert_eq!(r.superblock.unwrap().journal_seq, 1 + 4 * 16);
}

#[test]
fn damage_in_the_first_append_leaves_the_superblocks_state() {
    let mut j = Journaled::new(None);
    j.append(grow);
    j.append(shrink);
    j.edit(1, |b| b.used = 12);
    let p = plan(&j.dev, None).unwrap();
    assert_eq!(codes(&p), ["journal_damaged"], "{}", messages(&p));
    assert!(
        messages(&p).contains("the state is the superblock's, no append is replayed"),
        "{}",
        messages(&p)
    );
    let (_, c, _) = repair_ok(&mut j.dev, None);
    assert_eq!(c, contents_of(&j.states[0]));
}

#[test]
fn repair_checks_an_unflushed_newest_append_with_data() {
    let setup = || {
        let mut j = Journaled::with_data();
        j.append(shrink);
        let a2 = j.append(grow);
        j.mark_unflushed(a2);
        (j, a2)
    };
    let note = |p: &Plan| {
        let c = p
            .changes
            .iter()
            .find(|c| c.code == "journal_unflushed")
            .unwrap_or_else(|| panic!("{}", messages(p)))
            .clone();
        assert!(!c.changed);
        c.message
    };
    // Without --data: refused (repair would make permanent an append the
    // kernel may drop).
    let (j, a2) = setup();
    let last = j.next_seq - 1;
    let Err(e) = plan(&j.dev, None) else {
        panic!("repair without --data was not refused");
    };
    assert!(
        e.0.contains(&format!("newest journal append (sequence {a2}..{last})"))
            && e.0.ends_with("give the data device with --data"),
        "{}",
        e.0
    );
    // With it, the data there: checked and applied.
    let (mut j, _) = setup();
    let data = data_device();
    let p = plan(&j.dev, Some(&data)).unwrap();
    assert!(note(&p).ends_with("unflushed: its data checked, applied"));
    assert_eq!(p.summary.journal_appends_replayed, 2);
    let (_, c, _) = repair_ok(&mut j.dev, Some(&data));
    assert_eq!(c, contents_of(&j.states[2]));
    // A block it makes live without its data: dropped, the state is the
    // one before it; the superblock written has the flag clear.
    let (mut j, _) = setup();
    let mut data = data_device();
    data.block_mut(253).fill(0xee);
    let p = plan(&j.dev, Some(&data)).unwrap();
    assert_eq!(p.changed(), 0, "{}", messages(&p));
    assert!(
        note(&p).ends_with(
            "data block 253 does not hold its fingerprint: dropped, as the kernel does (it was \
             never acknowledged)"
        ),
        "{}",
        messages(&p)
    );
    assert_eq!(p.summary.journal_appends_replayed, 1);
    assert_eq!(
        p.summary.journal_unflushed,
        Some(crate::journal::UnflushedOutcome::Dropped)
    );
    let (_, c, _) = repair_ok(&mut j.dev, Some(&data));
    assert_eq!(c, contents_of(&j.states[1]));
    let (r, _) = run_check(&j.dev);
    let sbi = r.superblock.unwrap();
    assert_eq!(sbi.flags, 0);
    assert_eq!(r.journal.unwrap().blocks_in_epoch, 0);
}
