//! Tests of the checker: images built by the writer, then damaged.

use super::*;
use crate::device::MemDev;
use crate::writer::{test_fingerprint, write_image, ImageSpec, Layout};

const LOGICAL: u64 = 2000; // map: 4 leaves, height 1
const DATA: u64 = 300; // refcounts: 1 leaf, height 0; fingerprints: 3 leaves, height 1

fn sb_for(logical: u64, data: u64, metadata_blocks: u64, gen: u64) -> Superblock {
    let mut sb =
        Superblock::new_formatted(metadata_blocks, data, logical, "sha256", 32, 1_700_000_000);
    sb.header.txn = gen;
    sb
}

/// 1200 mapped LBAs over 3 leaves onto 250 PBAs: LBA i -> PBA i % 250.
fn sample_mappings() -> Vec<(u64, u64)> {
    (0..1200u64).map(|i| (i + 300, i % 250)).collect()
}

fn build(spec: &ImageSpec) -> (MemDev, Layout) {
    let mut d = MemDev::new(spec.sb.metadata_blocks);
    let (_, layout) = write_image(&mut d, spec).unwrap();
    (d, layout)
}

fn sample_spec() -> ImageSpec {
    let blocks = required_blocks(LOGICAL, DATA) + 8;
    ImageSpec::consistent(
        sb_for(LOGICAL, DATA, blocks, 5),
        &sample_mappings(),
        test_fingerprint,
    )
}

fn sample() -> (MemDev, Layout) {
    build(&sample_spec())
}

fn run(d: &MemDev) -> Report {
    check(d, &CheckOptions::default()).unwrap().0
}

fn codes(r: &Report) -> Vec<&'static str> {
    r.problems.iter().map(|p| p.code).collect()
}

fn find<'a>(r: &'a Report, code: &str) -> &'a Problem {
    r.problems
        .iter()
        .find(|p| p.code == code)
        .unwrap_or_else(|| panic!("no {code} in {:#?}", r.problems))
}

fn reseal(d: &mut MemDev, nr: u64) {
    seal(d.block_mut(nr));
}

fn set64(d: &mut MemDev, nr: u64, off: usize, v: u64) {
    d.block_mut(nr)[off..off + 8].copy_from_slice(&v.to_le_bytes());
    reseal(d, nr);
}

/// Rewrite the superblock of the chosen slot through `f`.
fn edit_sb(d: &mut MemDev, f: impl FnOnce(&mut Superblock)) {
    let states = read_slots(d);
    let i = pick_superblock(&states).unwrap();
    let mut sb = Superblock::decode(d.block(i as u64));
    f(&mut sb);
    let b = sb.encode();
    *d.block_mut(sb.slot()) = *b;
}

fn child(d: &MemDev, nr: u64, slot: usize) -> u64 {
    le64(&d.block(nr)[..], HEADER_SIZE + slot * 8)
}

#[test]
fn clean_image() {
    let (d, layout) = sample();
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert!(r.clean());
    let s = r.summary.unwrap();
    assert_eq!(s.mapped_blocks, 1200);
    assert_eq!(s.live_blocks, 250);
    assert_eq!(s.refcount_sum, 1200);
    assert_eq!(s.fingerprinted_blocks, 250);
    assert!((s.dedup_ratio - 4.8).abs() < 1e-9);
    // map: LBAs 300..1500 -> leaves 0..2 plus a root; refcounts: one
    // leaf; fingerprints: PBAs 0..250 -> leaves 0,1 plus a root.
    assert_eq!(
        (s.map_blocks, s.refcount_blocks, s.fingerprint_blocks),
        (4, 1, 3)
    );
    // The journal's run follows the trees, as long as the sizes ask for:
    // the 8 blocks the device has beyond required_blocks stay free.
    assert_eq!(layout.journal_start, 2 + layout.tree_blocks);
    let jb = journal_size(LOGICAL, DATA);
    assert_eq!(jb, JOURNAL_MAKE_MIN);
    assert_eq!(s.metadata_blocks_total, required_blocks(LOGICAL, DATA) + 8);
    assert_eq!((s.journal_blocks, layout.journal_blocks), (jb, jb));
    assert_eq!(s.metadata_blocks_used, 2 + layout.tree_blocks + jb);
    let sb = r.superblock.unwrap();
    assert_eq!((sb.slot, sb.generation), (1, 5));
    assert_eq!(r.slots[0].state, "zero");
    assert_eq!(r.slots[1].state, "valid");
}

#[test]
fn clean_with_sparse_tables_and_contents() {
    let spec = sample_spec();
    let (d, _) = build(&spec);
    for limit in [0, 1 << 28] {
        let opts = CheckOptions {
            collect: true,
            dense_limit: Some(limit),
            ..CheckOptions::default()
        };
        let (r, c) = check(&d, &opts).unwrap();
        assert!(r.problems.is_empty(), "{:#?}", r.problems);
        let c = c.unwrap();
        assert_eq!(c.mappings, spec.mappings);
        let blocks: Vec<_> = spec
            .refcounts
            .iter()
            .zip(&spec.fingerprints)
            .map(|(&(p, rc), &(_, fp))| (p, rc, fp))
            .collect();
        assert_eq!(c.blocks, blocks);
    }
}

#[test]
fn formatted_empty_device_is_clean() {
    let mut d = MemDev::new(required_blocks(LOGICAL, DATA));
    crate::writer::format(&mut d, DATA, LOGICAL, "sha256", 32, 0).unwrap();
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    // The device has exactly the required size: the journal the sizes
    // ask for, the smallest one for sizes this small.
    assert_eq!(journal_size(LOGICAL, DATA), JOURNAL_MAKE_MIN);
    assert_eq!(
        r.summary.unwrap().metadata_blocks_used,
        2 + JOURNAL_MAKE_MIN
    );
    let j = r.journal.unwrap();
    assert_eq!((j.start, j.blocks, j.epoch), (2, JOURNAL_MAKE_MIN, 1));
    assert_eq!((j.blocks_in_epoch, j.appends), (0, 0));
}

#[test]
fn deep_tree_is_clean() {
    // 508 * 508 + 1 logical blocks: map height 2.
    let logical = 508 * 508 + 1;
    let data = 5000;
    let maps: Vec<(u64, u64)> = (0..3000u64).map(|i| (i * 86, i % 4999)).collect();
    let blocks = required_blocks(logical, data);
    let spec = ImageSpec::consistent(sb_for(logical, data, blocks, 9), &maps, test_fingerprint);
    let (d, _) = build(&spec);
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(r.summary.unwrap().mapped_blocks, 3000);
}

#[test]
fn bad_checksum_in_map_leaf() {
    let (mut d, layout) = sample();
    let leaf = child(&d, layout.map_root, 1);
    d.block_mut(leaf)[HEADER_SIZE + 7] ^= 0x40;
    let r = run(&d);
    assert!(!r.clean());
    let p = find(&r, "bad_checksum");
    assert_eq!(p.block, Some(leaf));
    assert_eq!(p.array, Some("map"));
    assert_eq!(p.level, Some(0));
    assert_eq!(p.index, Some(508));
    assert!(p.message.contains("checksum mismatch"), "{}", p.message);
    // Refcounts cannot be compared with a partial map: no cascade.
    assert!(!r.has("refcount_mismatch"));
    assert!(r.has("refcounts_unverified"));
    assert_eq!(r.errors, 1);
}

#[test]
fn zeroed_tree_block() {
    let (mut d, layout) = sample();
    d.block_mut(layout.refcount_root).fill(0);
    let r = run(&d);
    let p = find(&r, "bad_checksum");
    assert_eq!(p.block, Some(layout.refcount_root));
    assert!(p.message.contains("all zeros"));
    // Live blocks and fingerprints of an unreadable refcount leaf are not
    // reported one by one.
    assert!(!r.has("missing_fingerprint"));
    assert!(!r.has("refcount_mismatch"));
}

#[test]
fn wrong_blocknr() {
    let (mut d, layout) = sample();
    let leaf = child(&d, layout.fingerprint_root, 0);
    set64(&mut d, leaf, 8, leaf + 100);
    let r = run(&d);
    let p = find(&r, "wrong_blocknr");
    assert_eq!(p.block, Some(leaf));
    assert_eq!(p.array, Some("fingerprint"));
    assert!(p
        .message
        .contains(&format!("claims to be block {}", leaf + 100)));
}

#[test]
fn wrong_type_array_level() {
    let (mut d, layout) = sample();
    // The map root is an interior node at level 1; call it a leaf.
    d.block_mut(layout.map_root)[4..8].copy_from_slice(&BT_LEAF.to_le_bytes());
    d.block_mut(layout.map_root)[25] = 0;
    reseal(&mut d, layout.map_root);
    let p = find(&run(&d), "wrong_kind").clone();
    assert_eq!(p.block, Some(layout.map_root));
    assert!(
        p.message
            .contains("type LEAF array 1 level 0, expected INTR array 1 level 1"),
        "{}",
        p.message
    );

    let (mut d, layout) = sample();
    d.block_mut(layout.refcount_root)[24] = 3; // array id
    reseal(&mut d, layout.refcount_root);
    let p = find(&run(&d), "wrong_kind").clone();
    assert!(
        p.message.contains("array 3 level 0, expected LEAF array 2"),
        "{}",
        p.message
    );
}

#[test]
fn block_referenced_twice_within_an_array() {
    let (mut d, layout) = sample();
    let first = child(&d, layout.map_root, 0);
    // Child 2 of the map root now points at the same leaf as child 0.
    set64(&mut d, layout.map_root, HEADER_SIZE + 2 * 8, first);
    let r = run(&d);
    let p = find(&r, "referenced_twice");
    assert_eq!(p.block, Some(layout.map_root));
    assert!(p.message.contains(&format!(
        "child 2 points to block {first}, already used by the map array"
    )));
}

#[test]
fn block_referenced_twice_across_arrays() {
    let (mut d, layout) = sample();
    edit_sb(&mut d, |sb| sb.fingerprint_root = layout.map_root);
    let r = run(&d);
    let p = find(&r, "referenced_twice");
    assert_eq!(p.block, None);
    assert_eq!(p.array, Some("fingerprint"));
    assert!(
        p.message.contains("fingerprint_root points to block"),
        "{}",
        p.message
    );
    // Each block is read at most once: the map subtree is not re-walked.
    assert_eq!(r.summary.unwrap().fingerprint_blocks, 0);
}

