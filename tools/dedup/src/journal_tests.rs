//! Tests of the journal's replay on images built by the writer, with
//! appends written as the kernel writes them; and the helper the check and
//! repair tests build journaled images with.

use super::*;
use crate::device::MemDev;
use crate::writer::{append_blocks, test_fingerprint, write_append, write_image, ImageSpec};

pub(crate) const LOGICAL: u64 = 2000;
pub(crate) const DATA: u64 = 300;

/// A device whose trees hold `states[0]` and whose journal holds one
/// append per later state, each taking the previous one to it.
pub(crate) struct Journaled {
    pub dev: MemDev,
    /// The superblock as written.
    pub sb: Superblock,
    pub states: Vec<ImageSpec>,
    /// Where the next append starts.
    pub next_seq: u64,
    /// The first sequence number of each append.
    pub appends: Vec<u64>,
    /// The fingerprint record of a live block.
    pub fp: fn(u64) -> [u8; FP_SIZE],
}

/// Content of data block `pba` of `data_device()`.
pub(crate) fn data_block(pba: u64) -> Vec<u8> {
    (0..BLOCK_SIZE as u64)
        .map(|i| (pba * 37 + i / 5) as u8)
        .collect()
}

/// The sha256 record of `data_block(pba)`.
pub(crate) fn data_fp(pba: u64) -> [u8; FP_SIZE] {
    crate::fingerprint::Hasher::Sha256.record(&data_block(pba))
}

/// A data device of DATA blocks, block p holding `data_block(p)`.
pub(crate) fn data_device() -> MemDev {
    MemDev::from_bytes((0..DATA).flat_map(data_block).collect())
}

impl Journaled {
    /// The check tests' sample state (LBA i + 300 -> PBA i % 250 for 1200
    /// blocks), generation 5. `run`: (start, blocks, epoch) of the journal
    /// instead of the writer's (journal_size() = 64 blocks after the trees,
    /// epoch 1).
    pub fn new(run: Option<(u64, u64, u64)>) -> Journaled {
        Journaled::with_fp(run, test_fingerprint)
    }

    /// As `new`, with the records of `data_fp`: a state `data_device()`
    /// holds, under a superblock with UNFLUSHED_APPENDS, as the kernel
    /// writes it.
    pub fn with_data() -> Journaled {
        let mut j = Journaled::with_fp(None, data_fp);
        j.sb.flags |= SB_UNFLUSHED_APPENDS;
        *j.dev.block_mut(j.sb.slot()) = *j.sb.encode();
        j
    }

    fn with_fp(run: Option<(u64, u64, u64)>, fp: fn(u64) -> [u8; FP_SIZE]) -> Journaled {
        let blocks = required_blocks(LOGICAL, DATA) + 8;
        let mut sb = Superblock::new_formatted(blocks, DATA, LOGICAL, "sha256", 32, 1_700_000_000);
        sb.header.txn = 5;
        sb.unique_writes = 250;
        sb.duplicate_writes = 950;
        if let Some((start, n, epoch)) = run {
            sb.journal_start = start;
            sb.journal_blocks = n;
            sb.journal_seq = epoch;
            sb.journal_id = 0x5eed_0001;
        }
        let maps: Vec<(u64, u64)> = (0..1200u64).map(|i| (i + 300, i % 250)).collect();
        let spec = ImageSpec::consistent(sb, &maps, fp);
        let mut dev = MemDev::new(blocks);
        let (sb, _) = write_image(&mut dev, &spec).unwrap();
        Journaled {
            dev,
            next_seq: sb.journal_seq,
            sb,
            states: vec![spec],
            appends: Vec::new(),
            fp,
        }
    }

    pub fn last(&self) -> &ImageSpec {
        self.states.last().unwrap()
    }

    /// The next state: the last one with its mappings changed by `f`.
    pub fn next_state(&self, f: impl FnOnce(&mut Vec<(u64, u64)>)) -> ImageSpec {
        let last = self.last();
        let mut maps = last.mappings.clone();
        f(&mut maps);
        maps.sort_unstable();
        maps.dedup_by_key(|m| m.0);
        let mut sb = last.sb.clone();
        sb.unique_writes += 1;
        ImageSpec::consistent(sb, &maps, self.fp)
    }

