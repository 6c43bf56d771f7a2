//! Fingerprints of data blocks as the kernel computes them, for the hashes
//! this tool can compute, reading them from a data device (`check --data`,
//! `repair --data`), and the placeholder record `repair` writes for a live
//! block whose fingerprint is lost.
//!
//! A fingerprint record is 32 bytes: the first fp_size bytes of the crypto
//! API digest (min(digest size, 32)), the rest zero
//! (Documentation/dedup-format.rst, "Fingerprint entry").

use blake2::digest::consts::{U32, U48, U64};
use blake2::Blake2b;
use sha2::{Digest, Sha256, Sha384, Sha512};
use sha3::{Sha3_256, Sha3_384, Sha3_512};

use crate::check::Fatal;
use crate::crc32c::crc32c;
use crate::device::BlockDev;
use crate::ondisk::{is_zero, zero_block, Superblock, BLOCK_SIZE, FP_SIZE};

/// A hash the kernel may name in the superblock and this tool can compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hasher {
    Sha256,
    Sha384,
    Sha512,
    Sha3_256,
    Sha3_384,
    Sha3_512,
    /// The crypto API's "blake2b-256" (..-384, ..-512): BLAKE2b unkeyed,
    /// with that digest length as its parameter (not a truncation).
    Blake2b256,
    Blake2b384,
    Blake2b512,
    /// The crypto API's "crc32c": the inverted CRC-32C, little-endian.
    Crc32c,
    /// The crypto API's "crc32": CRC-32 (IEEE) from seed 0 without the
    /// final inversion, little-endian (crypto/crc32_generic.c sets the
    /// default key to 0 and stores the raw register).
    Crc32,
    /// The crypto API's "xxhash64": XXH64 with seed 0, little-endian.
    Xxhash64,
}

/// Names this tool computes, for messages.
pub const COMPUTABLE: &str = "sha256, sha384, sha512, sha3-256, sha3-384, sha3-512, \
                              blake2b-256, blake2b-384, blake2b-512, crc32c, crc32, xxhash64";

impl Hasher {
    pub fn from_name(name: &str) -> Option<Hasher> {
        Some(match name {
            "sha256" => Hasher::Sha256,
            "sha384" => Hasher::Sha384,
            "sha512" => Hasher::Sha512,
            "sha3-256" => Hasher::Sha3_256,
            "sha3-384" => Hasher::Sha3_384,
            "sha3-512" => Hasher::Sha3_512,
            "blake2b-256" => Hasher::Blake2b256,
            "blake2b-384" => Hasher::Blake2b384,
            "blake2b-512" => Hasher::Blake2b512,
            "crc32c" => Hasher::Crc32c,
            "crc32" => Hasher::Crc32,
            "xxhash64" => Hasher::Xxhash64,
            _ => return None,
        })
    }

    /// The digest bytes the record keeps (min(digest size, 32)).
    pub fn fp_size(self) -> usize {
        match self {
            Hasher::Sha256
            | Hasher::Sha384
            | Hasher::Sha512
            | Hasher::Sha3_256
            | Hasher::Sha3_384
            | Hasher::Sha3_512
            | Hasher::Blake2b256
            | Hasher::Blake2b384
            | Hasher::Blake2b512 => 32,
            Hasher::Crc32c | Hasher::Crc32 => 4,
            Hasher::Xxhash64 => 8,
        }
    }

    /// The 32-byte record the kernel stores for a block holding `data`.
    pub fn record(self, data: &[u8]) -> [u8; FP_SIZE] {
        let mut fp = [0u8; FP_SIZE];
        match self {
            Hasher::Sha256 => fp.copy_from_slice(&Sha256::digest(data)),
            Hasher::Sha384 => fp.copy_from_slice(&Sha384::digest(data)[..FP_SIZE]),
            Hasher::Sha512 => fp.copy_from_slice(&Sha512::digest(data)[..FP_SIZE]),
            Hasher::Sha3_256 => fp.copy_from_slice(&Sha3_256::digest(data)),
            Hasher::Sha3_384 => fp.copy_from_slice(&Sha3_384::digest(data)[..FP_SIZE]),
            Hasher::Sha3_512 => fp.copy_from_slice(&Sha3_512::digest(data)[..FP_SIZE]),
            Hasher::Blake2b256 => fp.copy_from_slice(&Blake2b::<U32>::digest(data)),
            Hasher::Blake2b384 => fp.copy_from_slice(&Blake2b::<U48>::digest(data)[..FP_SIZE]),
            Hasher::Blake2b512 => fp.copy_from_slice(&Blake2b::<U64>::digest(data)[..FP_SIZE]),
            Hasher::Crc32c => fp[..4].copy_from_slice(&crc32c(data).to_le_bytes()),
            Hasher::Crc32 => fp[..4].copy_from_slice(&crc32_raw(data).to_le_bytes()),
            Hasher::Xxhash64 => fp[..8].copy_from_slice(&xxh64(data, 0).to_le_bytes()),
        }
        fp
    }
}

