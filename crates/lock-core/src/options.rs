//! Helpers for the drivers' URL options, so every driver reads them the same way.

use std::time::Duration;

use crate::{Error, Result};

/// The one duration grammar of distlock, for URL options and the command line alike:
/// [`humantime`]'s — a number and a unit, possibly several (`500ms`, `30s`, `2m`, `1h`, `1d`,
/// `1m30s`, `1h 30m`, `1.5s`) — and, where the caller has one, a bare number in `bare_unit` (whole or
/// decimal: the CLI reads `2.5` as seconds, as `flock -w` does; libpq's `connect_timeout` is
/// whole seconds). Decimals with a unit (`1.5s`) are humantime's too. Surrounding whitespace is
/// ignored.
///
/// # Errors
/// A message naming the accepted forms, when `text` is none of them or does not fit a
/// [`Duration`].
pub fn parse_duration(
    text: &str,
    bare_unit: Option<Duration>,
) -> std::result::Result<Duration, String> {
    let text = text.trim();
    let bad = || {
        let bare = if bare_unit.is_some() {
            " or a bare number"
        } else {
            ""
        };
        format!("invalid duration {text:?}: use e.g. 500ms, 30s, 2m, 1h, 1d or 1m30s{bare}")
    };
    if let Some(unit) = bare_unit
        && !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit() || b == b'.')
    {
        let n: f64 = text.parse().map_err(|_| bad())?;
        return Duration::try_from_secs_f64(n * unit.as_secs_f64()).map_err(|_| bad());
    }
    humantime::parse_duration(text).map_err(|_| bad())
}

/// Parses the URL option `name=value` with [`parse_duration`]; it must be positive.
///
/// # Errors
/// [`Error::Config`] naming the option, for anything else (before any I/O).
pub fn parse_duration_option(
    name: &str,
    value: &str,
    bare_unit: Option<Duration>,
) -> Result<Duration> {
    match parse_duration(value, bare_unit) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(Error::Config(format!(
            "the option {name}={value:?} must be a positive duration like 500ms, 3s, 1m or 1m30s"
        ))),
    }
}

/// Decodes a percent-encoded user name or password taken from a URL (`Url::username()` and
/// `Url::password()` return them encoded). Strict: a malformed escape is an error rather than
/// passed through, so a typo never silently becomes a different credential.
///
/// # Errors
/// [`Error::Config`] for a malformed escape or non-UTF-8 result; the value is never echoed.
pub fn decode_url_credential(s: &str) -> Result<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let byte = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    Error::Config("bad percent-escape in the URL's credentials".into())
                })?;
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| Error::Config("the URL's credentials are not UTF-8".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_need_a_unit_or_the_drivers_bare_unit() {
        let ms = Some(Duration::from_millis(1));
        assert_eq!(
            parse_duration_option("t", "500ms", None).unwrap(),
            Duration::from_millis(500)
        );
        assert_eq!(
            parse_duration_option("t", "3s", None).unwrap(),
            Duration::from_secs(3)
        );
        assert_eq!(
            parse_duration_option("t", "2m", None).unwrap(),
            Duration::from_secs(120)
        );
        assert_eq!(
            parse_duration_option("t", "250", ms).unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(
            parse_duration_option("t", "2", Some(Duration::from_secs(1))).unwrap(),
            Duration::from_secs(2)
        );
        assert_eq!(
            parse_duration_option("t", "1h", None).unwrap(),
            Duration::from_secs(3600)
        );
        assert_eq!(
            parse_duration_option("t", "1m30s", None).unwrap(),
            Duration::from_secs(90)
        );
        for bad in [
            "",
            "0",
            "0s",
            "3",
            "s",
            "-1s",
            "99999999999999999999999s",
            "1s2",
            "ten",
        ] {
            let err = parse_duration_option("t", bad, if bad == "3" { None } else { ms });
            assert!(matches!(err, Err(Error::Config(_))), "{bad:?} was accepted");
        }
    }

    #[test]
    fn one_grammar_for_urls_and_the_command_line() {
        let secs = Some(Duration::from_secs(1));
        for (text, want) in [
            ("30s", Duration::from_secs(30)),
            ("500ms", Duration::from_millis(500)),
            ("1d12h", Duration::from_secs(129_600)),
            ("1h 30m", Duration::from_secs(5400)),
            ("2", Duration::from_secs(2)),
            ("0.25", Duration::from_millis(250)),
            ("1.5s", Duration::from_millis(1500)),
            ("0s", Duration::ZERO),
            (" 10s ", Duration::from_secs(10)),
        ] {
            assert_eq!(parse_duration(text, secs), Ok(want), "{text}");
        }
        for bad in [
            "", "s", "10x", "-1s", "-1", "1s2", "ten", "1e400", "1..2", "NaN", "inf",
        ] {
            assert!(parse_duration(bad, secs).is_err(), "{bad:?} was accepted");
        }
        // Without a bare unit a bare number is refused.
        assert!(parse_duration("2", None).is_err());
    }

    #[test]
    fn credentials_decode_strictly() {
        assert_eq!(
            decode_url_credential("p%40ss%3Aw%C3%B6rd").unwrap(),
            "p@ss:wörd"
        );
        for bad in ["%", "%4", "%zz", "%ff", "%C3"] {
            assert!(decode_url_credential(bad).is_err(), "{bad:?}");
        }
    }
}