    /// Mark every block of the append that starts at `first` UNFLUSHED,
    /// as the kernel writes an append while its data is being flushed.
    pub fn mark_unflushed(&mut self, first: u64) {
        let end = self
            .appends
            .iter()
            .find(|&&a| a > first)
            .copied()
            .unwrap_or(self.next_seq);
        for seq in first..end {
            self.edit(seq, |b| b.flags |= JF_UNFLUSHED);
        }
    }

    /// Append the records that take the last state to the one `f` makes;
    /// the append's first sequence number.
    pub fn append(&mut self, f: impl FnOnce(&mut Vec<(u64, u64)>)) -> u64 {
        let next = self.next_state(f);
        let recs = self.last().changes_to(&next);
        self.states.push(next);
        self.append_records(&recs)
    }

    /// Append `recs` as they are (the state is not followed).
    pub fn append_records(&mut self, recs: &[Record]) -> u64 {
        let first = self.next_seq;
        self.next_seq = write_append(&mut self.dev, &self.sb, first, 6, recs).unwrap();
        self.appends.push(first);
        first
    }

    /// The blocks of an append of `recs` from the next sequence, not
    /// written: to write some of them (a torn append).
    pub fn blocks_of(&self, recs: &[Record]) -> Vec<JournalBlock> {
        append_blocks(&self.sb, self.next_seq, 6, recs)
    }

    pub fn replay(&self) -> Replay {
        replay(&self.dev, &self.sb).unwrap()
    }

    /// A block of the journal, decoded.
    pub fn block(&self, seq: u64) -> JournalBlock {
        JournalBlock::decode(self.dev.block(self.sb.journal_block(seq)))
    }

    /// Rewrite the journal block of `seq` through `f`, resealed.
    pub fn edit(&mut self, seq: u64, f: impl FnOnce(&mut JournalBlock)) {
        let mut jb = self.block(seq);
        f(&mut jb);
        let at = self.sb.journal_block(seq);
        *self.dev.block_mut(at) = *jb.encode();
    }
}

/// New blocks 250..260 mapped by LBAs 0..10 (map leaf 0), one of them
/// again by LBA 1900 (map leaf 3, absent from the trees), and PBA 260..262
/// (fingerprint leaf 2, absent) by LBAs 1950..1952.
/// What `check` collects from a consistent image: its map and blocks.
pub(crate) fn contents_of(spec: &ImageSpec) -> crate::check::Contents {
    crate::check::Contents {
        mappings: spec.mappings.clone(),
        blocks: spec
            .refcounts
            .iter()
            .zip(&spec.fingerprints)
            .map(|(&(p, rc), &(_, fp))| (p, rc, fp))
            .collect(),
    }
}

pub(crate) fn grow(m: &mut Vec<(u64, u64)>) {
    m.extend((0..10u64).map(|i| (i, 250 + i)));
    m.push((1900, 255));
    m.extend((0..2u64).map(|i| (1950 + i, 260 + i)));
}

/// LBAs 300..310 unmapped, LBA 320 remapped to PBA 260.
pub(crate) fn shrink(m: &mut Vec<(u64, u64)>) {
    m.retain(|x| !(300..310).contains(&x.0));
    for x in m.iter_mut() {
        if x.0 == 320 {
            x.1 = 260;
        }
    }
}

/// The state an overlay on `base`'s trees gives: (mappings, refcounts,
/// fingerprints of the live blocks).
type State = (Vec<(u64, u64)>, Vec<(u64, u32)>, Vec<(u64, [u8; FP_SIZE])>);

