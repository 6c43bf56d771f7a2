//! `dedup`: userspace tools for the dm-dedup device-mapper target.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use dedup_tools::check::{self, CheckOptions};
use dedup_tools::device::{self, BlockDev, FileDev};
use dedup_tools::ondisk;
use dedup_tools::util::*;
use dedup_tools::{dump, estimate, repair, stats, writer};

macro_rules! exit_codes {
    () => {
        "\
EXIT STATUS
    0   success; for check: no errors (warnings may have been printed)
    1   repair: errors were corrected
    4   check: errors were found and left uncorrected; dump: the metadata
        has errors (use --force to dump anyway); restore: the restored
        metadata fails its check (a bug: please report it)
    8   operational error: cannot open or read a device, not a dm-dedup
        metadata device, device busy, too small, or the operation was
        refused (e.g. it would overwrite valid metadata without --force)
    16  usage or syntax error (for format also an unknown --hash)"
    };
}

const EXIT_CODES: &str = exit_codes!();

#[derive(Parser, Debug)]
#[command(
    name = "dedup",
    version,
    about = "Userspace tools for the dm-dedup device-mapper target",
    long_about = "Userspace tools for the dm-dedup device-mapper target, which deduplicates 4 KiB \
blocks between a metadata device and a data device.\n\n\
The tools read and write the metadata device directly, so they must only be run on a metadata \
device that no active dedup target uses: block devices are opened exclusively (O_EXCL), which \
the kernel refuses while device-mapper holds them.",
    after_long_help = EXIT_CODES,
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    Check(CheckArgs),
    Repair(RepairArgs),
    Format(FormatArgs),
    Dump(DumpArgs),
    Restore(RestoreArgs),
    Estimate(EstimateArgs),
    Stats(StatsArgs),
}