/// The hasher for reading `data` as the data device of the metadata `sb`
/// describes. Refused: a hash this tool cannot compute, and a device
/// smaller than the metadata's data_blocks, which is the wrong device (the
/// kernel refuses the pair: "cannot shrink the data device"). A larger one
/// is a grown device, which the kernel takes (dd_grow()); only the blocks
/// the metadata describes are read.
pub fn data_hasher(sb: &Superblock, data: &dyn BlockDev) -> Result<Hasher, Fatal> {
    let name = sb.hash();
    let h = Hasher::from_name(&name).ok_or_else(|| {
        Fatal(format!(
            "--data: the metadata's hash '{name}' cannot be computed by this tool \
             (it computes {COMPUTABLE}); run without --data"
        ))
    })?;
    if data.nr_blocks() < sb.data_blocks {
        return Err(Fatal(format!(
            "--data: the data device has {} blocks of 4 KiB but the metadata describes {} \
             (the kernel refuses a smaller data device): wrong device?",
            data.nr_blocks(),
            sb.data_blocks
        )));
    }
    Ok(h)
}

/// The record of a data block and whether the block is all zero, or why
/// it could not be read.
pub type DataDigest = Result<([u8; FP_SIZE], bool), String>;

/// Blocks per read request (1 MiB): large enough that a densely used data
/// device is read at sequential speed, small enough to spread the hashing
/// over the cores.
const RUN_BLOCKS: usize = 256;

/// The digests of data blocks `pbas`, in the same order. Consecutive PBAs
/// are read as one request, so callers pass them sorted.
pub fn digest_blocks(
    data: &(dyn BlockDev + Sync),
    hasher: Hasher,
    pbas: &[u64],
) -> Vec<DataDigest> {
    use rayon::prelude::*;
    let runs: Vec<&[u64]> = pbas
        .chunk_by(|a, b| a.checked_add(1) == Some(*b))
        .flat_map(|run| run.chunks(RUN_BLOCKS))
        .collect();
    runs.par_iter()
        .flat_map_iter(|run| digest_run(data, hasher, run))
        .collect()
}

fn digest_run(data: &dyn BlockDev, hasher: Hasher, run: &[u64]) -> Vec<DataDigest> {
    let digest = |b: &[u8]| (hasher.record(b), is_zero(b));
    let mut buf = vec![0u8; run.len() * BLOCK_SIZE];
    if data.read_blocks(run[0], &mut buf).is_ok() {
        return buf
            .chunks_exact(BLOCK_SIZE)
            .map(|b| Ok(digest(b)))
            .collect();
    }
    // Block by block, to tell the unreadable ones from the rest.
    run.iter()
        .map(|&pba| {
            let mut b = zero_block();
            data.read_block(pba, &mut b)
                .map_err(|e| format!("cannot be read: {e}"))?;
            Ok(digest(&b[..]))
        })
        .collect()
}

/// CRC-32 (reflected polynomial 0xEDB88320) from register 0, no final
/// inversion: what the kernel's crc32 shash outputs with its default key.
fn crc32_raw(data: &[u8]) -> u32 {
    static TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0xEDB8_8320
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    data.iter().fold(0u32, |c, &b| {
        (c >> 8) ^ TABLE[((c ^ b as u32) & 0xff) as usize]
    })
}

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

fn xxh_round(acc: u64, lane: u64) -> u64 {
    acc.wrapping_add(lane.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

fn xxh_merge(acc: u64, v: u64) -> u64 {
    (acc ^ xxh_round(0, v)).wrapping_mul(P1).wrapping_add(P4)
}

fn lane64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().unwrap())
}

