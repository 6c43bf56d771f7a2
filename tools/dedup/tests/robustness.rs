//! Deterministic stand-in for the cargo-fuzz targets in tools/fuzz: the
//! same entry points run over thousands of random and mutated inputs with
//! a fixed seed. Nothing may panic, whatever `check` calls clean must
//! survive dump + restore unchanged (asserted inside fuzz_image), and what
//! `repair` writes must check clean and need no second repair (asserted
//! inside fuzz_repair).

use dedup_tools::device::MemDev;
use dedup_tools::dump::{write_dump, DumpSuperblock};
use dedup_tools::fuzzing::{
    fuzz_dump, fuzz_image, fuzz_image_owned, fuzz_journal, fuzz_repair, fuzz_stats,
    journal_fuzz_seeds,
};
use dedup_tools::ondisk::*;
use dedup_tools::writer::{format, test_fingerprint, write_append, write_image, ImageSpec};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len() as u64) as usize]
    }
}

fn image(
    logical: u64,
    data: u64,
    maps: &[(u64, u64)],
    hash: &str,
    fp_size: u32,
    gen: u64,
) -> Vec<u8> {
    let blocks = required_blocks(logical, data);
    let mut sb = Superblock::new_formatted(blocks, data, logical, hash, fp_size, 1);
    sb.header.txn = gen;
    let mut spec = ImageSpec::consistent(sb, maps, test_fingerprint);
    for f in spec.fingerprints.iter_mut() {
        f.1[fp_size as usize..].fill(0);
    }
    let mut d = MemDev::new(blocks);
    write_image(&mut d, &spec).unwrap();
    d.bytes
}

fn seeds() -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    let mut d = MemDev::new(required_blocks(600, 200));
    format(&mut d, 200, 600, "sha256", 32, 5).unwrap();
    v.push(d.bytes);
    v.push(image(
        600,
        200,
        &[(0, 0), (1, 0), (599, 199)],
        "sha256",
        32,
        2,
    ));
    let maps: Vec<(u64, u64)> = (0..700u64).map(|i| (i * 2, i % 150)).collect();
    v.push(image(1500, 300, &maps, "sha256", 32, 9));
    let maps: Vec<(u64, u64)> = (0..40u64).map(|i| (i * 6000, i % 7)).collect();
    v.push(image(508 * 508 + 3, 140, &maps, "xxhash64", 8, 3));
    v
}

/// Overwrite 8 bytes of block `b` and fix its checksum, so that the
/// change reaches the structural checks instead of stopping at the CRC.
fn poke_sealed(bytes: &mut [u8], b: usize, off: usize, v: u64) {
    let blk = &mut bytes[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE];
    blk[off..off + 8].copy_from_slice(&v.to_le_bytes());
    let blk: &mut Block = blk.try_into().unwrap();
    seal(blk);
}

/// A block to damage: most of the time one that holds something (a
/// header), since most of an image is never written (the room for the
/// trees' worst case and the journal's run).
fn pick_block(r: &mut Rng, x: &[u8]) -> usize {
    let nblocks = x.len() / BLOCK_SIZE;
    if r.below(8) != 0 {
        let used: Vec<usize> = (0..nblocks)
            .filter(|&b| {
                x[b * BLOCK_SIZE..b * BLOCK_SIZE + 64]
                    .iter()
                    .any(|&c| c != 0)
            })
            .collect();
        if !used.is_empty() {
            return *r.pick(&used);
        }
    }
    r.below(nblocks as u64) as usize
}

fn mutate(r: &mut Rng, base: &[u8]) -> Vec<u8> {
    let mut x = base.to_vec();
    let rounds = 1 + r.below(3);
    for _ in 0..rounds {
        let nblocks = x.len() / BLOCK_SIZE;
        if nblocks == 0 {
            break;
        }
        match r.below(8) {
            0 => {
                for _ in 0..1 + r.below(8) {
                    let i = r.below(x.len() as u64) as usize;
                    x[i] ^= 1 << r.below(8);
                }
            }
            1..=3 => {
                // A structural field of a tree block, a journal block or
                // the superblock, resealed: header fields, child pointers,
                // entries, journal fields and records.
                let b = pick_block(r, &x);
                let off = *r.pick(&[
                    8usize, 16, 24, 32, 40, 48, 56, 64, 72, 104, 112, 120, 128, 136, 144, 184, 208,
                    216, 224, 232,
                ]);
                let off = if r.below(2) == 0 {
                    off
                } else {
                    HEADER_SIZE + 8 * r.below(508) as usize
                };
                let v = match r.below(6) {
                    0 => 0,
                    1 => r.below(nblocks as u64 + 2),
                    2 => r.next(),
                    3 => u64::MAX,
                    4 => r.below(1 << 20),
                    _ => 1,
                };
                if (b as u64) < SB_SLOTS && r.below(2) == 0 {
                    // Keep the blocknr of a superblock right most of the time.
                    poke_sealed(&mut x, b, off.max(32), v);
                } else {
                    poke_sealed(&mut x, b, off, v);
                }
            }
            4 => {
                let n = r.below(x.len() as u64 + 1) as usize;
                x.truncate(n);
            }
            5 => {
                // Copy one block over another.
                if nblocks > 1 {
                    let a = pick_block(r, &x);
                    let b = pick_block(r, &x);
                    let src = x[a * BLOCK_SIZE..(a + 1) * BLOCK_SIZE].to_vec();
                    x[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE].copy_from_slice(&src);
                }
            }
            6 => {
                let b = pick_block(r, &x);
                x[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE].fill(0);
            }
            _ => {
                // A single byte of an entry, resealed.
                let b = pick_block(r, &x);
                let i = b * BLOCK_SIZE
                    + HEADER_SIZE
                    + r.below((BLOCK_SIZE - HEADER_SIZE) as u64) as usize;
                x[i] = r.next() as u8;
                let blk: &mut Block = (&mut x[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE])
                    .try_into()
                    .unwrap();
                seal(blk);
            }
        }
    }
    x
}

