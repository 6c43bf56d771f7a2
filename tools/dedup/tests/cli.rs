//! End-to-end tests of the `dedup` binary on image files.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dedup_tools::device::{BlockDev, MemDev};
use dedup_tools::ondisk::*;
use dedup_tools::writer::{test_fingerprint, write_append, write_image, ImageSpec, Layout};

const BIN: &str = env!("CARGO_BIN_EXE_dedup");

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("dedup-cli-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn dedup(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap()
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn sized_file(p: &Path, bytes: u64) {
    let f = fs::File::create(p).unwrap();
    f.set_len(bytes).unwrap();
}

/// A consistent image with some sharing, written to `p`.
fn sample_image(p: &Path) -> ImageSpec {
    let (logical, data) = (10_000u64, 3_000u64);
    let blocks = required_blocks(logical, data) + 10;
    let mut sb = Superblock::new_formatted(blocks, data, logical, "sha256", 32, 1_700_000_000);
    sb.header.txn = 12;
    sb.unique_writes = 900;
    sb.duplicate_writes = 2100;
    sb.zero_writes = 5;
    sb.discarded_blocks = 7;
    let maps: Vec<(u64, u64)> = (0..3000u64).map(|i| (i * 3, (i * 7) % 900)).collect();
    let spec = ImageSpec::consistent(sb, &maps, test_fingerprint);
    let mut d = MemDev::new(blocks);
    write_image(&mut d, &spec).unwrap();
    fs::write(p, &d.bytes).unwrap();
    spec
}

#[test]
fn help_for_every_subcommand() {
    for sub in [
        "check", "repair", "format", "dump", "restore", "estimate", "stats",
    ] {
        let o = dedup(&[sub, "--help"]);
        assert_eq!(code(&o), 0, "{sub}");
        assert!(out(&o).contains("EXIT STATUS"), "{sub}");
    }
    let o = dedup(&["--help"]);
    assert_eq!(code(&o), 0);
    assert!(out(&o).contains("repair"));
}

#[test]
fn usage_errors_exit_16() {
    for args in [
        &[][..],
        &["frobnicate"],
        &["check"],
        &["format", "x"],
        &["format", "x", "--data-blocks", "1", "--logical-size", "5Q"],
        &[
            "format",
            "x",
            "--data-blocks",
            "1",
            "--logical-blocks",
            "1",
            "--data-dev",
            "y",
        ],
        &["check", "x", "--max-problems", "-1"],
        &["estimate", "x", "--block-sizes", "1000"],
    ] {
        let o = dedup(args);
        assert_eq!(code(&o), 16, "{args:?}: {}", err(&o));
    }
    let t = TempDir::new("usage");
    let m = t.path("meta");
    sized_file(&m, 1 << 20);
    let o = dedup(&[
        "format",
        s(&m),
        "--data-blocks",
        "10",
        "--logical-size",
        "4097",
    ]);
    assert_eq!(code(&o), 16, "{}", err(&o));
    assert!(err(&o).contains("not a multiple of 4096"));
    let o = dedup(&[
        "format",
        s(&m),
        "--data-blocks",
        "10",
        "--logical-blocks",
        "10",
        "--hash",
        "md5",
    ]);
    assert_eq!(code(&o), 16);
    assert!(err(&o).contains("unknown hash"));
}

#[test]
fn format_then_check() {
    let t = TempDir::new("format");
    let m = t.path("meta");
    sized_file(&m, 16 << 20);
    let o = dedup(&[
        "format",
        s(&m),
        "--data-blocks",
        "5000",
        "--logical-blocks",
        "20000",
    ]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).contains("generation 1 in slot 1"));

    let o = dedup(&["check", s(&m)]);
    assert_eq!(code(&o), 0, "{}{}", out(&o), err(&o));
    assert!(out(&o).contains("superblock slot 0: zero"));
    assert!(out(&o).contains("superblock slot 1: valid, generation 1"));
    assert!(out(&o).contains("result: clean"));

    let o = dedup(&[
        "check",
        s(&m),
        "--json",
        "--data-blocks",
        "5000",
        "--logical-blocks",
        "20000",
        "--hash",
        "sha256",
    ]);
    assert_eq!(code(&o), 0);
    let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(j["exit_code"], 0);
    assert_eq!(j["superblock"]["data_blocks"], 5000);
    assert_eq!(j["superblock"]["metadata_blocks"], 4096);
    // The slots and the journal's run, as long as the sizes ask for
    // (the device's room beyond required_blocks stays free).
    let jb = journal_size(20000, 5000);
    assert_eq!(jb, JOURNAL_MAKE_MIN);
    assert!(4096 > required_blocks(20000, 5000) + jb);
    assert_eq!(j["summary"]["metadata_blocks_used"], 2 + jb);
    assert_eq!(j["superblock"]["version"], 2);
    assert_eq!(j["superblock"]["journal_start"], 2);
    assert_eq!(j["superblock"]["journal_blocks"], jb);
    assert_eq!(j["superblock"]["journal_seq"], 1);
    assert_eq!(j["journal"]["blocks_in_epoch"], 0);
    assert_eq!(j["slots"][0]["state"], "zero");

    // A smaller table: the kernel refuses it, an error.
    let o = dedup(&["check", s(&m), "--data-blocks", "4999"]);
    assert_eq!(code(&o), 4);
    assert!(
        out(&o).contains("cannot shrink the data device"),
        "{}",
        out(&o)
    );
    // A larger one: the kernel grows the device, a warning.
    let o = dedup(&["check", s(&m), "--data-blocks", "5001"]);
    assert_eq!(code(&o), 0, "{}", out(&o));
    assert!(
        out(&o).contains("the kernel grows the data device to 5001 blocks when it activates"),
        "{}",
        out(&o)
    );

    // Formatting again needs --force.
    let o = dedup(&[
        "format",
        s(&m),
        "--data-blocks",
        "5000",
        "--logical-blocks",
        "20000",
    ]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("already holds dm-dedup metadata (slot "));
    // So does restoring over it, with the same words.
    let dump = t.path("d.json");
    let o = dedup(&["dump", s(&m), "-o", s(&dump)]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    let o = dedup(&["restore", s(&dump), s(&m)]);
    assert_eq!(code(&o), 8, "{}", err(&o));
    assert!(
        err(&o).contains("already holds dm-dedup metadata (slot "),
        "{}",
        err(&o)
    );
    assert!(
        err(&o).contains("use --force to overwrite it"),
        "{}",
        err(&o)
    );
    let o = dedup(&[
        "format",
        s(&m),
        "--data-blocks",
        "6000",
        "--logical-blocks",
        "20000",
        "--force",
    ]);
    assert_eq!(code(&o), 0, "{}", err(&o));
}

#[test]
fn format_from_sizes_and_too_small() {
    let t = TempDir::new("format-sizes");
    let m = t.path("meta");
    let data = t.path("data");
    sized_file(&data, (1 << 30) + 1000);
    sized_file(&m, 64 << 20);
    let o = dedup(&[
        "format",
        s(&m),
        "--data-dev",
        s(&data),
        "--logical-size",
        "4G",
        "--format-time",
        "1000",
    ]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    let o = dedup(&["check", s(&m), "--json"]);
    let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(j["superblock"]["data_blocks"], 262144);
    assert_eq!(j["superblock"]["logical_blocks"], 1 << 20);
    assert_eq!(j["superblock"]["format_time"], 1000);
    assert_eq!(j["superblock"]["hash"], "sha256");
    assert_eq!(j["superblock"]["fp_size"], 32);
    // These sizes ask for the longest journal.
    assert_eq!(j["superblock"]["journal_blocks"], JOURNAL_BLOCKS);

    // Too small: 1 MiB, and one block short of required_blocks (where a
    // halved journal would fit, but the kernel formats none).
    let need = required_blocks(1 << 20, 262144);
    assert_eq!(need, 8806 + JOURNAL_BLOCKS);
    let small = t.path("small");
    for bytes in [1 << 20, (need - 1) * 4096] {
        sized_file(&small, bytes);
        let o = dedup(&[
            "format",
            s(&small),
            "--data-dev",
            s(&data),
            "--logical-size",
            "4G",
        ]);
        assert_eq!(code(&o), 8);
        assert!(
            err(&o).contains(&format!("({need} blocks of 4 KiB)")),
            "{}",
            err(&o)
        );
        assert!(fs::read(&small).unwrap().iter().all(|&b| b == 0));
    }
    sized_file(&small, need * 4096);
    let o = dedup(&[
        "format",
        s(&small),
        "--data-dev",
        s(&data),
        "--logical-size",
        "4G",
    ]);
    assert_eq!(code(&o), 0, "{}", err(&o));
}

#[test]
fn format_is_byte_identical_to_dd_format() {
    // What dd_format() + dd_bm_write_super() leave on a zeroed device,
    // written out field by field from dedup-format.h: version 2 with the
    // journal dd_journal_make() makes (dd_journal_size(): 64 blocks for
    // these sizes, at block 2, epoch 1; the id is random, given here),
    // and version 1 without one.
    let t = TempDir::new("format-bytes");
    let m = t.path("meta");
    let blocks = 2100u64;
    assert_eq!(journal_size(17, 9), 64);
    for version in [2u32, 1] {
        sized_file(&m, blocks * 4096);
        let mut args = vec![
            "format",
            s(&m),
            "--data-blocks",
            "9",
            "--logical-blocks",
            "17",
            "--format-time",
            "1234567890",
            "--force",
        ];
        if version == 2 {
            args.extend(["--journal-id", "81985529216486895"]);
        } else {
            args.extend(["--format-version", "1"]);
        }
        let o = dedup(&args);
        assert_eq!(code(&o), 0, "{}", err(&o));
        let got = fs::read(&m).unwrap();
        let mut want = vec![0u8; blocks as usize * 4096];
        let sb = &mut want[4096..8192];
        sb[4..8].copy_from_slice(b"SUPR");
        sb[8..16].copy_from_slice(&1u64.to_le_bytes()); // blocknr = slot 1
        sb[16..24].copy_from_slice(&1u64.to_le_bytes()); // txn = generation 1
        sb[32..40].copy_from_slice(b"DDEDUP01");
        sb[40..44].copy_from_slice(&version.to_le_bytes());
        sb[44..48].copy_from_slice(&4096u32.to_le_bytes());
        sb[48..56].copy_from_slice(&blocks.to_le_bytes());
        sb[56..64].copy_from_slice(&9u64.to_le_bytes());
        sb[64..72].copy_from_slice(&17u64.to_le_bytes());
        sb[72..78].copy_from_slice(b"sha256");
        sb[104..108].copy_from_slice(&32u32.to_le_bytes());
        sb[184..192].copy_from_slice(&1234567890u64.to_le_bytes());
        if version == 2 {
            sb[208..216].copy_from_slice(&2u64.to_le_bytes()); // journal_start
            sb[216..224].copy_from_slice(&64u64.to_le_bytes()); // journal_blocks
            sb[224..232].copy_from_slice(&1u64.to_le_bytes()); // journal_seq
            sb[232..240].copy_from_slice(&0x0123_4567_89ab_cdefu64.to_le_bytes());
        }
        let c = dedup_tools::crc32c::crc32c(&sb[4..]);
        sb[0..4].copy_from_slice(&c.to_le_bytes());
        assert!(
            got == want,
            "version {version}: format output differs from the kernel layout"
        );
        let o = dedup(&["check", s(&m)]);
        assert_eq!(code(&o), 0, "{}", out(&o));
        let want_line = if version == 2 {
            "journal: 64 blocks at block 2 (id 0x0123456789abcdef), epoch 1: empty; it ends at \
             sequence 1: block 3 (sequence 1) is all zeros (never written)"
        } else {
            "journal: none (format version 1: every flush commits the trees)"
        };
        assert!(out(&o).contains(want_line), "{}", out(&o));
        assert!(out(&o).contains(&format!("format version {version})")));
    }
    // A journal id is version 2's; versions other than 1 and 2 are refused.
    for bad in [
        &["--format-version", "1", "--journal-id", "5"][..],
        &["--format-version", "3"],
        &["--journal-id", "0"],
    ] {
        let mut args = vec![
            "format",
            s(&m),
            "--data-blocks",
            "9",
            "--logical-blocks",
            "17",
            "--force",
        ];
        args.extend(bad);
        assert_eq!(code(&dedup(&args)), 16, "{bad:?}");
    }
}

#[test]
fn check_finds_damage_and_refuses_non_dedup() {
    let t = TempDir::new("damage");
    let m = t.path("meta");
    sample_image(&m);
    let o = dedup(&["check", s(&m)]);
    assert_eq!(code(&o), 0, "{}", out(&o));
    assert!(out(&o).contains("mapped logical blocks: 3000, live physical blocks: 900"));

    // Flip a byte in every tree block's payload in turn: always exit 4.
    let bytes = fs::read(&m).unwrap();
    let used = metadata_blocks_used(&m);
    for b in 2..used {
        let mut x = bytes.clone();
        x[(b as usize) * 4096 + 1000] ^= 0x10;
        fs::write(&m, &x).unwrap();
        let o = dedup(&["check", s(&m), "--json"]);
        assert_eq!(code(&o), 4, "block {b}");
        let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
        let p = &j["problems"][0];
        assert_eq!(p["code"], "bad_checksum");
        assert_eq!(p["block"], b);
    }

    // Garbage, text, an empty and a missing file: operational errors.
    let garbage = garbage_bytes(1 << 20);
    fs::write(&m, &garbage).unwrap();
    let o = dedup(&["check", s(&m)]);
    assert_eq!(code(&o), 8);
    assert_eq!(err(&o).lines().count(), 1);
    assert!(err(&o).contains("not a dm-dedup metadata device"));
    fs::write(&m, b"").unwrap();
    let o = dedup(&["check", s(&m)]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("too small"));
    let o = dedup(&["check", s(&t.path("nope"))]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("No such file"));
    let o = dedup(&["check", s(&t.0)]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("not a block device or a regular file"));

    // Truncated.
    fs::write(&m, &bytes[..30 * 4096]).unwrap();
    let o = dedup(&["check", s(&m)]);
    assert_eq!(code(&o), 8);
    assert_eq!(err(&o).lines().count(), 1);
    assert!(err(&o).contains("truncated"));
}

#[test]
fn dump_restore_round_trip() {
    let t = TempDir::new("dump");
    let m = t.path("meta");
    let spec = sample_image(&m);
    let j1 = t.path("d1.json");
    let o = dedup(&["dump", s(&m), "-o", s(&j1)]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    let text = fs::read_to_string(&j1).unwrap();
    let d: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(d["format"], "dm-dedup-metadata-dump");
    assert_eq!(d["superblock"]["generation"], 12);
    assert_eq!(d["superblock"]["duplicate_writes"], 2100);
    assert_eq!(d["mappings"].as_array().unwrap().len(), 3000);
    assert_eq!(d["mappings"][1], serde_json::json!({"lba": 3, "pba": 7}));
    assert_eq!(d["blocks"].as_array().unwrap().len(), 900);
    assert_eq!(d["blocks"][0]["refcount"], 4);
    assert_eq!(
        d["blocks"][5]["fingerprint"],
        dedup_tools::util::hex(&test_fingerprint(5))
    );

    // Restore onto a bigger device, check, dump again: same content.
    let m2 = t.path("meta2");
    sized_file(&m2, fs::metadata(&m).unwrap().len() + (1 << 20));
    let o = dedup(&["restore", s(&j1), s(&m2)]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).contains("generation 12 in slot 0"));
    let o = dedup(&["check", s(&m2)]);
    assert_eq!(code(&o), 0, "{}", out(&o));
    let o = dedup(&["dump", s(&m2)]);
    assert_eq!(code(&o), 0);
    let d2: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(d2["mappings"], d["mappings"]);
    assert_eq!(d2["blocks"], d["blocks"]);
    // A new journal: the same place after the trees, a new id, empty.
    assert_eq!(d["journal"]["appends"], serde_json::json!([]));
    assert_eq!(d2["journal"]["appends"], serde_json::json!([]));
    assert_eq!(d2["journal"]["epoch"], 1);
    assert_ne!(
        d2["superblock"]["journal_id"],
        d["superblock"]["journal_id"]
    );
    // On either device, the journal is as long as the sizes ask for: the
    // room beyond required_blocks (10 blocks, then 1 MiB more) stays free.
    let big = fs::metadata(&m2).unwrap().len() / 4096;
    let need = required_blocks(spec.sb.logical_blocks, spec.sb.data_blocks);
    let jb = journal_size(spec.sb.logical_blocks, spec.sb.data_blocks);
    assert!(big > need + 256);
    assert_eq!(d["superblock"]["journal_blocks"], jb);
    assert_eq!(d2["superblock"]["journal_blocks"], jb);
    let mut s1 = d["superblock"].clone();
    let mut s2 = d2["superblock"].clone();
    for f in ["metadata_blocks", "journal_id"] {
        s1[f] = 0.into();
        s2[f] = 0.into();
    }
    assert_eq!(s1, s2);
    assert_eq!(
        d2["superblock"]["metadata_blocks"],
        fs::metadata(&m2).unwrap().len() / 4096
    );

    // The restored trees are laid out from block 2 like the writer's.
    let bytes = fs::read(&m2).unwrap();
    let dev = MemDev::from_bytes(bytes);
    assert_eq!(dev.nr_blocks(), fs::metadata(&m2).unwrap().len() / 4096);
    let mut mem = MemDev::new(dev.nr_blocks());
    let mut sp = spec.clone();
    sp.sb.metadata_blocks = dev.nr_blocks();
    sp.sb.journal_id = d2["superblock"]["journal_id"].as_u64().unwrap();
    write_image(&mut mem, &sp).unwrap();
    assert!(
        mem.bytes == dev.bytes,
        "restore differs from the writer's image"
    );

    // Restoring over valid metadata needs --force; another generation.
    let o = dedup(&["restore", s(&j1), s(&m2)]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("--force"));
    let o = dedup(&["restore", s(&j1), s(&m2), "--force", "--generation", "1"]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).contains("generation 1 in slot 1"));
    let o = dedup(&["check", s(&m2)]);
    assert_eq!(code(&o), 0);
}

#[test]
fn restore_refuses_inconsistent_dumps() {
    let t = TempDir::new("restore-bad");
    let m = t.path("meta");
    sample_image(&m);
    let o = dedup(&["dump", s(&m)]);
    let good: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let target = t.path("target");
    sized_file(&target, fs::metadata(&m).unwrap().len());
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|d| d["blocks"][0]["refcount"] = 5.into()),
            "refcount 5 but 4 mappings",
        ),
        (
            Box::new(|d| d["mappings"][0]["lba"] = 3.into()),
            "lba 3 is mapped twice",
        ),
        (
            Box::new(|d| d["mappings"][0]["pba"] = 5000.into()),
            "beyond data_blocks",
        ),
        (
            Box::new(|d| d["superblock"]["mapped_blocks"] = 1.into()),
            "mapped_blocks is 1",
        ),
        (
            Box::new(|d| d["blocks"][1]["fingerprint"] = "00".into()),
            "all zero",
        ),
        (
            Box::new(|d| d["blocks"][1]["fingerprint"] = "xyz".into()),
            "hex digits",
        ),
        (
            Box::new(|d| {
                d["blocks"].as_array_mut().unwrap().remove(3);
                d["superblock"]["used_data_blocks"] = 899.into();
            }),
            "no block record",
        ),
        (
            Box::new(|d| d["format"] = "something".into()),
            "format is 'something'",
        ),
    ];
    for (f, want) in cases {
        let mut d = good.clone();
        f(&mut d);
        let p = t.path("bad.json");
        fs::write(&p, serde_json::to_string(&d).unwrap()).unwrap();
        let o = dedup(&["restore", s(&p), s(&target)]);
        assert_eq!(code(&o), 8, "{want}");
        assert!(err(&o).contains(want), "{want}: {}", err(&o));
    }
    let p = t.path("bad.json");
    fs::write(&p, "{ not json").unwrap();
    let o = dedup(&["restore", s(&p), s(&target)]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("not a valid dump"));
    // Too small a target.
    let small = t.path("small");
    sized_file(&small, 8 * 4096);
    fs::write(&p, serde_json::to_string(&good).unwrap()).unwrap();
    let o = dedup(&["restore", s(&p), s(&small)]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("too small"));
}

