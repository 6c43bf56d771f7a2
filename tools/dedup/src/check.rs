//! `dedup check`: offline consistency check of a metadata device.
//!
//! The superblock slots are classified and chosen exactly as dd_md_open()
//! does, the superblock is held to what dd_check_sb() requires, the
//! journal that follows it (format version 2) is read as the kernel's
//! replay reads it, then the three arrays are walked once (every metadata
//! block is read at most once) with the journal's new values laid over
//! them, and every invariant the kernel relies on is verified on that
//! state. With a data device, the fingerprint record of every live block
//! is compared with the digest of its content. Problems are collected
//! with their location; nothing is ever written.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use crate::device::BlockDev;
use crate::fingerprint::{self, Hasher};
use crate::journal::{self, Overlay, Replay};
use crate::ondisk::*;
use crate::util::hex;

#[path = "saved.rs"]
mod saved;

/// Above this many data blocks the per-PBA tables are hash maps instead of
/// flat arrays (a flat table costs 4 bytes per data block, zero-filled
/// lazily by the OS, so it is the fast choice up to ~1 TiB of data).
const DENSE_LIMIT: u64 = 1 << 28;

/// Fingerprints at least this long never come out all zero in practice
/// (probability 2^-128): an all-zero record of a live block is a lost
/// record. Shorter digests can be zero, and the kernel accepts them.
pub const STRONG_FP_SIZE: usize = 16;

/// Live blocks whose records wait for their data to be read: enough runs
/// to keep every core hashing, while memory stays bounded on any device.
const VERIFY_BATCH: usize = 1 << 16;

/// The owner mark of a block of the journal's run (tree blocks are marked
/// with their array id).
const JOURNAL_OWNER: u8 = 0xff;

#[derive(Clone, Debug, Default)]
pub struct CheckOptions {
    /// Data blocks the table will have (the data device size; without it,
    /// the --data device's size): the kernel refuses fewer than the
    /// metadata's, and grows the metadata to more at activation.
    pub data_blocks: Option<u64>,
    /// Logical blocks the table will have: the same rules.
    pub logical_blocks: Option<u64>,
    /// Hash the table will name.
    pub hash: Option<String>,
    /// Keep the content (mappings, refcounts, fingerprints) for `dump`.
    pub collect: bool,
    /// Problems kept in the report; 0 = all. Every problem is counted.
    pub max_problems: usize,
    /// Data blocks up to which per-PBA tables are flat arrays (None: the
    /// default, 2^28); above, hash maps. For tests of both paths.
    pub dense_limit: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

/// One finding, with where it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    pub severity: Severity,
    /// Stable machine-readable kind, e.g. `bad_checksum`.
    pub code: &'static str,
    /// Metadata block concerned (for a bad child pointer: the parent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub array: Option<&'static str>,
    /// Tree level (0 = leaf).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub level: Option<u8>,
    /// Entry index: the LBA (map) or PBA (refcount, fingerprint), or the
    /// first entry a damaged tree block covers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u64>,
    pub message: String,
}

impl Problem {
    /// "block 17, map level 0, index 1016" style location.
    pub fn location(&self) -> String {
        let mut parts = Vec::new();
        if let Some(b) = self.block {
            parts.push(format!("block {b}"));
        }
        match (self.array, self.level) {
            (Some(a), Some(l)) => parts.push(format!("{a} level {l}")),
            (Some(a), None) => parts.push(a.to_string()),
            _ => {}
        }
        if let Some(i) = self.index {
            let what = match self.array {
                Some("map") => "lba",
                Some("refcount") | Some("fingerprint") => "pba",
                Some("saved") => "word",
                Some("journal") => "sequence",
                _ => "index",
            };
            parts.push(format!("{what} {i}"));
        }
        if parts.is_empty() {
            "superblock".into()
        } else {
            parts.join(", ")
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct SlotReport {
    pub slot: u64,
    /// `valid`, `zero` or `bad`.
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
}

/// The chosen superblock, decoded.
#[derive(Clone, Debug, Serialize)]
pub struct SuperblockInfo {
    pub slot: u64,
    pub generation: u64,
    pub version: u32,
    pub block_size: u32,
    pub metadata_blocks: u64,
    pub data_blocks: u64,
    pub logical_blocks: u64,
    pub hash: String,
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
    /// The state saved at a clean close, 0 = none (see `Report::saved`).
    pub saved_root: u64,
    pub saved_words: u64,
    /// Version 2: the journal's run, its epoch and id (all 0 in version
    /// 1). See `Report::journal`.
    pub journal_start: u64,
    pub journal_blocks: u64,
    pub journal_seq: u64,
    pub journal_id: u64,
}

impl SuperblockInfo {
    pub fn from_sb(slot: u64, sb: &Superblock) -> SuperblockInfo {
        SuperblockInfo {
            slot,
            generation: sb.generation(),
            version: sb.version,
            block_size: sb.block_size,
            metadata_blocks: sb.metadata_blocks,
            data_blocks: sb.data_blocks,
            logical_blocks: sb.logical_blocks,
            hash: sb.hash(),
            fp_size: sb.fp_size,
            flags: sb.flags,
            map_root: sb.map_root,
            refcount_root: sb.refcount_root,
            fingerprint_root: sb.fingerprint_root,
            mapped_blocks: sb.mapped_blocks,
            used_data_blocks: sb.used_data_blocks,
            unique_writes: sb.unique_writes,
            duplicate_writes: sb.duplicate_writes,
            zero_writes: sb.zero_writes,
            discarded_blocks: sb.discarded_blocks,
            format_time: sb.format_time,
            saved_root: sb.saved_root,
            saved_words: sb.saved_words,
            journal_start: sb.journal_start,
            journal_blocks: sb.journal_blocks,
            journal_seq: sb.journal_seq,
            journal_id: sb.journal_id,
        }
    }
}

/// What the walk counted.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    /// Superblock slots plus tree blocks plus the journal's run: comparable
    /// with the `metadata_blocks_used` the kernel reports right after
    /// activation.
    pub metadata_blocks_used: u64,
    pub metadata_blocks_total: u64,
    pub map_blocks: u64,
    pub refcount_blocks: u64,
    pub fingerprint_blocks: u64,
    /// The journal's run (0 without one).
    pub journal_blocks: u64,
    /// Non-zero map entries.
    pub mapped_blocks: u64,
    /// Physical blocks with refcount > 0.
    pub live_blocks: u64,
    pub refcount_sum: u64,
    /// Live blocks with a non-zero fingerprint record.
    pub fingerprinted_blocks: u64,
    /// Fingerprint records left on free blocks (normal: the kernel does
    /// not clear them when a block is freed).
    pub stale_fingerprints: u64,
    /// Live blocks whose record is the placeholder `repair` writes when a
    /// fingerprint is lost (recognisable for digests of 24 bytes or more).
    pub placeholder_fingerprints: u64,
    /// mapped / live (1.0 when nothing is live).
    pub dedup_ratio: f64,
    /// With a data device: live blocks whose content matches their record.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_blocks_verified: Option<u64>,
    /// With a data device: live blocks whose content does not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fingerprint_mismatches: Option<u64>,
    /// With a data device: live blocks whose content could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_read_errors: Option<u64>,
}

/// The state saved at the last clean close, when the superblock names one.
#[derive(Clone, Debug, Serialize)]
pub struct SavedReport {
    pub root: u64,
    pub words: u64,
    /// Its blocks (not counted in `metadata_blocks_used`).
    pub blocks: u64,
    /// The kernel would load it at the next activation instead of walking
    /// the trees (otherwise `saved_state_stale` says why not).
    pub loadable: bool,
    /// It was compared with the trees (loadable, and the trees were read
    /// whole); differences are `saved_state_wrong`.
    pub compared: bool,
    /// Compared, and it differs from the trees (`saved_state_wrong`
    /// errors were counted, whether listed or not: see max_problems).
    pub differs: bool,
}

/// The journal that follows the superblock (format version 2), as replay
/// read it. The summary and every content check are of the state with its
/// whole appends applied.
#[derive(Clone, Debug, Serialize)]
pub struct JournalReport {
    /// The run: `blocks` blocks from block `start`.
    pub start: u64,
    pub blocks: u64,
    pub id: u64,
    /// The superblock's journal_seq: the first sequence number after its
    /// state.
    pub epoch: u64,
    /// Blocks that continue the journal from the epoch (whole appends, a
    /// torn tail, a damaged part).
    pub blocks_in_epoch: u64,
    /// Whole appends applied, their blocks and records.
    pub appends: u64,
    pub replayed_blocks: u64,
    pub records: u64,
    /// The first sequence number that does not continue the journal, and
    /// why it does not.
    pub end_seq: u64,
    pub end: String,
    /// Blocks after the last END: an append torn by a crash, ignored (not
    /// an error), and the records they hold.
    pub torn_blocks: u64,
    pub torn_records: u64,
    /// The counters of the last COUNTERS record applied: the state's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counters: Option<Counters>,
    /// A block that continues the journal but is malformed
    /// (`journal_damaged`): the state checked is the one before the
    /// append it belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub damage: Option<journal::Damage>,
    /// The newest append is unflushed: checked against the data (with
    /// `--data`) and applied or dropped, or applied unchecked. `appends`
    /// and the state do not include a dropped one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unflushed: Option<journal::Unflushed>,
}

impl JournalReport {
    fn of(r: &Replay) -> JournalReport {
        JournalReport {
            start: r.start,
            blocks: r.nr_blocks,
            id: r.id,
            epoch: r.epoch,
            blocks_in_epoch: r.continued,
            appends: r.appends.len() as u64,
            replayed_blocks: r.applied_blocks(),
            records: r.records(),
            end_seq: r.end_seq,
            end: r.end_text(),
            torn_blocks: r.torn_blocks,
            torn_records: r.torn_records,
            counters: r.counters(),
            damage: r.damage.clone(),
            unflushed: r.unflushed.clone(),
        }
    }
}

/// Full result of a check.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub device_blocks: u64,
    pub slots: Vec<SlotReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub superblock: Option<SuperblockInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary: Option<Summary>,
    /// Version 2 with sound journal fields: the journal replayed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal: Option<JournalReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saved: Option<SavedReport>,
    pub errors: u64,
    pub warnings: u64,
    /// Problems counted but not listed (see max_problems).
    pub unlisted_problems: u64,
    pub problems: Vec<Problem>,
}

impl Report {
    pub fn clean(&self) -> bool {
        self.errors == 0
    }

