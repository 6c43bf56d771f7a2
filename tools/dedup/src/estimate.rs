//! `dedup estimate`: how much a set of images or devices would shrink on
//! dm-dedup, and what the target would need to hold them.
//!
//! Rules (documented in README.md):
//! - Every input is cut into blocks at offsets that are multiples of the
//!   block size, from offset 0. A trailing partial block is padded with
//!   zeros (as it would be stored in a 4 KiB-block filesystem or device).
//! - A block whose bytes are all zero is counted as a zero block: the
//!   target does not store it (it unmaps the logical block).
//! - Two non-zero blocks are duplicates when their SHA-256 digests agree
//!   (the first 16 bytes are kept: the chance of a false match among 2^40
//!   blocks is below 2^-47). Blocks larger than 4 KiB are fingerprinted
//!   from the fingerprints of their 4 KiB parts, so they are duplicates
//!   exactly when all their parts are.
//! - All inputs together form one pool: a block present in two inputs is
//!   stored once.

use std::collections::HashSet;
use std::fs::File;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::{self, IsTerminal, Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::ondisk::saved::IndexGeometry;
use crate::ondisk::{required_blocks, BLOCK_SIZE};
use crate::util::*;

pub const DEFAULT_BLOCK_SIZES: [u32; 4] = [4096, 8192, 16384, 32768];
/// Bytes read per request: large and sequential.
pub const CHUNK: usize = 8 << 20;
/// Largest block size accepted. Block sizes are powers of two from 4 KiB
/// to this, so that a chunk holds a whole number of them.
pub const MAX_BLOCK_SIZE: u32 = 1 << 20;
const SHARDS: usize = 256;

/// Keys are already uniform (digest bytes): hash them by folding.
#[derive(Default)]
struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = (v as u64) ^ ((v >> 64) as u64);
    }
}

type FastSet = HashSet<u128, BuildHasherDefault<FoldHasher>>;

/// Digests seen, split into shards so that threads rarely contend.
struct Sharded {
    shards: Vec<Mutex<FastSet>>,
}

impl Sharded {
    fn new() -> Sharded {
        Sharded {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(FastSet::default()))
                .collect(),
        }
    }

    /// Insert a batch; the shard is chosen by the top byte.
    fn insert_all(&self, keys: &[u128]) {
        let mut by_shard: Vec<Vec<u128>> = vec![Vec::new(); SHARDS];
        for &k in keys {
            by_shard[(k >> 120) as usize].push(k);
        }
        by_shard.into_par_iter().enumerate().for_each(|(i, ks)| {
            if !ks.is_empty() {
                let mut s = self.shards[i].lock().unwrap();
                s.extend(ks);
            }
        });
    }

    fn len(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap().len() as u64)
            .sum()
    }
}

/// Running totals for one block size.
struct SizeState {
    block_size: u32,
    total: AtomicU64,
    zero: AtomicU64,
    seen: Sharded,
}

/// Shared state of a scan.
pub struct Scanner {
    sizes: Vec<SizeState>,
    /// Bytes consumed so far, for progress.
    pub bytes_done: AtomicU64,
}

/// Fingerprint of one 4 KiB block, None if all zero.
fn fp4k(b: &[u8]) -> Option<u128> {
    if b.iter().all(|&x| x == 0) {
        return None;
    }
    let d = Sha256::digest(b);
    Some(u128::from_be_bytes(d[..16].try_into().unwrap()))
}

/// Fingerprint of a larger block from its 4 KiB parts, None if all zero.
fn fp_group(parts: &[Option<u128>]) -> Option<u128> {
    if parts.iter().all(Option::is_none) {
        return None;
    }
    let mut h = Sha256::new();
    for p in parts {
        // A zero part contributes a marker no digest prefix can equal
        // with any relevant probability.
        h.update(p.unwrap_or(0).to_be_bytes());
    }
    let d = h.finalize();
    Some(u128::from_be_bytes(d[..16].try_into().unwrap()))
}

