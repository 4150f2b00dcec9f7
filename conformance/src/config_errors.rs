//! The drivers' config unit tests share one check for their tables of URLs to refuse, so each
//! driver states only its cases.

use std::fmt;

/// For each `(url, mention)` in `cases`: `parse(url)` must fail with `Error::Config` whose
/// message contains `mention` (the option, part or value the refusal is about), and, when the URL
/// carries a password, the message must not contain it (as given or percent-decoded). Checks
/// every case, then panics (fails the test) listing each case that failed, with what `parse`
/// answered instead.
pub fn assert_config_errors<T: fmt::Debug>(
    parse: impl Fn(&str) -> lock_core::Result<T>,
    cases: &[(&str, &str)],
) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|&(url, mention)| {
            let why = match parse(url) {
                Err(lock_core::Error::Config(why)) => why,
                other => return Some(format!("{url}: not a Config error: {other:?}")),
            };
            if !why.contains(mention) {
                return Some(format!(
                    "{url}: the message does not mention {mention:?}: {why}"
                ));
            }
            passwords(url)
                .iter()
                .any(|secret| why.contains(secret.as_str()))
                .then(|| format!("{url}: the message shows the password: {why}"))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The URL's password as written and percent-decoded (neither may show in a message); none when
/// the URL does not parse or has no password.
fn passwords(url: &str) -> Vec<String> {
    let Some(raw) = url::Url::parse(url)
        .ok()
        .and_then(|u| u.password().map(str::to_owned))
        .filter(|p| !p.is_empty())
    else {
        return Vec::new();
    };
    let decoded = url::form_urlencoded::parse(format!("p={raw}").as_bytes())
        .next()
        .map(|(_, v)| v.into_owned());
    std::iter::once(raw).chain(decoded).collect()
}
