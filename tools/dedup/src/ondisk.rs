//! The on-disk format of the dm-dedup metadata device, as implemented by
//! dm-dedup/dedup-format.h, dedup-block.c, dedup-array.c and
//! dedup-metadata.c.
//!
//! Everything is little-endian. The device is an array of 4 KiB blocks:
//! blocks 0 and 1 are the two superblock slots, every other block is free or
//! belongs to one of three radix trees (the map, the refcounts and the
//! fingerprints), or to the state saved at a clean close (a fourth array,
//! named by the superblock that closed), or (format version 2) to the
//! journal's run of blocks, a ring of redo records named by the superblock.
//! Every block starts with a 32-byte header and is protected by a CRC-32C
//! of its bytes 4..4095.

use crate::crc32c::crc32c;

pub const BLOCK_SIZE: usize = 4096;
pub const BLOCK_SHIFT: u32 = 12;
pub const SB_MAGIC: u64 = 0x3130_5055_4445_4444; // "DDEDUP01"
/// The format version the tools write (DD_FORMAT_VERSION): version 2 has
/// the journal. Version 1 is the same without it, and is read too.
pub const FORMAT_VERSION: u32 = 2;
/// DD_FORMAT_VERSION_V1: no journal, the four journal fields 0.
pub const FORMAT_VERSION_V1: u32 = 1;
pub const SB_SLOTS: u64 = 2;
/// DD_MAX_TXN: the highest generation (`hdr.txn`) a superblock may carry,
/// 2^64 - 2^32 - 1. The kernel refuses a device whose superblock is above
/// it (dd_check_sb): commits from there on could wrap the id, after which
/// the older slot would win at the next open. Nothing here writes a
/// superblock above it; `check` reports one as `txn_too_large`.
pub const MAX_TXN: u64 = u64::MAX - (1 << 32);
pub const FIRST_TREE_BLOCK: u64 = SB_SLOTS;
/// Superblock flag: the kernel found the metadata damaged and opens it
/// read-only until `check --clear-needs-check` or `repair` clears it.
pub const SB_NEEDS_CHECK: u32 = 0x1;
/// Superblock flag (DD_SB_UNFLUSHED_APPENDS): the appends after this
/// superblock may carry JF_UNFLUSHED. A bit an older reader refuses, so
/// that it never replays an append whose data may not have reached the
/// data device.
pub const SB_UNFLUSHED_APPENDS: u32 = 0x2;
/// Every flag the format defines; the kernel refuses any other bit.
pub const SB_KNOWN_FLAGS: u32 = SB_NEEDS_CHECK | SB_UNFLUSHED_APPENDS;

pub const BT_SUPER: u32 = 0x5250_5553; // "SUPR"
pub const BT_INTERIOR: u32 = 0x5254_4e49; // "INTR"
pub const BT_LEAF: u32 = 0x4641_454c; // "LEAF"
pub const BT_JOURNAL: u32 = 0x4c4e_524a; // "JRNL"

pub const FP_SIZE: usize = 32;
pub const HASH_NAME_LEN: usize = 32;
pub const HEADER_SIZE: usize = 32;
pub const PAYLOAD_SIZE: usize = BLOCK_SIZE - HEADER_SIZE;
pub const INTERIOR_FANOUT: u64 = (PAYLOAD_SIZE / 8) as u64; // 508
/// Size of `struct dd_superblock` (header included).
pub const SUPERBLOCK_SIZE: usize = 240;

/// DD_JOURNAL_BLOCKS: the longest journal run the kernel (and these tools)
/// make, journal_size()'s upper bound.
pub const JOURNAL_BLOCKS: u64 = 2048;
/// DD_JOURNAL_MAKE_MIN: the shortest run the kernel makes: journal_size()'s
/// lower bound, and where dd_journal_make() stops halving.
pub const JOURNAL_MAKE_MIN: u64 = 64;
/// DD_JOURNAL_MIN_BLOCKS: the shortest run a version 2 superblock may name.
pub const JOURNAL_MIN_BLOCKS: u64 = 16;
/// Size of `struct dd_journal_header` (block header included).
pub const JOURNAL_HEADER_SIZE: usize = 64;
/// Bytes of records a journal block holds (DD_JOURNAL_PAYLOAD).
pub const JOURNAL_PAYLOAD: usize = BLOCK_SIZE - JOURNAL_HEADER_SIZE;
/// Journal block flag: the last block of an append (DD_JF_END).
pub const JF_END: u32 = 0x1;
/// Journal block flag (DD_JF_UNFLUSHED), on every block of an append
/// written while the data device was being flushed for it: replay checks
/// that append's data when it is the newest (dedup-format.rst, "The
/// newest append"). Allowed only under SB_UNFLUSHED_APPENDS.
pub const JF_UNFLUSHED: u32 = 0x2;
/// Record types (enum dd_journal_record) and the key's layout.
pub const JR_MAP: u8 = 1;
pub const JR_REFCOUNT: u8 = 2;
pub const JR_FINGERPRINT: u8 = 3;
pub const JR_COUNTERS: u8 = 4;
pub const JR_TYPE_SHIFT: u32 = 56;
pub const JR_INDEX_MASK: u64 = (1 << JR_TYPE_SHIFT) - 1;
/// Values of a COUNTERS record (DD_JR_NR_COUNTERS).
pub const JR_NR_COUNTERS: usize = 6;

/// Largest refcount the kernel stores (it saturates there).
pub const REFCOUNT_MAX: u32 = u32::MAX;

pub type Block = [u8; BLOCK_SIZE];

pub fn zero_block() -> Box<Block> {
    Box::new([0u8; BLOCK_SIZE])
}

pub fn le16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes(b[off..off + 2].try_into().unwrap())
}
pub fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}
pub fn le64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
}
fn put16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// The kernel's dd_block_csum(): standard CRC-32C of bytes 4..4095.
pub fn block_csum(block: &Block) -> u32 {
    crc32c(&block[4..])
}

pub fn stored_csum(block: &Block) -> u32 {
    le32(block, 0)
}

pub fn csum_ok(block: &Block) -> bool {
    stored_csum(block) == block_csum(block)
}

/// Recompute and store the checksum (what dm-bufio's write callback does).
pub fn seal(block: &mut Block) {
    let c = block_csum(block);
    put32(block, 0, c);
}

pub fn is_zero(b: &[u8]) -> bool {
    b.iter().all(|&x| x == 0)
}

/// Name of a block type, for messages.
pub fn type_name(t: u32) -> String {
    match t {
        BT_SUPER => "SUPR".into(),
        BT_INTERIOR => "INTR".into(),
        BT_LEAF => "LEAF".into(),
        BT_JOURNAL => "JRNL".into(),
        _ => format!("{t:#010x}"),
    }
}

/// `struct dd_block_header`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub csum: u32,
    pub btype: u32,
    pub blocknr: u64,
    pub txn: u64,
    pub array: u8,
    pub level: u8,
    pub reserved1: u16,
    pub reserved2: u32,
}

impl Header {
    pub fn decode(b: &[u8]) -> Header {
        Header {
            csum: le32(b, 0),
            btype: le32(b, 4),
            blocknr: le64(b, 8),
            txn: le64(b, 16),
            array: b[24],
            level: b[25],
            reserved1: le16(b, 26),
            reserved2: le32(b, 28),
        }
    }

    /// Writes every field but the checksum.
    pub fn encode(&self, b: &mut [u8]) {
        put32(b, 4, self.btype);
        put64(b, 8, self.blocknr);
        put64(b, 16, self.txn);
        b[24] = self.array;
        b[25] = self.level;
        put16(b, 26, self.reserved1);
        put32(b, 28, self.reserved2);
    }
}

/// `enum dd_array_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ArrayId {
    /// LBA -> PBA + 1 (`__le64`), 0 = unmapped.
    Map = 1,
    /// PBA -> number of LBAs mapping it (`__le32`).
    Refcount = 2,
    /// PBA -> fingerprint of its content (`u8[32]`).
    Fingerprint = 3,
    /// The state saved at a clean close (`__le64` words, see [`saved`]):
    /// not part of the committed state, and not in [`ArrayId::ALL`].
    Saved = 4,
}

impl ArrayId {
    /// The three arrays of the committed state.
    pub const ALL: [ArrayId; 3] = [ArrayId::Map, ArrayId::Refcount, ArrayId::Fingerprint];

    pub fn from_u8(v: u8) -> Option<ArrayId> {
        match v {
            1 => Some(ArrayId::Map),
            2 => Some(ArrayId::Refcount),
            3 => Some(ArrayId::Fingerprint),
            4 => Some(ArrayId::Saved),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ArrayId::Map => "map",
            ArrayId::Refcount => "refcount",
            ArrayId::Fingerprint => "fingerprint",
            ArrayId::Saved => "saved",
        }
    }

    pub fn entry_size(self) -> u32 {
        match self {
            ArrayId::Map | ArrayId::Saved => 8,
            ArrayId::Refcount => 4,
            ArrayId::Fingerprint => FP_SIZE as u32,
        }
    }
}

