//! `dedup stats`: the state of an active dedup device, from
//! `dmsetup status` (dedup_status() in dm-dedup-target.c) and
//! `dmsetup message NAME 0 stats` (dd_message_stats()).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde::Serialize;

use crate::util::*;

/// The STATUSTYPE_INFO line:
/// `<start> <len> dedup <mode> <txn> <meta used>/<meta total>
///  <data used>/<data total> <mapped> <unique> <duplicate> <zero>
///  <discarded> <hash> verify|no_verify discard_passdown|no_discard_passdown
///  [<journal used>/<journal total>]` (the last field since format version
/// 2: journal blocks appended since the last commit, and the journal's
/// size; 0/0 without a journal).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Status {
    pub start: u64,
    pub length: u64,
    pub mode: String,
    pub transaction_id: u64,
    pub metadata_used: u64,
    pub metadata_total: u64,
    pub data_used: u64,
    pub data_total: u64,
    pub mapped: u64,
    pub unique_writes: u64,
    pub duplicate_writes: u64,
    pub zero_writes: u64,
    pub discarded: u64,
    pub hash: String,
    pub verify: bool,
    pub discard_passdown: bool,
    /// (used, total) journal blocks, from a kernel that reports them.
    pub journal: Option<(u64, u64)>,
}

fn num(s: &str, what: &str) -> Result<u64, String> {
    s.parse()
        .map_err(|_| format!("{what}: '{s}' is not a number"))
}

fn ratio(s: &str, what: &str) -> Result<(u64, u64), String> {
    let (a, b) = s
        .split_once('/')
        .ok_or_else(|| format!("{what}: '{s}' is not used/total"))?;
    Ok((num(a, what)?, num(b, what)?))
}

/// Parse one status line (with or without a leading "NAME: " as dmsetup
/// prints when listing several devices).
pub fn parse_status_line(line: &str) -> Result<Status, String> {
    let line = line.trim();
    let body = match line.split_once(": ") {
        Some((_, rest)) if !line.starts_with(|c: char| c.is_ascii_digit()) => rest,
        _ => line,
    };
    let f: Vec<&str> = body.split_whitespace().collect();
    if f.len() < 3 {
        return Err(format!("status line too short: '{line}'"));
    }
    if f[2] != "dedup" {
        return Err(format!("target type is '{}', not dedup", f[2]));
    }
    if f.len() < 15 {
        return Err(format!(
            "dedup status has {} fields, expected 12: '{line}'",
            f.len() - 3
        ));
    }
    let (metadata_used, metadata_total) = ratio(f[5], "metadata blocks")?;
    let (data_used, data_total) = ratio(f[6], "data blocks")?;
    let verify = match f[13] {
        "verify" => true,
        "no_verify" => false,
        o => return Err(format!("verify field: unexpected '{o}'")),
    };
    let discard_passdown = match f[14] {
        "discard_passdown" => true,
        "no_discard_passdown" => false,
        o => return Err(format!("discard field: unexpected '{o}'")),
    };
    Ok(Status {
        start: num(f[0], "start")?,
        length: num(f[1], "length")?,
        mode: f[3].to_string(),
        transaction_id: num(f[4], "transaction id")?,
        metadata_used,
        metadata_total,
        data_used,
        data_total,
        mapped: num(f[7], "mapped")?,
        unique_writes: num(f[8], "unique writes")?,
        duplicate_writes: num(f[9], "duplicate writes")?,
        zero_writes: num(f[10], "zero writes")?,
        discarded: num(f[11], "discarded")?,
        hash: f[12].to_string(),
        verify,
        discard_passdown,
        journal: f.get(15).map(|j| ratio(j, "journal blocks")).transpose()?,
    })
}

/// Every dedup segment of a `dmsetup status NAME` output.
pub fn parse_status(out: &str) -> Result<Vec<Status>, String> {
    let mut v = Vec::new();
    let mut other = None;
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        match parse_status_line(line) {
            Ok(s) => v.push(s),
            Err(e) if e.starts_with("target type") => other = Some(e),
            Err(e) => return Err(e),
        }
    }
    if v.is_empty() {
        return Err(other.unwrap_or_else(|| "empty status".into()));
    }
    Ok(v)
}

