//! `dedup check` of the state saved at a clean close (DD_ARRAY_SAVED, see
//! `ondisk::saved`), when the superblock names one.
//!
//! The save is walked like the trees (block type, array, level, checksum,
//! location) and read as dd_saved_load() reads it. Whatever would make the
//! kernel refuse it (an unreadable block, a header for another superblock
//! or other sizes, bits out of range, counts that disagree) is a warning,
//! `saved_state_stale`: the next activation just walks the trees. A save
//! the kernel would load is compared with what the walk of the trees found;
//! a difference is an error, `saved_state_wrong`, since the kernel would
//! trust it (allocate over live blocks, or never reuse free ones).
//! The index is read as dd_index_saved_ok() reads it: its layout (IDX2)
//! and geometry must be the ones the kernel computes for the table, and
//! every entry must name a fingerprint leaf of the device with a block the
//! data bitmap marks. Compared with the trees: no leaf is named by more
//! entries than it has live blocks (one entry per indexed block). Not
//! checked: the index's capacity (the kernel also refuses more entries
//! than its index holds) and the entries' buckets and tags, which only
//! steer lookups.
//!
//! A child module of `check`: it drives the check's own Walker.

use super::*;
use crate::ondisk::saved::{self as fmt, IndexEntry, IndexGeometry, Layout};

pub(super) const STALE: &str = "saved_state_stale";
pub(super) const WRONG: &str = "saved_state_wrong";

/// Positions of one kind of finding: how many, and the first.
#[derive(Default)]
struct Tally {
    count: u64,
    first: u64,
}

impl Tally {
    fn add(&mut self, at: u64) {
        if self.count == 0 {
            self.first = at;
        }
        self.count += 1;
    }
}

/// The positions of the bits set in word `k` of a bitmap.
fn set_bits(k: u64, mut bits: u64) -> impl Iterator<Item = u64> {
    std::iter::from_fn(move || {
        let i = (bits != 0).then(|| k * 64 + bits.trailing_zeros() as u64);
        bits &= bits.wrapping_sub(1);
        i
    })
}

/// What the kernel would find reading the save, collected as the walk
/// hands over its leaves (in index order, as dd_array_walk does).
pub(super) struct SavedWalk {
    /// The metadata device's size and the table's data blocks (the
    /// superblock's, or more: a grown table), which the kernel compares
    /// the header with (a smaller table is `table_mismatch`).
    device_blocks: u64,
    data_blocks: u64,
    pub(super) blocks: u64,
    /// A block of the save, or the pointer to it, could not be read.
    pub(super) unreadable: bool,
    header_seen: bool,
    /// Set once the header matches: the parts are where it says.
    layout: Option<Layout>,
    head: [u64; fmt::TARGET_HEAD],
    /// Data blocks with refcount > 0, from the refcount walk.
    pub(super) live: Live,
    meta: Vec<u64>,
    /// Data blocks the saved bitmap marks (within the device).
    marked: Live,
    marked_count: u64,
    data_out_of_range: Tally,
    data_dead: Tally,
    /// Set with `layout`: how the target words hold the entries.
    index: Option<IndexGeometry>,
    /// The last non-zero target word seen (its index in the target part
    /// and value), whose last entry may go on in the next word.
    pending: Option<(u64, u64)>,
    entries_used: u64,
    /// Entries per fingerprint leaf.
    leaf_entries: Counts,
    /// Entries with a tag but no leaf (first: the entry).
    entry_no_leaf: Tally,
    /// Entries naming a leaf past the device's (first: the leaf).
    entry_beyond: Tally,
    /// Would keep the kernel from loading it (besides the walk's faults).
    stale: Vec<(At, String)>,
    /// What the kernel would load and trust, and is not so.
    wrong: Vec<(At, String)>,
}

fn at_word(word: u64) -> At {
    At::entry(ArrayId::Saved, word)
}

fn at_saved() -> At {
    At {
        array: Some(ArrayId::Saved),
        ..At::sb()
    }
}

