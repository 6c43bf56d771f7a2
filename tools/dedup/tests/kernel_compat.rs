//! Cross-checks with the kernel's own metadata code.
//!
//! tools/kernel-compat builds dm-dedup's dedup-metadata.c,
//! dedup-journal.c, dedup-saved.c, dedup-array.c, dedup-block.c,
//! dedup-space.c and dedup-reserve.c (unchanged, from ../dm-dedup) in
//! userspace over a small stand-in for dm-bufio. These tests then check that:
//! - the kernel's dd_format() and `dedup format` write identical bytes
//!   (given the kernel's random journal id), and refuse the same devices;
//! - what the kernel writes through many transactions (new, duplicate and
//!   zero writes, discards, commits; and a crash with a written but
//!   uncommitted transaction) checks clean, with the same map and counts;
//! - the kernel activates what `dedup restore` writes (all of
//!   dd_activate()'s checks), reads the same map back, and keeps working
//!   on it;
//! - the kernel and `dedup check` draw the transaction id limit
//!   (DD_MAX_TXN) at the same place: a superblock at it is activated,
//!   one above it refused by both;
//! - the kernel refuses metadata with damaged leaves, activates what
//!   `dedup repair` makes of it (placeholder fingerprints included), reads
//!   back every salvaged mapping, and keeps working on it;
//! - the state the kernel saves at a clean close (dd_md_save, with an
//!   index part in the target's layout) checks clean and loadable, the
//!   kernel loads it in place of a walk with the same state, and its next
//!   commit drops it; an index entry naming no leaf of the device makes
//!   both refuse it;
//! - a device the kernel grew checks clean at its new sizes;
//! - the journal the kernel gives a version 1 device is the one the tools'
//!   writer would make on it;
//! - what the kernel leaves in its journal (appends between commits, a
//!   ring wrapped many times, a crash after more changes, a torn last
//!   block) `dedup check` replays to the state the kernel replays to,
//!   read-only in memory and read-write into the trees.
//!
//! They fail (with a message) when the C compiler or ../dm-dedup is
//! missing.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use dedup_tools::check::{check, CheckOptions, Contents, Report};
use dedup_tools::device::MemDev;
use dedup_tools::dump::{
    parse_dump, restore_to, validate, write_dump_with_journal, Dump, DumpSuperblock,
};
use dedup_tools::ondisk::*;

fn harness() -> Option<&'static Path> {
    static H: OnceLock<Option<PathBuf>> = OnceLock::new();
    H.get_or_init(|| {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        let kdir = manifest.join("../../dm-dedup");
        let shim = manifest.join("../kernel-compat");
        if !kdir.join("dedup-metadata.c").exists() {
            panic!("kernel sources not found at {}", kdir.display());
        }
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dedup-kernel-harness");
        let mut cmd = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()));
        cmd.args(["-O1", "-g", "-Wall", "-Wno-unused-function", "-o"])
            .arg(&out)
            .arg("-I")
            .arg(&shim)
            .arg("-I")
            .arg(&kdir)
            .arg(shim.join("kshim.c"))
            .arg(shim.join("harness.c"));
        for f in [
            "dedup-block.c",
            "dedup-array.c",
            "dedup-space.c",
            "dedup-reserve.c",
            "dedup-metadata.c",
            "dedup-journal.c",
            "dedup-saved.c",
        ] {
            cmd.arg(kdir.join(f));
        }
        match cmd.output() {
            Err(e) => panic!("kernel_compat needs a C compiler (cc or $CC): {e}"),
            Ok(o) if !o.status.success() => {
                panic!(
                    "the kernel metadata code does not build in userspace:\n{}",
                    String::from_utf8_lossy(&o.stderr)
                );
            }
            Ok(_) => Some(out),
        }
    })
    .as_deref()
}

struct Tmp(PathBuf);