#[test]
fn block_numbers_out_of_range() {
    let (mut d, layout) = sample();
    set64(&mut d, layout.map_root, HEADER_SIZE + 8, 1);
    let r = run(&d);
    let p = find(&r, "block_out_of_range");
    assert_eq!(p.block, Some(layout.map_root));
    assert!(
        p.message.contains("child 1 points to block 1"),
        "{}",
        p.message
    );

    let (mut d, _) = sample();
    let n = d.nr_blocks();
    edit_sb(&mut d, |sb| sb.refcount_root = n);
    let p = find(&run(&d), "block_out_of_range").clone();
    assert!(p.message.contains("refcount_root points to block"));
}

#[test]
fn child_beyond_the_array_end() {
    let (mut d, layout) = sample();
    // The map has 4 leaves (2000 entries); slot 4 is beyond the end.
    let leaf = child(&d, layout.map_root, 0);
    set64(&mut d, layout.map_root, HEADER_SIZE + 4 * 8, leaf);
    let r = run(&d);
    let p = find(&r, "child_beyond_end");
    assert_eq!(p.block, Some(layout.map_root));
    assert!(p.message.contains("child 4"));
    assert!(!r.has("referenced_twice"));
}

#[test]
fn transaction_newer_than_superblock() {
    let (mut d, layout) = sample();
    set64(&mut d, layout.refcount_root, 16, 6);
    let r = run(&d);
    let p = find(&r, "bad_txn");
    assert_eq!(p.block, Some(layout.refcount_root));
    assert!(p.message.contains("transaction 6"));
}

#[test]
fn refcount_mismatch() {
    let mut spec = sample_spec();
    spec.refcounts[17].1 += 1; // pba 17: 5 mappings, refcount 6
    let (d, _) = build(&spec);
    let r = run(&d);
    let p = find(&r, "refcount_mismatch");
    assert_eq!(p.array, Some("refcount"));
    assert_eq!(p.index, Some(17));
    assert!(
        p.message.contains("refcount is 6 but 5 map entries"),
        "{}",
        p.message
    );
    // and the sum no longer matches the superblock
    assert!(r
        .problems
        .iter()
        .any(|p| p.code == "counter_mismatch" && p.message.contains("refcounts sum to 1201")));
}

#[test]
fn mapped_block_with_zero_refcount() {
    let mut spec = sample_spec();
    // Map LBA 0 onto PBA 290, which has neither refcount nor fingerprint.
    spec.mappings.insert(0, (0, 290));
    spec.sb.mapped_blocks += 1;
    let (d, _) = build(&spec);
    let r = run(&d);
    let p = find(&r, "refcount_mismatch");
    assert_eq!(p.index, Some(290));
    assert!(
        p.message.contains("refcount is 0 but 1 map entries"),
        "{}",
        p.message
    );
    assert!(r.has("counter_mismatch"));
}

#[test]
fn refcount_leaf_missing() {
    // PBA 1100 lives in refcount leaf 1, which is absent.
    let data = 2000;
    let blocks = required_blocks(LOGICAL, data);
    let mut spec = ImageSpec::consistent(
        sb_for(LOGICAL, data, blocks, 3),
        &[(1, 5), (2, 1100)],
        test_fingerprint,
    );
    spec.refcounts.retain(|r| r.0 != 1100);
    spec.sb.used_data_blocks -= 1;
    let (d, _) = build(&spec);
    let r = run(&d);
    let p = find(&r, "refcount_mismatch");
    assert_eq!(p.index, Some(1100));
    assert!(p.message.contains("no refcount leaf"));
}

#[test]
fn missing_fingerprints() {
    let mut spec = sample_spec();
    spec.fingerprints[3].1 = [0; FP_SIZE]; // pba 3: zero record
    spec.fingerprints.retain(|f| f.0 < 127); // leaf 1 (pba 127..250) absent
    let (d, _) = build(&spec);
    let r = run(&d);
    let zero = r
        .problems
        .iter()
        .filter(|p| p.code == "missing_fingerprint")
        .collect::<Vec<_>>();
    assert_eq!(zero.len(), 1 + 123);
    assert_eq!(zero[0].index, Some(3));
    assert!(zero[0].message.contains("all-zero"));
    assert_eq!(zero[1].index, Some(127));
    assert!(zero[1].message.contains("no fingerprint leaf"));
    assert_eq!(r.summary.unwrap().fingerprinted_blocks, 126);
}

#[test]
fn fingerprint_tail_past_fp_size() {
    let mut spec = sample_spec();
    spec.sb.hash_name = [0; HASH_NAME_LEN];
    spec.sb.hash_name[..8].copy_from_slice(b"xxhash64");
    spec.sb.fp_size = 8;
    for f in spec.fingerprints.iter_mut() {
        f.1[8..].fill(0);
    }
    spec.fingerprints[0].1[20] = 1;
    let (d, _) = build(&spec);
    let r = run(&d);
    assert_eq!(codes(&r), vec!["fingerprint_tail"]);
    assert!(r.clean());
}

#[test]
fn stale_fingerprints_are_fine() {
    let mut spec = sample_spec();
    spec.fingerprints.push((260, test_fingerprint(260)));
    let (d, _) = build(&spec);
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(r.summary.unwrap().stale_fingerprints, 1);
}

#[test]
fn map_entry_beyond_data_device() {
    let mut spec = sample_spec();
    spec.mappings.push((1999, DATA)); // pba == data_blocks
    spec.sb.mapped_blocks += 1;
    let (d, _) = build(&spec);
    let r = run(&d);
    let p = find(&r, "map_beyond_data");
    assert_eq!(p.array, Some("map"));
    assert_eq!(p.index, Some(1999));
}

#[test]
fn superblock_counters() {
    let (mut d, _) = sample();
    edit_sb(&mut d, |sb| {
        sb.mapped_blocks = 1199;
        sb.used_data_blocks = 251;
    });
    let r = run(&d);
    let msgs: Vec<_> = r
        .problems
        .iter()
        .filter(|p| p.code == "counter_mismatch")
        .map(|p| p.message.clone())
        .collect();
    assert_eq!(msgs.len(), 3, "{msgs:?}");
    assert!(msgs[0].contains("1200 mapped entries"));
    assert!(msgs[1].contains("refcounts sum to 1200"));
    assert!(msgs[2].contains("251"));
}

#[test]
fn superblock_fields() {
    let (mut d, _) = sample();
    edit_sb(&mut d, |sb| {
        sb.block_size = 512;
        sb.fp_size = 33;
        sb.flags = 0x7;
    });
    let r = run(&d);
    assert!(r
        .problems
        .iter()
        .any(|p| p.message.contains("block_size is 512")));
    assert!(r
        .problems
        .iter()
        .any(|p| p.message.contains("fp_size is 33")));
    assert!(r
        .problems
        .iter()
        .any(|p| p.severity == Severity::Error && p.message.contains("unknown flags 0x4")));
    // needs_check alone is a warning: the metadata itself is fine
    let (mut d, _) = sample();
    edit_sb(&mut d, |sb| sb.flags = SB_NEEDS_CHECK);
    let r = run(&d);
    assert!(r.clean(), "{:#?}", r.problems);
    assert!(r.has("needs_check"));
    // UNFLUSHED_APPENDS is the kernel's everyday state: nothing to say.
    let (mut d, _) = sample();
    edit_sb(&mut d, |sb| sb.flags = SB_UNFLUSHED_APPENDS);
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(r.superblock.unwrap().flags, SB_UNFLUSHED_APPENDS);
    // Bit 2 is still unknown, with or without it.
    for flags in [0x4, SB_UNFLUSHED_APPENDS | 0x4] {
        let (mut d, _) = sample();
        edit_sb(&mut d, |sb| sb.flags = flags);
        let r = run(&d);
        assert_eq!(codes(&r), ["unknown_flags"], "{:#?}", r.problems);
        assert!(find(&r, "unknown_flags")
            .message
            .contains("unknown flags 0x4"));
    }

    let (mut d, _) = sample();
    edit_sb(&mut d, |sb| sb.version = 3);
    let f = check(&d, &CheckOptions::default()).unwrap_err();
    assert!(f.0.contains("version 3 is not supported"), "{f}");
}

#[test]
fn generation_at_the_limit_is_fine_above_is_an_error() {
    // Written at exactly DD_MAX_TXN (trees included): the kernel opens it.
    let mut spec = sample_spec();
    spec.sb.header.txn = MAX_TXN;
    let (mut d, _) = build(&spec);
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(r.superblock.as_ref().unwrap().generation, MAX_TXN);

    // One commit more (to the other slot): the kernel refuses it.
    edit_sb(&mut d, |sb| sb.header.txn = MAX_TXN + 1);
    let r = run(&d);
    assert_eq!(r.superblock.as_ref().unwrap().generation, MAX_TXN + 1);
    assert_eq!(codes(&r), vec!["txn_too_large"], "{:#?}", r.problems);
    let p = find(&r, "txn_too_large");
    assert_eq!(p.severity, Severity::Error);
    assert_eq!(p.location(), "superblock");
    assert!(
        p.message
            .contains("generation 18446744069414584320 is above 18446744069414584319"),
        "{}",
        p.message
    );
    assert!(!r.clean());

    // The highest id of all, in a superblock that is otherwise sound.
    let (mut d, _) = sample();
    edit_sb(&mut d, |sb| sb.header.txn = u64::MAX);
    let r = run(&d);
    assert_eq!(r.superblock.as_ref().unwrap().generation, u64::MAX);
    assert_eq!(codes(&r), vec!["txn_too_large"], "{:#?}", r.problems);

    // The same rule as restore's validation sees it.
    let mut sb = sample_spec().sb;
    sb.header.txn = MAX_TXN;
    assert!(superblock_rules(&sb).is_empty());
    sb.header.txn = MAX_TXN + 1;
    let v = superblock_rules(&sb);
    assert_eq!(v.len(), 1);
    assert_eq!((v[0].0, v[0].1), (Severity::Error, "txn_too_large"));
}

/// `d` checked against a table of these sizes (None: the superblock's).
fn with_table(d: &MemDev, data: Option<u64>, logical: Option<u64>) -> Report {
    let opts = CheckOptions {
        data_blocks: data,
        logical_blocks: logical,
        ..CheckOptions::default()
    };
    check(d, &opts).unwrap().0
}

