//! Writing metadata the way the kernel lays it out: superblocks
//! (dd_bm_write_super) and the three radix-tree arrays (dedup-array.c).
//! Shared by `format`, `restore` and the tests, which build images here and
//! then damage them.

use std::collections::BTreeMap;
use std::io;

use crate::device::BlockDev;
use crate::ondisk::*;

/// Allocates tree blocks upwards from a start block and writes them.
pub struct TreeWriter<'a> {
    dev: &'a mut dyn BlockDev,
    next: u64,
    limit: u64,
    txn: u64,
    /// Blocks that must not be written (true = in use), indexed by block
    /// number; beyond its end everything is free.
    reserved: &'a [bool],
    /// Tree blocks written so far.
    pub blocks: u64,
}

fn full(limit: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::StorageFull,
        format!("metadata device full: the trees need more than {limit} blocks"),
    )
}

impl<'a> TreeWriter<'a> {
    /// Blocks [first, limit) are free; every block gets transaction `txn`.
    pub fn new(dev: &'a mut dyn BlockDev, first: u64, limit: u64, txn: u64) -> TreeWriter<'a> {
        TreeWriter {
            dev,
            next: first,
            limit,
            txn,
            reserved: &[],
            blocks: 0,
        }
    }

    /// Skip the blocks marked true in `reserved`: they hold a committed
    /// state that must survive until the new superblock is written.
    pub fn reserving(mut self, reserved: &'a [bool]) -> TreeWriter<'a> {
        self.reserved = reserved;
        self
    }

    fn alloc(&mut self) -> io::Result<u64> {
        while self.reserved.get(self.next as usize) == Some(&true) {
            self.next += 1;
        }
        if self.next >= self.limit {
            return Err(full(self.limit));
        }
        self.next += 1;
        self.blocks += 1;
        Ok(self.next - 1)
    }

    fn put(&mut self, mut blk: Box<Block>) -> io::Result<()> {
        seal(&mut blk);
        let nr = le64(&blk[..], 8);
        self.dev.write_block(nr, &blk)
    }

    /// Write an array holding `entries` (ascending index, each
    /// `g.entry_size` bytes; absent indices read as zero) and return its
    /// root block (0 for no entries). Leaves go first, then each interior
    /// level, in index order.
    pub fn build<E: AsRef<[u8]>>(
        &mut self,
        g: &Geometry,
        entries: impl IntoIterator<Item = (u64, E)>,
    ) -> io::Result<u64> {
        let es = g.entry_size as usize;
        let per_leaf = g.per_leaf as u64;
        // (node index within its level, block number)
        let mut level_nodes: Vec<(u64, u64)> = Vec::new();
        let mut cur: Option<(u64, Box<Block>)> = None;
        let mut last: Option<u64> = None;
        for (index, e) in entries {
            let e = e.as_ref();
            if index >= g.nr_entries {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} index {index} beyond the array ({} entries)",
                        g.id.name(),
                        g.nr_entries
                    ),
                ));
            }
            if last.is_some_and(|l| index <= l) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} entries not in ascending order at {index}", g.id.name()),
                ));
            }
            last = Some(index);
            let leaf_nr = index / per_leaf;
            if cur.as_ref().is_some_and(|(l, _)| *l != leaf_nr) {
                let (l, blk) = cur.take().unwrap();
                level_nodes.push((l, le64(&blk[..], 8)));
                self.put(blk)?;
            }
            if cur.is_none() {
                let nr = self.alloc()?;
                cur = Some((leaf_nr, new_tree_block(nr, g.id, 0, self.txn)));
            }
            let (_, blk) = cur.as_mut().unwrap();
            let off = HEADER_SIZE + (index % per_leaf) as usize * es;
            blk[off..off + es].copy_from_slice(&e[..es]);
        }
        if let Some((l, blk)) = cur.take() {
            level_nodes.push((l, le64(&blk[..], 8)));
            self.put(blk)?;
        }
        if level_nodes.is_empty() {
            return Ok(0);
        }
        for level in 1..=g.height {
            let mut parents: Vec<(u64, u64)> = Vec::new();
            let mut node: Option<(u64, Box<Block>)> = None;
            for &(idx, child) in &level_nodes {
                let parent = idx / INTERIOR_FANOUT;
                if node.as_ref().is_some_and(|(p, _)| *p != parent) {
                    let (p, blk) = node.take().unwrap();
                    parents.push((p, le64(&blk[..], 8)));
                    self.put(blk)?;
                }
                if node.is_none() {
                    let nr = self.alloc()?;
                    node = Some((parent, new_tree_block(nr, g.id, level, self.txn)));
                }
                let (_, blk) = node.as_mut().unwrap();
                let off = HEADER_SIZE + (idx % INTERIOR_FANOUT) as usize * 8;
                blk[off..off + 8].copy_from_slice(&child.to_le_bytes());
            }
            let (p, blk) = node.take().unwrap();
            parents.push((p, le64(&blk[..], 8)));
            self.put(blk)?;
            level_nodes = parents;
        }
        debug_assert_eq!(level_nodes.len(), 1);
        Ok(level_nodes[0].1)
    }
}