impl Tmp {
    fn new(name: &str) -> Tmp {
        let p = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("kc-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        Tmp(p)
    }
    fn file(&self, name: &str, bytes: u64) -> PathBuf {
        let p = self.0.join(name);
        fs::File::create(&p).unwrap().set_len(bytes).unwrap();
        p
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// What the harness printed: the map and the stats line.
#[derive(Debug)]
struct Out {
    map: Vec<(u64, u64)>,
    stats: BTreeMap<String, u64>,
}

fn run(h: &Path, args: &[&str]) -> Result<Out, String> {
    let o = Command::new(h)
        .args(args)
        .env("KSHIM_TIME", "1700000000")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    if !o.status.success() {
        return Err(format!("{text}{}", String::from_utf8_lossy(&o.stderr)));
    }
    let mut out = Out {
        map: Vec::new(),
        stats: BTreeMap::new(),
    };
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("stats ") {
            for kv in rest.split_whitespace() {
                let (k, v) = kv.split_once('=').unwrap();
                out.stats.insert(k.into(), v.parse().unwrap());
            }
        } else {
            let (a, b) = line.split_once(' ').unwrap();
            out.map.push((a.parse().unwrap(), b.parse().unwrap()));
        }
    }
    Ok(out)
}

fn check_file(p: &Path) -> (Report, Contents) {
    let d = MemDev::from_bytes(fs::read(p).unwrap());
    let opts = CheckOptions {
        collect: true,
        ..CheckOptions::default()
    };
    let (r, c) = check(&d, &opts).unwrap();
    (r, c.unwrap())
}

/// The counters of the state `dedup check` checked: those of the last
/// COUNTERS record its replay of the journal applied, or the superblock's
/// when it applied none.
fn state_counters(r: &Report) -> Counters {
    if let Some(c) = r.journal.as_ref().and_then(|j| j.counters) {
        return c;
    }
    let sb = r.superblock.as_ref().unwrap();
    Counters {
        mapped_blocks: sb.mapped_blocks,
        used_data_blocks: sb.used_data_blocks,
        unique_writes: sb.unique_writes,
        duplicate_writes: sb.duplicate_writes,
        zero_writes: sb.zero_writes,
        discarded_blocks: sb.discarded_blocks,
    }
}

/// Journal blocks `dedup check` replayed (in whole appends).
fn replayed(r: &Report) -> u64 {
    r.journal.as_ref().map_or(0, |j| j.replayed_blocks)
}

/// The state the kernel printed is the one `dedup check` checked (with
/// the journal replayed), and that state is clean.
fn assert_agrees(r: &Report, c: &Contents, out: &Out) {
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert_eq!(c.mappings, out.map);
    assert_counters(r, out);
    // A replayed journal leaves blocks in the kernel's running transaction
    // (or its in-memory view) that the trees on the disk do not name.
    if replayed(r) == 0 {
        let s = r.summary.as_ref().unwrap();
        assert_eq!(s.metadata_blocks_used, out.stats["metadata_used"]);
    }
}

/// The counters and the generation of the state `dedup check` checked
/// are the kernel's.
fn assert_counters(r: &Report, out: &Out) {
    let s = r.summary.as_ref().unwrap();
    let sb = r.superblock.as_ref().unwrap();
    let k = state_counters(r);
    assert_eq!(s.mapped_blocks, out.stats["mapped"]);
    assert_eq!(s.live_blocks, out.stats["live"]);
    assert_eq!(sb.generation, out.stats["txn"]);
    assert_eq!(
        k,
        Counters {
            mapped_blocks: out.stats["mapped"],
            used_data_blocks: out.stats["live"],
            unique_writes: out.stats["unique"],
            duplicate_writes: out.stats["duplicate"],
            zero_writes: out.stats["zero"],
            discarded_blocks: out.stats["discarded"],
        }
    );
}

/// Metadata file `name` in `t`, sized for `logical` and `data` blocks (16
/// to spare), after the harness's `workload` on it with `args` (seed,
/// operations, commit every[, written but never committed]).
fn workload_image(
    h: &Path,
    t: &Tmp,
    name: &str,
    logical: u64,
    data: u64,
    args: &[&str],
) -> (PathBuf, Out) {
    image_after(h, t, name, "workload", logical, data, args)
}

/// workload_image with the harness command `cmd` (`workload`, `save` or
/// `journal`).
fn image_after(
    h: &Path,
    t: &Tmp,
    name: &str,
    cmd: &str,
    logical: u64,
    data: u64,
    args: &[&str],
) -> (PathBuf, Out) {
    let m = t.file(name, (required_blocks(logical, data) + 16) * 4096);
    let (l, d) = (logical.to_string(), data.to_string());
    let mut argv = vec![cmd, m.to_str().unwrap(), &l, &d];
    argv.extend_from_slice(args);
    let out = run(h, &argv).unwrap();
    (m, out)
}

/// What `dedup dump` makes of the clean metadata in `p`, written and read
/// back as JSON through the library as the CLI does: the state with the
/// journal replayed.
fn dump_of(p: &Path) -> Dump {
    let (r, c) = check_file(p);
    assert!(r.clean());
    let dev = MemDev::from_bytes(fs::read(p).unwrap());
    let sb = Superblock::decode(dev.block(r.superblock.unwrap().slot));
    let (dsb, journal) = DumpSuperblock::of_state(&dev, &sb);
    let mut json = Vec::new();
    write_dump_with_journal(&mut json, &dsb, &c, journal.as_ref()).unwrap();
    parse_dump(&json[..]).unwrap()
}

#[test]
fn kernel_format_equals_dedup_format() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("format");
    let bin = env!("CARGO_BIN_EXE_dedup");
    // (logical, data, metadata blocks): exactly required_blocks (for the
    // smallest sizes, the smallest journal), more than that (the room
    // beyond it stays free), a journal of 312 blocks, and the longest one.
    for (logical, data, blocks) in [
        (20_000u64, 5_000u64, 1024u64),
        (1, 1, required_blocks(1, 1)),
        (300_000, 3_000, 2000),
        (1 << 20, 1 << 18, required_blocks(1 << 20, 1 << 18)),
    ] {
        let (l, d) = (logical.to_string(), data.to_string());
        let k = t.file("k", blocks * 4096);
        let u = t.file("u", blocks * 4096);
        let out = run(h, &["open", k.to_str().unwrap(), &l, &d]).unwrap();
        assert_eq!(out.stats["txn"], 1);
        let kernel = fs::read(&k).unwrap();
        // The kernel's journal: at block 2, as long as the sizes ask for,
        // with a random id (superblock slot 1, offset 232).
        let sb = &kernel[4096..8192];
        assert_eq!(le64(sb, 208), 2);
        assert_eq!(le64(sb, 216), journal_size(logical, data));
        let id = le64(sb, 232);
        assert_ne!(id, 0);
        let o = Command::new(bin)
            .args(["format", u.to_str().unwrap(), "--format-time", "1700000000"])
            .args(["--data-blocks", &d, "--logical-blocks", &l])
            .args(["--journal-id", &id.to_string()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        // The kernel's superblock has UNFLUSHED_APPENDS (it writes every
        // one with a journal so); the tools write it clear, since their
        // journal is empty. Otherwise the same bytes.
        let mut kernel = kernel;
        let slot: &mut [u8] = &mut kernel[4096..8192];
        assert_eq!(le32(slot, 108), SB_UNFLUSHED_APPENDS, "{logical}/{data}");
        slot[108..112].copy_from_slice(&0u32.to_le_bytes());
        seal(slot.try_into().unwrap());
        assert!(
            kernel == fs::read(&u).unwrap(),
            "{logical}/{data}: bytes differ"
        );
        // and the kernel activates what dedup format wrote
        run(h, &["open", u.to_str().unwrap(), &l, &d]).unwrap();

        // One block less than required_blocks: both refuse to format.
        let need = required_blocks(logical, data);
        let k = t.file("k", (need - 1) * 4096);
        let err = run(h, &["open", k.to_str().unwrap(), &l, &d]).unwrap_err();
        assert!(err.contains("metadata device too small"), "{err}");
        assert!(err.contains(&format!("({need} blocks)")), "{err}");
        let o = Command::new(bin)
            .args(["format", k.to_str().unwrap(), "--data-blocks", &d])
            .args(["--logical-blocks", &l])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(8));
        let msg = String::from_utf8_lossy(&o.stderr);
        assert!(msg.contains(&format!("({need} blocks of 4 KiB)")), "{msg}");
        assert!(fs::read(&k).unwrap().iter().all(|&b| b == 0));
    }
}

#[test]
fn kernel_workloads_check_clean() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("workload");
    // (logical, data, ops, commit every): small data devices fill up and
    // exercise frees; 300000 logical blocks make a two-level map.
    for (i, (logical, data, ops, every)) in [
        (20_000u64, 5_000u64, 20_000u64, 500u64),
        (4_000, 600, 15_000, 97),
        (300_000, 3_000, 12_000, 1_000),
        (2_000, 2_000, 5_000, 1),
    ]
    .into_iter()
    .enumerate()
    {
        let (m, out) = workload_image(
            h,
            &t,
            &format!("m{i}"),
            logical,
            data,
            &[&(i + 1).to_string(), &ops.to_string(), &every.to_string()],
        );
        let (l, d) = (logical.to_string(), data.to_string());
        assert!(out.stats["mapped"] > 0 && out.stats["mapped"] > out.stats["live"]);
        let (r, c) = check_file(&m);
        assert_agrees(&r, &c, &out);
        // The kernel reads the same map back after reactivation.
        let again = run(h, &["map", m.to_str().unwrap(), &l, &d]).unwrap();
        assert_eq!(again.map, out.map);
    }
}

/// A device the kernel grew (a larger table over the same metadata) checks
/// clean at its new sizes with the old map intact, and keeps working: the
/// map goes from one level to two, the refcounts from one leaf to three.
#[test]
fn kernel_grown_metadata_checks_clean() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("grow");
    let (small_l, small_d, big_l, big_d) = (2_000u64, 600u64, 300_000u64, 3_000u64);
    let m = t.file("m", (required_blocks(big_l, big_d) + 16) * 4096);
    let ms = m.to_str().unwrap();
    let (sl, sd, bl, bd) = (
        small_l.to_string(),
        small_d.to_string(),
        big_l.to_string(),
        big_d.to_string(),
    );
    let before = run(h, &["workload", ms, &sl, &sd, "5", "4000", "300"]).unwrap();
    let refused = run(h, &["map", ms, &bl, &bd]).unwrap_err();
    assert!(
        refused.contains("cannot grow a read-only device"),
        "{refused}"
    );