/// Check the metadata of a dm-dedup device offline (fsck).
///
/// Reads both superblock slots and reports each as valid, zero or bad (and
/// why), then chooses the valid one with the highest generation exactly as
/// the kernel does. From it, walks the three persistent arrays (map,
/// refcounts, fingerprints) reading each metadata block at most once, and
/// verifies: every block's CRC-32C, that it sits where its header says,
/// that its type, array and level match its place in the tree, that its
/// transaction is not newer than the superblock; that block numbers are in
/// range and no block is referenced twice (across all arrays); that no
/// child lies beyond the end of its array; that map entries point inside
/// the data device; that the refcount of every physical block equals the
/// number of logical blocks mapped to it; that every live block has a
/// fingerprint; and that the superblock counters (mapped_blocks,
/// used_data_blocks) match what the trees hold. A superblock whose
/// generation is above 2^64 - 2^32 - 1 (DD_MAX_TXN) is an error
/// (txn_too_large): the kernel refuses to activate it.
///
/// Format versions 1 and 2 are read. Version 2 has a redo journal: a run
/// of blocks the superblock names, where each flush appends its changes.
/// The state checked is the superblock's trees with the journal replayed
/// as the kernel replays it: from the superblock's epoch, the blocks that
/// carry its journal id, epoch and consecutive sequence numbers, grouped
/// into appends that end with an END block; every whole append is
/// applied, in order. Blocks after the last END are an append torn by a
/// crash: ignored, and not an error. A block that continues the journal
/// but is malformed (unknown record, record out of range, bad length or
/// flags, UNFLUSHED under a superblock without UNFLUSHED_APPENDS, an
/// append without its final counters) is an error (journal_damaged): the
/// kernel refuses to activate. The newest append may be *unflushed*
/// (written while the data device was being flushed for it, never
/// acknowledged): with --data it is applied only if every block it makes
/// live holds the content its fingerprint record names, and otherwise
/// dropped, as the kernel's replay does (not an error); without --data it
/// is applied unchecked, and the journal line says so. So are journal
/// fields the kernel refuses (journal_run) and a tree block inside the
/// journal's run (journal_overlap). The report says where the journal is,
/// how many blocks, appends and records follow the superblock, and where
/// and why it ends.
///
/// With --data, every live block is also read from the data device and
/// hashed with the superblock's hash, and the result compared with its
/// fingerprint record: a block whose content no longer matches its record
/// is an error (fingerprint_mismatch), since a later write of the content
/// the record names would be mapped onto this block's other bytes.
/// Placeholder records written by `dedup repair` are skipped. The data
/// device must have at least the size the metadata describes (a larger
/// one is a grown table, as with a larger --data-blocks); it is only read.
/// Hashes this tool computes: sha256, sha384, sha512, sha3-256, sha3-384,
/// sha3-512, blake2b-256, blake2b-384, blake2b-512, crc32c, crc32,
/// xxhash64.
///
/// Every problem is listed with its location: block number, array, level
/// and the logical (lba) or physical (pba) block index concerned. Nothing
/// is ever written.
#[derive(Args, Debug)]
#[command(after_long_help = concat!("EXAMPLES\n    dedup check /dev/vg/dedup-meta\n    dedup check meta.img --data-blocks 262144 --logical-blocks 1048576 --json\n    dedup check /dev/vg/dedup-meta --data /dev/vg/dedup-data\n\n", exit_codes!()))]
struct CheckArgs {
    /// Metadata device or image file.
    device: PathBuf,
    /// Also check the metadata against a table whose data device has this
    /// many 4 KiB blocks (default: the --data device's size). Fewer than
    /// the superblock's data_blocks is an error (table_mismatch: the
    /// kernel refuses to shrink); more is a warning (table_grows: the
    /// kernel grows the device at activation), and an error where the
    /// kernel would refuse to grow (metadata device too small for the new
    /// sizes, non-zero entries past an array's end, generation at
    /// DD_MAX_TXN).
    #[arg(long, value_name = "N")]
    data_blocks: Option<u64>,
    /// Also check the metadata against this logical size in 4 KiB blocks
    /// (the target length in sectors / 8), as --data-blocks: smaller is an
    /// error, larger a warning unless the kernel would refuse to grow.
    #[arg(long, value_name = "N")]
    logical_blocks: Option<u64>,
    /// Also require this hash algorithm.
    #[arg(long, value_name = "ALG")]
    hash: Option<String>,
    /// The data device (or image file): verify the fingerprint record of
    /// every live block against the block's content, and the data of an
    /// unflushed newest journal append as the kernel's replay does.
    #[arg(long, value_name = "DEV")]
    data: Option<PathBuf>,
    /// Print the report as JSON on stdout (see README.md for the schema).
    #[arg(long)]
    json: bool,
    /// List at most N problems (all are counted); 0 lists all.
    #[arg(long, value_name = "N", default_value_t = 10000)]
    max_problems: usize,
    /// When the check finds no error, clear the superblock's needs_check
    /// flag (set by the kernel when it found damage while running; the
    /// device opens read-only while it is set). Writes the same state
    /// again as the next generation. With errors, nothing is written: run
    /// `dedup repair`, which clears the flag too.
    #[arg(long)]
    clear_needs_check: bool,
}