/// The state saved at a clean close (DD_ARRAY_SAVED, dedup-format.h and
/// dedup-saved.c): an array of `__le64` words, absent leaves reading as
/// zeros. A header of [`saved::HEADER_WORDS`], then a bitmap of the
/// metadata blocks the trees use, a bitmap of the data blocks with
/// refcount > 0, and the target's words (the fingerprint index).
pub mod saved {
    /// DD_SAVED_MAGIC, "DDSAVED1".
    pub const MAGIC: u64 = 0x3144_4556_4153_4444;
    /// enum dd_saved_header: word indices of the header.
    pub const W_MAGIC: usize = 0;
    /// The generation of the superblock that names the save.
    pub const W_TXN: usize = 1;
    pub const W_METADATA_BLOCKS: usize = 2;
    pub const W_DATA_BLOCKS: usize = 3;
    pub const W_TARGET_WORDS: usize = 4;
    /// The 8 words the target describes its part with.
    pub const W_TARGET_HEAD: usize = 8;
    pub const TARGET_HEAD: usize = 8;
    pub const HEADER_WORDS: usize = 16;

    /// The target's part as dedup-decide.c saves it (dd_index_saved_view):
    /// head[0] = this layout, head[1..2] the siphash key, head[3] the
    /// non-empty entries, head[4] the inserts that found no room so far
    /// (the stats counter index_full), head[5] the activations that loaded
    /// the index since one rebuilt it, head[6] and head[7] its geometry
    /// ([`IndexGeometry`]); the words are the packed entries of
    /// dedup-index.c.
    pub const INDEX_LAYOUT: u64 = 0x3258_4449; // "IDX2"
    pub const HEAD_LAYOUT: usize = 0;
    pub const HEAD_ENTRIES: usize = 3;
    pub const HEAD_FULL: usize = 4;
    pub const HEAD_LOADS: usize = 5;
    pub const HEAD_GEOMETRY: usize = 6;
    pub const HEAD_BUCKETS: usize = 7;
    /// DD_INDEX_MAX_LOADS: a head[5] this high, and the kernel rebuilds.
    pub const MAX_LOADS: u64 = 16;
    /// DD_FP_PER_LEAF: fingerprint records (data blocks) per leaf of the
    /// fingerprint array, 127.
    pub const FP_PER_LEAF: u64 = (super::PAYLOAD_SIZE / super::FP_SIZE) as u64;
    /// The kernel's index sizing (dedup-index.h, dedup-index.c), from
    /// which it computes the geometry a save must have: DD_INDEX_BUCKET,
    /// entries per bucket;
    pub const BUCKET_ENTRIES: u32 = 8;
    /// DD_INDEX_LOAD_PERCENT, the share of the entries that one for every
    /// data block fills;
    pub const LOAD_PERCENT: u64 = 95;
    /// DD_INDEX_MIN_ENTRY_BITS and DD_INDEX_MIN_TAG_BITS: entries have at
    /// least these many bits, and at least these many tag bits.
    pub const MIN_ENTRY_BITS: u32 = 30;
    pub const MIN_TAG_BITS: u32 = 4;

    /// The fingerprint leaf that holds the record of data block `pba`.
    pub fn leaf_of(pba: u64) -> u64 {
        pba / FP_PER_LEAF
    }

    /// Fingerprint leaves a data device of `data_blocks` has.
    pub fn nr_leaves(data_blocks: u64) -> u64 {
        data_blocks.div_ceil(FP_PER_LEAF)
    }

    /// The shape of the saved index: `buckets` buckets of `bucket_entries`
    /// entries of `entry_bits` bits each, packed into the target words
    /// (entry k = bucket * E + slot in bits [k * w, k * w + w) of the bit
    /// string whose bit j is bit j % 64 of word j / 64). An entry's low
    /// `leaf_bits` bits hold its fingerprint leaf + 1 (0: empty, and then
    /// the whole entry is 0), the rest a tag of the keyed hash. head[6] =
    /// w | L << 8 | E << 16 | G << 32, head[7] = B.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct IndexGeometry {
        /// w
        pub entry_bits: u32,
        /// L
        pub leaf_bits: u32,
        /// E
        pub bucket_entries: u32,
        /// G, data blocks per fingerprint leaf
        pub fp_per_leaf: u64,
        /// B
        pub buckets: u64,
    }

    /// What one entry holds.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum IndexEntry {
        Empty,
        /// The fingerprint leaf (not + 1).
        Leaf(u64),
        /// A tag without a leaf: the kernel refuses the save.
        NoLeaf,
    }

    impl IndexGeometry {
        /// The geometry the kernel computes for a table of `data_blocks`
        /// (dd_index_size): L = max(1, fls64(leaves)), w = max(30, L + 4),
        /// E = 8, B = max(2, ceil(data_blocks * 100 / (95 * E))).
        pub fn for_data_blocks(data_blocks: u64) -> IndexGeometry {
            let leaf_bits = (64 - nr_leaves(data_blocks).leading_zeros()).max(1);
            let e = BUCKET_ENTRIES as u128;
            let buckets = (data_blocks as u128 * 100)
                .div_ceil(LOAD_PERCENT as u128 * e)
                .max(2);
            IndexGeometry {
                entry_bits: MIN_ENTRY_BITS.max(leaf_bits + MIN_TAG_BITS),
                leaf_bits,
                bucket_entries: BUCKET_ENTRIES,
                fp_per_leaf: FP_PER_LEAF,
                // Below data_blocks: fits.
                buckets: buckets as u64,
            }
        }

        /// head[6] and head[7] as a save holds them; None when they do
        /// not describe entries this module can read (w above 64, no leaf
        /// bits or no tag bits, no entries per bucket, a G other than
        /// 127, bits 24-31 set, or more bits than a u64 counts).
        pub fn decode(geometry: u64, buckets: u64) -> Option<IndexGeometry> {
            let g = IndexGeometry {
                entry_bits: (geometry & 0xff) as u32,
                leaf_bits: ((geometry >> 8) & 0xff) as u32,
                bucket_entries: ((geometry >> 16) & 0xff) as u32,
                fp_per_leaf: geometry >> 32,
                buckets,
            };
            let ok = g.entry_bits <= 64
                && g.leaf_bits >= 1
                && g.leaf_bits < g.entry_bits
                && g.bucket_entries >= 1
                && g.fp_per_leaf == FP_PER_LEAF
                && (geometry >> 24) & 0xff == 0
                && buckets
                    .checked_mul(g.bucket_entries as u64)
                    .and_then(|n| n.checked_mul(g.entry_bits as u64))
                    .is_some();
            ok.then_some(g)
        }

        /// head[6].
        pub fn encode(&self) -> u64 {
            self.entry_bits as u64
                | (self.leaf_bits as u64) << 8
                | (self.bucket_entries as u64) << 16
                | self.fp_per_leaf << 32
        }

        /// B * E (fits a u64 for a decoded geometry).
        pub fn entries(&self) -> u64 {
            self.buckets.wrapping_mul(self.bucket_entries as u64)
        }

        /// t, the target words: ceil(B * E * w / 64).
        pub fn words(&self) -> u64 {
            let bits = self.entries() as u128 * self.entry_bits as u128;
            bits.div_ceil(64) as u64
        }

        fn mask(&self) -> u64 {
            u64::MAX.checked_shr(64 - self.entry_bits).unwrap_or(0)
        }

        /// The words entry `k` lies in: (first, last), last = first + 1
        /// when it straddles two.
        pub fn entry_words(&self, k: u64) -> (u64, u64) {
            let bit = k * self.entry_bits as u64;
            (bit / 64, (bit + self.entry_bits as u64 - 1) / 64)
        }

        /// Entry `k`, from `word(i)`, the target word i.
        pub fn entry_with(&self, k: u64, word: impl Fn(u64) -> u64) -> u64 {
            let bit = k * self.entry_bits as u64;
            let (i, off) = (bit / 64, (bit % 64) as u32);
            let mut v = word(i) >> off;
            if off + self.entry_bits > 64 {
                v |= word(i + 1) << (64 - off);
            }
            v & self.mask()
        }

        /// Entry `k` of `words` (words past the end read as 0).
        pub fn entry(&self, words: &[u64], k: u64) -> u64 {
            self.entry_with(k, |i| words.get(i as usize).copied().unwrap_or(0))
        }

        /// Store `v` (its low w bits) as entry `k` of `words`.
        pub fn set_entry(&self, words: &mut [u64], k: u64, v: u64) {
            let v = v & self.mask();
            let bit = k * self.entry_bits as u64;
            let (i, off) = ((bit / 64) as usize, (bit % 64) as u32);
            words[i] = (words[i] & !(self.mask() << off)) | v << off;
            if off + self.entry_bits > 64 {
                let hi = 64 - off;
                words[i + 1] = (words[i + 1] & !(self.mask() >> hi)) | v >> hi;
            }
        }

        /// An entry naming fingerprint leaf `leaf` with tag `tag` (its
        /// low w - L bits).
        pub fn make_entry(&self, leaf: u64, tag: u64) -> u64 {
            ((leaf + 1) | tag << self.leaf_bits) & self.mask()
        }

        /// What entry value `v` holds.
        pub fn decode_entry(&self, v: u64) -> IndexEntry {
            let field = v & u64::MAX.checked_shr(64 - self.leaf_bits).unwrap_or(0);
            match (field, v >> self.leaf_bits) {
                (0, 0) => IndexEntry::Empty,
                (0, _) => IndexEntry::NoLeaf,
                (f, _) => IndexEntry::Leaf(f - 1),
            }
        }
    }

    /// dd_saved_layout(): where each part starts, in words.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Layout {
        pub meta_words: u64,
        pub data_words: u64,
        pub data_start: u64,
        pub target_start: u64,
        pub total: u64,
    }

    impl Layout {
        /// None when the sizes overflow (the kernel's layout would not
        /// match any array the superblock can name).
        pub fn new(metadata_blocks: u64, data_blocks: u64, target_words: u64) -> Option<Layout> {
            let meta_words = metadata_blocks.div_ceil(64);
            let data_words = data_blocks.div_ceil(64);
            let data_start = (HEADER_WORDS as u64).checked_add(meta_words)?;
            let target_start = data_start.checked_add(data_words)?;
            Some(Layout {
                meta_words,
                data_words,
                data_start,
                target_start,
                total: target_start.checked_add(target_words)?,
            })
        }
    }
}