    /// A problem of `code` is listed (not all are: see max_problems).
    pub fn has(&self, code: &str) -> bool {
        self.problems.iter().any(|p| p.code == code)
    }
}

/// The content of the arrays, for `dump`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Contents {
    /// (lba, pba), ascending lba.
    pub mappings: Vec<(u64, u64)>,
    /// (pba, refcount, fingerprint record), ascending pba, refcount > 0.
    pub blocks: Vec<(u64, u32, [u8; FP_SIZE])>,
}

/// Conditions under which the device cannot be checked at all (exit 8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fatal(pub String);

impl std::fmt::Display for Fatal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

struct Problems {
    list: Vec<Problem>,
    max: usize,
    errors: u64,
    warnings: u64,
    unlisted: u64,
}

impl Problems {
    fn push(&mut self, p: Problem) {
        match p.severity {
            Severity::Error => self.errors += 1,
            Severity::Warning => self.warnings += 1,
        }
        if self.max == 0 || self.list.len() < self.max {
            self.list.push(p);
        } else {
            self.unlisted += 1;
        }
    }
}

/// Where a problem is, for building Problems.
#[derive(Clone, Copy, Default)]
struct At {
    block: Option<u64>,
    array: Option<ArrayId>,
    level: Option<u8>,
    index: Option<u64>,
}

impl At {
    fn sb() -> At {
        At::default()
    }
    fn node(block: u64, array: ArrayId, level: u8, index: u64) -> At {
        At {
            block: Some(block),
            array: Some(array),
            level: Some(level),
            index: Some(index),
        }
    }
    fn entry(array: ArrayId, index: u64) -> At {
        At {
            array: Some(array),
            index: Some(index),
            ..At::default()
        }
    }
}

/// Map references per physical block.
enum Counts {
    Dense(Vec<u32>),
    Sparse(HashMap<u64, u32>),
}

impl Counts {
    fn new(n: u64, dense_limit: u64) -> Counts {
        if n <= dense_limit {
            Counts::Dense(vec![0; n as usize])
        } else {
            Counts::Sparse(HashMap::new())
        }
    }
    fn inc_all(&mut self, pbas: &[u64]) {
        match self {
            Counts::Dense(v) => {
                for &p in pbas {
                    let c = &mut v[p as usize];
                    *c = c.saturating_add(1);
                }
            }
            Counts::Sparse(m) => {
                for &p in pbas {
                    let c = m.entry(p).or_insert(0);
                    *c = c.saturating_add(1);
                }
            }
        }
    }
    fn take(&mut self, pba: u64) -> u32 {
        match self {
            Counts::Dense(v) => v
                .get_mut(pba as usize)
                .map(std::mem::take)
                .unwrap_or_default(),
            Counts::Sparse(m) => m.remove(&pba).unwrap_or(0),
        }
    }
    fn remaining(&self) -> Vec<(u64, u32)> {
        match self {
            Counts::Dense(v) => v
                .iter()
                .enumerate()
                .filter(|(_, &c)| c != 0)
                .map(|(i, &c)| (i as u64, c))
                .collect(),
            Counts::Sparse(m) => {
                let mut r: Vec<_> = m.iter().map(|(&k, &v)| (k, v)).collect();
                r.sort_unstable();
                r
            }
        }
    }
}

/// Physical blocks with refcount > 0 not yet matched with a fingerprint.
enum Live {
    Dense(Vec<u64>),
    Sparse(HashSet<u64>),
}

impl Live {
    fn new(n: u64, dense_limit: u64) -> Live {
        if n <= dense_limit {
            Live::Dense(vec![0; n.div_ceil(64) as usize])
        } else {
            Live::Sparse(HashSet::new())
        }
    }
    fn insert(&mut self, pba: u64) {
        match self {
            Live::Dense(v) => v[(pba / 64) as usize] |= 1 << (pba % 64),
            Live::Sparse(s) => {
                s.insert(pba);
            }
        }
    }
    fn contains(&self, pba: u64) -> bool {
        match self {
            Live::Dense(v) => v
                .get((pba / 64) as usize)
                .is_some_and(|w| w & (1 << (pba % 64)) != 0),
            Live::Sparse(s) => s.contains(&pba),
        }
    }
    /// Remove `pba`; true if it was there.
    fn remove(&mut self, pba: u64) -> bool {
        match self {
            Live::Dense(v) => match v.get_mut((pba / 64) as usize) {
                Some(w) => {
                    let bit = 1u64 << (pba % 64);
                    let was = *w & bit != 0;
                    *w &= !bit;
                    was
                }
                None => false,
            },
            Live::Sparse(s) => s.remove(&pba),
        }
    }
    fn remaining(&self) -> Vec<u64> {
        match self {
            Live::Dense(v) => {
                let mut r = Vec::new();
                for (i, &w) in v.iter().enumerate() {
                    let mut w = w;
                    while w != 0 {
                        let b = w.trailing_zeros() as u64;
                        r.push(i as u64 * 64 + b);
                        w &= w - 1;
                    }
                }
                r
            }
            Live::Sparse(s) => {
                let mut r: Vec<_> = s.iter().copied().collect();
                r.sort_unstable();
                r
            }
        }
    }
}

