//! The etcd client: connecting (endpoints, TLS, authentication, the server's smallest lease),
//! counting the requests sent, and classifying etcd-client's errors by what a failed request may
//! have applied.

use std::{
    future::Future,
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use etcd_client::{
    Certificate, Client, ConnectOptions, GetOptions, Identity, SortOrder, SortTarget, TlsOptions,
    TxnOpResponse, TxnResponse,
};
use lock_core::raw::{Error, Result};

use crate::EtcdLockConfig;

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

/// Requests sent to etcd by one client, by kind.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) lease_grant: AtomicU64,
    pub(crate) lease_keepalive: AtomicU64,
    pub(crate) lease_revoke: AtomicU64,
    pub(crate) txn: AtomicU64,
    pub(crate) range: AtomicU64,
    pub(crate) watch: AtomicU64,
}

impl Counters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Builds the client of `config` (TLS, authentication, leader required), bounded by the dial
/// timeout plus one request timeout.
pub(crate) async fn connect(config: &EtcdLockConfig) -> Result<Client> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(config.dial_timeout)
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
        // A member that has lost its leader refuses at once instead of serving stale
        // watches or stalling requests (review L4).
        .with_require_leader(true);
    if let Some(user) = &config.user {
        // Re-authenticates when the token expired (etcd's simple tokens live 5 min by
        // default), instead of failing every later request for good (review L5).
        options = options
            .with_user(user.clone(), config.password.clone().unwrap_or_default())
            .with_auto_token_refresh(true);
    }
    let scheme = if let Some(tls) = &config.tls {
        let mut t = TlsOptions::new();
        if let Some(ca) = &tls.ca_file {
            t = t.ca_certificate(Certificate::from_pem(read_file(ca, "ca_file")?));
        }
        if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
            t = t.identity(Identity::from_pem(
                read_file(cert, "cert_file")?,
                read_file(key, "key_file")?,
            ));
        }
        if let Some(domain) = &tls.domain {
            t = t.domain_name(domain.clone());
        }
        options = options.with_tls(t);
        "https"
    } else {
        "http"
    };
    let endpoints: Vec<String> = config
        .endpoints
        .iter()
        .map(|e| format!("{scheme}://{e}"))
        .collect();
    request(
        config.dial_timeout.saturating_add(config.request_timeout),
        Client::connect(endpoints, Some(options)),
    )
    .await
    .map_err(|e| e.into_error("connect"))
}

/// How many requests one [`EtcdLock`] client has sent to etcd, by kind (for measuring overhead).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdRequestCounts {
    /// `LeaseGrant` calls.
    pub lease_grant: u64,
    /// `LeaseKeepAlive` requests (messages on keepalive streams, including each stream's first).
    pub lease_keepalive: u64,
    /// `LeaseRevoke` calls.
    pub lease_revoke: u64,
    /// `Txn` calls.
    pub txn: u64,
    /// `Range` calls.
    pub range: u64,
    /// Watches created.
    pub watch: u64,
}

impl EtcdRequestCounts {
    /// All requests.
    pub fn total(&self) -> u64 {
        self.lease_grant
            + self.lease_keepalive
            + self.lease_revoke
            + self.txn
            + self.range
            + self.watch
    }
}

pub(crate) fn first_create() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1)
}

pub(crate) fn txn_get(resp: &TxnResponse, index: usize) -> Option<etcd_client::GetResponse> {
    match resp.op_responses().into_iter().nth(index)? {
        TxnOpResponse::Get(get) => Some(get),
        _ => None,
    }
}

fn read_file(path: &std::path::Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path)
        .map_err(|e| Error::Config(format!("etcd: cannot read {what} {}: {e}", path.display())))
}

/// Asks the server which TTL it grants for a 1 s lease (etcd raises short leases to its
/// minimum, about 1.5 election timeouts).
pub(crate) async fn probe_min_ttl(
    client: &Client,
    config: &EtcdLockConfig,
    counters: &Counters,
) -> Result<Duration> {
    Counters::bump(&counters.lease_grant);
    let resp = request(config.request_timeout, client.lease_client().grant(1, None))
        .await
        .map_err(|e| e.into_error("connect"))?;
    Counters::bump(&counters.lease_revoke);
    if let Err(e) = request(
        config.request_timeout,
        client.lease_client().revoke(resp.id()),
    )
    .await
    {
        tracing::debug!(error = %e.source, "revoking the probe lease failed; it expires by itself");
    }
    let secs = u64::try_from(resp.ttl()).unwrap_or(0).max(1);
    Ok(Duration::from_secs(secs))
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