/// Repair the metadata of a dm-dedup device offline.
///
/// Writes consistent metadata from what can be salvaged, reports every
/// change, and never invents data. Run `dedup check` first: on a device
/// that check finds clean, repair refuses to run unless --force is given.
///
/// What is salvaged. The superblock the kernel would use gives the sizes,
/// the hash and the counters (if its fields are impossible, a generation
/// above 2^64 - 2^32 - 1 included, the other valid slot; if no slot is
/// valid, a damaged one whose fields are sane and whose roots lead to
/// intact trees). The three arrays are walked from it. A tree
/// block that fails its checksum, sits at the wrong place, is of the wrong
/// kind, was written after the last commit, or is claimed by two places of
/// the trees is not trusted, and neither is anything below it.
///
/// What is written. Every map entry of an intact map leaf that points
/// inside the data device is kept with its physical block; the logical
/// blocks under an untrusted node are lost and read as zeros afterwards.
/// Refcounts are recomputed from the kept map entries. A live physical
/// block keeps its fingerprint record if the record is intact. With --data,
/// every live block is read and its fingerprint computed with the hash the
/// superblock names: intact records are verified (one that differs from
/// the data is replaced, and the logical blocks reading that block are
/// named, since their content may be damaged), lost ones are recomputed.
/// A live block whose record is lost and cannot be recomputed (no --data,
/// an unreadable data block) keeps its mappings under a placeholder record
/// that no write can match: its data stays readable but nothing is
/// deduplicated against it; `dedup check` lists such blocks, and a later
/// `dedup repair --force --data DEV` recomputes them. (The kernel refuses
/// to activate with a live block that has no record; dropping the block's
/// mappings instead would lose readable data.) Fingerprint records of free
/// blocks are dropped. The counters mapped_blocks and used_data_blocks are
/// recomputed; the sizes, hash, write counters and format time are kept;
/// the flags are written clear.
///
/// How it is written. As a kernel commit: the new trees go to blocks the
/// old state does not use, then, after a flush, a superblock of a newer
/// generation goes to the slot the old state is not in. It is never above
/// 2^64 - 2^32 - 1 (DD_MAX_TXN): a slot above that limit is the one
/// overwritten, and when the next generation would pass it (a superblock
/// already at the limit) repair refuses. An interrupted repair leaves the
/// device as it was. The result is checked before the
/// command returns.
///
/// The journal (format version 2). Its whole appends are replayed into
/// the state written, as the kernel would replay them. When a block that
/// continues the journal is malformed, or an append does not end with its
/// counters, the append it belongs to and everything after it are
/// dropped, and repair says which sequence numbers, blocks and records
/// went; the state is then the one after the last whole append before it.
/// An unflushed newest append is checked against --data as `dedup check`
/// checks it, and applied or dropped as the kernel would (a note says
/// which); without --data repair refuses to run, since it would make an
/// append permanent that the kernel might drop. The data device is
/// flushed before it is read.
/// The new superblock has an empty journal: the same run and journal id
/// with the epoch moved two rings on (journal_seq + 2 * journal_blocks),
/// or, if the run cannot be used, a new run after the new trees, as long
/// as the kernel would make it (a quarter of the trees' worst case for the
/// sizes, 64 to 2048 blocks, halved while it does not fit beside the
/// trees' worst case or in a free window; format version 1 if not even
/// 64 do).
/// A version 1 device stays version 1.
///
/// Every change is reported: one line per cause, listing every block it
/// concerns as ranges; lines starting with "note:" report findings that
/// change nothing. The data device (--data) must be the table's data
/// device: at least as large as the metadata's data_blocks (a larger one
/// is a grown device, which the kernel takes at activation; repair reads
/// only the blocks the metadata describes and keeps its sizes). It is
/// only read, after a flush. Hashes this
/// tool computes: sha256, sha384, sha512, sha3-256, sha3-384, sha3-512,
/// blake2b-256, blake2b-384, blake2b-512, crc32c, crc32, xxhash64.
#[derive(Args, Debug)]
#[command(after_long_help = "EXAMPLES
    dedup check /dev/vg/meta
    dedup repair --dry-run /dev/vg/meta
    dedup repair /dev/vg/meta --data /dev/vg/data
    dedup repair --force --data /dev/vg/data /dev/vg/meta   # verify fingerprints of a clean device

EXIT STATUS
    0   nothing was wrong: check found no errors (--force) and the metadata
        was rewritten, or would be (--dry-run)
    1   errors were corrected: the repaired metadata checks clean
    4   --dry-run: check found errors that a repair would correct; or the
        repaired metadata still has errors (e.g. the device is smaller
        than the kernel requires for its sizes)
    8   operational error: cannot open or read a device, not a dm-dedup
        metadata device, truncated, no usable superblock (e.g. the only
        valid one has a generation above 2^64 - 2^32 - 1), a new
        generation that would pass that limit, device busy, refused
        because check finds the device clean (no --force), a --data
        device smaller than the metadata's data_blocks or that cannot be
        flushed, hash not computable with --data, an unflushed newest
        journal append without --data, a data block that such an append
        makes live that cannot be read, write failed (the device then
        opens as before)
    16  usage or syntax error")]