/// Entry ranges [first, end) of an array that could not be read, sorted
/// and disjoint (touching ones merged), so that `contains` is a binary
/// search: `finish` asks it for every block left over.
#[derive(Default)]
struct Damaged(Vec<(u64, u64)>);

impl Damaged {
    /// The depth-first walk adds ranges in index order, each at or after
    /// the last one's end: then this appends (or extends the last one).
    /// Any other range is merged into its place.
    fn add(&mut self, (mut a, mut b): (u64, u64)) {
        if a >= b {
            return;
        }
        // The ranges that overlap or touch [a, b): [i, j).
        let i = self.0.partition_point(|&(_, e)| e < a);
        let j = i + self.0[i..].partition_point(|&(s, _)| s <= b);
        if i < j {
            a = a.min(self.0[i].0);
            b = b.max(self.0[j - 1].1);
        }
        self.0.splice(i..j, [(a, b)]);
    }
    fn contains(&self, i: u64) -> bool {
        let k = self.0.partition_point(|&(_, e)| e <= i);
        self.0.get(k).is_some_and(|&(a, _)| a <= i)
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn entries(&self) -> u64 {
        self.0.iter().map(|&(a, b)| b - a).sum()
    }
}

/// The sizes of the table the device is to be loaded with: those named
/// (--logical-blocks; --data-blocks or the size of the --data device),
/// else the superblock's. dd_check_sb() refuses a smaller table; dd_grow()
/// grows the device to a larger one at activation.
#[derive(Clone, Copy, Debug)]
struct Table {
    logical_blocks: u64,
    data_blocks: u64,
    /// The data size is the --data device's, not a --data-blocks.
    data_from_device: bool,
}

impl Table {
    /// A table of the superblock's sizes.
    fn of(sb: &Superblock) -> Table {
        Table {
            logical_blocks: sb.logical_blocks,
            data_blocks: sb.data_blocks,
            data_from_device: false,
        }
    }

    /// The entries array `id` has at the table's sizes.
    fn entries(&self, id: ArrayId) -> Option<u64> {
        match id {
            ArrayId::Map => Some(self.logical_blocks),
            ArrayId::Refcount | ArrayId::Fingerprint => Some(self.data_blocks),
            ArrayId::Saved => None,
        }
    }

    /// The entries array `id` grows to (dd_grow() calls dd_array_grow()
    /// for it), if more than it has at the superblock's sizes.
    fn grows(&self, sb: &Superblock, id: ArrayId) -> Option<u64> {
        let has = Table::of(sb).entries(id)?;
        self.entries(id).filter(|&n| n > has)
    }
}

struct Walker<'a> {
    dev: &'a dyn BlockDev,
    /// The state checked: the chosen superblock with the journal's
    /// counters.
    sb: &'a Superblock,
    /// The table's sizes, which may grow the arrays.
    table: Table,
    /// The journal's new values, laid over the trees as replay sets them.
    overlay: Overlay,
    /// Whole appends replayed (a save is then stale).
    journal_appends: u64,
    problems: Problems,
    /// Owner (array id) of each metadata block reached so far; 0 = none.
    owner: Vec<u8>,
    counts: Counts,
    live: Live,
    /// Per array id - 1, the save's included.
    damaged: [Damaged; 4],
    summary: Summary,
    fp_size: usize,
    contents: Option<Contents>,
    /// Fingerprints of live blocks, for dump.
    fps: Vec<(u64, [u8; FP_SIZE])>,
    first_placeholder: u64,
    /// The data device and the superblock's hash, to verify records.
    data: Option<(&'a (dyn BlockDev + Sync), Hasher)>,
    /// (pba, fingerprint leaf, record) of live blocks not yet verified;
    /// no leaf for an entry only the journal holds.
    unverified: Vec<(u64, Option<u64>, [u8; FP_SIZE])>,
    /// The save the superblock names, while it is checked.
    saved: Option<saved::SavedWalk>,
}

impl Walker<'_> {
    fn report(&mut self, sev: Severity, code: &'static str, at: At, message: String) {
        self.problems.push(Problem {
            severity: sev,
            code,
            block: at.block,
            array: at.array.map(ArrayId::name),
            level: at.level,
            index: at.index,
            message,
        });
    }

    /// An error of the trees; in the save (which the walk visits too),
    /// only a reason for the kernel not to load it.
    fn error(&mut self, code: &'static str, at: At, message: String) {
        if at.array == Some(ArrayId::Saved) {
            return self.saved_unreadable(at, format!("{message} [{code}]"));
        }
        self.report(Severity::Error, code, at, message)
    }

    fn warn(&mut self, code: &'static str, at: At, message: String) {
        self.report(Severity::Warning, code, at, message)
    }

    fn walk_array(&mut self, id: ArrayId) {
        let g = self.sb.geometry(id);
        let root = self.sb.root(id);
        if root == 0 {
            // An empty array: the journal may still set entries.
            self.absent(&g, 0, g.height);
            return;
        }
        if g.nr_entries == 0 {
            self.error(
                "root_of_empty_array",
                At {
                    array: Some(id),
                    ..At::sb()
                },
                format!(
                    "the {} array has no entries but its root is block {root}",
                    id.name()
                ),
            );
            return;
        }
        self.walk(&g, root, g.height, 0, None);
    }

    /// Visit block `b`, at `level`, covering leaves from `leaf_base`.
    /// `parent` is (parent block, slot) for messages about the pointer.
    fn walk(
        &mut self,
        g: &Geometry,
        b: u64,
        level: u8,
        leaf_base: u64,
        parent: Option<(u64, u32)>,
    ) {
        let id = g.id;
        let range = g.entry_range(leaf_base, level);
        let ptr_at = match parent {
            Some((pb, _)) => At::node(pb, id, level + 1, range.0),
            None => At {
                array: Some(id),
                index: Some(range.0),
                ..At::sb()
            },
        };
        let ptr_name = match parent {
            Some((_, slot)) => format!("child {slot}"),
            None => format!("{}_root", id.name()),
        };
        if b < FIRST_TREE_BLOCK || b >= self.sb.metadata_blocks {
            self.error(
                "block_out_of_range",
                ptr_at,
                format!(
                    "{ptr_name} points to block {b}, outside the tree area [{FIRST_TREE_BLOCK}, {})",
                    self.sb.metadata_blocks
                ),
            );
            self.damaged[id as usize - 1].add(range);
            return;
        }
        let owner = self.owner[b as usize];
        if owner == JOURNAL_OWNER {
            self.error(
                "journal_overlap",
                ptr_at,
                format!(
                    "{ptr_name} points to block {b}, inside the journal's run [{}, {}): the kernel \
                     refuses to activate",
                    self.sb.journal_start,
                    self.sb.journal_start + self.sb.journal_blocks
                ),
            );
            self.damaged[id as usize - 1].add(range);
            return;
        }
        if owner != 0 {
            let first = ArrayId::from_u8(owner).map_or("?", ArrayId::name);
            self.error(
                "referenced_twice",
                ptr_at,
                format!("{ptr_name} points to block {b}, already used by the {first} array"),
            );
            self.damaged[id as usize - 1].add(range);
            return;
        }
        self.owner[b as usize] = id as u8;
        match id {
            ArrayId::Map => self.summary.map_blocks += 1,
            ArrayId::Refcount => self.summary.refcount_blocks += 1,
            ArrayId::Fingerprint => self.summary.fingerprint_blocks += 1,
            ArrayId::Saved => {
                if let Some(s) = self.saved.as_mut() {
                    s.blocks += 1;
                }
            }
        }
        let at = At::node(b, id, level, range.0);
        let mut blk = zero_block();
        if let Err(e) = self.dev.read_block(b, &mut blk) {
            self.error("read_error", at, format!("cannot read: {e}"));
            self.damaged[id as usize - 1].add(range);
            return;
        }
        if !self.block_ok(&blk, b, id, level, at) {
            self.damaged[id as usize - 1].add(range);
            return;
        }
        if level > 0 {
            for slot in 0..INTERIOR_FANOUT as u32 {
                let off = HEADER_SIZE + slot as usize * 8;
                let child = le64(&blk[..], off);
                if child == 0 {
                    // An absent subtree reads as zeros, but for what the
                    // journal sets in it.
                    if let Some(first_leaf) = g.child_first_leaf(leaf_base, level, slot) {
                        self.absent(g, first_leaf, level - 1);
                    }
                    continue;
                }
                match g.child_first_leaf(leaf_base, level, slot) {
                    None => self.error(
                        "child_beyond_end",
                        at,
                        format!(
                            "child {slot} (block {child}) lies beyond the end of the array ({} entries)",
                            g.nr_entries
                        ),
                    ),
                    Some(first_leaf) => self.walk(g, child, level - 1, first_leaf, Some((b, slot))),
                }
            }
        } else {
            self.leaf(g, &blk, b, leaf_base);
        }
    }

