//! Replay of the redo journal (format version 2, dedup-format.rst
//! "Journal"): which journal blocks follow the superblock's state, the
//! appends they form, where the journal ends and why, and the overlay of
//! new values those appends put on the trees.
//!
//! The rules are the kernel's (dedup-journal.c): from the epoch
//! s = journal_seq, the block at journal_start + (s mod journal_blocks)
//! *continues the journal* when its checksum is right, it is a JRNL block
//! naming that location, and it carries the superblock's journal id, the
//! epoch and s; at most journal_blocks blocks are read. The records of
//! every block that continues it are checked; a malformed one is damage,
//! not the end (the kernel refuses to activate). Whole appends (ended by a
//! block with END, whose last record is COUNTERS) are applied in order;
//! blocks after the last END are an append torn by a crash, ignored.
//!
//! Under a superblock with UNFLUSHED_APPENDS the newest whole append may
//! carry UNFLUSHED: it was written while its data was being flushed, and
//! never acknowledged. With the data device at hand it is applied only if
//! every block it makes live holds the data its fingerprint names
//! (`Replay::check_unflushed`); without, it is applied as it is and the
//! report says it was not checked.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::device::BlockDev;
use crate::fingerprint::{self, Hasher};
use crate::ondisk::*;

/// One whole append: consecutive blocks up to one with END.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Append {
    pub first_seq: u64,
    pub blocks: u64,
    pub records: Vec<Record>,
    /// Its END block carries UNFLUSHED (the kernel sets it on every block
    /// of the append; the END block's is the one that counts).
    pub unflushed: bool,
}

impl Append {
    pub fn last_seq(&self) -> u64 {
        self.first_seq.wrapping_add(self.blocks - 1)
    }
}

/// A block that continues the journal but cannot be replayed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Damage {
    /// The damaged block's sequence number and location.
    pub seq: u64,
    pub block: u64,
    /// Offset of the record at fault in the block's record area.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<usize>,
    pub why: String,
    /// The first block of the append it belongs to: replay keeps
    /// everything before it; repair drops it and everything after.
    pub append_seq: u64,
}

/// What follows the damage, from the damaged append's first block to the
/// end of the journal: what repair drops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Dropped {
    pub blocks: u64,
    /// Records that still decode in those blocks (up to each block's
    /// first malformed one).
    pub records: u64,
    /// Blocks with END among them.
    pub appends: u64,
}

/// What became of an unflushed newest append.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UnflushedOutcome {
    /// No data device to check it against: applied as it is.
    Unchecked,
    /// Every block it makes live holds its data: applied.
    Applied,
    /// A block it makes live does not hold its data: not applied, as the
    /// kernel drops it.
    Dropped,
}

/// The newest whole append, when it is unflushed (its END block carries
/// UNFLUSHED), and what its data check made of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Unflushed {
    pub first_seq: u64,
    pub last_seq: u64,
    pub blocks: u64,
    pub records: u64,
    pub outcome: UnflushedOutcome,
    /// With a data device: the distinct data blocks read to check it (the
    /// blocks it makes live that have a FINGERPRINT record in it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_blocks_checked: Option<u64>,
    /// Dropped: the first data block, in record order, that does not hold
    /// the content its FINGERPRINT record names.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mismatch: Option<u64>,
}

impl Unflushed {
    /// The outcome in words, for the text reports.
    pub fn text(&self) -> String {
        let what = format!(
            "newest append (sequence {}..{}) unflushed",
            self.first_seq, self.last_seq
        );
        match (self.outcome, self.mismatch) {
            (UnflushedOutcome::Unchecked, _) => {
                format!("{what}: not checked against the data (no data device), applied")
            }
            (UnflushedOutcome::Applied, _) => format!("{what}: its data checked, applied"),
            (UnflushedOutcome::Dropped, pba) => format!(
                "{what}: data block {} does not hold its fingerprint: dropped, as the kernel \
                 does (it was never acknowledged)",
                pba.unwrap_or_default()
            ),
        }
    }
}

/// Why the journal ends where it does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// The block at `seq` does not continue it (stale, torn, never
    /// written): the normal end.
    Block { seq: u64, block: u64, why: String },
    /// journal_blocks blocks continued it: the ring is full.
    RingFull,
    /// The block at `seq` could not be read (the kernel fails too).
    ReadError { seq: u64, block: u64, error: String },
}