    let grown = run(h, &["open", ms, &bl, &bd]).unwrap();
    assert_eq!(grown.stats["txn"], before.stats["txn"] + 1);
    let (r, c) = check_file(&m);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    let sb = r.superblock.as_ref().unwrap();
    assert_eq!((sb.logical_blocks, sb.data_blocks), (big_l, big_d));
    assert_eq!(c.mappings, before.map);

    let after = run(h, &["workload", ms, &bl, &bd, "6", "8000", "700"]).unwrap();
    assert!(after.map.iter().any(|&(l, p)| l >= small_l && p >= small_d));
    let (r, c) = check_file(&m);
    assert_agrees(&r, &c, &after);
    let shrunk = run(h, &["open", ms, &sl, &bd]).unwrap_err();
    assert!(
        shrunk.contains("cannot shrink the logical size"),
        "{shrunk}"
    );
}

/// The kernel's needs_check flag and the tools' clearing of it: a flagged
/// device opens read-only in the kernel (no commit at open), `dedup check`
/// warns, `--clear-needs-check` clears it, and the kernel opens it
/// read-write again with the same map.
#[test]
fn needs_check_set_by_kernel_cleared_by_check() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("needs-check");
    let (m, out) = workload_image(h, &t, "m", 3_000, 900, &["9", "3000", "250"]);
    let (ms, l, d) = (m.to_str().unwrap(), "3000", "900");
    let flagged = run(h, &["flag", ms, l, d]).unwrap();
    assert_eq!(flagged.stats["needs_check"], 1);
    let gen = flagged.stats["txn"];
    let again = run(h, &["open", ms, l, d]).unwrap();
    assert_eq!((again.stats["needs_check"], again.stats["txn"]), (1, gen));
    let (r, c) = check_file(&m);
    assert!(r.clean() && r.has("needs_check"), "{:#?}", r.problems);
    assert_eq!(c.mappings, out.map);

    let bin = env!("CARGO_BIN_EXE_dedup");
    let o = Command::new(bin)
        .args(["check", "--clear-needs-check", ms])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let opened = run(h, &["open", ms, l, d]).unwrap();
    // cleared as gen + 1; the read-write open commits once more
    assert_eq!(
        (opened.stats["needs_check"], opened.stats["txn"]),
        (0, gen + 2)
    );
    let (r, c) = check_file(&m);
    assert!(r.clean() && !r.has("needs_check"), "{:#?}", r.problems);
    assert_eq!(c.mappings, out.map);
}