/// Assert that `r` has a problem of `code` and `sev` whose message says
/// `text`.
fn says(r: &Report, code: &str, sev: Severity, text: &str) {
    assert!(
        r.problems
            .iter()
            .any(|p| p.code == code && p.severity == sev && p.message.contains(text)),
        "no {code} ({sev:?}) saying {text:?} in {:#?}",
        r.problems
    );
}

fn messages<'a>(r: &'a Report, code: &str) -> Vec<&'a str> {
    r.problems
        .iter()
        .filter(|p| p.code == code)
        .map(|p| p.message.as_str())
        .collect()
}

#[test]
fn table_mismatch() {
    let (d, _) = sample();
    // Smaller sizes: dd_check_sb() refuses to shrink; another hash too.
    let opts = CheckOptions {
        data_blocks: Some(DATA - 1),
        logical_blocks: Some(LOGICAL - 1),
        hash: Some("sha512".into()),
        ..CheckOptions::default()
    };
    let r = check(&d, &opts).unwrap().0;
    let msgs = messages(&r, "table_mismatch");
    assert_eq!(msgs.len(), 3, "{msgs:?}");
    assert_eq!(r.errors, 3, "{:#?}", r.problems);
    assert!(
        msgs[0].contains("--data-blocks 299 is smaller than data_blocks 300")
            && msgs[0].contains("cannot shrink the data device"),
        "{}",
        msgs[0]
    );
    assert!(
        msgs[1].contains("--logical-blocks 1999 is smaller than logical_blocks 2000")
            && msgs[1].contains("cannot shrink the logical size"),
        "{}",
        msgs[1]
    );
    assert!(msgs[2].contains("--hash sha512"));

    // Larger sizes: the kernel grows the device at activation (dd_grow);
    // a warning, not an error. These need no more metadata blocks.
    let r = with_table(&d, Some(DATA + 1), Some(LOGICAL + 32));
    assert!(r.clean(), "{:#?}", r.problems);
    assert_eq!(codes(&r), ["table_grows", "table_grows"]);
    assert!(r.problems.iter().all(|p| p.severity == Severity::Warning));
    let msgs = messages(&r, "table_grows");
    assert!(
        msgs[0].contains(
            "--data-blocks 301 is larger than data_blocks 300: the kernel grows the data \
             device to 301 blocks when it activates this table"
        ),
        "{}",
        msgs[0]
    );
    assert!(
        msgs[1].contains("--logical-blocks 2032 is larger than logical_blocks 2000"),
        "{}",
        msgs[1]
    );
    // The same sizes: nothing to say.
    assert!(with_table(&d, Some(DATA), Some(LOGICAL))
        .problems
        .is_empty());
}

#[test]
fn a_larger_table_is_held_to_what_the_kernel_grows() {
    let (d, layout) = sample();
    // dd_md_open(): the trees at the table's sizes beside the journal.
    let r = with_table(&d, None, Some(100_000));
    let need = open_blocks(100_000, DATA) + layout.journal_blocks;
    let text = format!("100000 logical and 300 data blocks need {need}");
    says(&r, "device_too_small", Severity::Error, &text);

    // dd_array_grow(): non-zero entries past the end of the last leaf of
    // an array that grows are refused (-EILSEQ); of one that does not,
    // nobody reads them. The last LBA mapped: the last map leaf is there.
    let mut mappings = sample_mappings();
    mappings.push((LOGICAL - 1, 0));
    let blocks = required_blocks(LOGICAL, DATA) + 8;
    let spec = ImageSpec::consistent(
        sb_for(LOGICAL, DATA, blocks, 5),
        &mappings,
        test_fingerprint,
    );
    let (mut d, layout) = build(&spec);
    assert!(run(&d).problems.is_empty());
    d.block_mut(layout.refcount_root)[HEADER_SIZE + DATA as usize * 4] = 1;
    reseal(&mut d, layout.refcount_root);
    let last_map_leaf = child(&d, layout.map_root, 3);
    assert_ne!(last_map_leaf, 0);
    d.block_mut(last_map_leaf)[HEADER_SIZE + (LOGICAL as usize - 3 * 508) * 8 + 7] = 1;
    reseal(&mut d, last_map_leaf);
    let tails = |r: &Report| -> Vec<(Severity, Option<&str>)> {
        r.problems
            .iter()
            .filter(|p| p.code == "tail_nonzero")
            .map(|p| (p.severity, p.array))
            .collect()
    };
    let r = run(&d);
    assert_eq!(
        tails(&r),
        [
            (Severity::Warning, Some("map")),
            (Severity::Warning, Some("refcount"))
        ]
    );
    assert!(r.clean());
    let r = with_table(&d, Some(DATA + 1), None);
    assert_eq!(
        tails(&r),
        [
            (Severity::Warning, Some("map")),
            (Severity::Error, Some("refcount"))
        ]
    );
    let text = "the kernel refuses to grow the array to the table's 301 entries";
    says(&r, "tail_nonzero", Severity::Error, text);
    let r = with_table(&d, None, Some(LOGICAL + 1));
    assert_eq!(
        tails(&r),
        [
            (Severity::Error, Some("map")),
            (Severity::Warning, Some("refcount"))
        ]
    );

    // dd_check_sb(): no growth at DD_MAX_TXN.
    let mut spec = sample_spec();
    spec.sb.header.txn = MAX_TXN;
    let (d, _) = build(&spec);
    assert!(with_table(&d, Some(DATA), Some(LOGICAL)).clean());
    let r = with_table(&d, Some(DATA + 1), None);
    let text = "cannot grow at the transaction id limit";
    says(&r, "grow_refused", Severity::Error, text);

    // dd_check_sb(): no growth of a device flagged needs_check (opened
    // read-only) until `check --clear-needs-check` clears the flag.
    let (mut d, _) = sample();
    edit_sb(&mut d, |sb| sb.flags = SB_NEEDS_CHECK);
    let r = with_table(&d, None, Some(LOGICAL + 1));
    assert!(r.clean(), "{:#?}", r.problems);
    let text = "cannot grow a device flagged needs_check: run dedup check first";
    says(&r, "table_grows", Severity::Warning, text);

    // A save written for the smaller data device is not loaded: the
    // kernel compares it with the table's size (dd_saved_load()).
    let (d, _, _) = saved_sample(|_, _| {});
    let r = with_table(&d, Some(SAVED_DATA + 1), None);
    assert!(r.clean(), "{:#?}", r.problems);
    let text = "written for 1100 data blocks, the table has 1101";
    says(&r, saved::STALE, Severity::Warning, text);
    assert!(!r.saved.as_ref().unwrap().loadable);
}

#[test]
fn device_smaller_than_required() {
    let spec = sample_spec();
    let mut small = spec.clone();
    // Version 1: no room for a journal is needed to write it.
    small.sb.version = FORMAT_VERSION_V1;
    small.sb.metadata_blocks = 15;
    assert!(required_blocks(LOGICAL, DATA) > 15);
    let (d, _) = build(&small);
    let r = run(&d);
    let p = find(&r, "device_too_small");
    // What dd_md_open() asks of a formatted device: no journal's room.
    assert!(p
        .message
        .contains(&format!("need {}", open_blocks(LOGICAL, DATA))));
}

#[test]
fn newest_valid_slot_wins() {
    let spec = sample_spec();
    let (mut d, _) = build(&spec);
    // An older generation in slot 0 with other counters: ignored.
    let mut old = Superblock::decode(d.block(1));
    old.header.txn = 4;
    old.mapped_blocks = 7;
    *d.block_mut(0) = *old.encode();
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(r.superblock.as_ref().unwrap().slot, 1);
    assert_eq!(r.slots[0].generation, Some(4));

    // A newer one in slot 0 wins, and its counters are then wrong.
    old.header.txn = 6;
    *d.block_mut(0) = *old.encode();
    let r = run(&d);
    assert_eq!(r.superblock.as_ref().unwrap().slot, 0);
    assert!(r.has("counter_mismatch"));
}

#[test]
fn damaged_other_slot_is_a_warning() {
    let (mut d, _) = sample();
    d.block_mut(0)[..8].copy_from_slice(b"garbage!");
    let r = run(&d);
    assert!(r.clean());
    let p = find(&r, "other_slot_bad");
    assert_eq!(p.severity, Severity::Warning);
    assert_eq!(r.slots[0].state, "bad");
    assert!(r.slots[0]
        .reason
        .as_ref()
        .unwrap()
        .contains("no dm-dedup magic"));
}

#[test]
fn superblock_damage_with_one_slot() {
    // Bad checksum in the only superblock: metadata is there, no valid sb.
    let (mut d, _) = sample();
    d.block_mut(1)[200] = 1;
    let r = run(&d);
    assert!(!r.clean());
    let p = find(&r, "no_valid_superblock");
    assert!(
        p.message.contains("slot 1: checksum mismatch"),
        "{}",
        p.message
    );
    assert!(r.summary.is_none());

    // Misdirected: the slot-1 superblock written to slot 0.
    let (mut d, _) = sample();
    let b = *d.block(1);
    *d.block_mut(0) = b;
    d.block_mut(1).fill(0);
    let p = find(&run(&d), "no_valid_superblock").clone();
    assert!(
        p.message.contains("slot 0: claims to be block 1"),
        "{}",
        p.message
    );
}

#[test]
fn zeroed_superblocks() {
    // Both slots wiped on a device with trees: damaged metadata.
    let (mut d, _) = sample();
    d.block_mut(1).fill(0);
    let r = run(&d);
    let p = find(&r, "no_valid_superblock");
    assert!(
        p.message.contains("slot 0: zero; slot 1: zero"),
        "{}",
        p.message
    );

    // A device never formatted: operational error.
    let d = MemDev::new(100);
    let f = check(&d, &CheckOptions::default()).unwrap_err();
    assert!(f.0.starts_with("not formatted"), "{f}");
}