fn state_of(base: &ImageSpec, o: &Overlay) -> State {
    let mut map: BTreeMap<u64, u64> = base.mappings.iter().map(|&(l, p)| (l, p + 1)).collect();
    map.extend(o.map.iter().map(|(&k, &v)| (k, v)));
    let mut rc: BTreeMap<u64, u32> = base.refcounts.iter().copied().collect();
    rc.extend(o.refcount.iter().map(|(&k, &v)| (k, v)));
    let mut fp: BTreeMap<u64, [u8; FP_SIZE]> = base.fingerprints.iter().copied().collect();
    fp.extend(o.fingerprint.iter().map(|(&k, &v)| (k, v)));
    let live: Vec<(u64, u32)> = rc.into_iter().filter(|r| r.1 != 0).collect();
    (
        map.into_iter()
            .filter(|m| m.1 != 0)
            .map(|(l, v)| (l, v - 1))
            .collect(),
        live.clone(),
        live.iter().map(|&(p, _)| (p, fp[&p])).collect(),
    )
}

fn content(s: &ImageSpec) -> State {
    (
        s.mappings.clone(),
        s.refcounts.clone(),
        s.fingerprints.clone(),
    )
}

#[test]
fn an_empty_journal() {
    let j = Journaled::new(None);
    let r = j.replay();
    // As long as the sizes ask for; the 8 blocks the device has beyond
    // required_blocks stay free.
    assert_eq!(j.dev.nr_blocks(), required_blocks(LOGICAL, DATA) + 8);
    assert_eq!(
        (r.epoch, r.nr_blocks, r.id),
        (1, journal_size(LOGICAL, DATA), j.sb.journal_id)
    );
    assert_eq!(r.nr_blocks, JOURNAL_MAKE_MIN);
    assert_eq!((r.continued, r.end_seq, r.appends.len()), (0, 1, 0));
    assert!(matches!(r.end, End::Block { seq: 1, .. }));
    assert!(r.end_text().contains("all zeros"), "{}", r.end_text());
    assert_eq!(r.counters(), None);
    assert!(Overlay::of(&r.appends).is_empty());
    // Version 1 has none; nor has a superblock with impossible fields.
    let mut v1 = j.sb.clone();
    v1.version = FORMAT_VERSION_V1;
    assert_eq!(replay(&j.dev, &v1), None);
    let mut bad = j.sb.clone();
    bad.journal_id = 0;
    assert_eq!(replay(&j.dev, &bad), None);
}

#[test]
fn multiple_appends_replay_in_order() {
    let mut j = Journaled::new(None);
    let a1 = j.append(grow);
    let a2 = j.append(shrink);
    // A big one: every LBA of map leaf 1 moved, over several blocks.
    let a3 = j.append(|m| {
        for x in m.iter_mut().filter(|x| (508..1016).contains(&x.0)) {
            x.1 = (x.1 + 1) % 250;
        }
    });
    assert_eq!((a1, a2), (1, 2));
    let r = j.replay();
    assert_eq!(r.appends.len(), 3);
    assert_eq!(
        r.appends.iter().map(|a| a.first_seq).collect::<Vec<_>>(),
        [a1, a2, a3]
    );
    assert!(r.appends[2].blocks > 1, "{}", r.appends[2].blocks);
    assert_eq!(r.continued, r.applied_blocks());
    assert_eq!(r.end_seq, j.next_seq);
    assert_eq!((r.torn_blocks, r.damage.clone()), (0, None));
    // The records are those written, in order.
    let s = &j.states;
    assert_eq!(r.appends[0].records, s[0].changes_to(&s[1]));
    assert_eq!(r.appends[1].records, s[1].changes_to(&s[2]));
    assert_eq!(
        r.records(),
        (0..3)
            .map(|i| s[i].changes_to(&s[i + 1]).len() as u64)
            .sum::<u64>()
    );
    // Applied over the trees they give the last state, its counters too.
    let o = Overlay::of(&r.appends);
    assert_eq!(state_of(&s[0], &o), content(j.last()));
    assert_eq!(r.counters(), Some(Counters::of(&j.last().sb)));
    let st = r.state_superblock(&j.sb);
    assert_eq!(st.mapped_blocks, j.last().sb.mapped_blocks);
    assert_eq!(st.unique_writes, 253);
    assert_eq!(st.map_root, j.sb.map_root);
    // Later records win: an entry set twice has its last value.
    assert_eq!(o.map.get(&320), Some(&261));
    // Only the first two: the state after the second.
    let o2 = Overlay::of(&r.appends[..2]);
    assert_eq!(state_of(&s[0], &o2), content(&s[2]));
}