#[test]
fn kernel_crash_leaves_the_last_commit() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("crash");
    let (logical, data) = (6_000u64, 1_500u64);
    let (l, d) = (logical.to_string(), data.to_string());
    // 4000 operations and a commit, then 3000 more written but never
    // committed: blocks of the lost transaction are all over the device.
    let (m, out) = workload_image(h, &t, "m", logical, data, &["7", "4000", "400", "3000"]);
    let (r, c) = check_file(&m);
    assert_agrees(&r, &c, &out);
    let again = run(h, &["map", m.to_str().unwrap(), &l, &d]).unwrap();
    assert_eq!(again.map, out.map);
}

#[test]
fn kernel_opens_restored_metadata() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("restore");
    let (logical, data) = (30_000u64, 4_000u64);
    let (l, d) = (logical.to_string(), data.to_string());
    let (src, out) = workload_image(h, &t, "src", logical, data, &["3", "20000", "700"]);
    let blocks = fs::metadata(&src).unwrap().len() / 4096;

    // dump -> JSON -> restore, through the library as the CLI does.
    let spec = validate(&dump_of(&src), None, 10).unwrap();
    let mut dev = MemDev::new(blocks + 100);
    restore_to(&mut dev, spec, false).unwrap();
    let dst = t.0.join("dst");
    fs::write(&dst, &dev.bytes).unwrap();

    // The kernel activates it and reads the same map and counters.
    let back = run(h, &["map", dst.to_str().unwrap(), &l, &d]).unwrap();
    assert_eq!(back.map, out.map);
    for k in [
        "txn",
        "mapped",
        "live",
        "unique",
        "duplicate",
        "zero",
        "discarded",
    ] {
        assert_eq!(back.stats[k], out.stats[k], "{k}");
    }
    // It keeps working on it (copy-on-write over the restored trees), and
    // the result checks clean again.
    let more = run(
        h,
        &[
            "workload",
            dst.to_str().unwrap(),
            &l,
            &d,
            "4",
            "8000",
            "300",
        ],
    )
    .unwrap();
    let (r, c) = check_file(&dst);
    assert_agrees(&r, &c, &more);
}

#[test]
fn transaction_id_limit_is_the_kernels() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("txn-limit");
    let (logical, data) = (5_000u64, 1_000u64);
    let (l, d) = (logical.to_string(), data.to_string());
    let (src, out) = workload_image(h, &t, "src", logical, data, &["6", "3000", "100"]);
    let blocks = fs::metadata(&src).unwrap().len() / 4096;
    let dump = dump_of(&src);

    // Restored at exactly DD_MAX_TXN: the kernel activates it and reads
    // the same map.
    let spec = validate(&dump, Some(MAX_TXN), 10).unwrap();
    let mut dev = MemDev::new(blocks);
    restore_to(&mut dev, spec, false).unwrap();
    let m = t.0.join("m");
    fs::write(&m, &dev.bytes).unwrap();
    let back = run(h, &["map", m.to_str().unwrap(), &l, &d]).unwrap();
    assert_eq!(back.map, out.map);
    assert_eq!(back.stats["txn"], MAX_TXN);

    // One above (the tools never write it; forged here): refused by both.
    let mut over = Superblock::decode(dev.block(MAX_TXN % SB_SLOTS));
    over.header.txn = MAX_TXN + 1;
    *dev.block_mut(over.slot()) = *over.encode();
    fs::write(&m, &dev.bytes).unwrap();
    let err = run(h, &["open", m.to_str().unwrap(), &l, &d]).unwrap_err();
    assert!(err.contains("refused"), "{err}");
    assert!(err.contains("transaction id near the 2^64 limit"), "{err}");
    let (r, _) = check_file(&m);
    let codes: Vec<_> = r.problems.iter().map(|p| p.code).collect();
    assert_eq!(codes, ["txn_too_large"]);
    // restore refuses to write it.
    assert!(validate(&dump, Some(MAX_TXN + 1), 10).is_err());
}

#[test]
fn damage_is_refused_by_both() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("damage");
    let (logical, data) = (5_000u64, 1_000u64);
    let (l, d) = (logical.to_string(), data.to_string());
    let (m, _) = workload_image(h, &t, "m", logical, data, &["5", "3000", "100"]);
    let (r, _) = check_file(&m);
    let sb = r.superblock.unwrap();
    let pristine = fs::read(&m).unwrap();
    // A refcount or fingerprint leaf with a flipped bit: the kernel's
    // activation reads these arrays whole (the map's leaves it skips).
    for root in [sb.refcount_root, sb.fingerprint_root] {
        let mut bytes = pristine.clone();
        bytes[root as usize * 4096 + 3000] ^= 4;
        fs::write(&m, &bytes).unwrap();
        let err = run(h, &["open", m.to_str().unwrap(), &l, &d]).unwrap_err();
        assert!(err.contains("refused"), "{err}");
        let (r, _) = check_file(&m);
        assert!(r.has("bad_checksum"), "{:#?}", r.problems);
    }
}

