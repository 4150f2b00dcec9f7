//! Metrics and tracing, written once as a wrapper around any backend.
//!
//! [`Observed`] implements [`crate::DistributedLock`] (as a [`crate::raw::Driver`]) around an inner lock and records, through the
//! [`metrics`] facade (a no-op until the application installs a recorder such as a Prometheus
//! exporter) and [`tracing`] spans:
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `distlock_acquire_total` | counter | `backend`, `op` (`try_acquire`/`acquire`), `outcome` (`acquired`, `busy`, or an error kind) |
//! | `distlock_acquire_wait_seconds` | histogram | `backend`, `op`, `outcome` |
//! | `distlock_hold_seconds` | histogram | `backend` (from grant to release) |
//! | `distlock_renew_total` | counter | `backend`, `outcome` (`renewed` or an error kind) |
//! | `distlock_renew_seconds` | histogram | `backend` |
//! | `distlock_group_renew_total` | counter | `backend`, `outcome` — a [renewal group](crate::raw::RenewalGroup)'s renewal, which renews every guard of the group at once (their renewals are not counted one by one in `distlock_renew_total`) |
//! | `distlock_group_renew_seconds` | histogram | `backend` |
//! | `distlock_release_total` | counter | `backend`, `outcome` (`released`, `already_lost`, or an error kind) |
//! | `distlock_force_release_total` | counter | `backend`, `outcome` |
//! | `distlock_lost_total` | counter | `backend`, `reason` (recorded by [`crate::LockGuard`]) |
//! | `distlock_acquire_retries_total` | counter | `outcome` (error kind; recorded by [`crate::raw::AcquireWait`]) |
//! | `distlock_fencing_rejections_total` | counter | `resource` (recorded by the fenced-write helpers) |
//!
//! Keys are not metric labels unless [`Observed::with_key_label`] asks for it (unbounded
//! cardinality). Spans carry the key, the token *digest*, the fencing token, the TTL and the
//! elapsed time; the full ownership token never appears.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use futures::future::BoxFuture;
use tokio::time::Instant;
use tracing::{Instrument, field};

use crate::{
    Capabilities, DynLock, Error, FencingToken, HolderInfo, Lease, LockKey, LossReason, Result,
};

/// Wraps any lock with metrics and tracing. Cheap: a few atomic updates per operation.
pub struct Observed {
    inner: DynLock,
    key_label: bool,
}

impl Observed {
    /// Observes `inner`.
    pub fn new(inner: DynLock) -> Self {
        Self {
            inner,
            key_label: false,
        }
    }

    /// Also label metrics with the lock key (only for a small, fixed set of keys).
    pub fn with_key_label(mut self, yes: bool) -> Self {
        self.key_label = yes;
        self
    }

    /// The wrapped lock.
    pub fn inner(&self) -> &DynLock {
        &self.inner
    }

