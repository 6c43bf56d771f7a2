//! `dedup repair`: fresh, consistent metadata from what a damaged device
//! still holds.
//!
//! What is kept and what is dropped:
//! - the superblock the kernel would use (or an older valid one if its
//!   fields are impossible, or a damaged one whose roots check out) gives
//!   the sizes, the hash and the counters;
//! - every map entry in an intact map leaf that points inside the data
//!   device is kept with its physical block; the logical blocks under a
//!   damaged node are lost (they read as zeros afterwards);
//! - refcounts are recomputed from the kept map entries;
//! - a live block keeps its fingerprint record if the record is intact,
//!   with --data it gets the digest of its content; a live block whose
//!   record is lost and cannot be recomputed keeps its mappings under a
//!   placeholder record that no write matches (see
//!   fingerprint::placeholder for why that is safe and why dropping the
//!   mappings is not done);
//! - records of free blocks are dropped;
//! - the journal (format version 2) is replayed into what is written: the
//!   whole appends that follow the superblock, up to a damaged append
//!   (malformed records, or no final COUNTERS record), which is dropped
//!   with everything after it. The new superblock's journal is empty: the
//!   same run and id with the epoch two rings on, or a new run if the old
//!   one cannot be used.
//!
//! The new state is written next to the old one, as a kernel commit
//! would: trees to blocks the old state does not use, then a superblock
//! of a newer generation to the other slot. An interrupted repair leaves
//! the device as it was.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;

use crate::check::{self, CheckOptions, Fatal};
use crate::device::{BlockDev, FileDev};
use crate::fingerprint;
use crate::journal::{self, Overlay, Replay};
use crate::ondisk::*;
use crate::salvage::{choose_superblock, Chosen, Lost, Salvager, Source};
use crate::util::*;
use crate::writer::{fresh_journal_id, planned_journal_run, write_image_beside, ImageSpec};

/// fsck's "errors corrected".
pub const EXIT_REPAIRED: i32 = 1;

/// One change the repair makes (or, in a dry run, would make), or one
/// finding it reports without a change (`changed` false).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Change {
    /// `superblock`, `map`, `refcount` or `fingerprint`.
    pub area: &'static str,
    /// Stable machine-readable kind, e.g. `map_lost`.
    pub code: &'static str,
    /// Lowest and highest index concerned: LBA for the map, PBA for
    /// refcounts and fingerprints.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last: Option<u64>,
    /// Entries concerned (0 when not countable).
    pub count: u64,
    pub changed: bool,
    pub message: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RepairSummary {
    /// "newest", "fallback" or "damaged": where the superblock came from.
    pub source: &'static str,
    pub slot_before: u64,
    pub generation_before: u64,
    pub slot_after: u64,
    pub generation_after: u64,
    /// The old superblock's counters and what the new state holds.
    pub mapped_before: u64,
    pub mapped_after: u64,
    pub live_before: u64,
    pub live_after: u64,
    /// Logical blocks under damaged map nodes (mapped or not: unknown).
    pub logical_blocks_in_lost_ranges: u64,
    /// Map entries dropped because they point beyond the data device.
    pub mappings_dropped: u64,
    pub refcounts_changed: u64,
    /// Live blocks whose intact record was kept (verified or not).
    pub fingerprints_kept: u64,
    /// Records compared with the data and found equal (--data).
    pub fingerprints_verified: u64,
    /// Lost or untrusted records recomputed from the data (--data).
    pub fingerprints_recomputed: u64,
    /// Intact records that differed from the data, replaced (--data).
    pub fingerprints_replaced: u64,
    pub placeholders: u64,
    pub stale_fingerprints_dropped: u64,
    pub data_read_errors: u64,
    /// Whole appends of the journal replayed into the state written, and
    /// their records.
    pub journal_appends_replayed: u64,
    pub journal_records_replayed: u64,
    /// Journal blocks dropped: a damaged append and everything after it.
    pub journal_blocks_dropped: u64,
    /// The newest append was unflushed: checked against --data (repair
    /// refuses to run without it),
    /// checked and applied, or dropped (its data is not there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal_unflushed: Option<journal::UnflushedOutcome>,
}

/// What repair will write and why.
#[derive(Clone, Debug)]
pub struct Plan {
    pub spec: ImageSpec,
    /// The old state's blocks, kept intact until the new superblock is
    /// written.
    pub in_use: Vec<bool>,
    pub changes: Vec<Change>,
    pub summary: RepairSummary,
}

impl Plan {
    /// Changes that alter the metadata (findings excluded).
    pub fn changed(&self) -> usize {
        self.changes.iter().filter(|c| c.changed).count()
    }
}

struct Changes(Vec<Change>);

impl Changes {
    fn add(
        &mut self,
        area: &'static str,
        code: &'static str,
        range: Option<(u64, u64)>,
        count: u64,
        message: String,
    ) {
        self.0.push(Change {
            area,
            code,
            first: range.map(|r| r.0),
            last: range.map(|r| r.1),
            count,
            changed: true,
            message,
        });
    }

    fn note(&mut self, area: &'static str, code: &'static str, count: u64, message: String) {
        self.0.push(Change {
            area,
            code,
            first: None,
            last: None,
            count,
            changed: false,
            message,
        });
    }
}

