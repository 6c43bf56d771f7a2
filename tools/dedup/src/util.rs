//! Small helpers: sizes, dates, exit codes.

/// fsck-style exit codes.
pub const EXIT_OK: i32 = 0;
/// Errors were found and left uncorrected.
pub const EXIT_ERRORS: i32 = 4;
/// Operational error: cannot open or read, not a dedup device, refused.
pub const EXIT_OPERATIONAL: i32 = 8;
/// Usage or syntax error.
pub const EXIT_USAGE: i32 = 16;

/// "1.5 GiB" style size.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else if v >= 100.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Parse "4096", "4K", "64MiB", "1g", "2T" (binary units) into bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!("'{s}' is not a size (e.g. 4096, 64M, 10GiB)"));
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}': number too large"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        u => {
            return Err(format!(
                "'{s}': unknown unit '{u}' (use K, M, G, T, P: powers of 1024)"
            ))
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("'{s}': size too large"))
}

/// Seconds since the epoch as "YYYY-MM-DD HH:MM:SS UTC".
pub fn format_utc(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Lower-case hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

/// "7" or "7-9": an inclusive range of block numbers.
pub fn span(first: u64, last: u64) -> String {
    if first == last {
        format!("{first}")
    } else {
        format!("{first}-{last}")
    }
}

/// Ascending block numbers as "1-5, 9, 12-14".
pub fn spans(sorted: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        out.push(span(sorted[i], sorted[j]));
        i = j + 1;
    }
    out.join(", ")
}

/// "1 block", "2 blocks".
pub fn plural(n: u64, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert_eq!(parse_size("2 TiB").unwrap(), 2 << 40);
        assert!(parse_size("").is_err());
        assert!(parse_size("x").is_err());
        assert!(parse_size("5Q").is_err());
        assert!(parse_size("99999999999P").is_err());
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(64 << 20), "64.0 MiB");
        assert_eq!(human_bytes(300 << 30), "300 GiB");
    }

    #[test]
    fn dates() {
        assert_eq!(format_utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(format_utc(1_700_000_000), "2023-11-14 22:13:20 UTC");
    }

    #[test]
    fn span_lists() {
        assert_eq!(spans(&[]), "");
        assert_eq!(spans(&[4]), "4");
        assert_eq!(spans(&[1, 2, 3, 5, 7, 8]), "1-3, 5, 7-8");
        assert_eq!(span(3, 3), "3");
        assert_eq!(plural(1, "block"), "1 block");
        assert_eq!(plural(0, "block"), "0 blocks");
    }

    #[test]
    fn hexes() {
        assert_eq!(hex(&[0, 0xab, 0x10]), "00ab10");
        assert_eq!(unhex("00ab10").unwrap(), vec![0, 0xab, 0x10]);
        assert!(unhex("0").is_none());
        assert!(unhex("zz").is_none());
        assert!(unhex("é1").is_none());
    }
}