#[test]
fn kernel_opens_repaired_metadata() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("repair");
    let (logical, data) = (30_000u64, 4_000u64);
    let (l, d) = (logical.to_string(), data.to_string());
    let (m, out) = workload_image(h, &t, "m", logical, data, &["9", "20000", "700"]);
    let (r, _) = check_file(&m);
    let sb = r.superblock.unwrap();
    let mut dev = MemDev::from_bytes(fs::read(&m).unwrap());
    // The map has one interior level: damage its fourth leaf (LBAs
    // 1524..2032), and the second fingerprint leaf (PBAs 127..254).
    let child = |dev: &MemDev, b: u64, slot: usize| le64(&dev.block(b)[..], HEADER_SIZE + slot * 8);
    let map_leaf = child(&dev, sb.map_root, 3);
    let fp_leaf = child(&dev, sb.fingerprint_root, 1);
    assert!(map_leaf != 0 && fp_leaf != 0);
    dev.block_mut(map_leaf)[2000] ^= 8;
    dev.block_mut(fp_leaf)[2000] ^= 8;
    fs::write(&m, &dev.bytes).unwrap();
    let err = run(h, &["open", m.to_str().unwrap(), &l, &d]).unwrap_err();
    assert!(err.contains("refused"), "{err}");

    let p = dedup_tools::repair::plan(&dev, None).unwrap();
    assert!(p.summary.placeholders > 0);
    let report = dedup_tools::repair::write(&mut dev, &p).unwrap();
    assert!(report.clean(), "{:#?}", report.problems);
    fs::write(&m, &dev.bytes).unwrap();

    // The kernel activates it and reads every salvaged mapping.
    let back = run(h, &["map", m.to_str().unwrap(), &l, &d]).unwrap();
    let want: Vec<(u64, u64)> = out
        .map
        .iter()
        .copied()
        .filter(|&(lba, _)| !(1524..2032).contains(&lba))
        .collect();
    assert!(want.len() < out.map.len());
    assert_eq!(back.map, want);
    assert_eq!(back.stats["txn"], sb.generation + 1);
    assert_eq!(back.stats["mapped"], want.len() as u64);
    // It keeps working on it, frees blocks with placeholder records, and
    // the result checks clean again (still pointing out the placeholders
    // of blocks that are live).
    let more = run(
        h,
        &["workload", m.to_str().unwrap(), &l, &d, "10", "8000", "300"],
    )
    .unwrap();
    let (mut r, c) = check_file(&m);
    let left = r.summary.as_ref().unwrap().placeholder_fingerprints;
    assert!(left > 0 && left < p.summary.placeholders);
    r.problems.retain(|p| p.code != "placeholder_fingerprint");
    assert_agrees(&r, &c, &more);
}

/// The words of the save `sb` names (absent leaves read as zeros), and
/// the block of each present leaf, by leaf number.
fn read_save(d: &MemDev, sb: &Superblock) -> (Vec<u64>, BTreeMap<u64, u64>) {
    let g = Geometry::new(ArrayId::Saved, sb.saved_words);
    let mut words = vec![0u64; sb.saved_words as usize];
    let mut leaves = BTreeMap::new();
    let mut todo = vec![(sb.saved_root, g.height, 0u64)];
    while let Some((b, level, base)) = todo.pop() {
        let block = d.block(b);
        if level == 0 {
            let first = (base * g.per_leaf as u64) as usize;
            for i in 0..g.leaf_count(base) as usize {
                words[first + i] = le64(&block[..], HEADER_SIZE + i * 8);
            }
            leaves.insert(base, b);
            continue;
        }
        for slot in 0..INTERIOR_FANOUT as u32 {
            let Some(leaf) = g.child_first_leaf(base, level, slot) else {
                break;
            };
            let child = le64(&block[..], HEADER_SIZE + slot as usize * 8);
            if child != 0 {
                todo.push((child, level - 1, leaf));
            }
        }
    }
    (words, leaves)
}