/// The shape of one persistent array (dd_array_init in dedup-array.c): a
/// radix tree of fixed fan-out whose height depends only on the number of
/// entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub id: ArrayId,
    pub nr_entries: u64,
    pub entry_size: u32,
    pub per_leaf: u32,
    pub nr_leaves: u64,
    /// Interior levels above the leaves; the root has level `height`.
    pub height: u8,
}

impl Geometry {
    pub fn new(id: ArrayId, nr_entries: u64) -> Geometry {
        let entry_size = id.entry_size();
        let per_leaf = per_leaf(entry_size);
        let nr_leaves = nr_leaves(entry_size, nr_entries);
        let mut reach: u128 = 1;
        let mut height = 0u8;
        while reach < nr_leaves as u128 {
            reach *= INTERIOR_FANOUT as u128;
            height += 1;
        }
        Geometry {
            id,
            nr_entries,
            entry_size,
            per_leaf,
            nr_leaves,
            height,
        }
    }

    /// Leaves below one node of `level` (1 for a leaf).
    pub fn leaves_below(level: u8) -> u128 {
        (INTERIOR_FANOUT as u128).pow(level as u32)
    }

    /// dd_child_slot(): which child of a node at `level` leads to leaf
    /// `leaf_nr`.
    pub fn child_slot(leaf_nr: u64, level: u8) -> u32 {
        debug_assert!(level >= 1);
        let mut l = leaf_nr;
        for _ in 1..level {
            l /= INTERIOR_FANOUT;
        }
        (l % INTERIOR_FANOUT) as u32
    }

    /// Index of the first entry below child `slot` of a node at `level`
    /// whose first leaf is `leaf_base`, or None if it lies beyond the array
    /// (the kernel's "child beyond the array end" test).
    pub fn child_first_leaf(&self, leaf_base: u64, level: u8, slot: u32) -> Option<u64> {
        let first_leaf = leaf_base as u128 + slot as u128 * Self::leaves_below(level - 1);
        if first_leaf * self.per_leaf as u128 >= self.nr_entries as u128 {
            None
        } else {
            Some(first_leaf as u64)
        }
    }

    /// Entries held by leaf `leaf_nr` (the last leaf may be partial).
    pub fn leaf_count(&self, leaf_nr: u64) -> u32 {
        let first = leaf_nr as u128 * self.per_leaf as u128;
        let left = (self.nr_entries as u128).saturating_sub(first);
        left.min(self.per_leaf as u128) as u32
    }

    /// Entry index range [first, end) covered by the node of `level` whose
    /// first leaf is `leaf_base`, clipped to the array.
    pub fn entry_range(&self, leaf_base: u64, level: u8) -> (u64, u64) {
        let first = leaf_base as u128 * self.per_leaf as u128;
        let end = first + Self::leaves_below(level) * self.per_leaf as u128;
        let n = self.nr_entries as u128;
        (first.min(n) as u64, end.min(n) as u64)
    }
}

pub fn per_leaf(entry_size: u32) -> u32 {
    PAYLOAD_SIZE as u32 / entry_size
}

pub fn nr_leaves(entry_size: u32, nr_entries: u64) -> u64 {
    nr_entries.div_ceil(per_leaf(entry_size) as u64)
}

/// dd_array_max_blocks(): blocks a fully populated array occupies.
pub fn array_max_blocks(entry_size: u32, nr_entries: u64) -> u64 {
    let mut level = nr_leaves(entry_size, nr_entries);
    let mut total = level;
    while level > 1 {
        level = level.div_ceil(INTERIOR_FANOUT);
        total += level;
    }
    total
}

/// dd_trees_required(): what format version 1 needs (in 4 KiB blocks):
/// the two superblock slots and twice the full trees, because the
/// running transaction may shadow every committed block. The kernel
/// opens no device smaller than this plus its journal's run.
pub fn open_blocks(logical_blocks: u64, data_blocks: u64) -> u64 {
    let trees = array_max_blocks(8, logical_blocks)
        .saturating_add(array_max_blocks(4, data_blocks))
        .saturating_add(array_max_blocks(FP_SIZE as u32, data_blocks));
    SB_SLOTS.saturating_add(trees.saturating_mul(2))
}

/// dd_journal_size(): the journal a device of these sizes gets, a quarter
/// of open_blocks() within [JOURNAL_MAKE_MIN, JOURNAL_BLOCKS]. It follows
/// from the sizes alone, so room left for growing them stays the trees'.
pub fn journal_size(logical_blocks: u64, data_blocks: u64) -> u64 {
    (open_blocks(logical_blocks, data_blocks) / 4).clamp(JOURNAL_MAKE_MIN, JOURNAL_BLOCKS)
}

/// dd_md_required_blocks(): the smallest metadata device the kernel
/// formats for these sizes: open_blocks() and the journal's run.
pub fn required_blocks(logical_blocks: u64, data_blocks: u64) -> u64 {
    open_blocks(logical_blocks, data_blocks)
        .saturating_add(journal_size(logical_blocks, data_blocks))
}

/// dd_journal_make(): the journal a device of `nr_blocks` asks for:
/// journal_size(), or None when the trees leave not even JOURNAL_MAKE_MIN
/// blocks. A new run is that long, or as long as the trees leave if less,
/// halved while no free window holds it, down to JOURNAL_MAKE_MIN (see
/// `writer::new_run`).
pub fn journal_blocks_for(nr_blocks: u64, logical_blocks: u64, data_blocks: u64) -> Option<u64> {
    let trees = open_blocks(logical_blocks, data_blocks);
    (nr_blocks >= trees.saturating_add(JOURNAL_MAKE_MIN))
        .then(|| journal_size(logical_blocks, data_blocks))
}

/// Fingerprint bytes kept for the hash algorithms the kernel knows
/// (min(digest size, 32)), by crypto API name.
pub fn hash_fp_size(name: &str) -> Option<u32> {
    let digest = match name {
        "sha256" | "sha3-256" | "blake2b-256" | "sm3" => 32,
        "sha384" | "sha3-384" | "blake2b-384" => 48,
        "sha512" | "sha3-512" | "blake2b-512" => 64,
        "blake2b-160" => 20,
        "sha1" => 20,
        "xxhash64" => 8,
        "crc32c" | "crc32" => 4,
        _ => return None,
    };
    Some(digest.min(FP_SIZE as u32))
}

/// `struct dd_superblock`, decoded. `generation` is `hdr.txn`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub header: Header,
    pub magic: u64,
    pub version: u32,
    pub block_size: u32,
    pub metadata_blocks: u64,
    pub data_blocks: u64,
    pub logical_blocks: u64,
    pub hash_name: [u8; HASH_NAME_LEN],
    pub fp_size: u32,
    pub flags: u32,
    pub map_root: u64,
    pub refcount_root: u64,
    pub fingerprint_root: u64,
    pub mapped_blocks: u64,
    pub used_data_blocks: u64,
    pub unique_writes: u64,
    pub duplicate_writes: u64,
    pub zero_writes: u64,
    pub discarded_blocks: u64,
    pub format_time: u64,
    /// Root of the state saved at the clean close that wrote this
    /// superblock ([`ArrayId::Saved`]); 0 = none. Any other commit, and
    /// every superblock the tools write, has none.
    pub saved_root: u64,
    /// Its number of words.
    pub saved_words: u64,
    /// Version 2: the journal's run of blocks, [journal_start,
    /// journal_start + journal_blocks); 0 in version 1 (and, in a
    /// superblock the writer is given, "make a run": see
    /// writer::write_image).
    pub journal_start: u64,
    pub journal_blocks: u64,
    /// The epoch: the sequence number of the first journal block that
    /// follows this state.
    pub journal_seq: u64,
    /// Random, not 0, carried by the journal's blocks.
    pub journal_id: u64,
}

impl Superblock {
    /// What dd_format() fills in before its first commit: version 2, with
    /// the journal fields 0 (the writer makes the run, as dd_format()
    /// does with dd_journal_make()).
    pub fn new_formatted(
        metadata_blocks: u64,
        data_blocks: u64,
        logical_blocks: u64,
        hash_name: &str,
        fp_size: u32,
        format_time: u64,
    ) -> Superblock {
        let mut name = [0u8; HASH_NAME_LEN];
        // strscpy(): at most HASH_NAME_LEN - 1 bytes, NUL terminated.
        let n = hash_name.len().min(HASH_NAME_LEN - 1);
        name[..n].copy_from_slice(&hash_name.as_bytes()[..n]);
        Superblock {
            header: Header {
                btype: BT_SUPER,
                txn: 1,
                ..Header::default()
            },
            magic: SB_MAGIC,
            version: FORMAT_VERSION,
            block_size: BLOCK_SIZE as u32,
            metadata_blocks,
            data_blocks,
            logical_blocks,
            hash_name: name,
            fp_size,
            flags: 0,
            map_root: 0,
            refcount_root: 0,
            fingerprint_root: 0,
            mapped_blocks: 0,
            used_data_blocks: 0,
            unique_writes: 0,
            duplicate_writes: 0,
            zero_writes: 0,
            discarded_blocks: 0,
            format_time,
            saved_root: 0,
            saved_words: 0,
            journal_start: 0,
            journal_blocks: 0,
            journal_seq: 0,
            journal_id: 0,
        }
    }