/// Everything one committed state holds: the superblock (roots are filled
/// in by write_image) and the array contents.
#[derive(Clone, Debug)]
pub struct ImageSpec {
    pub sb: Superblock,
    /// (lba, pba), ascending lba; stored as pba + 1.
    pub mappings: Vec<(u64, u64)>,
    /// (pba, refcount), ascending pba.
    pub refcounts: Vec<(u64, u32)>,
    /// (pba, record), ascending pba.
    pub fingerprints: Vec<(u64, [u8; FP_SIZE])>,
}

impl ImageSpec {
    /// A consistent state: refcounts are derived from `mappings`, live
    /// blocks get `fp(pba)` as fingerprint, the counters match.
    pub fn consistent(
        mut sb: Superblock,
        mappings: &[(u64, u64)],
        fp: impl Fn(u64) -> [u8; FP_SIZE],
    ) -> ImageSpec {
        let mut rc: BTreeMap<u64, u32> = BTreeMap::new();
        for &(_, pba) in mappings {
            *rc.entry(pba).or_default() += 1;
        }
        let mut m = mappings.to_vec();
        m.sort_unstable();
        sb.mapped_blocks = m.len() as u64;
        sb.used_data_blocks = rc.len() as u64;
        ImageSpec {
            sb,
            mappings: m,
            fingerprints: rc.keys().map(|&p| (p, fp(p))).collect(),
            refcounts: rc.into_iter().collect(),
        }
    }
}

/// A fingerprint record for tests: deterministic, never all zero.
pub fn test_fingerprint(pba: u64) -> [u8; FP_SIZE] {
    let mut f = [0u8; FP_SIZE];
    let mut x = pba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    for chunk in f.chunks_mut(8) {
        x ^= x >> 29;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    f[0] |= 1;
    f
}

/// Refuse to write a superblock the kernel would refuse for its generation:
/// 0 (never committed) or above MAX_TXN (dd_check_sb). Checked before
/// anything is written.
fn writable_generation(sb: &Superblock) -> io::Result<()> {
    let g = sb.generation();
    if g == 0 || g > MAX_TXN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("refusing to write a superblock of generation {g}: it must be 1..={MAX_TXN}"),
        ));
    }
    Ok(())
}

/// Block numbers of what write_image wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    pub map_root: u64,
    pub refcount_root: u64,
    pub fingerprint_root: u64,
    /// Tree blocks written; write_image puts them at [2, 2 + tree_blocks).
    pub tree_blocks: u64,
}

