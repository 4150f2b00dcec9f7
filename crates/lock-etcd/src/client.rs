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

pub(crate) use lock_core::raw::failure::{Failure, RequestFailure};

/// What this driver reads from a failed request beyond its [`Failure`] class
/// (`lock_core::raw::failure`).
pub(crate) trait Classified {
    /// As a `lock_core::raw::Error` for an operation whose outcome does not matter (reads,
    /// idempotent writes, a write whose unknown outcome is resolved by other means): the
    /// `Effect::Read` row of `lock_core::raw::failure` — unreachable or unanswered →
    /// `Unavailable`, refused → `Backend`.
    fn into_read_error(self, op: &'static str) -> Error;

    /// Whether the server refused the request in a way that retrying cannot change while this
    /// client lives: permission denied, credentials refused (a deleted user, a changed
    /// password), an invalid request. Not an expired token (refreshed: [`Failure::NotSent`]),
    /// not a stale auth revision, not a leader change.
    fn is_permanent(&self) -> bool;

    /// etcd's own class, decided before the shared one: the server says the lease does not
    /// exist (expired or revoked). A refusal ([`Failure::Refused`]) that the callers tell apart.
    fn lease_not_found(&self) -> bool;
}

impl Classified for RequestFailure {
    fn into_read_error(self, op: &'static str) -> Error {
        match self.failure {
            Failure::NotSent | Failure::Unknown => Error::unavailable(BACKEND, op, self.source),
            _ => Error::backend(BACKEND, op, self.source),
        }
    }