#[test]
fn not_a_dedup_device() {
    // Random garbage.
    let mut x = 0x1234_5678_9abc_def0u64;
    let bytes: Vec<u8> = (0..64 * BLOCK_SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let f = check(&MemDev::from_bytes(bytes), &CheckOptions::default()).unwrap_err();
    assert!(f.0.starts_with("not a dm-dedup metadata device"), "{f}");
    // A data device: text.
    let text = b"hello world, this is a data block\n".repeat(1000);
    let f = check(&MemDev::from_bytes(text), &CheckOptions::default()).unwrap_err();
    assert!(f.0.starts_with("not a dm-dedup metadata device"), "{f}");
}

#[test]
fn truncated_devices() {
    let (d, _) = sample();
    let mut bytes = d.bytes.clone();
    bytes.truncate(20 * BLOCK_SIZE + 100);
    let f = check(&MemDev::from_bytes(bytes), &CheckOptions::default()).unwrap_err();
    assert!(f.0.contains("truncated"), "{f}");
    assert!(f.0.contains("the device has 20"), "{f}");

    let mut bytes = d.bytes.clone();
    bytes.truncate(BLOCK_SIZE + 5);
    let f = check(&MemDev::from_bytes(bytes), &CheckOptions::default()).unwrap_err();
    assert!(f.0.contains("too small"), "{f}");

    let f = check(&MemDev::default(), &CheckOptions::default()).unwrap_err();
    assert!(f.0.contains("too small"), "{f}");
}

#[test]
fn problem_list_is_capped_but_counted() {
    let mut spec = sample_spec();
    for r in spec.refcounts.iter_mut() {
        r.1 += 1;
    }
    let (d, _) = build(&spec);
    let opts = CheckOptions {
        max_problems: 10,
        ..CheckOptions::default()
    };
    let r = check(&d, &opts).unwrap().0;
    assert_eq!(r.problems.len(), 10);
    assert_eq!(r.errors, 250 + 1);
    assert_eq!(r.unlisted_problems, 241);
    let text = render(&r, "img");
    assert!(text.contains("241 more problems"));
    assert!(text.contains("result: 251 errors"));
}

#[test]
fn render_mentions_locations() {
    let (mut d, layout) = sample();
    let leaf = child(&d, layout.map_root, 1);
    d.block_mut(leaf)[100] ^= 1;
    let text = render(&run(&d), "img");
    assert!(
        text.contains(&format!(
            "error: block {leaf}, map level 0, lba 508: checksum mismatch"
        )),
        "{text}"
    );
    assert!(
        text.contains("superblock slot 1: valid, generation 5"),
        "{text}"
    );
}

#[test]
fn zero_fingerprint_of_a_short_digest_is_a_warning() {
    let mut spec = sample_spec();
    spec.sb.hash_name = [0; HASH_NAME_LEN];
    spec.sb.hash_name[..6].copy_from_slice(b"crc32c");
    spec.sb.fp_size = 4;
    for f in spec.fingerprints.iter_mut() {
        f.1[4..].fill(0);
    }
    spec.fingerprints[9].1 = [0; FP_SIZE];
    let (d, _) = build(&spec);
    let r = run(&d);
    assert!(r.clean());
    let p = find(&r, "zero_fingerprint");
    assert_eq!(p.index, Some(9));
    assert_eq!(r.summary.unwrap().fingerprinted_blocks, 250);
    // An absent leaf is an error whatever the digest size.
    spec.fingerprints.retain(|f| f.0 < 127);
    let (d, _) = build(&spec);
    assert!(run(&d).has("missing_fingerprint"));
}

/// Content of data block `pba` of the test data devices.
fn data_content(pba: u64) -> Vec<u8> {
    (0..BLOCK_SIZE as u64)
        .map(|i| (pba * 131 + i / 3) as u8)
        .collect()
}

/// A metadata image and a data device, as files, removed when dropped.
struct DataPair {
    meta: std::path::PathBuf,
    data: std::path::PathBuf,
}

impl DataPair {
    /// The sample mappings over DATA data blocks, with records of `hash`
    /// computed from data_content, after `edit` changed the spec.
    fn new(name: &str, hash: &str, edit: impl FnOnce(&mut ImageSpec)) -> DataPair {
        let h = crate::fingerprint::Hasher::from_name(hash).unwrap();
        let blocks = required_blocks(LOGICAL, DATA) + 8;
        let mut sb = sb_for(LOGICAL, DATA, blocks, 5);
        sb.hash_name = [0; HASH_NAME_LEN];
        sb.hash_name[..hash.len()].copy_from_slice(hash.as_bytes());
        sb.fp_size = h.fp_size() as u32;
        let mut spec =
            ImageSpec::consistent(sb, &sample_mappings(), |p| h.record(&data_content(p)));
        edit(&mut spec);
        let (m, _) = build(&spec);
        let dir = std::env::temp_dir();
        let tag = format!("dedup-check-data-{}-{name}", std::process::id());
        let pair = DataPair {
            meta: dir.join(format!("{tag}.meta")),
            data: dir.join(format!("{tag}.data")),
        };
        std::fs::write(&pair.meta, &m.bytes).unwrap();
        let bytes: Vec<u8> = (0..DATA).flat_map(data_content).collect();
        std::fs::write(&pair.data, bytes).unwrap();
        pair
    }

    fn check(&self) -> Result<Report, Fatal> {
        use crate::device::FileDev;
        let meta = FileDev::open(&self.meta, false).unwrap();
        let data = FileDev::open(&self.data, false).unwrap();
        check_with_data(&meta, Some(&data), &CheckOptions::default()).map(|r| r.0)
    }
}

impl Drop for DataPair {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.meta);
        let _ = std::fs::remove_file(&self.data);
    }
}

#[test]
fn data_matching_its_fingerprints_is_clean() {
    for hash in ["sha256", "crc32c", "xxhash64"] {
        let pair = DataPair::new(&format!("clean-{hash}"), hash, |_| {});
        let r = pair.check().unwrap();
        assert!(r.problems.is_empty(), "{hash}: {:#?}", r.problems);
        let s = r.summary.as_ref().unwrap();
        assert_eq!(s.data_blocks_verified, Some(250), "{hash}");
        assert_eq!(s.fingerprint_mismatches, Some(0));
        assert_eq!(s.data_read_errors, Some(0));
        assert!(render(&r, "m").contains("data blocks verified: 250 of 250 live blocks"));
    }
    // Without a data device, nothing is verified and nothing is said.
    let (d, _) = sample();
    let r = run(&d);
    let s = r.summary.as_ref().unwrap();
    assert_eq!(s.data_blocks_verified, None);
    let j = serde_json::to_value(&r).unwrap();
    assert!(j["summary"].get("data_blocks_verified").is_none());
    assert!(!render(&r, "m").contains("data blocks verified"));
}

#[test]
fn fingerprint_mismatch_and_placeholder() {
    let pair = DataPair::new("mismatch", "sha256", |spec| {
        spec.fingerprints[7].1[31] ^= 1; // PBA 7: the last stored byte
        spec.fingerprints[200].1 = crate::fingerprint::placeholder(200, 32);
    });
    let r = pair.check().unwrap();
    let p = find(&r, "fingerprint_mismatch");
    assert_eq!(p.severity, Severity::Error);
    assert_eq!((p.array, p.index), (Some("fingerprint"), Some(7)));
    assert!(p.block.is_some());
    assert!(p
        .message
        .contains("differs from the sha256 of the data block"));
    // The placeholder is the known warning, not a mismatch.
    assert_eq!(find(&r, "placeholder_fingerprint").index, Some(200));
    assert_eq!((r.errors, r.warnings), (1, 1), "{:#?}", r.problems);
    let s = r.summary.as_ref().unwrap();
    assert_eq!(s.data_blocks_verified, Some(248));
    assert_eq!(s.fingerprint_mismatches, Some(1));
    assert_eq!(s.placeholder_fingerprints, 1);
    let j = serde_json::to_value(&r).unwrap();
    assert_eq!(j["summary"]["fingerprint_mismatches"], 1);
    assert_eq!(j["summary"]["data_blocks_verified"], 248);
    assert!(render(&r, "m").contains("(mismatched: 1, unreadable: 0, placeholders skipped: 1)"));

    // Changed data: a mismatch at that block; an all-zero one says so.
    let pair = DataPair::new("changed-data", "sha256", |_| {});
    let mut bytes = std::fs::read(&pair.data).unwrap();
    bytes[42 * BLOCK_SIZE + 100] ^= 0x80;
    bytes[43 * BLOCK_SIZE..44 * BLOCK_SIZE].fill(0);
    std::fs::write(&pair.data, bytes).unwrap();
    let r = pair.check().unwrap();
    let bad: Vec<_> = r
        .problems
        .iter()
        .filter(|p| p.code == "fingerprint_mismatch")
        .collect();
    assert_eq!(bad.len(), 2, "{:#?}", r.problems);
    assert_eq!((bad[0].index, bad[1].index), (Some(42), Some(43)));
    assert!(
        bad[1].message.contains(", all zeros)"),
        "{}",
        bad[1].message
    );
}

#[test]
fn data_device_of_the_wrong_size_is_fatal() {
    let pair = DataPair::new("short", "sha256", |_| {});
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&pair.data)
        .unwrap();
    f.set_len((DATA - 1) * BLOCK_SIZE as u64).unwrap();
    let e = pair.check().unwrap_err();
    assert!(
        e.0.contains("299 blocks of 4 KiB but the metadata describes 300"),
        "{e}"
    );
    // A trailing partial block is ignored, as the kernel does.
    f.set_len(DATA * BLOCK_SIZE as u64 + 100).unwrap();
    let r = pair.check().unwrap();
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    // A larger one is a grown table: the kernel takes it.
    f.set_len((DATA + 1) * BLOCK_SIZE as u64).unwrap();
    let r = pair.check().unwrap();
    assert!(r.clean(), "{:#?}", r.problems);
    assert_eq!(codes(&r), ["table_grows"]);
    assert!(
        r.problems[0]
            .message
            .contains("the data device (--data) has 301 blocks, larger than data_blocks 300"),
        "{}",
        r.problems[0].message
    );
    assert_eq!(r.summary.as_ref().unwrap().data_blocks_verified, Some(250));
    // --data-blocks must then agree with it.
    use crate::device::FileDev;
    let meta = FileDev::open(&pair.meta, false).unwrap();
    let data = FileDev::open(&pair.data, false).unwrap();
    let opts = CheckOptions {
        data_blocks: Some(DATA),
        ..CheckOptions::default()
    };
    let e = check_with_data(&meta, Some(&data), &opts).unwrap_err();
    assert!(
        e.0.contains("--data-blocks 300 but the data device (--data) has 301 blocks"),
        "{e}"
    );
}