/// The journal that follows a superblock's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replay {
    pub start: u64,
    pub nr_blocks: u64,
    pub id: u64,
    pub epoch: u64,
    /// The whole appends that replay applies, in order (those before any
    /// damage).
    pub appends: Vec<Append>,
    /// Blocks that continue the journal from the epoch (whole appends, a
    /// torn tail and any damaged part).
    pub continued: u64,
    /// The first sequence number that does not continue it (epoch +
    /// continued).
    pub end_seq: u64,
    pub end: End,
    /// Blocks after the last END (no damage): an append torn by a crash,
    /// ignored. With its records.
    pub torn_blocks: u64,
    pub torn_records: u64,
    pub damage: Option<Damage>,
    pub dropped: Dropped,
    /// The newest whole append is unflushed: whether it was checked, and
    /// applied or dropped. A dropped one is no longer in `appends`.
    pub unflushed: Option<Unflushed>,
}

impl Replay {
    /// Blocks of the whole appends applied.
    pub fn applied_blocks(&self) -> u64 {
        self.appends.iter().map(|a| a.blocks).sum()
    }

    pub fn records(&self) -> u64 {
        self.appends.iter().map(|a| a.records.len() as u64).sum()
    }

    /// The counters of the last COUNTERS record applied.
    pub fn counters(&self) -> Option<Counters> {
        self.appends
            .iter()
            .flat_map(|a| a.records.iter())
            .filter_map(|r| match r {
                Record::Counters(c) => Some(*c),
                _ => None,
            })
            .next_back()
    }

    /// What the end is, in words: "block 7 (sequence 5) is of epoch 3".
    pub fn end_text(&self) -> String {
        match &self.end {
            End::Block { seq, block, why } => {
                format!("block {block} (sequence {seq}) {why}")
            }
            End::RingFull => format!("all {} blocks of the ring follow the epoch", self.nr_blocks),
            End::ReadError { seq, block, error } => {
                format!("block {block} (sequence {seq}) cannot be read: {error}")
            }
        }
    }

    /// The superblock's state with the journal replayed: its counters set
    /// to the last COUNTERS record (the entries are in `Overlay`).
    pub fn state_superblock(&self, sb: &Superblock) -> Superblock {
        let mut s = sb.clone();
        if let Some(c) = self.counters() {
            c.apply(&mut s);
        }
        s
    }
}

/// Why the block `blk` read at sequence `seq` does not continue the
/// journal of `sb`, or None if it does.
pub fn not_continuing(sb: &Superblock, blk: &Block, seq: u64) -> Option<String> {
    let jb = JournalBlock::decode(blk);
    let at = sb.journal_block(seq);
    if is_zero(&blk[..]) {
        return Some("is all zeros (never written)".into());
    }
    if !csum_ok(blk) {
        return Some(format!(
            "fails its checksum (stored {:#010x}, computed {:#010x}): a torn write or other \
             content",
            stored_csum(blk),
            block_csum(blk)
        ));
    }
    if jb.header.btype != BT_JOURNAL {
        return Some(format!(
            "is not a journal block (type {})",
            type_name(jb.header.btype)
        ));
    }
    if jb.header.blocknr != at {
        return Some(format!("claims to be block {}", jb.header.blocknr));
    }
    if jb.journal_id != sb.journal_id {
        return Some(format!(
            "belongs to another journal (id {:#x}, not {:#x})",
            jb.journal_id, sb.journal_id
        ));
    }
    if jb.epoch != sb.journal_seq {
        return Some(format!(
            "is of another epoch ({}, not {}): stale",
            jb.epoch, sb.journal_seq
        ));
    }
    if jb.seq != seq {
        return Some(format!("has sequence number {}, not {seq}", jb.seq));
    }
    None
}