    fn is_permanent(&self) -> bool {
        use tonic::Code;
        if self.failure != Failure::Refused || self.lease_not_found() {
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

    fn lease_not_found(&self) -> bool {
        self.failure == Failure::Refused
            && self
                .source
                .downcast_ref::<etcd_client::Error>()
                .is_some_and(is_lease_not_found)
    }
}

/// The server says the lease does not exist (expired or revoked): a refusal of etcd's own.
fn is_lease_not_found(e: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    match e {
        E::GRpcStatus(status) => {
            status.code() == tonic::Code::NotFound && status.message().contains("lease not found")
        }
        E::LeaseKeepAliveError(m) => m.contains("lease not found"),
        _ => false,
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

/// A status the client's transport made up (the connection failed), not the server's answer.
fn is_transport_failure(message: &str) -> bool {
    [
        "h2 protocol error",
        "http2 error",
        "transport error",
        "connection reset",
    ]
    .iter()
    .any(|needle| message.contains(needle))
}

/// What a failed etcd-client request may have applied.
pub(crate) fn classify(e: &etcd_client::Error) -> Failure {
    use etcd_client::Error as E;
    use tonic::Code;
    if is_lease_not_found(e) {
        return Failure::Refused;
    }
    match e {
        E::TransportError(_) | E::IoError(_) | E::InvalidUri(_) | E::EndpointError(_) => {
            Failure::NotSent
        }
        E::GRpcStatus(status) => {
            let full = format!("{} {:?}", status.message(), status);
            match status.code() {
                Code::Unavailable if is_connect_failure(&full) => Failure::NotSent,
                // An expired token: refused before anything was applied, and the client
                // re-authenticates (auto token refresh), so it is temporary (review L5).
                Code::Unauthenticated | Code::Unknown
                    if status.message().contains("invalid auth token") =>
                {
                    Failure::NotSent
                }
                // etcd's own back-pressure (its applied index lags the committed one): refused
                // before anything is applied.
                Code::ResourceExhausted if status.message().contains("too many requests") => {
                    Failure::NotSent
                }
                Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Cancelled
                | Code::Unknown
                | Code::Internal
                | Code::Aborted => Failure::Unknown,
                // The HTTP/2 connection failed under the request (e.g. h2's GOAWAY
                // ENHANCE_YOUR_CALM "too_many_internal_resets", which tonic reports as
                // ResourceExhausted): not a refusal, the outcome is unknown; the channel
                // reconnects.
                _ if is_transport_failure(&full) => Failure::Unknown,
                _ => Failure::Refused,
            }
        }
        E::LeaseKeepAliveError(_) | E::WatchError(_) => Failure::Unknown,
        _ => Failure::Refused,
    }
}

/// Runs one request with the configured timeout, classifying failures.
pub(crate) async fn request<T>(
    timeout: Duration,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, RequestFailure> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(RequestFailure {
            failure: classify(&e),
            source: Box::new(e),
        }),
        Err(_) => Err(RequestFailure::unknown(format!(
            "no reply within the request timeout of {timeout:?}"
        ))),
    }
}

/// Runs one request with at most what is left until `until` (and never more than `timeout`):
/// `lock_core::raw::within`. Past `until` the request is not sent at all
/// ([`Failure::NotSent`]).
pub(crate) async fn request_until<T>(
    timeout: Duration,
    until: tokio::time::Instant,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, RequestFailure> {
    lock_core::raw::within(timeout, until, classify, fut).await
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
        .with_connect_timeout(config.connect_timeout)
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
        // A member that has lost its leader refuses at once instead of serving stale
        // watches or stalling requests (review L4).
        .with_require_leader(true);
    if let Some(user) = &config.user {
        // Re-authenticates when the token expired (etcd's simple tokens live 5 min by
        // default), instead of failing every later request for good (review L5).
        options = options
            .with_user(user.clone(), config.password_text())
            .with_auto_token_refresh(true);
    }
    let scheme = if let Some(tls) = &config.tls {
        options = options.with_tls(tls_options(tls)?);
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
        config.connect_timeout.saturating_add(config.timeout),
        Client::connect(endpoints, Some(options)),
    )
    .await
    .map_err(|e| {
        // A certificate the server or we refused is a configuration to fix, as on every
        // backend (the CLI's 78), not an outage to wait out.
        if rejected_certificate(&*e.source) {
            Error::backend(BACKEND, "connect", e.source)
        } else {
            e.into_read_error("connect")
        }
    })
}

/// How many requests one [`EtcdLock`](crate::EtcdLock) client has sent to etcd, by kind (for measuring overhead).
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

/// The TLS settings of `tls`: the CA, the client identity and the server name to verify. The
/// driver's connection and the audit's per-member probes both use it.
pub(crate) fn tls_options(tls: &crate::EtcdTlsConfig) -> Result<TlsOptions> {
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
    Ok(t)
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
    let resp = request(config.timeout, client.lease_client().grant(1, None))
        .await
        .map_err(|e| e.into_read_error("connect"))?;
    Counters::bump(&counters.lease_revoke);
    if let Err(e) = request(config.timeout, client.lease_client().revoke(resp.id())).await {
        tracing::debug!(error = %e.source, "revoking the probe lease failed; it expires by itself");
    }
    let secs = u64::try_from(resp.ttl()).unwrap_or(0).max(1);
    Ok(Duration::from_secs(secs))
}

/// Whether `e` is a TLS certificate refused in the handshake (by us or by the server), through
/// any chain of sources or in tonic's flattened message.
fn rejected_certificate(e: &(dyn std::error::Error + 'static)) -> bool {
    // By text: tonic flattens rustls's error into its status message, so no typed source
    // survives to downcast (lock-core's typed check needs its `rustls` feature and a source).
    const REJECTED: [&str; 4] = [
        "invalid peer certificate",
        "received fatal alert: BadCertificate",
        "received fatal alert: UnknownCA",
        "received fatal alert: CertificateRequired",
    ];
    let mut next = Some(e);
    while let Some(e) = next {
        let text = e.to_string();
        if REJECTED.iter().any(|needle| text.contains(needle)) {
            return true;
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: tonic::Code, message: &str) -> RequestFailure {
        let e = etcd_client::Error::GRpcStatus(tonic::Status::new(code, message));
        RequestFailure {
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
        let timeout = RequestFailure::unknown("no reply");
        assert!(!timeout.is_permanent());
        // Back-pressure is refused before anything applies; a failed connection's status is no
        // refusal at all (seen at 100,000 locks: the h2 client's GOAWAY after many timed-out
        // requests, reported as ResourceExhausted).
        let busy = status(Code::ResourceExhausted, "etcdserver: too many requests");
        assert_eq!(busy.failure, Failure::NotSent);
        let goaway = status(Code::ResourceExhausted, "h2 protocol error: http2 error");
        assert_eq!(goaway.failure, Failure::Unknown);
        assert_eq!(
            status(
                Code::ResourceExhausted,
                "grpc: received message larger than max"
            )
            .failure,
            Failure::Refused
        );
        // etcd's own class: a refusal, never permanent, told apart by `lease_not_found`.
        let gone = status(Code::NotFound, "etcdserver: requested lease not found");
        assert_eq!(gone.failure, Failure::Refused);
        assert!(gone.lease_not_found() && !gone.is_permanent());
        let gone = etcd_client::Error::LeaseKeepAliveError("lease not found".into());
        assert_eq!(classify(&gone), Failure::Refused);
        assert!(is_lease_not_found(&gone));
        let closed = etcd_client::Error::LeaseKeepAliveError("keepalive stream closed".into());
        assert_eq!(classify(&closed), Failure::Unknown);
        assert!(!status(Code::Unknown, "lease not found").lease_not_found());
        assert!(!timeout.lease_not_found());
    }
}