struct RepairArgs {
    /// Metadata device or image file.
    device: PathBuf,
    /// The data device (or image file): recompute the fingerprint of every
    /// live block from its content; check the data of an unflushed newest
    /// journal append.
    #[arg(long, value_name = "DEV")]
    data: Option<PathBuf>,
    /// Report what would change; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Run even if `dedup check` finds no errors.
    #[arg(long)]
    force: bool,
    /// Print the report as JSON on stdout (see README.md for the schema).
    #[arg(long)]
    json: bool,
}

/// Format a metadata device offline, as the kernel does on first use.
///
/// Writes the superblock the kernel's dd_format() writes: format version 2,
/// generation 1 in slot 1, empty arrays, format_time = now,
/// metadata_blocks = the device size in 4 KiB blocks, and an empty
/// journal as the kernel makes it: a run from block 2 as long as the sizes
/// ask for (a quarter of the trees' worst case, 64 to 2048 blocks; room
/// the device has beyond that stays free for growing the trees), a random
/// journal id and epoch 1; slot 0 is zeroed. The rest of the device is left as it is: nothing reachable from
/// the superblock lives there, and no block of the old content continues
/// the new journal (its id is new).
///
/// With --format-version 1 the superblock is version 1: no journal, every
/// flush commits the trees, as the kernel did before version 2. A kernel
/// that knows version 2 upgrades such a device in place at its first
/// read-write activation when it finds room for a journal: a free run of
/// the length it would format, or half of that and so on down to 64
/// blocks, that leaves the trees' worst case its room.
///
/// The sizes must be those of the table the device will be used with: the
/// data device size (--data-blocks, or --data-dev to measure it) and the
/// logical size (--logical-blocks or --logical-size). The device must be at
/// least as large as the kernel requires for these sizes (twice the full
/// trees, two superblock slots and the journal; version 1 needs no
/// journal's room); otherwise the needed size is printed. A device that already holds a
/// valid superblock, or a superblock slot that is neither zeroed nor
/// valid (perhaps damaged metadata that `dedup repair` can recover; the
/// kernel refuses to format it too), is refused unless --force is given.
#[derive(Args, Debug)]
#[command(after_long_help = concat!("EXAMPLES\n    dedup format /dev/vg/meta --data-dev /dev/vg/data --logical-size 100G\n    dmsetup create vol --table \"0 $((100 << 21)) dedup /dev/vg/meta /dev/vg/data\"\n\n", exit_codes!()))]
struct FormatArgs {
    /// Metadata device or image file (a file must already have its size).
    device: PathBuf,
    /// Number of 4 KiB blocks of the data device.
    #[arg(
        long,
        value_name = "N",
        required_unless_present = "data_dev",
        conflicts_with = "data_dev"
    )]
    data_blocks: Option<u64>,
    /// Data device (or file) whose size gives the number of data blocks.
    #[arg(long, value_name = "PATH")]
    data_dev: Option<PathBuf>,
    /// Logical size in 4 KiB blocks.
    #[arg(
        long,
        value_name = "N",
        required_unless_present = "logical_size",
        conflicts_with = "logical_size"
    )]
    logical_blocks: Option<u64>,
    /// Logical size in bytes, a multiple of 4096; K, M, G, T suffixes are
    /// powers of 1024 (e.g. 100G).
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    logical_size: Option<u64>,
    /// Hash algorithm the table will name (crypto API name): sha256,
    /// sha384, sha512, sha3-256, sha3-384, sha3-512, blake2b-160,
    /// blake2b-256, blake2b-384, blake2b-512, sm3, sha1, xxhash64, crc32c
    /// or crc32; any other name is a usage error (exit 16).
    #[arg(long, value_name = "ALG", default_value = "sha256")]
    hash: String,
    /// Overwrite a device that holds a valid dm-dedup superblock.
    #[arg(long)]
    force: bool,
    /// Seconds since the epoch to record as format time (for reproducible
    /// images).
    #[arg(long, hide = true)]
    format_time: Option<u64>,
    /// Format version to write: 2 (with a journal) or 1 (without).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=2))]
    format_version: u32,
    /// The journal id to write instead of a random one (for reproducible
    /// images); not 0.
    #[arg(long, value_name = "ID", hide = true, value_parser = clap::value_parser!(u64).range(1..))]
    journal_id: Option<u64>,
}

