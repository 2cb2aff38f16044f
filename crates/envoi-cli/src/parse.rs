//! Durations and sizes on the command line.

use std::time::Duration;

/// Parses a duration: one or more numbers with a unit — `ms`, `s`, `m`,
/// `h` or `d` — such as `500ms`, `30s`, `1.5m` or `1h30m`. A bare number is
/// seconds. The spellings are those of transport DSNs
/// ([`envoi_core::transport::parse_duration`]).
///
/// ```
/// use envoi_cli::parse_duration;
/// use std::time::Duration;
///
/// assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
/// assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
/// assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
/// assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
/// assert!(parse_duration("soon").unwrap_err().contains("such as"));
/// ```
///
/// # Errors
///
/// A message saying what a duration looks like.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    envoi_core::transport::parse_duration(text).ok_or_else(|| {
        format!(
            "invalid duration `{text}`: use a number with a unit, such as 500ms, 30s, 5m or 1h30m"
        )
    })
}

/// Parses a size in bytes: a number with an optional unit — `B`, `K`/`KB`/
/// `KiB`, `M`/`MB`/`MiB`, `G`/`GB`/`GiB`, `T`/`TB`/`TiB` (multiples of 1024,
/// as memory limits usually are; case-insensitive).
///
/// ```
/// use envoi_cli::parse_size;
///
/// assert_eq!(parse_size("128MB"), Ok(128 * 1024 * 1024));
/// assert_eq!(parse_size("1.5g"), Ok(1536 * 1024 * 1024));
/// assert_eq!(parse_size("4096"), Ok(4096));
/// assert!(parse_size("lots").unwrap_err().contains("such as"));
/// ```
///
/// # Errors
///
/// A message saying what a size looks like.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let bad =
        || format!("invalid size `{text}`: use a number with a unit, such as 512K, 128MB or 2G");
    let trimmed = text.trim();
    let number_len = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    if number_len == 0 {
        return Err(bad());
    }
    let number: f64 = trimmed[..number_len].parse().map_err(|_| bad())?;
    let scale: u64 = match trimmed[number_len..].trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    let bytes = number * scale as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes.round() as u64)
}

/// Parses a whole number of at least 1 (a count such as `--concurrency`).
pub(crate) fn parse_positive(text: &str) -> Result<usize, String> {
    positive(text)
}

/// Parses a whole number of at least 1 (a limit such as `--limit`).
pub(crate) fn parse_positive_u64(text: &str) -> Result<u64, String> {
    positive(text)
}

fn positive<N>(text: &str) -> Result<N, String>
where
    N: std::str::FromStr<Err = std::num::ParseIntError> + Default + PartialEq,
{
    match text.trim().parse::<N>() {
        Ok(n) if n != N::default() => Ok(n),
        Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => {
            Err(format!("`{text}` is too large"))
        }
        _ => Err(format!("`{text}` is not a whole number of at least 1")),
    }
}

/// Parses a duration greater than zero (`--time-limit`): a zero limit would
/// stop at once.
pub(crate) fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        Duration::ZERO => Err(format!("`{text}` is not a duration greater than zero")),
        d => Ok(d),
    }
}

/// Parses a size greater than zero (`--memory-limit`): a zero limit would
/// stop at once.
pub(crate) fn parse_positive_size(text: &str) -> Result<u64, String> {
    match parse_size(text)? {
        0 => Err(format!("`{text}` is not a size greater than zero")),
        n => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_combine_units_and_accept_fractions() {
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(172_800)));
        assert_eq!(parse_duration(" 10s "), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
    }

    #[test]
    fn bad_durations_are_refused_with_an_example() {
        for bad in ["", "s", "10x", "-5s", "1..2s", "ms10", "1e400", "inf"] {
            let e = parse_duration(bad).unwrap_err();
            assert!(e.contains(&format!("`{bad}`")), "{e}");
            assert!(e.contains("30s"), "{e}");
        }
    }

    #[test]
    fn sizes_use_binary_multiples() {
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("1kib"), Ok(1024));
        assert_eq!(parse_size("2 MiB"), Ok(2 << 20));
        assert_eq!(parse_size("1GB"), Ok(1 << 30));
        assert_eq!(parse_size("10b"), Ok(10));
    }

    #[test]
    fn bad_sizes_are_refused_with_an_example() {
        for bad in ["", "MB", "12XB", "-1M", "1.2.3K", "99999999999T"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains("128MB"), "{bad}: {e}");
        }
    }

    #[test]
    fn positive_numbers_start_at_one() {
        assert_eq!(parse_positive("16"), Ok(16));
        assert!(parse_positive("0").is_err());
        assert!(parse_positive("-2").is_err());
        assert!(parse_positive("many").is_err());
        assert_eq!(parse_positive_u64("1"), Ok(1));
        assert_eq!(parse_positive_u64("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(
            parse_positive_u64("100000000000000000000").unwrap_err(),
            "`100000000000000000000` is too large"
        );
    }

    #[test]
    fn every_positive_count_refuses_zero_with_the_same_words() {
        let expected = "`0` is not a whole number of at least 1";
        assert_eq!(parse_positive("0").unwrap_err(), expected);
        assert_eq!(parse_positive_u64("0").unwrap_err(), expected);
        assert_eq!(
            parse_positive_u64("-1"),
            Err("`-1` is not a whole number of at least 1".to_string())
        );
    }

    #[test]
    fn limits_refuse_a_zero_duration_or_size() {
        assert_eq!(
            parse_positive_duration("0s"),
            Err("`0s` is not a duration greater than zero".to_string())
        );
        assert_eq!(
            parse_positive_duration("0"),
            Err("`0` is not a duration greater than zero".to_string())
        );
        assert_eq!(
            parse_positive_duration("250ms"),
            Ok(Duration::from_millis(250))
        );
        assert_eq!(
            parse_positive_size("0MB"),
            Err("`0MB` is not a size greater than zero".to_string())
        );
        assert_eq!(parse_positive_size("1K"), Ok(1024));
        // A bad text keeps its own explanation.
        assert!(parse_positive_size("lots").unwrap_err().contains("128MB"));
        assert!(parse_positive_duration("soon").unwrap_err().contains("30s"));
    }
}
