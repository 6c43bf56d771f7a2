//! `dedup dump` and `dedup restore`: the portable JSON form of a metadata
//! device. The schema is documented in tools/README.md.
//!
//! A dump holds the state: the superblock's trees with its journal
//! replayed. The journal's appends are dumped too, for reading; restore
//! ignores them (their effect is already in the mappings and blocks) and
//! writes the state as trees, with an empty journal.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::check::{self, CheckOptions, Contents};
use crate::device::{BlockDev, FileDev};
use crate::journal::{self, Replay};
use crate::ondisk::*;
use crate::util::*;
use crate::writer::{self, ImageSpec};

pub const DUMP_FORMAT: &str = "dm-dedup-metadata-dump";
pub const DUMP_VERSION: u32 = 1;

/// The superblock fields a dump carries. Roots and metadata_blocks are
/// not carried: they describe where things were on the old device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpSuperblock {
    pub generation: u64,
    pub format_version: u32,
    pub block_size: u32,
    /// Size of the device the dump was taken from (informational).
    pub metadata_blocks: u64,
    pub data_blocks: u64,
    pub logical_blocks: u64,
    pub hash: String,
    pub fp_size: u32,
    pub flags: u32,
    pub mapped_blocks: u64,
    pub used_data_blocks: u64,
    pub unique_writes: u64,
    pub duplicate_writes: u64,
    pub zero_writes: u64,
    pub discarded_blocks: u64,
    pub format_time: u64,
    /// Version 2: where the journal was and its epoch and id
    /// (informational, like metadata_blocks: restore makes a new one).
    #[serde(default)]
    pub journal_start: u64,
    #[serde(default)]
    pub journal_blocks: u64,
    #[serde(default)]
    pub journal_seq: u64,
    #[serde(default)]
    pub journal_id: u64,
}

/// One journal record, as dumped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum DumpRecord {
    /// `pba` null: the record unmaps the logical block.
    Map {
        lba: u64,
        pba: Option<u64>,
    },
    Refcount {
        pba: u64,
        refcount: u32,
    },
    Fingerprint {
        pba: u64,
        fingerprint: String,
    },
    Counters {
        mapped_blocks: u64,
        used_data_blocks: u64,
        unique_writes: u64,
        duplicate_writes: u64,
        zero_writes: u64,
        discarded_blocks: u64,
    },
}

impl DumpRecord {
    pub fn of(r: &Record) -> DumpRecord {
        match *r {
            Record::Map { lba, value } => DumpRecord::Map {
                lba,
                pba: value.checked_sub(1),
            },
            Record::Refcount { pba, count } => DumpRecord::Refcount {
                pba,
                refcount: count,
            },
            Record::Fingerprint { pba, fp } => DumpRecord::Fingerprint {
                pba,
                fingerprint: hex(&fp),
            },
            Record::Counters(c) => DumpRecord::Counters {
                mapped_blocks: c.mapped_blocks,
                used_data_blocks: c.used_data_blocks,
                unique_writes: c.unique_writes,
                duplicate_writes: c.duplicate_writes,
                zero_writes: c.zero_writes,
                discarded_blocks: c.discarded_blocks,
            },
        }
    }

    /// One line of the dump: `{"type": "map", "lba": 3, "pba": 7}`.
    fn line(&self) -> String {
        match self {
            DumpRecord::Map { lba, pba } => format!(
                "{{\"type\": \"map\", \"lba\": {lba}, \"pba\": {}}}",
                pba.map_or("null".to_string(), |p| p.to_string())
            ),
            DumpRecord::Refcount { pba, refcount } => {
                format!("{{\"type\": \"refcount\", \"pba\": {pba}, \"refcount\": {refcount}}}")
            }
            DumpRecord::Fingerprint { pba, fingerprint } => format!(
                "{{\"type\": \"fingerprint\", \"pba\": {pba}, \"fingerprint\": {}}}",
                serde_json::Value::from(fingerprint.as_str())
            ),
            DumpRecord::Counters {
                mapped_blocks,
                used_data_blocks,
                unique_writes,
                duplicate_writes,
                zero_writes,
                discarded_blocks,
            } => format!(
                "{{\"type\": \"counters\", \"mapped_blocks\": {mapped_blocks}, \
                 \"used_data_blocks\": {used_data_blocks}, \"unique_writes\": {unique_writes}, \
                 \"duplicate_writes\": {duplicate_writes}, \"zero_writes\": {zero_writes}, \
                 \"discarded_blocks\": {discarded_blocks}}}"
            ),
        }
    }
}