/// A device with one unreadable block (repair's tests use it too).
pub(crate) struct BadSector {
    pub(crate) inner: MemDev,
    pub(crate) bad: u64,
}

impl BlockDev for BadSector {
    fn nr_blocks(&self) -> u64 {
        self.inner.nr_blocks()
    }
    fn read_block(&self, nr: u64, buf: &mut Block) -> std::io::Result<()> {
        if nr == self.bad {
            return Err(std::io::Error::other("injected read error"));
        }
        self.inner.read_block(nr, buf)
    }
    fn write_block(&mut self, _: u64, _: &Block) -> std::io::Result<()> {
        unreachable!()
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn unreadable_data_block_is_an_error_and_the_rest_is_verified() {
    let spec = ImageSpec::consistent(
        sb_for(LOGICAL, DATA, required_blocks(LOGICAL, DATA) + 8, 5),
        &sample_mappings(),
        |p| crate::fingerprint::Hasher::Sha256.record(&data_content(p)),
    );
    let (m, _) = build(&spec);
    let data = BadSector {
        inner: MemDev::from_bytes((0..DATA).flat_map(data_content).collect()),
        bad: 100,
    };
    let r = check_with_data(&m, Some(&data), &CheckOptions::default())
        .unwrap()
        .0;
    let p = find(&r, "data_read_error");
    assert_eq!(p.index, Some(100));
    assert!(p.message.contains("injected read error"), "{}", p.message);
    assert_eq!(r.errors, 1);
    let s = r.summary.unwrap();
    assert_eq!(
        (s.data_blocks_verified, s.data_read_errors),
        (Some(249), Some(1))
    );
}

// ---- the state saved at a clean close ----

use crate::ondisk::saved as fmt;
use crate::writer::TreeWriter;

/// Data blocks of the image the test saves are made for: the index the
/// kernel sizes from them (145 buckets of 8 entries of 30 bits, 4 of them
/// the leaf, in 544 words) makes the save take two leaves and a root. 9 fingerprint leaves; the live blocks
/// (0..250, as in the sample) lie in leaves 0 and 1.
const SAVED_DATA: u64 = 1100;
/// Live blocks the test saves put in index entries (the rest count as
/// index_full).
const INDEXED: u64 = 100;

/// The sample's mappings on a data device of SAVED_DATA blocks.
fn saved_spec() -> ImageSpec {
    let blocks = required_blocks(LOGICAL, SAVED_DATA) + 8;
    ImageSpec::consistent(
        sb_for(LOGICAL, SAVED_DATA, blocks, 5),
        &sample_mappings(),
        test_fingerprint,
    )
}

fn index_geometry() -> fmt::IndexGeometry {
    fmt::IndexGeometry::for_data_blocks(SAVED_DATA)
}

fn saved_layout(d: &MemDev) -> fmt::Layout {
    fmt::Layout::new(d.nr_blocks(), SAVED_DATA, index_geometry().words()).unwrap()
}

/// Set index entry `k` of the save `w` to `v`.
fn set_entry(w: &mut [u64], l: &fmt::Layout, k: u64, v: u64) {
    index_geometry().set_entry(&mut w[l.target_start as usize..], k, v);
}

/// The save's non-empty index entries.
fn entries_in(w: &[u64], l: &fmt::Layout) -> Vec<(u64, u64)> {
    let g = index_geometry();
    (0..g.entries())
        .map(|k| (k, g.entry(&w[l.target_start as usize..], k)))
        .filter(|&(_, v)| v != 0)
        .collect()
}

fn set_bit(words: &mut [u64], start: u64, bit: u64) {
    words[(start + bit / 64) as usize] |= 1 << (bit % 64);
}

fn clear_bit(words: &mut [u64], start: u64, bit: u64) {
    words[(start + bit / 64) as usize] &= !(1 << (bit % 64));
}

/// The words dd_saved_write() writes for the saved_spec() image: its tree
/// blocks ([2, 2 + tree_blocks)), its live blocks, and INDEXED of them
/// (PBAs 0, 2, 4, ...: 64 in leaf 0, 36 in leaf 1) in entries spread over
/// the whole index, with a tag.
fn good_save(d: &MemDev, layout: &Layout, spec: &ImageSpec) -> Vec<u64> {
    let l = saved_layout(d);
    let g = index_geometry();
    let mut w = vec![0u64; l.total as usize];
    w[fmt::W_MAGIC] = fmt::MAGIC;
    w[fmt::W_TXN] = spec.sb.generation();
    w[fmt::W_METADATA_BLOCKS] = d.nr_blocks();
    w[fmt::W_DATA_BLOCKS] = SAVED_DATA;
    w[fmt::W_TARGET_WORDS] = g.words();
    let live = spec.refcounts.len() as u64;
    let head = [
        fmt::INDEX_LAYOUT,
        0x1234,
        0x5678,
        INDEXED,
        live - INDEXED,
        3,
        g.encode(),
        g.buckets,
    ];
    w[fmt::W_TARGET_HEAD..fmt::W_TARGET_HEAD + head.len()].copy_from_slice(&head);
    for b in FIRST_TREE_BLOCK..FIRST_TREE_BLOCK + layout.tree_blocks {
        set_bit(&mut w, fmt::HEADER_WORDS as u64, b);
    }
    for &(pba, _) in &spec.refcounts {
        set_bit(&mut w, l.data_start, pba);
    }
    let indexed = spec.refcounts.iter().step_by(2).take(INDEXED as usize);
    for (j, &(pba, _)) in (0..).zip(indexed) {
        let k = j * g.entries() / INDEXED;
        let tag = pba.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        set_entry(&mut w, &l, k, g.make_entry(fmt::leaf_of(pba), tag));
    }
    w
}

/// Write `words` as the save (blocks after the trees and the journal,
/// transaction `txn`) and name it in the superblock; its root.
fn put_save(d: &mut MemDev, layout: &Layout, words: &[u64], txn: u64) -> u64 {
    let first =
        (FIRST_TREE_BLOCK + layout.tree_blocks).max(layout.journal_start + layout.journal_blocks);
    let end = d.nr_blocks();
    let g = Geometry::new(ArrayId::Saved, words.len() as u64);
    let root = TreeWriter::new(d, first, end, txn)
        .build(
            &g,
            (0u64..)
                .zip(words)
                .filter(|(_, &v)| v != 0)
                .map(|(i, v)| (i, v.to_le_bytes())),
        )
        .unwrap();
    edit_sb(d, |sb| {
        sb.saved_root = root;
        sb.saved_words = words.len() as u64;
    });
    root
}

/// The sample image with the save `edit` makes of the right one.
fn saved_sample(edit: impl FnOnce(&mut Vec<u64>, &fmt::Layout)) -> (MemDev, Layout, u64) {
    let spec = saved_spec();
    let (mut d, layout) = build(&spec);
    let mut w = good_save(&d, &layout, &spec);
    edit(&mut w, &saved_layout(&d));
    let root = put_save(&mut d, &layout, &w, spec.sb.generation());
    (d, layout, root)
}

/// Only saved_state_stale warnings, the save not loadable.
fn assert_stale(r: &Report, why: &str) {
    assert!(r.clean(), "{:#?}", r.problems);
    assert!(
        r.problems.iter().all(|p| p.code == saved::STALE),
        "{:#?}",
        r.problems
    );
    let p = find(r, saved::STALE);
    assert!(
        r.problems.iter().any(|p| p.message.contains(why)),
        "no {why:?} in {:#?}",
        r.problems
    );
    assert_eq!(p.severity, Severity::Warning);
    let s = r.saved.as_ref().unwrap();
    assert!(!s.loadable && !s.compared);
}

/// Exactly one saved_state_wrong error, saying `why`; the save loadable.
fn assert_wrong(r: &Report, why: &str) {
    assert_eq!(codes(r), [saved::WRONG], "{:#?}", r.problems);
    let p = find(r, saved::WRONG);
    assert!(p.message.contains(why), "{}", p.message);
    assert_eq!(p.array, Some("saved"));
    let s = r.saved.as_ref().unwrap();
    assert!(s.loadable && s.compared);
}

#[test]
fn saved_state_that_matches_is_clean() {
    let (d, layout, root) = saved_sample(|_, _| {});
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    let s = r.saved.as_ref().unwrap();
    assert!(s.loadable && s.compared);
    assert_eq!((s.root, s.words), (root, saved_layout(&d).total));
    // The index reaches the second leaf: 2 leaves under a root.
    assert_eq!(s.blocks, 3);
    let l = saved_layout(&d);
    assert!(l.target_start < 508 && l.total > 508, "{l:?}");
    assert_eq!(
        r.summary.as_ref().unwrap().metadata_blocks_used,
        2 + layout.tree_blocks + layout.journal_blocks
    );
    assert_eq!(r.superblock.as_ref().unwrap().saved_root, root);
    let text = render(&r, "img");
    assert!(
        text.contains(&format!(
            "saved state: {} words in 3 blocks (root {root}), loadable, matches the trees",
            s.words
        )),
        "{text}"
    );
    // No save named, no line.
    let (d, _) = sample();
    let r = run(&d);
    assert!(r.saved.is_none());
    assert!(!render(&r, "img").contains("saved state"));
}

#[test]
fn saved_state_the_kernel_would_not_load_is_a_warning() {
    type Edit = fn(&mut Vec<u64>, &fmt::Layout);
    let cases: [(Edit, &str); 12] = [
        (|w, _| w[fmt::W_MAGIC] = 1, "no header"),
        (|w, _| w[fmt::W_TXN] -= 1, "generation 4, not this one (5)"),
        (
            |w, _| w[fmt::W_METADATA_BLOCKS] += 1,
            "metadata blocks, the device has",
        ),
        (
            |w, _| w[fmt::W_DATA_BLOCKS] -= 1,
            "data blocks, the superblock has",
        ),
        (|w, _| w[fmt::W_TARGET_WORDS] += 1, "do not make the"),
        (
            |w, _| w[fmt::W_TARGET_HEAD] = 0x3158_4449,
            "index layout 0x31584449 is not this module's (IDX2)",
        ),
        // Another number of buckets: other words.
        (
            |w, _| w[fmt::W_TARGET_HEAD + fmt::HEAD_BUCKETS] += 1,
            "packs 1168 entries of 30 bits in 548 words, not the 544",
        ),
        // The same words, another geometry (L = 5, not fls64(9) = 4).
        (
            |w, _| w[fmt::W_TARGET_HEAD + fmt::HEAD_GEOMETRY] += 1 << 8,
            "index geometry 0x7f0008051e with 145 buckets is not the kernel's for 1100 data \
             blocks (0x7f0008041e with 145 buckets)",
        ),
        (
            |w, _| w[fmt::W_TARGET_HEAD + fmt::HEAD_GEOMETRY] = 0,
            "index geometry 0x0 with 145 buckets",
        ),
        (
            |w, _| w[fmt::W_TARGET_HEAD + fmt::HEAD_ENTRIES] += 1,
            "100 index entries are in use but its head says 101",
        ),
        (
            |w, _| w[fmt::W_TARGET_HEAD + fmt::HEAD_LOADS] = 16,
            "its index was loaded 16 times since it was rebuilt",
        ),
        // A live block unmarked: the count differs from the superblock's.
        (
            |w, l| clear_bit(w, l.data_start, 7),
            "marks 249 data blocks used but the superblock says used_data_blocks 250",
        ),
    ];
    for (edit, why) in cases {
        let (d, _, _) = saved_sample(edit);
        assert_stale(&run(&d), why);
    }
    // Bits outside what the kernel's allocators cover.
    let (d, _, _) = saved_sample(|w, l| set_bit(w, l.data_start, SAVED_DATA + 1));
    assert_stale(&run(&d), "beyond the data device");
    let (d, _, _) = saved_sample(|w, _| set_bit(w, fmt::HEADER_WORDS as u64, 1));
    assert_stale(&run(&d), "outside the tree area");
    // The bitmap claims a block of the save itself.
    // (After the trees and the journal: see clean_image.)
    let (_, layout, root) = saved_sample(|_, _| {});
    let first = layout.journal_start + layout.journal_blocks;
    assert_eq!(root, first + 2, "the leaves, then the root");
    let (d, _, _) = saved_sample(|w, _| set_bit(w, fmt::HEADER_WORDS as u64, first));
    assert_stale(&run(&d), "blocks of the save itself");
    // A root left out: dd_activate_saved refuses the save (block 5 is the
    // map's root), where another tree block left out is trusted wrongly.
    let (_, layout, _) = saved_sample(|_, _| {});
    assert_eq!(layout.map_root, 5);
    let (d, _, _) = saved_sample(|w, _| clear_bit(w, fmt::HEADER_WORDS as u64, 5));
    assert_stale(&run(&d), "tree roots are not marked used");
}

#[test]
fn saved_state_blocks_that_do_not_read_are_a_warning() {
    // A flipped bit in a save block.
    let (mut d, _, root) = saved_sample(|_, _| {});
    let leaf = child(&d, root, 0);
    d.block_mut(leaf)[HEADER_SIZE + 8] ^= 1;
    assert_stale(&run(&d), "checksum mismatch");
    // The root of the save is a tree block.
    let (mut d, layout, _) = saved_sample(|_, _| {});
    edit_sb(&mut d, |sb| sb.saved_root = layout.map_root);
    let r = run(&d);
    assert_stale(
        &r,
        &format!(
            "saved_root points to block {}, already used by the map array",
            layout.map_root
        ),
    );
    // Out of range, and a size of no words.
    let (mut d, _, _) = saved_sample(|_, _| {});
    edit_sb(&mut d, |sb| sb.saved_root = sb.metadata_blocks);
    assert_stale(&run(&d), "outside the tree area");
    let (mut d, _, _) = saved_sample(|_, _| {});
    edit_sb(&mut d, |sb| sb.saved_words = 0);
    assert_stale(&run(&d), "no entries");
    // Written after the superblock that names it.
    let spec = saved_spec();
    let (mut d, layout) = build(&spec);
    let w = good_save(&d, &layout, &spec);
    put_save(&mut d, &layout, &w, 6);
    assert_stale(&run(&d), "after the superblock (5)");
}

#[test]
fn saved_state_the_kernel_would_trust_wrongly_is_an_error() {
    type Edit = fn(&mut Vec<u64>, &fmt::Layout);
    // The entry edits add entries: keep the head's count right.
    fn with_count(edit: Edit) -> impl Fn(&mut Vec<u64>, &fmt::Layout) {
        move |w, l| {
            edit(w, l);
            let used = entries_in(w, l).len() as u64;
            w[fmt::W_TARGET_HEAD + fmt::HEAD_ENTRIES] = used;
        }
    }
    // An entry in the first empty one from `k`.
    fn add_entry(w: &mut [u64], l: &fmt::Layout, k: u64, v: u64) -> u64 {
        let g = index_geometry();
        let k = (k..g.entries())
            .find(|&k| g.entry(&w[l.target_start as usize..], k) == 0)
            .unwrap();
        set_entry(w, l, k, v);
        k
    }
    let cases: [(Edit, &str); 3] = [
        (
            |w, _| clear_bit(w, fmt::HEADER_WORDS as u64, 6),
            "1 metadata blocks the trees use are not marked used (the first is 6)",
        ),
        (
            // Past the trees (2..10), the journal (10..82) and the save.
            |w, _| set_bit(w, fmt::HEADER_WORDS as u64, 90),
            "no tree uses them (the first is 90)",
        ),
        (
            // Leaf 1 holds 123 live blocks (127..250), 36 of them
            // indexed: 88 more entries are one too many.
            |w, l| {
                let g = index_geometry();
                for i in 0..88 {
                    add_entry(w, l, i * 13, g.make_entry(1, i));
                }
            },
            "1 fingerprint leaves are named by more index entries than they hold blocks with \
             refcount > 0 (the first is 1): the index holds entries of blocks that are gone",
        ),
    ];
    for (edit, why) in cases {
        let (d, _, _) = saved_sample(with_count(edit));
        assert_wrong(&run(&d), why);
    }
    // What dd_index_saved_ok refuses: the kernel walks instead.
    let refused: [(Edit, &str); 5] = [
        (
            // Leaf 2 (PBAs 254..381) holds no live block.
            |w, l| {
                add_entry(w, l, 1, index_geometry().make_entry(2, 7));
            },
            "1 fingerprint leaves named by index entries hold no block marked used (the first \
             is 2)",
        ),
        (
            // 9 leaves: 0..8. The leaf field (4 bits) holds up to 14.
            |w, l| {
                add_entry(w, l, 600, index_geometry().make_entry(9, 7));
                add_entry(w, l, 700, index_geometry().make_entry(14, 0));
            },
            "2 index entries name a fingerprint leaf past the data device's 9 (the first is 9)",
        ),
        (
            // A tag without a leaf, in an entry straddling words 0 and 1.
            |w, l| set_entry(w, l, 2, 5 << 4),
            "1 index entries hold a tag but no leaf (entry number) (the first is 2)",
        ),
        (
            // Entry 2 starts at bit 60: its leaf field there, the rest
            // (0) in word 1, which is zero.
            |w, l| set_entry(w, l, 2, 5),
            "1 fingerprint leaves named by index entries hold no block marked used (the first \
             is 4)",
        ),
        (
            |w, _| w[fmt::W_TARGET_HEAD + fmt::HEAD_ENTRIES] = 251,
            "its head counts 251 index entries, but it marks only 250 data blocks used",
        ),
    ];
    for (edit, why) in refused {
        let (d, _, _) = saved_sample(|w, l| {
            if why.starts_with("its head") {
                edit(w, l);
            } else {
                with_count(edit)(w, l);
            }
        });
        let r = run(&d);
        assert!(r.has(saved::STALE), "{why}: {:#?}", r.problems);
        assert!(
            r.problems.iter().any(|p| p.message.contains(why)),
            "no {why:?} in {:#?}",
            r.problems
        );
    }
    // A live block swapped for a free one: the count still matches.
    let (d, _, _) = saved_sample(|w, l| {
        clear_bit(w, l.data_start, 7);
        set_bit(w, l.data_start, 290);
    });
    let r = run(&d);
    assert_eq!(codes(&r), [saved::WRONG, saved::WRONG], "{:#?}", r.problems);
    assert!(r.problems[0]
        .message
        .contains("have refcount 0 (the first is 290)"));
    assert!(r.problems[1]
        .message
        .contains("are not marked used (the first is 7): the kernel would allocate them again"));
    // Save blocks of another transaction, under a header of this one.
    let spec = saved_spec();
    let (mut d, layout) = build(&spec);
    let w = good_save(&d, &layout, &spec);
    put_save(&mut d, &layout, &w, 4);
    let r = run(&d);
    // One per block of the save.
    assert_eq!(r.errors, 3, "{:#?}", r.problems);
    assert!(r.problems.iter().all(|p| p.code == saved::WRONG));
    assert!(find(&r, saved::WRONG)
        .message
        .contains("left over from another state"));
}

#[test]
fn saved_state_is_not_compared_with_damaged_trees() {
    let (mut d, layout, _) = saved_sample(|w, _| clear_bit(w, fmt::HEADER_WORDS as u64, 6));
    let leaf = child(&d, layout.map_root, 1);
    d.block_mut(leaf)[HEADER_SIZE + 7] ^= 0x40;
    let r = run(&d);
    assert!(
        !r.has(saved::WRONG) && !r.has(saved::STALE),
        "{:#?}",
        r.problems
    );
    let s = r.saved.as_ref().unwrap();
    assert!(s.loadable && !s.compared);
    assert!(render(&r, "img").contains("loadable, not compared with the damaged trees"));
}

#[test]
fn rewritten_superblocks_drop_the_save() {
    // --clear-needs-check: the same state, next generation, no save.
    let (mut d, _, _) = saved_sample(|_, _| {});
    edit_sb(&mut d, |sb| sb.flags |= SB_NEEDS_CHECK);
    let r = run(&d);
    assert!(r.has("needs_check") && r.saved.is_some());
    // The kernel walks a flagged device's trees, whatever its save holds.
    assert!(!r.saved.as_ref().unwrap().loadable);
    assert!(r
        .problems
        .iter()
        .any(|p| p.code == saved::STALE && p.message.contains("flagged needs_check")));
    let states = read_slots(&d);
    let SlotState::Valid(cur) = &states[pick_superblock(&states).unwrap()] else {
        unreachable!()
    };
    let sb = crate::writer::clear_needs_check(&mut d, cur).unwrap();
    assert_eq!((sb.saved_root, sb.saved_words), (0, 0));
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert!(r.saved.is_none());

    // repair of a damaged map leaf: the new state names no save.
    let (mut d, layout, _) = saved_sample(|_, _| {});
    let leaf = child(&d, layout.map_root, 1);
    d.block_mut(leaf)[HEADER_SIZE + 7] ^= 0x40;
    let p = crate::repair::plan(&d, None).unwrap();
    let report = crate::repair::write(&mut d, &p).unwrap();
    assert!(report.clean(), "{:#?}", report.problems);
    let r = run(&d);
    assert!(r.saved.is_none());
    let sb = r.superblock.unwrap();
    assert_eq!((sb.generation, sb.saved_root, sb.saved_words), (6, 0, 0));
}

#[test]
fn damaged_saved_state_never_panics() {
    let (pristine, _, root) = saved_sample(|_, _| {});
    let saved_blocks = [root, child(&pristine, root, 0), child(&pristine, root, 1)];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..300 {
        let mut d = MemDev::from_bytes(pristine.bytes.clone());
        let b = saved_blocks[(rnd() % 3) as usize];
        let off = HEADER_SIZE + (rnd() % (PAYLOAD_SIZE as u64 / 8)) as usize * 8;
        let v = match rnd() % 4 {
            0 => rnd(),
            1 => rnd() % 64,
            2 => u64::MAX,
            _ => 1 << (rnd() % 64),
        };
        set64(&mut d, b, off, v);
        if rnd() % 4 == 0 {
            let w = rnd() % 2048;
            edit_sb(&mut d, |sb| sb.saved_words = w);
        }
        let r = run(&d);
        // Damage to the save alone never makes the trees wrong.
        assert!(
            r.problems.iter().all(|p| p.array == Some("saved")),
            "{:#?}",
            r.problems
        );
        let _ = render(&r, "img");
    }
}

// ---------------------------------------------------------------------
// Format version 2: the journal.

use crate::journal::tests::{contents_of, data_device, grow, shrink, Journaled};

fn collect(d: &MemDev) -> (Report, Contents) {
    let opts = CheckOptions {
        collect: true,
        ..CheckOptions::default()
    };
    let (r, c) = check(d, &opts).unwrap();
    (r, c.unwrap())
}

#[test]
fn a_nonempty_journal_checks_clean_as_replayed() {
    let mut j = Journaled::new(None);
    j.append(grow);
    j.append(shrink);
    j.append(|m| {
        for x in m.iter_mut().filter(|x| (508..1016).contains(&x.0)) {
            x.1 = (x.1 + 1) % 250;
        }
    });
    for limit in [0, 1 << 28] {
        let opts = CheckOptions {
            collect: true,
            dense_limit: Some(limit),
            ..CheckOptions::default()
        };
        let (r, c) = check(&j.dev, &opts).unwrap();
        assert!(r.problems.is_empty(), "{:#?}", r.problems);
        // The state is the last append's: entries in leaves the trees
        // have, and in leaves only the journal makes (LBA 1900, PBA 260).
        assert_eq!(c.unwrap(), contents_of(j.last()));
    }
    let r = run(&j.dev);
    let last = &j.last().sb;
    let s = r.summary.as_ref().unwrap();
    assert_eq!(s.mapped_blocks, last.mapped_blocks);
    assert_eq!(s.live_blocks, last.used_data_blocks);
    assert_eq!(s.journal_blocks, journal_size(LOGICAL, DATA));
    // The superblock is shown as it is on the disk.
    let sbi = r.superblock.as_ref().unwrap();
    assert_eq!(sbi.mapped_blocks, 1200);
    assert_eq!((sbi.version, sbi.journal_seq), (2, 1));
    let jr = r.journal.as_ref().unwrap();
    assert_eq!((jr.appends, jr.blocks_in_epoch), (3, jr.replayed_blocks));
    assert_eq!((jr.end_seq, jr.torn_blocks), (j.next_seq, 0));
    assert_eq!(jr.counters, Some(Counters::of(last)));
    let n = jr.replayed_blocks;
    let recs = jr.records;
    let text = render(&r, "img");
    let line = format!(
        "journal: 64 blocks at block 10 (id {:#018x}), epoch 1: {n} blocks follow it: 3 appends \
         replayed ({n} blocks, {recs} records); it ends at sequence {}: block {} (sequence {}) is \
         all zeros (never written)",
        j.sb.journal_id,
        j.next_seq,
        10 + j.next_seq,
        j.next_seq
    );
    assert!(text.contains(&line), "{text}");
    assert!(text.contains("result: clean, 0 warnings"), "{text}");
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["journal"]["appends"], 3);
    assert_eq!(
        json["journal"]["counters"]["mapped_blocks"],
        last.mapped_blocks
    );
}

#[test]
fn a_torn_tail_is_not_an_error() {
    let mut j = Journaled::new(None);
    j.append(grow);
    let next = j.next_state(shrink);
    let recs = j.last().changes_to(&next);
    let mut b = j.blocks_of(&recs).remove(0);
    // Its first block only, without END: the rest never reached the disk.
    b.flags = 0;
    b.used = JournalBlock::fits(&recs[..recs.len() - 1]) as u32 * 16;
    b.used = b.used.min(16 * 4);
    j.dev.write_block(b.header.blocknr, &b.encode()).unwrap();
    let (r, c) = collect(&j.dev);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(c, contents_of(&j.states[1]));
    let jr = r.journal.as_ref().unwrap();
    assert_eq!((jr.appends, jr.torn_blocks, jr.torn_records), (1, 1, 4));
    let text = render(&r, "img");
    assert!(
        text.contains(
            "then 1 block after the last END ignored (an append torn by a crash, 4 records)"
        ),
        "{text}"
    );
}

#[test]
fn a_damaged_journal_is_an_error_and_the_state_before_it_is_checked() {
    let mut j = Journaled::new(None);
    j.append(grow);
    let a2 = j.append(shrink);
    j.edit(a2, |b| b.flags |= 0x10);
    let (r, c) = collect(&j.dev);
    assert_eq!(codes(&r), ["journal_damaged"], "{:#?}", r.problems);
    let p = find(&r, "journal_damaged");
    assert_eq!((p.block, p.index), (Some(10 + a2), Some(a2)));
    assert_eq!(p.array, Some("journal"));
    assert_eq!(
        p.location(),
        format!("block {}, journal, sequence {a2}", 10 + a2)
    );
    assert!(p.message.contains("unknown flags 0x10"), "{}", p.message);
    assert!(p.message.contains("refuses to activate"), "{}", p.message);
    // The invariants hold on the state before the damaged append.
    assert_eq!(c, contents_of(&j.states[1]));
    assert!(render(&r, "img").contains(&format!(
        "then damage at sequence {a2} (block {}): replayed up to the append that starts at \
         sequence {a2}",
        10 + a2
    )));
    // An append whose records break an invariant: checked after replay.
    let mut k = Journaled::new(None);
    let mut sb = k.last().sb.clone();
    sb.mapped_blocks += 1;
    k.append_records(&[
        Record::Map { lba: 5, value: 1 },
        Record::Counters(Counters::of(&sb)),
    ]);
    let r = run(&k.dev);
    assert_eq!(
        codes(&r),
        ["refcount_mismatch", "counter_mismatch"],
        "{:#?}",
        r.problems
    );
    let p = find(&r, "refcount_mismatch");
    assert!(
        p.message.contains("refcount is 5 but 6 map entries"),
        "{}",
        p.message
    );
    // The counters are the journal's.
    assert!(find(&r, "counter_mismatch")
        .message
        .contains("refcounts sum to 1200 but the superblock says mapped_blocks 1201"));
    // A live block the journal leaves without a fingerprint: none in a
    // leaf only the journal would make.
    let mut k = Journaled::new(None);
    let mut sb = k.last().sb.clone();
    sb.mapped_blocks += 1;
    sb.used_data_blocks += 1;
    k.append_records(&[
        Record::Map {
            lba: 1990,
            value: 291,
        },
        Record::Refcount { pba: 290, count: 1 },
        Record::Counters(Counters::of(&sb)),
    ]);
    let r = run(&k.dev);
    assert_eq!(codes(&r), ["missing_fingerprint"], "{:#?}", r.problems);
    assert_eq!(find(&r, "missing_fingerprint").index, Some(290));
}

#[test]
fn journal_fields_and_run_are_checked() {
    // Version 1 with journal fields: the kernel refuses it.
    let (mut d, layout) = sample();
    edit_sb(&mut d, |sb| {
        sb.version = FORMAT_VERSION_V1;
        sb.journal_id = 0;
    });
    let r = run(&d);
    assert_eq!(codes(&r), ["journal_run"], "{:#?}", r.problems);
    assert!(find(&r, "journal_run")
        .message
        .contains("version 1 has no journal"));
    assert!(render(&r, "img").contains("journal: none (format version 1"));
    // Version 1 without: clean, no journal counted.
    edit_sb(&mut d, |sb| {
        sb.journal_start = 0;
        sb.journal_blocks = 0;
        sb.journal_seq = 0;
    });
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert!(r.journal.is_none());
    assert_eq!(
        r.summary.unwrap().metadata_blocks_used,
        2 + layout.tree_blocks
    );
    // Version 2 with a short run, or one past the device's end.
    for (f, why) in [
        (
            (|sb: &mut Superblock| sb.journal_blocks = 8) as fn(&mut Superblock),
            "fewer than 16",
        ),
        (
            |sb| sb.journal_start = sb.metadata_blocks - 10,
            "not inside",
        ),
        (|sb| sb.journal_id = 0, "id is 0"),
    ] {
        let (mut d, _) = sample();
        edit_sb(&mut d, f);
        let r = run(&d);
        assert_eq!(codes(&r), ["journal_run"], "{why}: {:#?}", r.problems);
        assert!(find(&r, "journal_run").message.contains(why));
        assert!(r.journal.is_none());
        assert!(render(&r, "img").contains("journal: unusable"));
    }
    // A run over the trees: every tree block in it is an error.
    let (mut d, layout) = sample();
    edit_sb(&mut d, |sb| sb.journal_start = 2);
    let r = run(&d);
    assert!(!r.clean());
    let p = find(&r, "journal_overlap");
    assert!(
        p.message.contains("inside the journal's run [2, 66)"),
        "{}",
        p.message
    );
    assert_eq!(r.errors, 3, "the three roots: {:#?}", r.problems);
    assert!(r
        .problems
        .iter()
        .all(|p| p.code == "journal_overlap" || p.code == "refcounts_unverified"));
    assert_eq!(layout.journal_blocks, 64);
    assert!(layout.map_root < 66);
}

#[test]
fn a_save_with_a_journal_after_it_is_stale() {
    let (mut d, layout, _) = saved_sample(|_, _| {});
    // Its bitmap may mark the journal's run, as the kernel's does.
    let spec = saved_spec();
    let mut w = good_save(&d, &layout, &spec);
    for b in layout.journal_start..layout.journal_start + layout.journal_blocks {
        set_bit(&mut w, fmt::HEADER_WORDS as u64, b);
    }
    put_save(&mut d, &layout, &w, spec.sb.generation());
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert!(r.saved.as_ref().unwrap().compared);
    // An append after the superblock that names it: the kernel replays
    // and commits instead of loading it.
    let mut sb = Superblock::decode(d.block(1));
    let mut next = spec.clone();
    next.sb.unique_writes += 1;
    let recs = spec.changes_to(&next);
    crate::writer::write_append(&mut d, &sb, sb.journal_seq, 6, &recs).unwrap();
    let r = run(&d);
    assert_stale(&r, "the journal after its superblock holds 1 append");
    // Only a torn block: the state is the save's, it still loads.
    let (mut d, _, _) = saved_sample(|_, _| {});
    sb = Superblock::decode(d.block(1));
    let mut b = crate::writer::append_blocks(&sb, sb.journal_seq, 6, &recs).remove(0);
    b.flags = 0;
    d.write_block(b.header.blocknr, &b.encode()).unwrap();
    let r = run(&d);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert!(r.saved.as_ref().unwrap().loadable);
}

fn check_data(d: &MemDev, data: &MemDev) -> Result<(Report, Contents), Fatal> {
    let opts = CheckOptions {
        collect: true,
        ..CheckOptions::default()
    };
    check_with_data(d, Some(data), &opts).map(|(r, c)| (r, c.unwrap()))
}

#[test]
fn an_unflushed_newest_append_is_checked_with_data() {
    let mut j = Journaled::with_data();
    j.append(shrink);
    let a2 = j.append(grow);
    j.mark_unflushed(a2);
    let last = j.next_seq - 1;
    let what = format!("newest append (sequence {a2}..{last}) unflushed");
    // Without the data device: applied, and said not to be checked.
    let (r, c) = collect(&j.dev);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(c, contents_of(&j.states[2]));
    let text = render(&r, "img");
    assert!(
        text.contains(&format!(
            "{what}: not checked against the data (no data device), applied; it ends"
        )),
        "{text}"
    );
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["journal"]["unflushed"]["outcome"], "unchecked");
    assert_eq!(json["journal"]["unflushed"]["first_seq"], a2);
    // With it, the data there: checked, applied.
    let data = data_device();
    let (r, c) = check_data(&j.dev, &data).unwrap();
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(c, contents_of(&j.states[2]));
    assert!(render(&r, "img").contains(&format!("{what}: its data checked, applied")));
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["journal"]["unflushed"]["outcome"], "applied");
    assert_eq!(json["journal"]["appends"], 2);
    // A block it makes live without its data: dropped, not an error; the
    // state checked is the one before it.
    let mut data = data_device();
    data.block_mut(258)[0] ^= 0x10;
    let (r, c) = check_data(&j.dev, &data).unwrap();
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(c, contents_of(&j.states[1]));
    let jr = r.journal.as_ref().unwrap();
    assert_eq!(jr.appends, 1);
    assert_eq!(jr.counters, Some(Counters::of(&j.states[1].sb)));
    assert!(render(&r, "img").contains(&format!(
        "{what}: data block 258 does not hold its fingerprint: dropped, as the kernel does (it \
         was never acknowledged)"
    )));
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["journal"]["unflushed"]["outcome"], "dropped");
    assert_eq!(json["journal"]["unflushed"]["mismatch"], 258);
    // A data block the check needs that cannot be read: operational.
    let data = BadSector {
        inner: data_device(),
        bad: 252,
    };
    let opts = CheckOptions::default();
    let e = check_with_data(&j.dev, Some(&data), &opts).unwrap_err();
    assert!(
        e.0.contains("data block 252 cannot be read: injected read error"),
        "{e}"
    );
}