    fn labels(&self, key: &LockKey, rest: &[(&'static str, String)]) -> Vec<metrics::Label> {
        let mut labels = vec![metrics::Label::new("backend", self.inner.backend_name())];
        if self.key_label {
            labels.push(metrics::Label::new("key", key.as_str().to_owned()));
        }
        labels.extend(rest.iter().map(|(k, v)| metrics::Label::new(*k, v.clone())));
        labels
    }

    fn record_acquire(&self, key: &LockKey, op: &'static str, outcome: &str, started: Instant) {
        let labels = self.labels(
            key,
            &[("op", op.to_owned()), ("outcome", outcome.to_owned())],
        );
        metrics::counter!("distlock_acquire_total", labels.clone()).increment(1);
        metrics::histogram!("distlock_acquire_wait_seconds", labels)
            .record(started.elapsed().as_secs_f64());
    }

    /// Logs and counts an operator force release.
    fn record_force_release(
        &self,
        key: &LockKey,
        span: &tracing::Span,
        result: Result<bool>,
    ) -> Result<bool> {
        let outcome = match &result {
            Ok(true) => "removed",
            Ok(false) => "not_held",
            Err(e) => e.kind(),
        };
        span.in_scope(|| tracing::warn!(outcome, "operator force_release"));
        metrics::counter!(
            "distlock_force_release_total",
            self.labels(key, &[("outcome", outcome.to_owned())])
        )
        .increment(1);
        result
    }
}

fn record_grant(span: &tracing::Span, lease: &Lease) {
    span.record("token", field::display(lease.token().digest()));
    if let Some(f) = lease.fencing_token() {
        span.record("fencing", f.0);
    }
}

fn elapsed(span: &tracing::Span, started: Instant) {
    span.record("elapsed", field::debug(started.elapsed()));
}

#[async_trait]
impl crate::raw::Driver for Observed {
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        let span = tracing::debug_span!("distlock.try_acquire", backend = self.inner.backend_name(), %key, ?ttl,
            token = field::Empty, fencing = field::Empty, elapsed = field::Empty);
        let started = Instant::now();
        let result = self
            .inner
            .try_acquire(key, ttl)
            .instrument(span.clone())
            .await;
        elapsed(&span, started);
        let outcome = match &result {
            Ok(Some(lease)) => {
                record_grant(&span, lease);
                "acquired"
            }
            Ok(None) => "busy",
            Err(e) => e.kind(),
        };
        span.in_scope(|| tracing::debug!(outcome, "try_acquire"));
        self.record_acquire(key, "try_acquire", outcome, started);
        result
    }

    /// The inner lock's `acquire` makes the attempt a short deadline allows: counted as part
    /// of the `acquire`, not as a `try_acquire`.
    fn acquire_tries_first(&self) -> bool {
        true
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        let span = tracing::debug_span!("distlock.acquire", backend = self.inner.backend_name(), %key, ?ttl,
            token = field::Empty, fencing = field::Empty, elapsed = field::Empty);
        let started = Instant::now();
        let result = self
            .inner
            .acquire(key, ttl, deadline)
            .instrument(span.clone())
            .await;
        elapsed(&span, started);
        let outcome = match &result {
            Ok(lease) => {
                record_grant(&span, lease);
                "acquired"
            }
            Err(e) => e.kind(),
        };
        span.in_scope(|| tracing::debug!(outcome, "acquire"));
        self.record_acquire(key, "acquire", outcome, started);
        result
    }

    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        let span = tracing::trace_span!("distlock.renew", backend = self.inner.backend_name(), key = %lease.key(),
            token = %lease.token().digest(), fencing = lease.fencing_token().map(|f| f.0), ?ttl, elapsed = field::Empty);
        let started = Instant::now();
        let result = self.inner.renew(lease, ttl).instrument(span.clone()).await;
        elapsed(&span, started);
        let outcome = match &result {
            Ok(()) => "renewed",
            Err(e) => e.kind(),
        };
        span.in_scope(|| tracing::trace!(outcome, "renew"));
        let labels = self.labels(lease.key(), &[("outcome", outcome.to_owned())]);
        metrics::counter!("distlock_renew_total", labels).increment(1);
        metrics::histogram!("distlock_renew_seconds", self.labels(lease.key(), &[]))
            .record(started.elapsed().as_secs_f64());
        result
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let span = tracing::debug_span!("distlock.release", backend = self.inner.backend_name(), key = %lease.key(),
            token = %lease.token().digest(), fencing = lease.fencing_token().map(|f| f.0), elapsed = field::Empty);
        let started = Instant::now();
        let result = self.inner.release(lease).instrument(span.clone()).await;
        elapsed(&span, started);
        let outcome = match &result {
            Ok(true) => "released",
            Ok(false) => "already_lost",
            Err(e) => e.kind(),
        };
        span.in_scope(|| tracing::debug!(outcome, "release"));
        metrics::counter!(
            "distlock_release_total",
            self.labels(lease.key(), &[("outcome", outcome.to_owned())])
        )
        .increment(1);
        if matches!(result, Ok(true)) {
            metrics::histogram!("distlock_hold_seconds", self.labels(lease.key(), &[]))
                .record(lease.acquired_at().elapsed().as_secs_f64());
        }
        result
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let span =
            tracing::trace_span!("distlock.inspect", backend = self.inner.backend_name(), %key);
        self.inner.inspect(key).instrument(span).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let span = tracing::info_span!("distlock.force_release", backend = self.inner.backend_name(), %key);
        let result = self.inner.force_release(key).instrument(span.clone()).await;
        self.record_force_release(key, &span, result)
    }

    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        let span = tracing::info_span!(
            "distlock.force_release",
            backend = self.inner.backend_name(),
            %key,
            fencing = holder.get()
        );
        let result = self
            .inner
            .force_release_grant(key, holder)
            .instrument(span.clone())
            .await;
        self.record_force_release(key, &span, result)
    }

    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        self.inner.watch_lost(lease)
    }

    fn renewal_group(&self, lease: &Lease) -> Option<crate::raw::SharedGroup> {
        let group = self.inner.renewal_group(lease)?;
        Some(Arc::new(ObservedGroup {
            inner: group,
            backend: self.inner.backend_name(),
        }))
    }

    async fn hold_at_least(&self, lease: &Lease, at_least: Duration) -> Result<()> {
        let span = tracing::debug_span!("distlock.hold_at_least", backend = self.inner.backend_name(), key = %lease.key(), ?at_least);
        self.inner
            .hold_at_least(lease, at_least)
            .instrument(span)
            .await
    }

    async fn keep(&self, lease: &mut Lease, left: Duration) -> Result<bool> {
        let span = tracing::debug_span!("distlock.keep", backend = self.inner.backend_name(), key = %lease.key(), ?left);
        self.inner.keep(lease, left).instrument(span).await
    }

    async fn relabel(&self, lease: &Lease, holder: &crate::HolderIdentity) -> Result<()> {
        let span = tracing::debug_span!("distlock.relabel", backend = self.inner.backend_name(), key = %lease.key());
        self.inner.relabel(lease, holder).instrument(span).await
    }

    fn watch_holder(&self, key: &LockKey) -> Option<futures::stream::BoxStream<'static, ()>> {
        self.inner.watch_holder(key)
    }
}