impl Scanner {
    /// `sizes`: powers of two from 4096 to MAX_BLOCK_SIZE (so that CHUNK
    /// holds whole blocks: `process` groups the 4 KiB parts of one chunk
    /// only); 4096 is always included (the target's size).
    pub fn new(sizes: &[u32]) -> Scanner {
        assert!(
            sizes
                .iter()
                .all(|&n| n.is_power_of_two() && (BLOCK_SIZE as u32..=MAX_BLOCK_SIZE).contains(&n)),
            "block sizes {sizes:?}"
        );
        let mut s: Vec<u32> = sizes.to_vec();
        s.push(BLOCK_SIZE as u32);
        s.sort_unstable();
        s.dedup();
        Scanner {
            sizes: s
                .into_iter()
                .map(|block_size| SizeState {
                    block_size,
                    total: AtomicU64::new(0),
                    zero: AtomicU64::new(0),
                    seen: Sharded::new(),
                })
                .collect(),
            bytes_done: AtomicU64::new(0),
        }
    }

    /// Account one chunk: a whole number of the largest block size, except
    /// at the end of an input, where it is padded with zeros here.
    fn process(&self, chunk: &[u8]) {
        if chunk.is_empty() {
            return;
        }
        let n4 = chunk.len().div_ceil(BLOCK_SIZE);
        let fps: Vec<Option<u128>> = (0..n4)
            .into_par_iter()
            .map(|i| {
                let s = i * BLOCK_SIZE;
                let e = (s + BLOCK_SIZE).min(chunk.len());
                if e - s == BLOCK_SIZE {
                    fp4k(&chunk[s..e])
                } else {
                    let mut b = [0u8; BLOCK_SIZE];
                    b[..e - s].copy_from_slice(&chunk[s..e]);
                    fp4k(&b)
                }
            })
            .collect();
        for st in &self.sizes {
            let k = (st.block_size as usize) / BLOCK_SIZE;
            let group: Vec<Option<u128>> = if k == 1 {
                fps.clone()
            } else {
                (0..n4.div_ceil(k))
                    .into_par_iter()
                    .map(|g| {
                        let s = g * k;
                        let e = (s + k).min(n4);
                        if e - s == k {
                            fp_group(&fps[s..e])
                        } else {
                            // The tail of an input: pad with zero parts.
                            let mut parts = fps[s..e].to_vec();
                            parts.resize(k, None);
                            fp_group(&parts)
                        }
                    })
                    .collect()
            };
            let keys: Vec<u128> = group.iter().flatten().copied().collect();
            st.total.fetch_add(group.len() as u64, Ordering::Relaxed);
            st.zero
                .fetch_add((group.len() - keys.len()) as u64, Ordering::Relaxed);
            st.seen.insert_all(&keys);
        }
        self.bytes_done
            .fetch_add(chunk.len() as u64, Ordering::Relaxed);
    }

    /// Scan one input to its end. Reading the next chunk overlaps with
    /// hashing the current one. Returns the bytes read.
    pub fn scan(&self, r: &mut (dyn Read + Send)) -> io::Result<u64> {
        let mut cur = vec![0u8; CHUNK];
        let mut next = vec![0u8; CHUNK];
        let mut n = read_full(r, &mut cur)?;
        let mut total = 0u64;
        while n > 0 {
            let (res, ()) = rayon::join(
                || {
                    if n == CHUNK {
                        read_full(r, &mut next)
                    } else {
                        Ok(0)
                    }
                },
                || self.process(&cur[..n]),
            );
            total += n as u64;
            n = res?;
            std::mem::swap(&mut cur, &mut next);
        }
        Ok(total)
    }

    pub fn results(&self) -> Vec<SizeResult> {
        self.sizes
            .iter()
            .map(|s| {
                let total = s.total.load(Ordering::Relaxed);
                let zero = s.zero.load(Ordering::Relaxed);
                let unique = s.seen.len();
                let stored = unique;
                SizeResult {
                    block_size: s.block_size,
                    total_blocks: total,
                    zero_blocks: zero,
                    unique_blocks: unique,
                    duplicate_blocks: total - zero - unique,
                    stored_bytes: stored * s.block_size as u64,
                    savings_percent: if total == 0 {
                        0.0
                    } else {
                        100.0 * (total - stored) as f64 / total as f64
                    },
                    dedup_only_savings_percent: if total == zero {
                        0.0
                    } else {
                        100.0 * (total - zero - unique) as f64 / (total - zero) as f64
                    },
                }
            })
            .collect()
    }
}