#[test]
fn unflushed_under_a_superblock_without_the_flag_is_damage() {
    let mut j = Journaled::new(None);
    j.append(shrink);
    let a2 = j.append(grow);
    j.mark_unflushed(a2);
    let (r, c) = collect(&j.dev);
    assert_eq!(codes(&r), ["journal_damaged"], "{:#?}", r.problems);
    assert!(find(&r, "journal_damaged")
        .message
        .contains("UNFLUSHED, under a superblock without UNFLUSHED_APPENDS"));
    assert_eq!(c, contents_of(&j.states[1]));
    assert!(r.journal.unwrap().unflushed.is_none());
}

#[test]
fn clearing_needs_check_keeps_unflushed_appends() {
    let mut j = Journaled::with_data();
    let a1 = j.append(grow);
    j.mark_unflushed(a1);
    edit_sb(&mut j.dev, |sb| sb.flags |= SB_NEEDS_CHECK);
    let r = run(&j.dev);
    assert_eq!(codes(&r), ["needs_check"], "{:#?}", r.problems);
    let states = read_slots(&j.dev);
    let SlotState::Valid(cur) = &states[pick_superblock(&states).unwrap()] else {
        unreachable!()
    };
    let sb = crate::writer::clear_needs_check(&mut j.dev, cur).unwrap();
    assert_eq!(sb.flags, SB_UNFLUSHED_APPENDS);
    // The same journal follows it, its unflushed append still allowed.
    let (r, c) = collect(&j.dev);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(c, contents_of(&j.states[1]));
    let u = r.journal.unwrap().unflushed.unwrap();
    assert_eq!(u.first_seq, a1);
}