/// Read the journal that follows the state of `sb`. None when `sb` has
/// none: version 1, or journal fields dd_check_sb() refuses.
pub fn replay(dev: &dyn BlockDev, sb: &Superblock) -> Option<Replay> {
    sb.journal_run()?;
    let n = sb.journal_blocks;
    let epoch = sb.journal_seq;
    let mut r = Replay {
        start: sb.journal_start,
        nr_blocks: n,
        id: sb.journal_id,
        epoch,
        appends: Vec::new(),
        continued: 0,
        end_seq: epoch,
        end: End::RingFull,
        torn_blocks: 0,
        torn_records: 0,
        damage: None,
        dropped: Dropped::default(),
        unflushed: None,
    };
    let unflushed_allowed = sb.unflushed_appends();
    // The append being collected: first seq, blocks, records.
    let mut first = epoch;
    let mut blocks = 0u64;
    let mut records: Vec<Record> = Vec::new();
    let mut blk = zero_block();
    for i in 0..n {
        let seq = epoch.wrapping_add(i);
        let at = sb.journal_block(seq);
        if let Err(e) = dev.read_block(at, &mut blk) {
            r.end = End::ReadError {
                seq,
                block: at,
                error: e.to_string(),
            };
            break;
        }
        if let Some(why) = not_continuing(sb, &blk, seq) {
            r.end = End::Block {
                seq,
                block: at,
                why,
            };
            break;
        }
        r.continued += 1;
        let jb = JournalBlock::decode(&blk);
        if r.damage.is_some() {
            // Past the damage: only counted, for what repair drops.
            r.dropped.blocks += 1;
            r.dropped.records += lenient_count(&jb, sb);
            r.dropped.appends += jb.is_end() as u64;
            continue;
        }
        match jb.records(sb.logical_blocks, sb.data_blocks, unflushed_allowed) {
            Err(f) => {
                r.damage = Some(Damage {
                    seq,
                    block: at,
                    offset: f.offset,
                    why: f.why,
                    append_seq: first,
                });
                r.dropped = Dropped {
                    blocks: blocks + 1,
                    records: records.len() as u64 + lenient_count(&jb, sb),
                    appends: jb.is_end() as u64,
                };
                records.clear();
            }
            Ok(v) => {
                records.extend(v);
                blocks += 1;
                if jb.is_end() {
                    r.appends.push(Append {
                        first_seq: first,
                        blocks,
                        records: std::mem::take(&mut records),
                        unflushed: jb.is_unflushed(),
                    });
                    first = seq.wrapping_add(1);
                    blocks = 0;
                }
            }
        }
    }
    r.end_seq = epoch.wrapping_add(r.continued);
    if r.damage.is_none() {
        r.torn_blocks = blocks;
        r.torn_records = records.len() as u64;
    }
    // After damage the kernel replays nothing at all; the newest append
    // before it is still the one repair would keep last, so it is held to
    // the same rule.
    r.unflushed = r.appends.last().filter(|a| a.unflushed).map(|a| Unflushed {
        first_seq: a.first_seq,
        last_seq: a.last_seq(),
        blocks: a.blocks,
        records: a.records.len() as u64,
        outcome: UnflushedOutcome::Unchecked,
        data_blocks_checked: None,
        mismatch: None,
    });
    Some(r)
}

/// The data blocks an unflushed append must find holding their content:
/// (pba, record) of every FINGERPRINT record, in record order. The kernel
/// writes one only for a block that becomes live in the append, once its
/// data was written; a block made live and freed again within the append
/// is checked too (dedup-format.rst, "The newest append").
pub fn blocks_to_verify(a: &Append) -> Vec<(u64, [u8; FP_SIZE])> {
    a.records
        .iter()
        .filter_map(|r| match *r {
            Record::Fingerprint { pba, fp } => Some((pba, fp)),
            _ => None,
        })
        .collect()
}