#[test]
fn the_ring_wraps_around() {
    // 16 blocks at 70 from epoch 13: sequence 16 lives at the run's
    // first block.
    let mut j = Journaled::new(Some((70, 16, 13)));
    let mut firsts = Vec::new();
    for k in 0..5u64 {
        firsts.push(j.append(move |m| m.push((1800 + k, 280 + k))));
    }
    assert_eq!(firsts, [13, 14, 15, 16, 17]);
    assert_eq!(j.sb.journal_block(16), 70);
    assert_eq!(j.block(16).header.blocknr, 70);
    assert_eq!(j.block(15).header.blocknr, 85);
    let r = j.replay();
    assert_eq!(r.appends.len(), 5);
    assert_eq!(r.end_seq, 18);
    assert_eq!(
        state_of(&j.states[0], &Overlay::of(&r.appends)),
        content(j.last())
    );
    // Fill the ring: 16 blocks continue, no more is read.
    for k in 5..16u64 {
        j.append(move |m| m.push((1800 + k, 280 + k)));
    }
    let r = j.replay();
    assert_eq!((r.appends.len(), r.continued), (16, 16));
    assert_eq!(r.end, End::RingFull);
    assert!(r.end_text().contains("all 16 blocks"));
    // A sequence number near 2^64 wraps too.
    let mut j = Journaled::new(Some((70, 16, u64::MAX - 1)));
    j.append(grow);
    j.append(shrink);
    let r = j.replay();
    assert_eq!(r.appends.len(), 2);
    assert_eq!(r.appends[1].first_seq, u64::MAX);
    assert_eq!(r.end_seq, 0);
}

#[test]
fn a_torn_final_append_is_ignored() {
    let mut j = Journaled::new(None);
    j.append(grow);
    // An append of 3 blocks of which only the first two reached the disk.
    let next = j.next_state(|m| {
        for x in m.iter_mut() {
            x.1 = (x.1 + 7) % 250;
        }
    });
    let recs = j.last().changes_to(&next);
    let blocks = j.blocks_of(&recs);
    assert!(blocks.len() >= 3, "{}", blocks.len());
    for b in &blocks[..2] {
        j.dev.write_block(b.header.blocknr, &b.encode()).unwrap();
    }
    let r = j.replay();
    assert_eq!(r.appends.len(), 1);
    assert_eq!((r.continued, r.torn_blocks), (3, 2));
    assert_eq!(
        r.torn_records,
        (JournalBlock::fits(&recs) + JournalBlock::fits(&recs[JournalBlock::fits(&recs)..])) as u64
    );
    assert_eq!(r.damage, None);
    assert_eq!(r.end_seq, 4);
    assert_eq!(
        state_of(&j.states[0], &Overlay::of(&r.appends)),
        content(&j.states[1])
    );
    // The last block written torn (half old, half new): the same.
    let mut torn = *blocks[2].encode();
    torn[2048..].fill(0);
    j.dev.write_block(blocks[2].header.blocknr, &torn).unwrap();
    let r = j.replay();
    assert_eq!((r.appends.len(), r.torn_blocks), (1, 2));
    assert!(
        r.end_text().contains("fails its checksum"),
        "{}",
        r.end_text()
    );
}

