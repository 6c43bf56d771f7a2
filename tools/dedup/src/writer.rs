//! Writing metadata the way the kernel lays it out: superblocks
//! (dd_bm_write_super), the three radix-tree arrays (dedup-array.c) and, in
//! format version 2, the journal's run and its blocks (dedup-journal.c).
//! Shared by `format`, `restore`, `repair` and the tests, which build
//! images here and then damage them.

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

    /// The block the next allocation starts from: every block below it
    /// is reserved or was written.
    pub fn next_free(&self) -> u64 {
        self.next
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

impl ImageSpec {
    /// The journal records that take this state to `to` (same sizes), in
    /// the order a kernel would note them: the map entries that change,
    /// the refcounts that change, the fingerprints of blocks that become
    /// live or change, then the counters of `to`. Records hold values, so
    /// any order of the entries gives the same state.
    pub fn changes_to(&self, to: &ImageSpec) -> Vec<Record> {
        fn diff<V: Copy + PartialEq>(
            a: &[(u64, V)],
            b: &[(u64, V)],
            zero: V,
            mut put: impl FnMut(u64, V),
        ) {
            let a: BTreeMap<u64, V> = a.iter().copied().collect();
            let b: BTreeMap<u64, V> = b.iter().copied().collect();
            for (&k, &v) in &b {
                if a.get(&k) != Some(&v) {
                    put(k, v);
                }
            }
            for &k in a.keys() {
                if !b.contains_key(&k) {
                    put(k, zero);
                }
            }
        }
        let mut v = Vec::new();
        let map = |m: &[(u64, u64)]| m.iter().map(|&(l, p)| (l, p + 1)).collect::<Vec<_>>();
        diff(&map(&self.mappings), &map(&to.mappings), 0, |lba, value| {
            v.push(Record::Map { lba, value })
        });
        diff(&self.refcounts, &to.refcounts, 0, |pba, count| {
            v.push(Record::Refcount { pba, count })
        });
        let live: BTreeMap<u64, u32> = to.refcounts.iter().copied().collect();
        diff(
            &self.fingerprints,
            &to.fingerprints,
            [0; FP_SIZE],
            |pba, fp| {
                // A block freed keeps its record, as the kernel leaves it.
                if live.contains_key(&pba) {
                    v.push(Record::Fingerprint { pba, fp })
                }
            },
        );
        v.push(Record::Counters(Counters::of(&to.sb)));
        v
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
    /// The journal's run (version 2; 0 and 0 in version 1). A run the
    /// writer makes follows the trees.
    pub journal_start: u64,
    pub journal_blocks: u64,
}

/// A journal id as the kernel draws one (get_random_u64() | 1): random,
/// never 0.
pub fn fresh_journal_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is keyed from the OS's random source; the time and the
    // process make two ids drawn in one process differ too.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(t);
    h.write_u32(std::process::id());
    h.finish() | 1
}

/// dd_space_alloc_exact(): the first run of `n` blocks in [from, limit)
/// none of which is marked in `reserved`.
pub fn journal_window(reserved: &[bool], from: u64, limit: u64, n: u64) -> Option<u64> {
    let mut start = from.max(FIRST_TREE_BLOCK);
    let mut b = start;
    while b < limit {
        if reserved.get(b as usize) == Some(&true) {
            start = b + 1;
        } else if b + 1 - start == n {
            return Some(start);
        }
        b += 1;
    }
    None
}

/// How many tree blocks TreeWriter::build writes for entries at these
/// ascending indices of an array shaped `g`: the leaves holding them and
/// the interior nodes above those leaves.
pub fn tree_block_count(g: &Geometry, indices: impl IntoIterator<Item = u64>) -> u64 {
    let mut nodes: Vec<u64> = Vec::new();
    for i in indices {
        let leaf = i / g.per_leaf as u64;
        if nodes.last() != Some(&leaf) {
            nodes.push(leaf);
        }
    }
    if nodes.is_empty() {
        return 0;
    }
    let mut total = nodes.len() as u64;
    for _ in 0..g.height {
        nodes = nodes.iter().map(|n| n / INTERIOR_FANOUT).collect();
        nodes.dedup();
        total += nodes.len() as u64;
    }
    total
}

/// The tree blocks TreeWriter writes for `spec`.
pub fn spec_tree_blocks(spec: &ImageSpec) -> u64 {
    tree_block_count(
        &spec.sb.geometry(ArrayId::Map),
        spec.mappings.iter().map(|m| m.0),
    ) + tree_block_count(
        &spec.sb.geometry(ArrayId::Refcount),
        spec.refcounts.iter().map(|r| r.0),
    ) + tree_block_count(
        &spec.sb.geometry(ArrayId::Fingerprint),
        spec.fingerprints.iter().map(|f| f.0),
    )
}

/// Where the run a version 2 `spec` asks the writer to make would go, and
/// how long it would be (see `new_run`): after the trees (None: the device
/// has no room for one). Repair asks before it plans a version 2 state.
pub fn planned_journal_run(spec: &ImageSpec, in_use: &[bool]) -> Option<(u64, u64)> {
    let mut b = FIRST_TREE_BLOCK;
    let mut left = spec_tree_blocks(spec);
    while left > 0 {
        if in_use.get(b as usize) != Some(&true) {
            left -= 1;
        }
        b += 1;
    }
    new_run(&spec.sb, in_use, b)
}

/// dd_journal_make(): a new run for the journal of `sb`: the length its
/// sizes ask for (journal_size, whatever room the device has beyond it),
/// halved until it leaves the trees their room and a window of blocks from
/// `from` free of `reserved` holds it, at least JOURNAL_MAKE_MIN. (start,
/// length).
pub fn new_run(sb: &Superblock, reserved: &[bool], from: u64) -> Option<(u64, u64)> {
    let (m, l, d) = (sb.metadata_blocks, sb.logical_blocks, sb.data_blocks);
    let room = m.checked_sub(open_blocks(l, d))?;
    let mut len = journal_blocks_for(m, l, d)?.min(room);
    while len >= JOURNAL_MAKE_MIN {
        if let Some(start) = journal_window(reserved, from, m, len) {
            return Some((start, len));
        }
        len /= 2;
    }
    None
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// The journal fields of a version 2 superblock about to be written: a run
/// it names is checked and reserved in `reserved`; with journal_blocks 0
/// a run is to be made (see `make_run`), with a fresh id if journal_id is
/// 0 and epoch 1 if journal_seq is 0. Version 1: the fields must be 0.
/// Returns whether a run is to be made and whether its id was drawn.
fn prepare_journal(sb: &mut Superblock, reserved: &mut Vec<bool>) -> io::Result<(bool, bool)> {
    if sb.version != FORMAT_VERSION {
        return match sb.journal_fault() {
            Some(why) => Err(invalid(format!("refusing to write the superblock: {why}"))),
            None => Ok((false, false)),
        };
    }
    if sb.journal_blocks == 0 {
        let drawn = sb.journal_id == 0;
        if drawn {
            sb.journal_id = fresh_journal_id();
        }
        if sb.journal_seq == 0 {
            sb.journal_seq = 1;
        }
        return Ok((true, drawn));
    }
    if let Some(why) = sb.journal_fault() {
        return Err(invalid(format!("refusing to write the superblock: {why}")));
    }
    let run = sb.journal_start..sb.journal_start + sb.journal_blocks;
    if reserved.len() < run.end as usize {
        reserved.resize(run.end as usize, false);
    }
    for b in run {
        reserved[b as usize] = true;
    }
    Ok((false, false))
}

/// Make the run `prepare_journal` asked for (see `new_run`).
fn make_run(sb: &mut Superblock, reserved: &[bool], from: u64) -> io::Result<()> {
    let (start, len) = new_run(sb, reserved, from).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::StorageFull,
            format!(
                "metadata device full: no room for a journal beside the trees' worst case (the \
                 {} blocks these sizes ask for, or a half of that down to {JOURNAL_MAKE_MIN}; {} \
                 blocks needed for these sizes, the device has {})",
                journal_size(sb.logical_blocks, sb.data_blocks),
                required_blocks(sb.logical_blocks, sb.data_blocks),
                sb.metadata_blocks
            ),
        )
    })?;
    sb.journal_start = start;
    sb.journal_blocks = len;
    Ok(())
}