impl SavedWalk {
    pub(super) fn new(device_blocks: u64, data_blocks: u64, dense_limit: u64) -> SavedWalk {
        SavedWalk {
            device_blocks,
            data_blocks,
            blocks: 0,
            unreadable: false,
            header_seen: false,
            layout: None,
            head: [0; fmt::TARGET_HEAD],
            live: Live::new(data_blocks, dense_limit),
            meta: Vec::new(),
            marked: Live::new(data_blocks, dense_limit),
            marked_count: 0,
            data_out_of_range: Tally::default(),
            data_dead: Tally::default(),
            index: None,
            pending: None,
            entries_used: 0,
            leaf_entries: Counts::new(fmt::nr_leaves(data_blocks), dense_limit),
            entry_no_leaf: Tally::default(),
            entry_beyond: Tally::default(),
            stale: Vec::new(),
            wrong: Vec::new(),
        }
    }

    fn stale(&mut self, at: At, why: String) {
        self.stale.push((at, why));
    }

    /// dd_saved_header(): the header of leaf 0 against the superblock
    /// naming the save and the sizes the kernel would open it with.
    fn header(&mut self, sb: &Superblock, h: &[u64]) {
        let (mb, db, tw) = (
            h[fmt::W_METADATA_BLOCKS],
            h[fmt::W_DATA_BLOCKS],
            h[fmt::W_TARGET_WORDS],
        );
        let mut ok = true;
        let mut stale = |w: usize, why: String| {
            ok = false;
            self.stale.push((at_word(w as u64), why));
        };
        if h[fmt::W_MAGIC] != fmt::MAGIC {
            stale(
                fmt::W_MAGIC,
                format!("no header: magic {:#018x}", h[fmt::W_MAGIC]),
            );
        } else {
            if h[fmt::W_TXN] != sb.generation() {
                stale(
                    fmt::W_TXN,
                    format!(
                        "written for the superblock of generation {}, not this one ({})",
                        h[fmt::W_TXN],
                        sb.generation()
                    ),
                );
            }
            if mb != self.device_blocks {
                stale(
                    fmt::W_METADATA_BLOCKS,
                    format!(
                        "written for {mb} metadata blocks, the device has {}",
                        self.device_blocks
                    ),
                );
            }
            if db != self.data_blocks {
                // The table's size, which a larger table grows the
                // superblock's to before the save is read.
                let whose = if self.data_blocks == sb.data_blocks {
                    "the superblock"
                } else {
                    "the table"
                };
                stale(
                    fmt::W_DATA_BLOCKS,
                    format!(
                        "written for {db} data blocks, {whose} has {}",
                        self.data_blocks
                    ),
                );
            }
            let layout = Layout::new(mb, db, tw);
            if layout.is_none_or(|l| l.total != sb.saved_words) {
                stale(
                    fmt::W_TARGET_WORDS,
                    format!(
                        "its parts ({mb} metadata and {db} data blocks, {tw} index words) do not \
                         make the {} words the superblock names",
                        sb.saved_words
                    ),
                );
            }
            let head = &h[fmt::W_TARGET_HEAD..fmt::W_TARGET_HEAD + fmt::TARGET_HEAD];
            let kind = head[fmt::HEAD_LAYOUT];
            let (geometry, buckets) = (head[fmt::HEAD_GEOMETRY], head[fmt::HEAD_BUCKETS]);
            let want = IndexGeometry::for_data_blocks(self.data_blocks);
            let index = IndexGeometry::decode(geometry, buckets);
            if kind != fmt::INDEX_LAYOUT {
                stale(
                    fmt::W_TARGET_HEAD,
                    format!("index layout {kind:#x} is not this module's (IDX2)"),
                );
            } else if let Some(g) = index.filter(|g| g.words() != tw) {
                stale(
                    fmt::W_TARGET_HEAD + fmt::HEAD_GEOMETRY,
                    format!(
                        "its index geometry packs {} entries of {} bits in {} words, not the \
                         {tw} index words it has",
                        g.entries(),
                        g.entry_bits,
                        g.words()
                    ),
                );
            } else if index != Some(want) {
                stale(
                    fmt::W_TARGET_HEAD + fmt::HEAD_GEOMETRY,
                    format!(
                        "index geometry {geometry:#x} with {buckets} buckets is not the \
                         kernel's for {} data blocks ({:#x} with {} buckets)",
                        self.data_blocks,
                        want.encode(),
                        want.buckets
                    ),
                );
            }
            if ok {
                self.layout = layout;
                self.index = index;
            }
        }
        if !ok {
            return;
        }
        if mb != sb.metadata_blocks {
            self.wrong.push((
                at_word(fmt::W_METADATA_BLOCKS as u64),
                format!(
                    "written for {mb} metadata blocks but the superblock naming it has {}",
                    sb.metadata_blocks
                ),
            ));
        }
        self.head
            .copy_from_slice(&h[fmt::W_TARGET_HEAD..fmt::W_TARGET_HEAD + fmt::TARGET_HEAD]);
        self.meta = vec![0; mb.div_ceil(64) as usize];
    }