    /// Checksum, location, kind and transaction of a tree block.
    fn block_ok(&mut self, blk: &Block, b: u64, id: ArrayId, level: u8, at: At) -> bool {
        if let Some((code, why)) = tree_block_fault(blk, b, id, level) {
            self.error(code, at, why);
            return false;
        }
        let h = Header::decode(&blk[..]);
        let gen = self.sb.generation();
        if id == ArrayId::Saved {
            self.saved_block_txn(h.txn, at);
        } else if h.txn == 0 || h.txn > gen {
            self.error(
                "bad_txn",
                at,
                format!(
                    "written by transaction {}, not in 1..={gen} (the superblock generation); \
                     the kernel would change it in place",
                    h.txn
                ),
            );
        }
        if h.reserved1 != 0 || h.reserved2 != 0 {
            self.warn(
                "reserved_nonzero",
                at,
                format!(
                    "reserved header fields are not zero ({:#06x}, {:#010x})",
                    h.reserved1, h.reserved2
                ),
            );
        }
        true
    }

    fn leaf(&mut self, g: &Geometry, blk: &Block, b: u64, leaf_nr: u64) {
        let id = g.id;
        let es = g.entry_size as usize;
        let first = leaf_nr * g.per_leaf as u64;
        let count = g.leaf_count(leaf_nr) as usize;
        let payload = &blk[HEADER_SIZE..];
        if !is_zero(&payload[count * es..]) {
            let from = first + count as u64;
            let at = At::node(b, id, 0, from);
            let what =
                format!("entries past the end of the array (from index {from}) are not zero");
            // dd_array_grow() reads them in the last leaf of an array
            // that grows, and refuses (-EILSEQ) if any is not zero.
            match self.table.grows(self.sb, id) {
                Some(n) => self.error(
                    "tail_nonzero",
                    at,
                    format!(
                        "{what}: the kernel refuses to grow the array to the table's {n} entries \
                         (\"non-zero entries past its end\")"
                    ),
                ),
                None => self.warn("tail_nonzero", at, what),
            }
        }
        if id == ArrayId::Saved {
            return self.saved_leaf(payload, first, count);
        }
        let end = first + count as u64;
        if self.journal_appends > 0 && self.overlay.touches(id, first, end) {
            let mut patched = payload.to_vec();
            self.lay_over(id, first, end, &mut patched);
            return self.entries(g, &patched, Some(b), leaf_nr);
        }
        self.entries(g, payload, Some(b), leaf_nr)
    }

    /// Put the journal's values of array `id` in [first, end) into the
    /// entries of the leaf whose first index is `first`.
    fn lay_over(&self, id: ArrayId, first: u64, end: u64, payload: &mut [u8]) {
        let es = id.entry_size() as usize;
        for (i, v) in self.overlay.entries(id, first, end) {
            let off = (i - first) as usize * es;
            payload[off..off + es].copy_from_slice(&v[..es]);
        }
    }

    /// A subtree that is absent (its pointer or the root is 0), at
    /// `level`, from leaf `leaf_base`: its entries read as zero, except
    /// those the journal sets, which replay puts into new leaves.
    fn absent(&mut self, g: &Geometry, leaf_base: u64, level: u8) {
        if self.journal_appends == 0 {
            return;
        }
        let (first, end) = g.entry_range(leaf_base, level);
        let set = self.overlay.entries(g.id, first, end);
        let per_leaf = g.per_leaf as u64;
        let mut k = 0;
        while k < set.len() {
            let leaf_nr = set[k].0 / per_leaf;
            let lf = leaf_nr * per_leaf;
            let le = lf + g.leaf_count(leaf_nr) as u64;
            let mut payload = vec![0u8; PAYLOAD_SIZE];
            self.lay_over(g.id, lf, le, &mut payload);
            self.entries(g, &payload, None, leaf_nr);
            while k < set.len() && set[k].0 < le {
                k += 1;
            }
        }
    }

    /// The entries of leaf `leaf_nr` (at metadata block `b`; None for one
    /// only the journal creates).
    fn entries(&mut self, g: &Geometry, payload: &[u8], b: Option<u64>, leaf_nr: u64) {
        let id = g.id;
        let es = g.entry_size as usize;
        let first = leaf_nr * g.per_leaf as u64;
        let count = g.leaf_count(leaf_nr) as usize;
        if id == ArrayId::Map {
            // Counting is a random access per entry into a table of 4 bytes
            // per data block, a cache miss each on a large device: done in
            // a tight loop after the checks, so that the misses overlap.
            let mut pbas = [0u64; INTERIOR_FANOUT as usize];
            let mut n = 0;
            for i in 0..count {
                if let Some(pba) = self.map_entry(first + i as u64, le64(payload, i * 8), b) {
                    pbas[n] = pba;
                    n += 1;
                }
            }
            self.counts.inc_all(&pbas[..n]);
            return;
        }
        for i in 0..count {
            let e = &payload[i * es..(i + 1) * es];
            let index = first + i as u64;
            match id {
                ArrayId::Map | ArrayId::Saved => unreachable!("handled above"),
                ArrayId::Refcount => self.refcount_entry(index, le32(e, 0), b),
                ArrayId::Fingerprint => self.fingerprint_entry(index, e.try_into().unwrap(), b),
            }
        }
    }

    /// A map entry's checks; the PBA to count, if it is one.
    fn map_entry(&mut self, lba: u64, v: u64, b: Option<u64>) -> Option<u64> {
        if v == 0 {
            return None;
        }
        self.summary.mapped_blocks += 1;
        if v > self.sb.data_blocks {
            self.error(
                "map_beyond_data",
                At {
                    block: b,
                    ..At::entry(ArrayId::Map, lba)
                },
                format!(
                    "maps to physical block {}, beyond the data device ({} blocks)",
                    v - 1,
                    self.sb.data_blocks
                ),
            );
            return None;
        }
        if let Some(c) = self.contents.as_mut() {
            c.mappings.push((lba, v - 1));
        }
        Some(v - 1)
    }