#[test]
fn check_never_panics_on_mutated_images() {
    let seeds = seeds();
    for s in &seeds {
        fuzz_image(s);
    }
    let mut r = Rng(0x0005_EED0_FDED_u64);
    for i in 0..4000 {
        // The deep-tree seed is 4 MiB: use it for one input in ten.
        let base = if i % 10 == 0 {
            &seeds[seeds.len() - 1]
        } else {
            &seeds[r.below(seeds.len() as u64 - 1) as usize]
        };
        fuzz_image_owned(mutate(&mut r, base));
    }
}

#[test]
fn check_never_panics_on_random_bytes() {
    let mut r = Rng(42);
    for i in 0..600 {
        let len = match i % 4 {
            0 => r.below(3 * BLOCK_SIZE as u64),
            1 => (BLOCK_SIZE as u64) * (2 + r.below(6)),
            _ => r.below(12 * BLOCK_SIZE as u64),
        } as usize;
        let mut v: Vec<u8> = (0..len).map(|_| r.next() as u8).collect();
        if i % 3 == 0 && len >= 2 * BLOCK_SIZE {
            // Plant a magic so that more than the first test is passed.
            let slot = (r.below(2) as usize) * BLOCK_SIZE;
            v[slot + 32..slot + 40].copy_from_slice(&SB_MAGIC.to_le_bytes());
            v[slot + 4..slot + 8].copy_from_slice(&BT_SUPER.to_le_bytes());
            v[slot + 8..slot + 16].copy_from_slice(&((slot / BLOCK_SIZE) as u64).to_le_bytes());
            v[slot + 40..slot + 44].copy_from_slice(&1u32.to_le_bytes());
            let blk: &mut Block = (&mut v[slot..slot + BLOCK_SIZE]).try_into().unwrap();
            seal(blk);
        }
        fuzz_image(&v);
    }
}

#[test]
fn repair_never_panics_and_always_writes_clean_metadata() {
    let mut seeds = seeds();
    // Small data devices, so that the --data path runs too.
    let maps: Vec<(u64, u64)> = (0..300u64).map(|i| (i * 3, i % 50)).collect();
    seeds.push(image(1200, 60, &maps, "sha256", 32, 6));
    seeds.push(image(1200, 60, &maps, "crc32c", 4, 7));
    // All but the deep tree, the only image of more than 1 MiB (its
    // trees' worst case and its journal of 258 blocks).
    let small: Vec<&Vec<u8>> = seeds.iter().filter(|s| s.len() < 1 << 20).collect();
    assert_eq!(small.len(), seeds.len() - 1);
    for s in &seeds {
        fuzz_repair(s);
    }
    let mut r = Rng(0x2E9A_1200);
    for i in 0..1200 {
        let base = small[r.below(small.len() as u64) as usize];
        let mut x = mutate(&mut r, base);
        // Unsealed damage too: the salvage path is about bad checksums.
        if i % 2 == 0 && !x.is_empty() {
            for _ in 0..1 + r.below(3) {
                let p = r.below(x.len() as u64) as usize;
                x[p] ^= 1 << r.below(8);
            }
        }
        fuzz_repair(&x);
    }
}