    /// dd_saved_leaf(): one present leaf, words from index `first`.
    pub(super) fn leaf(&mut self, sb: &Superblock, first: u64, words: &[u64]) {
        if first == 0 {
            self.header_seen = true;
            if words.len() < fmt::HEADER_WORDS {
                self.stale(at_word(0), "no header: the array is too short".into());
                return;
            }
            self.header(sb, &words[..fmt::HEADER_WORDS]);
        } else if !self.header_seen {
            self.header_seen = true;
            self.stale(at_word(0), "no header: its first leaf is absent".into());
        }
        let Some(l) = self.layout else {
            return;
        };
        for (i, &v) in (first..).zip(words) {
            if i < fmt::HEADER_WORDS as u64 || v == 0 {
                continue;
            }
            if i < l.data_start {
                self.meta[(i - fmt::HEADER_WORDS as u64) as usize] = v;
            } else if i < l.target_start {
                self.data_word(i - l.data_start, v);
            } else {
                self.target_word(i - l.target_start, v);
            }
        }
    }

    fn data_word(&mut self, k: u64, bits: u64) {
        for pba in set_bits(k, bits) {
            if pba >= self.data_blocks {
                self.data_out_of_range.add(pba);
                continue;
            }
            self.marked.insert(pba);
            self.marked_count += 1;
            if !self.live.contains(pba) {
                self.data_dead.add(pba);
            }
        }
    }

    /// Non-zero target word `j` (the walk skips zeros, absent leaves
    /// among them): the entries that end in it. One that goes on into
    /// word j + 1 waits for it, or for [`Self::flush`] if it is zero.
    fn target_word(&mut self, j: u64, v: u64) {
        let Some(g) = self.index else {
            return;
        };
        if self.pending.is_some_and(|(i, _)| i + 1 != j) {
            self.flush();
        }
        let prev = match self.pending {
            Some((i, pv)) if i + 1 == j => pv,
            _ => 0,
        };
        let w = g.entry_bits as u128;
        // From the entry holding the word's first bit to the last one
        // starting in it.
        let first = (j as u128 * 64 / w) as u64;
        let end = ((j as u128 * 64 + 64).div_ceil(w) as u64).min(g.entries());
        for k in first..end {
            if g.entry_words(k).1 > j {
                continue;
            }
            let e = g.entry_with(k, |x| {
                if x == j {
                    v
                } else if x + 1 == j {
                    prev
                } else {
                    0
                }
            });
            self.entry(&g, k, e);
        }
        self.pending = Some((j, v));
    }

    /// The entry that goes on from the pending word into a zero one.
    fn flush(&mut self) {
        let (Some(g), Some((i, v))) = (self.index, self.pending.take()) else {
            return;
        };
        let k = ((i as u128 * 64 + 63) / g.entry_bits as u128) as u64;
        if k < g.entries() && g.entry_words(k) == (i, i + 1) {
            let e = g.entry_with(k, |x| if x == i { v } else { 0 });
            self.entry(&g, k, e);
        }
    }

    /// Entry `k`, value `e`: what dd_index_saved_ok checks of it alone.
    fn entry(&mut self, g: &IndexGeometry, k: u64, e: u64) {
        match g.decode_entry(e) {
            IndexEntry::Empty => return,
            IndexEntry::NoLeaf => self.entry_no_leaf.add(k),
            IndexEntry::Leaf(leaf) if leaf >= fmt::nr_leaves(self.data_blocks) => {
                self.entry_beyond.add(leaf)
            }
            IndexEntry::Leaf(leaf) => self.leaf_entries.inc_all(&[leaf]),
        }
        self.entries_used += 1;
    }