    pub fn generation(&self) -> u64 {
        self.header.txn
    }

    /// The slot a commit of this generation goes to (dd_bm_write_super).
    pub fn slot(&self) -> u64 {
        self.header.txn % SB_SLOTS
    }

    /// The hash name up to its first NUL, lossily decoded.
    pub fn hash(&self) -> String {
        let end = self
            .hash_name
            .iter()
            .position(|&c| c == 0)
            .unwrap_or(HASH_NAME_LEN);
        String::from_utf8_lossy(&self.hash_name[..end]).into_owned()
    }

    pub fn decode(b: &Block) -> Superblock {
        Superblock {
            header: Header::decode(b),
            magic: le64(b, 32),
            version: le32(b, 40),
            block_size: le32(b, 44),
            metadata_blocks: le64(b, 48),
            data_blocks: le64(b, 56),
            logical_blocks: le64(b, 64),
            hash_name: b[72..104].try_into().unwrap(),
            fp_size: le32(b, 104),
            flags: le32(b, 108),
            map_root: le64(b, 112),
            refcount_root: le64(b, 120),
            fingerprint_root: le64(b, 128),
            mapped_blocks: le64(b, 136),
            used_data_blocks: le64(b, 144),
            unique_writes: le64(b, 152),
            duplicate_writes: le64(b, 160),
            zero_writes: le64(b, 168),
            discarded_blocks: le64(b, 176),
            format_time: le64(b, 184),
            saved_root: le64(b, 192),
            saved_words: le64(b, 200),
            journal_start: le64(b, 208),
            journal_blocks: le64(b, 216),
            journal_seq: le64(b, 224),
            journal_id: le64(b, 232),
        }
    }

    /// The block dd_bm_write_super() writes: the structure, zeros up to
    /// 4 KiB, `blocknr` = the slot, then the checksum.
    pub fn encode(&self) -> Box<Block> {
        let mut b = zero_block();
        let mut h = self.header;
        h.blocknr = self.slot();
        h.encode(&mut b[..]);
        put64(&mut b[..], 32, self.magic);
        put32(&mut b[..], 40, self.version);
        put32(&mut b[..], 44, self.block_size);
        put64(&mut b[..], 48, self.metadata_blocks);
        put64(&mut b[..], 56, self.data_blocks);
        put64(&mut b[..], 64, self.logical_blocks);
        b[72..104].copy_from_slice(&self.hash_name);
        put32(&mut b[..], 104, self.fp_size);
        put32(&mut b[..], 108, self.flags);
        put64(&mut b[..], 112, self.map_root);
        put64(&mut b[..], 120, self.refcount_root);
        put64(&mut b[..], 128, self.fingerprint_root);
        put64(&mut b[..], 136, self.mapped_blocks);
        put64(&mut b[..], 144, self.used_data_blocks);
        put64(&mut b[..], 152, self.unique_writes);
        put64(&mut b[..], 160, self.duplicate_writes);
        put64(&mut b[..], 168, self.zero_writes);
        put64(&mut b[..], 176, self.discarded_blocks);
        put64(&mut b[..], 184, self.format_time);
        put64(&mut b[..], 192, self.saved_root);
        put64(&mut b[..], 200, self.saved_words);
        put64(&mut b[..], 208, self.journal_start);
        put64(&mut b[..], 216, self.journal_blocks);
        put64(&mut b[..], 224, self.journal_seq);
        put64(&mut b[..], 232, self.journal_id);
        seal(&mut b);
        b
    }

    pub fn root(&self, id: ArrayId) -> u64 {
        match id {
            ArrayId::Map => self.map_root,
            ArrayId::Refcount => self.refcount_root,
            ArrayId::Fingerprint => self.fingerprint_root,
            ArrayId::Saved => self.saved_root,
        }
    }

    pub fn geometry(&self, id: ArrayId) -> Geometry {
        match id {
            ArrayId::Map => Geometry::new(id, self.logical_blocks),
            ArrayId::Refcount | ArrayId::Fingerprint => Geometry::new(id, self.data_blocks),
            ArrayId::Saved => Geometry::new(id, self.saved_words),
        }
    }

    /// The same state without a save: what any rewrite of a superblock
    /// writes, since a save describes only the superblock that named it.
    pub fn without_save(mut self) -> Superblock {
        self.saved_root = 0;
        self.saved_words = 0;
        self
    }

    /// Why the journal fields cannot be what this version demands, as
    /// dd_check_sb() judges them (the kernel refuses the device: "journal
    /// fields"): in version 1 all four are 0; in version 2 the run holds
    /// JOURNAL_MIN_BLOCKS to JOURNAL_BLOCKS blocks inside [2,
    /// metadata_blocks) and the id is not 0. None for another version
    /// (refused on its own).
    pub fn journal_fault(&self) -> Option<String> {
        let (start, n) = (self.journal_start, self.journal_blocks);
        match self.version {
            FORMAT_VERSION_V1 => {
                if start != 0 || n != 0 || self.journal_seq != 0 || self.journal_id != 0 {
                    return Some(format!(
                        "format version 1 has no journal, but the journal fields are not 0 \
                         (start {start}, blocks {n}, seq {}, id {:#x})",
                        self.journal_seq, self.journal_id
                    ));
                }
                None
            }
            FORMAT_VERSION => {
                if n < JOURNAL_MIN_BLOCKS {
                    return Some(format!(
                        "the journal has {n} blocks, fewer than {JOURNAL_MIN_BLOCKS}"
                    ));
                }
                if n > JOURNAL_BLOCKS {
                    return Some(format!(
                        "the journal has {n} blocks, more than {JOURNAL_BLOCKS}"
                    ));
                }
                let end = start.checked_add(n);
                if start < FIRST_TREE_BLOCK || end.is_none_or(|e| e > self.metadata_blocks) {
                    return Some(format!(
                        "the journal's run of {n} blocks at {start} is not inside \
                         [{FIRST_TREE_BLOCK}, {}) (metadata_blocks)",
                        self.metadata_blocks
                    ));
                }
                if self.journal_id == 0 {
                    return Some("the journal id is 0".into());
                }
                None
            }
            _ => None,
        }
    }

    /// The journal's run, when this is a version 2 superblock whose
    /// journal fields are sound.
    pub fn journal_run(&self) -> Option<std::ops::Range<u64>> {
        (self.version == FORMAT_VERSION && self.journal_fault().is_none())
            .then(|| self.journal_start..self.journal_start + self.journal_blocks)
    }

    /// Whether the appends after this superblock may carry JF_UNFLUSHED.
    pub fn unflushed_appends(&self) -> bool {
        self.flags & SB_UNFLUSHED_APPENDS != 0
    }

    /// Where the journal block of sequence number `seq` lives (the run
    /// must be sound).
    pub fn journal_block(&self, seq: u64) -> u64 {
        self.journal_start + seq % self.journal_blocks
    }
}

/// The six values of a COUNTERS record: the superblock's counters as of
/// the end of an append.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    pub mapped_blocks: u64,
    pub used_data_blocks: u64,
    pub unique_writes: u64,
    pub duplicate_writes: u64,
    pub zero_writes: u64,
    pub discarded_blocks: u64,
}

impl Counters {
    pub fn of(sb: &Superblock) -> Counters {
        Counters {
            mapped_blocks: sb.mapped_blocks,
            used_data_blocks: sb.used_data_blocks,
            unique_writes: sb.unique_writes,
            duplicate_writes: sb.duplicate_writes,
            zero_writes: sb.zero_writes,
            discarded_blocks: sb.discarded_blocks,
        }
    }

    /// Set the superblock's counters to these.
    pub fn apply(&self, sb: &mut Superblock) {
        sb.mapped_blocks = self.mapped_blocks;
        sb.used_data_blocks = self.used_data_blocks;
        sb.unique_writes = self.unique_writes;
        sb.duplicate_writes = self.duplicate_writes;
        sb.zero_writes = self.zero_writes;
        sb.discarded_blocks = self.discarded_blocks;
    }

    fn values(&self) -> [u64; JR_NR_COUNTERS] {
        [
            self.mapped_blocks,
            self.used_data_blocks,
            self.unique_writes,
            self.duplicate_writes,
            self.zero_writes,
            self.discarded_blocks,
        ]
    }

    fn from_values(v: [u64; JR_NR_COUNTERS]) -> Counters {
        Counters {
            mapped_blocks: v[0],
            used_data_blocks: v[1],
            unique_writes: v[2],
            duplicate_writes: v[3],
            zero_writes: v[4],
            discarded_blocks: v[5],
        }
    }
}

/// One journal record (enum dd_journal_record): the new value of an entry,
/// or the counters at the end of an append.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// map[lba] = value: PBA + 1, or 0 for unmapped.
    Map { lba: u64, value: u64 },
    /// refcount[pba] = count (stored as a __le64 whose high half is 0).
    Refcount { pba: u64, count: u32 },
    /// fingerprint[pba] = the 32-byte record.
    Fingerprint { pba: u64, fp: [u8; FP_SIZE] },
    /// The counters as of the end of the append; index 0.
    Counters(Counters),
}