    fn refcount_entry(&mut self, pba: u64, rc: u32, b: Option<u64>) {
        let refs = self.counts.take(pba);
        if rc != refs && self.damaged[ArrayId::Map as usize - 1].is_empty() {
            self.error(
                "refcount_mismatch",
                At {
                    block: b,
                    ..At::entry(ArrayId::Refcount, pba)
                },
                format!("refcount is {rc} but {refs} map entries point at it"),
            );
        }
        if rc == 0 {
            return;
        }
        self.summary.live_blocks += 1;
        // Damaged refcounts may sum past 2^64: the top then matches no
        // mapped_blocks, and finish() reports the mismatch.
        self.summary.refcount_sum = self.summary.refcount_sum.saturating_add(rc as u64);
        self.live.insert(pba);
        if let Some(s) = self.saved.as_mut() {
            s.live.insert(pba);
        }
        if let Some(c) = self.contents.as_mut() {
            c.blocks.push((pba, rc, [0; FP_SIZE]));
        }
    }

    fn fingerprint_entry(&mut self, pba: u64, fp: &[u8; FP_SIZE], b: Option<u64>) {
        let zero = is_zero(fp);
        if !self.live.remove(pba) {
            if !zero {
                self.summary.stale_fingerprints += 1;
            }
            return;
        }
        let at = At {
            block: b,
            ..At::entry(ArrayId::Fingerprint, pba)
        };
        if zero {
            if self.fp_size >= STRONG_FP_SIZE {
                self.error(
                    "missing_fingerprint",
                    at,
                    "live block (refcount > 0) has an all-zero fingerprint record".into(),
                );
                return;
            }
            // A short digest (crc32c, xxhash64 with verify) can be zero.
            self.warn(
                "zero_fingerprint",
                at,
                format!(
                    "live block has an all-zero fingerprint: possible for a {}-byte digest, \
                     but it may also be a lost record",
                    self.fp_size
                ),
            );
        }
        self.summary.fingerprinted_blocks += 1;
        if fingerprint::is_placeholder(pba, fp, self.fp_size) {
            if self.summary.placeholder_fingerprints == 0 {
                self.first_placeholder = pba;
            }
            self.summary.placeholder_fingerprints += 1;
        } else if self.data.is_some() {
            self.unverified.push((pba, b, *fp));
            if self.unverified.len() >= VERIFY_BATCH {
                self.verify_data();
            }
        }
        if !is_zero(&fp[self.fp_size..]) {
            self.warn(
                "fingerprint_tail",
                at,
                format!(
                    "fingerprint bytes past fp_size ({}) are not zero: the block can never be matched",
                    self.fp_size
                ),
            );
        }
        if self.contents.is_some() {
            self.fps.push((pba, *fp));
        }
    }

    /// Compare the records waiting in `unverified` with the digests of
    /// their data blocks.
    fn verify_data(&mut self) {
        let Some((data, hasher)) = self.data else {
            return;
        };
        let mut batch = std::mem::take(&mut self.unverified);
        // Sorted, consecutive live blocks are read in one request. (The
        // walk already visits leaves in index order.)
        batch.sort_unstable_by_key(|u| u.0);
        let pbas: Vec<u64> = batch.iter().map(|u| u.0).collect();
        let digests = fingerprint::digest_blocks(data, hasher, &pbas);
        let n = self.fp_size;
        for ((pba, b, rec), digest) in batch.into_iter().zip(digests) {
            let at = At {
                block: b,
                ..At::entry(ArrayId::Fingerprint, pba)
            };
            let s = &mut self.summary;
            match digest {
                Ok((d, _)) if d[..n] == rec[..n] => *s.data_blocks_verified.get_or_insert(0) += 1,
                Ok((d, zero)) => {
                    *s.fingerprint_mismatches.get_or_insert(0) += 1;
                    self.error(
                        "fingerprint_mismatch",
                        at,
                        format!(
                            "the record ({}) differs from the {} of the data block ({}{}): the data \
                             or the record is damaged, and a later write of the content the record \
                             names would be mapped onto this block and read back other bytes; \
                             `dedup repair --force --data DEV` replaces the record and names the \
                             logical blocks that read this one",
                            short_hex(&rec[..n]),
                            self.sb.hash(),
                            short_hex(&d[..n]),
                            if zero { ", all zeros" } else { "" }
                        ),
                    );
                }
                Err(e) => {
                    *s.data_read_errors.get_or_insert(0) += 1;
                    self.error(
                        "data_read_error",
                        at,
                        format!("the data block {e}; its record is not verified"),
                    );
                }
            }
        }
    }

    /// What replay found wrong with the journal: damage (the kernel
    /// refuses to activate), or a block it could not read.
    fn check_journal(&mut self, r: &Replay) {
        let mut at = |sev, code, block: u64, seq: u64, message: String| {
            self.problems.push(Problem {
                severity: sev,
                code,
                block: Some(block),
                array: Some("journal"),
                level: None,
                index: Some(seq),
                message,
            })
        };
        if let Some(d) = &r.damage {
            let wher = d
                .offset
                .map_or(String::new(), |o| format!(" (record at offset {o})"));
            at(
                Severity::Error,
                "journal_damaged",
                d.block,
                d.seq,
                format!(
                    "the block continues the journal but is malformed: {}{wher}; the kernel \
                     refuses to activate. Checked: the state before the append that starts at \
                     sequence {} ({} blocks from there dropped by `dedup repair`)",
                    d.why, d.append_seq, r.dropped.blocks
                ),
            );
        }
        if let journal::End::ReadError { seq, block, error } = &r.end {
            at(
                Severity::Error,
                "read_error",
                *block,
                *seq,
                format!("journal block cannot be read: {error}; the kernel cannot replay"),
            );
        }
    }

    /// After the walks: what the per-block passes could not see.
    fn finish(&mut self) {
        self.verify_data();
        let map_damaged = !self.damaged[ArrayId::Map as usize - 1].is_empty();
        if map_damaged {
            let n = self.damaged[ArrayId::Map as usize - 1].entries();
            self.warn(
                "refcounts_unverified",
                At {
                    array: Some(ArrayId::Refcount),
                    ..At::sb()
                },
                format!(
                    "refcounts were not compared with the map: {n} map entries could not be read"
                ),
            );
        } else {
            for (pba, refs) in self.counts.remaining() {
                if self.damaged[ArrayId::Refcount as usize - 1].contains(pba) {
                    continue;
                }
                self.error(
                    "refcount_mismatch",
                    At::entry(ArrayId::Refcount, pba),
                    format!("refcount is 0 (no refcount leaf) but {refs} map entries point at it"),
                );
            }
        }
        for pba in self.live.remaining() {
            if self.damaged[ArrayId::Fingerprint as usize - 1].contains(pba) {
                continue;
            }
            self.error(
                "missing_fingerprint",
                At::entry(ArrayId::Fingerprint, pba),
                "live block (refcount > 0) has no fingerprint record (no fingerprint leaf)".into(),
            );
        }
        let n = self.summary.placeholder_fingerprints;
        if n > 0 {
            self.warn(
                "placeholder_fingerprint",
                At::entry(ArrayId::Fingerprint, self.first_placeholder),
                format!(
                    "{n} live blocks (the first is this one) carry the placeholder record `dedup repair` \
                     writes for a lost fingerprint: they are readable but never deduplicated against; \
                     `dedup repair --force --data DEV` recomputes them"
                ),
            );
        }
        let s = &self.summary;
        let (mapped, refsum, live) = (s.mapped_blocks, s.refcount_sum, s.live_blocks);
        if !map_damaged && mapped != self.sb.mapped_blocks {
            self.error(
                "counter_mismatch",
                At::sb(),
                format!(
                    "the map has {mapped} mapped entries but the superblock says mapped_blocks {}",
                    self.sb.mapped_blocks
                ),
            );
        }
        if self.damaged[ArrayId::Refcount as usize - 1].is_empty() {
            if refsum != self.sb.mapped_blocks {
                self.error(
                    "counter_mismatch",
                    At::sb(),
                    format!(
                        "refcounts sum to {refsum} but the superblock says mapped_blocks {}",
                        self.sb.mapped_blocks
                    ),
                );
            }
            if live != self.sb.used_data_blocks {
                self.error(
                    "counter_mismatch",
                    At::sb(),
                    format!(
                        "{live} physical blocks have refcount > 0 but the superblock says used_data_blocks {}",
                        self.sb.used_data_blocks
                    ),
                );
            }
        }
        let s = &mut self.summary;
        s.metadata_blocks_used =
            SB_SLOTS + s.map_blocks + s.refcount_blocks + s.fingerprint_blocks + s.journal_blocks;
        s.metadata_blocks_total = self.sb.metadata_blocks;
        s.dedup_ratio = if s.live_blocks == 0 {
            1.0
        } else {
            s.mapped_blocks as f64 / s.live_blocks as f64
        };
        if let Some(c) = self.contents.as_mut() {
            let fps = std::mem::take(&mut self.fps);
            for blk in c.blocks.iter_mut() {
                if let Ok(i) = fps.binary_search_by_key(&blk.0, |f| f.0) {
                    blk.2 = fps[i].1;
                }
            }
        }
    }
}