#[test]
fn a_stale_block_of_another_epoch_ends_the_journal() {
    let mut j = Journaled::new(None);
    j.append(grow);
    j.append(shrink);
    j.append(|m| m.push((1999, 299)));
    // A checkpoint after the first append would start epoch 2: the block
    // at sequence 2 is then of epoch 1, stale.
    let mut later = j.sb.clone();
    later.journal_seq = 2;
    let r = replay(&j.dev, &later).unwrap();
    assert_eq!((r.continued, r.appends.len()), (0, 0));
    assert!(
        r.end_text().contains("another epoch (1, not 2)"),
        "{}",
        r.end_text()
    );
    // A block of another epoch in the middle: the journal ends before it,
    // the appends after it are not applied.
    j.edit(3, |b| b.epoch = 7);
    let r = j.replay();
    assert_eq!(r.appends.len(), 2);
    assert_eq!(r.end_seq, 3);
    assert!(matches!(&r.end, End::Block { seq: 3, why, .. } if why.contains("epoch (7, not 1)")));
    // Likewise another journal id, sequence, location or type.
    for (f, why) in [
        (
            (|b: &mut JournalBlock| b.journal_id ^= 1) as fn(&mut JournalBlock),
            "another journal",
        ),
        (|b| b.seq = 9, "sequence number 9, not 2"),
        (|b| b.header.blocknr += 1, "claims to be block"),
        (
            |b| b.header.btype = BT_LEAF,
            "not a journal block (type LEAF)",
        ),
    ] {
        let mut k = Journaled::new(None);
        k.append(grow);
        k.append(shrink);
        k.edit(2, f);
        let r = k.replay();
        assert_eq!(r.appends.len(), 1, "{why}");
        assert!(r.end_text().contains(why), "{}", r.end_text());
        assert_eq!(r.damage, None);
    }
}

#[test]
fn a_malformed_record_is_damage_not_the_end() {
    let mut j = Journaled::new(None);
    j.append(grow);
    let a2 = j.append(shrink);
    j.append(|m| m.push((1999, 299)));
    // A record of an unknown type in the second append, resealed: the
    // block still continues the journal.
    j.edit(a2, |b| b.payload[16 + 7] = 0x7f);
    let r = j.replay();
    assert_eq!(r.appends.len(), 1);
    let d = r.damage.clone().unwrap();
    assert_eq!((d.seq, d.append_seq, d.offset), (a2, a2, Some(16)));
    assert_eq!(d.block, j.sb.journal_block(a2));
    assert!(d.why.contains("unknown record type 127"), "{}", d.why);
    // It continues: the journal ends after the third append, which is
    // dropped with the damaged one.
    assert_eq!((r.continued, r.end_seq), (3, 4));
    assert_eq!((r.dropped.blocks, r.dropped.appends), (2, 2));
    let recs2 = j.states[1].changes_to(&j.states[2]).len() as u64;
    let recs3 = j.states[2].changes_to(&j.states[3]).len() as u64;
    assert_eq!(r.dropped.records, 1 + recs3);
    assert!(recs2 > 2);
    assert_eq!(r.torn_blocks, 0);
    assert_eq!(
        state_of(&j.states[0], &Overlay::of(&r.appends)),
        content(&j.states[1])
    );
    // The other faults the kernel refuses.
    type Edit = fn(&mut JournalBlock);
    for (f, why) in [
        ((|b| b.used = 4040) as Edit, "bad record length"),
        (|b| b.used -= 8, "crossing"),
        (|b| b.flags |= 4, "unknown flags"),
        (|b| b.payload[8 + 4] = 1, "above 32 bits"),
        (|b| b.payload[1] = 0xff, "beyond the logical size"),
        (
            |b| b.payload[8..16].copy_from_slice(&1000u64.to_le_bytes()),
            "beyond the data device",
        ),
        (|b| b.used -= 56, "does not end with its counters"),
    ] {
        let mut k = Journaled::new(None);
        // One block: map record of LBA 0, refcount of PBA 0, counters.
        let recs = [
            Record::Map { lba: 0, value: 1 },
            Record::Refcount { pba: 0, count: 6 },
            Record::Counters(Counters::of(&k.last().sb)),
        ];
        k.append_records(&recs);
        let fix = |b: &mut JournalBlock| {
            // The refcount record first where the test pokes at it.
            if why == "above 32 bits" {
                let (a, rest) = b.payload.split_at_mut(16);
                a.swap_with_slice(&mut rest[..16]);
            }
            f(b);
        };
        k.edit(1, fix);
        let r = k.replay();
        assert_eq!(r.appends.len(), 0, "{why}");
        let d = r.damage.expect(why);
        assert!(d.why.contains(why), "{why}: {}", d.why);
    }
    // An END block without records: its append has no counters.
    let mut k = Journaled::new(None);
    k.append_records(&[]);
    let d = k.replay().damage.unwrap();
    assert!(
        d.why.contains("does not end with its counters"),
        "{}",
        d.why
    );
    // Damage in a torn tail is damage too (the kernel checks every block
    // that continues the journal).
    let mut k = Journaled::new(None);
    k.append(grow);
    let mut b = k.blocks_of(&[Record::Map { lba: 5, value: 0 }]).remove(0);
    b.flags = 0;
    b.payload[7] = 0x33;
    k.dev.write_block(b.header.blocknr, &b.encode()).unwrap();
    let r = k.replay();
    assert_eq!((r.appends.len(), r.torn_blocks), (1, 0));
    assert_eq!(r.damage.unwrap().append_seq, 2);
}

