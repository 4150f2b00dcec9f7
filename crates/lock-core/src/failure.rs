//! One request's failure, classified by what it may have done on the coordinator, and the
//! request budget every driver sends under.
//!
//! Every driver answers the same question after a failed request: *could it have applied?*
//! The answer decides the error the caller sees, and whether the driver may simply send it
//! again:
//!
//! | [`Failure`] | what applied | a write answers | a read answers | re-send |
//! |---|---|---|---|---|
//! | [`Failure::NotSent`] (connection refused, the budget spent before sending) | nothing | `Unavailable` | `Unavailable` | any request |
//! | [`Failure::Unknown`] (no reply in time, the connection lost mid-request) | maybe | `Indeterminate` | `Unavailable` | only an idempotent one |
//! | [`Failure::Refused`] (the server answered with an error) | nothing | `Backend` | `Backend` | no (it will refuse again) |
//!
//! [`within`] runs one request with at most what is left of a deadline, so a wait never
//! outlives its deadline, and classifies a missed reply as [`Failure::Unknown`].

use std::{future::Future, time::Duration};

use tokio::time::Instant;

use crate::{BoxError, Error, LockKey};

/// What a failed request may have done on the coordinator (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Failure {
    /// The request never reached a server: nothing applied.
    NotSent,
    /// The request was sent and its reply never came: it may have applied.
    Unknown,
    /// The server answered with an error: nothing applied, and sending it again will not help.
    Refused,
}

/// Whether an operation changes the coordinator's state — which decides what an
/// [`Failure::Unknown`] means to the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Effect {
    /// A read (`inspect`, a look at a queue): an unanswered one changed nothing.
    Read,
    /// A write of the lock's state (acquire, renew, release): an unanswered one may have.
    Write,
}

/// A failed request: its class and the client library's error.
#[derive(Debug)]
pub struct RequestFailure {
    /// What it may have done.
    pub failure: Failure,
    /// What went wrong.
    pub source: BoxError,
}

impl RequestFailure {
    /// A request that never reached a server.
    pub fn not_sent(source: impl Into<BoxError>) -> Self {
        Self {
            failure: Failure::NotSent,
            source: source.into(),
        }
    }

    /// A request whose reply never came.
    pub fn unknown(source: impl Into<BoxError>) -> Self {
        Self {
            failure: Failure::Unknown,
            source: source.into(),
        }
    }

    /// A request the server refused.
    pub fn refused(source: impl Into<BoxError>) -> Self {
        Self {
            failure: Failure::Refused,
            source: source.into(),
        }
    }

    /// The caller's error for `op` on `key` of `backend`, by the table in the
    /// [module docs](self).
    pub fn into_error(
        self,
        backend: &'static str,
        op: &'static str,
        key: &LockKey,
        effect: Effect,
    ) -> Error {
        match (self.failure, effect) {
            (Failure::NotSent, _) | (Failure::Unknown, Effect::Read) => {
                Error::unavailable(backend, op, self.source)
            }
            (Failure::Unknown, Effect::Write) => Error::Indeterminate {
                backend,
                op,
                key: key.as_str().to_owned(),
                message: self.source.to_string(),
            },
            (Failure::Refused, _) => Error::backend(backend, op, self.source),
        }
    }
}

/// Runs `request` with at most `timeout`, and never past `until`: past `until` it is not sent
/// at all ([`Failure::NotSent`]); a reply that does not come in time is [`Failure::Unknown`].
/// `classify` sorts the client library's own errors.
///
/// # Errors
/// The request's failure, classified.
pub async fn within<T, E>(
    timeout: Duration,
    until: Instant,
    classify: impl FnOnce(&E) -> Failure,
    request: impl Future<Output = std::result::Result<T, E>>,
) -> std::result::Result<T, RequestFailure>
where
    E: Into<BoxError>,
{
    let left = until.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(RequestFailure::not_sent(
            "the caller's deadline passed before the request was sent",
        ));
    }
    let limit = timeout.min(left);
    match tokio::time::timeout(limit, request).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(RequestFailure {
            failure: classify(&e),
            source: e.into(),
        }),
        Err(_) => Err(RequestFailure::unknown(format!(
            "no reply within the request timeout of {limit:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> LockKey {
        LockKey::new("k").unwrap()
    }

    #[test]
    fn each_class_maps_to_the_error_its_table_row_names() {
        let e = |f: RequestFailure, effect| f.into_error("x", "op", &key(), effect);
        assert!(matches!(
            e(RequestFailure::not_sent("refused"), Effect::Write),
            Error::Unavailable { .. }
        ));
        assert!(matches!(
            e(RequestFailure::unknown("lost"), Effect::Write),
            Error::Indeterminate { .. }
        ));
        assert!(matches!(
            e(RequestFailure::unknown("lost"), Effect::Read),
            Error::Unavailable { .. }
        ));
        assert!(matches!(
            e(RequestFailure::refused("no"), Effect::Read),
            Error::Backend { .. }
        ));
        assert!(matches!(
            e(RequestFailure::refused("no"), Effect::Write),
            Error::Backend { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_never_outlives_the_deadline_and_a_late_reply_is_unknown() {
        let classify = |_: &std::io::Error| Failure::Refused;
        // Past the deadline: not sent.
        let past = Instant::now();
        let sent = std::sync::atomic::AtomicBool::new(false);
        let got = within(Duration::from_secs(5), past, classify, async {
            sent.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, std::io::Error>(())
        })
        .await;
        assert_eq!(got.unwrap_err().failure, Failure::NotSent);
        assert!(!sent.load(std::sync::atomic::Ordering::SeqCst));
        // A reply that never comes: unknown, at the earlier of the timeout and the deadline.
        let start = Instant::now();
        let until = start + Duration::from_secs(2);
        let got = within(
            Duration::from_secs(5),
            until,
            classify,
            std::future::pending::<Result<(), std::io::Error>>(),
        )
        .await;
        assert_eq!(got.unwrap_err().failure, Failure::Unknown);
        assert_eq!(Instant::now(), until);
        // The library's errors are classified by the driver.
        let got = within(
            Duration::from_secs(5),
            Instant::now() + Duration::from_secs(5),
            classify,
            async { Err::<(), _>(std::io::Error::other("nope")) },
        )
        .await;
        assert_eq!(got.unwrap_err().failure, Failure::Refused);
    }
}