#[test]
fn transaction_id_limit() {
    let t = TempDir::new("txn-limit");
    let m = t.path("meta");
    let spec = sample_image(&m);
    let j = t.path("d.json");
    let o = dedup(&["dump", s(&m), "-o", s(&j)]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    let max = MAX_TXN.to_string();
    let above = (MAX_TXN + 1).to_string();

    // restore --generation above DD_MAX_TXN: exit 8, nothing written.
    let pristine = fs::read(&m).unwrap();
    for g in [above.as_str(), "18446744073709551615"] {
        let o = dedup(&["restore", s(&j), s(&m), "--force", "--generation", g]);
        assert_eq!(code(&o), 8, "{}", err(&o));
        assert_eq!(err(&o).lines().count(), 1, "{}", err(&o));
        assert!(
            err(&o).contains(&format!(
                "--generation refused: generation {g} is above {max}"
            )),
            "{}",
            err(&o)
        );
        assert_eq!(fs::read(&m).unwrap(), pristine);
    }
    // At DD_MAX_TXN: written, and it checks clean.
    let o = dedup(&["restore", s(&j), s(&m), "--force", "--generation", &max]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).contains(&format!("generation {max} in slot 1")));
    let o = dedup(&["check", s(&m)]);
    assert_eq!(code(&o), 0, "{}", out(&o));

    // One above, in an otherwise sound superblock (the next slot): check
    // reports txn_too_large (exit 4), and so does dump.
    let mut bytes = fs::read(&m).unwrap();
    let mut sb = Superblock::decode(bytes[4096..8192].try_into().unwrap());
    sb.header.txn = MAX_TXN + 1;
    bytes[..4096].copy_from_slice(&sb.encode()[..]);
    fs::write(&m, &bytes).unwrap();
    let o = dedup(&["check", "--json", s(&m)]);
    assert_eq!(code(&o), 4);
    let r: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(r["errors"], 1, "{r}");
    assert_eq!(r["problems"][0]["code"], "txn_too_large");
    assert_eq!(r["problems"][0]["severity"], "error");
    assert_eq!(r["superblock"]["slot"], 0);
    let o = dedup(&["dump", s(&m)]);
    assert_eq!(code(&o), 4);
    assert!(err(&o).contains("txn_too_large") || err(&o).contains("is above"));

    // repair falls back to the slot at the limit, whose successor would
    // be above it: refused.
    let o = dedup(&["repair", s(&m)]);
    assert_eq!(code(&o), 8, "{}", out(&o));
    assert!(err(&o).contains("cannot be advanced"), "{}", err(&o));

    // A device whose only superblock is above the limit: repair refuses
    // and names the way out, which keeps every mapping.
    bytes[4096..8192].fill(0);
    fs::write(&m, &bytes).unwrap();
    let o = dedup(&["repair", s(&m)]);
    assert_eq!(code(&o), 8, "{}", out(&o));
    assert_eq!(err(&o).lines().count(), 1, "{}", err(&o));
    assert!(err(&o).contains("no usable superblock"), "{}", err(&o));
    assert!(err(&o).contains("dedup dump --force"), "{}", err(&o));
    let j2 = t.path("d2.json");
    let o = dedup(&["dump", "--force", s(&m), "-o", s(&j2)]);
    assert_eq!(code(&o), 4, "{}", err(&o));
    let o = dedup(&["restore", s(&j2), s(&m)]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("--generation N"), "{}", err(&o));
    let o = dedup(&["restore", "--force", "--generation", "2", s(&j2), s(&m)]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    let o = dedup(&["check", s(&m)]);
    assert_eq!(code(&o), 0, "{}", out(&o));
    assert_eq!(dumped_mappings(&m), spec.mappings);
}

#[test]
fn dump_refuses_damaged_metadata_unless_forced() {
    let t = TempDir::new("dump-bad");
    let m = t.path("meta");
    sample_image(&m);
    let mut bytes = fs::read(&m).unwrap();
    bytes[2 * 4096 + 100] ^= 1; // first map leaf
    fs::write(&m, &bytes).unwrap();
    let o = dedup(&["dump", s(&m)]);
    assert_eq!(code(&o), 4);
    assert!(err(&o).contains("checksum mismatch"));
    assert!(out(&o).is_empty());
    let o = dedup(&["dump", s(&m), "--force"]);
    assert_eq!(code(&o), 4);
    let d: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(d["blocks"].as_array().unwrap().len(), 900);
    assert!(d["mappings"].as_array().unwrap().len() < 3000);
}

#[test]
fn stats_from_saved_outputs() {
    let t = TempDir::new("stats");
    let st = t.path("status");
    let msg = t.path("msg");
    fs::write(
        &st,
        "0 8388608 dedup rw 7 300/65536 1000/262144 4000 1000 3000 10 0 sha256 verify no_discard_passdown\n",
    )
    .unwrap();
    fs::write(
        &msg,
        "mode rw\ntransaction_id 7\nlogical_blocks 1048576\nmapped_blocks 4000\ndata_blocks_total 262144\n\
         data_blocks_used 1000\ndata_blocks_live 1000\ndata_blocks_pending_free 0\nmetadata_blocks_total 65536\n\
         metadata_blocks_used 300\nunique_writes 1000\nduplicate_writes 3000\nzero_writes 10\ndiscarded_blocks 0\n\
         dedup_ratio_x100 400\nwrite_savings_x100 7512\nindex_bytes 2621568\nindex_bytes_per_data_block_x100 1000\n\
         index_entries 1000\nindex_full 0\nverify_mismatches 2\nnospc_errors 0\ndata_write_errors 0\n\
         deferred_reads 0\ndiscard_passdown_blocks 0\nhash sha256\n",
    )
    .unwrap();
    let o = dedup(&[
        "stats",
        "vol",
        "--status-file",
        s(&st),
        "--message-file",
        s(&msg),
    ]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    let text = out(&o);
    assert!(text.contains("dedup ratio                4.00"), "{text}");
    assert!(text.contains("space savings              75.0%"), "{text}");
    assert!(text.contains("verify mismatches          2"), "{text}");
    let o = dedup(&[
        "stats",
        "vol",
        "--json",
        "--status-file",
        s(&st),
        "--message-file",
        s(&msg),
    ]);
    let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(j["data_blocks_free"], 261144);
    assert_eq!(j["verify"], true);
    fs::write(&st, "0 100 linear 8:1 0\n").unwrap();
    let o = dedup(&["stats", "vol", "--status-file", s(&st)]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("not dedup"));
}

#[test]
fn estimate_files() {
    let t = TempDir::new("estimate");
    let a = t.path("a");
    let b = t.path("b");
    let blk = |seed: u8| vec![seed; 4096];
    let mut x = Vec::new();
    for i in 0..64u8 {
        x.extend(blk(i % 16 + 1));
    }
    x.extend(vec![0u8; 4096 * 16]);
    fs::write(&a, &x).unwrap();
    fs::write(&b, &x[..4096 * 8 + 10]).unwrap();
    let o = dedup(&[
        "estimate",
        s(&a),
        s(&b),
        "--json",
        "--block-sizes",
        "4K,16K",
    ]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let r4 = &j["block_sizes"][0];
    assert_eq!(r4["block_size"], 4096);
    assert_eq!(r4["total_blocks"], 80 + 9);
    assert_eq!(r4["zero_blocks"], 16);
    // 16 distinct fills plus the padded 10-byte tail.
    assert_eq!(r4["unique_blocks"], 17);
    assert_eq!(j["target"]["data_blocks"], 17);
    assert_eq!(j["target"]["logical_blocks"], 89);
    let o = dedup(&["estimate", s(&a)]);
    assert_eq!(code(&o), 0);
    assert!(out(&o).contains("dm-dedup (4 KiB blocks) would need"));
    let o = dedup(&["estimate", s(&t.path("missing"))]);
    assert_eq!(code(&o), 8);
}

/// Mappings of a clean image, through `dedup dump`.
fn dumped_mappings(m: &Path) -> Vec<(u64, u64)> {
    let o = dedup(&["dump", s(m)]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    j["mappings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["lba"].as_u64().unwrap(), m["pba"].as_u64().unwrap()))
        .collect()
}

#[test]
fn repair_refuses_clean_devices_and_bad_input() {
    let t = TempDir::new("repair-refuse");
    let m = t.path("meta");
    let spec = sample_image(&m);
    let pristine = fs::read(&m).unwrap();
    let o = dedup(&["repair", s(&m)]);
    assert_eq!(code(&o), 8, "{}", out(&o));
    assert_eq!(err(&o).lines().count(), 1);
    assert!(err(&o).contains("check finds no errors"), "{}", err(&o));
    let o = dedup(&["repair", "--dry-run", s(&m)]);
    assert_eq!(code(&o), 8);
    assert_eq!(fs::read(&m).unwrap(), pristine);

    // --force: rewritten, a newer generation, the same content.
    let o = dedup(&["repair", "--force", s(&m)]);
    assert_eq!(code(&o), 0, "{}{}", out(&o), err(&o));
    assert!(out(&o).contains("writing generation 13 to superblock slot 1 (0 changes)"));
    assert!(out(&o).contains("done: the metadata checks clean"));
    assert_eq!(dumped_mappings(&m), spec.mappings);

    // Bad input: one line on stderr, exit 8, never a panic.
    let garbage = garbage_bytes(1 << 20);
    let g = t.path("garbage");
    fs::write(&g, &garbage).unwrap();
    let z = t.path("zeros");
    sized_file(&z, 1 << 20);
    let tr = t.path("truncated");
    fs::write(&tr, &pristine[..30 * 4096]).unwrap();
    let e = t.path("empty");
    fs::write(&e, b"").unwrap();
    for (p, why) in [
        (g.as_path(), "not a dm-dedup metadata device"),
        (z.as_path(), "not formatted"),
        (tr.as_path(), "truncated"),
        (e.as_path(), "too small"),
        (t.path("nope").as_path(), "No such file"),
        (t.0.as_path(), "not a block device or a regular file"),
    ] {
        for args in [
            &["repair", s(p)][..],
            &["repair", "--force", "--json", s(p)],
        ] {
            let o = dedup(args);
            assert_eq!(code(&o), 8, "{args:?}");
            assert_eq!(err(&o).lines().count(), 1, "{args:?}: {}", err(&o));
            assert!(err(&o).contains(why), "{args:?}: {}", err(&o));
            assert!(!err(&o).contains("panicked"));
        }
    }
    let o = dedup(&["repair", "--force", "--json", s(&g)]);
    let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(j["exit_code"], 8);
    assert!(j["fatal"].as_str().unwrap().contains("not a dm-dedup"));
}

/// The kernel's needs_check flag: check warns but calls the metadata
/// clean; --clear-needs-check leaves it while errors remain, repair clears
/// it, and on clean metadata --clear-needs-check writes the same state as
/// the next generation without it.
#[test]
fn needs_check_cleared_by_check_or_repair() {
    let t = TempDir::new("needs-check");
    let m = t.path("meta");
    let mut spec = sample_image(&m);
    spec.sb.flags = SB_NEEDS_CHECK;
    let mut d = MemDev::new(fs::metadata(&m).unwrap().len() / 4096);
    write_image(&mut d, &spec).unwrap();
    fs::write(&m, &d.bytes).unwrap();
    let flagged = d.bytes.clone();
    let json = |o: &Output| -> serde_json::Value { serde_json::from_str(&out(o)).unwrap() };

    let o = dedup(&["check", s(&m), "--json"]);
    assert_eq!(code(&o), 0, "{}", out(&o));
    let j = json(&o);
    assert_eq!(j["superblock"]["flags"], 1);
    assert_eq!(j["problems"][0]["code"], "needs_check");
    assert_eq!(j["problems"][0]["severity"], "warning");
    let o = dedup(&["check", s(&m)]);
    assert!(out(&o).contains("needs_check"), "{}", out(&o));

    // damaged: the flag stays; repair clears it
    let mut x = flagged.clone();
    x[2 * 4096 + 1000] ^= 0x10;
    fs::write(&m, &x).unwrap();
    let o = dedup(&["check", "--clear-needs-check", s(&m)]);
    assert_eq!(code(&o), 4);
    assert!(
        err(&o).contains("needs_check stays set; run dedup repair"),
        "{}",
        err(&o)
    );
    assert_eq!(fs::read(&m).unwrap(), x);
    let o = dedup(&["repair", s(&m), "--json"]);
    assert_eq!(code(&o), 1, "{}", err(&o));
    assert!(json(&o)["changes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["code"] == "needs_check"));
    let j = json(&dedup(&["check", s(&m), "--json"]));
    assert_eq!(
        (j["exit_code"].as_u64(), j["superblock"]["flags"].as_u64()),
        (Some(0), Some(0))
    );

    // clean: cleared as generation 13 in the other slot, same content
    fs::write(&m, &flagged).unwrap();
    let before = dumped_mappings(&m);
    let o = dedup(&["check", "--clear-needs-check", s(&m), "--json"]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert_eq!(json(&o)["needs_check_cleared"], true);
    assert!(
        err(&o).contains("needs_check cleared (generation 13 in slot 1)"),
        "{}",
        err(&o)
    );
    let j = json(&dedup(&["check", s(&m), "--json"]));
    assert_eq!(j["superblock"]["flags"], 0);
    assert_eq!(j["superblock"]["generation"], 13);
    assert_eq!(j["warnings"], 0);
    assert_eq!(dumped_mappings(&m), before);
    let o = dedup(&["check", "--clear-needs-check", s(&m)]);
    assert_eq!(code(&o), 0);
    assert!(err(&o).contains("needs_check is not set"), "{}", err(&o));
}

#[test]
fn repair_every_damaged_tree_block() {
    let t = TempDir::new("repair-every");
    let m = t.path("meta");
    let spec = sample_image(&m);
    let bytes = fs::read(&m).unwrap();
    let used = metadata_blocks_used(&m);
    for b in 2..used {
        let mut x = bytes.clone();
        x[(b as usize) * 4096 + 1000] ^= 0x10;
        fs::write(&m, &x).unwrap();
        // A dry run says what it would do and writes nothing.
        let o = dedup(&["repair", "--dry-run", s(&m)]);
        assert_eq!(code(&o), 4, "block {b}: {}", err(&o));
        assert!(out(&o).contains("would write generation 13"));
        assert_eq!(fs::read(&m).unwrap(), x);

        let o = dedup(&["repair", s(&m), "--json"]);
        assert_eq!(code(&o), 1, "block {b}: {}{}", out(&o), err(&o));
        let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
        assert_eq!(j["exit_code"], 1);
        assert_eq!(j["check_after"]["errors"], 0);
        // Lost: exactly the logical blocks of the changes' map ranges.
        let lost: Vec<(u64, u64)> = j["changes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["code"] == "map_lost")
            .map(|c| (c["first"].as_u64().unwrap(), c["last"].as_u64().unwrap()))
            .collect();
        let want: Vec<(u64, u64)> = spec
            .mappings
            .iter()
            .copied()
            .filter(|m| !lost.iter().any(|&(a, z)| a <= m.0 && m.0 <= z))
            .collect();
        let o = dedup(&["check", s(&m)]);
        assert_eq!(code(&o), 0, "block {b}: {}", out(&o));
        assert_eq!(dumped_mappings(&m), want, "block {b}");
        assert!(want.len() == spec.mappings.len() || !lost.is_empty());
    }
}

/// A data device of 200 blocks, block `p` holding `content(p)`, written to
/// `dpath`, and a consistent image (txn 3, 600 mappings onto 150 live blocks)
/// whose sha256 fingerprints match it. The image is written to a `MemDev`
/// only: returns the data bytes, the spec, the device and its layout.
fn image_with_data(
    dpath: &Path,
    content: impl Fn(u64) -> Vec<u8>,
) -> (Vec<u8>, ImageSpec, MemDev, Layout) {
    let (logical, data) = (2_000u64, 200u64);
    let dd: Vec<u8> = (0..data).flat_map(&content).collect();
    fs::write(dpath, &dd).unwrap();
    let blocks = required_blocks(logical, data) + 4;
    let mut sb = Superblock::new_formatted(blocks, data, logical, "sha256", 32, 1_700_000_000);
    sb.header.txn = 3;
    let maps: Vec<(u64, u64)> = (0..600u64).map(|i| (i * 3, i % 150)).collect();
    let h = dedup_tools::fingerprint::Hasher::Sha256;
    let spec = ImageSpec::consistent(sb, &maps, |p| h.record(&content(p)));
    let mut d = MemDev::new(blocks);
    let (_, layout) = write_image(&mut d, &spec).unwrap();
    (dd, spec, d, layout)
}

#[test]
fn repair_with_the_data_device() {
    let t = TempDir::new("repair-data");
    let (m, dpath) = (t.path("meta"), t.path("data"));
    let content = |p: u64| -> Vec<u8> { (0..4096u64).map(|i| (p * 31 + i / 7) as u8).collect() };
    let h = dedup_tools::fingerprint::Hasher::Sha256;
    let (_, spec, mut d, layout) = image_with_data(&dpath, content);
    // Damage the fingerprint root: every record is lost.
    d.block_mut(layout.fingerprint_root)[500] ^= 1;
    fs::write(&m, &d.bytes).unwrap();

    // The wrong data device (another size) is refused.
    let o = dedup(&["repair", s(&m), "--data", s(&m)]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("wrong device"), "{}", err(&o));
    let o = dedup(&["repair", s(&m), "--data", s(&t.path("nope"))]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("--data"), "{}", err(&o));

    let o = dedup(&["repair", s(&m), "--data", s(&dpath)]);
    assert_eq!(code(&o), 1, "{}{}", out(&o), err(&o));
    assert!(
        out(&o).contains(
            "fingerprint of physical blocks 0-149 (150 blocks): lost (fingerprint interior node (level 1) at metadata block"
        ),
        "{}",
        out(&o)
    );
    assert!(out(&o).contains("recomputed from the data device"));
    let o = dedup(&["check", s(&m)]);
    assert_eq!(code(&o), 0);
    assert!(!out(&o).contains("placeholder"));
    let o = dedup(&["dump", s(&m)]);
    let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    for b in j["blocks"].as_array().unwrap() {
        let p = b["pba"].as_u64().unwrap();
        assert_eq!(
            b["fingerprint"].as_str().unwrap(),
            dedup_tools::util::hex(&h.record(&content(p)))
        );
    }
    assert_eq!(dumped_mappings(&m), spec.mappings);
}

#[test]
fn check_with_the_data_device() {
    let t = TempDir::new("check-data");
    let (m, dpath) = (t.path("meta"), t.path("data"));
    let content = |p: u64| -> Vec<u8> { (0..4096u64).map(|i| (p * 17 + i / 5) as u8).collect() };
    let (mut dd, _, d, _) = image_with_data(&dpath, content);
    fs::write(&m, &d.bytes).unwrap();

    let o = dedup(&["check", s(&m), "--data", s(&dpath)]);
    assert_eq!(code(&o), 0, "{}{}", out(&o), err(&o));
    assert!(
        out(&o).contains("data blocks verified: 150 of 150 live blocks"),
        "{}",
        out(&o)
    );

    // A damaged live block: exit 4, the PBA in the JSON.
    dd[77 * 4096 + 5] ^= 1;
    fs::write(&dpath, &dd).unwrap();
    let o = dedup(&["check", s(&m), "--data", s(&dpath), "--json"]);
    assert_eq!(code(&o), 4, "{}{}", out(&o), err(&o));
    let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(j["exit_code"], 4);
    assert_eq!(j["problems"][0]["code"], "fingerprint_mismatch");
    assert_eq!(j["problems"][0]["index"], 77);
    assert_eq!(j["summary"]["data_blocks_verified"], 149);
    assert_eq!(j["summary"]["fingerprint_mismatches"], 1);
    assert_eq!(j["summary"]["data_read_errors"], 0);
    // Free blocks are not read: damage there changes nothing.
    dd[77 * 4096 + 5] ^= 1;
    dd[180 * 4096] ^= 1;
    fs::write(&dpath, &dd).unwrap();
    assert_eq!(code(&dedup(&["check", s(&m), "--data", s(&dpath)])), 0);

    // The wrong data device, a missing one: exit 8, JSON says why.
    let o = dedup(&["check", s(&m), "--data", s(&m), "--json"]);
    assert_eq!(code(&o), 8);
    let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert!(j["fatal"].as_str().unwrap().contains("wrong device"), "{j}");
    assert_eq!(j["exit_code"], 8);
    assert_eq!(err(&o).lines().count(), 1);
    let o = dedup(&["check", s(&m), "--data", s(&t.path("nope"))]);
    assert_eq!(code(&o), 8);
    assert!(err(&o).contains("--data"), "{}", err(&o));
}

/// The superblock slots and the blocks of the image's trees, as `check
/// --json` counts them (not the journal's run, which follows the trees):
/// the trees are blocks [2, this).
fn metadata_blocks_used(m: &Path) -> u64 {
    let o = dedup(&["check", s(m), "--json"]);
    let j: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    j["summary"]["metadata_blocks_used"].as_u64().unwrap()
        - j["summary"]["journal_blocks"].as_u64().unwrap()
}

/// Deterministic pseudo-random bytes (xorshift64): metadata that is
/// neither zero nor dm-dedup.
fn garbage_bytes(len: usize) -> Vec<u8> {
    let mut x = 88172645463325252u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The sample image with two appends in its journal (LBAs 1, 4, .., 13
/// mapped to new blocks 2000..2005, then LBA 7 unmapped), as the kernel
/// leaves it at a flush; the state after them.
fn journaled_image(p: &Path) -> (ImageSpec, Superblock) {
    let spec = sample_image(p);
    let mut d = MemDev::from_bytes(fs::read(p).unwrap());
    let sb = Superblock::decode(d.block(spec.sb.slot()));
    type Edit = dyn Fn(&mut Vec<(u64, u64)>);
    let step = |from: &ImageSpec, f: &Edit| {
        let mut m = from.mappings.clone();
        f(&mut m);
        m.sort_unstable();
        let mut s = from.sb.clone();
        s.unique_writes += 5;
        ImageSpec::consistent(s, &m, test_fingerprint)
    };
    let a = step(&spec, &|m| m.extend((0..5).map(|k| (3 * k + 1, 2000 + k))));
    let b = step(&a, &|m| m.retain(|x| x.0 != 7));
    let seq = write_append(&mut d, &sb, sb.journal_seq, 13, &spec.changes_to(&a)).unwrap();
    write_append(&mut d, &sb, seq, 13, &a.changes_to(&b)).unwrap();
    fs::write(p, &d.bytes).unwrap();
    (b, sb)
}

#[test]
fn a_journal_is_checked_dumped_restored_and_repaired() {
    let t = TempDir::new("journal");
    let m = t.path("meta");
    let (state, sb) = journaled_image(&m);
    let o = dedup(&["check", s(&m)]);
    assert_eq!(code(&o), 0, "{}", out(&o));
    let text = out(&o);
    let line = format!(
        "journal: {} blocks at block {} (id {:#018x}), epoch 1: 2 blocks follow it: 2 appends \
         replayed (2 blocks, 19 records); it ends at sequence 3: block {} (sequence 3) is all \
         zeros (never written)",
        sb.journal_blocks,
        sb.journal_start,
        sb.journal_id,
        sb.journal_start + 3
    );
    assert!(text.contains(&line), "{text}");
    assert!(
        text.contains("mapped logical blocks: 3004, live physical blocks: 904"),
        "{text}"
    );

    // The dump: the state, and the appends one record per line.
    let o = dedup(&["dump", s(&m)]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    let dump = out(&o);
    for l in [
        "  \"journal\": {",
        "    \"epoch\": 1,",
        "    \"blocks_in_epoch\": 2,",
        "    \"appends\": [",
        "      {\"first_seq\": 1, \"blocks\": 1, \"records\": [",
        "        {\"type\": \"map\", \"lba\": 1, \"pba\": 2000},",
        "        {\"type\": \"refcount\", \"pba\": 2000, \"refcount\": 1},",
        "      {\"first_seq\": 2, \"blocks\": 1, \"records\": [",
        "        {\"type\": \"map\", \"lba\": 7, \"pba\": null},",
        "        {\"type\": \"refcount\", \"pba\": 2002, \"refcount\": 0},",
    ] {
        assert!(dump.lines().any(|x| x == l), "no {l:?} in\n{dump}");
    }
    assert!(dump.contains(&format!(
        "\"type\": \"fingerprint\", \"pba\": 2000, \"fingerprint\": \"{}\"",
        dedup_tools::util::hex(&test_fingerprint(2000))
    )));
    assert!(dump.contains(
        "{\"type\": \"counters\", \"mapped_blocks\": 3004, \"used_data_blocks\": 904, \
         \"unique_writes\": 910, \"duplicate_writes\": 2100, \"zero_writes\": 5, \
         \"discarded_blocks\": 7}"
    ));
    let d: serde_json::Value = serde_json::from_str(&dump).unwrap();
    assert_eq!(d["superblock"]["mapped_blocks"], 3004);
    assert_eq!(d["superblock"]["journal_seq"], 1);
    assert_eq!(d["journal"]["appends"].as_array().unwrap().len(), 2);
    assert_eq!(d["mappings"].as_array().unwrap().len(), 3004);
    assert_eq!(d["mappings"][0], serde_json::json!({"lba": 0, "pba": 0}));
    assert_eq!(d["mappings"][1], serde_json::json!({"lba": 1, "pba": 2000}));

    // Restored: the state as trees, a new empty journal.
    let j = t.path("d.json");
    fs::write(&j, &dump).unwrap();
    let m2 = t.path("meta2");
    sized_file(&m2, fs::metadata(&m).unwrap().len());
    let o = dedup(&["restore", s(&j), s(&m2)]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    let o = dedup(&["check", s(&m2), "--json"]);
    assert_eq!(code(&o), 0);
    let c: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(c["journal"]["blocks_in_epoch"], 0);
    assert_eq!(c["summary"]["mapped_blocks"], 3004);
    let o = dedup(&["dump", s(&m2)]);
    let d2: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(d2["mappings"], d["mappings"]);
    assert_eq!(d2["blocks"], d["blocks"]);
    assert_eq!(d2["journal"]["appends"], serde_json::json!([]));
    assert_eq!(state.mappings.len(), 3004);

    // A damaged second append: check says so (exit 4), repair drops it.
    let mut bytes = fs::read(&m).unwrap();
    let at = (sb.journal_start + 2) as usize * 4096;
    bytes[at + 64 + 7] = 0x6e; // the first record's type
    let blk: &mut Block = (&mut bytes[at..at + 4096]).try_into().unwrap();
    seal(blk);
    fs::write(&m, &bytes).unwrap();
    let o = dedup(&["check", s(&m)]);
    assert_eq!(code(&o), 4, "{}", out(&o));
    assert!(
        out(&o).contains(&format!(
            "error: block {}, journal, sequence 2: the block continues the journal but is \
             malformed: unknown record type 110 (record at offset 0); the kernel refuses to \
             activate",
            sb.journal_start + 2
        )),
        "{}",
        out(&o)
    );
    assert!(out(&o).contains("[journal_damaged]"));
    let o = dedup(&["repair", s(&m)]);
    assert_eq!(code(&o), 1, "{}{}", out(&o), err(&o));
    assert!(
        out(&o).contains(&format!(
            "journal: block {} (sequence 2, record at offset 0) is damaged: unknown record type \
             110; dropped from the append that starts at sequence 2 on: 1 block (sequence 2 to \
             2, 0 records that still read, 1 block with END); the state is the one after \
             sequence 1",
            sb.journal_start + 2
        )),
        "{}",
        out(&o)
    );
    assert!(out(&o).contains(
        "note: journal: 1 append (1 block, sequence 1 to 1, 16 records) replayed into the trees written"
    ), "{}", out(&o));
    let o = dedup(&["check", s(&m), "--json"]);
    assert_eq!(code(&o), 0, "{}", out(&o));
    let c: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    // The first append's state: LBA 7 still mapped.
    assert_eq!(c["summary"]["mapped_blocks"], 3005);
    assert_eq!(c["superblock"]["journal_seq"], 1 + 2 * sb.journal_blocks);
    assert_eq!(c["superblock"]["journal_id"], sb.journal_id);
    assert_eq!(c["journal"]["blocks_in_epoch"], 0);
}

/// Both superblock slots damaged (torn, or flipped on the medium) but not
/// zeroed: what `dedup repair` salvages. The kernel refuses to format such
/// a device; `format` and `restore` refuse to overwrite it without --force.
#[test]
fn format_and_restore_keep_off_damaged_metadata() {
    let t = TempDir::new("damaged");
    let m = t.path("meta");
    sample_image(&m);
    let dump = t.path("d.json");
    let o = dedup(&["dump", s(&m), "-o", s(&dump)]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    let mut bytes = fs::read(&m).unwrap();
    for slot in 0..2 {
        for b in &mut bytes[slot * 4096 + 512..slot * 4096 + 576] {
            *b ^= 0xff;
        }
    }
    fs::write(&m, &bytes).unwrap();
    let o = dedup(&[
        "format",
        s(&m),
        "--data-blocks",
        "400",
        "--logical-blocks",
        "3000",
    ]);
    assert_eq!(code(&o), 8, "{}", err(&o));
    assert!(err(&o).contains("neither zeroed nor valid"), "{}", err(&o));
    let o = dedup(&["restore", s(&dump), s(&m)]);
    assert_eq!(code(&o), 8, "{}", err(&o));
    assert!(err(&o).contains("dedup repair"), "{}", err(&o));
    assert_eq!(fs::read(&m).unwrap(), bytes, "a refused writer wrote");
    let o = dedup(&["restore", s(&dump), s(&m), "--force"]);
    assert_eq!(code(&o), 0, "{}", err(&o));
}