/// Block numbers grouped by a reason, groups in order of first sight.
#[derive(Default)]
struct Groups {
    order: Vec<(&'static str, String)>,
    members: HashMap<(&'static str, String), Vec<u64>>,
}

impl Groups {
    fn add(&mut self, code: &'static str, why: &str, pba: u64) {
        let key = (code, why.to_string());
        self.members
            .entry(key.clone())
            .or_insert_with(|| {
                self.order.push(key);
                Vec::new()
            })
            .push(pba);
    }

    fn into_iter(mut self) -> impl Iterator<Item = (&'static str, String, Vec<u64>)> {
        let order = std::mem::take(&mut self.order);
        order.into_iter().map(move |k| {
            let v = self.members.remove(&k).unwrap_or_default();
            (k.0, k.1, v)
        })
    }
}

fn blocks_phrase(what: &str, pbas: &[u64]) -> String {
    if pbas.len() == 1 {
        format!("{what} block {}", pbas[0])
    } else {
        format!("{what} blocks {} ({} blocks)", spans(pbas), pbas.len())
    }
}

/// "logical block 7" or "logical blocks 7-9".
fn range_phrase(what: &str, first: u64, last: u64) -> String {
    let s = if first == last { "" } else { "s" };
    format!("{what} block{s} {}", span(first, last))
}

/// Fingerprint of one live block, before --data is looked at.
enum FpRecord {
    Trusted([u8; FP_SIZE]),
    Lost(String),
}

/// The generation of the repaired superblock: newer than every valid one
/// at most MAX_TXN (so the kernel uses it: a slot above MAX_TXN is never
/// the starting one, so it is the slot overwritten), in the slot the
/// starting state is not in (so that state survives until the new one is
/// complete), and never above MAX_TXN (the kernel would refuse it).
fn new_generation(c: &Chosen) -> Result<u64, Fatal> {
    let base = c.max_generation.max(c.sb.generation());
    let mut g = base.saturating_add(1);
    if g % SB_SLOTS == c.slot {
        g = g.saturating_add(1);
    }
    if g > MAX_TXN {
        return Err(Fatal(format!(
            "generation {base} cannot be advanced: the repaired superblock would be generation \
             {g}, above {MAX_TXN} (2^64 - 2^32 - 1, DD_MAX_TXN), the highest the kernel accepts. \
             To keep the state: `dedup dump --force DEV -o FILE`, then `dedup restore --force \
             --generation N FILE DEV` with a lower N"
        )));
    }
    Ok(g)
}

/// The lost ranges of one array, which the walk found in index order and
/// which do not overlap: looked up by binary search, since heavy damage
/// means many ranges and every live block is looked up.
struct LostRanges(Vec<Lost>);

impl LostRanges {
    fn of(lost: &[Lost], id: ArrayId) -> LostRanges {
        let mut v: Vec<Lost> = lost.iter().filter(|l| l.array == id).cloned().collect();
        v.sort_by_key(|l| l.first);
        LostRanges(v)
    }

    fn find(&self, i: u64) -> Option<&Lost> {
        let k = self.0.partition_point(|l| l.first <= i);
        k.checked_sub(1).map(|k| &self.0[k]).filter(|l| i < l.end)
    }
}

/// Work out the repaired state of `dev`, reading the data device if given.
/// Nothing is written.
pub fn plan(dev: &dyn BlockDev, data: Option<&(dyn BlockDev + Sync)>) -> Result<Plan, Fatal> {
    if dev.nr_blocks() < SB_SLOTS {
        return Err(Fatal(format!(
            "too small to be a dm-dedup metadata device ({} whole 4 KiB blocks)",
            dev.nr_blocks()
        )));
    }
    let chosen = choose_superblock(dev)?;
    let sb = chosen.sb.clone();
    let hasher = data.map(|d| fingerprint::data_hasher(&sb, d)).transpose()?;
    let new_gen = new_generation(&chosen)?;
    let mut ch = Changes(Vec::new());
    let mut sum = RepairSummary {
        source: match chosen.source {
            Source::Newest => "newest",
            Source::Fallback { .. } => "fallback",
            Source::Damaged { .. } => "damaged",
        },
        slot_before: chosen.slot,
        generation_before: sb.generation(),
        slot_after: new_gen % SB_SLOTS,
        generation_after: new_gen,
        ..RepairSummary::default()
    };
    superblock_changes(&chosen, new_gen, &mut ch);

    let mut s = Salvager::new(dev, &sb);
    let mut in_use = s.in_use();
    // The journal that follows the superblock: what it replays is part of
    // the state. Its run stays reserved until the new superblock is
    // written, so that an interrupted repair leaves the journal too.
    let mut replay = journal::replay(dev, &sb);
    // Repair makes the state permanent: an append the kernel might drop
    // (its data may never have reached the disk) must be checked first.
    if let (Some(u), None) = (replay.as_ref().and_then(|r| r.unflushed.as_ref()), data) {
        return Err(Fatal(format!(
            "the newest journal append (sequence {}..{}) was written while its data was being \
             flushed, and repair would make it permanent: its data must be checked first; give \
             the data device with --data",
            u.first_seq, u.last_seq
        )));
    }
    if let (Some(r), Some(d), Some(h)) = (replay.as_mut(), data, hasher) {
        r.check_unflushed(d, h, sb.fp_size as usize)
            .map_err(|e| Fatal(format!("--data: {e}")))?;
    }
    let run_intact = sb
        .journal_run()
        .filter(|run| run.clone().all(|b| !in_use[b as usize]));
    if let Some(run) = &run_intact {
        in_use[run.start as usize..run.end as usize].fill(true);
    }
    let overlay = replay
        .as_ref()
        .map(|r| Overlay::of(&r.appends))
        .unwrap_or_default();
    let state = replay
        .as_ref()
        .map_or_else(|| sb.clone(), |r| r.state_superblock(&sb));
    sum.mapped_before = state.mapped_blocks;
    sum.live_before = state.used_data_blocks;
    journal_changes(
        &sb,
        replay.as_ref(),
        run_intact.is_some(),
        &mut sum,
        &mut ch,
    );

    // The map: intact leaves, entries inside the data device.
    let mg = sb.geometry(ArrayId::Map);
    let mut mappings: Vec<(u64, u64)> = Vec::new();
    // Growing a vector of tens of millions of entries costs more in page
    // faults and copies than the walk: reserve what the superblock counted
    // (it may be damaged: at most what the device's blocks can hold).
    let most = sb.metadata_blocks.saturating_mul(mg.per_leaf as u64);
    let _ = mappings.try_reserve_exact(sb.mapped_blocks.min(sb.logical_blocks).min(most) as usize);
    let mut beyond: Vec<(u64, u64)> = Vec::new();
    s.walk(ArrayId::Map, &mut |leaf_nr, _, blk| {
        let first = leaf_nr * mg.per_leaf as u64;
        for i in 0..mg.leaf_count(leaf_nr) as usize {
            let v = le64(&blk[..], HEADER_SIZE + i * 8);
            if v == 0 {
                continue;
            }
            let lba = first + i as u64;
            if v > sb.data_blocks {
                beyond.push((lba, v - 1));
            } else {
                mappings.push((lba, v - 1));
            }
        }
    });
    mappings.sort_unstable();
    if !overlay.map.is_empty() {
        // The journal's values win, even where a leaf was lost: replay
        // writes each record's value whatever the entry held.
        beyond.retain(|m| !overlay.map.contains_key(&m.0));
        mappings = lay_over_map(&mappings, &overlay.map);
    }
    for l in s.lost.iter().filter(|l| l.array == ArrayId::Map) {
        sum.logical_blocks_in_lost_ranges = sum
            .logical_blocks_in_lost_ranges
            .saturating_add(l.end - l.first);
        let set = overlay
            .map
            .range(l.first..l.end)
            .filter(|m| *m.1 != 0)
            .count();
        let except = if set > 0 {
            format!(" but the {} the journal maps", plural(set as u64, "block"))
        } else {
            String::new()
        };
        ch.add(
            "map",
            "map_lost",
            Some((l.first, l.end - 1)),
            l.end - l.first,
            format!(
                "map: {} lost ({}: {}); they read as zeros from now on{except}",
                range_phrase("logical", l.first, l.end - 1),
                l.node(),
                l.reason
            ),
        );
    }
    if !beyond.is_empty() {
        let lbas: Vec<u64> = beyond.iter().map(|m| m.0).collect();
        let what = if let [(lba, pba)] = beyond[..] {
            format!("logical block {lba} -> physical block {pba} dropped")
        } else {
            format!(
                "{} dropped (the first points at physical block {})",
                blocks_phrase("logical", &lbas),
                beyond[0].1
            )
        };
        ch.add(
            "map",
            "map_beyond_data",
            Some((lbas[0], lbas[lbas.len() - 1])),
            lbas.len() as u64,
            format!(
                "map: {what}: beyond the data device ({} blocks)",
                sb.data_blocks
            ),
        );
    }
    sum.mappings_dropped = beyond.len() as u64;

    // Refcounts: recomputed from the kept map entries.
    let mut pbas: Vec<u64> = mappings.iter().map(|m| m.1).collect();
    pbas.sort_unstable();
    let mut refcounts: Vec<(u64, u32)> = Vec::new();
    for chunk in pbas.chunk_by(|a, b| a == b) {
        // REFCOUNT_MAX is u32::MAX: the kernel saturates there and stores
        // another copy, so a larger count cannot come from it.
        let n = u32::try_from(chunk.len()).ok().ok_or_else(|| {
            Fatal(format!(
                "physical block {} has {} mappings, more than a refcount can hold",
                chunk[0],
                chunk.len()
            ))
        })?;
        refcounts.push((chunk[0], n));
    }
    drop(pbas);
    let rg = sb.geometry(ArrayId::Refcount);
    let mut old_rc: Vec<(u64, u32)> = Vec::new();
    s.walk(ArrayId::Refcount, &mut |leaf_nr, _, blk| {
        let first = leaf_nr * rg.per_leaf as u64;
        for i in 0..rg.leaf_count(leaf_nr) as usize {
            let v = le32(&blk[..], HEADER_SIZE + i * 4);
            if v != 0 {
                old_rc.push((first + i as u64, v));
            }
        }
    });
    old_rc.sort_unstable();
    if !overlay.refcount.is_empty() {
        old_rc = lay_over_sorted(&old_rc, &overlay.refcount, |&c| c != 0);
    }
    let live_in = |a: u64, b: u64| {
        refcounts.partition_point(|r| r.0 < b) - refcounts.partition_point(|r| r.0 < a)
    };
    let lost_rc = LostRanges::of(&s.lost, ArrayId::Refcount);
    for l in &lost_rc.0 {
        ch.add(
            "refcount",
            "refcount_lost",
            Some((l.first, l.end - 1)),
            l.end - l.first,
            format!(
                "refcount: records of {} lost ({}: {}); recomputed from the map \
                 ({} of these blocks are live)",
                range_phrase("physical", l.first, l.end - 1),
                l.node(),
                l.reason,
                live_in(l.first, l.end)
            ),
        );
    }
    // One line per kind of change (old -> new), listing its blocks: a lost
    // map leaf changes the refcounts of blocks all over the data device.
    let mut rc_groups = Groups::default();
    {
        let (mut i, mut j) = (0, 0);
        while i < old_rc.len() || j < refcounts.len() {
            let po = old_rc.get(i).map_or(u64::MAX, |r| r.0);
            let pn = refcounts.get(j).map_or(u64::MAX, |r| r.0);
            let pba = po.min(pn);
            let old = if po == pba { old_rc[i].1 } else { 0 };
            let new = if pn == pba { refcounts[j].1 } else { 0 };
            i += (po == pba) as usize;
            j += (pn == pba) as usize;
            if old != new && lost_rc.find(pba).is_none() {
                sum.refcounts_changed += 1;
                rc_groups.add("refcount_changed", &format!("{old} -> {new}"), pba);
            }
        }
    }
    for (code, change, pbas) in rc_groups.into_iter() {
        let message = if pbas.len() == 1 {
            format!("refcount of physical block {}: {change}", pbas[0])
        } else {
            format!("refcounts {change} of {}", blocks_phrase("physical", &pbas))
        };
        ch.add(
            "refcount",
            code,
            Some((pbas[0], pbas[pbas.len() - 1])),
            pbas.len() as u64,
            message,
        );
    }

    // Fingerprints of the live blocks: the intact records go straight to
    // where the new records are built (memory is per live block here).
    let fp_size = (sb.fp_size as usize).min(FP_SIZE);
    let fg = sb.geometry(ArrayId::Fingerprint);
    let mut fps: Vec<(u64, [u8; FP_SIZE])> =
        refcounts.iter().map(|r| (r.0, [0u8; FP_SIZE])).collect();
    let mut have = vec![false; fps.len()];
    let mut stale = 0u64;
    s.walk(ArrayId::Fingerprint, &mut |leaf_nr, _, blk| {
        let first = leaf_nr * fg.per_leaf as u64;
        let mut k = fps.partition_point(|f| f.0 < first);
        for i in 0..fg.leaf_count(leaf_nr) as u64 {
            let off = HEADER_SIZE + i as usize * FP_SIZE;
            let e = &blk[off..off + FP_SIZE];
            if fps.get(k).is_some_and(|f| f.0 == first + i) {
                fps[k].1.copy_from_slice(e);
                have[k] = true;
                k += 1;
            } else if !is_zero(e) {
                stale += 1;
            }
        }
    });
    // Records the journal sets are intact records too (checksummed).
    for (&pba, fp) in &overlay.fingerprint {
        if let Ok(k) = fps.binary_search_by_key(&pba, |f| f.0) {
            fps[k].1 = *fp;
            have[k] = true;
        }
    }
    let live_in =
        |a: u64, b: u64| fps.partition_point(|f| f.0 < b) - fps.partition_point(|f| f.0 < a);
    let lost_fp = LostRanges::of(&s.lost, ArrayId::Fingerprint);
    for l in &lost_fp.0 {
        ch.note(
            "fingerprint",
            "fingerprint_leaf_lost",
            l.end - l.first,
            format!(
                "fingerprint: records of {} lost ({}: {}); {} of these blocks are live",
                range_phrase("physical", l.first, l.end - 1),
                l.node(),
                l.reason,
                live_in(l.first, l.end)
            ),
        );
    }
    // Whether a live block's record can be trusted, before --data.
    let judge = |pba: u64, rec: Option<&[u8; FP_SIZE]>| -> FpRecord {
        let untrusted = |why: &str| FpRecord::Lost(why.to_string());
        match rec {
            None => match lost_fp.find(pba) {
                Some(l) => FpRecord::Lost(format!("{}: {}", l.node(), l.reason)),
                None => untrusted("no fingerprint leaf holds it"),
            },
            Some(r) if fp_size >= check::STRONG_FP_SIZE && is_zero(r) => {
                untrusted("the record is all zero")
            }
            Some(r) if !is_zero(&r[fp_size..]) => {
                untrusted("the record has non-zero bytes past fp_size")
            }
            Some(r) => {
                // A refcount leaf that said "free" while the map says
                // otherwise: the record may be of earlier content, and a
                // wrong record would let a write share this block.
                let said_free = lost_rc.find(pba).is_none()
                    && old_rc.binary_search_by_key(&pba, |r| r.0).is_err();
                if said_free {
                    untrusted("its refcount was 0, so the record may be of earlier content")
                } else {
                    FpRecord::Trusted(*r)
                }
            }
        }
    };
    let mut groups = Groups::default();
    // With --data, blocks are read and hashed a batch at a time, in
    // parallel, so that memory does not grow with the data device.
    const BATCH: usize = 1 << 16;
    for start in (0..fps.len()).step_by(BATCH) {
        let end = (start + BATCH).min(fps.len());
        let digests = match (data, hasher) {
            (Some(d), Some(h)) => {
                let pbas: Vec<u64> = fps[start..end].iter().map(|f| f.0).collect();
                Some(fingerprint::digest_blocks(d, h, &pbas))
            }
            _ => None,
        };
        for k in start..end {
            let pba = fps[k].0;
            let rec = judge(pba, have[k].then_some(&fps[k].1));
            let dig = digests.as_ref().map(|d| &d[k - start]);
            if let Some(Ok((_, true))) = dig {
                groups.add("data_zero", "", pba);
            }
            if let Some(Err(e)) = dig {
                sum.data_read_errors += 1;
                if let FpRecord::Trusted(_) = rec {
                    groups.add("data_unreadable", e, pba);
                }
            }
            fps[k].1 = match (rec, dig) {
                (FpRecord::Trusted(r), Some(Ok((c, _)))) if *c == r => {
                    sum.fingerprints_kept += 1;
                    sum.fingerprints_verified += 1;
                    r
                }
                (FpRecord::Trusted(_), Some(Ok((c, _)))) => {
                    sum.fingerprints_replaced += 1;
                    groups.add("fingerprint_mismatch", "", pba);
                    *c
                }
                (FpRecord::Trusted(r), _) => {
                    sum.fingerprints_kept += 1;
                    r
                }
                (FpRecord::Lost(why), Some(Ok((c, _)))) => {
                    sum.fingerprints_recomputed += 1;
                    groups.add("fingerprint_recomputed", &why, pba);
                    *c
                }
                (FpRecord::Lost(why), Some(Err(e))) => {
                    sum.placeholders += 1;
                    groups.add("fingerprint_placeholder", &format!("{why}; data: {e}"), pba);
                    fingerprint::placeholder(pba, fp_size)
                }
                (FpRecord::Lost(why), None) => {
                    sum.placeholders += 1;
                    groups.add("fingerprint_placeholder", &why, pba);
                    fingerprint::placeholder(pba, fp_size)
                }
            };
        }
    }
    drop(have);
    fingerprint_changes(groups, &mappings, &mut ch);
    sum.stale_fingerprints_dropped = stale;
    if stale > 0 {
        ch.add(
            "fingerprint",
            "stale_dropped",
            None,
            stale,
            format!(
                "fingerprint: {} of free physical blocks dropped (leftovers the kernel ignores)",
                plural(stale, "record")
            ),
        );
    }
    for o in &s.oddities {
        ch.add(o.array.name(), "cleaned", None, 0, o.message.clone());
    }

    // Counters.
    sum.mapped_after = mappings.len() as u64;
    sum.live_after = fps.len() as u64;
    for (name, old, new) in [
        ("mapped_blocks", state.mapped_blocks, sum.mapped_after),
        ("used_data_blocks", state.used_data_blocks, sum.live_after),
    ] {
        if old != new {
            ch.add(
                "superblock",
                "counter",
                None,
                0,
                format!("superblock: {name} {old} -> {new}"),
            );
        }
    }

    // The state's counters (the journal's), the superblock's identity.
    let mut nsb = state.clone();
    nsb.header = Header {
        btype: BT_SUPER,
        txn: new_gen,
        ..Header::default()
    };
    nsb.map_root = 0;
    nsb.refcount_root = 0;
    nsb.fingerprint_root = 0;
    nsb.mapped_blocks = sum.mapped_after;
    nsb.used_data_blocks = sum.live_after;
    // The repaired state is consistent: the kernel may use it read-write,
    // and it refuses flags it does not know.
    if nsb.flags & SB_NEEDS_CHECK != 0 {
        ch.add(
            "superblock",
            "needs_check",
            None,
            0,
            "superblock: flag needs_check cleared".into(),
        );
    }
    if nsb.flags & !SB_KNOWN_FLAGS != 0 {
        ch.add(
            "superblock",
            "unknown_flags",
            None,
            0,
            format!(
                "superblock: unknown flags {:#x} cleared",
                nsb.flags & !SB_KNOWN_FLAGS
            ),
        );
    }
    nsb.flags = 0;
    let mut spec = ImageSpec {
        sb: nsb,
        mappings,
        refcounts,
        fingerprints: fps,
    };
    new_journal(&sb, run_intact.is_some(), &mut spec, &in_use, &mut ch);
    Ok(Plan {
        spec,
        in_use,
        changes: ch.0,
        summary: sum,
    })
}

/// `sorted` (ascending keys) with the values of `over` laid over it; the
/// entries whose value fails `keep` are left out.
fn lay_over_sorted<V: Copy>(
    sorted: &[(u64, V)],
    over: &std::collections::BTreeMap<u64, V>,
    keep: impl Fn(&V) -> bool,
) -> Vec<(u64, V)> {
    let mut out = Vec::with_capacity(sorted.len() + over.len());
    let mut o = over.iter().peekable();
    for &(k, v) in sorted {
        while let Some((&ok, &ov)) = o.next_if(|(&ok, _)| ok < k) {
            if keep(&ov) {
                out.push((ok, ov));
            }
        }
        match o.next_if(|(&ok, _)| ok == k) {
            Some((_, &ov)) if keep(&ov) => out.push((k, ov)),
            Some(_) => {}
            None => out.push((k, v)),
        }
    }
    out.extend(o.filter(|(_, v)| keep(v)).map(|(&k, &v)| (k, v)));
    out
}

/// The map's (lba, pba) with the journal's map records (PBA + 1, 0 =
/// unmapped) laid over it.
fn lay_over_map(
    mappings: &[(u64, u64)],
    over: &std::collections::BTreeMap<u64, u64>,
) -> Vec<(u64, u64)> {
    let as_values: Vec<(u64, u64)> = mappings.iter().map(|&(l, p)| (l, p + 1)).collect();
    lay_over_sorted(&as_values, over, |&v| v != 0)
        .into_iter()
        .map(|(l, v)| (l, v - 1))
        .collect()
}

/// What replay found, as changes: the appends replayed (a finding: the
/// state is the same), a torn tail (a finding), damage (the damaged append
/// and everything after it are dropped), a run that cannot be used.
fn journal_changes(
    sb: &Superblock,
    replay: Option<&Replay>,
    run_intact: bool,
    sum: &mut RepairSummary,
    ch: &mut Changes,
) {
    if let Some(why) = sb.journal_fault() {
        let what = if sb.version == FORMAT_VERSION_V1 {
            "cleared"
        } else {
            "its appends cannot be found and are lost; a new run is made"
        };
        ch.add(
            "journal",
            "journal_run",
            None,
            0,
            format!("journal: {why}: {what}"),
        );
        return;
    }
    let Some(r) = replay else { return };
    if !run_intact {
        ch.add(
            "journal",
            "journal_run",
            None,
            0,
            format!(
                "journal: its run [{}, {}) shares blocks with the trees (the kernel refuses \
                 that); it is replayed, and the new state gets a new run",
                r.start,
                r.start + r.nr_blocks
            ),
        );
    }
    sum.journal_appends_replayed = r.appends.len() as u64;
    sum.journal_records_replayed = r.records();
    if let (Some(first), Some(last)) = (r.appends.first(), r.appends.last()) {
        ch.note(
            "journal",
            "journal_replayed",
            r.records(),
            format!(
                "journal: {} ({}, sequence {} to {}, {}) replayed into the trees written",
                plural(r.appends.len() as u64, "append"),
                plural(r.applied_blocks(), "block"),
                first.first_seq,
                last.last_seq(),
                plural(r.records(), "record")
            ),
        );
    }
    let unreadable = matches!(r.end, journal::End::ReadError { .. });
    if r.torn_blocks > 0 && !unreadable {
        ch.note(
            "journal",
            "journal_torn",
            r.torn_records,
            format!(
                "journal: {} from sequence {} after the last END ignored: an append torn by a \
                 crash, never acknowledged ({})",
                plural(r.torn_blocks, "block"),
                r.end_seq - r.torn_blocks,
                plural(r.torn_records, "record")
            ),
        );
    }
    if let Some(u) = &r.unflushed {
        sum.journal_unflushed = Some(u.outcome);
        // A finding, not a change: the state written is the one the
        // kernel's replay reaches (without --data, the one it reaches when
        // the data is there).
        ch.note(
            "journal",
            "journal_unflushed",
            u.records,
            format!("journal: {}", u.text()),
        );
    }
    if unreadable && r.damage.is_some() {
        // Past damage, whose change below drops everything from its
        // append on: this block ends only what was counted.
        ch.note(
            "journal",
            "journal_unreadable",
            0,
            format!("journal: {}; nothing after it was read", r.end_text()),
        );
    } else if unreadable {
        // Not a crash's torn tail: whatever followed the block is lost
        // unread, acknowledged appends perhaps among it. The kernel
        // refuses to replay past it.
        sum.journal_blocks_dropped += r.torn_blocks;
        let read = if r.torn_blocks == 0 {
            String::new()
        } else {
            format!(
                " the {} read before it of the append it belongs to ({}), and",
                plural(r.torn_blocks, "block"),
                plural(r.torn_records, "record")
            )
        };
        ch.add(
            "journal",
            "journal_unreadable",
            (r.torn_blocks > 0).then(|| {
                (
                    r.end_seq.wrapping_sub(r.torn_blocks),
                    r.end_seq.wrapping_sub(1),
                )
            }),
            r.torn_blocks,
            format!(
                "journal: {}; the whole appends before it are replayed; dropped:{read} \
                 whatever followed it, unread (appends there may have been acknowledged)",
                r.end_text()
            ),
        );
    }
    if let Some(d) = &r.damage {
        sum.journal_blocks_dropped = r.dropped.blocks;
        let at = d
            .offset
            .map_or(String::new(), |o| format!(", record at offset {o}"));
        ch.add(
            "journal",
            "journal_damaged",
            Some((d.append_seq, r.end_seq.wrapping_sub(1))),
            r.dropped.blocks,
            format!(
                "journal: block {} (sequence {}{at}) is damaged: {}; dropped from the append that \
                 starts at sequence {} on: {} (sequence {} to {}, {} that still read, {} with END); \
                 {}",
                d.block,
                d.seq,
                d.why,
                d.append_seq,
                plural(r.dropped.blocks, "block"),
                d.append_seq,
                r.end_seq.wrapping_sub(1),
                plural(r.dropped.records, "record"),
                plural(r.dropped.appends, "block"),
                if d.append_seq == r.epoch {
                    "the state is the superblock's, no append is replayed".to_string()
                } else {
                    format!("the state is the one after sequence {}", d.append_seq.wrapping_sub(1))
                }
            ),
        );
    }
}

/// The journal of the state written, which is empty: in version 1 none;
/// in version 2 the same run and id if the run is intact, with the epoch
/// two rings on (dedup-format.rst, "Epochs and stale blocks"), or else a
/// new run after the new trees (version 1 if there is no room for one, as
/// the kernel keeps a device it cannot give a journal).
fn new_journal(
    sb: &Superblock,
    run_intact: bool,
    spec: &mut ImageSpec,
    in_use: &[bool],
    ch: &mut Changes,
) {
    let n = &mut spec.sb;
    if sb.version == FORMAT_VERSION_V1 {
        n.journal_start = 0;
        n.journal_blocks = 0;
        n.journal_seq = 0;
        n.journal_id = 0;
        return;
    }
    if run_intact {
        match sb.journal_seq.checked_add(2 * sb.journal_blocks) {
            Some(e) => n.journal_seq = e,
            None => {
                // The epochs ran out: a new id, so that no block of the
                // old one continues the new journal.
                n.journal_id = fresh_journal_id();
                n.journal_seq = 1;
            }
        }
        return;
    }
    n.journal_start = 0;
    n.journal_blocks = 0;
    n.journal_seq = 0;
    n.journal_id = 0;
    if planned_journal_run(spec, in_use).is_none() {
        spec.sb.version = FORMAT_VERSION_V1;
        ch.add(
            "journal",
            "journal_run",
            None,
            0,
            format!(
                "journal: no room for a new run beside the trees' worst case (the {} blocks \
                 these sizes ask for, or a half of that down to {JOURNAL_MAKE_MIN}, in a row): \
                 written as format version 1 (the kernel gives it a journal when it finds room)",
                journal_size(spec.sb.logical_blocks, spec.sb.data_blocks)
            ),
        );
    }
}

fn superblock_changes(c: &Chosen, new_gen: u64, ch: &mut Changes) {
    let g = c.sb.generation();
    match &c.source {
        Source::Newest => {}
        Source::Fallback { skipped_slot, why } => ch.add(
            "superblock",
            "superblock_fallback",
            None,
            0,
            format!(
                "superblock: the newest valid slot, {skipped_slot}, cannot be used: {why}; starting \
                 from slot {} (generation {g}): what the newer generation changed is lost",
                c.slot
            ),
        ),
        Source::Damaged { why } => ch.add(
            "superblock",
            "superblock_damaged",
            None,
            0,
            format!(
                "superblock: no slot is valid; slot {} is damaged ({why}) but its fields are sane \
                 and its roots lead to intact trees: starting from it (generation {g})",
                c.slot
            ),
        ),
    }
    for (slot, why) in &c.other_bad {
        let fate = if *slot == new_gen % SB_SLOTS {
            "the repaired superblock replaces it"
        } else {
            "left as it is"
        };
        // A finding, not a change: the kernel ignores such a slot, and a
        // commit overwrites it just as this repair does.
        ch.note(
            "superblock",
            "slot_damaged",
            0,
            format!("superblock: slot {slot} is damaged ({why}); {fate}"),
        );
    }
}

fn fingerprint_changes(groups: Groups, mappings: &[(u64, u64)], ch: &mut Changes) {
    for (code, why, pbas) in groups.into_iter() {
        let range = Some((pbas[0], pbas[pbas.len() - 1]));
        let n = pbas.len() as u64;
        let blocks = blocks_phrase("physical", &pbas);
        match code {
            "fingerprint_placeholder" => ch.add(
                "fingerprint",
                code,
                range,
                n,
                format!(
                    "fingerprint of {blocks}: lost ({why}); placeholder record written: the blocks \
                     keep their mappings and stay readable, but no write is deduplicated against \
                     them (repair with --data DEV recomputes the records)"
                ),
            ),
            "fingerprint_recomputed" => ch.add(
                "fingerprint",
                code,
                range,
                n,
                format!("fingerprint of {blocks}: lost ({why}); recomputed from the data device"),
            ),
            "fingerprint_mismatch" => {
                let set: std::collections::HashSet<u64> = pbas.iter().copied().collect();
                let lbas: Vec<u64> = mappings
                    .iter()
                    .filter(|m| set.contains(&m.1))
                    .map(|m| m.0)
                    .collect();
                ch.add(
                    "fingerprint",
                    code,
                    range,
                    n,
                    format!(
                        "fingerprint of {blocks}: the record does not match the data, replaced by \
                         the digest of the data; the data block or its record was damaged: check \
                         the content of {}",
                        blocks_phrase("logical", &lbas)
                    ),
                )
            }
            "data_unreadable" => ch.note(
                "fingerprint",
                code,
                n,
                format!("data of {blocks}: {why}; the intact record is kept unverified"),
            ),
            _ => ch.note(
                "fingerprint",
                code,
                n,
                format!(
                    "data of {blocks}: all zeros, which the kernel never stores (a zero write \
                     unmaps): the content may have been discarded or lost"
                ),
            ),
        }
    }
}

/// Write `plan` next to the state on `dev`, then check the result: it
/// must be clean and hold exactly the planned content. Err: why not.
pub fn write(dev: &mut dyn BlockDev, plan: &Plan) -> Result<check::Report, String> {
    write_image_beside(dev, &plan.spec, &plan.in_use).map_err(|e| {
        format!(
            "write failed: {e}; the superblock in use was not touched, the device opens as before"
        )
    })?;
    let opts = CheckOptions {
        collect: true,
        max_problems: 20,
        ..CheckOptions::default()
    };
    let (report, contents) = check::check(dev, &opts)
        .map_err(|f| format!("the repaired metadata does not check: {f}"))?;
    let c = contents.unwrap_or_default();
    let same = c.mappings == plan.spec.mappings
        && c.blocks.len() == plan.spec.refcounts.len()
        && c.blocks
            .iter()
            .zip(plan.spec.refcounts.iter().zip(&plan.spec.fingerprints))
            .all(|(b, (r, f))| b.0 == r.0 && b.1 == r.1 && b.2 == f.1);
    if report.clean() && !same {
        return Err("the repaired metadata reads back differently from what was written (a bug: please report)".into());
    }
    Ok(report)
}

/// The text report.
pub fn render(plan: &Plan, device: &str, dry_run: bool) -> String {
    use std::fmt::Write;
    let s = &plan.summary;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "repairing {device}: starting from superblock slot {} (generation {})",
        s.slot_before, s.generation_before
    );
    for c in &plan.changes {
        let _ = writeln!(o, "{}{}", if c.changed { "" } else { "note: " }, c.message);
    }
    let _ = writeln!(
        o,
        "result: {} mappings kept of {} the superblock counted ({} logical blocks in lost map ranges, \
         {} dropped), {} live physical blocks; fingerprints: {} kept ({} verified against the data), \
         {} recomputed, {} replaced, {} placeholders",
        s.mapped_after,
        s.mapped_before,
        s.logical_blocks_in_lost_ranges,
        s.mappings_dropped,
        s.live_after,
        s.fingerprints_kept,
        s.fingerprints_verified,
        s.fingerprints_recomputed,
        s.fingerprints_replaced,
        s.placeholders
    );
    let verb = if dry_run { "would write" } else { "writing" };
    let _ = writeln!(
        o,
        "{verb} generation {} to superblock slot {} ({})",
        s.generation_after,
        s.slot_after,
        plural(plan.changed() as u64, "change")
    );
    o
}

/// Options of the command line.
pub struct RepairArgs<'a> {
    pub device: &'a Path,
    pub data: Option<&'a Path>,
    pub dry_run: bool,
    pub force: bool,
    pub json: bool,
}