#[test]
fn an_unreadable_block_ends_it_with_a_read_error() {
    let mut j = Journaled::new(Some((70, 16, 1)));
    j.append(grow);
    // A device that ends inside the run.
    let mut short = j.dev.clone();
    short.bytes.truncate(72 * BLOCK_SIZE);
    let r = replay(&short, &j.sb).unwrap();
    assert_eq!(r.appends.len(), 1);
    assert!(matches!(
        r.end,
        End::ReadError {
            seq: 2,
            block: 72,
            ..
        }
    ));
    assert!(r.end_text().contains("cannot be read"));
}

#[test]
fn an_unflushed_newest_append_whose_data_is_there_is_applied() {
    let mut j = Journaled::with_data();
    j.append(shrink);
    let a2 = j.append(grow);
    j.mark_unflushed(a2);
    let data = data_device();
    // Without the data: applied as it is, and said so.
    let mut r = j.replay();
    assert!(r.damage.is_none());
    assert_eq!(r.appends.len(), 2);
    assert!(!r.appends[0].unflushed && r.appends[1].unflushed);
    let u = r.unflushed.clone().unwrap();
    let last = j.next_seq - 1;
    assert_eq!((u.first_seq, u.last_seq), (a2, last));
    assert_eq!(u.outcome, UnflushedOutcome::Unchecked);
    assert!(
        u.text().contains("not checked against the data"),
        "{}",
        u.text()
    );
    // With it: every block the append makes live holds its data.
    r.check_unflushed(&data, crate::fingerprint::Hasher::Sha256, 32)
        .unwrap();
    let u = r.unflushed.clone().unwrap();
    assert_eq!(u.outcome, UnflushedOutcome::Applied);
    // PBAs 250..260 and 261, the blocks grow makes live (260 already is,
    // since shrink).
    assert_eq!((u.data_blocks_checked, u.mismatch), (Some(11), None));
    assert_eq!(
        u.text(),
        format!("newest append (sequence {a2}..{last}) unflushed: its data checked, applied")
    );
    assert_eq!(r.appends.len(), 2);
    assert_eq!(
        state_of(&j.states[0], &Overlay::of(&r.appends)),
        content(&j.states[2])
    );
    // Only the newest append is checked: an older one carrying the flag
    // was followed by another, so its flush completed.
    let mut k = Journaled::with_data();
    let b1 = k.append(grow);
    k.mark_unflushed(b1);
    k.append(shrink);
    let mut short = data_device();
    short.bytes.truncate(250 * BLOCK_SIZE);
    let mut r = k.replay();
    assert_eq!(r.unflushed, None);
    r.check_unflushed(&short, crate::fingerprint::Hasher::Sha256, 32)
        .unwrap();
    assert_eq!(r.appends.len(), 2);
}

