//! The README's metrics claims, asserted on a recorder: `distlock_acquire_retries_total`,
//! `distlock_acquire_wait_seconds`, `distlock_renew_seconds` and `Observed::with_key_label`.
//!
//! One test in its own binary: the recorder is process-wide (Prometheus' exporter, installed
//! once, rendered as text), so nothing else may record into it meanwhile.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use distlock::{
    Capabilities, DynLock, Error, FencingToken, HolderInfo, InMemoryLock, Lease, LockKey,
    LossReason, Observed, Result,
    raw::{async_trait, poll_acquire},
};
use tokio::time::Instant;

/// The in-memory lock whose first `failures` attempts fail with a temporary error, and whose
/// `acquire` is the default polling one (which counts each retried failure).
#[derive(Debug)]
struct Flaky {
    inner: InMemoryLock,
    failures: AtomicUsize,
}

#[async_trait]
impl distlock::raw::Driver for Flaky {
    fn backend_name(&self) -> &'static str {
        "flaky"
    }

    fn capabilities(&self) -> Capabilities {
        distlock::DistributedLock::capabilities(&self.inner)
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        let left = self.failures.load(Ordering::SeqCst);
        if left > 0 {
            self.failures.store(left - 1, Ordering::SeqCst);
            return Err(Error::Unavailable {
                backend: "flaky",
                op: "acquire",
                message: "injected".into(),
                source: None,
            });
        }
        distlock::DistributedLock::try_acquire(&self.inner, key, ttl).await
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        poll_acquire(self, key, ttl, deadline).await
    }

    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        distlock::DistributedLock::renew(&self.inner, lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        distlock::DistributedLock::release(&self.inner, lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        distlock::DistributedLock::inspect(&self.inner, key).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        distlock::DistributedLock::force_release(&self.inner, key).await
    }

    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        distlock::DistributedLock::force_release_grant(&self.inner, key, holder).await
    }

    fn watch_lost(
        &self,
        lease: &Lease,
    ) -> std::pin::Pin<Box<dyn Future<Output = LossReason> + Send + 'static>> {
        distlock::DistributedLock::watch_lost(&self.inner, lease)
    }
}

/// The value of the rendered sample `name{labels}` (labels in the exporter's order), if any.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, "}"));
            if metric != name {
                return None;
            }
            let rest = rest.strip_suffix('}')?;
            let have: Vec<(&str, &str)> = rest
                .split(',')
                .filter(|p| !p.is_empty())
                .filter_map(|p| {
                    let (k, v) = p.split_once('=')?;
                    Some((k, v.trim_matches('"')))
                })
                .collect();
            let mut want = labels.to_vec();
            want.sort_unstable();
            let mut have = have;
            have.sort_unstable();
            (have == want).then(|| value.parse().ok())?
        })
}

/// Every rendered series of metric `name` (lines of text, without the value).
fn series<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' ').map(|(s, _)| s))
        .filter(|s| s.split('{').next() == Some(name))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_metrics_are_recorded_with_their_labels() {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("the only recorder of this test binary");
    let coordinator = InMemoryLock::new();
    const FAILURES: usize = 3;
    let flaky: DynLock = Arc::new(Observed::new(Arc::new(Flaky {
        inner: coordinator.client(),
        failures: AtomicUsize::new(FAILURES),
    })));
    let key = LockKey::new("metrics/retried").unwrap();
    let ttl = Duration::from_secs(10);

    // Three temporary failures, each retried by the default acquire, then the grant.
    let started = Instant::now();
    let mut lease = flaky
        .acquire(&key, ttl, Instant::now() + Duration::from_secs(20))
        .await
        .unwrap();
    let waited = started.elapsed().as_secs_f64();
    // Two renewals and the release.
    flaky.renew(&mut lease, ttl).await.unwrap();
    flaky.renew(&mut lease, ttl).await.unwrap();
    assert!(flaky.release(&lease).await.unwrap());

    // with_key_label: the key becomes a label of the same metrics; without it, never.
    let labelled: DynLock =
        Arc::new(Observed::new(Arc::new(coordinator.client())).with_key_label(true));
    let key2 = LockKey::new("metrics/labelled").unwrap();
    let l2 = labelled.try_acquire(&key2, ttl).await.unwrap().unwrap();
    assert!(labelled.release(&l2).await.unwrap());

    let text = handle.render();
    let retries = sample(
        &text,
        "distlock_acquire_retries_total",
        &[("outcome", "unavailable")],
    );
    assert_eq!(
        retries,
        Some(FAILURES as f64),
        "one retry per temporary failure:\n{text}"
    );
    let acquired = [
        ("backend", "flaky"),
        ("op", "acquire"),
        ("outcome", "acquired"),
    ];
    let count = sample(&text, "distlock_acquire_wait_seconds_count", &acquired);
    assert_eq!(count, Some(1.0), "one acquire wait recorded:\n{text}");
    let sum = sample(&text, "distlock_acquire_wait_seconds_sum", &acquired).unwrap();
    // The wait includes the three backoff delays: more than zero, at most what the test saw.
    assert!(
        sum > 0.0 && sum <= waited,
        "acquire_wait_seconds {sum} vs the {waited} s the test waited"
    );
    let renews = sample(
        &text,
        "distlock_renew_seconds_count",
        &[("backend", "flaky")],
    );
    assert_eq!(
        renews,
        Some(2.0),
        "one renew_seconds sample per renewal:\n{text}"
    );
    assert_eq!(
        sample(
            &text,
            "distlock_renew_total",
            &[("backend", "flaky"), ("outcome", "renewed")]
        ),
        Some(2.0),
        "{text}"
    );

    let with_key = [
        ("backend", "memory"),
        ("key", "metrics/labelled"),
        ("op", "try_acquire"),
        ("outcome", "acquired"),
    ];
    assert_eq!(
        sample(&text, "distlock_acquire_total", &with_key),
        Some(1.0),
        "with_key_label(true) labels the key:\n{text}"
    );
    assert_eq!(
        sample(
            &text,
            "distlock_release_total",
            &[
                ("backend", "memory"),
                ("key", "metrics/labelled"),
                ("outcome", "released")
            ]
        ),
        Some(1.0),
        "{text}"
    );
    for name in [
        "distlock_acquire_total",
        "distlock_acquire_wait_seconds_count",
        "distlock_renew_total",
        "distlock_renew_seconds_count",
        "distlock_release_total",
    ] {
        for s in series(&text, name) {
            if s.contains("backend=\"flaky\"") {
                assert!(
                    !s.contains("key="),
                    "a key label without with_key_label: {s}"
                );
            }
        }
    }
}