fn fail(json: bool, device: &str, code: i32, msg: &str) -> i32 {
    // Open errors already start with the path.
    let msg = msg
        .strip_prefix(device)
        .and_then(|m| m.strip_prefix(": "))
        .unwrap_or(msg);
    if json {
        let _ = print_json(&serde_json::json!({
            "device": device, "fatal": msg, "exit_code": code
        }));
    }
    eprintln!("dedup repair: {device}: {msg}");
    code
}

fn print_json(v: &serde_json::Value) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v)?;
    writeln!(out)
}

/// `dedup repair`, returning the exit code.
pub fn run(a: RepairArgs<'_>) -> i32 {
    let name = a.device.display().to_string();
    let mut dev = match FileDev::open(a.device, !a.dry_run) {
        Ok(d) => d,
        Err(e) => return fail(a.json, &name, EXIT_OPERATIONAL, &e.0),
    };
    let opts = CheckOptions {
        max_problems: 20,
        ..CheckOptions::default()
    };
    let before = match check::check(&dev, &opts) {
        Ok((r, _)) => r,
        Err(f) => {
            return fail(
                a.json,
                &name,
                EXIT_OPERATIONAL,
                &format!("cannot repair: {f}"),
            )
        }
    };
    if before.clean() && !a.force {
        return fail(
            a.json,
            &name,
            EXIT_OPERATIONAL,
            "check finds no errors, refusing to rewrite it (--force rewrites it anyway, e.g. to \
             verify the fingerprints with --data)",
        );
    }
    let mut data = match a.data {
        None => None,
        Some(p) => match FileDev::open(p, false) {
            Ok(d) => Some(d),
            Err(e) => return fail(a.json, &name, EXIT_OPERATIONAL, &format!("--data: {}", e.0)),
        },
    };
    // What the data device holds is made durable before repair checks it
    // and writes a state that relies on it: after a crash that kept the
    // device's cache, a block may still be there that a power loss would
    // take back (the kernel flushes at activation for the same reason).
    if let Some(Err(e)) = data.as_mut().map(|d| d.flush()) {
        return fail(
            a.json,
            &name,
            EXIT_OPERATIONAL,
            &format!("--data: cannot flush the data device: {e}"),
        );
    }
    let plan = match plan(&dev, data.as_ref().map(|d| d as &(dyn BlockDev + Sync))) {
        Ok(p) => p,
        Err(f) => {
            return fail(
                a.json,
                &name,
                EXIT_OPERATIONAL,
                &format!("cannot repair: {f}"),
            )
        }
    };
    if !a.json {
        print!("{}", render(&plan, &name, a.dry_run));
    }
    let mut after: Option<check::Report> = None;
    let code = if a.dry_run {
        if before.clean() {
            EXIT_OK
        } else {
            EXIT_ERRORS
        }
    } else {
        match write(&mut dev, &plan) {
            Err(msg) => return fail(a.json, &name, EXIT_OPERATIONAL, &msg),
            Ok(r) => {
                let clean = r.clean();
                if !a.json {
                    if clean {
                        println!("done: the metadata checks clean");
                    } else {
                        println!("the repaired metadata still has errors:");
                        for p in &r.problems {
                            println!("  {}: {} [{}]", p.location(), p.message, p.code);
                        }
                    }
                }
                after = Some(r);
                match (clean, before.clean()) {
                    (false, _) => EXIT_ERRORS,
                    (true, true) => EXIT_OK,
                    (true, false) => EXIT_REPAIRED,
                }
            }
        }
    };
    if a.json {
        let v = serde_json::json!({
            "device": name,
            "dry_run": a.dry_run,
            "exit_code": code,
            "check_before": {"errors": before.errors, "warnings": before.warnings},
            "summary": plan.summary,
            "changes": plan.changes,
            "check_after": after.as_ref().map(|r| serde_json::json!({
                "errors": r.errors, "warnings": r.warnings, "problems": r.problems
            })),
        });
        if print_json(&v).is_err() {
            return EXIT_OPERATIONAL;
        }
    }
    code
}

#[cfg(test)]
#[path = "repair_tests.rs"]
mod tests;