/// Write a whole committed state: both superblock slots are zeroed first,
/// then the trees (from block 2 up, transaction = the generation), then
/// the superblock in the slot its generation selects. Flushes between
/// steps, so a crash leaves either the complete state or no valid
/// superblock at all.
pub fn write_image(dev: &mut dyn BlockDev, spec: &ImageSpec) -> io::Result<(Superblock, Layout)> {
    writable_generation(&spec.sb)?;
    let zero = zero_block();
    for slot in 0..SB_SLOTS {
        dev.write_block(slot, &zero)?;
    }
    dev.flush()?;
    write_trees_and_super(dev, spec, &[])
}

/// Write a whole committed state next to the one on the device, as a
/// kernel commit does: the trees go to blocks not marked in `in_use` (the
/// committed state's blocks), then, after a flush, the superblock goes to
/// the slot its generation selects, which must not be the slot of the
/// committed state. Until that last write the device still opens in its
/// old state; after it, in the new one.
pub fn write_image_beside(
    dev: &mut dyn BlockDev,
    spec: &ImageSpec,
    in_use: &[bool],
) -> io::Result<(Superblock, Layout)> {
    writable_generation(&spec.sb)?;
    write_trees_and_super(dev, spec, in_use)
}

fn write_trees_and_super(
    dev: &mut dyn BlockDev,
    spec: &ImageSpec,
    in_use: &[bool],
) -> io::Result<(Superblock, Layout)> {
    // A new state: whatever save the superblock named describes another.
    let mut sb = spec.sb.clone().without_save();
    let gen = sb.generation();
    let mut layout = Layout::default();
    {
        let mut w =
            TreeWriter::new(dev, FIRST_TREE_BLOCK, sb.metadata_blocks, gen).reserving(in_use);
        layout.map_root = w.build(
            &sb.geometry(ArrayId::Map),
            spec.mappings
                .iter()
                .map(|&(lba, pba)| (lba, (pba + 1).to_le_bytes())),
        )?;
        layout.refcount_root = w.build(
            &sb.geometry(ArrayId::Refcount),
            spec.refcounts
                .iter()
                .map(|&(pba, rc)| (pba, rc.to_le_bytes())),
        )?;
        layout.fingerprint_root = w.build(
            &sb.geometry(ArrayId::Fingerprint),
            spec.fingerprints.iter().map(|(pba, fp)| (*pba, fp)),
        )?;
        layout.tree_blocks = w.blocks;
    }
    dev.flush()?;
    sb.map_root = layout.map_root;
    sb.refcount_root = layout.refcount_root;
    sb.fingerprint_root = layout.fingerprint_root;
    let blk = sb.encode();
    dev.write_block(sb.slot(), &blk)?;
    dev.flush()?;
    Ok((Superblock::decode(&blk), layout))
}

/// `check --clear-needs-check`: the committed state `current` once more,
/// without the needs_check flag, as the next generation, in the other
/// slot, so that a torn write leaves the flagged superblock in force. A
/// save the current superblock named is dropped: it describes that
/// superblock only (the kernel flags without one anyway).
pub fn clear_needs_check(dev: &mut dyn BlockDev, current: &Superblock) -> io::Result<Superblock> {
    let mut sb = current.clone().without_save();
    sb.flags &= !SB_NEEDS_CHECK;
    sb.header.txn = current.generation().wrapping_add(1);
    writable_generation(&sb)?;
    let blk = sb.encode();
    dev.write_block(sb.slot(), &blk)?;
    dev.flush()?;
    Ok(Superblock::decode(&blk))
}