/// Rules on the superblock's own fields, whatever the device: what
/// dd_check_sb() demands and plain sanity of the counters. Shared with
/// restore's validation of a dump.
pub fn superblock_rules(sb: &Superblock) -> Vec<(Severity, &'static str, String)> {
    let mut v = Vec::new();
    let mut e = |code, msg: String| v.push((Severity::Error, code, msg));
    if sb.block_size != BLOCK_SIZE as u32 {
        e(
            "superblock",
            format!("block_size is {}, must be {BLOCK_SIZE}", sb.block_size),
        );
    }
    if sb.fp_size > FP_SIZE as u32 || sb.fp_size < 4 {
        e(
            "superblock",
            format!("fp_size is {}, must be 4..={FP_SIZE}", sb.fp_size),
        );
    }
    let hash = sb.hash();
    let name_len = sb.hash_name.iter().position(|&c| c == 0);
    if name_len.is_none() {
        e("superblock", "hash_name is not NUL terminated".into());
    }
    let name = &sb.hash_name[..name_len.unwrap_or(HASH_NAME_LEN)];
    if hash.is_empty() {
        e("superblock", "hash_name is empty".into());
    } else if !name.iter().all(|c| c.is_ascii_graphic()) {
        e(
            "superblock",
            format!("hash_name {hash:?} is not a crypto API name"),
        );
    } else if let Some(fp) = hash_fp_size(&hash) {
        if fp != sb.fp_size {
            e(
                "superblock",
                format!("fp_size is {} but hash {hash} keeps {fp} bytes", sb.fp_size),
            );
        }
    }
    if sb.data_blocks == 0 {
        e("superblock", "data_blocks is 0".into());
    }
    if sb.logical_blocks == 0 {
        e("superblock", "logical_blocks is 0".into());
    }
    if sb.generation() == 0 {
        e(
            "superblock",
            "generation is 0 (the first commit is generation 1)".into(),
        );
    }
    if sb.generation() > MAX_TXN {
        e(
            "txn_too_large",
            format!(
                "generation {} is above {MAX_TXN} (2^64 - 2^32 - 1, DD_MAX_TXN), the highest \
                 transaction id the kernel accepts: it refuses to activate the device (commits \
                 from here could wrap the id and make the older slot win)",
                sb.generation()
            ),
        );
    }
    if sb.mapped_blocks > sb.logical_blocks {
        e(
            "counter_mismatch",
            format!(
                "mapped_blocks {} exceeds logical_blocks {}",
                sb.mapped_blocks, sb.logical_blocks
            ),
        );
    }
    if sb.used_data_blocks > sb.data_blocks {
        e(
            "counter_mismatch",
            format!(
                "used_data_blocks {} exceeds data_blocks {}",
                sb.used_data_blocks, sb.data_blocks
            ),
        );
    }
    if sb.used_data_blocks > sb.mapped_blocks {
        e(
            "counter_mismatch",
            format!(
                "used_data_blocks {} exceeds mapped_blocks {} (a live block has a reference)",
                sb.used_data_blocks, sb.mapped_blocks
            ),
        );
    }
    if sb.flags & !SB_KNOWN_FLAGS != 0 {
        // Its own code: the sizes and roots stay usable for repair.
        e(
            "unknown_flags",
            format!(
                "unknown flags {:#x}: the kernel refuses to activate",
                sb.flags & !SB_KNOWN_FLAGS
            ),
        );
    }
    if sb.flags & SB_NEEDS_CHECK != 0 {
        v.push((
            Severity::Warning,
            "needs_check",
            "flag needs_check is set: the kernel found damage while running and opens \
             the device read-only until `dedup check --clear-needs-check` (once clean) or \
             `dedup repair` clears it"
                .into(),
        ));
    }
    v
}

/// Superblock-level invariants, including those that involve the device
/// and the table the user named. `sb` is the state: the chosen superblock
/// with the journal's counters.
fn check_superblock(sb: &Superblock, dev_blocks: u64, opts: &CheckOptions, w: &mut Walker<'_>) {
    for (sev, code, msg) in superblock_rules(sb) {
        w.report(sev, code, At::sb(), msg);
    }
    if let Some(why) = sb.journal_fault() {
        w.error(
            "journal_run",
            At::sb(),
            format!("{why}: the kernel refuses to activate (journal fields)"),
        );
    }
    let e = |w: &mut Walker<'_>, code, msg: String| w.error(code, At::sb(), msg);
    if sb.metadata_blocks < FIRST_TREE_BLOCK {
        e(
            w,
            "superblock",
            format!("metadata_blocks is {}", sb.metadata_blocks),
        );
    }
    // dd_md_open(): room for the trees at the table's sizes beside the
    // journal run the superblock names (none in version 1). A smaller
    // table is refused before that (below): the superblock's sizes are
    // the least a table the kernel loads has.
    let t = w.table;
    let (l, d) = (
        t.logical_blocks.max(sb.logical_blocks),
        t.data_blocks.max(sb.data_blocks),
    );
    let need = open_blocks(l, d).saturating_add(sb.journal_blocks);
    if dev_blocks < need {
        e(
            w,
            "device_too_small",
            format!(
                "the device has {dev_blocks} blocks but {l} logical and {d} data blocks need {need}: \
                 the kernel refuses to activate (\"metadata device too small\")"
            ),
        );
    }
    // dd_check_sb(): a smaller table is refused, a larger one grown.
    let data_named = if t.data_from_device {
        format!("the data device (--data) has {} blocks,", t.data_blocks)
    } else {
        format!("--data-blocks {} is", t.data_blocks)
    };
    for (named, field, what, n, has) in [
        (
            data_named,
            "data_blocks",
            "data device",
            t.data_blocks,
            sb.data_blocks,
        ),
        (
            format!("--logical-blocks {} is", t.logical_blocks),
            "logical_blocks",
            "logical size",
            t.logical_blocks,
            sb.logical_blocks,
        ),
    ] {
        if n < has {
            e(
                w,
                "table_mismatch",
                format!(
                    "{named} smaller than {field} {has}: the kernel refuses a smaller table \
                     (\"cannot shrink the {what} (field {field})\")"
                ),
            );
        } else if n > has {
            let mut msg = format!(
                "{named} larger than {field} {has}: the kernel grows the {what} to {n} blocks \
                 when it activates this table (not a read-only table: \"cannot grow a \
                 read-only device\")"
            );
            if sb.flags & SB_NEEDS_CHECK != 0 {
                msg += "; needs_check is set, so it opens the device read-only and refuses the \
                        table (\"cannot grow a device flagged needs_check: run dedup check \
                        first\") until `dedup check --clear-needs-check` clears the flag";
            }
            w.warn("table_grows", At::sb(), msg);
        }
    }
    // dd_check_sb(): no growth at DD_MAX_TXN (above it, txn_too_large:
    // refused before).
    let grows = t.logical_blocks > sb.logical_blocks || t.data_blocks > sb.data_blocks;
    if grows && sb.generation() == MAX_TXN {
        e(
            w,
            "grow_refused",
            format!(
                "the table is larger than the metadata, but generation {MAX_TXN} is the \
                 transaction id limit (DD_MAX_TXN): the kernel refuses it (\"cannot grow at the \
                 transaction id limit: run dedup repair\")"
            ),
        );
    }
    if let Some(h) = &opts.hash {
        let hash = sb.hash();
        if *h != hash {
            e(
                w,
                "table_mismatch",
                format!("hash differs from the metadata: --hash {h}, hash_name {hash}"),
            );
        }
    }
}

