//! Shared checks for the drivers' TLS and authentication tests.

use std::{fmt, future::Future, time::Duration};

use lock_core::{Error, Result};
use tokio::time::{Instant, timeout};
use url::Url;

use crate::backend_url;

/// Awaits `attempt` (a connect, or a connect plus a first request) and expects it to fail closed:
/// an error (never a success), within `bound` (a hang is reported once `hang` passes), with no
/// `secret` in the error's `Display` or `Debug` (source chain included). Returns the error and its
/// lower-cased text for further checks.
pub async fn fails_closed<T: fmt::Debug>(
    attempt: impl Future<Output = Result<T>>,
    secrets: &[&str],
    bound: Duration,
    hang: Duration,
) -> (Error, String) {
    let started = Instant::now();
    let result = timeout(hang, attempt)
        .await
        .unwrap_or_else(|_| panic!("hung for {hang:?} instead of failing"));
    let elapsed = started.elapsed();
    let err = match result {
        Ok(granted) => panic!("succeeded where it must fail closed: {granted:?}"),
        Err(e) => e,
    };
    let shown = format!("{err} | {err:?}");
    for secret in secrets {
        assert!(!shown.contains(secret), "a secret leaked: {shown}");
    }
    assert!(elapsed < bound, "failing took {elapsed:?}: {shown}");
    eprintln!("failed closed in {elapsed:?}: {err}");
    (err, shown.to_lowercase())
}

/// A secured server from `scripts/backends.sh up-secure`: its URL (with credentials), the
/// password in it, and the path of an unrelated CA for "wrong CA" checks.
#[derive(Debug)]
pub struct SecureServer {
    /// The server's URL, credentials and CA option included.
    pub url: Url,
    /// The password in `url`, to check that it never shows.
    pub password: String,
    /// `DISTLOCK_TEST_SECURE_WRONG_CA`: a CA that did not sign the server's certificate.
    pub wrong_ca: String,
}

/// The secured server whose URL is in `var` (`None`, or a failure under
/// `DISTLOCK_REQUIRE_BACKENDS=1`, when unset — see [`backend_url`]).
pub fn secure_server(var: &str) -> Option<SecureServer> {
    let url = Url::parse(&backend_url(var)?).expect("the secure URL parses");
    let password = url
        .password()
        .expect("the secure URL has a password")
        .to_owned();
    let wrong_ca = std::env::var("DISTLOCK_TEST_SECURE_WRONG_CA")
        .expect("DISTLOCK_TEST_SECURE_WRONG_CA is set with the secure URLs");
    Some(SecureServer {
        url,
        password,
        wrong_ca,
    })
}
