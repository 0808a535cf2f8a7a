//! Byte sizes written the way people write them: `"512MiB"`, `"4GiB"`, `"1.5 GB"`, `"1000000"`.

use crate::error::{KvError, Result};

/// Parses a size in bytes: a number with an optional unit, B, KB/MB/GB/TB (powers of
/// 1000) or KiB/MiB/GiB/TiB (powers of 1024), case-insensitive.
pub fn parse_size(text: &str) -> Result<usize> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim().to_ascii_lowercase());
    let mult: f64 = match unit.as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        _ => {
            return Err(bad(
                text,
                "unknown unit; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB",
            ))
        }
    };
    let value: f64 = num.parse().map_err(|_| {
        bad(
            text,
            "expected a number followed by a unit, such as '512MiB'",
        )
    })?;
    let bytes = value * mult;
    if !bytes.is_finite() || bytes < 0.0 || bytes > isize::MAX as f64 {
        return Err(bad(text, "must be between 0 and the address space"));
    }
    Ok(bytes as usize)
}

fn bad(text: &str, reason: &str) -> KvError {
    KvError::InvalidArgument {
        name: "memory_bytes",
        value: format!("{text:?}"),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_size("1.5 GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("123").unwrap(), 123);
        assert_eq!(parse_size("2kib").unwrap(), 2048);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("-1MB").is_err());
        assert!(parse_size("MiB").is_err());
    }
}