/// The `stats` message result: one `key value` per line (`key=value` and
/// `key: value` are accepted too).
pub fn parse_message(out: &str) -> Result<BTreeMap<String, String>, String> {
    let mut m = BTreeMap::new();
    for line in out.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .or_else(|| line.split_once(':'))
            .or_else(|| line.split_once(char::is_whitespace))
            .ok_or_else(|| format!("stats line without a value: '{line}'"))?;
        m.insert(k.trim().to_string(), v.trim().to_string());
    }
    if m.is_empty() {
        return Err("empty stats message".into());
    }
    Ok(m)
}

/// What `dedup stats` shows, derived from both outputs.
#[derive(Clone, Debug, Serialize)]
pub struct Stats {
    pub name: String,
    pub mode: String,
    pub transaction_id: u64,
    pub logical_blocks: u64,
    pub mapped_blocks: u64,
    pub data_blocks_total: u64,
    pub data_blocks_used: u64,
    pub data_blocks_free: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_blocks_live: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_blocks_pending_free: Option<u64>,
    pub metadata_blocks_total: u64,
    pub metadata_blocks_used: u64,
    pub metadata_blocks_free: u64,
    /// mapped / live physical blocks.
    pub dedup_ratio: f64,
    /// Share of the mapped logical data not stored thanks to sharing:
    /// 100 * (1 - live / mapped).
    pub space_savings_percent: f64,
    /// Share of written blocks that were not stored (duplicates and
    /// zeros): 100 * (written - unique) / written.
    pub write_savings_percent: f64,
    pub unique_writes: u64,
    pub duplicate_writes: u64,
    pub zero_writes: u64,
    pub discarded_blocks: u64,
    pub hash: String,
    pub verify: bool,
    pub discard_passdown: bool,
    /// Journal blocks appended since the last commit, and the journal's
    /// size (0 without one: format version 1); absent from a kernel
    /// without the journal.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal_blocks_used: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal_blocks_total: Option<u64>,
    /// Every counter of the stats message, as given.
    pub counters: BTreeMap<String, serde_json::Value>,
}

pub fn combine(name: &str, st: &Status, msg: Option<&BTreeMap<String, String>>) -> Stats {
    let get = |k: &str| {
        msg.and_then(|m| m.get(k))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let live = get("data_blocks_live");
    let logical_blocks = get("logical_blocks").unwrap_or(st.length / 8);
    let dedup_ratio = match (get("dedup_ratio_x100"), live) {
        (_, Some(l)) if l > 0 => st.mapped as f64 / l as f64,
        (Some(x), _) => x as f64 / 100.0,
        _ => 1.0,
    };
    let space_savings_percent = match live {
        Some(l) if st.mapped > 0 => 100.0 * (1.0 - l as f64 / st.mapped as f64),
        _ if dedup_ratio > 0.0 => 100.0 * (1.0 - 1.0 / dedup_ratio),
        _ => 0.0,
    };
    // The counters come from the superblock unchecked: saturate, so that
    // 0 <= written - unique <= written and the share stays in 0..=100 %.
    let written = st
        .unique_writes
        .saturating_add(st.duplicate_writes)
        .saturating_add(st.zero_writes);
    let write_savings_percent = if written > 0 {
        100.0 * written.saturating_sub(st.unique_writes) as f64 / written as f64
    } else {
        0.0
    };
    let counters = msg
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let jv = v
                        .parse::<i64>()
                        .map(serde_json::Value::from)
                        .or_else(|_| v.parse::<u64>().map(serde_json::Value::from))
                        .unwrap_or_else(|_| serde_json::Value::from(v.clone()));
                    (k.clone(), jv)
                })
                .collect()
        })
        .unwrap_or_default();
    Stats {
        name: name.to_string(),
        mode: st.mode.clone(),
        transaction_id: st.transaction_id,
        logical_blocks,
        mapped_blocks: st.mapped,
        data_blocks_total: st.data_total,
        data_blocks_used: st.data_used,
        data_blocks_free: st.data_total.saturating_sub(st.data_used),
        data_blocks_live: live,
        data_blocks_pending_free: get("data_blocks_pending_free"),
        metadata_blocks_total: st.metadata_total,
        metadata_blocks_used: st.metadata_used,
        metadata_blocks_free: st.metadata_total.saturating_sub(st.metadata_used),
        dedup_ratio,
        space_savings_percent,
        write_savings_percent,
        unique_writes: st.unique_writes,
        duplicate_writes: st.duplicate_writes,
        zero_writes: st.zero_writes,
        discarded_blocks: st.discarded,
        hash: st.hash.clone(),
        verify: st.verify,
        discard_passdown: st.discard_passdown,
        journal_blocks_used: get("journal_blocks_used").or(st.journal.map(|j| j.0)),
        journal_blocks_total: get("journal_blocks_total").or(st.journal.map(|j| j.1)),
        counters,
    }
}