#[test]
fn an_unflushed_newest_append_whose_data_differs_is_dropped() {
    let mut j = Journaled::with_data();
    j.append(shrink);
    let a2 = j.append(grow);
    j.mark_unflushed(a2);
    let mut data = data_device();
    // PBA 257 never received its data; 261 neither, later in the records.
    data.block_mut(257)[9] ^= 1;
    data.block_mut(261).fill(0);
    let mut r = j.replay();
    r.check_unflushed(&data, crate::fingerprint::Hasher::Sha256, 32)
        .unwrap();
    let u = r.unflushed.clone().unwrap();
    assert_eq!(u.outcome, UnflushedOutcome::Dropped);
    assert_eq!(u.mismatch, Some(257));
    assert!(
        u.text().ends_with(
            "data block 257 does not hold its fingerprint: dropped, as the kernel does (it was \
             never acknowledged)"
        ),
        "{}",
        u.text()
    );
    // Not damage: the state is the one after the append before it.
    assert!(r.damage.is_none());
    assert_eq!(r.appends.len(), 1);
    assert_eq!(r.counters(), Some(Counters::of(&j.states[1].sb)));
    assert_eq!(
        state_of(&j.states[0], &Overlay::of(&r.appends)),
        content(&j.states[1])
    );
    // The only append dropped: the superblock's state.
    let mut k = Journaled::with_data();
    let b1 = k.append(grow);
    k.mark_unflushed(b1);
    let mut r = k.replay();
    r.check_unflushed(&data, crate::fingerprint::Hasher::Sha256, 32)
        .unwrap();
    assert_eq!((r.appends.len(), r.counters()), (0, None));
    // A digest shorter than 32 bytes: compared as the record keeps it,
    // fp_size bytes zero-padded.
    let mut r = k.replay();
    r.check_unflushed(&data_device(), crate::fingerprint::Hasher::Sha256, 8)
        .unwrap();
    assert_eq!(r.unflushed.unwrap().mismatch, Some(250));
    // A data block that cannot be read: an error, not a verdict.
    let mut short = data_device();
    short.bytes.truncate(255 * BLOCK_SIZE);
    let mut r = k.replay();
    let e = r
        .check_unflushed(&short, crate::fingerprint::Hasher::Sha256, 32)
        .unwrap_err();
    assert!(e.contains("data block 255 cannot be read"), "{e}");
    // Unless a block before it in record order already failed: the
    // kernel stops there, dropping the append.
    short.block_mut(250)[0] ^= 1;
    let mut r = k.replay();
    r.check_unflushed(&short, crate::fingerprint::Hasher::Sha256, 32)
        .unwrap();
    assert_eq!(r.unflushed.unwrap().mismatch, Some(250));
}

#[test]
fn an_unflushed_append_checks_every_block_it_made_live() {
    let mut j = Journaled::with_data();
    // PBA 290 is made live and freed again within the append: its data
    // was written before the flush too, so it is checked, and as it does
    // not hold the content its record names, the append is dropped.
    let recs = [
        Record::Refcount { pba: 290, count: 1 },
        Record::Fingerprint {
            pba: 290,
            fp: [7; FP_SIZE],
        },
        Record::Refcount { pba: 290, count: 0 },
        Record::Fingerprint {
            pba: 291,
            fp: data_fp(291),
        },
        Record::Counters(Counters::of(&j.last().sb)),
    ];
    let a = j.append_records(&recs);
    j.mark_unflushed(a);
    let mut r = j.replay();
    assert_eq!(
        blocks_to_verify(&r.appends[0]),
        [(290, [7; FP_SIZE]), (291, data_fp(291))].to_vec()
    );
    r.check_unflushed(&data_device(), crate::fingerprint::Hasher::Sha256, 32)
        .unwrap();
    let u = r.unflushed.unwrap();
    assert_eq!(u.outcome, UnflushedOutcome::Dropped);
    assert_eq!(u.mismatch, Some(290));
}

#[test]
fn unflushed_without_the_superblock_flag_is_damage() {
    let mut j = Journaled::new(None);
    j.append(shrink);
    let a2 = j.append(grow);
    j.mark_unflushed(a2);
    let r = j.replay();
    let d = r.damage.clone().unwrap();
    assert_eq!((d.seq, d.append_seq), (a2, a2));
    assert!(d.why.contains("UNFLUSHED"), "{}", d.why);
    assert_eq!((r.appends.len(), r.unflushed), (1, None));
    // Under the flag, an unknown bit is still damage.
    let mut k = Journaled::with_data();
    let b1 = k.append(grow);
    k.edit(b1, |b| b.flags |= JF_UNFLUSHED | 0x4);
    let d = k.replay().damage.unwrap();
    assert!(d.why.contains("unknown flags 0x4"), "{}", d.why);
}