/// Read both superblock slots.
pub fn read_slots(dev: &dyn BlockDev) -> Vec<SlotState> {
    (0..SB_SLOTS)
        .map(|slot| {
            let mut b = zero_block();
            match dev.read_block(slot, &mut b) {
                Ok(()) => classify_slot(slot, &b),
                Err(e) => SlotState::Bad(format!("cannot read: {e}")),
            }
        })
        .collect()
}

fn slot_reports(states: &[SlotState]) -> Vec<SlotReport> {
    states
        .iter()
        .enumerate()
        .map(|(i, st)| SlotReport {
            slot: i as u64,
            state: st.label(),
            reason: match st {
                SlotState::Bad(r) => Some(r.clone()),
                _ => None,
            },
            generation: match st {
                SlotState::Valid(sb) => Some(sb.generation()),
                _ => None,
            },
        })
        .collect()
}

/// True if block 2 looks like a tree block or a journal block of this
/// format (where the kernel and `dedup format` put the journal): what is
/// left when both superblocks were wiped.
fn has_tree_blocks(dev: &dyn BlockDev) -> bool {
    let mut b = zero_block();
    if dev.read_block(FIRST_TREE_BLOCK, &mut b).is_err() || !csum_ok(&b) {
        return false;
    }
    let h = Header::decode(&b[..]);
    h.blocknr == FIRST_TREE_BLOCK
        && (h.btype == BT_JOURNAL
            || ((h.btype == BT_INTERIOR || h.btype == BT_LEAF)
                && ArrayId::from_u8(h.array).is_some()))
}

/// A fingerprint in messages: its first 8 bytes.
fn short_hex(fp: &[u8]) -> String {
    if fp.len() > 8 {
        format!("{}...", hex(&fp[..8]))
    } else {
        hex(fp)
    }
}

/// Check the metadata on `dev`.
pub fn check(dev: &dyn BlockDev, opts: &CheckOptions) -> Result<(Report, Option<Contents>), Fatal> {
    check_with_data(dev, None, opts)
}

/// Check the metadata on `dev` and, if `data` is given, verify every live
/// block's fingerprint record against its content on `data`. A data device
/// of another size or a hash this tool cannot compute is fatal.
pub fn check_with_data(
    dev: &dyn BlockDev,
    data: Option<&(dyn BlockDev + Sync)>,
    opts: &CheckOptions,
) -> Result<(Report, Option<Contents>), Fatal> {
    let dev_blocks = dev.nr_blocks();
    if dev_blocks < SB_SLOTS {
        return Err(Fatal(format!(
            "too small to be a dm-dedup metadata device ({dev_blocks} whole 4 KiB blocks; \
             the superblock slots alone need {SB_SLOTS})"
        )));
    }
    let states = read_slots(dev);
    let slots = slot_reports(&states);
    let mut problems = Problems {
        list: Vec::new(),
        max: opts.max_problems,
        errors: 0,
        warnings: 0,
        unlisted: 0,
    };
    let Some(best) = pick_superblock(&states) else {
        let zero = states.iter().all(|s| *s == SlotState::Zero);
        let magic = (0..SB_SLOTS).any(|slot| {
            let mut b = zero_block();
            dev.read_block(slot, &mut b).is_ok() && le64(&b[..], 32) == SB_MAGIC
        });
        if !magic && !has_tree_blocks(dev) {
            return Err(Fatal(if zero {
                "not formatted: both superblock slots are zero (the kernel formats such a device \
                 on first activation; `dedup format` does it offline)"
                    .into()
            } else {
                "not a dm-dedup metadata device: no superblock magic in blocks 0 and 1".into()
            }));
        }
        let why: Vec<String> = states
            .iter()
            .enumerate()
            .map(|(i, s)| match s {
                SlotState::Bad(r) => format!("slot {i}: {r}"),
                _ => format!("slot {i}: {}", s.label()),
            })
            .collect();
        problems.push(Problem {
            severity: Severity::Error,
            code: "no_valid_superblock",
            block: None,
            array: None,
            level: None,
            index: None,
            message: format!(
                "no valid superblock, but the device holds dm-dedup metadata ({})",
                why.join("; ")
            ),
        });
        return Ok((
            Report {
                device_blocks: dev_blocks,
                slots,
                superblock: None,
                summary: None,
                journal: None,
                saved: None,
                errors: problems.errors,
                warnings: problems.warnings,
                unlisted_problems: problems.unlisted,
                problems: problems.list,
            },
            None,
        ));
    };
    let SlotState::Valid(sb) = &states[best] else {
        unreachable!()
    };
    let sb: &Superblock = sb;
    if sb.version != FORMAT_VERSION && sb.version != FORMAT_VERSION_V1 {
        return Err(Fatal(format!(
            "metadata format version {} is not supported (this tool knows versions \
             {FORMAT_VERSION_V1} and {FORMAT_VERSION})",
            sb.version
        )));
    }
    if sb.metadata_blocks > dev_blocks {
        return Err(Fatal(format!(
            "the device is truncated or too small: the superblock (slot {best}) says {} metadata \
             blocks, the device has {dev_blocks}",
            sb.metadata_blocks
        )));
    }
    let table = match (opts.data_blocks, data.map(|d| d.nr_blocks())) {
        (Some(n), Some(m)) if n != m => {
            return Err(Fatal(format!(
                "--data-blocks {n} but the data device (--data) has {m} blocks: the table's \
                 data device is the one --data names"
            )))
        }
        (n, m) => Table {
            logical_blocks: opts.logical_blocks.unwrap_or(sb.logical_blocks),
            data_blocks: n.or(m).unwrap_or(sb.data_blocks),
            data_from_device: n.is_none() && m.is_some(),
        },
    };
    let data = match data {
        Some(d) => Some((d, fingerprint::data_hasher(sb, d)?)),
        None => None,
    };
    // A device the kernel accepts has data_blocks < 64 * metadata_blocks
    // (the fingerprint tree alone needs 2 blocks per 127 data blocks);
    // anything else is damaged and must not make us allocate huge tables.
    let dense_limit = opts
        .dense_limit
        .unwrap_or(DENSE_LIMIT)
        .min(sb.metadata_blocks.saturating_mul(64));
    // The state is the superblock's with its journal replayed, as the
    // kernel replays it: an unflushed newest append whose data is not on
    // the data device is dropped.
    let mut replay = journal::replay(dev, sb);
    if let (Some(r), Some((d, h))) = (replay.as_mut(), data) {
        r.check_unflushed(d, h, sb.fp_size as usize)
            .map_err(|e| Fatal(format!("--data: {e}")))?;
    }
    let state = match &replay {
        Some(r) => r.state_superblock(sb),
        None => sb.clone(),
    };
    let mut owner = vec![0; sb.metadata_blocks as usize];
    if let Some(run) = sb.journal_run() {
        owner[run.start as usize..run.end as usize].fill(JOURNAL_OWNER);
    }
    let mut w = Walker {
        dev,
        sb: &state,
        table,
        overlay: replay
            .as_ref()
            .map(|r| Overlay::of(&r.appends))
            .unwrap_or_default(),
        journal_appends: replay.as_ref().map_or(0, |r| r.appends.len() as u64),
        problems,
        owner,
        counts: Counts::new(sb.data_blocks, dense_limit),
        live: Live::new(sb.data_blocks, dense_limit),
        damaged: Default::default(),
        summary: Summary {
            data_blocks_verified: data.map(|_| 0),
            fingerprint_mismatches: data.map(|_| 0),
            data_read_errors: data.map(|_| 0),
            journal_blocks: sb.journal_run().map_or(0, |r| r.end - r.start),
            ..Summary::default()
        },
        fp_size: (sb.fp_size as usize).min(FP_SIZE),
        contents: opts.collect.then(Contents::default),
        fps: Vec::new(),
        first_placeholder: 0,
        data,
        unverified: Vec::new(),
        saved: (sb.saved_root != 0)
            .then(|| saved::SavedWalk::new(dev_blocks, table.data_blocks, dense_limit)),
    };
    for (i, st) in states.iter().enumerate() {
        if i == best {
            continue;
        }
        if let SlotState::Bad(r) = st {
            w.warn(
                "other_slot_bad",
                At {
                    block: Some(i as u64),
                    ..At::sb()
                },
                format!(
                    "superblock slot {i} is damaged ({r}); the kernel ignores it and overwrites it \
                     at the next commit"
                ),
            );
        }
    }
    check_superblock(&state, dev_blocks, opts, &mut w);
    if let Some(r) = &replay {
        w.check_journal(r);
    }
    for id in ArrayId::ALL {
        w.walk_array(id);
    }
    w.finish();
    let saved = w.check_saved();
    let report = Report {
        device_blocks: dev_blocks,
        slots,
        superblock: Some(SuperblockInfo::from_sb(best as u64, sb)),
        summary: Some(w.summary.clone()),
        journal: replay.as_ref().map(JournalReport::of),
        saved,
        errors: w.problems.errors,
        warnings: w.problems.warnings,
        unlisted_problems: w.problems.unlisted,
        problems: w.problems.list,
    };
    Ok((report, w.contents))
}