    /// After the walk: the rest of dd_saved_load() and dd_activate_saved()
    /// (metadata bitmap, counts), then the comparison with the trees.
    fn judge(&mut self, sb: &Superblock, owner: &[u8]) {
        if !self.header_seen && !self.unreadable {
            self.stale(at_word(0), "no header: the array has no leaf".into());
        }
        self.flush();
        if self.layout.is_none() {
            return;
        }
        let at = at_saved();
        let tree = |b: u64| owner.get(b as usize).is_some_and(|&o| (1..=3).contains(&o));
        let mut out_of_range = Tally::default();
        let mut on_save = Tally::default();
        let mut unused = Tally::default();
        for (k, &w) in (0..).zip(&self.meta) {
            for b in set_bits(k, w) {
                if b < FIRST_TREE_BLOCK || b >= self.device_blocks {
                    out_of_range.add(b);
                } else if owner.get(b as usize) == Some(&(ArrayId::Saved as u8)) {
                    on_save.add(b);
                } else if owner.get(b as usize) == Some(&JOURNAL_OWNER) {
                    // The journal's run is used space: the kernel marks it
                    // whether or not the save does (dd_journal_claim_saved).
                } else if !tree(b) {
                    unused.add(b);
                }
            }
        }
        // dd_activate_saved(): a root not in the bitmap (or one of the
        // save's own blocks, which the walk above counts) and the kernel
        // rebuilds instead of loading.
        let marked = |b: u64| {
            self.meta
                .get((b / 64) as usize)
                .is_some_and(|w| w & (1 << (b % 64)) != 0)
        };
        let mut root_unmarked = Tally::default();
        for r in [sb.map_root, sb.refcount_root, sb.fingerprint_root] {
            if r != 0 && !marked(r) {
                root_unmarked.add(r);
            }
        }
        let mut missing = Tally::default();
        for b in (0..owner.len() as u64).filter(|&b| tree(b)) {
            if self.meta[(b / 64) as usize] & (1 << (b % 64)) == 0 {
                missing.add(b);
            }
        }
        let mut stale = Vec::new();
        let mut wrong = Vec::new();
        // "N <what> (the first is F)<so>"
        let note = |v: &mut Vec<(At, String)>, t: &Tally, what: &str, so: &str| {
            if t.count > 0 {
                v.push((
                    at,
                    format!("{} {what} (the first is {}){so}", t.count, t.first),
                ));
            }
        };
        note(
            &mut stale,
            &out_of_range,
            "metadata blocks marked used lie outside the tree area",
            "",
        );
        note(
            &mut stale,
            &on_save,
            "metadata blocks marked used by the trees are blocks of the save itself",
            "",
        );
        if sb.flags & SB_NEEDS_CHECK != 0 {
            stale.push((
                at,
                "the superblock is flagged needs_check: the kernel walks the trees instead".into(),
            ));
        }
        note(
            &mut stale,
            &root_unmarked,
            "tree roots are not marked used in its metadata bitmap",
            "",
        );
        note(
            &mut stale,
            &self.data_out_of_range,
            "data blocks marked used lie beyond the data device",
            "",
        );
        if self.marked_count != sb.used_data_blocks {
            stale.push((
                at,
                format!(
                    "it marks {} data blocks used but the superblock says used_data_blocks {}",
                    self.marked_count, sb.used_data_blocks
                ),
            ));
        }
        let entries = self.head[fmt::HEAD_ENTRIES];
        if self.entries_used != entries {
            stale.push((
                at,
                format!(
                    "{} index entries are in use but its head says {entries}",
                    self.entries_used
                ),
            ));
        }
        let loads = self.head[fmt::HEAD_LOADS];
        if loads >= fmt::MAX_LOADS {
            stale.push((
                at,
                format!(
                    "its index was loaded {loads} times since it was rebuilt: the kernel \
                     rebuilds it at {}",
                    fmt::MAX_LOADS
                ),
            ));
        }
        note(
            &mut wrong,
            &unused,
            "metadata blocks are marked used but no tree uses them",
            ": the kernel would never reuse them",
        );
        note(
            &mut wrong,
            &missing,
            "metadata blocks the trees use are not marked used",
            ": the kernel would allocate them over the committed trees",
        );
        note(
            &mut wrong,
            &self.data_dead,
            "data blocks are marked used but have refcount 0",
            ": the kernel would never reuse them",
        );
        let mut unmarked = Tally::default();
        for pba in self.live.remaining() {
            if !self.marked.contains(pba) {
                unmarked.add(pba);
            }
        }
        note(
            &mut wrong,
            &unmarked,
            "data blocks with refcount > 0 are not marked used",
            ": the kernel would allocate them again and overwrite their content",
        );
        // The leaves the entries name: dd_index_saved_ok refuses one
        // without a block in the data bitmap; one with fewer live blocks
        // than entries holds entries of blocks that are gone.
        let per_leaf = fmt::FP_PER_LEAF;
        let mut leaf_unmarked = Tally::default();
        let mut leaf_over = Tally::default();
        for (leaf, n) in self.leaf_entries.remaining() {
            let blocks = leaf * per_leaf..((leaf + 1) * per_leaf).min(self.data_blocks);
            if !blocks.clone().any(|p| self.marked.contains(p)) {
                leaf_unmarked.add(leaf);
            } else if (blocks.filter(|&p| self.live.contains(p)).count() as u64) < n as u64 {
                leaf_over.add(leaf);
            }
        }
        // dd_index_saved_ok refuses these: the kernel walks instead.
        note(
            &mut stale,
            &self.entry_no_leaf,
            "index entries hold a tag but no leaf (entry number)",
            "",
        );
        note(
            &mut stale,
            &self.entry_beyond,
            &format!(
                "index entries name a fingerprint leaf past the data device's {}",
                fmt::nr_leaves(self.data_blocks)
            ),
            "",
        );
        note(
            &mut stale,
            &leaf_unmarked,
            "fingerprint leaves named by index entries hold no block marked used",
            "",
        );
        note(
            &mut wrong,
            &leaf_over,
            "fingerprint leaves are named by more index entries than they hold blocks with \
             refcount > 0",
            ": the index holds entries of blocks that are gone",
        );
        if entries > self.marked_count {
            stale.push((
                at,
                format!(
                    "its head counts {entries} index entries, but it marks only {} data \
                     blocks used",
                    self.marked_count
                ),
            ));
        }
        self.stale.append(&mut stale);
        self.wrong.append(&mut wrong);
    }
}