#[test]
fn damaged_ranges_are_searched_at_their_edges() {
    let mut d = Damaged::default();
    assert!(!d.contains(0));
    // In index order, as the depth-first walk adds them; an empty range
    // is not added, and one that touches the last is merged with it.
    for r in [(10, 20), (20, 25), (30, 31), (40, 40), (100, 508)] {
        d.add(r);
    }
    assert_eq!(d.0, [(10, 25), (30, 31), (100, 508)]);
    assert_eq!(d.entries(), 15 + 1 + 408);
    for (i, want) in [
        (0, false),
        (9, false),
        (10, true),
        (19, true),
        (20, true),
        (24, true),
        (25, false),
        (29, false),
        (30, true),
        (31, false),
        (40, false),
        (99, false),
        (100, true),
        (507, true),
        (508, false),
        (u64::MAX, false),
    ] {
        assert_eq!(d.contains(i), want, "{i}");
    }
    // Out of order or overlapping (not from the walk): still sorted and
    // disjoint, each entry counted once.
    d.add((0, 5));
    d.add((15, 35));
    d.add((500, 600));
    assert_eq!(d.0, [(0, 5), (10, 35), (100, 600)]);
    assert_eq!(d.entries(), 5 + 25 + 500);
    assert!(d.contains(4) && !d.contains(5) && d.contains(34) && !d.contains(35));
    assert!(d.contains(599) && !d.contains(600));
}