/// Dump the content of a metadata device as portable JSON.
///
/// The metadata is checked first (as `dedup check` does); a device with
/// errors is refused unless --force, in which case what could be read is
/// dumped. The JSON holds the superblock's identity fields and counters,
/// every mapped logical block as {lba, pba}, and every live physical block
/// as {pba, refcount, fingerprint}: the state, that is the trees with the
/// journal (format version 2) replayed. The journal itself is dumped too:
/// where it is, where it ends and why, and every append replay applied
/// with its records (an unflushed one marked "unflushed"; dump reads no
/// data device, so an unflushed newest append is applied unchecked, and
/// it says so), one per line ({"type": "map", "lba", "pba"},
/// "refcount", "fingerprint", "counters"). Its schema is in
/// tools/README.md.
#[derive(Args, Debug)]
#[command(after_long_help = concat!("EXAMPLES\n    dedup dump /dev/vg/meta -o meta.json\n    dedup restore meta.json /dev/vg/new-meta\n\n", exit_codes!()))]
struct DumpArgs {
    /// Metadata device or image file.
    device: PathBuf,
    /// Write the JSON here instead of stdout.
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Dump even if the check finds errors.
    #[arg(long)]
    force: bool,
}

/// Write fresh metadata from a JSON dump.
///
/// The dump is validated first and refused if it is inconsistent: a logical
/// or physical block out of range, a logical block mapped twice, a refcount
/// that differs from the number of mappings to its block, a mapped block
/// without a record, a missing fingerprint, or counters that disagree.
/// Then new trees are written from block 2 upwards, all with the dump's
/// generation as their transaction, and the superblock last, in the slot
/// that generation selects (the other slot is zeroed). The superblock is
/// format version 2 with an empty journal: a run right after the trees,
/// as long as the kernel would make it (a quarter of the trees' worst case
/// for the sizes, 64 to 2048 blocks), a new random journal id, epoch 1.
/// A dump's journal part is not replayed again: its effect is in the
/// dumped state. metadata_blocks becomes the size of the target device,
/// which must be large enough for the dump's sizes. The result is checked
/// before the command returns (exit 4 if it does not check clean, which
/// would be a bug; the device then holds what was written).
/// A device that already holds a valid superblock, or a superblock slot
/// that is neither zeroed nor valid (perhaps damaged metadata that `dedup
/// repair` can recover), is refused unless --force is given. A generation
/// above 2^64 - 2^32 - 1 (DD_MAX_TXN, the
/// highest the kernel accepts), from the dump or --generation, is refused
/// (exit 8).
#[derive(Args, Debug)]
#[command(after_long_help = concat!("EXAMPLES\n    dedup dump /dev/vg/meta -o meta.json\n    dedup restore meta.json /dev/vg/bigger-meta\n\n", exit_codes!()))]
struct RestoreArgs {
    /// JSON dump written by `dedup dump` ("-" for stdin).
    input: PathBuf,
    /// Metadata device or image file to write.
    device: PathBuf,
    /// Overwrite a device that holds a valid dm-dedup superblock.
    #[arg(long)]
    force: bool,
    /// Generation to write instead of the dump's: 1 to 2^64 - 2^32 - 1
    /// (18446744069414584319).
    #[arg(long, value_name = "N")]
    generation: Option<u64>,
}