/// What the kernel saves at a clean close (dd_md_save, an index part of
/// one entry per live block) checks clean and loadable; the kernel loads
/// it instead of walking the trees and finds the same state; the commit of
/// the next read-write open drops it, and the walk finds the same state
/// again. An entry naming a leaf past the device's: both refuse it.
#[test]
fn kernel_saved_state_checks_clean_and_loads() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("saved");
    let (logical, data) = (30_000u64, 4_000u64);
    let (l, d) = (logical.to_string(), data.to_string());
    let (m, out) = image_after(h, &t, "m", "save", logical, data, &["11", "20000", "700"]);
    let ms = m.to_str().unwrap();
    let (r, c) = check_file(&m);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    let saved = r.saved.as_ref().expect("the superblock names a save");
    assert!(saved.loadable && saved.compared, "{saved:?}");
    let sb = r.superblock.as_ref().unwrap();
    assert_eq!(sb.saved_root, saved.root);
    assert_eq!(sb.generation, out.stats["txn"]);
    assert_eq!(c.mappings, out.map);
    let s = r.summary.as_ref().unwrap();
    // The save's own blocks are taken too, until the next commit.
    assert_eq!(
        s.metadata_blocks_used + saved.blocks,
        out.stats["metadata_used"]
    );
    assert_eq!(s.live_blocks, out.stats["live"]);
    let text = dedup_tools::check::render(&r, "m");
    assert!(text.contains("loadable, matches the trees"), "{text}");

    // Its index part: IDX2 at the kernel's geometry for the sizes, one
    // entry for each live block, across several leaves of the save.
    let dev = MemDev::from_bytes(fs::read(&m).unwrap());
    let sbk = Superblock::decode(dev.block(sb.slot));
    let (words, leaves) = read_save(&dev, &sbk);
    assert!(leaves.len() >= 4, "{leaves:?}");
    let head = &words[saved::W_TARGET_HEAD..saved::W_TARGET_HEAD + saved::TARGET_HEAD];
    let g = saved::IndexGeometry::for_data_blocks(data);
    assert_eq!(g.leaf_bits, 6); // 32 leaves
    assert_eq!(head[saved::HEAD_LAYOUT], saved::INDEX_LAYOUT);
    assert_eq!(
        (head[saved::HEAD_GEOMETRY], head[saved::HEAD_BUCKETS]),
        (g.encode(), g.buckets)
    );
    let lay = saved::Layout::new(sbk.metadata_blocks, data, g.words()).unwrap();
    assert_eq!(lay.total, sbk.saved_words);
    let target = &words[lay.target_start as usize..];
    let used: Vec<u64> = (0..g.entries())
        .filter(|&k| g.entry(target, k) != 0)
        .collect();
    assert_eq!(used.len() as u64, head[saved::HEAD_ENTRIES]);
    assert_eq!(head[saved::HEAD_ENTRIES], out.stats["live"]);
    assert_eq!(head[saved::HEAD_FULL], 0);

    // One entry made to name leaf 32, past the last (31): both refuse it,
    // the kernel walks instead.
    let bad = t.0.join("bad");
    let mut dev = dev;
    let mut t2 = target.to_vec();
    let k = used[used.len() / 2];
    let tag = g.entry(target, k) >> g.leaf_bits;
    g.set_entry(&mut t2, k, g.make_entry(32, tag));
    for (i, (&a, &b)) in (lay.target_start..).zip(target.iter().zip(&t2)) {
        if a != b {
            let block = leaves[&(i / INTERIOR_FANOUT)];
            let off = HEADER_SIZE + (i % INTERIOR_FANOUT) as usize * 8;
            let blk = dev.block_mut(block);
            blk[off..off + 8].copy_from_slice(&b.to_le_bytes());
            seal(blk);
        }
    }
    fs::write(&bad, &dev.bytes).unwrap();
    let (r, _) = check_file(&bad);
    assert!(
        r.problems.iter().all(|p| p.code == "saved_state_stale")
            && r.problems.iter().any(|p| p
                .message
                .contains("1 index entries name a fingerprint leaf past the data device's 32")),
        "{:#?}",
        r.problems
    );
    assert!(!r.saved.as_ref().unwrap().loadable);
    let walked = run(h, &["map", bad.to_str().unwrap(), &l, &d]).unwrap();
    assert_eq!(walked.stats["loaded"], 0);
    assert_eq!(walked.map, out.map);

    // Loaded, read-only: the same map and counters.
    let loaded = run(h, &["map", ms, &l, &d]).unwrap();
    assert_eq!(loaded.stats["loaded"], 1);
    assert_eq!(loaded.map, out.map);
    for k in [
        "txn",
        "metadata_used",
        "live",
        "mapped",
        "unique",
        "duplicate",
        "zero",
        "discarded",
    ] {
        assert_eq!(loaded.stats[k], out.stats[k], "{k}");
    }
    // Blocks freed before the close and not yet reusable are free now.
    assert_eq!(loaded.stats["data_used"], out.stats["live"]);
    // Loaded, read-write: committed again, without the save.
    let opened = run(h, &["open", ms, &l, &d]).unwrap();
    assert_eq!(opened.stats["loaded"], 1);
    assert_eq!(opened.stats["txn"], out.stats["txn"] + 1);
    let (r, c) = check_file(&m);
    assert!(r.problems.is_empty(), "{:#?}", r.problems);
    assert!(r.saved.is_none());
    let sb = r.superblock.as_ref().unwrap();
    assert_eq!((sb.saved_root, sb.saved_words), (0, 0));
    assert_eq!(c.mappings, out.map);
    let walked = run(h, &["map", ms, &l, &d]).unwrap();
    assert_eq!(walked.stats["loaded"], 0);
    assert_eq!(walked.map, out.map);
    assert_eq!(
        walked.stats["metadata_used"],
        r.summary.as_ref().unwrap().metadata_blocks_used
    );
}

/// `dedup check` of `p` through the binary: its exit code and JSON report.
fn check_cli(p: &Path) -> (i32, serde_json::Value) {
    let o = Command::new(env!("CARGO_BIN_EXE_dedup"))
        .args(["check", "--json", p.to_str().unwrap()])
        .output()
        .unwrap();
    let j = serde_json::from_str(&String::from_utf8_lossy(&o.stdout)).unwrap();
    (o.status.code().unwrap(), j)
}