fn pct(a: u64, b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{:.1}%", 100.0 * a as f64 / b as f64)
    }
}

/// The human table.
pub fn render(s: &Stats) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let blk = |n: u64| format!("{n} ({})", human_bytes(n.saturating_mul(4096)));
    let mut row = |k: &str, v: String| {
        let _ = writeln!(o, "{k:<26} {v}");
    };
    row("device", s.name.clone());
    row("mode", s.mode.clone());
    row("transaction", s.transaction_id.to_string());
    row("logical blocks", blk(s.logical_blocks));
    row(
        "mapped blocks",
        format!(
            "{} ({} of logical)",
            blk(s.mapped_blocks),
            pct(s.mapped_blocks, s.logical_blocks)
        ),
    );
    row(
        "data blocks used",
        format!(
            "{} of {} ({})",
            blk(s.data_blocks_used),
            blk(s.data_blocks_total),
            pct(s.data_blocks_used, s.data_blocks_total)
        ),
    );
    row("data blocks free", blk(s.data_blocks_free));
    if let Some(l) = s.data_blocks_live {
        row("data blocks live", blk(l));
    }
    if let Some(p) = s.data_blocks_pending_free {
        row("data blocks pending free", p.to_string());
    }
    row(
        "metadata blocks used",
        format!(
            "{} of {} ({})",
            blk(s.metadata_blocks_used),
            blk(s.metadata_blocks_total),
            pct(s.metadata_blocks_used, s.metadata_blocks_total)
        ),
    );
    row("metadata blocks free", blk(s.metadata_blocks_free));
    row("dedup ratio", format!("{:.2}", s.dedup_ratio));
    row("space savings", format!("{:.1}%", s.space_savings_percent));
    row("write savings", format!("{:.1}%", s.write_savings_percent));
    row("unique writes", s.unique_writes.to_string());
    row("duplicate writes", s.duplicate_writes.to_string());
    row("zero writes", s.zero_writes.to_string());
    row("discarded blocks", s.discarded_blocks.to_string());
    row(
        "hash",
        format!(
            "{}{}{}",
            s.hash,
            if s.verify { ", verify" } else { "" },
            if s.discard_passdown {
                ", discard_passdown"
            } else {
                ""
            }
        ),
    );
    const SHOWN: [&str; 18] = [
        "mode",
        "transaction_id",
        "logical_blocks",
        "mapped_blocks",
        "data_blocks_total",
        "data_blocks_used",
        "data_blocks_live",
        "data_blocks_pending_free",
        "metadata_blocks_total",
        "metadata_blocks_used",
        "unique_writes",
        "duplicate_writes",
        "zero_writes",
        "discarded_blocks",
        "dedup_ratio_x100",
        "write_savings_x100",
        "hash",
        "index_bytes",
    ];
    if let Some(j) = journal_row(s) {
        row("journal", j);
    }
    if let Some(c) = commits_row(s) {
        row("commits", c);
    }
    if let Some(serde_json::Value::Number(b)) = s.counters.get("index_bytes") {
        let b = b.as_u64().unwrap_or(0);
        let per = s
            .counters
            .get("index_bytes_per_data_block_x100")
            .and_then(|v| v.as_u64())
            .map(|x| format!(", {:.2} bytes per data block", x as f64 / 100.0))
            .unwrap_or_default();
        row("index memory", format!("{}{per}", human_bytes(b)));
    }
    for (k, v) in &s.counters {
        if SHOWN.contains(&k.as_str())
            || JOURNAL_KEYS.contains(&k.as_str())
            || COMMIT_KEYS.contains(&k.as_str())
            || k == "index_bytes_per_data_block_x100"
        {
            continue;
        }
        let v = match v {
            serde_json::Value::String(x) => x.clone(),
            o => o.to_string(),
        };
        row(&k.replace('_', " "), v);
    }
    o
}