impl Record {
    /// Bytes of a record of `kind`, key included; None for an unknown type.
    pub fn size_of(kind: u8) -> Option<usize> {
        match kind {
            JR_MAP | JR_REFCOUNT => Some(16),
            JR_FINGERPRINT => Some(8 + FP_SIZE),
            JR_COUNTERS => Some(8 + 8 * JR_NR_COUNTERS),
            _ => None,
        }
    }

    pub fn kind(&self) -> u8 {
        match self {
            Record::Map { .. } => JR_MAP,
            Record::Refcount { .. } => JR_REFCOUNT,
            Record::Fingerprint { .. } => JR_FINGERPRINT,
            Record::Counters(_) => JR_COUNTERS,
        }
    }

    pub fn index(&self) -> u64 {
        match *self {
            Record::Map { lba, .. } => lba,
            Record::Refcount { pba, .. } | Record::Fingerprint { pba, .. } => pba,
            Record::Counters(_) => 0,
        }
    }

    pub fn size(&self) -> usize {
        Record::size_of(self.kind()).expect("a known type")
    }

    /// The record's bytes: the key (type << 56 | index; the index is cut
    /// to 56 bits, as the kernel does), then the value.
    pub fn encode(&self) -> Vec<u8> {
        let key = (self.kind() as u64) << JR_TYPE_SHIFT | (self.index() & JR_INDEX_MASK);
        let mut v = key.to_le_bytes().to_vec();
        match self {
            Record::Map { value, .. } => v.extend_from_slice(&value.to_le_bytes()),
            Record::Refcount { count, .. } => v.extend_from_slice(&(*count as u64).to_le_bytes()),
            Record::Fingerprint { fp, .. } => v.extend_from_slice(fp),
            Record::Counters(c) => {
                for x in c.values() {
                    v.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
        v
    }

    /// The record at the start of `buf` and its size, or why it is not
    /// one: an unknown type, a record longer than `buf`, a REFCOUNT whose
    /// high half is not 0, a COUNTERS record with an index. Sizes are not
    /// judged here (see `fault`).
    pub fn decode(buf: &[u8]) -> Result<(Record, usize), String> {
        if buf.len() < 8 {
            return Err("a record crossing the end of the used bytes".into());
        }
        let key = le64(buf, 0);
        let kind = (key >> JR_TYPE_SHIFT) as u8;
        let index = key & JR_INDEX_MASK;
        let Some(size) = Record::size_of(kind) else {
            return Err(format!("unknown record type {kind}"));
        };
        if buf.len() < size {
            return Err(format!(
                "a {}-byte record of type {kind} crossing the end of the used bytes",
                size
            ));
        }
        let r = match kind {
            JR_MAP => Record::Map {
                lba: index,
                value: le64(buf, 8),
            },
            JR_REFCOUNT => {
                let v = le64(buf, 8);
                if v >> 32 != 0 {
                    return Err(format!(
                        "refcount record of physical block {index} above 32 bits ({v:#x})"
                    ));
                }
                Record::Refcount {
                    pba: index,
                    count: v as u32,
                }
            }
            JR_FINGERPRINT => Record::Fingerprint {
                pba: index,
                fp: buf[8..8 + FP_SIZE].try_into().unwrap(),
            },
            _ => {
                if index != 0 {
                    return Err(format!("counters record with index {index}"));
                }
                let mut v = [0u64; JR_NR_COUNTERS];
                for (i, x) in v.iter_mut().enumerate() {
                    *x = le64(buf, 8 + 8 * i);
                }
                Record::Counters(Counters::from_values(v))
            }
        };
        Ok((r, size))
    }

    /// Why the record does not fit the arrays of `sb` (what the kernel's
    /// replay refuses): an index beyond its array, or a map value beyond
    /// the data device.
    pub fn fault(&self, logical_blocks: u64, data_blocks: u64) -> Option<String> {
        match *self {
            Record::Map { lba, .. } if lba >= logical_blocks => Some(format!(
                "map record of logical block {lba}, beyond the logical size ({logical_blocks} blocks)"
            )),
            Record::Map { lba, value } if value > data_blocks => Some(format!(
                "map record of logical block {lba} to physical block {}, beyond the data device \
                 ({data_blocks} blocks)",
                value - 1
            )),
            Record::Refcount { pba, .. } | Record::Fingerprint { pba, .. } if pba >= data_blocks => {
                Some(format!(
                    "{} record of physical block {pba}, beyond the data device ({data_blocks} blocks)",
                    if self.kind() == JR_REFCOUNT {
                        "refcount"
                    } else {
                        "fingerprint"
                    }
                ))
            }
            _ => None,
        }
    }
}

/// A journal block (`struct dd_journal_header` and its records), decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalBlock {
    /// type JRNL, blocknr where it lives, txn informational, array and
    /// level 0.
    pub header: Header,
    pub journal_id: u64,
    /// The journal_seq of the superblock it follows.
    pub epoch: u64,
    pub seq: u64,
    /// Bytes of records at the start of `payload`.
    pub used: u32,
    /// JF_END on the last block of an append; JF_UNFLUSHED.
    pub flags: u32,
    /// Bytes 64..4095 of the block: `used` bytes of records, then zeros.
    pub payload: Box<[u8; JOURNAL_PAYLOAD]>,
}

/// Why the records of a journal block cannot be replayed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordFault {
    /// Offset in the record area of the record at fault (None: the
    /// block's own fields).
    pub offset: Option<usize>,
    pub why: String,
}

impl JournalBlock {
    /// A block of `records` (which must fit: see `fits`), to live at
    /// `blocknr`.
    pub fn new(
        blocknr: u64,
        txn: u64,
        journal_id: u64,
        epoch: u64,
        seq: u64,
        records: &[Record],
        end: bool,
    ) -> JournalBlock {
        let mut payload = Box::new([0u8; JOURNAL_PAYLOAD]);
        let mut used = 0;
        for r in records {
            let b = r.encode();
            payload[used..used + b.len()].copy_from_slice(&b);
            used += b.len();
        }
        JournalBlock {
            header: Header {
                btype: BT_JOURNAL,
                blocknr,
                txn,
                ..Header::default()
            },
            journal_id,
            epoch,
            seq,
            used: used as u32,
            flags: if end { JF_END } else { 0 },
            payload,
        }
    }

    /// How many of `records`, from the first, fill one block.
    pub fn fits(records: &[Record]) -> usize {
        let mut used = 0;
        records
            .iter()
            .take_while(|r| {
                used += r.size();
                used <= JOURNAL_PAYLOAD
            })
            .count()
    }

    pub fn is_end(&self) -> bool {
        self.flags & JF_END != 0
    }

    pub fn is_unflushed(&self) -> bool {
        self.flags & JF_UNFLUSHED != 0
    }

    pub fn decode(b: &Block) -> JournalBlock {
        JournalBlock {
            header: Header::decode(&b[..]),
            journal_id: le64(b, 32),
            epoch: le64(b, 40),
            seq: le64(b, 48),
            used: le32(b, 56),
            flags: le32(b, 60),
            payload: Box::new(b[JOURNAL_HEADER_SIZE..].try_into().unwrap()),
        }
    }

    /// The block as written, checksum included.
    pub fn encode(&self) -> Box<Block> {
        let mut b = zero_block();
        self.header.encode(&mut b[..]);
        put64(&mut b[..], 32, self.journal_id);
        put64(&mut b[..], 40, self.epoch);
        put64(&mut b[..], 48, self.seq);
        put32(&mut b[..], 56, self.used);
        put32(&mut b[..], 60, self.flags);
        b[JOURNAL_HEADER_SIZE..].copy_from_slice(&self.payload[..]);
        seal(&mut b);
        b
    }

    /// The records of a block that continues the journal of a device
    /// with these sizes, or the first reason they are malformed, as the
    /// kernel's replay judges them: `used` above 4032 or not a multiple of
    /// 8, unknown flags (UNFLUSHED among them unless `unflushed_allowed`:
    /// the superblock has SB_UNFLUSHED_APPENDS), a record that is unknown,
    /// crosses `used`, lies beyond its array or has a non-zero REFCOUNT
    /// high half, and a block with END whose last record is not COUNTERS.
    pub fn records(
        &self,
        logical_blocks: u64,
        data_blocks: u64,
        unflushed_allowed: bool,
    ) -> Result<Vec<Record>, RecordFault> {
        let block_fault = |why: String| RecordFault { offset: None, why };
        if self.used as usize > JOURNAL_PAYLOAD || !self.used.is_multiple_of(8) {
            return Err(block_fault(format!(
                "bad record length: used is {} (a multiple of 8, at most {JOURNAL_PAYLOAD})",
                self.used
            )));
        }
        let unknown = self.flags & !(JF_END | JF_UNFLUSHED);
        if unknown != 0 {
            return Err(block_fault(format!("unknown flags {unknown:#x}")));
        }
        if self.is_unflushed() && !unflushed_allowed {
            // The kernel says "unknown flags" too: to a reader of this
            // superblock the bit is not defined.
            return Err(block_fault(format!(
                "unknown flags {JF_UNFLUSHED:#x} (UNFLUSHED, under a superblock without \
                 UNFLUSHED_APPENDS)"
            )));
        }
        let used = self.used as usize;
        let mut v = Vec::new();
        let mut off = 0;
        while off < used {
            let fault = |why: String| RecordFault {
                offset: Some(off),
                why,
            };
            let (r, size) = Record::decode(&self.payload[off..used]).map_err(fault)?;
            if let Some(why) = r.fault(logical_blocks, data_blocks) {
                return Err(fault(why));
            }
            v.push(r);
            off += size;
        }
        if self.is_end() && !matches!(v.last(), Some(Record::Counters(_))) {
            return Err(block_fault(
                "an append that does not end with its counters (the END block's last \
                 record is not COUNTERS)"
                    .into(),
            ));
        }
        Ok(v)
    }
}

/// What one superblock slot holds, decided exactly as dd_read_sb() does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Checksum, type, block number and magic all right.
    Valid(Box<Superblock>),
    /// All 4096 bytes are zero (never written).
    Zero,
    /// Anything else; the string says why.
    Bad(String),
}