/// One whole append that replay applied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpAppend {
    pub first_seq: u64,
    pub blocks: u64,
    /// Its blocks carry UNFLUSHED (only the newest append may).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unflushed: bool,
    pub records: Vec<DumpRecord>,
}

/// The journal that follows the dumped superblock: what replay applied to
/// its trees to give the state dumped, and where the journal ends.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpJournal {
    pub start: u64,
    pub blocks: u64,
    pub id: u64,
    pub epoch: u64,
    /// Blocks that continue the journal from the epoch.
    pub blocks_in_epoch: u64,
    /// The first sequence number that does not continue it, and why.
    pub end_seq: u64,
    pub end: String,
    /// Blocks after the last END, ignored (an append torn by a crash).
    pub torn_blocks: u64,
    /// A malformed block (the dump was forced): what replay stopped at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub damage: Option<String>,
    /// The newest append is unflushed: dump has no data device, so it is
    /// applied as it is, unchecked (what the kernel does when its data is
    /// there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unflushed: Option<String>,
    pub appends: Vec<DumpAppend>,
}

impl DumpJournal {
    pub fn of(r: &Replay) -> DumpJournal {
        DumpJournal {
            start: r.start,
            blocks: r.nr_blocks,
            id: r.id,
            epoch: r.epoch,
            blocks_in_epoch: r.continued,
            end_seq: r.end_seq,
            end: r.end_text(),
            torn_blocks: r.torn_blocks,
            damage: r.damage.as_ref().map(|d| {
                format!(
                    "block {} (sequence {}): {}; the appends from sequence {} on are not applied",
                    d.block, d.seq, d.why, d.append_seq
                )
            }),
            unflushed: r.unflushed.as_ref().map(|u| u.text()),
            appends: r
                .appends
                .iter()
                .map(|a| DumpAppend {
                    first_seq: a.first_seq,
                    blocks: a.blocks,
                    unflushed: a.unflushed,
                    records: a.records.iter().map(DumpRecord::of).collect(),
                })
                .collect(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mapping {
    pub lba: u64,
    pub pba: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRecord {
    pub pba: u64,
    pub refcount: u32,
    /// The 32-byte fingerprint record in lower-case hex (64 digits); bytes
    /// past fp_size are zero.
    pub fingerprint: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dump {
    pub format: String,
    pub version: u32,
    pub superblock: DumpSuperblock,
    /// Version 2: the journal replayed into the state dumped (ignored by
    /// restore).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<DumpJournal>,
    pub mappings: Vec<Mapping>,
    pub blocks: Vec<BlockRecord>,
}

impl DumpSuperblock {
    pub fn from_sb(sb: &Superblock) -> DumpSuperblock {
        DumpSuperblock {
            generation: sb.generation(),
            format_version: sb.version,
            block_size: sb.block_size,
            metadata_blocks: sb.metadata_blocks,
            data_blocks: sb.data_blocks,
            logical_blocks: sb.logical_blocks,
            hash: sb.hash(),
            fp_size: sb.fp_size,
            flags: sb.flags,
            mapped_blocks: sb.mapped_blocks,
            used_data_blocks: sb.used_data_blocks,
            unique_writes: sb.unique_writes,
            duplicate_writes: sb.duplicate_writes,
            zero_writes: sb.zero_writes,
            discarded_blocks: sb.discarded_blocks,
            format_time: sb.format_time,
            journal_start: sb.journal_start,
            journal_blocks: sb.journal_blocks,
            journal_seq: sb.journal_seq,
            journal_id: sb.journal_id,
        }
    }

    /// The dump of the state of `sb` on `dev`: its fields with the
    /// journal's counters, and the journal replayed (version 2).
    pub fn of_state(dev: &dyn BlockDev, sb: &Superblock) -> (DumpSuperblock, Option<DumpJournal>) {
        match journal::replay(dev, sb) {
            Some(r) => (
                DumpSuperblock::from_sb(&r.state_superblock(sb)),
                Some(DumpJournal::of(&r)),
            ),
            None => (DumpSuperblock::from_sb(sb), None),
        }
    }
}

/// Write `d` as JSON: the header pretty-printed, then one mapping or block
/// per line, so that large dumps stay readable and diffable.
pub fn write_dump(out: &mut dyn Write, sb: &DumpSuperblock, c: &Contents) -> io::Result<()> {
    write_dump_with_journal(out, sb, c, None)
}

/// write_dump with the journal replayed into the state (version 2): its
/// fields pretty-printed, then one record per line.
pub fn write_dump_with_journal(
    out: &mut dyn Write,
    sb: &DumpSuperblock,
    c: &Contents,
    journal: Option<&DumpJournal>,
) -> io::Result<()> {
    writeln!(out, "{{")?;
    writeln!(out, "  \"format\": \"{DUMP_FORMAT}\",")?;
    writeln!(out, "  \"version\": {DUMP_VERSION},")?;
    let sbj = serde_json::to_string_pretty(sb)?.replace('\n', "\n  ");
    writeln!(out, "  \"superblock\": {sbj},")?;
    if let Some(j) = journal {
        let head = DumpJournal {
            appends: Vec::new(),
            ..j.clone()
        };
        let hj = serde_json::to_string_pretty(&head)?.replace('\n', "\n  ");
        // `"appends": []` is the last field: open it again.
        let hj = hj
            .strip_suffix("[]\n  }")
            .expect("appends is the last field");
        write!(out, "  \"journal\": {hj}[")?;
        for (i, a) in j.appends.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(
                out,
                "{sep}\n      {{\"first_seq\": {}, \"blocks\": {}, {}\"records\": [",
                a.first_seq,
                a.blocks,
                if a.unflushed {
                    "\"unflushed\": true, "
                } else {
                    ""
                }
            )?;
            for (k, r) in a.records.iter().enumerate() {
                let sep = if k == 0 { "" } else { "," };
                write!(out, "{sep}\n        {}", r.line())?;
            }
            write!(
                out,
                "{}]}}",
                if a.records.is_empty() { "" } else { "\n      " }
            )?;
        }
        writeln!(
            out,
            "{}]\n  }},",
            if j.appends.is_empty() { "" } else { "\n    " }
        )?;
    }
    write!(out, "  \"mappings\": [")?;
    for (i, &(lba, pba)) in c.mappings.iter().enumerate() {
        let sep = if i == 0 { "" } else { "," };
        write!(out, "{sep}\n    {{\"lba\": {lba}, \"pba\": {pba}}}")?;
    }
    writeln!(out, "{}],", if c.mappings.is_empty() { "" } else { "\n  " })?;
    write!(out, "  \"blocks\": [")?;
    for (i, (pba, rc, fp)) in c.blocks.iter().enumerate() {
        let sep = if i == 0 { "" } else { "," };
        write!(
            out,
            "{sep}\n    {{\"pba\": {pba}, \"refcount\": {rc}, \"fingerprint\": \"{}\"}}",
            hex(fp)
        )?;
    }
    writeln!(out, "{}]", if c.blocks.is_empty() { "" } else { "\n  " })?;
    writeln!(out, "}}")?;
    out.flush()
}

/// Dump the metadata of `dev` into `out`. Err((exit code, message)).
pub fn dump_to(
    dev: &dyn BlockDev,
    out: &mut dyn Write,
    force: bool,
) -> Result<check::Report, (i32, String)> {
    let opts = CheckOptions {
        collect: true,
        max_problems: 20,
        ..CheckOptions::default()
    };
    let (report, contents) = check::check(dev, &opts).map_err(|f| (EXIT_OPERATIONAL, f.0))?;
    let Some(sbi) = &report.superblock else {
        return Err((
            EXIT_ERRORS,
            "no valid superblock: nothing to dump (run dedup check)".into(),
        ));
    };
    if !report.clean() && !force {
        let first: Vec<String> = report
            .problems
            .iter()
            .filter(|p| p.severity == check::Severity::Error)
            .take(5)
            .map(|p| format!("  {}: {}", p.location(), p.message))
            .collect();
        return Err((
            EXIT_ERRORS,
            format!(
                "the metadata has {} errors; run dedup check (or dump what is readable with --force):\n{}",
                report.errors,
                first.join("\n")
            ),
        ));
    }
    let mut slot = zero_block();
    dev.read_block(sbi.slot, &mut slot)
        .map_err(|e| (EXIT_OPERATIONAL, format!("cannot read the superblock: {e}")))?;
    let sb = Superblock::decode(&slot);
    let contents = contents.unwrap_or_default();
    let (dsb, journal) = DumpSuperblock::of_state(dev, &sb);
    write_dump_with_journal(out, &dsb, &contents, journal.as_ref())
        .map_err(|e| (EXIT_OPERATIONAL, format!("cannot write the dump: {e}")))?;
    Ok(report)
}

pub fn run_dump(device: &Path, output: Option<&Path>, force: bool) -> i32 {
    let dev = match FileDev::open(device, false) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("dedup dump: {e}");
            return EXIT_OPERATIONAL;
        }
    };
    let mut out: Box<dyn Write> = match output {
        None => Box::new(BufWriter::new(io::stdout().lock())),
        Some(p) => match File::create(p) {
            Ok(f) => Box::new(BufWriter::new(f)),
            Err(e) => {
                eprintln!("dedup dump: {}: {e}", p.display());
                return EXIT_OPERATIONAL;
            }
        },
    };
    match dump_to(&dev, &mut *out, force) {
        Ok(r) => {
            if let Some(u) = r.journal.as_ref().and_then(|j| j.unflushed.as_ref()) {
                eprintln!("dedup dump: {}: journal: {}", device.display(), u.text());
            }
            if !r.clean() {
                eprintln!(
                    "dedup dump: {}: dumped despite {} errors (--force)",
                    device.display(),
                    r.errors
                );
                return EXIT_ERRORS;
            }
            if let (Some(p), Some(s)) = (output, &r.summary) {
                eprintln!(
                    "dedup dump: {} -> {}: {} mappings, {} live blocks",
                    device.display(),
                    p.display(),
                    s.mapped_blocks,
                    s.live_blocks
                );
            }
            EXIT_OK
        }
        Err((code, msg)) => {
            eprintln!("dedup dump: {}: {msg}", device.display());
            if let Some(p) = output {
                let _ = std::fs::remove_file(p);
            }
            code
        }
    }
}

/// Parse a dump from JSON text.
pub fn parse_dump(r: impl Read) -> Result<Dump, String> {
    serde_json::from_reader(BufReader::new(r)).map_err(|e| format!("not a valid dump: {e}"))
}

/// Check that a dump describes a consistent state and turn it into what
/// the writer needs. `generation` overrides the dump's. Every problem found
/// is returned (at most `max` listed).
pub fn validate(d: &Dump, generation: Option<u64>, max: usize) -> Result<ImageSpec, Vec<String>> {
    let mut errs: Vec<String> = Vec::new();
    let mut more = 0u64;
    let mut bad = |m: String| {
        if errs.len() < max {
            errs.push(m);
        } else {
            more += 1;
        }
    };
    let s = &d.superblock;
    if d.format != DUMP_FORMAT {
        bad(format!(
            "format is '{}', expected '{DUMP_FORMAT}'",
            d.format
        ));
    }
    if d.version != DUMP_VERSION {
        bad(format!(
            "dump version {} not supported (expected {DUMP_VERSION})",
            d.version
        ));
    }
    if s.format_version != FORMAT_VERSION && s.format_version != FORMAT_VERSION_V1 {
        bad(format!(
            "metadata format version {} not supported",
            s.format_version
        ));
    }
    if s.block_size != BLOCK_SIZE as u32 {
        bad(format!("block_size {} is not {BLOCK_SIZE}", s.block_size));
    }
    if s.fp_size < 4 || s.fp_size > FP_SIZE as u32 {
        bad(format!("fp_size {} not in 4..={FP_SIZE}", s.fp_size));
    }
    if s.hash.is_empty() || s.hash.len() >= HASH_NAME_LEN || s.hash.contains('\0') {
        bad(format!(
            "hash name '{}' is empty or longer than {} bytes",
            s.hash,
            HASH_NAME_LEN - 1
        ));
    }
    if s.data_blocks == 0 || s.logical_blocks == 0 {
        bad("data_blocks and logical_blocks must be at least 1".into());
    }
    let gen = generation.unwrap_or(s.generation);
    if gen == 0 {
        bad("generation 0 is invalid (the first commit is generation 1)".into());
    }
    if gen > MAX_TXN {
        bad(if generation.is_some() {
            generation_too_large(gen)
        } else {
            format!(
                "{}; give a lower one with --generation N",
                generation_too_large(gen)
            )
        });
    }

    let mut mappings: Vec<(u64, u64)> = Vec::with_capacity(d.mappings.len());
    let mut refs: HashMap<u64, u64> = HashMap::new();
    for m in &d.mappings {
        if m.lba >= s.logical_blocks {
            bad(format!(
                "mapping lba {} -> pba {}: lba beyond logical_blocks {}",
                m.lba, m.pba, s.logical_blocks
            ));
            continue;
        }
        if m.pba >= s.data_blocks {
            bad(format!(
                "mapping lba {} -> pba {}: pba beyond data_blocks {}",
                m.lba, m.pba, s.data_blocks
            ));
            continue;
        }
        *refs.entry(m.pba).or_default() += 1;
        mappings.push((m.lba, m.pba));
    }
    mappings.sort_unstable();
    for w in mappings.windows(2) {
        if w[0].0 == w[1].0 {
            bad(format!(
                "lba {} is mapped twice (pba {} and {})",
                w[0].0, w[0].1, w[1].1
            ));
        }
    }

    let mut blocks: Vec<(u64, u32, [u8; FP_SIZE])> = Vec::with_capacity(d.blocks.len());
    for b in &d.blocks {
        if b.pba >= s.data_blocks {
            bad(format!(
                "block pba {}: beyond data_blocks {}",
                b.pba, s.data_blocks
            ));
            continue;
        }
        let n = refs.remove(&b.pba).unwrap_or(0);
        if b.refcount == 0 {
            // The kernel reads a count of 0 as a free block.
            bad(format!(
                "block pba {}: refcount 0: a block record names a live block",
                b.pba
            ));
        } else if b.refcount as u64 != n {
            bad(format!(
                "block pba {}: refcount {} but {n} mappings point at it",
                b.pba, b.refcount
            ));
        }
        let fp = match unhex(&b.fingerprint) {
            Some(v) if v.len() <= FP_SIZE => {
                let mut f = [0u8; FP_SIZE];
                f[..v.len()].copy_from_slice(&v);
                f
            }
            _ => {
                bad(format!(
                    "block pba {}: fingerprint is not up to {} hex digits",
                    b.pba,
                    2 * FP_SIZE
                ));
                continue;
            }
        };
        // Bytes past fp_size are kept as they are: the kernel never writes
        // them, check warns about them, a dump carries them unchanged.
        if is_zero(&fp) && s.fp_size as usize >= check::STRONG_FP_SIZE {
            bad(format!("block pba {}: fingerprint is all zero", b.pba));
        }
        blocks.push((b.pba, b.refcount, fp));
    }
    blocks.sort_unstable_by_key(|b| b.0);
    for w in blocks.windows(2) {
        if w[0].0 == w[1].0 {
            bad(format!("block pba {} is listed twice", w[0].0));
        }
    }
    let mut orphans: Vec<_> = refs.into_iter().collect();
    orphans.sort_unstable();
    for (pba, n) in orphans {
        bad(format!(
            "pba {pba}: {n} mappings point at it but it has no block record"
        ));
    }
    if s.mapped_blocks != d.mappings.len() as u64 {
        bad(format!(
            "mapped_blocks is {} but there are {} mappings",
            s.mapped_blocks,
            d.mappings.len()
        ));
    }
    if s.used_data_blocks != d.blocks.len() as u64 {
        bad(format!(
            "used_data_blocks is {} but there are {} block records",
            s.used_data_blocks,
            d.blocks.len()
        ));
    }
    let mut sb = Superblock::new_formatted(
        0,
        s.data_blocks,
        s.logical_blocks,
        &s.hash,
        s.fp_size,
        s.format_time,
    );
    sb.header.txn = gen;
    // UNFLUSHED_APPENDS, if the dump has it, is cleared by the writer: the
    // journal restored is empty.
    sb.flags = s.flags;
    sb.mapped_blocks = s.mapped_blocks;
    sb.used_data_blocks = s.used_data_blocks;
    sb.unique_writes = s.unique_writes;
    sb.duplicate_writes = s.duplicate_writes;
    sb.zero_writes = s.zero_writes;
    sb.discarded_blocks = s.discarded_blocks;
    // The same rules check applies to a superblock (the generation was
    // judged above, with a message that says where it came from).
    for (sev, code, msg) in check::superblock_rules(&sb) {
        if sev == check::Severity::Error && code != "txn_too_large" {
            bad(format!("superblock: {msg}"));
        }
    }
    if more > 0 {
        errs.push(format!("... and {more} more problems"));
    }
    if !errs.is_empty() {
        return Err(errs);
    }

    Ok(ImageSpec {
        sb,
        mappings,
        refcounts: blocks.iter().map(|b| (b.0, b.1)).collect(),
        fingerprints: blocks.iter().map(|b| (b.0, b.2)).collect(),
    })
}

/// Why a generation cannot be written: the kernel refuses it (dd_check_sb).
fn generation_too_large(gen: u64) -> String {
    format!(
        "generation {gen} is above {MAX_TXN} (2^64 - 2^32 - 1, DD_MAX_TXN), the highest \
         transaction id the kernel accepts"
    )
}

/// Why restore refuses `dump`, if it does: its state includes a newest
/// journal append written while its data was being flushed, which dump
/// (without a data device) applied unchecked. The kernel would check it
/// at activation and might drop it; restore would make it permanent.
pub fn unchecked_append(dump: &Dump) -> Option<String> {
    let u = dump.journal.as_ref()?.unflushed.as_ref()?;
    Some(format!(
        "refused: journal: {u}; restoring would make that append permanent without its data \
         checked. Check it first (`dedup repair --data DATA` on the source metadata device, or \
         activate the device once and remove it), then dump again"
    ))
}

/// Write `spec` to `dev` (metadata_blocks = the device size) after the
/// size and overwrite checks. Err((exit code, message)).
pub fn restore_to(
    dev: &mut dyn BlockDev,
    mut spec: ImageSpec,
    force: bool,
) -> Result<(Superblock, check::Report), (i32, String)> {
    let have = dev.nr_blocks();
    let need = required_blocks(spec.sb.logical_blocks, spec.sb.data_blocks);
    if have < need {
        return Err((
            EXIT_OPERATIONAL,
            format!(
                "device too small: {have} blocks ({}), the dump's sizes need {need} blocks ({})",
                human_bytes(have << 12),
                human_bytes(need.saturating_mul(4096))
            ),
        ));
    }
    if !force {
        if let Some(why) = overwrite_refusal("the device", &check::read_slots(dev)) {
            return Err((EXIT_OPERATIONAL, why));
        }
    }
    spec.sb.metadata_blocks = have;
    let (sb, _) = writer::write_image(dev, &spec)
        .map_err(|e| (EXIT_OPERATIONAL, format!("write failed: {e}")))?;
    let opts = CheckOptions {
        max_problems: 20,
        ..CheckOptions::default()
    };
    let (report, _) = check::check(dev, &opts).map_err(|f| {
        (
            EXIT_ERRORS,
            format!("the restored metadata does not check: {f}"),
        )
    })?;
    if !report.clean() {
        return Err((
            EXIT_ERRORS,
            format!(
                "the restored metadata has {} errors (a bug: please report): {}",
                report.errors,
                report
                    .problems
                    .iter()
                    .filter(|p| p.severity == check::Severity::Error)
                    .map(|p| format!("{}: {}", p.location(), p.message))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        ));
    }
    Ok((sb, report))
}

pub fn run_restore(input: &Path, device: &Path, force: bool, generation: Option<u64>) -> i32 {
    if let Some(g) = generation.filter(|&g| g > MAX_TXN) {
        eprintln!(
            "dedup restore: --generation refused: {} (it refuses to activate such a device)",
            generation_too_large(g)
        );
        return EXIT_OPERATIONAL;
    }
    let parsed = if input == Path::new("-") {
        parse_dump(io::stdin().lock())
    } else {
        match File::open(input) {
            Ok(f) => parse_dump(f),
            Err(e) => {
                eprintln!("dedup restore: {}: {e}", input.display());
                return EXIT_OPERATIONAL;
            }
        }
    };
    let dump = match parsed {
        Ok(d) => d,
        Err(e) => {
            eprintln!("dedup restore: {}: {e}", input.display());
            return EXIT_OPERATIONAL;
        }
    };
    if let Some(why) = unchecked_append(&dump) {
        eprintln!("dedup restore: {}: {why}", input.display());
        return EXIT_OPERATIONAL;
    }
    let spec = match validate(&dump, generation, 50) {
        Ok(s) => s,
        Err(errs) => {
            eprintln!(
                "dedup restore: {}: the dump is inconsistent, refusing it:",
                input.display()
            );
            for e in errs {
                eprintln!("  {e}");
            }
            return EXIT_OPERATIONAL;
        }
    };
    let mut dev = match FileDev::open(device, true) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("dedup restore: {e}");
            return EXIT_OPERATIONAL;
        }
    };
    match restore_to(&mut dev, spec, force) {
        Ok((sb, report)) => {
            let s = report.summary.unwrap_or_default();
            println!(
                "restored {} -> {}: generation {} in slot {}, {} mappings, {} live blocks, {} metadata blocks used of {}",
                input.display(),
                device.display(),
                sb.generation(),
                sb.slot(),
                s.mapped_blocks,
                s.live_blocks,
                s.metadata_blocks_used,
                sb.metadata_blocks
            );
            EXIT_OK
        }
        Err((code, msg)) => {
            eprintln!("dedup restore: {}: {msg}", device.display());
            code
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDev;
    use crate::writer::{test_fingerprint, write_image};

    /// A small consistent state of generation 7, dumped and parsed back.
    fn sample_dump() -> Dump {
        let (logical, data) = (3000u64, 400u64);
        let blocks = required_blocks(logical, data) + 4;
        let mut sb = Superblock::new_formatted(blocks, data, logical, "sha256", 32, 1_700_000_000);
        sb.header.txn = 7;
        let maps: Vec<(u64, u64)> = (0..900u64).map(|i| (i * 3, i % 300)).collect();
        let spec = ImageSpec::consistent(sb, &maps, test_fingerprint);
        let mut d = MemDev::new(blocks);
        let (sb, _) = write_image(&mut d, &spec).unwrap();
        let opts = CheckOptions {
            collect: true,
            ..CheckOptions::default()
        };
        let (r, c) = check::check(&d, &opts).unwrap();
        assert!(r.clean());
        let mut json = Vec::new();
        write_dump(&mut json, &DumpSuperblock::from_sb(&sb), &c.unwrap()).unwrap();
        parse_dump(&json[..]).unwrap()
    }

    fn only_error(r: Result<ImageSpec, Vec<String>>) -> String {
        let errs = r.unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        errs[0].clone()
    }

    /// Dump has no data device: an unflushed newest append is dumped
    /// applied, marked, with a word that it was not checked; restore
    /// refuses such a dump, and the state written from it (restore_to)
    /// has UNFLUSHED_APPENDS clear.
    #[test]
    fn an_unflushed_append_is_dumped_marked() {
        use crate::journal::tests::{contents_of, grow, shrink, Journaled};
        let mut j = Journaled::with_data();
        j.append(shrink);
        let a2 = j.append(grow);
        j.mark_unflushed(a2);
        let mut json = Vec::new();
        let r = dump_to(&j.dev, &mut json, false).unwrap();
        assert!(r.clean(), "{:#?}", r.problems);
        let text = String::from_utf8(json).unwrap();
        assert!(
            text.contains(&format!(
                "{{\"first_seq\": {a2}, \"blocks\": 1, \"unflushed\": true, \"records\": ["
            )),
            "{text}"
        );
        assert_eq!(text.matches("\"unflushed\": true").count(), 1);
        let d = parse_dump(text.as_bytes()).unwrap();
        let dj = d.journal.as_ref().unwrap();
        assert!(!dj.appends[0].unflushed && dj.appends[1].unflushed);
        assert!(
            dj.unflushed
                .as_ref()
                .unwrap()
                .contains("unflushed: not checked against the data"),
            "{dj:?}"
        );
        assert_eq!(d.superblock.flags, SB_UNFLUSHED_APPENDS);
        let why = unchecked_append(&d).expect("restore refuses it");
        assert!(why.contains("dedup repair --data"), "{why}");
        let mut flushed = d.clone();
        flushed.journal.as_mut().unwrap().unflushed = None;
        assert_eq!(unchecked_append(&flushed), None);
        let spec = validate(&d, None, 10).unwrap();
        assert_eq!(
            (spec.mappings.clone(), spec.refcounts.clone()),
            (j.states[2].mappings.clone(), j.states[2].refcounts.clone())
        );
        let mut dev = MemDev::new(j.dev.nr_blocks());
        let (sb, report) = restore_to(&mut dev, spec, false).unwrap();
        assert!(report.problems.is_empty(), "{:#?}", report.problems);
        assert_eq!(sb.flags, 0);
        let (_, c) = check::check(
            &dev,
            &CheckOptions {
                collect: true,
                ..CheckOptions::default()
            },
        )
        .unwrap();
        assert_eq!(c.unwrap(), contents_of(&j.states[2]));
    }

    #[test]
    fn a_block_record_with_refcount_zero_is_refused() {
        // The kernel reads a count of 0 as free: such a record, counted
        // as live, would make a state the kernel refuses.
        let mut d = sample_dump();
        let fingerprint = d.blocks[0].fingerprint.clone();
        d.blocks.push(BlockRecord {
            pba: 350,
            refcount: 0,
            fingerprint,
        });
        d.superblock.used_data_blocks += 1;
        let errs = validate(&d, None, 10).unwrap_err();
        assert!(
            errs.iter().any(|e| e.contains("block pba 350: refcount 0")),
            "{errs:?}"
        );
    }

    #[test]
    fn generation_above_the_limit_is_refused() {
        let d = sample_dump();
        // --generation above DD_MAX_TXN: one message, naming the limit.
        for g in [MAX_TXN + 1, u64::MAX] {
            let e = only_error(validate(&d, Some(g), 10));
            assert!(
                e.contains(&format!("generation {g} is above {MAX_TXN}")),
                "{e}"
            );
            assert!(!e.contains("--generation N"), "{e}");
        }
        // The dump's own generation above it: told to give another.
        let mut big = d.clone();
        big.superblock.generation = MAX_TXN + 1;
        let e = only_error(validate(&big, None, 10));
        assert!(e.contains("is above 18446744069414584319"), "{e}");
        assert!(e.contains("--generation N"), "{e}");
        assert_eq!(
            validate(&big, Some(3), 10).unwrap().sb.generation(),
            3,
            "--generation overrides the dump's"
        );
    }

    #[test]
    fn generation_at_the_limit_is_restored() {
        let d = sample_dump();
        let spec = validate(&d, Some(MAX_TXN), 10).unwrap();
        let mut dev = MemDev::new(required_blocks(spec.sb.logical_blocks, spec.sb.data_blocks));
        let (sb, report) = restore_to(&mut dev, spec, false).unwrap();
        assert!(report.problems.is_empty(), "{:#?}", report.problems);
        assert_eq!((sb.generation(), sb.slot()), (MAX_TXN, 1));
        assert!(is_zero(dev.block(0)));
    }

    #[test]
    fn run_restore_refuses_a_generation_above_the_limit() {
        let dir = std::env::temp_dir().join(format!("dedup-restore-gen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let dump = dir.join("d.json");
        std::fs::write(&dump, serde_json::to_string(&sample_dump()).unwrap()).unwrap();
        let dev = dir.join("meta");
        let before = vec![0x5au8; 64 * BLOCK_SIZE];
        std::fs::write(&dev, &before).unwrap();
        assert_eq!(
            run_restore(&dump, &dev, true, Some(MAX_TXN + 1)),
            EXIT_OPERATIONAL
        );
        assert_eq!(
            std::fs::read(&dev).unwrap(),
            before,
            "nothing may be written"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