/// A renewal group's renewals, counted as [`Observed`] counts a lease's.
#[derive(Debug)]
struct ObservedGroup {
    inner: crate::raw::SharedGroup,
    backend: &'static str,
}

impl crate::raw::RenewalGroup for ObservedGroup {
    fn id(&self) -> usize {
        self.inner.id()
    }

    fn join(&self, lease: &Lease, lost: &crate::raw::LostSink) -> bool {
        self.inner.join(lease, lost)
    }

    fn leave(&self, lease: &Lease) {
        self.inner.leave(lease);
    }

    fn leave_lost(&self, lease: &Lease) {
        self.inner.leave_lost(lease);
    }

    fn renew(
        &self,
        ttl: Duration,
        until: Instant,
    ) -> BoxFuture<'static, std::result::Result<Instant, crate::raw::GroupRenewError>> {
        let renewal = self.inner.renew(ttl, until);
        let backend = self.backend;
        Box::pin(async move {
            let started = Instant::now();
            let result = renewal.await;
            let outcome = match &result {
                Ok(_) => "renewed",
                Err(crate::raw::GroupRenewError::Lost(_)) => "not_held",
                Err(crate::raw::GroupRenewError::Failed(e)) => e.kind(),
            };
            metrics::counter!("distlock_group_renew_total", "backend" => backend, "outcome" => outcome)
                .increment(1);
            metrics::histogram!("distlock_group_renew_seconds", "backend" => backend)
                .record(started.elapsed().as_secs_f64());
            result
        })
    }
}

impl fmt::Debug for Observed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Observed")
            .field("inner", &self.inner)
            .finish()
    }
}

/// Counts a loss detected by a guard.
pub(crate) fn record_loss(backend: &'static str, reason: LossReason) {
    metrics::counter!("distlock_lost_total", "backend" => backend, "reason" => loss_label(reason))
        .increment(1);
}

/// Counts a retried acquire attempt.
pub(crate) fn record_retry(err: &Error) {
    metrics::counter!("distlock_acquire_retries_total", "outcome" => err.kind()).increment(1);
}

/// Counts a write rejected by a fenced resource because its fencing token was stale. Called by
/// [`crate::FencedRegister`] and by the drivers' resource-side helpers.
pub fn record_fencing_rejection(resource: &'static str) {
    metrics::counter!("distlock_fencing_rejections_total", "resource" => resource).increment(1);
}

