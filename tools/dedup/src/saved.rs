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
//! Not checked: the index's capacity (the kernel also refuses more entries
//! than its index, sized by the table, holds) and the slots' probe
//! distances and tags, which only steer lookups.
//!
//! A child module of `check`: it drives the check's own Walker.

use super::*;
use crate::ondisk::saved::{self as fmt, Layout};

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
    /// The metadata device's size and the superblock's data blocks, which
    /// the kernel compares the header with (a table of another size is
    /// `table_mismatch`).
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
    slots_used: u64,
    indexed: Live,
    slot_no_block: Tally,
    slot_dead: Tally,
    slot_twice: Tally,
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
            slots_used: 0,
            indexed: Live::new(data_blocks, dense_limit),
            slot_no_block: Tally::default(),
            slot_dead: Tally::default(),
            slot_twice: Tally::default(),
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
                stale(
                    fmt::W_DATA_BLOCKS,
                    format!(
                        "written for {db} data blocks, the superblock has {}",
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
            let kind = h[fmt::W_TARGET_HEAD + fmt::HEAD_LAYOUT];
            if kind != fmt::INDEX_LAYOUT {
                stale(
                    fmt::W_TARGET_HEAD,
                    format!("index layout {kind:#x} is not this module's (IDX1)"),
                );
            }
            if ok {
                self.layout = layout;
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
                self.slot(v);
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

    fn slot(&mut self, v: u64) {
        self.slots_used += 1;
        match fmt::slot_pba(v) {
            None => self.slot_no_block.add(v),
            Some(p) if p >= self.data_blocks || !self.live.contains(p) => self.slot_dead.add(p),
            Some(p) if self.indexed.contains(p) => self.slot_twice.add(p),
            Some(p) => self.indexed.insert(p),
        }
    }

    /// After the walk: the rest of dd_saved_load() and dd_activate_saved()
    /// (metadata bitmap, counts), then the comparison with the trees.
    fn judge(&mut self, sb: &Superblock, owner: &[u8], live_blocks: u64) {
        if !self.header_seen && !self.unreadable {
            self.stale(at_word(0), "no header: the array has no leaf".into());
        }
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
        if self.slots_used != entries {
            stale.push((
                at,
                format!(
                    "{} index slots are in use but its head says {entries} entries",
                    self.slots_used
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
        // dd_index_saved_ok refuses these: the kernel walks instead.
        note(
            &mut stale,
            &self.slot_no_block,
            "index slots are in use but name no block (slot value)",
            "",
        );
        note(
            &mut stale,
            &self.slot_dead,
            "index slots name a data block with refcount 0 or beyond the device",
            "",
        );
        note(
            &mut wrong,
            &self.slot_twice,
            "data blocks are in two index slots",
            "",
        );
        if entries > live_blocks {
            stale.push((
                at,
                format!(
                    "its head counts {entries} index entries, but only {live_blocks} data \
                     blocks have refcount > 0"
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
            });
        }
        s.judge(self.sb, &self.owner, self.summary.live_blocks);
        let loadable = !s.unreadable && s.stale.is_empty();
        for (at, why) in std::mem::take(&mut s.stale) {
            self.warn(STALE, at, format!("{why}; the kernel would not load it"));
        }
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
        })
    }
}