/// The kernel's journal, replayed by both: what the harness leaves after
/// appends between commits (and more changes never appended, then a
/// crash) checks clean as replayed, with the map and the counters of the
/// last append; a read-only activation replays the same in memory; a
/// read-write one replays into the trees and checkpoints, after which the
/// journal is empty and the state the same. A dump of the replayed state
/// restores to what the kernel reads back.
#[test]
fn kernel_journal_replay_agrees() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("journal");
    let mut replays = 0;
    // (logical, data, seed, ops, commit every, append every, tail)
    let cases: [(u64, u64, u64, u64, u64, u64, u64); 6] = [
        // Appends between commits, a crash after more changes.
        (20_000, 5_000, 1, 12_000, 5_000, 50, 300),
        // A small data device: blocks freed and reused, frequent appends.
        (4_000, 600, 2, 14_993, 1_000, 7, 500),
        // A two-level map, a journal of 312 blocks, no tail.
        (300_000, 3_000, 3, 12_000, 5_000, 100, 0),
        // A journal of 64 blocks with an append per operation and no
        // commits but the ones a full epoch forces (dd_journal_take's
        // -ENOSPC): the ring goes round about 70 times.
        (2_000, 600, 4, 5_000, 1_000_000, 1, 0),
        // The same with appends of several blocks: the last epoch starts
        // near the ring's end and continues at its start.
        (2_000, 600, 2, 4_000, 1_000_000, 3, 50),
        // Nothing appended since the last commit.
        (3_000, 900, 5, 4_000, 500, 40, 100),
    ];
    for (i, (logical, data, seed, ops, every, append, tail)) in cases.into_iter().enumerate() {
        let (l, d) = (logical.to_string(), data.to_string());
        let args = [seed, ops, every, append, tail].map(|v| v.to_string());
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let (m, out) = image_after(h, &t, &format!("m{i}"), "journal", logical, data, &args);
        let ms = m.to_str().unwrap();
        let what = format!("{i}: {logical} {data} {args:?}");
        assert!(out.stats["mapped"] > 0, "{what}");
        // As replayed by the tools: clean, the map and counters of the
        // last append.
        let (r, c) = check_file(&m);
        assert_agrees(&r, &c, &out);
        let j = r.journal.clone().unwrap();
        assert_eq!(j.blocks, journal_size(logical, data), "{what}");
        assert!(j.damage.is_none() && j.torn_blocks == 0, "{what}: {j:?}");
        let (code, json) = check_cli(&m);
        assert_eq!(code, 0, "{what}: {json}");
        assert_eq!(json["journal"]["replayed_blocks"], j.replayed_blocks);
        match i {
            0..=4 => assert!(j.appends > 0, "{what}: {j:?}"),
            _ => assert_eq!(j.blocks_in_epoch, 0, "{what}: {j:?}"),
        }
        if i == 3 || i == 4 {
            // The ring has gone round, and only forced commits made that
            // possible.
            assert!(j.epoch > 10 * j.blocks, "{what}: {j:?}");
            assert!(out.stats["txn"] > 10, "{what}");
        }
        if i == 4 {
            assert!(
                j.epoch % j.blocks + j.blocks_in_epoch > j.blocks,
                "{what}: {j:?}"
            );
        }

        // Read-only, the kernel replays in memory: the same state.
        let ro = run(h, &["map", ms, &l, &d]).unwrap();
        assert_eq!(ro.map, out.map, "{what}");
        assert_eq!(ro.stats["replayed"], j.replayed_blocks, "{what}");
        assert_counters(&r, &ro);
        replays += (ro.stats["replayed"] > 0) as u32;

        // A dump of the replayed state restores to what the kernel reads.
        if i == 1 {
            let spec = validate(&dump_of(&m), None, 10).unwrap();
            let mut dev = MemDev::new(fs::metadata(&m).unwrap().len() / 4096);
            restore_to(&mut dev, spec, false).unwrap();
            let dst = t.0.join("restored");
            fs::write(&dst, &dev.bytes).unwrap();
            let back = run(h, &["map", dst.to_str().unwrap(), &l, &d]).unwrap();
            assert_eq!(back.map, out.map);
            assert_eq!(back.stats["replayed"], 0);
            let (r2, _) = check_file(&dst);
            assert_eq!(state_counters(&r2), state_counters(&r));
        }

        // Read-write: replayed into the trees and checkpointed twice (both
        // slots name it), or committed once when there was nothing.
        let gen = r.superblock.as_ref().unwrap().generation;
        let rw = run(h, &["open", ms, &l, &d]).unwrap();
        assert_eq!(rw.stats["replayed"], j.replayed_blocks, "{what}");
        let commits = if j.replayed_blocks > 0 { 2 } else { 1 };
        assert_eq!(rw.stats["txn"], gen + commits, "{what}");
        let after = run(h, &["map", ms, &l, &d]).unwrap();
        assert_eq!(after.map, out.map, "{what}");
        assert_eq!(after.stats["replayed"], 0, "{what}");
        let (r, c) = check_file(&m);
        assert_agrees(&r, &c, &after);
        let j = r.journal.as_ref().unwrap();
        assert_eq!((j.blocks_in_epoch, j.appends), (0, 0), "{what}");
        let (code, json) = check_cli(&m);
        assert_eq!(code, 0, "{what}: {json}");
    }
    assert!(replays >= 4, "{replays}");
}

