//! Shared checks for the drivers' TLS and authentication tests.

use std::{fmt, future::Future, time::Duration};

use lock_core::{Error, Result};
use tokio::time::{Instant, timeout};

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
