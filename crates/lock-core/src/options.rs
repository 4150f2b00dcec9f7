//! Helpers for the drivers' URL options, so every driver reads them the same way.

use std::time::Duration;

use crate::{Error, Result};

/// Parses the duration option `name=value`: a whole number with a unit `ms`, `s` or `m`
/// (`500ms`, `3s`, `1m`), positive. A bare number is read in `bare_unit` when the driver follows a
/// convention that has one (libpq's `connect_timeout` is in seconds), and refused when it is `None`.
///
/// # Errors
/// [`Error::Config`] naming the option, for anything else (before any I/O).
pub fn parse_duration_option(
    name: &str,
    value: &str,
    bare_unit: Option<Duration>,
) -> Result<Duration> {
    let bad = || {
        Error::Config(format!(
            "the option {name}={value:?} must be a positive duration like 500ms, 3s or 1m"
        ))
    };
    let (digits, unit) = match value.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => value.split_at(at),
        None => (value, ""),
    };
    let n: u32 = digits.parse().map_err(|_| bad())?;
    let d = match (unit, bare_unit) {
        ("ms", _) => Duration::from_millis(n.into()),
        ("s", _) => Duration::from_secs(n.into()),
        ("m", _) => Duration::from_secs(u64::from(n) * 60),
        ("", Some(bare)) => bare * n,
        _ => return Err(bad()),
    };
    if d.is_zero() {
        return Err(bad());
    }
    Ok(d)
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
        for bad in [
            "",
            "0",
            "0s",
            "3",
            "s",
            "1h",
            "-1s",
            "1.5s",
            "99999999999s",
            " 1s",
        ] {
            let err = parse_duration_option("t", bad, if bad == "3" { None } else { ms });
            assert!(matches!(err, Err(Error::Config(_))), "{bad:?} was accepted");
        }
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