impl SlotState {
    pub fn label(&self) -> &'static str {
        match self {
            SlotState::Valid(_) => "valid",
            SlotState::Zero => "zero",
            SlotState::Bad(_) => "bad",
        }
    }
}

/// Classify the content of superblock slot `slot`.
pub fn classify_slot(slot: u64, b: &Block) -> SlotState {
    if is_zero(b) {
        return SlotState::Zero;
    }
    let sb = Superblock::decode(b);
    // The kernel tests these in one expression; report the first failure
    // in an order that makes the most useful message.
    if sb.magic != SB_MAGIC {
        return SlotState::Bad(format!(
            "no dm-dedup magic (found {:#018x}, expected {:#018x})",
            sb.magic, SB_MAGIC
        ));
    }
    if !csum_ok(b) {
        return SlotState::Bad(format!(
            "checksum mismatch (stored {:#010x}, computed {:#010x})",
            stored_csum(b),
            block_csum(b)
        ));
    }
    if sb.header.btype != BT_SUPER {
        return SlotState::Bad(format!(
            "block type {} is not SUPR",
            type_name(sb.header.btype)
        ));
    }
    if sb.header.blocknr != slot {
        return SlotState::Bad(format!(
            "claims to be block {} (misdirected write?)",
            sb.header.blocknr
        ));
    }
    SlotState::Valid(Box::new(sb))
}

/// The first slot that is neither zero nor a valid superblock, and why:
/// the kernel refuses to format such a device ("not zeroed"), and a
/// writer that starts from scratch must not overwrite it unforced either,
/// since it may hold damaged metadata that `dedup repair` can recover.
fn damaged_slot(states: &[SlotState]) -> Option<(usize, &str)> {
    states.iter().enumerate().find_map(|(i, st)| match st {
        SlotState::Bad(why) => Some((i, why.as_str())),
        _ => None,
    })
}

/// Why format and restore, unforced, refuse to write over device `name`
/// whose superblock slots read as `states`: valid metadata (the slot the
/// kernel would open), or a damaged slot. None: both slots are zeroed.
pub fn overwrite_refusal(name: &str, states: &[SlotState]) -> Option<String> {
    if let Some(slot) = pick_superblock(states) {
        let SlotState::Valid(sb) = &states[slot] else {
            unreachable!()
        };
        return Some(format!(
            "{name} already holds dm-dedup metadata (slot {slot}, generation {}, {} mapped \
             blocks); use --force to overwrite it",
            sb.generation(),
            sb.mapped_blocks
        ));
    }
    let (slot, why) = damaged_slot(states)?;
    Some(format!(
        "{name}: superblock slot {slot} is neither zeroed nor valid ({why}): it may hold damaged \
         dm-dedup metadata (try `dedup check`, then `dedup repair`) or other data; use --force \
         to overwrite it"
    ))
}

/// dd_md_open(): the valid slot with the highest generation; on a tie the
/// lower slot wins (the kernel compares with a strict `>`).
pub fn pick_superblock(states: &[SlotState]) -> Option<usize> {
    let mut best: Option<(usize, u64)> = None;
    for (i, st) in states.iter().enumerate() {
        if let SlotState::Valid(sb) = st {
            if best.is_none_or(|(_, g)| sb.generation() > g) {
                best = Some((i, sb.generation()));
            }
        }
    }
    best.map(|(i, _)| i)
}

/// Why `blk`, read at block `b`, cannot be the node of array `id` at
/// `level` that the tree expects there: (problem code, message), or None.
/// Checksum, location and kind only; the transaction is judged by the
/// caller (check reports it, repair distrusts the block).
pub fn tree_block_fault(
    blk: &Block,
    b: u64,
    id: ArrayId,
    level: u8,
) -> Option<(&'static str, String)> {
    if !csum_ok(blk) {
        let what = if is_zero(&blk[..]) {
            "block is all zeros (never written?)".to_string()
        } else {
            format!(
                "checksum mismatch (stored {:#010x}, computed {:#010x})",
                stored_csum(blk),
                block_csum(blk)
            )
        };
        return Some(("bad_checksum", what));
    }
    let h = Header::decode(&blk[..]);
    if h.blocknr != b {
        return Some((
            "wrong_blocknr",
            format!(
                "claims to be block {} (misdirected or misplaced write)",
                h.blocknr
            ),
        ));
    }
    let want = if level > 0 { BT_INTERIOR } else { BT_LEAF };
    if h.btype != want || h.array != id as u8 || h.level != level {
        return Some((
            "wrong_kind",
            format!(
                "type {} array {} level {}, expected {} array {} level {}",
                type_name(h.btype),
                h.array,
                h.level,
                type_name(want),
                id as u8,
                level
            ),
        ));
    }
    None
}

