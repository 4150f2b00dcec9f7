//! Human durations on the command line: `30s`, `500ms`, `2m`, `1h`, `1d`, `1m30s`, `1.5s` — the
//! grammar of URL options too — and a bare number is seconds (as `flock -w` takes them).

use std::time::Duration;

/// Parses a duration such as `30s`, `500ms`, `2m`, `1h30m` or `2.5` (seconds): distlock's one
/// duration grammar ([`distlock::raw::parse_duration`], humantime's), the same as in URL options,
/// with a bare number read as seconds.
///
/// # Errors
/// A message for clap when the text is not such a duration.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    // Negative values reach here (the options allow a leading hyphen) to be told what is wrong.
    if text.trim_start().starts_with('-') {
        return Err(format!(
            "invalid duration {text:?}: duration must be ≥ 0 (e.g. 0, 500ms, 30s, 2m)"
        ));
    }
    distlock::raw::parse_duration(text, Some(Duration::from_secs(1)))
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
        for text in ["-1s", "-1", " -0.5s"] {
            assert!(
                parse_duration(text)
                    .unwrap_err()
                    .contains("duration must be ≥ 0"),
                "{text:?}"
            );
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