fn loss_label(reason: LossReason) -> &'static str {
    match reason {
        LossReason::NotHeld => "not_held",
        LossReason::DeadlinePassed => "deadline_passed",
        LossReason::Revoked => "revoked",
        LossReason::SessionExpired => "session_expired",
        LossReason::RenewFailed => "renew_failed",
        LossReason::HeldTooLong => "held_too_long",
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io,
        sync::{Arc, Mutex},
    };

    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;
    use crate::{DistributedLockExt, FencedRegister, InMemoryLock};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Runs a lifecycle with a loss, a force-release, a stale write and errors, capturing TRACE
    /// logs and metrics; returns (logs, counters, tokens used).
    fn lifecycle() -> (String, Vec<(String, u64)>, Vec<String>) {
        let logs = Captured::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || writer.clone())
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .finish();
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let mut tokens = Vec::new();
        metrics::with_local_recorder(&recorder, || {
            tracing::subscriber::with_default(subscriber, || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    let coordinator = InMemoryLock::new();
                    let a: DynLock = Arc::new(Observed::new(Arc::new(coordinator.client())));
                    let b: DynLock = Arc::new(Observed::new(Arc::new(coordinator.client())));
                    let key = LockKey::new("observed").unwrap();
                    let ttl = Duration::from_millis(300);
                    let mut lease = a.try_acquire(&key, ttl).await.unwrap().unwrap();
                    tokens.push(lease.token().expose_hex());
                    assert!(b.try_acquire(&key, ttl).await.unwrap().is_none());
                    a.renew(&mut lease, ttl).await.unwrap();
                    tracing::info!(?lease, "debug output of a lease");
                    assert!(a.release(&lease).await.unwrap());
                    assert!(a.renew(&mut lease, ttl).await.is_err());

                    let guard = a.lock(&key).ttl(ttl).try_acquire().await.unwrap().unwrap();
                    tokens.push(guard.granted_lease().token().expose_hex());
                    tracing::info!(?guard, "debug output of a guard");
                    coordinator.force_expire(&key);
                    let taken = b.try_acquire(&key, ttl).await.unwrap().unwrap();
                    tokens.push(taken.token().expose_hex());
                    guard.lost().await;
                    let register = FencedRegister::new();
                    register.write(taken.fencing_token().unwrap(), ()).unwrap();
                    assert!(register.write(guard.fencing_token().unwrap(), ()).is_err());
                    assert!(!guard.release().await.unwrap());
                    assert!(b.force_release(&key).await.unwrap());
                    let wait = b
                        .lock(&key)
                        .ttl(ttl)
                        .wait(Duration::from_millis(50))
                        .acquire()
                        .await
                        .unwrap();
                    tokens.push(wait.granted_lease().token().expose_hex());
                    let blocked = a
                        .acquire(&key, ttl, Instant::now() + Duration::from_millis(50))
                        .await;
                    tracing::warn!(error = ?blocked.unwrap_err(), "debug output of an error");
                    wait.release().await.unwrap();
                });
            });
        });
        let counters = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(key, _, _, value)| match value {
                DebugValue::Counter(n) => {
                    let (kind, key) = key.into_parts();
                    let _ = kind;
                    let mut name = key.name().to_owned();
                    let mut labels: Vec<String> = key
                        .labels()
                        .map(|l| format!("{}={}", l.key(), l.value()))
                        .collect();
                    labels.sort();
                    name.push_str(&format!("{{{}}}", labels.join(",")));
                    Some((name, n))
                }
                _ => None,
            })
            .collect();
        let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        (logs, counters, tokens)
    }

    #[test]
    fn full_tokens_never_reach_trace_logs() {
        let (logs, _, tokens) = lifecycle();
        assert!(
            logs.contains("distlock.try_acquire"),
            "spans were not captured:\n{logs}"
        );
        assert!(
            logs.contains("lock ownership lost"),
            "the loss was not logged:\n{logs}"
        );
        for token in &tokens {
            assert!(
                !logs.contains(token.as_str()),
                "a full token leaked into the logs"
            );
            assert!(
                !logs.contains(&token[..12]),
                "a token prefix leaked into the logs"
            );
        }
    }

    /// A granted attempt's span carries what was granted (the token's digest, the fence), and
    /// spans their duration: what an operator finds a grant's log lines by.
    #[test]
    fn a_grants_span_records_its_token_digest_fence_and_duration() {
        let (logs, _, tokens) = lifecycle();
        let digest = crate::OwnershipToken::from_hex(&tokens[0])
            .unwrap()
            .digest()
            .to_string();
        let granted = logs
            .lines()
            .find(|l| l.contains("distlock.try_acquire{") && l.contains("outcome=\"acquired\""))
            .unwrap_or_else(|| panic!("no granted try_acquire was logged:\n{logs}"));
        assert!(
            granted.contains(&format!("token={digest} fencing=1}}")),
            "{granted}"
        );
        assert!(granted.contains(" elapsed="), "{granted}");
    }

    #[test]
    fn metrics_count_outcomes() {
        let (_, counters, _) = lifecycle();
        let get = |name: &str| {
            counters
                .iter()
                .filter(|(k, _)| k == name)
                .map(|(_, n)| *n)
                .sum::<u64>()
        };
        assert_eq!(
            get("distlock_acquire_total{backend=memory,op=try_acquire,outcome=acquired}"),
            3
        );
        assert_eq!(
            get("distlock_acquire_total{backend=memory,op=try_acquire,outcome=busy}"),
            1
        );
        assert_eq!(
            get("distlock_acquire_total{backend=memory,op=acquire,outcome=timeout}"),
            1
        );
        assert_eq!(
            get("distlock_renew_total{backend=memory,outcome=not_held}"),
            1
        );
        assert!(get("distlock_renew_total{backend=memory,outcome=renewed}") >= 1);
        assert_eq!(
            get("distlock_release_total{backend=memory,outcome=already_lost}"),
            1
        );
        assert_eq!(
            get("distlock_lost_total{backend=memory,reason=revoked}")
                + get("distlock_lost_total{backend=memory,reason=not_held}"),
            1
        );
        assert_eq!(
            get("distlock_fencing_rejections_total{resource=fenced_register}"),
            1
        );
        assert_eq!(
            get("distlock_force_release_total{backend=memory,outcome=removed}"),
            1
        );
    }
}