/// Estimate the savings of deduplicating files or devices.
///
/// Reads every input sequentially in large chunks, on all cores, hashes
/// each 4 KiB block with SHA-256 and counts, for every block size asked
/// for, the total, all-zero and distinct non-zero blocks. All inputs form
/// one pool, as if they were stored on one dedup device. Prints the savings
/// at each block size and what dm-dedup (4 KiB blocks) would need: the
/// data device (one block per distinct non-zero block), the metadata device
/// (the kernel's minimum for these sizes) and RAM (index and bitmaps).
///
/// Rules: blocks start at offset 0 of each input; a trailing partial block
/// is padded with zeros; all-zero blocks are not stored by the target and
/// count as saved; blocks larger than 4 KiB are equal when all their 4 KiB
/// parts are. Progress goes to stderr when it is a terminal.
#[derive(Args, Debug)]
#[command(after_long_help = concat!("EXAMPLES\n    dedup estimate /var/lib/libvirt/images/*.qcow2\n    dedup estimate /dev/sdb --block-sizes 4K,64K --json\n\n", exit_codes!()))]
struct EstimateArgs {
    /// Files or block devices to scan.
    #[arg(required = true, value_name = "INPUT")]
    inputs: Vec<PathBuf>,
    /// Print JSON (see README.md for the schema).
    #[arg(long)]
    json: bool,
    /// Block sizes to report, comma separated, powers of two from 4K to 1M
    /// (4K, 8K, 16K, 32K, 64K, 128K, 256K, 512K, 1M; K and M suffixes or
    /// bytes).
    #[arg(long, value_name = "LIST", default_value = "4096,8192,16384,32768", value_parser = parse_block_sizes)]
    block_sizes: BlockSizes,
    /// Show progress on stderr even when it is not a terminal.
    #[arg(long)]
    progress: bool,
    /// Worker threads (default: one per core).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
}

/// Show the state and counters of an active dedup device.
///
/// Runs `dmsetup status NAME` and `dmsetup message NAME 0 stats` and
/// prints the mode, used and free data and metadata space, mapped blocks,
/// dedup ratio, savings and the write counters.
#[derive(Args, Debug)]
#[command(after_long_help = concat!("EXAMPLES\n    dedup stats vol\n    dedup stats vol --json\n\n", exit_codes!()))]
struct StatsArgs {
    /// Device-mapper name of the dedup device (as in /dev/mapper/NAME).
    name: String,
    /// Print JSON (see README.md for the schema).
    #[arg(long)]
    json: bool,
    /// Read the `dmsetup status` output from this file instead of running
    /// dmsetup (for tests and offline analysis).
    #[arg(long, value_name = "FILE", hide = true)]
    status_file: Option<PathBuf>,
    /// Read the `dmsetup message ... stats` output from this file.
    #[arg(long, value_name = "FILE", hide = true)]
    message_file: Option<PathBuf>,
}

#[derive(Clone, Debug)]
struct BlockSizes(Vec<u32>);

fn parse_block_sizes(s: &str) -> Result<BlockSizes, String> {
    estimate::parse_block_sizes(s).map(BlockSizes)
}

fn err(cmd: &str, msg: impl std::fmt::Display) {
    eprintln!("dedup {cmd}: {msg}");
}

/// `check --clear-needs-check` after the check: the generation written,
/// or None when nothing was to be done or nothing may be done (said on
/// stderr).
fn clear_needs_check(
    dev: &mut FileDev,
    report: &check::Report,
    name: &str,
) -> std::io::Result<Option<u64>> {
    let Some(info) = report.superblock.as_ref() else {
        return Ok(None);
    };
    if info.flags & ondisk::SB_NEEDS_CHECK == 0 {
        eprintln!("dedup check: {name}: needs_check is not set; nothing to clear");
        return Ok(None);
    }
    if !report.clean() {
        eprintln!(
            "dedup check: {name}: the metadata has errors, so needs_check stays set; \
             run dedup repair"
        );
        return Ok(None);
    }
    let mut blk = ondisk::zero_block();
    dev.read_block(info.slot, &mut blk)?;
    let sb = writer::clear_needs_check(dev, &ondisk::Superblock::decode(&blk))?;
    eprintln!(
        "dedup check: {name}: needs_check cleared (generation {} in slot {})",
        sb.generation(),
        sb.slot()
    );
    Ok(Some(sb.generation()))
}