/// Header of a fresh tree block (dd_init_header), checksum included.
pub fn new_tree_block(blocknr: u64, id: ArrayId, level: u8, txn: u64) -> Box<Block> {
    let mut b = zero_block();
    Header {
        csum: 0,
        btype: if level > 0 { BT_INTERIOR } else { BT_LEAF },
        blocknr,
        txn,
        array: id as u8,
        level,
        reserved1: 0,
        reserved2: 0,
    }
    .encode(&mut b[..]);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_c_header() {
        assert_eq!(&SB_MAGIC.to_le_bytes(), b"DDEDUP01");
        assert_eq!(MAX_TXN, 0xffff_fffe_ffff_ffff);
        assert_eq!(MAX_TXN, 18_446_744_069_414_584_319);
        assert_eq!(&BT_SUPER.to_le_bytes(), b"SUPR");
        assert_eq!(&BT_INTERIOR.to_le_bytes(), b"INTR");
        assert_eq!(&BT_LEAF.to_le_bytes(), b"LEAF");
        assert_eq!(INTERIOR_FANOUT, 508);
        assert_eq!(&saved::MAGIC.to_le_bytes(), b"DDSAVED1");
        assert_eq!(saved::INDEX_LAYOUT.to_le_bytes(), *b"IDX2\0\0\0\0");
        assert_eq!(saved::FP_PER_LEAF, 127);
        assert_eq!(saved::FP_PER_LEAF, per_leaf(FP_SIZE as u32) as u64);
        assert_eq!(ArrayId::from_u8(4), Some(ArrayId::Saved));
        let l = saved::Layout::new(130, 64, 5).unwrap();
        assert_eq!((l.meta_words, l.data_words), (3, 1));
        assert_eq!((l.data_start, l.target_start, l.total), (19, 20, 25));
        assert_eq!(saved::Layout::new(u64::MAX, u64::MAX, u64::MAX), None);
        assert_eq!(per_leaf(8), 508);
        assert_eq!(per_leaf(4), 1016);
        assert_eq!(per_leaf(32), 127);
    }

    #[test]
    fn index_geometry_is_the_kernels() {
        use saved::{IndexEntry, IndexGeometry};
        // 300 data blocks: 3 leaves, L = 2; w = 30; B = ceil(30000 / 760).
        let g = IndexGeometry::for_data_blocks(300);
        assert_eq!(
            (g.entry_bits, g.leaf_bits, g.bucket_entries, g.fp_per_leaf),
            (30, 2, 8, 127)
        );
        assert_eq!((g.buckets, g.entries(), g.words()), (40, 320, 150));
        assert_eq!(g.encode(), 30 | 2 << 8 | 8 << 16 | 127 << 32);
        assert_eq!(IndexGeometry::decode(g.encode(), g.buckets), Some(g));
        // Leaf counts at powers of two: 127 blocks are 1 leaf (L = 1),
        // 128 are 2 (L = 2), 2^32 are 33818641 (L = 26, w still 30), and
        // 2^40 need L = 34, so w = 38. No leaf at all: L = 1.
        assert_eq!(IndexGeometry::for_data_blocks(0).leaf_bits, 1);
        assert_eq!(IndexGeometry::for_data_blocks(127).leaf_bits, 1);
        assert_eq!(IndexGeometry::for_data_blocks(128).leaf_bits, 2);
        let g = IndexGeometry::for_data_blocks(1 << 32);
        assert_eq!(saved::nr_leaves(1 << 32), 33_818_641);
        assert_eq!((g.leaf_bits, g.entry_bits), (26, 30));
        assert_eq!(g.buckets, 565_127_276); // ceil(2^32 * 100 / 760)
        let g = IndexGeometry::for_data_blocks(1 << 40);
        assert_eq!((g.leaf_bits, g.entry_bits), (34, 38));
        // At least 2 buckets.
        assert_eq!(IndexGeometry::for_data_blocks(1).buckets, 2);
        assert_eq!(IndexGeometry::for_data_blocks(15).buckets, 2);
        assert_eq!(IndexGeometry::for_data_blocks(16).buckets, 3);
        assert_eq!(saved::leaf_of(126), 0);
        assert_eq!(saved::leaf_of(127), 1);

        // What decode refuses.
        let ok = 30 | 2 << 8 | 8 << 16 | 127 << 32;
        assert!(IndexGeometry::decode(ok, 40).is_some());
        for bad in [
            (ok & !0xff) | 65,             // w > 64
            ok & !(0xff << 8),             // L = 0
            (ok & !(0xff << 8)) | 30 << 8, // L = w
            ok & !(0xff << 16),            // E = 0
            ok | 1 << 24,                  // bits 24-31
            (ok & 0xffff_ffff) | 128 << 32,
        ] {
            assert_eq!(IndexGeometry::decode(bad, 40), None, "{bad:#x}");
        }
        assert_eq!(IndexGeometry::decode(ok, u64::MAX / 4), None);
        // w = 64: one entry a word.
        let g = IndexGeometry::decode(64 | 40 << 8 | 4 << 16 | 127 << 32, 3).unwrap();
        assert_eq!((g.entries(), g.words()), (12, 12));

        // Entries straddle words: with w = 30, entry 2 is bits 60..90.
        let g = IndexGeometry::for_data_blocks(300);
        assert_eq!(g.entry_words(1), (0, 0));
        assert_eq!(g.entry_words(2), (0, 1));
        assert_eq!(g.entry_words(3), (1, 1));
        let mut w = vec![0u64; g.words() as usize];
        let e = g.make_entry(2, 0x5a5_a5a5);
        assert_eq!(e, 3 | 0x5a5_a5a5 << 2);
        g.set_entry(&mut w, 2, e);
        assert_eq!(w[0], e << 60);
        assert_eq!(w[1], e >> 4);
        assert_eq!(w[2..], vec![0; w.len() - 2][..]);
        assert_eq!(g.entry(&w, 2), e);
        assert_eq!((g.entry(&w, 1), g.entry(&w, 3)), (0, 0));
        assert_eq!(g.decode_entry(e), IndexEntry::Leaf(2));
        assert_eq!(g.decode_entry(0), IndexEntry::Empty);
        assert_eq!(g.decode_entry(1 << 2), IndexEntry::NoLeaf);
        // Every entry round-trips, neighbours untouched, the last ending
        // in the last word.
        let mut w = vec![0u64; g.words() as usize];
        let val = |k: u64| g.make_entry(k % 3, k.wrapping_mul(0x9E37_79B9));
        for k in 0..g.entries() {
            g.set_entry(&mut w, k, val(k));
        }
        for k in 0..g.entries() {
            assert_eq!(g.entry(&w, k), val(k), "entry {k}");
        }
        assert_eq!(g.entry_words(g.entries() - 1).1, g.words() - 1);
        g.set_entry(&mut w, 2, 0);
        assert_eq!((g.entry(&w, 1), g.entry(&w, 2)), (val(1), 0));
        assert_eq!(g.entry(&w, 3), val(3));
        // Past the end reads as zeros: of entry 2, the 4 bits of word 0.
        g.set_entry(&mut w, 2, val(2));
        assert_eq!(g.entry(&w[..1], 2), val(2) & 0xf);
    }

    #[test]
    fn geometry_heights() {
        assert_eq!(Geometry::new(ArrayId::Map, 0).height, 0);
        assert_eq!(Geometry::new(ArrayId::Map, 1).height, 0);
        assert_eq!(Geometry::new(ArrayId::Map, 508).height, 0);
        assert_eq!(Geometry::new(ArrayId::Map, 509).height, 1);
        assert_eq!(Geometry::new(ArrayId::Map, 508 * 508).height, 1);
        assert_eq!(Geometry::new(ArrayId::Map, 508 * 508 + 1).height, 2);
        assert_eq!(Geometry::new(ArrayId::Fingerprint, 128).height, 1);
        assert_eq!(Geometry::new(ArrayId::Map, u64::MAX).height, 7);
        let g = Geometry::new(ArrayId::Map, 1000);
        assert_eq!(g.leaf_count(0), 508);
        assert_eq!(g.leaf_count(1), 492);
        assert_eq!(g.leaf_count(2), 0);
    }

    #[test]
    fn child_slots() {
        assert_eq!(Geometry::child_slot(0, 1), 0);
        assert_eq!(Geometry::child_slot(507, 1), 507);
        assert_eq!(Geometry::child_slot(508, 1), 0);
        assert_eq!(Geometry::child_slot(508, 2), 1);
        assert_eq!(Geometry::child_slot(508 * 508 * 3 + 508 * 2 + 1, 3), 3);
        assert_eq!(Geometry::child_slot(508 * 508 * 3 + 508 * 2 + 1, 2), 2);
        assert_eq!(Geometry::child_slot(508 * 508 * 3 + 508 * 2 + 1, 1), 1);
    }

    #[test]
    fn required_blocks_formula() {
        // 4 GiB logical, 1 GiB data: map 1048576 entries -> 2065 leaves
        // + 5 + 1; refcounts 262144 -> 259 + 1; fingerprints -> 2065 + 5 + 1.
        let l = 1u64 << 20;
        let d = 1u64 << 18;
        assert_eq!(array_max_blocks(8, l), 2065 + 5 + 1);
        assert_eq!(array_max_blocks(4, d), 259 + 1);
        assert_eq!(array_max_blocks(32, d), 2065 + 5 + 1);
        // dd_md_required_blocks(): slots, twice the trees, and a journal
        // of a quarter of that (64 to 2048 blocks).
        assert_eq!(open_blocks(l, d), 2 + 2 * (2071 + 260 + 2071));
        assert_eq!(open_blocks(l, d), 8806);
        assert_eq!(journal_size(l, d), 2048);
        assert_eq!(required_blocks(l, d), 8806 + 2048);
        // The interface draft: 64 MiB of metadata covers this.
        assert!(required_blocks(l, d) * 4096 <= 64 << 20);
        assert_eq!(required_blocks(0, 0), 2 + 64);
        assert_eq!(required_blocks(1, 1), 2 + 2 * 3 + 64);
        // 64 MiB of data, 256 MiB logical: 562 / 4.
        assert_eq!(open_blocks(1 << 16, 1 << 14), 562);
        assert_eq!(journal_size(1 << 16, 1 << 14), 140);
        // dd_journal_make(): the sizes decide, the device only bounds it.
        assert_eq!(journal_blocks_for(8806 + 63, l, d), None);
        assert_eq!(journal_blocks_for(8806 + 64, l, d), Some(2048));
        assert_eq!(journal_blocks_for(1 << 30, l, d), Some(2048));
    }

    #[test]
    fn superblock_layout() {
        let sb = Superblock::new_formatted(100, 200, 300, "sha256", 32, 0x1122334455667788);
        let b = sb.encode();
        assert_eq!(le32(&b[..], 4), BT_SUPER);
        assert_eq!(le64(&b[..], 8), 1); // blocknr = slot 1
        assert_eq!(le64(&b[..], 16), 1); // txn
        assert_eq!(&b[32..40], b"DDEDUP01");
        assert_eq!(le32(&b[..], 40), 2);
        assert_eq!(le32(&b[..], 44), 4096);
        assert_eq!(le64(&b[..], 48), 100);
        assert_eq!(le64(&b[..], 56), 200);
        assert_eq!(le64(&b[..], 64), 300);
        assert_eq!(&b[72..79], b"sha256\0");
        assert_eq!(le32(&b[..], 104), 32);
        assert_eq!(le64(&b[..], 184), 0x1122334455667788);
        assert!(is_zero(&b[184 + 8..]));
        let mut with = sb.clone();
        with.saved_root = 0x0102;
        with.saved_words = 0x0304;
        let wb = with.encode();
        assert_eq!((le64(&wb[..], 192), le64(&wb[..], 200)), (0x0102, 0x0304));
        assert!(is_zero(&wb[SUPERBLOCK_SIZE..]));
        // The journal fields, at 208..239; nothing after them.
        let mut j = sb.clone();
        j.journal_start = 0x1111;
        j.journal_blocks = 0x2222;
        j.journal_seq = 0x3333;
        j.journal_id = 0x4444;
        let jb = j.encode();
        assert_eq!(le64(&jb[..], 208), 0x1111);
        assert_eq!(le64(&jb[..], 216), 0x2222);
        assert_eq!(le64(&jb[..], 224), 0x3333);
        assert_eq!(le64(&jb[..], 232), 0x4444);
        assert!(is_zero(&jb[SUPERBLOCK_SIZE..]));
        assert_eq!(SUPERBLOCK_SIZE, 240);
        let mut back = Superblock::decode(&jb);
        back.header = j.header;
        back.header.blocknr = 1;
        let mut want = j.clone();
        want.header.blocknr = 1;
        assert_eq!(back, want);
        let mut back = Superblock::decode(&wb).without_save();
        back.header.csum = stored_csum(&b);
        assert_eq!(back, Superblock::decode(&b));
        assert!(csum_ok(&b));
        assert_eq!(Superblock::decode(&b), {
            let mut s = sb.clone();
            s.header.blocknr = 1;
            s.header.csum = stored_csum(&b);
            s
        });
        assert!(matches!(classify_slot(1, &b), SlotState::Valid(_)));
        assert!(matches!(classify_slot(0, &b), SlotState::Bad(_)));
    }

    #[test]
    fn journal_fields_are_judged_as_the_kernel_does() {
        let mut sb = Superblock::new_formatted(4000, 10, 10, "sha256", 32, 0);
        sb.journal_start = 2;
        sb.journal_blocks = 2048;
        sb.journal_seq = 1;
        sb.journal_id = 7;
        assert_eq!(sb.journal_fault(), None);
        assert_eq!(sb.journal_run(), Some(2..2050));
        assert_eq!(sb.journal_block(1), 3);
        assert_eq!(sb.journal_block(2047), 2049);
        assert_eq!(sb.journal_block(2048), 2);
        assert_eq!(sb.journal_block(2048 * 5 + 9), 11);
        let bad = |f: fn(&mut Superblock)| {
            let mut s = sb.clone();
            f(&mut s);
            assert!(s.journal_run().is_none());
            s.journal_fault().unwrap()
        };
        assert!(bad(|s| s.journal_blocks = 15).contains("fewer than 16"));
        assert!(bad(|s| s.journal_blocks = 2049).contains("more than 2048"));
        assert!(bad(|s| s.journal_blocks = 1 << 32).contains("more than 2048"));
        assert!(bad(|s| s.journal_start = 1).contains("not inside [2, 4000)"));
        assert!(bad(|s| s.journal_start = 4000 - 2047).contains("not inside"));
        assert!(bad(|s| s.journal_start = u64::MAX - 10).contains("not inside"));
        assert!(bad(|s| s.journal_id = 0).contains("id is 0"));
        let mut v1 = sb.clone();
        v1.version = FORMAT_VERSION_V1;
        assert!(v1
            .journal_fault()
            .unwrap()
            .contains("version 1 has no journal"));
        v1.journal_start = 0;
        v1.journal_blocks = 0;
        v1.journal_seq = 0;
        v1.journal_id = 0;
        assert_eq!((v1.journal_fault(), v1.journal_run()), (None, None));
        let mut s16 = sb.clone();
        s16.journal_blocks = 16;
        s16.journal_start = 4000 - 16;
        assert_eq!(s16.journal_fault(), None);
    }

    fn sample_records() -> Vec<Record> {
        let mut fp = [0u8; FP_SIZE];
        fp.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8 + 1);
        vec![
            Record::Map { lba: 7, value: 3 },
            Record::Map { lba: 8, value: 0 },
            Record::Refcount {
                pba: 2,
                count: u32::MAX,
            },
            Record::Fingerprint { pba: 2, fp },
            Record::Counters(Counters {
                mapped_blocks: 1,
                used_data_blocks: 2,
                unique_writes: 3,
                duplicate_writes: 4,
                zero_writes: 5,
                discarded_blocks: 6,
            }),
        ]
    }

    #[test]
    fn records_encode_and_decode() {
        assert_eq!(&BT_JOURNAL.to_le_bytes(), b"JRNL");
        for r in sample_records() {
            let b = r.encode();
            assert_eq!(b.len(), r.size());
            assert_eq!(le64(&b, 0) >> 56, r.kind() as u64);
            assert_eq!(le64(&b, 0) & JR_INDEX_MASK, r.index());
            assert_eq!(Record::decode(&b), Ok((r, b.len())));
            // Cut short: a record crossing the end of the used bytes.
            assert!(Record::decode(&b[..b.len() - 8])
                .unwrap_err()
                .contains("crossing"));
        }
        // The layouts of the format document.
        let m = Record::Map { lba: 5, value: 9 }.encode();
        assert_eq!(
            m,
            [&(1u64 << 56 | 5).to_le_bytes()[..], &9u64.to_le_bytes()].concat()
        );
        let r = Record::Refcount { pba: 4, count: 2 }.encode();
        assert_eq!(
            r,
            [&(2u64 << 56 | 4).to_le_bytes()[..], &2u64.to_le_bytes()].concat()
        );
        assert_eq!(Record::size_of(JR_FINGERPRINT), Some(40));
        assert_eq!(Record::size_of(JR_COUNTERS), Some(56));
        assert_eq!(Record::size_of(0), None);
        assert_eq!(Record::size_of(5), None);
        // A REFCOUNT with a high half, an unknown type, COUNTERS with an
        // index: malformed.
        let mut hi = r.clone();
        hi[12] = 1;
        assert!(Record::decode(&hi).unwrap_err().contains("above 32 bits"));
        let mut unknown = r.clone();
        unknown[7] = 9;
        assert!(Record::decode(&unknown)
            .unwrap_err()
            .contains("unknown record type 9"));
        let mut c = sample_records()[4].encode();
        c[0] = 1;
        assert!(Record::decode(&c)
            .unwrap_err()
            .contains("counters record with index 1"));
        // Bounds: index beyond its array, a map value beyond the data.
        let f = |r: Record| r.fault(100, 10);
        assert_eq!(f(Record::Map { lba: 99, value: 10 }), None);
        assert!(f(Record::Map { lba: 100, value: 1 })
            .unwrap()
            .contains("logical size"));
        assert!(f(Record::Map { lba: 1, value: 11 })
            .unwrap()
            .contains("physical block 10"));
        assert!(f(Record::Refcount { pba: 10, count: 1 })
            .unwrap()
            .contains("refcount record"));
        assert!(f(Record::Fingerprint {
            pba: 10,
            fp: [1; FP_SIZE]
        })
        .unwrap()
        .contains("fingerprint record"));
        assert_eq!(f(sample_records()[4]), None);
    }

    #[test]
    fn journal_block_layout() {
        let recs = sample_records();
        let jb = JournalBlock::new(77, 9, 0xabcd, 5, 6, &recs, true);
        let b = jb.encode();
        assert!(csum_ok(&b));
        assert_eq!(&b[4..8], b"JRNL");
        assert_eq!(le64(&b[..], 8), 77);
        assert_eq!(le64(&b[..], 16), 9);
        assert_eq!((b[24], b[25]), (0, 0));
        assert_eq!(le64(&b[..], 32), 0xabcd);
        assert_eq!(le64(&b[..], 40), 5);
        assert_eq!(le64(&b[..], 48), 6);
        assert_eq!(le32(&b[..], 56), 16 + 16 + 16 + 40 + 56);
        assert_eq!(le32(&b[..], 60), JF_END);
        assert_eq!(&b[64..80], &recs[0].encode()[..]);
        assert!(is_zero(&b[64 + 144..]));
        let back = JournalBlock::decode(&b);
        assert_eq!(back, {
            let mut j = jb.clone();
            j.header.csum = stored_csum(&b);
            j
        });
        assert_eq!(back.records(100, 10, false), Ok(recs.clone()));
        // Fits: 4032 bytes of whole records.
        let maps: Vec<Record> = (0..300).map(|i| Record::Map { lba: i, value: 1 }).collect();
        assert_eq!(JournalBlock::fits(&maps), 252);
        let fps: Vec<Record> = (0..300)
            .map(|i| Record::Fingerprint {
                pba: i,
                fp: [1; FP_SIZE],
            })
            .collect();
        assert_eq!(JournalBlock::fits(&fps), 100);
        // What makes a block's records malformed.
        let fault = |f: fn(&mut JournalBlock)| {
            let mut j = back.clone();
            f(&mut j);
            j.records(100, 10, false).unwrap_err()
        };
        assert!(fault(|j| j.used = 4040).why.contains("bad record length"));
        assert!(fault(|j| j.used = 20).why.contains("bad record length"));
        assert!(fault(|j| j.flags = 5).why.contains("unknown flags 0x4"));
        // UNFLUSHED: only under a superblock with UNFLUSHED_APPENDS.
        let e = fault(|j| j.flags = JF_END | JF_UNFLUSHED);
        assert!(e.why.contains("unknown flags 0x2 (UNFLUSHED"), "{e:?}");
        let mut unflushed = back.clone();
        unflushed.flags = JF_END | JF_UNFLUSHED;
        assert!(unflushed.is_unflushed() && unflushed.is_end());
        assert_eq!(unflushed.records(100, 10, true), Ok(recs.clone()));
        unflushed.flags |= 0x4;
        assert!(unflushed.records(100, 10, true).is_err());
        let e = fault(|j| j.used = 16 + 16 + 16 + 40);
        assert!(e.why.contains("does not end with its counters"), "{e:?}");
        let e = fault(|j| j.used = 8);
        assert!(e.why.contains("crossing"), "{e:?}");
        assert_eq!(e.offset, Some(0));
        let e = fault(|j| j.payload[16 + 7] = 0x55);
        assert_eq!(e.offset, Some(16));
        assert!(e.why.contains("unknown record type"));
        // Not END: no counters needed; no records at all is fine.
        let mut open = back.clone();
        open.flags = 0;
        open.used = 16;
        assert_eq!(open.records(100, 10, false), Ok(recs[..1].to_vec()));
        open.used = 0;
        assert_eq!(open.records(100, 10, false), Ok(vec![]));
        // An END block without records: its append has no counters.
        open.flags = JF_END;
        assert!(open.records(100, 10, false).is_err());
        // Index bounds of the device.
        let e = back.records(7, 10, false).unwrap_err();
        assert!(e.why.contains("beyond the logical size"));
        assert_eq!(e.offset, Some(0));
    }

    #[test]
    fn slot_choice_is_the_kernels() {
        let mk = |g: u64| {
            let mut s = Superblock::new_formatted(10, 1, 1, "sha256", 32, 0);
            s.header.txn = g;
            SlotState::Valid(Box::new(s))
        };
        assert_eq!(pick_superblock(&[SlotState::Zero, mk(1)]), Some(1));
        assert_eq!(pick_superblock(&[mk(4), mk(3)]), Some(0));
        assert_eq!(pick_superblock(&[mk(4), mk(5)]), Some(1));
        assert_eq!(pick_superblock(&[mk(4), mk(4)]), Some(0));
        assert_eq!(
            pick_superblock(&[SlotState::Bad("x".into()), SlotState::Zero]),
            None
        );
    }
}