/// What `dedup format` (and the kernel's dd_format) writes: generation 1
/// in slot 1, empty arrays; slot 0 zeroed.
pub fn format(
    dev: &mut dyn BlockDev,
    data_blocks: u64,
    logical_blocks: u64,
    hash: &str,
    fp_size: u32,
    format_time: u64,
) -> io::Result<Superblock> {
    let sb = Superblock::new_formatted(
        dev.nr_blocks(),
        data_blocks,
        logical_blocks,
        hash,
        fp_size,
        format_time,
    );
    writable_generation(&sb)?;
    let zero = zero_block();
    for slot in 0..SB_SLOTS {
        if slot != sb.slot() {
            dev.write_block(slot, &zero)?;
        }
    }
    dev.flush()?;
    let blk = sb.encode();
    dev.write_block(sb.slot(), &blk)?;
    dev.flush()?;
    Ok(Superblock::decode(&blk))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDev;

    #[test]
    fn no_superblock_above_the_limit_is_written() {
        let sb = Superblock::new_formatted(64, 10, 20, "sha256", 32, 0);
        let mut spec = ImageSpec::consistent(sb, &[(1, 2)], test_fingerprint);
        for g in [MAX_TXN + 1, u64::MAX, 0] {
            spec.sb.header.txn = g;
            let mut d = MemDev::new(64);
            d.block_mut(1).fill(0xAA);
            let e = write_image(&mut d, &spec).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
            assert!(e.to_string().contains(&format!("generation {g}")), "{e}");
            let e = write_image_beside(&mut d, &spec, &[]).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
            // Refused before anything was written.
            assert!(d.block(1).iter().all(|&b| b == 0xAA));
            assert!(d.bytes[2 * BLOCK_SIZE..].iter().all(|&b| b == 0));
        }
        spec.sb.header.txn = MAX_TXN;
        let mut d = MemDev::new(64);
        let (sb, _) = write_image(&mut d, &spec).unwrap();
        assert_eq!((sb.generation(), sb.slot()), (MAX_TXN, 1));
    }

    #[test]
    fn format_writes_slot_one_only() {
        let mut d = MemDev::new(64);
        d.block_mut(0).fill(0xAA);
        let sb = format(&mut d, 10, 20, "sha256", 32, 1234).unwrap();
        assert!(is_zero(d.block(0)));
        assert_eq!(sb.generation(), 1);
        assert_eq!(sb.header.blocknr, 1);
        assert_eq!(sb.metadata_blocks, 64);
        assert!(matches!(classify_slot(1, d.block(1)), SlotState::Valid(_)));
        assert!(d.bytes[2 * BLOCK_SIZE..].iter().all(|&b| b == 0));
    }

    #[test]
    fn tree_shape_two_levels() {
        // 509 leaves of the map need one interior level... with 2 leaves
        // present the root is an interior node with children 0 and 508.
        let g = Geometry::new(ArrayId::Map, 508 * 509);
        assert_eq!(g.height, 2);
        let mut d = MemDev::new(16);
        let root = {
            let mut w = TreeWriter::new(&mut d, 2, 16, 7);
            let r = w
                .build(
                    &g,
                    [
                        (5u64, 11u64.to_le_bytes()),
                        (508 * 508, 12u64.to_le_bytes()),
                    ],
                )
                .unwrap();
            assert_eq!(w.blocks, 5);
            r
        };
        // leaves 2, 3; level-1 nodes 4 (index 0), 5 (index 1); root 6.
        assert_eq!(root, 6);
        let rb = d.block(6);
        assert!(csum_ok(rb));
        let h = Header::decode(&rb[..]);
        assert_eq!((h.btype, h.level, h.array, h.txn), (BT_INTERIOR, 2, 1, 7));
        assert_eq!(le64(&rb[..], HEADER_SIZE), 4);
        assert_eq!(le64(&rb[..], HEADER_SIZE + 8), 5);
        assert_eq!(le64(&d.block(4)[..], HEADER_SIZE), 2);
        assert_eq!(le64(&d.block(5)[..], HEADER_SIZE), 3);
        assert_eq!(le64(&d.block(2)[..], HEADER_SIZE + 5 * 8), 11);
        assert_eq!(le64(&d.block(3)[..], HEADER_SIZE), 12);
    }

    #[test]
    fn tree_too_big_fails_cleanly() {
        let g = Geometry::new(ArrayId::Map, 100_000);
        let mut d = MemDev::new(4);
        let mut w = TreeWriter::new(&mut d, 2, 4, 1);
        let e = w
            .build(
                &g,
                (0..100_000u64)
                    .step_by(508)
                    .map(|i| (i, 1u64.to_le_bytes())),
            )
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
    }
}