fn print_json<T: serde::Serialize>(v: &T) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v)?;
    writeln!(out)
}

fn run_check(a: CheckArgs) -> i32 {
    let name = a.device.display().to_string();
    let fatal = |msg: &str| {
        if a.json {
            let _ = print_json(&serde_json::json!({
                "device": name, "fatal": msg, "exit_code": EXIT_OPERATIONAL
            }));
        }
        err("check", format!("{name}: {msg}"));
        EXIT_OPERATIONAL
    };
    let mut dev = match FileDev::open(&a.device, a.clear_needs_check) {
        Ok(d) => d,
        Err(e) => {
            err("check", e);
            return EXIT_OPERATIONAL;
        }
    };
    let data = match a.data.as_deref().map(|p| FileDev::open(p, false)) {
        None => None,
        Some(Ok(d)) => Some(d),
        Some(Err(e)) => return fatal(&format!("--data: {e}")),
    };
    let opts = CheckOptions {
        data_blocks: a.data_blocks,
        logical_blocks: a.logical_blocks,
        hash: a.hash,
        collect: false,
        max_problems: a.max_problems,
        dense_limit: None,
    };
    let data = data.as_ref().map(|d| d as &(dyn BlockDev + Sync));
    let checked = check::check_with_data(&dev, data, &opts);
    match checked {
        Err(f) => fatal(&f.0),
        Ok((report, _)) => {
            let mut code = if report.clean() { EXIT_OK } else { EXIT_ERRORS };
            let cleared = if a.clear_needs_check {
                match clear_needs_check(&mut dev, &report, &name) {
                    Ok(c) => c,
                    Err(e) => {
                        err("check", format!("{name}: clearing needs_check: {e}"));
                        code = EXIT_OPERATIONAL;
                        None
                    }
                }
            } else {
                None
            };
            let r = if a.json {
                let mut v = serde_json::to_value(&report).expect("report serializes");
                v["device"] = name.clone().into();
                v["exit_code"] = code.into();
                v["needs_check_cleared"] = cleared.is_some().into();
                print_json(&v)
            } else {
                std::io::stdout()
                    .lock()
                    .write_all(check::render(&report, &name).as_bytes())
            };
            if r.is_err() {
                return EXIT_OPERATIONAL;
            }
            code
        }
    }
}