impl Replay {
    /// Check the newest append's data, when it is unflushed, on `data`
    /// with `hasher` (the superblock's hash, `fp_size` significant bytes):
    /// applied if every block it makes live holds the content its
    /// FINGERPRINT record names; otherwise dropped from `appends`, and the
    /// state is that of the append before. Not damage: the kernel never
    /// acknowledged that append. A data block that cannot be read is an
    /// error (the kernel fails the activation).
    pub fn check_unflushed(
        &mut self,
        data: &(dyn BlockDev + Sync),
        hasher: Hasher,
        fp_size: usize,
    ) -> Result<(), String> {
        let Some(u) = self.unflushed.as_mut() else {
            return Ok(());
        };
        let a = self
            .appends
            .last()
            .expect("the unflushed append is the last");
        let want = blocks_to_verify(a);
        let mut pbas: Vec<u64> = want.iter().map(|w| w.0).collect();
        pbas.sort_unstable();
        pbas.dedup();
        let digests = fingerprint::digest_blocks(data, hasher, &pbas);
        let have: BTreeMap<u64, fingerprint::DataDigest> =
            pbas.iter().copied().zip(digests).collect();
        // In record order, as the kernel walks them: the first block that
        // does not hold its data decides, and a read error only counts
        // before it.
        u.mismatch = None;
        for (pba, want_fp) in &want {
            let (mut fp, _) = have[pba].clone().map_err(|e| {
                format!(
                    "the newest journal append (sequence {}..{}) is unflushed and its data must \
                     be checked, but data block {pba} {e}",
                    u.first_seq, u.last_seq
                )
            })?;
            // The record keeps fp_size bytes of the digest, zero-padded.
            fp[fp_size.min(FP_SIZE)..].fill(0);
            if fp != *want_fp {
                u.mismatch = Some(*pba);
                break;
            }
        }
        u.data_blocks_checked = Some(pbas.len() as u64);
        if u.mismatch.is_some() {
            u.outcome = UnflushedOutcome::Dropped;
            self.appends.pop();
        } else {
            u.outcome = UnflushedOutcome::Applied;
        }
        Ok(())
    }
}

/// Records that decode in `jb` up to its first malformed one.
fn lenient_count(jb: &JournalBlock, sb: &Superblock) -> u64 {
    let used = (jb.used as usize).min(JOURNAL_PAYLOAD);
    let mut off = 0;
    let mut n = 0;
    while off < used {
        match Record::decode(&jb.payload[off..used]) {
            Ok((r, size)) if r.fault(sb.logical_blocks, sb.data_blocks).is_none() => {
                n += 1;
                off += size;
            }
            _ => break,
        }
    }
    n
}

/// The new values the applied appends give the three arrays (the last
/// record of each entry wins), and the counters of the last COUNTERS
/// record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overlay {
    pub map: BTreeMap<u64, u64>,
    pub refcount: BTreeMap<u64, u32>,
    pub fingerprint: BTreeMap<u64, [u8; FP_SIZE]>,
    pub counters: Option<Counters>,
}

impl Overlay {
    pub fn of(appends: &[Append]) -> Overlay {
        let mut o = Overlay::default();
        for r in appends.iter().flat_map(|a| a.records.iter()) {
            o.apply(r);
        }
        o
    }

    /// Set the entry the record names, as replay does.
    pub fn apply(&mut self, r: &Record) {
        match *r {
            Record::Map { lba, value } => {
                self.map.insert(lba, value);
            }
            Record::Refcount { pba, count } => {
                self.refcount.insert(pba, count);
            }
            Record::Fingerprint { pba, fp } => {
                self.fingerprint.insert(pba, fp);
            }
            Record::Counters(c) => self.counters = Some(c),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
            && self.refcount.is_empty()
            && self.fingerprint.is_empty()
            && self.counters.is_none()
    }

    /// Entries of array `id` with index in [first, end), as (index, the
    /// entry's bytes as stored in a leaf).
    pub fn entries(&self, id: ArrayId, first: u64, end: u64) -> Vec<(u64, Vec<u8>)> {
        if first >= end {
            return Vec::new();
        }
        match id {
            ArrayId::Map => self
                .map
                .range(first..end)
                .map(|(&i, v)| (i, v.to_le_bytes().to_vec()))
                .collect(),
            ArrayId::Refcount => self
                .refcount
                .range(first..end)
                .map(|(&i, v)| (i, v.to_le_bytes().to_vec()))
                .collect(),
            ArrayId::Fingerprint => self
                .fingerprint
                .range(first..end)
                .map(|(&i, v)| (i, v.to_vec()))
                .collect(),
            ArrayId::Saved => Vec::new(),
        }
    }

    /// Whether array `id` has entries in [first, end).
    pub fn touches(&self, id: ArrayId, first: u64, end: u64) -> bool {
        if first >= end {
            return false;
        }
        match id {
            ArrayId::Map => self.map.range(first..end).next().is_some(),
            ArrayId::Refcount => self.refcount.range(first..end).next().is_some(),
            ArrayId::Fingerprint => self.fingerprint.range(first..end).next().is_some(),
            ArrayId::Saved => false,
        }
    }
}

#[cfg(test)]
#[path = "journal_tests.rs"]
pub(crate) mod tests;
