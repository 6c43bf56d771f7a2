//! Build a large, consistent metadata image for measurements (e.g. of
//! `dedup check` per GiB), streaming the trees to the file without holding
//! the content in memory.
//!
//!   cargo run --release --example make-image -- OUT LOGICAL_BLOCKS DATA_BLOCKS
//!
//! Every logical block is mapped: logical block i points at physical block
//! perm(i mod DATA) for a fixed permutation, so that map entries are
//! scattered over the data device as a real workload leaves them and each
//! physical block is shared by about LOGICAL / DATA logical blocks. The
//! file gets the kernel's minimum size for these sizes (twice the full
//! trees and the journal the sizes ask for, a quarter of that), about 40%
//! of which is written. The superblock is format version 2 with an empty
//! journal right after the trees.

use std::time::Instant;

use dedup_tools::device::{BlockDev, FileDev};
use dedup_tools::ondisk::*;
use dedup_tools::writer::{fresh_journal_id, new_run, test_fingerprint, TreeWriter};

/// x with a * x = 1 mod n, for a coprime with n (extended Euclid).
fn mod_inverse(a: u64, n: u64) -> u64 {
    let (mut r0, mut r1) = (n as i128, a as i128);
    let (mut t0, mut t1) = (0i128, 1i128);
    while r1 != 0 {
        let q = r0 / r1;
        (r0, r1) = (r1, r0 - q * r1);
        (t0, t1) = (t1, t0 - q * t1);
    }
    t0.rem_euclid(n as i128) as u64
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let sizes = args
        .get(2..4)
        .and_then(|a| Some((a[0].parse::<u64>().ok()?, a[1].parse::<u64>().ok()?)));
    let Some((logical, data)) = sizes.filter(|&(l, d)| args.len() == 4 && 0 < d && d <= l) else {
        eprintln!("usage: make-image OUT LOGICAL_BLOCKS DATA_BLOCKS (0 < DATA <= LOGICAL)");
        std::process::exit(16);
    };
    // x -> x * m mod data is a permutation when m is coprime with data.
    let mut m = 2_654_435_761u64 % data;
    while data > 1 && (m == 0 || gcd(m, data) != 1) {
        m += 1;
    }
    let mul = |x: u64, k: u64| ((x as u128 * k as u128) % data as u128) as u64;
    let inv = if data > 1 { mod_inverse(m, data) } else { 0 };
    let (per, extra) = (logical / data, logical % data);
    // Logical blocks i with i mod data = perm^-1(pba) map to pba.
    let refcount = |pba: u64| per as u32 + (mul(pba, inv) < extra) as u32;

    let blocks = required_blocks(logical, data);
    let out = std::path::Path::new(&args[1]);
    if let Err(e) = std::fs::File::create(out).and_then(|f| f.set_len(blocks * BLOCK_SIZE as u64)) {
        eprintln!("make-image: {}: {e}", out.display());
        std::process::exit(8);
    }
    let mut dev = FileDev::open(out, true).unwrap_or_else(|e| {
        eprintln!("make-image: {e}");
        std::process::exit(8);
    });
    let t = Instant::now();
    let mut sb = Superblock::new_formatted(blocks, data, logical, "sha256", 32, 1_700_000_000);
    sb.header.txn = 2;
    sb.mapped_blocks = logical;
    sb.used_data_blocks = data;
    sb.unique_writes = data;
    sb.duplicate_writes = logical - data;
    let mut w = TreeWriter::new(&mut dev, FIRST_TREE_BLOCK, blocks, sb.generation());
    let written = (|| -> std::io::Result<u64> {
        sb.map_root = w.build(
            &sb.geometry(ArrayId::Map),
            (0..logical).map(|lba| (lba, (mul(lba % data, m) + 1).to_le_bytes())),
        )?;
        sb.refcount_root = w.build(
            &sb.geometry(ArrayId::Refcount),
            (0..data).map(|pba| (pba, refcount(pba).to_le_bytes())),
        )?;
        sb.fingerprint_root = w.build(
            &sb.geometry(ArrayId::Fingerprint),
            (0..data).map(|pba| (pba, test_fingerprint(pba))),
        )?;
        Ok(w.blocks)
    })();
    let tree_blocks = written.unwrap_or_else(|e| {
        eprintln!("make-image: {e}");
        std::process::exit(8);
    });
    // The journal's run follows the trees (its blocks stay unwritten), as
    // long as the kernel would make it.
    let (start, len) = new_run(&sb, &[], w.next_free()).unwrap_or_else(|| {
        eprintln!("make-image: no room for a journal");
        std::process::exit(8);
    });
    sb.journal_start = start;
    sb.journal_blocks = len;
    sb.journal_seq = 1;
    sb.journal_id = fresh_journal_id();
    let r = dev
        .write_block(sb.slot(), &sb.encode())
        .and_then(|_| dev.flush());
    if let Err(e) = r {
        eprintln!("make-image: {e}");
        std::process::exit(8);
    }
    println!(
        "{}: {blocks} blocks ({:.2} GiB), {tree_blocks} tree blocks ({:.2} GiB) written in {:.1} s; \
         {logical} logical, {data} data blocks",
        out.display(),
        (blocks << 12) as f64 / (1u64 << 30) as f64,
        (tree_blocks << 12) as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64()
    );
}
