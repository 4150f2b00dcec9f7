//! Mapping etcd-client errors onto `lock_core::raw::Error`.

use std::{future::Future, time::Duration};

use lock_core::raw::Error;

pub(crate) const BACKEND: &str = "etcd";

/// What a failed request tells us about whether it was applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The request never reached a server (connection refused, dial failure): nothing applied.
    NotSent,
    /// The request may have been applied (timeout, connection lost mid-request).
    Unknown,
    /// The server answered with an error: nothing applied.
    Rejected,
    /// The server says the lease does not exist (expired or revoked).
    LeaseNotFound,
}

/// A failed request: its class plus the error to report.
#[derive(Debug)]
pub(crate) struct RequestError {
    pub(crate) failure: Failure,
    pub(crate) source: lock_core::raw::BoxError,
}

impl RequestError {
    /// As a `lock_core::raw::Error` for an operation whose outcome does not matter (reads, idempotent
    /// writes): unreachable → `Unavailable`, anything else → `Backend`.
    pub(crate) fn into_error(self, op: &'static str) -> Error {
        match self.failure {
            Failure::NotSent | Failure::Unknown => Error::unavailable(BACKEND, op, self.source),
            Failure::Rejected | Failure::LeaseNotFound => Error::backend(BACKEND, op, self.source),
        }
    }
}

impl RequestError {
    /// Whether the server refused the request in a way that retrying cannot change while this
    /// client lives: permission denied, credentials refused (a deleted user, a changed
    /// password), an invalid request. Not an expired token (refreshed: [`Failure::NotSent`]),
    /// not a stale auth revision, not a leader change.
    pub(crate) fn is_permanent(&self) -> bool {
        use tonic::Code;
        if self.failure != Failure::Rejected {
            return false;
        }
        let Some(etcd_client::Error::GRpcStatus(status)) =
            self.source.downcast_ref::<etcd_client::Error>()
        else {
            return false;
        };
        let m = status.message();
        match status.code() {
            Code::PermissionDenied | Code::Unauthenticated | Code::Unimplemented => true,
            Code::InvalidArgument => !m.contains("revision of auth store is old"),
            Code::FailedPrecondition => [
                "user name not found",
                "role is not granted",
                "role name not found",
            ]
            .iter()
            .any(|needle| m.contains(needle)),
            _ => false,
        }
    }
}

fn is_connect_failure(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    [
        "connection refused",
        "tcp connect error",
        "error trying to connect",
        "dns error",
        "failed to lookup address",
        "no route to host",
        "network is unreachable",
    ]
    .iter()
    .any(|needle| m.contains(needle))
}

pub(crate) fn classify(e: &etcd_client::Error) -> Failure {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        E::TransportError(_) | E::IoError(_) | E::InvalidUri(_) | E::EndpointError(_) => {
            Failure::NotSent
        }
        E::GRpcStatus(status) => {
            let full = format!("{} {:?}", status.message(), status);
            match status.code() {
                Code::NotFound if status.message().contains("lease not found") => {
                    Failure::LeaseNotFound
                }
                Code::Unavailable if is_connect_failure(&full) => Failure::NotSent,
                // An expired token: refused before anything was applied, and the client
                // re-authenticates (auto token refresh), so it is temporary (review L5).
                Code::Unauthenticated | Code::Unknown
                    if status.message().contains("invalid auth token") =>
                {
                    Failure::NotSent
                }
                Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Cancelled
                | Code::Unknown
                | Code::Internal
                | Code::Aborted => Failure::Unknown,
                _ => Failure::Rejected,
            }
        }
        E::LeaseKeepAliveError(m) if m.contains("lease not found") => Failure::LeaseNotFound,
        E::LeaseKeepAliveError(_) | E::WatchError(_) => Failure::Unknown,
        _ => Failure::Rejected,
    }
}

/// Runs one request with the configured timeout, classifying failures.
pub(crate) async fn request<T>(
    timeout: Duration,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, RequestError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(RequestError {
            failure: classify(&e),
            source: Box::new(e),
        }),
        Err(_) => Err(RequestError {
            failure: Failure::Unknown,
            source: format!("no reply within the request timeout of {timeout:?}").into(),
        }),
    }
}

/// Runs one request with at most what is left until `until` (and never more than `timeout`).
/// Past `until` the request is not sent at all ([`Failure::NotSent`]).
pub(crate) async fn request_until<T>(
    timeout: Duration,
    until: tokio::time::Instant,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, RequestError> {
    let left = until.saturating_duration_since(tokio::time::Instant::now());
    if left.is_zero() {
        return Err(RequestError {
            failure: Failure::NotSent,
            source: "the caller's deadline passed before the request was sent".into(),
        });
    }
    request(timeout.min(left), fut).await
}

/// A `Backend` error with a message of our own.
pub(crate) fn protocol(op: &'static str, message: impl Into<String>) -> Error {
    Error::Backend {
        backend: BACKEND,
        op,
        message: message.into(),
        source: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: tonic::Code, message: &str) -> RequestError {
        let e = etcd_client::Error::GRpcStatus(tonic::Status::new(code, message));
        RequestError {
            failure: classify(&e),
            source: Box::new(e),
        }
    }

    #[test]
    fn only_refusals_that_cannot_change_are_permanent() {
        use tonic::Code;
        for (code, message) in [
            (Code::PermissionDenied, "etcdserver: permission denied"),
            (
                Code::InvalidArgument,
                "etcdserver: authentication failed, invalid user ID or password",
            ),
            (Code::FailedPrecondition, "etcdserver: user name not found"),
        ] {
            assert!(status(code, message).is_permanent(), "{message}");
        }
        for (code, message) in [
            (Code::Unauthenticated, "etcdserver: invalid auth token"),
            (
                Code::InvalidArgument,
                "etcdserver: revision of auth store is old",
            ),
            (Code::FailedPrecondition, "etcdserver: not leader"),
            (Code::Unavailable, "etcdserver: leader changed"),
            (Code::ResourceExhausted, "etcdserver: too many requests"),
            (Code::NotFound, "etcdserver: requested lease not found"),
        ] {
            assert!(!status(code, message).is_permanent(), "{message}");
        }
        let timeout = RequestError {
            failure: Failure::Unknown,
            source: "no reply".into(),
        };
        assert!(!timeout.is_permanent());
    }
}