/// Fill `buf` unless the input ends first; the number of bytes read.
fn read_full(r: &mut (dyn Read + Send), buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SizeResult {
    pub block_size: u32,
    pub total_blocks: u64,
    pub zero_blocks: u64,
    /// Distinct non-zero blocks: what would be stored.
    pub unique_blocks: u64,
    /// Non-zero blocks that repeat an earlier one.
    pub duplicate_blocks: u64,
    pub stored_bytes: u64,
    /// 100 * (total - unique) / total: zeros and duplicates together.
    pub savings_percent: f64,
    /// Savings among the non-zero blocks only.
    pub dedup_only_savings_percent: f64,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct InputResult {
    pub path: String,
    pub bytes: u64,
}

/// What dm-dedup would need for the inputs, at 4 KiB.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TargetNeeds {
    /// Logical size: every 4 KiB block of the inputs.
    pub logical_blocks: u64,
    /// Data device: the unique non-zero blocks (no headroom included).
    pub data_blocks: u64,
    pub data_bytes: u64,
    /// Fingerprint index: its packed entries (dd_index_bytes), the words
    /// of [`crate::ondisk::saved::IndexGeometry`] for the data blocks.
    pub index_bytes: u64,
    /// Allocation bitmaps: 2 bits per data block and per metadata block.
    pub bitmap_bytes: u64,
    pub ram_bytes: u64,
    /// dd_md_required_blocks(logical, data): the smallest metadata device.
    pub metadata_blocks: u64,
    pub metadata_bytes: u64,
}

pub fn target_needs(logical_blocks: u64, data_blocks: u64) -> TargetNeeds {
    // The kernel sizes everything from the data device, which is at least
    // one block.
    let data = data_blocks.max(1);
    let index_bytes = IndexGeometry::for_data_blocks(data).words() * 8;
    let metadata_blocks = required_blocks(logical_blocks, data);
    // used, pending and cooling for data blocks; used and pending for
    // metadata blocks (Documentation/dm-dedup.rst, "Memory")
    let bitmap_bytes = 3 * data.div_ceil(64) * 8 + 2 * metadata_blocks.div_ceil(64) * 8;
    TargetNeeds {
        logical_blocks,
        data_blocks,
        data_bytes: data_blocks * BLOCK_SIZE as u64,
        index_bytes,
        bitmap_bytes,
        ram_bytes: index_bytes + bitmap_bytes,
        metadata_blocks,
        metadata_bytes: metadata_blocks * BLOCK_SIZE as u64,
    }
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Estimate {
    pub inputs: Vec<InputResult>,
    pub total_bytes: u64,
    pub block_sizes: Vec<SizeResult>,
    pub target: TargetNeeds,
}

pub fn estimate_from(scanner: &Scanner, inputs: Vec<InputResult>) -> Estimate {
    let block_sizes = scanner.results();
    let r4 = block_sizes
        .iter()
        .find(|r| r.block_size == BLOCK_SIZE as u32)
        .expect("4 KiB is always scanned");
    let target = target_needs(r4.total_blocks, r4.unique_blocks);
    Estimate {
        total_bytes: inputs.iter().map(|i| i.bytes).sum(),
        inputs,
        block_sizes,
        target,
    }
}

pub fn render(e: &Estimate, shown: &[u32]) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    for i in &e.inputs {
        let _ = writeln!(o, "input {}: {}", i.path, human_bytes(i.bytes));
    }
    let _ = writeln!(
        o,
        "scanned {} in {} input{}\n",
        human_bytes(e.total_bytes),
        e.inputs.len(),
        if e.inputs.len() == 1 { "" } else { "s" }
    );
    let _ = writeln!(
        o,
        "{:>10} {:>14} {:>14} {:>14} {:>12} {:>8} {:>10}",
        "block size", "blocks", "zero", "unique", "stored", "savings", "dedup only"
    );
    for r in e
        .block_sizes
        .iter()
        .filter(|r| shown.contains(&r.block_size))
    {
        let _ = writeln!(
            o,
            "{:>10} {:>14} {:>14} {:>14} {:>12} {:>7.1}% {:>9.1}%",
            human_bytes(r.block_size as u64),
            r.total_blocks,
            r.zero_blocks,
            r.unique_blocks,
            human_bytes(r.stored_bytes),
            r.savings_percent,
            r.dedup_only_savings_percent
        );
    }
    let t = &e.target;
    let _ = writeln!(o, "\ndm-dedup (4 KiB blocks) would need:");
    let _ = writeln!(
        o,
        "  logical size      {} blocks ({})",
        t.logical_blocks,
        human_bytes(t.logical_blocks * BLOCK_SIZE as u64)
    );
    let _ = writeln!(
        o,
        "  data device       {} blocks ({}) at least, for the unique non-zero blocks",
        t.data_blocks,
        human_bytes(t.data_bytes)
    );
    let _ = writeln!(
        o,
        "  metadata device   {} blocks ({}) at least",
        t.metadata_blocks,
        human_bytes(t.metadata_bytes)
    );
    let _ = writeln!(
        o,
        "  RAM               {} (index {}, bitmaps {}); it grows with the data device size",
        human_bytes(t.ram_bytes),
        human_bytes(t.index_bytes),
        human_bytes(t.bitmap_bytes)
    );
    o
}

/// Prints "scanned X of Y" on stderr twice a second until dropped.
struct Progress {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    fn start(scanner: Arc<Scanner>, total: u64) -> Progress {
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let handle = std::thread::spawn(move || {
            let t0 = Instant::now();
            while !s2.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(500));
                let done = scanner.bytes_done.load(Ordering::Relaxed);
                let secs = t0.elapsed().as_secs_f64().max(0.001);
                let pct = if total > 0 {
                    format!(" ({:.1}%)", 100.0 * done as f64 / total as f64)
                } else {
                    String::new()
                };
                let mut err = io::stderr().lock();
                let _ = write!(
                    err,
                    "\rscanned {} of {}{pct}, {}/s   ",
                    human_bytes(done),
                    human_bytes(total),
                    human_bytes((done as f64 / secs) as u64)
                );
                let _ = err.flush();
            }
            let _ = writeln!(io::stderr());
        });
        Progress {
            stop,
            handle: Some(handle),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

pub struct EstimateConfig {
    pub inputs: Vec<PathBuf>,
    pub block_sizes: Vec<u32>,
    pub json: bool,
    pub progress: bool,
    pub threads: Option<usize>,
}

/// Check a --block-sizes list.
pub fn parse_block_sizes(s: &str) -> Result<Vec<u32>, String> {
    let mut v = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let n = parse_size(part)?;
        // A power of two divides CHUNK, so a chunk holds whole blocks.
        if !n.is_power_of_two() || !(BLOCK_SIZE as u64..=MAX_BLOCK_SIZE as u64).contains(&n) {
            return Err(format!(
                "block size {part}: must be a power of two from 4K to 1M \
                 (4K, 8K, 16K, 32K, 64K, 128K, 256K, 512K, 1M)"
            ));
        }
        v.push(n as u32);
    }
    if v.is_empty() {
        return Err("no block size given".into());
    }
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

pub fn run(cfg: EstimateConfig) -> i32 {
    if let Some(t) = cfg.threads {
        if let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
        {
            eprintln!("dedup estimate: {e}");
            return EXIT_OPERATIONAL;
        }
    }
    let mut files = Vec::new();
    for p in &cfg.inputs {
        let opened = File::open(p).and_then(|mut f| {
            let size = f.seek(SeekFrom::End(0))?;
            f.seek(SeekFrom::Start(0))?;
            Ok((f, size))
        });
        match opened {
            Ok((f, size)) => {
                if f.metadata().map(|m| m.is_dir()).unwrap_or(false) {
                    eprintln!("dedup estimate: {}: is a directory", p.display());
                    return EXIT_USAGE;
                }
                files.push((p.clone(), f, size));
            }
            Err(e) => {
                eprintln!("dedup estimate: {}: {e}", p.display());
                return EXIT_OPERATIONAL;
            }
        }
    }
    let total: u64 = files.iter().map(|f| f.2).sum();
    let scanner = Arc::new(Scanner::new(&cfg.block_sizes));
    let progress = (cfg.progress || io::stderr().is_terminal())
        .then(|| Progress::start(scanner.clone(), total));
    let results: Vec<Result<InputResult, String>> = files
        .into_par_iter()
        .map(|(p, mut f, _)| {
            scanner
                .scan(&mut f)
                .map(|bytes| InputResult {
                    path: p.display().to_string(),
                    bytes,
                })
                .map_err(|e| format!("{}: {e}", p.display()))
        })
        .collect();
    drop(progress);
    let mut inputs = Vec::new();
    for r in results {
        match r {
            Ok(i) => inputs.push(i),
            Err(e) => {
                eprintln!("dedup estimate: {e}");
                return EXIT_OPERATIONAL;
            }
        }
    }
    let est = estimate_from(&scanner, inputs);
    if cfg.json {
        match serde_json::to_string_pretty(&est) {
            Ok(j) => println!("{j}"),
            Err(e) => {
                eprintln!("dedup estimate: {e}");
                return EXIT_OPERATIONAL;
            }
        }
    } else {
        print!("{}", render(&est, &cfg.block_sizes));
    }
    EXIT_OK
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn block(seed: u8) -> Vec<u8> {
        (0..BLOCK_SIZE)
            .map(|i| (i as u8).wrapping_mul(seed) ^ seed)
            .collect()
    }

    fn scan_bytes(sizes: &[u32], data: &[Vec<u8>]) -> Estimate {
        let s = Scanner::new(sizes);
        let mut inputs = Vec::new();
        for (i, d) in data.iter().enumerate() {
            let n = s.scan(&mut Cursor::new(d.clone())).unwrap();
            inputs.push(InputResult {
                path: format!("in{i}"),
                bytes: n,
            });
        }
        estimate_from(&s, inputs)
    }

    fn get(e: &Estimate, bs: u32) -> &SizeResult {
        e.block_sizes.iter().find(|r| r.block_size == bs).unwrap()
    }

    #[test]
    fn counts_zero_unique_and_duplicates() {
        // A B A 0 | B B 0 0  (8 blocks of 4 KiB)
        let (a, b, z) = (block(3), block(5), vec![0u8; BLOCK_SIZE]);
        let data: Vec<u8> = [&a[..], &b, &a, &z, &b, &b, &z, &z].concat();
        let e = scan_bytes(&[4096, 8192, 16384], &[data]);
        let r4 = get(&e, 4096);
        assert_eq!(
            (r4.total_blocks, r4.zero_blocks, r4.unique_blocks),
            (8, 3, 2)
        );
        assert_eq!(r4.duplicate_blocks, 3);
        assert!((r4.savings_percent - 75.0).abs() < 1e-9);
        assert!((r4.dedup_only_savings_percent - 60.0).abs() < 1e-9);
        // 8 KiB: AB A0 BB 00 -> 4 blocks, 1 zero, 3 unique.
        let r8 = get(&e, 8192);
        assert_eq!(
            (r8.total_blocks, r8.zero_blocks, r8.unique_blocks),
            (4, 1, 3)
        );
        // 16 KiB: ABA0 BB00 -> 2 unique.
        let r16 = get(&e, 16384);
        assert_eq!(
            (r16.total_blocks, r16.zero_blocks, r16.unique_blocks),
            (2, 0, 2)
        );
        assert_eq!(e.target.logical_blocks, 8);
        assert_eq!(e.target.data_blocks, 2);
        assert_eq!(e.target.metadata_blocks, required_blocks(8, 2));
        // 2 buckets of 8 entries of 30 bits.
        assert_eq!(e.target.index_bytes, 8 * 8);
    }

    #[test]
    fn inputs_share_one_pool_and_tails_are_padded() {
        let a = block(7);
        let mut tail = block(9);
        tail.truncate(100);
        let mut padded = tail.clone();
        padded.resize(BLOCK_SIZE, 0);
        // Input 2 ends with 100 bytes equal to the start of `padded`.
        let e = scan_bytes(
            &[4096],
            &[[&a[..], &padded[..]].concat(), [&a[..], &tail[..]].concat()],
        );
        let r = get(&e, 4096);
        assert_eq!((r.total_blocks, r.zero_blocks, r.unique_blocks), (4, 0, 2));
        assert_eq!(
            e.total_bytes,
            2 * BLOCK_SIZE as u64 + BLOCK_SIZE as u64 + 100
        );
    }

    #[test]
    fn spans_several_chunks() {
        // 3 chunks and a bit: every 4 KiB block distinct except a repeat
        // of the whole first chunk.
        let nb = CHUNK / BLOCK_SIZE;
        let mut data = Vec::with_capacity(3 * CHUNK + BLOCK_SIZE);
        for i in 0..(2 * nb) as u32 {
            let mut b = vec![0u8; BLOCK_SIZE];
            b[..4].copy_from_slice(&i.to_le_bytes());
            b[4] = 1;
            data.extend_from_slice(&b);
        }
        let first = data[..CHUNK].to_vec();
        data.extend_from_slice(&first);
        data.extend_from_slice(&[0u8; 10]);
        let e = scan_bytes(&[4096, 32768], &[data]);
        let r = get(&e, 4096);
        assert_eq!(r.total_blocks as usize, 3 * nb + 1);
        assert_eq!(r.zero_blocks, 1);
        assert_eq!(r.unique_blocks as usize, 2 * nb);
        let r32 = get(&e, 32768);
        assert_eq!(r32.unique_blocks as usize, 2 * nb / 8);
        assert_eq!(r32.zero_blocks, 1);
    }

    #[test]
    fn empty_input() {
        let e = scan_bytes(&[4096], &[Vec::new()]);
        assert_eq!(get(&e, 4096).total_blocks, 0);
        assert_eq!(get(&e, 4096).savings_percent, 0.0);
        assert!(!render(&e, &[4096]).is_empty());
    }

    #[test]
    fn block_size_lists() {
        assert_eq!(
            parse_block_sizes("4096,8K, 16k").unwrap(),
            vec![4096, 8192, 16384]
        );
        assert!(parse_block_sizes("1000").is_err());
        assert!(parse_block_sizes("2M").is_err());
        assert!(parse_block_sizes("").is_err());
    }

    #[test]
    fn block_sizes_must_be_powers_of_two() {
        // A chunk (8 MiB) holds a whole number of blocks only when the
        // block size is a power of two: 12K would end every chunk in a
        // padded block that is not in the input.
        for bad in ["12K", "20K", "24576", "1020K"] {
            let e = parse_block_sizes(bad).unwrap_err();
            assert!(e.contains("power of two"), "{bad}: {e}");
            assert!(
                e.contains("4K, 8K, 16K, 32K, 64K, 128K, 256K, 512K, 1M"),
                "{e}"
            );
        }
        let all = parse_block_sizes("4K,8K,16K,32K,64K,128K,256K,512K,1M").unwrap();
        assert_eq!(all.len(), 9);
        assert!(all.iter().all(|&n| CHUNK.is_multiple_of(n as usize)));
    }

    #[test]
    fn needs_formula() {
        let t = target_needs(1 << 20, 1 << 18);
        // 34493 buckets of 8 entries of 30 bits (2065 leaves: L = 12).
        assert_eq!(t.index_bytes, 129_349 * 8);
        assert_eq!(t.metadata_blocks, required_blocks(1 << 20, 1 << 18));
        assert_eq!(
            t.bitmap_bytes,
            3 * (1 << 12) * 8 + 2 * t.metadata_blocks.div_ceil(64) * 8
        );
        assert_eq!(t.ram_bytes, t.index_bytes + t.bitmap_bytes);
    }
}
