//! The on-disk format of the dm-dedup metadata device, as implemented by
//! dm-dedup/dedup-format.h, dedup-block.c, dedup-array.c and
//! dedup-metadata.c.
//!
//! Everything is little-endian. The device is an array of 4 KiB blocks:
//! blocks 0 and 1 are the two superblock slots, every other block is free or
//! belongs to one of three radix trees (the map, the refcounts and the
//! fingerprints), or to the state saved at a clean close (a fourth array,
//! named by the superblock that closed). Every block starts with a 32-byte header and is protected
//! by a CRC-32C of its bytes 4..4095.

use crate::crc32c::crc32c;

pub const BLOCK_SIZE: usize = 4096;
pub const BLOCK_SHIFT: u32 = 12;
pub const SB_MAGIC: u64 = 0x3130_5055_4445_4444; // "DDEDUP01"
pub const FORMAT_VERSION: u32 = 1;
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
/// Every flag the format defines; the kernel refuses any other bit.
pub const SB_KNOWN_FLAGS: u32 = SB_NEEDS_CHECK;

pub const BT_SUPER: u32 = 0x5250_5553; // "SUPR"
pub const BT_INTERIOR: u32 = 0x5254_4e49; // "INTR"
pub const BT_LEAF: u32 = 0x4641_454c; // "LEAF"

pub const FP_SIZE: usize = 32;
pub const HASH_NAME_LEN: usize = 32;
pub const HEADER_SIZE: usize = 32;
pub const PAYLOAD_SIZE: usize = BLOCK_SIZE - HEADER_SIZE;
pub const INTERIOR_FANOUT: u64 = (PAYLOAD_SIZE / 8) as u64; // 508
/// Size of `struct dd_superblock` (header included).
pub const SUPERBLOCK_SIZE: usize = 208;

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
    /// entries in the slots, head[4] the inserts that found no room so far
    /// (the stats counter index_full), head[5] the activations that loaded
    /// the index since one walked; the words are the slots of dedup-index.c.
    pub const INDEX_LAYOUT: u64 = 0x3158_4449; // "IDX1"
    pub const HEAD_LAYOUT: usize = 0;
    pub const HEAD_ENTRIES: usize = 3;
    pub const HEAD_FULL: usize = 4;
    /// Slot bits 0-39: PBA + 1, 0 = empty (40-47 probe distance, 48-63 tag).
    pub const SLOT_PBA_BITS: u32 = 40;

    /// The PBA a non-empty index slot names (None: its PBA bits are zero).
    pub fn slot_pba(slot: u64) -> Option<u64> {
        (slot & ((1 << SLOT_PBA_BITS) - 1)).checked_sub(1)
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

/// dd_md_required_blocks(): the smallest metadata device (in 4 KiB blocks)
/// the kernel accepts for these sizes. Twice the full trees, because the
/// running transaction may shadow every committed block, plus the two
/// superblock slots.
pub fn required_blocks(logical_blocks: u64, data_blocks: u64) -> u64 {
    let trees = array_max_blocks(8, logical_blocks)
        .saturating_add(array_max_blocks(4, data_blocks))
        .saturating_add(array_max_blocks(FP_SIZE as u32, data_blocks));
    SB_SLOTS.saturating_add(trees.saturating_mul(2))
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
}

impl Superblock {
    /// What dd_format() fills in before its first commit.
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
        assert_eq!(&saved::INDEX_LAYOUT.to_le_bytes()[..4], b"IDX1");
        assert_eq!(ArrayId::from_u8(4), Some(ArrayId::Saved));
        assert_eq!(saved::slot_pba(0), None);
        assert_eq!(saved::slot_pba((7 << 48) | (3 << 40) | 11), Some(10));
        let l = saved::Layout::new(130, 64, 5).unwrap();
        assert_eq!((l.meta_words, l.data_words), (3, 1));
        assert_eq!((l.data_start, l.target_start, l.total), (19, 20, 25));
        assert_eq!(saved::Layout::new(u64::MAX, u64::MAX, u64::MAX), None);
        assert_eq!(per_leaf(8), 508);
        assert_eq!(per_leaf(4), 1016);
        assert_eq!(per_leaf(32), 127);
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
        assert_eq!(required_blocks(l, d), 2 + 2 * (2071 + 260 + 2071));
        // The interface draft: 64 MiB of metadata covers this.
        assert!(required_blocks(l, d) * 4096 <= 64 << 20);
        assert_eq!(required_blocks(0, 0), 2);
        assert_eq!(required_blocks(1, 1), 2 + 2 * 3);
    }

    #[test]
    fn superblock_layout() {
        let sb = Superblock::new_formatted(100, 200, 300, "sha256", 32, 0x1122334455667788);
        let b = sb.encode();
        assert_eq!(le32(&b[..], 4), BT_SUPER);
        assert_eq!(le64(&b[..], 8), 1); // blocknr = slot 1
        assert_eq!(le64(&b[..], 16), 1); // txn
        assert_eq!(&b[32..40], b"DDEDUP01");
        assert_eq!(le32(&b[..], 40), 1);
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