#[test]
fn restore_never_panics_on_mutated_dumps() {
    let maps: Vec<(u64, u64)> = (0..30u64).map(|i| (i * 3, i % 11)).collect();
    let bytes = image(200, 60, &maps, "sha256", 32, 4);
    let d = MemDev::from_bytes(bytes);
    let opts = dedup_tools::check::CheckOptions {
        collect: true,
        ..Default::default()
    };
    let (rep, c) = dedup_tools::check::check(&d, &opts).unwrap();
    let sb = Superblock::decode(d.block(rep.superblock.unwrap().slot));
    let mut json = Vec::new();
    write_dump(&mut json, &DumpSuperblock::from_sb(&sb), &c.unwrap()).unwrap();
    fuzz_dump(&json);
    let text = String::from_utf8(json).unwrap();
    let mut r = Rng(7);
    let digits: Vec<usize> = text
        .char_indices()
        .filter(|(_, c)| c.is_ascii_digit())
        .map(|(i, _)| i)
        .collect();
    for i in 0..3000 {
        let mut t = text.clone().into_bytes();
        if i % 2 == 0 {
            // Change numbers: stays valid JSON, exercises validation.
            for _ in 0..1 + r.below(3) {
                let p = *r.pick(&digits);
                t[p] = b'0' + r.below(10) as u8;
            }
        } else {
            for _ in 0..1 + r.below(4) {
                let p = r.below(t.len() as u64) as usize;
                t[p] = r.next() as u8;
            }
        }
        fuzz_dump(&t);
    }
}

#[test]
fn stats_parsers_never_panic() {
    let good = b"0 2097152 dedup rw 42 130/16384 5000/262144 9000 5000 3500 500 200 sha256 no_verify no_discard_passdown\nmode rw\nmapped_blocks 9000\ndata_blocks_live 4500\n";
    fuzz_stats(good);
    let mut r = Rng(99);
    for _ in 0..3000 {
        let mut t = good.to_vec();
        for _ in 0..1 + r.below(4) {
            let p = r.below(t.len() as u64) as usize;
            t[p] = *r.pick(b"0123456789 /\n=:xa-\xff");
        }
        fuzz_stats(&t);
    }
}

/// A seed image whose journal holds appends: what the kernel leaves at a
/// flush, for the image and repair properties.
fn journaled_seed() -> Vec<u8> {
    let (logical, data) = (600u64, 200u64);
    let blocks = required_blocks(logical, data);
    let mut sb = Superblock::new_formatted(blocks, data, logical, "sha256", 32, 1);
    sb.header.txn = 4;
    let maps: Vec<(u64, u64)> = (0..300u64).map(|i| (i * 2, i % 90)).collect();
    let a = ImageSpec::consistent(sb, &maps, test_fingerprint);
    let mut d = MemDev::new(blocks);
    let (sb, _) = write_image(&mut d, &a).unwrap();
    let mut maps2 = maps.clone();
    maps2.retain(|m| m.0 % 10 != 0);
    maps2.extend((0..20u64).map(|i| (2 * i + 1, 150 + i)));
    maps2.sort_unstable();
    let b = ImageSpec::consistent(a.sb.clone(), &maps2, test_fingerprint);
    let mut seq = sb.journal_seq;
    seq = write_append(&mut d, &sb, seq, 5, &a.changes_to(&b)).unwrap();
    let c = ImageSpec::consistent(a.sb.clone(), &maps, test_fingerprint);
    write_append(&mut d, &sb, seq, 5, &b.changes_to(&c)).unwrap();
    d.bytes
}

#[test]
fn journaled_images_survive_mutation() {
    let seed = journaled_seed();
    fuzz_image(&seed);
    fuzz_repair(&seed);
    let mut r = Rng(0x00B1_0C5E);
    for i in 0..600 {
        let x = mutate(&mut r, &seed);
        if i % 3 == 0 {
            fuzz_repair(&x);
        } else {
            fuzz_image_owned(x);
        }
    }
}

#[test]
fn journal_parser_and_replay_never_panic() {
    let seeds = journal_fuzz_seeds();
    for s in &seeds {
        fuzz_journal(s);
    }
    let mut r = Rng(0x3A11_0F00);
    for i in 0..400 {
        let mut x = r.pick(&seeds).clone();
        for _ in 0..1 + r.below(6) {
            if x.is_empty() {
                break;
            }
            let p = r.below(x.len() as u64) as usize;
            match r.below(4) {
                // Journal fields and record keys more often than payload.
                0 => {
                    let blk = (p / BLOCK_SIZE) * BLOCK_SIZE;
                    let off = *r.pick(&[56usize, 57, 60, 64, 71, 72, 80, 87, 88]);
                    if let Some(c) = x.get_mut(blk + off + 16) {
                        *c = r.next() as u8;
                    }
                }
                1 => x[p] ^= 1 << r.below(8),
                2 => x[p] = r.next() as u8,
                _ => {
                    let n = r.below(x.len() as u64 + 1) as usize;
                    x.truncate(n.max(16));
                }
            }
        }
        if i % 50 == 0 {
            // Random bytes, head included.
            x = (0..r.below(3 * BLOCK_SIZE as u64))
                .map(|_| r.next() as u8)
                .collect();
        }
        fuzz_journal(&x);
    }
}
