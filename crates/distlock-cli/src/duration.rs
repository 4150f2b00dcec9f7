//! Human durations on the command line: `30s`, `500ms`, `2m`, `1h`, `1d`, `1m30s`, `1.5s`; a bare
//! number is seconds (as `flock -w` takes them).

use std::time::Duration;

/// Parses a duration such as `30s`, `500ms`, `2m`, `1h30m` or `2.5` (seconds).
///
/// # Errors
/// A message for clap when the text is not such a duration.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || {
        format!(
            "invalid duration `{text}`: use e.g. 30s, 500ms, 2m, 1h, 1d, 1m30s or a number of seconds"
        )
    };
    let text_trimmed = text.trim();
    if text_trimmed.is_empty() {
        return Err(bad());
    }
    if let Ok(secs) = text_trimmed.parse::<f64>() {
        return seconds(secs).ok_or_else(bad);
    }
    let mut total = Duration::ZERO;
    let mut rest = text_trimmed;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let (number, tail) = rest.split_at(number_len);
        let unit_len = tail
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let value: f64 = number.parse().map_err(|_| bad())?;
        let scale = match unit {
            "ms" => 0.001,
            "s" | "sec" | "secs" => 1.0,
            "m" | "min" | "mins" => 60.0,
            "h" | "hr" | "hrs" => 3600.0,
            "d" | "day" | "days" => 86400.0,
            _ => return Err(bad()),
        };
        total = total
            .checked_add(seconds(value * scale).ok_or_else(bad)?)
            .ok_or_else(bad)?;
        rest = tail;
    }
    Ok(total)
}

fn seconds(value: f64) -> Option<Duration> {
    Duration::try_from_secs_f64(value).ok()
}

/// `1.5s`, `250ms`, `2m05s`: short and readable.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", d.as_secs_f64())
    } else if ms < 3_600_000 {
        format!("{}m{:02}s", d.as_secs() / 60, d.as_secs() % 60)
    } else {
        format!("{}h{:02}m", d.as_secs() / 3600, d.as_secs() / 60 % 60)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn parses_units_and_combinations() {
        let cases = [
            ("30s", Duration::from_secs(30)),
            ("500ms", Duration::from_millis(500)),
            ("2m", Duration::from_secs(120)),
            ("1h", Duration::from_secs(3600)),
            ("1d", Duration::from_secs(86400)),
            ("1d12h", Duration::from_secs(129_600)),
            ("1m30s", Duration::from_secs(90)),
            ("1.5s", Duration::from_millis(1500)),
            ("2", Duration::from_secs(2)),
            ("0.25", Duration::from_millis(250)),
            ("0s", Duration::ZERO),
            (" 10s ", Duration::from_secs(10)),
        ];
        for (text, want) in cases {
            assert_eq!(parse_duration(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn rejects_garbage() {
        for text in [
            "", "s", "10x", "-1s", "-1", "1s2", "ten", "1e400", "1..2s", "NaN", "inf",
        ] {
            assert!(parse_duration(text).is_err(), "{text:?} should be rejected");
        }
    }

    #[test]
    fn formats_briefly() {
        assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_duration(Duration::from_secs(125)), "2m05s");
        assert_eq!(format_duration(Duration::from_secs(7260)), "2h01m");
    }
}