#[test]
fn saved_state_line_does_not_depend_on_the_listed_problems() {
    let (mut d, _, _) = saved_sample(|w, _| clear_bit(w, fmt::HEADER_WORDS as u64, 6));
    // A damaged other slot: a warning listed before the save's error.
    let other = 1 - pick_superblock(&read_slots(&d)).unwrap() as u64;
    d.block_mut(other)[100] = 1;
    let opts = CheckOptions {
        max_problems: 1,
        ..CheckOptions::default()
    };
    let r = check(&d, &opts).unwrap().0;
    assert_eq!(codes(&r), ["other_slot_bad"], "{:#?}", r.problems);
    assert_eq!((r.errors, r.unlisted_problems), (1, 1));
    assert!(r.saved.as_ref().unwrap().differs);
    let text = render(&r, "img");
    assert!(text.contains("loadable, differs from the trees"), "{text}");
    // All listed: the same line.
    let r = run(&d);
    assert!(r.has(saved::WRONG));
    assert!(render(&r, "img").contains("loadable, differs from the trees"));
    // A save that matches says so.
    let (d, _, _) = saved_sample(|_, _| {});
    let r = run(&d);
    assert!(!r.saved.as_ref().unwrap().differs);
    assert!(render(&r, "img").contains("loadable, matches the trees"));
}

/// A walker over `d` with nothing walked yet, for tests of one step.
fn bare_walker<'a>(d: &'a MemDev, sb: &'a Superblock) -> Walker<'a> {
    Walker {
        dev: d,
        sb,
        table: Table::of(sb),
        overlay: Overlay::default(),
        journal_appends: 0,
        problems: Problems {
            list: Vec::new(),
            max: 0,
            errors: 0,
            warnings: 0,
            unlisted: 0,
        },
        owner: vec![0; sb.metadata_blocks as usize],
        counts: Counts::new(sb.data_blocks, DENSE_LIMIT),
        live: Live::new(sb.data_blocks, DENSE_LIMIT),
        damaged: Default::default(),
        summary: Summary::default(),
        fp_size: FP_SIZE,
        contents: None,
        fps: Vec::new(),
        first_placeholder: 0,
        data: None,
        unverified: Vec::new(),
        saved: None,
    }
}

#[test]
fn refcount_sum_saturates() {
    let (d, _) = sample();
    let sb = Superblock::decode(d.block(pick_superblock(&read_slots(&d)).unwrap() as u64));
    let mut w = bare_walker(&d, &sb);
    // Damaged refcounts can sum past 2^64 (2^32 blocks of refcount
    // 2^32 - 1): the sum stops at the top, which no mapped_blocks matches.
    w.summary.refcount_sum = u64::MAX - 10;
    w.refcount_entry(0, u32::MAX, None);
    w.refcount_entry(1, 1, None);
    assert_eq!(w.summary.refcount_sum, u64::MAX);
    assert_eq!(w.summary.live_blocks, 2);
    w.finish();
    assert!(w.problems.list.iter().any(|p| p.code == "counter_mismatch"
        && p.message.contains("refcounts sum to 18446744073709551615")));
}