/// The journal's counters of the stats message (dd_message_stats(),
/// format version 2): the blocks used since the last commit and the ring's
/// size (0: version 1, no journal), appends and blocks written,
/// the blocks replayed at activation and those of an unflushed append
/// dropped then (target 1.8.0), commits (checkpoints), the appends
/// begun ahead of a flush request (1.9.0), and the flush requests that
/// joined an append on its way (1.10.0).
const JOURNAL_KEYS: [&str; 9] = [
    "journal_blocks_total",
    "journal_blocks_used",
    "journal_appends",
    "journal_blocks_written",
    "journal_blocks_replayed",
    "journal_blocks_dropped",
    "checkpoints",
    "appends_ahead",
    "appends_joined",
];

/// The journal row: "12 of 2048 blocks used since the last commit; 40
/// appends, 30 of them ahead (52 blocks written), 3 checkpoints; 0 blocks
/// replayed at activation", from what the status and the message have.
fn journal_row(s: &Stats) -> Option<String> {
    let c = &s.counters;
    let get = |k: &str| c.get(k).and_then(|v| v.as_u64());
    let (total, used) = (s.journal_blocks_total, s.journal_blocks_used);
    if total.is_none() && used.is_none() && JOURNAL_KEYS.iter().all(|k| get(k).is_none()) {
        return None;
    }
    let mut parts = Vec::new();
    match (total, used) {
        (Some(0), _) => parts.push("none (format version 1: every flush commits the trees)".into()),
        (Some(t), Some(u)) => parts.push(format!("{u} of {t} blocks used since the last commit")),
        (Some(t), None) => parts.push(format!("{t} blocks")),
        (None, Some(u)) => parts.push(format!("{u} blocks used since the last commit")),
        (None, None) => {}
    }
    let mut activity = Vec::new();
    if let Some(a) = get("journal_appends") {
        let ahead = match get("appends_ahead") {
            Some(n) => format!(", {n} of them ahead"),
            None => String::new(),
        };
        activity.push(match get("journal_blocks_written") {
            Some(w) => format!(
                "{}{ahead} ({} written)",
                plural(a, "append"),
                plural(w, "block")
            ),
            None => format!("{}{ahead}", plural(a, "append")),
        });
    } else if let Some(w) = get("journal_blocks_written") {
        activity.push(format!("{} written", plural(w, "block")));
    }
    if let Some(j) = get("appends_joined") {
        activity.push(format!(
            "{} completed with an append on its way",
            plural(j, "flush request")
        ));
    }
    if let Some(k) = get("checkpoints") {
        activity.push(plural(k, "checkpoint"));
    }
    if !activity.is_empty() {
        parts.push(activity.join(", "));
    }
    if let Some(r) = get("journal_blocks_replayed") {
        parts.push(format!("{} replayed at activation", plural(r, "block")));
    }
    if let Some(d) = get("journal_blocks_dropped").filter(|&d| d > 0) {
        parts.push(format!(
            "{} of the newest append dropped then (its data was lost; never acknowledged)",
            plural(d, "block")
        ));
    }
    Some(parts.join("; "))
}

/// How commits and appends went this activation (stats message, target
/// 1.3.0 and later): how long commits held writes out, in all and at most
/// at once, the data device flushes sent or found not needed (1.4.0), and
/// those sent ahead of a flush request (1.5.0).
const COMMIT_KEYS: [&str; 5] = [
    "commit_hold_us",
    "commit_hold_max_us",
    "data_flushes",
    "data_flushes_skipped",
    "data_flushes_ahead",
];

fn millis(us: u64) -> String {
    format!("{:.1} ms", us as f64 / 1000.0)
}