/// XXH64, written from the published algorithm description.
pub fn xxh64(data: &[u8], seed: u64) -> u64 {
    let mut rest = data;
    let mut acc = if data.len() >= 32 {
        let mut v = [
            seed.wrapping_add(P1).wrapping_add(P2),
            seed.wrapping_add(P2),
            seed,
            seed.wrapping_sub(P1),
        ];
        let mut stripes = data.chunks_exact(32);
        for s in &mut stripes {
            for (i, acc) in v.iter_mut().enumerate() {
                *acc = xxh_round(*acc, lane64(&s[i * 8..]));
            }
        }
        rest = stripes.remainder();
        let mut a = v[0]
            .rotate_left(1)
            .wrapping_add(v[1].rotate_left(7))
            .wrapping_add(v[2].rotate_left(12))
            .wrapping_add(v[3].rotate_left(18));
        for x in v {
            a = xxh_merge(a, x);
        }
        a
    } else {
        seed.wrapping_add(P5)
    };
    acc = acc.wrapping_add(data.len() as u64);
    let mut words = rest.chunks_exact(8);
    for w in &mut words {
        acc ^= xxh_round(0, lane64(w));
        acc = acc.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
    }
    let mut tail = words.remainder();
    if tail.len() >= 4 {
        let w = u32::from_le_bytes(tail[..4].try_into().unwrap()) as u64;
        acc ^= w.wrapping_mul(P1);
        acc = acc.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
        tail = &tail[4..];
    }
    for &b in tail {
        acc ^= (b as u64).wrapping_mul(P5);
        acc = acc.rotate_left(11).wrapping_mul(P1);
    }
    acc ^= acc >> 33;
    acc = acc.wrapping_mul(P2);
    acc ^= acc >> 29;
    acc = acc.wrapping_mul(P3);
    acc ^ (acc >> 32)
}

/// Marker in bytes 8..16 of a placeholder record.
pub const PLACEHOLDER_MARK: &[u8; 8] = b"DDREPAIR";

/// Fingerprint records shorter than this cannot carry the marker and the
/// block number, so check cannot recognise them as placeholders.
pub const PLACEHOLDER_RECOGNISABLE: usize = 24;

fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The record `repair` gives a live block whose fingerprint is lost and
/// cannot be recomputed. The kernel refuses to activate with a live block
/// that has no record, and dropping the block's mappings would lose data
/// that is still readable; so the block keeps its mappings under a record
/// that no write will match:
/// - for a collision-resistant hash (the only ones the kernel accepts
///   without `verify`) matching it means finding a preimage of a value
///   that is not a digest of anything;
/// - for any other hash the kernel requires `verify`, which compares the
///   bytes before sharing a block, so a chance match costs one read.
///
/// The first 8 bytes are a mix of the block number, so that placeholders
/// spread over the index like digests do (equal keys would pile up in one
/// probe chain); then the marker and the block number, so that `check`
/// can point them out; truncated to fp_size like a digest.
pub fn placeholder(pba: u64, fp_size: usize) -> [u8; FP_SIZE] {
    let mut fp = [0u8; FP_SIZE];
    fp[..8].copy_from_slice(&mix64(pba ^ 0x6464_7570_7265_7061).to_le_bytes());
    fp[8..16].copy_from_slice(PLACEHOLDER_MARK);
    fp[16..24].copy_from_slice(&pba.to_le_bytes());
    fp[24..32].copy_from_slice(&mix64(!pba).to_le_bytes());
    fp[fp_size.min(FP_SIZE)..].fill(0);
    fp
}