impl Walker<'_> {
    /// A fault of the save that keeps the kernel from loading it.
    pub(super) fn saved_unreadable(&mut self, at: At, why: String) {
        if let Some(s) = self.saved.as_mut() {
            s.unreadable = true;
        }
        self.warn(STALE, at, format!("{why}; the kernel would not load it"));
    }

    /// The transaction of a save block: written with the superblock that
    /// names the save. A later one the kernel refuses (dd_walk); an older
    /// one it would load, though it cannot be this save's.
    pub(super) fn saved_block_txn(&mut self, txn: u64, at: At) {
        let gen = self.sb.generation();
        if txn > gen {
            self.saved_unreadable(
                at,
                format!("written by transaction {txn}, after the superblock ({gen})"),
            );
        } else if txn != gen {
            if let Some(s) = self.saved.as_mut() {
                s.wrong.push((
                    at,
                    format!(
                        "written by transaction {txn}, not with the superblock that names it \
                         ({gen}): left over from another state"
                    ),
                ));
            }
        }
    }

    pub(super) fn saved_leaf(&mut self, payload: &[u8], first: u64, count: usize) {
        let words: Vec<u64> = (0..count).map(|i| le64(payload, i * 8)).collect();
        let sb = self.sb;
        if let Some(s) = self.saved.as_mut() {
            s.leaf(sb, first, &words);
        }
    }

    /// Walk and judge the save the superblock names; its findings go to
    /// the report, and what it came to to the report's `saved`.
    pub(super) fn check_saved(&mut self) -> Option<SavedReport> {
        self.saved.as_ref()?;
        self.walk_array(ArrayId::Saved);
        let trees_whole = self.damaged[..3].iter().all(Damaged::is_empty);
        let mut s = self.saved.take()?;
        if self.journal_appends > 0 {
            // The save describes the superblock's trees; the state is
            // those with the journal replayed, which the kernel commits
            // instead of loading the save.
            let n = self.journal_appends;
            self.warn(
                STALE,
                at_saved(),
                format!(
                    "the journal after its superblock holds {}: the kernel replays {} and \
                     commits, and does not load the save",
                    crate::util::plural(n, "append"),
                    if n == 1 { "it" } else { "them" }
                ),
            );
            return Some(SavedReport {
                root: self.sb.saved_root,
                words: self.sb.saved_words,
                blocks: s.blocks,
                loadable: false,
                compared: false,
                differs: false,
            });
        }
        s.judge(self.sb, &self.owner);
        let loadable = !s.unreadable && s.stale.is_empty();
        for (at, why) in std::mem::take(&mut s.stale) {
            self.warn(STALE, at, format!("{why}; the kernel would not load it"));
        }
        let differs = loadable && trees_whole && !s.wrong.is_empty();
        if loadable && trees_whole {
            for (at, why) in std::mem::take(&mut s.wrong) {
                self.report(
                    Severity::Error,
                    WRONG,
                    at,
                    format!("{why}; the kernel would load this saved state and trust it"),
                );
            }
        }
        Some(SavedReport {
            root: self.sb.saved_root,
            words: self.sb.saved_words,
            blocks: s.blocks,
            loadable,
            compared: loadable && trees_whole,
            differs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Entries read from the target words as the walk hands them over
    /// (non-zero words only, in order, absent runs between) are those of
    /// the whole array, those that straddle into a zero word included.
    #[test]
    fn entries_stream_across_words_and_gaps() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let geometries = [
            (300, IndexGeometry::for_data_blocks(300)),
            (
                1 << 36,
                IndexGeometry::decode(37 | 30 << 8 | 4 << 16 | 127 << 32, 40).unwrap(),
            ),
            (
                5000,
                IndexGeometry::decode(64 | 6 << 8 | 3 << 16 | 127 << 32, 20).unwrap(),
            ),
        ];
        for (data_blocks, g) in geometries {
            for round in 0..40 {
                let mut words = vec![0u64; g.words() as usize];
                for w in words.iter_mut() {
                    *w = match rnd() % 4 {
                        0 | 1 => 0,
                        2 => rnd() & rnd(),
                        _ => 1 << (rnd() % 64),
                    };
                }
                if round % 2 == 1 {
                    // Zero tags: the high part of a straddling entry is 0.
                    for k in 0..g.entries() {
                        let v = g.entry(&words, k);
                        let low = v & ((1 << g.leaf_bits) - 1);
                        g.set_entry(&mut words, k, low);
                    }
                }
                let mut s = SavedWalk::new(1000, data_blocks, 1 << 20);
                s.index = Some(g);
                for (j, &v) in (0..).zip(&words) {
                    if v != 0 {
                        s.target_word(j, v);
                    }
                }
                s.flush();
                let nr_leaves = fmt::nr_leaves(data_blocks);
                let (mut used, mut no_leaf, mut beyond) = (0, 0, 0);
                let mut per_leaf = BTreeMap::new();
                for k in 0..g.entries() {
                    match g.decode_entry(g.entry(&words, k)) {
                        IndexEntry::Empty => continue,
                        IndexEntry::NoLeaf => no_leaf += 1,
                        IndexEntry::Leaf(l) if l >= nr_leaves => beyond += 1,
                        IndexEntry::Leaf(l) => *per_leaf.entry(l).or_insert(0u32) += 1,
                    }
                    used += 1;
                }
                assert!(used > 0);
                assert_eq!(s.entries_used, used, "{g:?} round {round}");
                assert_eq!(s.entry_no_leaf.count, no_leaf);
                assert_eq!(s.entry_beyond.count, beyond);
                let got: BTreeMap<u64, u32> = s.leaf_entries.remaining().into_iter().collect();
                assert_eq!(got, per_leaf);
            }
        }
    }
}