/// The commits row: "held writes out 47.9 ms in all, 2.9 ms at most; data
/// device flushed 12 times (and 9 times ahead), 4 flushes not needed".
fn commits_row(s: &Stats) -> Option<String> {
    let get = |k: &str| s.counters.get(k).and_then(|v| v.as_u64());
    let mut parts = Vec::new();
    match (get("commit_hold_us"), get("commit_hold_max_us")) {
        (Some(t), Some(m)) => parts.push(format!(
            "held writes out {} in all, {} at most",
            millis(t),
            millis(m)
        )),
        (Some(t), None) => parts.push(format!("held writes out {} in all", millis(t))),
        _ => {}
    }
    let ahead = match get("data_flushes_ahead") {
        Some(a) => format!(" (and {} ahead)", plural(a, "time")),
        None => String::new(),
    };
    match (get("data_flushes"), get("data_flushes_skipped")) {
        (Some(f), Some(k)) => parts.push(format!(
            "data device flushed {}{ahead}, {k} {} not needed",
            plural(f, "time"),
            if k == 1 { "flush" } else { "flushes" }
        )),
        (Some(f), None) => parts.push(format!("data device flushed {}", plural(f, "time"))),
        _ => {}
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

fn dmsetup(args: &[&str]) -> Result<String, String> {
    let out = Command::new("dmsetup")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run dmsetup: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "dmsetup {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn run(name: &str, json: bool, status_file: Option<&Path>, message_file: Option<&Path>) -> i32 {
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
    let status = match status_file {
        Some(p) => read(p),
        None => dmsetup(&["status", name]),
    };
    let status = match status.and_then(|s| parse_status(&s)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("dedup stats: {name}: {e}");
            return EXIT_OPERATIONAL;
        }
    };
    let message = match (message_file, status_file) {
        (Some(p), _) => read(p),
        (None, Some(_)) => Err("no stats message given".into()),
        (None, None) => dmsetup(&["message", name, "0", "stats"]),
    };
    let msg = match message.and_then(|m| parse_message(&m)) {
        Ok(m) => Some(m),
        Err(e) => {
            eprintln!(
                "dedup stats: {name}: stats message unavailable ({e}); showing the status only"
            );
            None
        }
    };
    if status.len() > 1 {
        eprintln!(
            "dedup stats: {name}: {} dedup segments; showing the first",
            status.len()
        );
    }
    let s = combine(name, &status[0], msg.as_ref());
    if json {
        match serde_json::to_string_pretty(&s) {
            Ok(j) => println!("{j}"),
            Err(e) => {
                eprintln!("dedup stats: {e}");
                return EXIT_OPERATIONAL;
            }
        }
    } else {
        print!("{}", render(&s));
    }
    EXIT_OK
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What dedup_status() emits for STATUSTYPE_INFO, behind dmsetup's
    /// "<start> <length> <target>" prefix.
    const STATUS: &str =
        "0 2097152 dedup rw 42 130/16384 5000/262144 9000 5000 3500 500 200 sha256 no_verify no_discard_passdown\n";

    /// What dd_message_stats() emits (DMEMIT "key value\n" lines).
    const MESSAGE: &str = "mode rw
transaction_id 42
logical_blocks 262144
mapped_blocks 9000
data_blocks_total 262144
data_blocks_used 5000
data_blocks_live 4500
data_blocks_pending_free 500
metadata_blocks_total 16384
metadata_blocks_used 130
unique_writes 5000
duplicate_writes 3500
zero_writes 500
discarded_blocks 200
dedup_ratio_x100 200
write_savings_x100 4444
index_bytes 2621568
index_bytes_per_data_block_x100 1000
index_entries 4500
index_full 0
verify_mismatches 0
nospc_errors 0
data_write_errors 0
deferred_reads 17
discard_passdown_blocks 0
hash sha256
";

    #[test]
    fn journal_counters_make_one_row() {
        let st = &parse_status(STATUS).unwrap()[0];
        let with = format!(
            "{MESSAGE}journal_blocks_used 12\njournal_blocks_total 2048\njournal_appends 40\n\
             journal_blocks_written 52\njournal_blocks_replayed 0\ncheckpoints 3\n"
        );
        let m = parse_message(&with).unwrap();
        let s = combine("vol", st, Some(&m));
        assert_eq!(
            (s.journal_blocks_used, s.journal_blocks_total),
            (Some(12), Some(2048))
        );
        let text = render(&s);
        assert!(
            text.contains(
                "journal                    12 of 2048 blocks used since the last commit; 40 \
                 appends (52 blocks written), 3 checkpoints; 0 blocks replayed at activation"
            ),
            "{text}"
        );
        assert!(!text.contains("journal blocks used"), "{text}");
        assert!(!text.contains("checkpoints 3"), "{text}");
        assert!(!text.contains("dropped"), "{text}");
        let dropped = parse_message(&format!("{with}journal_blocks_dropped 2\n")).unwrap();
        let text = render(&combine("vol", st, Some(&dropped)));
        assert!(
            text.contains(
                "0 blocks replayed at activation; 2 blocks of the newest append dropped then"
            ),
            "{text}"
        );
        assert!(!text.contains("journal blocks dropped"), "{text}");
        // 1.9.0 counts the appends begun ahead of a flush request.
        let ahead = parse_message(&format!("{with}appends_ahead 30\n")).unwrap();
        let text = render(&combine("vol", st, Some(&ahead)));
        assert!(
            text.contains("; 40 appends, 30 of them ahead (52 blocks written), 3 checkpoints;"),
            "{text}"
        );
        assert!(!text.contains("appends ahead"), "{text}");
        // 1.10.0 counts the flush requests that joined an append.
        let joined = parse_message(&format!("{with}appends_ahead 30\nappends_joined 1\n")).unwrap();
        let text = render(&combine("vol", st, Some(&joined)));
        assert!(
            text.contains(
                "; 40 appends, 30 of them ahead (52 blocks written), \
                 1 flush request completed with an append on its way, 3 checkpoints;"
            ),
            "{text}"
        );
        assert!(!text.contains("appends joined"), "{text}");
        let v1 = parse_message(&format!(
            "{MESSAGE}journal_blocks_used 0\njournal_blocks_total 0\ncheckpoints 9\n"
        ))
        .unwrap();
        let text = render(&combine("vol", st, Some(&v1)));
        assert!(
            text.contains("none (format version 1: every flush commits the trees); 9 checkpoints"),
            "{text}"
        );
        // A kernel without a journal says nothing of it.
        let m = parse_message(MESSAGE).unwrap();
        assert!(!render(&combine("vol", st, Some(&m))).contains("journal"));
        // The status line's last field, without the message.
        let with = STATUS.replace("no_discard_passdown", "no_discard_passdown 7/846");
        let st2 = &parse_status(&with).unwrap()[0];
        assert_eq!(st2.journal, Some((7, 846)));
        let s = combine("vol", st2, None);
        assert!(render(&s).contains("7 of 846 blocks used since the last commit"));
        let j = serde_json::to_value(&s).unwrap();
        assert_eq!(
            (
                j["journal_blocks_used"].clone(),
                j["journal_blocks_total"].clone()
            ),
            (7.into(), 846.into())
        );
        assert!(
            parse_status(&STATUS.replace("no_discard_passdown", "no_discard_passdown x/1"))
                .is_err()
        );
        assert_eq!(parse_status(STATUS).unwrap()[0].journal, None);
    }

    #[test]
    fn commit_counters_make_one_row() {
        let st = &parse_status(STATUS).unwrap()[0];
        let with = format!(
            "{MESSAGE}commit_hold_us 47978\ncommit_hold_max_us 2884\ndata_flushes 12\n\
             data_flushes_skipped 1\n"
        );
        let text = render(&combine("vol", st, Some(&parse_message(&with).unwrap())));
        assert!(
            text.contains(
                "commits                    held writes out 48.0 ms in all, 2.9 ms at most; \
                 data device flushed 12 times, 1 flush not needed"
            ),
            "{text}"
        );
        assert!(!text.contains("commit hold"), "{text}");
        assert!(!text.contains("data flushes"), "{text}");
        // 1.5.0 counts the flushes sent ahead too.
        let ahead = format!("{with}data_flushes_ahead 9\n");
        let text = render(&combine("vol", st, Some(&parse_message(&ahead).unwrap())));
        assert!(
            text.contains("data device flushed 12 times (and 9 times ahead), 1 flush not needed"),
            "{text}"
        );
        assert!(!text.contains("data flushes ahead"), "{text}");
        // 1.3.0 has the hold only; older kernels neither.
        let old = format!("{MESSAGE}commit_hold_us 5000\ncommit_hold_max_us 1000\n");
        let text = render(&combine("vol", st, Some(&parse_message(&old).unwrap())));
        assert!(
            text.contains("held writes out 5.0 ms in all, 1.0 ms at most\n"),
            "{text}"
        );
        let m = parse_message(MESSAGE).unwrap();
        assert!(!render(&combine("vol", st, Some(&m))).contains("commits"));
    }

    #[test]
    fn status_line() {
        let s = parse_status(STATUS).unwrap();
        assert_eq!(s.len(), 1);
        let s = &s[0];
        assert_eq!(s.length, 2097152);
        assert_eq!(s.mode, "rw");
        assert_eq!(s.transaction_id, 42);
        assert_eq!((s.metadata_used, s.metadata_total), (130, 16384));
        assert_eq!((s.data_used, s.data_total), (5000, 262144));
        assert_eq!(s.mapped, 9000);
        assert_eq!(
            (
                s.unique_writes,
                s.duplicate_writes,
                s.zero_writes,
                s.discarded
            ),
            (5000, 3500, 500, 200)
        );
        assert_eq!(s.hash, "sha256");
        assert!(!s.verify && !s.discard_passdown);
    }

    #[test]
    fn status_variants() {
        let s = parse_status_line(
            "vol: 0 8 dedup needs_check 1 2/100 0/10 0 0 0 0 0 xxhash64 verify discard_passdown",
        )
        .unwrap();
        assert_eq!(s.mode, "needs_check");
        assert!(s.verify && s.discard_passdown);
        assert!(parse_status("0 100 linear 8:0 0\n")
            .unwrap_err()
            .contains("not dedup"));
        assert!(parse_status("0 8 dedup rw 1 2/100 0/10 0 0\n").is_err());
        assert!(
            parse_status("0 8 dedup rw x 2/100 0/10 0 0 0 0 0 sha256 verify discard_passdown")
                .is_err()
        );
        assert!(
            parse_status("0 8 dedup rw 1 2-100 0/10 0 0 0 0 0 sha256 verify discard_passdown")
                .is_err()
        );
        assert!(
            parse_status("0 8 dedup rw 1 2/100 0/10 0 0 0 0 0 sha256 maybe discard_passdown")
                .is_err()
        );
        assert!(parse_status("").is_err());
    }

    #[test]
    fn message_and_derived_numbers() {
        let m = parse_message(MESSAGE).unwrap();
        assert_eq!(m["deferred_reads"], "17");
        assert_eq!(m["hash"], "sha256");
        let st = &parse_status(STATUS).unwrap()[0];
        let s = combine("vol", st, Some(&m));
        assert_eq!(s.logical_blocks, 262144);
        assert_eq!(s.data_blocks_free, 257144);
        assert_eq!(s.data_blocks_live, Some(4500));
        assert!((s.dedup_ratio - 2.0).abs() < 1e-9);
        assert!((s.space_savings_percent - 50.0).abs() < 1e-9);
        assert!((s.write_savings_percent - 44.444).abs() < 0.01);
        assert_eq!(s.counters["index_full"], serde_json::json!(0));
        let text = render(&s);
        assert!(text.contains("dedup ratio                2.00"), "{text}");
        assert!(text.contains("deferred reads             17"), "{text}");
        assert!(
            text.contains("index memory               2.5 MiB, 10.00 bytes per data block"),
            "{text}"
        );
        let j = serde_json::to_value(&s).unwrap();
        assert_eq!(j["mapped_blocks"], 9000);
        assert_eq!(j["counters"]["hash"], "sha256");
    }

    #[test]
    fn message_forms() {
        let m = parse_message("a=1\nb: 2\nc 3\n\n").unwrap();
        assert_eq!(
            (m["a"].as_str(), m["b"].as_str(), m["c"].as_str()),
            ("1", "2", "3")
        );
        assert!(parse_message("\n").is_err());
        assert!(parse_message("lonely\n").is_err());
    }

    #[test]
    fn write_counters_near_the_top_do_not_overflow() {
        // The counters come from the superblock unchecked: their sum can
        // pass 2^64, and the share stays within 0..=100 %.
        let max = u64::MAX.to_string();
        for (counters, want) in [
            (format!("9000 {max} 3500 500 200"), 0.0),
            (format!("9000 5 {max} 500 200"), 100.0),
            (format!("9000 {max} {max} {max} 200"), 0.0),
            ("9000 0 0 0 200".to_string(), 0.0),
        ] {
            let line = STATUS.replace("9000 5000 3500 500 200", &counters);
            let st = &parse_status(&line).unwrap()[0];
            let s = combine("vol", st, None);
            assert!(
                (0.0..=100.0).contains(&s.write_savings_percent),
                "{counters}: {}",
                s.write_savings_percent
            );
            assert!((s.write_savings_percent - want).abs() < 1e-9, "{counters}");
            let text = render(&s);
            assert!(
                text.contains(&format!("write savings              {want:.1}%")),
                "{text}"
            );
        }
    }

    #[test]
    fn status_only() {
        let st = &parse_status(STATUS).unwrap()[0];
        let s = combine("vol", st, None);
        assert_eq!(s.logical_blocks, 262144);
        assert_eq!(s.dedup_ratio, 1.0);
        assert_eq!(s.data_blocks_live, None);
        assert!(!render(&s).is_empty());
    }
}