/// True if `fp` is the placeholder `repair` writes for `pba` (recognisable
/// only when fp_size >= PLACEHOLDER_RECOGNISABLE).
pub fn is_placeholder(pba: u64, fp: &[u8; FP_SIZE], fp_size: usize) -> bool {
    fp_size >= PLACEHOLDER_RECOGNISABLE && *fp == placeholder(pba, fp_size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::hex;

    #[test]
    fn xxh64_known_vectors() {
        assert_eq!(xxh64(b"", 0), 0xEF46_DB37_51D8_E999);
        assert_eq!(xxh64(b"a", 0), 0xD24E_C4F1_A98C_6E5B);
        assert_eq!(xxh64(b"abc", 0), 0x44BC_2CF5_AD77_0999);
        assert_eq!(
            xxh64(b"Nobody inspects the spammish repetition", 0),
            0xFBCE_A83C_8A37_8BF1
        );
        // Block-sized inputs and a 37-byte one (stripe, words, a 4-byte
        // word and single bytes), from the reference implementation
        // (the python xxhash package, 4.1).
        let d: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        assert_eq!(xxh64(&d, 0), 0x7963_98CD_4327_97CC);
        assert_eq!(xxh64(&[0u8; 4096], 0), 0xAC86_9B6F_32D8_BBDB);
        let d: Vec<u8> = (0..37u8).collect();
        assert_eq!(xxh64(&d, 0), 0xD93F_A2DF_EE5C_24C9);
    }

    #[test]
    fn crc32_is_the_kernels_raw_register() {
        // zlib's crc32 inverts before and after; the kernel's shash
        // starts from 0 and does not invert: ~zlib.crc32(d, 0xffffffff).
        assert_eq!(crc32_raw(b"123456789"), 0x2DFD_2D88);
        assert_eq!(crc32_raw(&[0u8; 4096]), 0);
        let d: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        assert_eq!(crc32_raw(&d), 0x658D_2093);
    }

    #[test]
    fn sha3_and_blake2b_are_the_crypto_apis() {
        // The first 32 bytes of each digest of a 4 KiB block, as python's
        // hashlib gives them (blake2b with digest_size 32, 48, 64) and
        // Debian's 6.12 kernel through AF_ALG, which agree: its
        // blake2b-256/384/512 set the digest length as a parameter.
        let d: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        for (name, hex) in [
            (
                "sha3-256",
                "195e4e4f0f5c24fb0bc00b218d28ae4c7c0328a6a8e8d6b8ceb8d2510c7647b6",
            ),
            (
                "sha3-384",
                "317e8c0d40a4cdeff756a894030e93baa1b76188c2efcdc3f5c671c0d59e99ba",
            ),
            (
                "sha3-512",
                "c8cf7f920e94bac864cd99280a71e7ad3397064d4522a23efd1125057744fac9",
            ),
            (
                "blake2b-256",
                "3b7dcca5dcb409b9ee1d33ac58a03966d5e86581278891945e3d2fd80e3aad58",
            ),
            (
                "blake2b-384",
                "c66127c69eb331237d0bcc23cbcd16d9608efd950f04ae3b6cededf2fa0139c3",
            ),
            (
                "blake2b-512",
                "31404c9c7ed64c59112579f300f2afef181ee6283c3918bf026c4ed4bcde0697",
            ),
        ] {
            let h = Hasher::from_name(name).unwrap();
            assert_eq!(crate::util::hex(&h.record(&d)), hex, "{name}");
        }
    }

    #[test]
    fn records_are_truncated_and_padded() {
        let d = [0x5Au8; 4096];
        for name in [
            "sha256",
            "sha384",
            "sha512",
            "sha3-256",
            "sha3-384",
            "sha3-512",
            "blake2b-256",
            "blake2b-384",
            "blake2b-512",
            "crc32c",
            "crc32",
            "xxhash64",
        ] {
            let h = Hasher::from_name(name).unwrap();
            assert_eq!(
                Some(h.fp_size() as u32),
                crate::ondisk::hash_fp_size(name),
                "{name}"
            );
            let r = h.record(&d);
            assert!(r[h.fp_size()..].iter().all(|&b| b == 0), "{name}");
        }
        assert_eq!(
            hex(&Hasher::Sha256.record(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(hex(&Hasher::Crc32c.record(b"123456789")[..4]), "839206e3");
        assert!(Hasher::from_name("sm3").is_none());
    }

    #[test]
    fn digest_blocks_reads_runs_and_keeps_the_order() {
        use crate::device::MemDev;
        let n = 700u64;
        let mut d = MemDev::new(n);
        for p in 0..n {
            d.block_mut(p).fill((p % 255) as u8 + 1);
        }
        d.block_mut(5).fill(0);
        // Runs longer than one request, single blocks, a gap at the end.
        let pbas: Vec<u64> = (0..600).chain([602, 650]).chain(660..699).collect();
        let got = digest_blocks(&d, Hasher::Sha256, &pbas);
        assert_eq!(got.len(), pbas.len());
        for (&p, g) in pbas.iter().zip(&got) {
            let want = Hasher::Sha256.record(&d.block(p)[..]);
            assert_eq!(g, &Ok((want, p == 5)), "pba {p}");
        }
        // Beyond the end: that block only.
        let got = digest_blocks(&d, Hasher::Crc32c, &[698, 699, 700]);
        assert!(got[0].is_ok() && got[1].is_ok());
        assert!(got[2].as_ref().unwrap_err().contains("beyond the end"));
    }

    #[test]
    fn placeholders() {
        let p = placeholder(77, 32);
        assert!(is_placeholder(77, &p, 32));
        assert!(!is_placeholder(78, &p, 32));
        assert_ne!(placeholder(1, 32)[..8], placeholder(2, 32)[..8]);
        assert!(placeholder(0, 32).iter().any(|&b| b != 0));
        let short = placeholder(77, 8);
        assert!(short[8..].iter().all(|&b| b == 0));
        assert!(!is_placeholder(77, &short, 8));
    }
}