fn run_format(a: FormatArgs) -> i32 {
    let data_blocks = match (a.data_blocks, &a.data_dev) {
        (Some(n), _) => n,
        (None, Some(p)) => match device::size_of(p) {
            Ok(s) => s >> ondisk::BLOCK_SHIFT,
            Err(e) => {
                err("format", format!("{}: {e}", p.display()));
                return EXIT_OPERATIONAL;
            }
        },
        (None, None) => unreachable!("clap requires one"),
    };
    let logical_blocks = match (a.logical_blocks, a.logical_size) {
        (Some(n), _) => n,
        (None, Some(bytes)) => {
            if bytes % ondisk::BLOCK_SIZE as u64 != 0 {
                err(
                    "format",
                    format!("--logical-size {bytes} is not a multiple of 4096 bytes"),
                );
                return EXIT_USAGE;
            }
            bytes >> ondisk::BLOCK_SHIFT
        }
        (None, None) => unreachable!("clap requires one"),
    };
    if data_blocks == 0 {
        err(
            "format",
            "the data device must hold at least one 4 KiB block",
        );
        return EXIT_USAGE;
    }
    if data_blocks > (1 << 40) - 1 {
        err(
            "format",
            format!("{data_blocks} data blocks: the kernel supports at most 2^40 - 1"),
        );
        return EXIT_USAGE;
    }
    if logical_blocks == 0 {
        err(
            "format",
            "the logical size must be at least one 4 KiB block",
        );
        return EXIT_USAGE;
    }
    if logical_blocks > u64::MAX >> 12 {
        err("format", "logical size too large");
        return EXIT_USAGE;
    }
    if a.format_version == ondisk::FORMAT_VERSION_V1 && a.journal_id.is_some() {
        err("format", "--journal-id: format version 1 has no journal");
        return EXIT_USAGE;
    }
    let Some(fp_size) = ondisk::hash_fp_size(&a.hash) else {
        err(
            "format",
            format!(
                "unknown hash '{}' (known: sha256, sha384, sha512, sha3-256, sha3-384, sha3-512, \
                 blake2b-160, blake2b-256, blake2b-384, blake2b-512, sm3, sha1, xxhash64, \
                 crc32c, crc32)",
                a.hash
            ),
        );
        return EXIT_USAGE;
    };
    let mut dev = match FileDev::open(&a.device, true) {
        Ok(d) => d,
        Err(e) => {
            err("format", e);
            return EXIT_OPERATIONAL;
        }
    };
    let name = a.device.display().to_string();
    let have = dev.nr_blocks();
    // The kernel formats version 2 (with the journal the sizes ask for)
    // from required_blocks; it opens version 1 with that room less.
    let need = if a.format_version == ondisk::FORMAT_VERSION_V1 {
        ondisk::open_blocks(logical_blocks, data_blocks)
    } else {
        ondisk::required_blocks(logical_blocks, data_blocks)
    };
    if have < need {
        err(
            "format",
            format!(
                "{name} is too small: {} ({have} blocks), needs at least {} ({need} blocks of 4 KiB) \
                 for {logical_blocks} logical and {data_blocks} data blocks",
                human_bytes(dev.size_bytes()),
                human_bytes(need.saturating_mul(4096)),
            ),
        );
        return EXIT_OPERATIONAL;
    }
    if !a.force {
        if let Some(why) = ondisk::overwrite_refusal(&name, &check::read_slots(&dev)) {
            err("format", why);
            return EXIT_OPERATIONAL;
        }
    }
    let time = a.format_time.unwrap_or_else(now_secs);
    match writer::format_as(
        &mut dev,
        data_blocks,
        logical_blocks,
        &a.hash,
        fp_size,
        time,
        a.format_version,
        a.journal_id,
    ) {
        Ok(sb) => {
            let journal = if sb.journal_blocks == 0 {
                "format version 1, no journal".to_string()
            } else {
                format!(
                    "format version 2, journal of {} blocks at block {} (id {:#018x}, epoch {})",
                    sb.journal_blocks, sb.journal_start, sb.journal_id, sb.journal_seq
                )
            };
            println!(
                "formatted {name}: {} metadata blocks ({}), {data_blocks} data blocks ({}), \
                 {logical_blocks} logical blocks ({}), hash {} ({fp_size}-byte fingerprints); \
                 generation 1 in slot 1; {journal}",
                sb.metadata_blocks,
                human_bytes(sb.metadata_blocks << 12),
                human_bytes(data_blocks << 12),
                human_bytes(logical_blocks << 12),
                a.hash
            );
            EXIT_OK
        }
        Err(e) => {
            err("format", format!("{name}: write failed: {e}"));
            EXIT_OPERATIONAL
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_USAGE as u8 } else { 0 });
        }
    };
    let code = match cli.command {
        Command::Check(a) => run_check(a),
        Command::Repair(a) => repair::run(repair::RepairArgs {
            device: &a.device,
            data: a.data.as_deref(),
            dry_run: a.dry_run,
            force: a.force,
            json: a.json,
        }),
        Command::Format(a) => run_format(a),
        Command::Dump(a) => dump::run_dump(&a.device, a.output.as_deref(), a.force),
        Command::Restore(a) => dump::run_restore(&a.input, &a.device, a.force, a.generation),
        Command::Estimate(a) => estimate::run(estimate::EstimateConfig {
            inputs: a.inputs,
            block_sizes: a.block_sizes.0,
            json: a.json,
            progress: a.progress,
            threads: a.threads,
        }),
        Command::Stats(a) => stats::run(
            &a.name,
            a.json,
            a.status_file.as_deref(),
            a.message_file.as_deref(),
        ),
    };
    ExitCode::from(code as u8)
}