/// The epoch of a superblock the writer writes follows an empty journal:
/// the block at the epoch must not continue it. It could only if an
/// earlier state used this id and epoch: then the epoch moves on by two
/// rings (as a kernel activation does), or a drawn id is drawn again.
fn settle_epoch(dev: &dyn BlockDev, sb: &mut Superblock, drawn: bool) -> io::Result<()> {
    if sb.journal_run().is_none() {
        return Ok(());
    }
    let mut blk = zero_block();
    for _ in 0..64 {
        let at = sb.journal_block(sb.journal_seq);
        dev.read_block(at, &mut blk)?;
        if crate::journal::not_continuing(sb, &blk, sb.journal_seq).is_some() {
            return Ok(());
        }
        match sb.journal_seq.checked_add(2 * sb.journal_blocks) {
            Some(s) if !drawn => sb.journal_seq = s,
            _ => {
                sb.journal_id = fresh_journal_id();
                sb.journal_seq = 1;
            }
        }
    }
    Err(io::Error::other(
        "cannot find an epoch that no journal block continues",
    ))
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
    // Its journal is empty (the epoch is settled past every block that
    // could continue it), so no append of it can be unflushed; the kernel
    // sets the bit again in the superblocks it writes.
    sb.flags &= !SB_UNFLUSHED_APPENDS;
    let gen = sb.generation();
    let mut layout = Layout::default();
    let mut reserved = in_use.to_vec();
    let (new_run, drawn) = prepare_journal(&mut sb, &mut reserved)?;
    {
        let mut w =
            TreeWriter::new(dev, FIRST_TREE_BLOCK, sb.metadata_blocks, gen).reserving(&reserved);
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
        if new_run {
            // After the trees, as the kernel's first-fit would find it.
            let from = w.next_free();
            make_run(&mut sb, &reserved, from)?;
        }
    }
    settle_epoch(dev, &mut sb, drawn)?;
    layout.journal_start = sb.journal_start;
    layout.journal_blocks = sb.journal_blocks;
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
/// superblock only (the kernel flags without one anyway). UNFLUSHED_APPENDS
/// is kept: the journal after the state is the same, and its newest
/// append may still be unflushed.
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
/// in slot 1, empty arrays, a journal at block 2 as long as the sizes ask
/// for (journal_size) with a fresh id and epoch 1; slot 0 zeroed. Refused
/// (StorageFull) on a device smaller than required_blocks, as the kernel
/// refuses to format it.
pub fn format(
    dev: &mut dyn BlockDev,
    data_blocks: u64,
    logical_blocks: u64,
    hash: &str,
    fp_size: u32,
    format_time: u64,
) -> io::Result<Superblock> {
    format_as(
        dev,
        data_blocks,
        logical_blocks,
        hash,
        fp_size,
        format_time,
        FORMAT_VERSION,
        None,
    )
}

/// `format` in a given format version (1: no journal, what the kernel
/// wrote before version 2), with a given journal id (None: a fresh one).
#[allow(clippy::too_many_arguments)]
pub fn format_as(
    dev: &mut dyn BlockDev,
    data_blocks: u64,
    logical_blocks: u64,
    hash: &str,
    fp_size: u32,
    format_time: u64,
    version: u32,
    journal_id: Option<u64>,
) -> io::Result<Superblock> {
    let mut sb = Superblock::new_formatted(
        dev.nr_blocks(),
        data_blocks,
        logical_blocks,
        hash,
        fp_size,
        format_time,
    );
    sb.version = version;
    sb.journal_id = journal_id.unwrap_or(0);
    if version != FORMAT_VERSION && version != FORMAT_VERSION_V1 {
        return Err(invalid(format!("format version {version} is not 1 or 2")));
    }
    if version == FORMAT_VERSION_V1 && journal_id.is_some() {
        return Err(invalid("format version 1 has no journal id".into()));
    }
    writable_generation(&sb)?;
    // dd_md_open() formats no device smaller than dd_md_required_blocks():
    // the trees' worst case and the whole run the sizes ask for.
    let need = required_blocks(logical_blocks, data_blocks);
    if version == FORMAT_VERSION && sb.metadata_blocks < need {
        return Err(io::Error::new(
            io::ErrorKind::StorageFull,
            format!(
                "metadata device full: {need} blocks needed for these sizes (the trees' worst \
                 case and a journal of {} blocks), the device has {}",
                journal_size(logical_blocks, data_blocks),
                sb.metadata_blocks
            ),
        ));
    }
    let mut reserved = Vec::new();
    let (new_run, drawn) = prepare_journal(&mut sb, &mut reserved)?;
    if new_run {
        make_run(&mut sb, &reserved, FIRST_TREE_BLOCK)?;
    }
    settle_epoch(dev, &mut sb, drawn)?;
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

/// The blocks of one append of `records` to the journal of `sb`, from
/// sequence `seq`, as dd_journal_take() packs them: as many whole records
/// per block as fit, END on the last block. Written by transaction `txn`
/// (informational). No records: one END block without any (malformed).
pub fn append_blocks(sb: &Superblock, seq: u64, txn: u64, records: &[Record]) -> Vec<JournalBlock> {
    let mut out = Vec::new();
    let mut rest = records;
    let mut s = seq;
    loop {
        let n = JournalBlock::fits(rest);
        let end = n == rest.len();
        out.push(JournalBlock::new(
            sb.journal_block(s),
            txn,
            sb.journal_id,
            sb.journal_seq,
            s,
            &rest[..n],
            end,
        ));
        if end {
            return out;
        }
        rest = &rest[n..];
        s = s.wrapping_add(1);
    }
}

/// Append `records` to the journal of `sb` at sequence `seq` (see
/// append_blocks) and flush, as a kernel flush does; the next sequence.
/// The superblock must have a sound journal run.
pub fn write_append(
    dev: &mut dyn BlockDev,
    sb: &Superblock,
    seq: u64,
    txn: u64,
    records: &[Record],
) -> io::Result<u64> {
    if let Some(why) = sb.journal_fault() {
        return Err(invalid(why));
    }
    if sb.journal_run().is_none() {
        return Err(invalid("format version 1 has no journal".into()));
    }
    let blocks = append_blocks(sb, seq, txn, records);
    let n = blocks.len() as u64;
    for b in blocks {
        dev.write_block(b.header.blocknr, &b.encode())?;
    }
    dev.flush()?;
    Ok(seq.wrapping_add(n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDev;

    /// Enough for the trees of these tests and a journal.
    const BLOCKS: u64 = 64 + JOURNAL_BLOCKS;

    #[test]
    fn no_superblock_above_the_limit_is_written() {
        let sb = Superblock::new_formatted(BLOCKS, 10, 20, "sha256", 32, 0);
        let mut spec = ImageSpec::consistent(sb, &[(1, 2)], test_fingerprint);
        for g in [MAX_TXN + 1, u64::MAX, 0] {
            spec.sb.header.txn = g;
            let mut d = MemDev::new(BLOCKS);
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
        let mut d = MemDev::new(BLOCKS);
        let (sb, _) = write_image(&mut d, &spec).unwrap();
        assert_eq!((sb.generation(), sb.slot()), (MAX_TXN, 1));
    }

    /// Restore and repair write their state with an empty journal: never
    /// with UNFLUSHED_APPENDS; other flags as the spec has them.
    #[test]
    fn a_written_state_has_unflushed_appends_clear() {
        let mut sb = Superblock::new_formatted(BLOCKS, 10, 20, "sha256", 32, 0);
        sb.header.txn = 3;
        sb.flags = SB_NEEDS_CHECK | SB_UNFLUSHED_APPENDS;
        let spec = ImageSpec::consistent(sb, &[(1, 2)], test_fingerprint);
        let mut d = MemDev::new(BLOCKS);
        let (sb, _) = write_image(&mut d, &spec).unwrap();
        assert_eq!(sb.flags, SB_NEEDS_CHECK);
        assert_eq!(Superblock::decode(d.block(sb.slot())).flags, SB_NEEDS_CHECK);
        let sb = format(&mut d, 10, 20, "sha256", 32, 1234).unwrap();
        assert_eq!(sb.flags, 0);
    }

    #[test]
    fn format_writes_slot_one_only() {
        let mut d = MemDev::new(BLOCKS);
        d.block_mut(0).fill(0xAA);
        let sb = format(&mut d, 10, 20, "sha256", 32, 1234).unwrap();
        assert!(is_zero(d.block(0)));
        assert_eq!(sb.generation(), 1);
        assert_eq!(sb.header.blocknr, 1);
        assert_eq!(sb.metadata_blocks, BLOCKS);
        // Version 2 with an empty journal at block 2, as dd_format(): as
        // long as the sizes ask for, however much room the device has.
        assert_eq!(sb.version, FORMAT_VERSION);
        assert!(BLOCKS > required_blocks(20, 10) + JOURNAL_MAKE_MIN);
        assert_eq!(journal_size(20, 10), JOURNAL_MAKE_MIN);
        assert_eq!((sb.journal_start, sb.journal_blocks), (2, JOURNAL_MAKE_MIN));
        assert_eq!(sb.journal_seq, 1);
        assert_ne!(sb.journal_id, 0);
        assert_eq!(sb.journal_id & 1, 1);
        assert!(matches!(classify_slot(1, d.block(1)), SlotState::Valid(_)));
        assert!(d.bytes[2 * BLOCK_SIZE..].iter().all(|&b| b == 0));
        // Two formats draw two ids.
        let again = format(&mut d, 10, 20, "sha256", 32, 1234).unwrap();
        assert_ne!(again.journal_id, sb.journal_id);
    }

    #[test]
    fn format_version_1_has_no_journal() {
        let mut d = MemDev::new(BLOCKS);
        let sb = format_as(&mut d, 10, 20, "sha256", 32, 5, FORMAT_VERSION_V1, None).unwrap();
        assert_eq!(sb.version, 1);
        assert_eq!(
            (
                sb.journal_start,
                sb.journal_blocks,
                sb.journal_seq,
                sb.journal_id
            ),
            (0, 0, 0, 0)
        );
        assert_eq!(le32(&d.block(1)[..], 40), 1);
        assert!(is_zero(&d.block(1)[184 + 8..]));
        // The same bytes as version 2 but for the version, the journal
        // fields and the checksum.
        let mut d2 = MemDev::new(BLOCKS);
        format_as(&mut d2, 10, 20, "sha256", 32, 5, FORMAT_VERSION, Some(77)).unwrap();
        let (a, b) = (d.block(1), d2.block(1));
        assert_eq!(&a[4..40], &b[4..40]);
        assert_eq!(&a[44..208], &b[44..208]);
        assert_eq!(le64(&b[..], 232), 77);
        // Refused: another version, an id without a journal, no room.
        assert!(format_as(&mut d, 10, 20, "sha256", 32, 5, 3, None).is_err());
        assert!(format_as(&mut d, 10, 20, "sha256", 32, 5, 1, Some(3)).is_err());
        let mut small = MemDev::new(60);
        let e = format(&mut small, 10, 20, "sha256", 32, 5).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        assert!(is_zero(small.block(1)), "nothing written");
        format_as(&mut small, 10, 20, "sha256", 32, 5, 1, None).unwrap();
    }

    #[test]
    fn the_journal_follows_the_trees_and_its_epoch_is_empty() {
        let sb = Superblock::new_formatted(BLOCKS, 10, 2000, "sha256", 32, 0);
        let maps: Vec<(u64, u64)> = (0..1000).map(|i| (i, i % 10)).collect();
        let spec = ImageSpec::consistent(sb, &maps, test_fingerprint);
        // Map: 2 leaves and a root; refcounts and fingerprints: a leaf each.
        assert_eq!(spec_tree_blocks(&spec), 2 + 1 + 1 + 1);
        let mut d = MemDev::new(BLOCKS);
        let (sb, l) = write_image(&mut d, &spec).unwrap();
        assert_eq!(l.tree_blocks, 5);
        let len = journal_size(2000, 10);
        assert_eq!(len, JOURNAL_MAKE_MIN);
        assert_eq!((l.journal_start, l.journal_blocks), (7, len));
        assert_eq!((sb.journal_start, sb.journal_seq), (7, 1));
        assert_eq!(planned_journal_run(&spec, &[]), Some((7, len)));
        // Reserved blocks are skipped by the trees and the run alike.
        let mut in_use = vec![false; 20];
        in_use[3] = true;
        in_use[12] = true;
        assert_eq!(planned_journal_run(&spec, &in_use), Some((13, len)));
        let mut d2 = MemDev::new(BLOCKS);
        let (_, l2) = write_image_beside(&mut d2, &spec, &in_use).unwrap();
        assert_eq!(l2.journal_start, 13);
        // A run the spec names is kept, and the trees go around it.
        let mut named = spec.clone();
        named.sb.journal_start = 3;
        named.sb.journal_blocks = 16;
        named.sb.journal_seq = 40;
        named.sb.journal_id = 5;
        let mut d3 = MemDev::new(BLOCKS);
        let (sb3, l3) = write_image(&mut d3, &named).unwrap();
        assert_eq!((sb3.journal_start, sb3.journal_blocks), (3, 16));
        assert_eq!((sb3.journal_seq, sb3.journal_id), (40, 5));
        assert_eq!((l3.map_root > 18, l3.tree_blocks), (true, 5));
        // An epoch some block already continues moves two rings on.
        let blk = append_blocks(&sb3, 40, 9, &[Record::Counters(Counters::of(&sb3))]);
        d3.write_block(blk[0].header.blocknr, &blk[0].encode())
            .unwrap();
        let (sb4, _) = write_image(&mut d3, &named).unwrap();
        assert_eq!((sb4.journal_seq, sb4.journal_id), (72, 5));
        // Impossible journal fields are refused before anything is written.
        named.sb.journal_blocks = 8;
        let e = write_image(&mut d3, &named).unwrap_err();
        assert!(e.to_string().contains("fewer than 16"), "{e}");
        let mut v1 = spec.clone();
        v1.sb.version = FORMAT_VERSION_V1;
        v1.sb.journal_id = 3;
        assert!(write_image(&mut MemDev::new(BLOCKS), &v1).is_err());
        v1.sb.journal_id = 0;
        let (sb5, l5) = write_image(&mut MemDev::new(BLOCKS), &v1).unwrap();
        assert_eq!((sb5.version, l5.journal_blocks), (1, 0));
    }

    #[test]
    fn a_new_run_is_as_long_as_the_sizes_ask_for() {
        // dd_journal_make(): journal_size() of the sizes (256 MiB logical
        // over 64 MiB of data: a quarter of the trees' worst case of 562
        // blocks, 140), or what the trees' worst case leaves if less,
        // halved while no window holds it, down to 64.
        let (l, d) = (1u64 << 16, 1u64 << 14);
        let sb = |blocks: u64| Superblock::new_formatted(blocks, d, l, "sha256", 32, 0);
        assert_eq!((open_blocks(l, d), journal_size(l, d)), (562, 140));
        assert_eq!(required_blocks(l, d), 702);
        assert_eq!(new_run(&sb(562 + 63), &[], 2), None);
        // What the trees leave, from 64 blocks on.
        assert_eq!(new_run(&sb(562 + 64), &[], 2), Some((2, 64)));
        assert_eq!(new_run(&sb(562 + 69), &[], 2), Some((2, 69)));
        assert_eq!(new_run(&sb(701), &[], 2), Some((2, 139)));
        assert_eq!(new_run(&sb(702), &[], 2), Some((2, 140)));
        // Room beyond that stays the trees' (for growing the sizes).
        assert_eq!(new_run(&sb(5000), &[], 2), Some((2, 140)));
        assert_eq!(new_run(&sb(1 << 30), &[], 2), Some((2, 140)));
        // No window that long: halved until one holds it, down to 64.
        let mut reserved = vec![false; 5000];
        for b in (0..5000).step_by(100) {
            reserved[b] = true;
        }
        assert_eq!(new_run(&sb(5000), &reserved, 2), Some((2, 70)));
        for b in (0..5000).step_by(60) {
            reserved[b] = true;
        }
        assert_eq!(new_run(&sb(5000), &reserved, 2), None);
        // The longest run: 4 GiB logical over 1 GiB of data ask for 2048.
        let (l, d) = (1u64 << 20, 1u64 << 18);
        let big = |blocks: u64| Superblock::new_formatted(blocks, d, l, "sha256", 32, 0);
        assert_eq!(
            (open_blocks(l, d), journal_size(l, d)),
            (8806, JOURNAL_BLOCKS)
        );
        assert_eq!(new_run(&big(8806 + 64), &[], 2), Some((2, 64)));
        assert_eq!(new_run(&big(8806 + 1500), &[], 2), Some((2, 1500)));
        assert_eq!(new_run(&big(10854), &[], 2), Some((2, JOURNAL_BLOCKS)));
        assert_eq!(new_run(&big(1 << 30), &[], 2), Some((2, JOURNAL_BLOCKS)));
        let mut reserved = vec![false; 20000];
        for b in (0..20000).step_by(1500) {
            reserved[b] = true;
        }
        assert_eq!(new_run(&big(20000), &reserved, 2), Some((2, 1024)));
        for b in (0..20000).step_by(100) {
            reserved[b] = true;
        }
        assert_eq!(new_run(&big(20000), &reserved, 2), Some((2, 64)));
        for b in (0..20000).step_by(60) {
            reserved[b] = true;
        }
        assert_eq!(new_run(&big(20000), &reserved, 2), None);
        // Format makes the run the sizes ask for, and refuses a device
        // smaller than required_blocks() as dd_md_open() does, even where
        // a halved run would fit.
        let (l, d) = (1u64 << 16, 1u64 << 14);
        for blocks in [702, 5000] {
            let mut dev = MemDev::new(blocks);
            let f = format(&mut dev, d, l, "sha256", 32, 1).unwrap();
            assert_eq!((f.journal_start, f.journal_blocks), (2, 140));
        }
        let mut small = MemDev::new(701);
        let e = format(&mut small, d, l, "sha256", 32, 1).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        assert!(e.to_string().contains("702 blocks needed"), "{e}");
        assert!(small.bytes.iter().all(|&b| b == 0), "nothing written");
        // Restore and repair write a shorter run where the room is short.
        let spec = ImageSpec::consistent(sb(640), &[(5, 1), (1500, 2)], test_fingerprint);
        let (w, lay) = write_image(&mut MemDev::new(640), &spec).unwrap();
        // Map: two leaves and a root; the others: a leaf and a root each.
        assert_eq!(lay.tree_blocks, 7);
        assert_eq!((w.journal_start, w.journal_blocks), (9, 78));
        let spec = ImageSpec::consistent(sb(5000), &[(5, 1), (1500, 2)], test_fingerprint);
        let (w, _) = write_image(&mut MemDev::new(5000), &spec).unwrap();
        assert_eq!((w.journal_start, w.journal_blocks), (9, 140));
        let spec = ImageSpec::consistent(sb(625), &[(5, 1), (1500, 2)], test_fingerprint);
        let e = write_image(&mut MemDev::new(625), &spec).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        assert!(e.to_string().contains("702 blocks needed"), "{e}");
        let e = format(&mut MemDev::new(79), 10, 2000, "sha256", 32, 1).unwrap_err();
        assert!(e.to_string().contains("80 blocks needed"), "{e}");
    }

    #[test]
    fn appends_are_packed_as_the_kernel_packs_them() {
        let mut sb = Superblock::new_formatted(BLOCKS, 1000, 1000, "sha256", 32, 0);
        sb.journal_start = 100;
        sb.journal_blocks = 16;
        sb.journal_seq = 30;
        sb.journal_id = 9;
        let mut recs: Vec<Record> = (0..300).map(|i| Record::Map { lba: i, value: 1 }).collect();
        recs.push(Record::Counters(Counters::default()));
        let blocks = append_blocks(&sb, 31, 4, &recs);
        assert_eq!(blocks.len(), 2);
        assert_eq!(
            blocks.iter().map(|b| b.header.blocknr).collect::<Vec<_>>(),
            [115, 100]
        );
        assert_eq!((blocks[0].seq, blocks[1].seq), (31, 32));
        assert_eq!((blocks[0].epoch, blocks[0].journal_id), (30, 9));
        assert_eq!((blocks[0].is_end(), blocks[1].is_end()), (false, true));
        assert_eq!(blocks[0].used, 252 * 16);
        assert_eq!(blocks[1].used, 48 * 16 + 56);
        let mut d = MemDev::new(BLOCKS);
        assert_eq!(write_append(&mut d, &sb, 31, 4, &recs).unwrap(), 33);
        assert_eq!(JournalBlock::decode(d.block(100)).seq, 32);
        let mut v1 = sb.clone();
        v1.version = FORMAT_VERSION_V1;
        assert!(write_append(&mut d, &v1, 1, 1, &recs).is_err());
    }

    #[test]
    fn tree_block_counts() {
        let g = Geometry::new(ArrayId::Map, 508 * 509);
        assert_eq!(tree_block_count(&g, []), 0);
        assert_eq!(tree_block_count(&g, [0, 1, 2]), 1 + 1 + 1);
        assert_eq!(tree_block_count(&g, [5, 508 * 508]), 5);
        let g0 = Geometry::new(ArrayId::Refcount, 10);
        assert_eq!(tree_block_count(&g0, [3, 4]), 1);
        let mut d = MemDev::new(16);
        let mut w = TreeWriter::new(&mut d, 2, 16, 7);
        w.build(&g, [(5u64, [1u8; 8]), (508 * 508, [1u8; 8])])
            .unwrap();
        assert_eq!(w.blocks, 5);
        assert_eq!(
            journal_window(&[false, false, true, false], 0, 10, 3),
            Some(3)
        );
        assert_eq!(journal_window(&[], 2, 5, 3), Some(2));
        assert_eq!(journal_window(&[], 2, 4, 3), None);
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