/// A torn last journal block (a crash in the middle of an append's write):
/// `dedup check` does not call it an error, and replays to the state the
/// kernel replays to, read-only and read-write.
#[test]
fn kernel_journal_with_a_torn_last_block() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("journal-torn");
    let mut torn = Vec::new();
    // (logical, data, seed, ops, commit every, append every): the last
    // append of one block (twice), and of several.
    for (i, (logical, data, seed, ops, every, append)) in [
        (20_000u64, 5_000u64, 6u64, 9_000u64, 5_000u64, 40u64),
        (300_000, 3_000, 7, 7_000, 1_000_000, 2_500),
        (2_000, 600, 2, 4_000, 1_000_000, 3),
    ]
    .into_iter()
    .enumerate()
    {
        let (l, d) = (logical.to_string(), data.to_string());
        let args = [seed, ops, every, append, 20].map(|v| v.to_string());
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let (m, out) = image_after(h, &t, &format!("m{i}"), "journal", logical, data, &args);
        let ms = m.to_str().unwrap();
        let (r, c) = check_file(&m);
        assert_agrees(&r, &c, &out);
        let j = r.journal.clone().unwrap();
        assert!(j.appends > 0, "{i}: {j:?}");
        let sb = r.superblock.as_ref().unwrap();
        // The last block written: the last one that continues the epoch.
        let last_seq = sb.journal_seq + j.blocks_in_epoch - 1;
        let at = sb.journal_start + last_seq % sb.journal_blocks;
        assert_eq!(last_seq, j.end_seq - 1);
        let mut bytes = fs::read(&m).unwrap();
        let blk = &mut bytes[at as usize * 4096..][..4096];
        assert_eq!(le64(blk, 48), last_seq);
        assert_ne!(le32(blk, 60) & JF_END, 0, "the last block ends an append");
        blk[100] ^= 0x20;
        fs::write(&m, &bytes).unwrap();

        let (r, c) = check_file(&m);
        assert!(r.clean(), "{i}: {:#?}", r.problems);
        let tj = r.journal.clone().unwrap();
        assert_eq!(tj.end_seq, last_seq, "{i}");
        assert_eq!(tj.appends, j.appends - 1, "{i}");
        assert!(tj.damage.is_none(), "{i}: {tj:?}");
        // Exit 0: no errors (a torn tail is not one).
        let (code, json) = check_cli(&m);
        assert_eq!(code, 0, "{i}: {json}");
        // The kernel replays the same appends, in memory and into the trees.
        let ro = run(h, &["map", ms, &l, &d]).unwrap();
        assert_eq!(ro.map, c.mappings, "{i}");
        assert_eq!(ro.stats["replayed"], tj.replayed_blocks, "{i}");
        assert_counters(&r, &ro);
        // The append the block ended lost; blocks before it in the same
        // append are a torn tail.
        assert_eq!(
            tj.replayed_blocks + tj.torn_blocks,
            j.replayed_blocks - 1,
            "{i}"
        );
        torn.push(tj.torn_blocks);
        run(h, &["open", ms, &l, &d]).unwrap();
        let after = run(h, &["map", ms, &l, &d]).unwrap();
        assert_eq!(after.map, c.mappings, "{i}");
        let (r, c) = check_file(&m);
        assert_agrees(&r, &c, &after);
    }
    assert_eq!(torn.iter().filter(|&&n| n > 0).count(), 1, "{torn:?}");
}

/// A version 1 device gets a journal at its first read-write activation:
/// the run the kernel makes (dd_journal_make()) is the one the tools'
/// writer would make (`new_run`: the sizes' journal_size() or what the
/// trees' worst case leaves, halved while no free window holds it, down
/// to 64), or none.
#[test]
fn kernel_upgrade_makes_the_run_the_writer_makes() {
    let Some(h) = harness() else { return };
    let t = Tmp::new("upgrade");
    let bin = env!("CARGO_BIN_EXE_dedup");
    // 256 MiB logical over 64 MiB of data: trees' worst case 562, a
    // journal of 140, or what the trees leave if that is 64 or more.
    let (logical, data) = (1u64 << 16, 1u64 << 14);
    let (l, d) = (logical.to_string(), data.to_string());
    assert_eq!(
        (open_blocks(logical, data), journal_size(logical, data)),
        (562, 140)
    );
    let mut seen = Vec::new();
    for blocks in [562u64, 600, 625, 626, 631, 632, 701, 702, 5000] {
        let m = t.file("m", blocks * 4096);
        let ms = m.to_str().unwrap();
        let o = Command::new(bin)
            .args(["format", ms, "--format-version", "1"])
            .args(["--data-blocks", &d, "--logical-blocks", &l])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v1 = Superblock::decode(MemDev::from_bytes(fs::read(&m).unwrap()).block(1));
        let want = dedup_tools::writer::new_run(&v1, &[], FIRST_TREE_BLOCK);
        let opened = run(h, &["open", ms, &l, &d]).unwrap();
        assert_eq!(opened.stats["txn"], 2);
        let (r, c) = check_file(&m);
        assert!(r.problems.is_empty(), "{blocks}: {:#?}", r.problems);
        assert!(c.mappings.is_empty());
        let sb = r.superblock.as_ref().unwrap();
        let got = (sb.version == 2).then_some((sb.journal_start, sb.journal_blocks));
        assert_eq!(got, want, "{blocks} blocks");
        seen.push(got.map_or(0, |g| g.1));
    }
    assert_eq!(seen, [0, 0, 0, 64, 69, 70, 139, 140, 140]);
}