/// The line about the journal: where it is and what replay made of it.
pub fn journal_line(sb: &SuperblockInfo, j: Option<&JournalReport>) -> String {
    let Some(j) = j else {
        return if sb.version == FORMAT_VERSION_V1 {
            "journal: none (format version 1: every flush commits the trees)".into()
        } else {
            "journal: unusable (see the journal_run error)".into()
        };
    };
    let plural = crate::util::plural;
    let what = if j.blocks_in_epoch == 0 {
        "empty".to_string()
    } else {
        let mut w = format!(
            "{} follow it: {} replayed ({}, {})",
            plural(j.blocks_in_epoch, "block"),
            plural(j.appends, "append"),
            plural(j.replayed_blocks, "block"),
            plural(j.records, "record")
        );
        if j.torn_blocks > 0 {
            w += &format!(
                ", then {} after the last END ignored (an append torn by a crash, {})",
                plural(j.torn_blocks, "block"),
                plural(j.torn_records, "record")
            );
        }
        if let Some(d) = &j.damage {
            w += &format!(
                ", then damage at sequence {} (block {}): replayed up to the append that starts \
                 at sequence {}",
                d.seq, d.block, d.append_seq
            );
        }
        if let Some(u) = &j.unflushed {
            w += &format!("; {}", u.text());
        }
        w
    };
    format!(
        "journal: {} at block {} (id {:#018x}), epoch {}: {what}; it ends at sequence {}: {}",
        plural(j.blocks, "block"),
        j.start,
        j.id,
        j.epoch,
        j.end_seq,
        j.end
    )
}

/// The report as text for a person.
pub fn render(report: &Report, device: &str) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "checking {device} ({} blocks of 4 KiB)",
        report.device_blocks
    );
    for s in &report.slots {
        let _ = match (&s.reason, s.generation) {
            (Some(r), _) => writeln!(o, "  superblock slot {}: bad: {r}", s.slot),
            (None, Some(g)) => writeln!(o, "  superblock slot {}: valid, generation {g}", s.slot),
            _ => writeln!(o, "  superblock slot {}: {}", s.slot, s.state),
        };
    }
    if let Some(sb) = &report.superblock {
        let _ = writeln!(
            o,
            "  using slot {} (generation {}, format version {}): {} metadata, {} data, {} logical blocks; hash {} ({}-byte fingerprints); formatted {}",
            sb.slot,
            sb.generation,
            sb.version,
            sb.metadata_blocks,
            sb.data_blocks,
            sb.logical_blocks,
            sb.hash,
            sb.fp_size,
            crate::util::format_utc(sb.format_time)
        );
    }
    for p in &report.problems {
        let sev = match p.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        let _ = writeln!(o, "{sev}: {}: {} [{}]", p.location(), p.message, p.code);
    }
    if report.unlisted_problems > 0 {
        let _ = writeln!(
            o,
            "... and {} more problems not listed (see --max-problems)",
            report.unlisted_problems
        );
    }
    if let Some(sb) = &report.superblock {
        let _ = writeln!(o, "{}", journal_line(sb, report.journal.as_ref()));
    }
    if let Some(s) = &report.summary {
        let _ = writeln!(
            o,
            "metadata blocks in use: {} of {} (2 superblock slots, {} map, {} refcount, {} fingerprint, {} journal)",
            s.metadata_blocks_used,
            s.metadata_blocks_total,
            s.map_blocks,
            s.refcount_blocks,
            s.fingerprint_blocks,
            s.journal_blocks
        );
        let _ = writeln!(
            o,
            "mapped logical blocks: {}, live physical blocks: {}, refcounts sum to {}, dedup ratio {:.2}",
            s.mapped_blocks, s.live_blocks, s.refcount_sum, s.dedup_ratio
        );
        if let (Some(v), Some(m), Some(e)) = (
            s.data_blocks_verified,
            s.fingerprint_mismatches,
            s.data_read_errors,
        ) {
            let _ = writeln!(
                o,
                "data blocks verified: {v} of {} live blocks match their fingerprint records \
                 (mismatched: {m}, unreadable: {e}, placeholders skipped: {})",
                s.live_blocks, s.placeholder_fingerprints
            );
        }
    }
    if let Some(s) = &report.saved {
        let _ = writeln!(
            o,
            "saved state: {} words in {} blocks (root {}), {}",
            s.words,
            s.blocks,
            s.root,
            match (s.loadable, s.compared) {
                (true, true) if s.differs => "loadable, differs from the trees",
                (true, true) => "loadable, matches the trees",
                (true, false) => "loadable, not compared with the damaged trees",
                (false, _) => "not loadable (the kernel rebuilds it from the trees)",
            }
        );
    }
    let plural = |n: u64, w: &str| format!("{n} {w}{}", if n == 1 { "" } else { "s" });
    let _ = if report.errors == 0 {
        writeln!(o, "result: clean, {}", plural(report.warnings, "warning"))
    } else {
        writeln!(
            o,
            "result: {}, {}",
            plural(report.errors, "error"),
            plural(report.warnings, "warning")
        )
    };
    o
}

#[cfg(test)]
#[path = "check_tests.rs"]
pub(crate) mod tests;
