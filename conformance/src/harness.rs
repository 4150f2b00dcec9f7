//! What a backend's test setup provides, and how tests find their servers.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use lock_core::raw::async_trait;
use lock_core::{DynLock, Lease, LockKey, Result};

/// A backend under test: hands out fresh, independent clients and the fault hooks the properties
/// need. Implemented once per driver in its `tests/conformance.rs`.
#[async_trait]
pub trait TestBackend: Send + Sync + 'static {
    /// A new, independent client with its own connection or session, as a separate service
    /// instance would have.
    async fn client(&self) -> Result<DynLock>;

    /// The shortest TTL whose expiry is reliable on a loaded machine (e.g. 300 ms for Redis,
    /// the etcd lease floor, the ZooKeeper session timeout). Expiry properties wait a few of
    /// these, so keep it small.
    fn short_ttl(&self) -> Duration;

    /// Makes the coordinator drop `lease` as if its TTL had run out, without going through the
    /// holder's client (Redis `DEL`, etcd lease revoke, ZooKeeper node delete, PostgreSQL
    /// `expires_at` in the past). After it returns, another client can acquire the key.
    async fn force_expire(&self, lease: &Lease) -> Result<()>;

    /// A client configured for a coordinator that cannot be reached (closed port), built without
    /// I/O, if the driver can (used to prove that bad input fails before any I/O).
    async fn unreachable_client(&self) -> Option<DynLock> {
        None
    }

    /// The holder process dies without releasing: drop the client without a graceful goodbye.
    /// Session-bound backends should make the coordinator see a dead client (not a clean close)
    /// where the client library allows it.
    async fn abandon(&self, client: DynLock) {
        drop(client);
    }

    /// Sets the coordinator's fence counter of `key` (which has been granted and released once)
    /// to `value`, so that the next grant's fencing token is the one after it: for boundary
    /// tests of the fence's range (2^53, `i64::MAX`). `None` when the backend's fences cannot
    /// be set (etcd revisions, ZooKeeper zxids, the in-memory reference); the property skips.
    async fn set_fence_counter(&self, key: &LockKey, value: u64) -> Option<Result<()>> {
        let _ = (key, value);
        None
    }
}

/// The handle every property receives.
#[derive(Clone)]
pub struct Harness {
    backend: Arc<dyn TestBackend>,
}

impl Harness {
    /// Wraps a backend.
    pub fn new(backend: impl TestBackend) -> Self {
        Self {
            backend: Arc::new(backend),
        }
    }

    /// A new independent client. Panics (fails the test) when the server cannot be reached.
    pub async fn client(&self) -> DynLock {
        match self.backend.client().await {
            Ok(client) => client,
            Err(e) => panic!("could not connect a test client: {e}"),
        }
    }

    /// `n` new independent clients.
    pub async fn clients(&self, n: usize) -> Vec<DynLock> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.client().await);
        }
        out
    }

    /// The backend's short TTL.
    pub fn short_ttl(&self) -> Duration {
        self.backend.short_ttl()
    }

    /// See [`TestBackend::force_expire`].
    pub async fn force_expire(&self, lease: &Lease) {
        if let Err(e) = self.backend.force_expire(lease).await {
            panic!("force_expire failed: {e}");
        }
    }

    /// See [`TestBackend::unreachable_client`].
    pub async fn unreachable_client(&self) -> Option<DynLock> {
        self.backend.unreachable_client().await
    }

    /// See [`TestBackend::abandon`].
    pub async fn abandon(&self, client: DynLock) {
        self.backend.abandon(client).await;
    }

    /// See [`TestBackend::set_fence_counter`]: `false` when the backend cannot set it.
    pub async fn set_fence_counter(&self, key: &LockKey, value: u64) -> bool {
        match self.backend.set_fence_counter(key, value).await {
            None => false,
            Some(Ok(())) => true,
            Some(Err(e)) => panic!("set_fence_counter({key}, {value}) failed: {e}"),
        }
    }

    /// A fresh random key, so tests can run in parallel against one server.
    pub fn key(&self, label: &str) -> LockKey {
        fresh_key(label)
    }
}

impl fmt::Debug for Harness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Harness")
            .field("short_ttl", &self.short_ttl())
            .finish_non_exhaustive()
    }
}

/// A key unique to this test run: `conformance/<label>/<random>`.
pub fn fresh_key(label: &str) -> LockKey {
    let suffix: u64 = rand::random();
    match LockKey::new(format!("conformance/{label}/{suffix:016x}")) {
        Ok(key) => key,
        Err(e) => panic!("bad test key label {label:?}: {e}"),
    }
}

/// `true` when `DISTLOCK_REQUIRE_BACKENDS=1`: a missing server is then a failure, not a skip.
pub fn backends_required() -> bool {
    std::env::var("DISTLOCK_REQUIRE_BACKENDS").is_ok_and(|v| v == "1" || v == "true")
}

/// The server URL in environment variable `var` (e.g. `DISTLOCK_TEST_REDIS_URL`).
///
/// Returns `None` (the caller skips, printing why) when it is unset, unless
/// [`backends_required`], in which case it panics so the test fails.
pub fn backend_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if backends_required() => {
            panic!(
                "{var} is not set but DISTLOCK_REQUIRE_BACKENDS=1: start the servers with scripts/backends.sh up"
            )
        }
        _ => {
            eprintln!("skipping: {var} is not set (run scripts/test.sh to start the servers)");
            None
        }
    }
}

/// Runs the future `make` returns on a current-thread runtime of its own, shut down as soon as
/// that future completes — like a process that exits right then: whatever it left to background
/// tasks is dropped unrun. For tests of what a client leaves behind when its process exits.
///
/// # Panics
/// When the future (or building the runtime) panics.
pub async fn run_then_exit<T, F>(make: impl FnOnce() -> F + Send + 'static) -> T
where
    F: std::future::Future<Output = T>,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime of its own");
        let value = runtime.block_on(make());
        drop(runtime);
        value
    })
    .await
    .expect("the future run on a runtime of its own panicked")
}

/// What a property concluded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every assertion held.
    Passed,
    /// The backend does not claim the capability the property checks.
    Skipped(&'static str),
}

fn runtime() -> tokio::runtime::Runtime {
    match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => panic!("cannot build a tokio runtime: {e}"),
    }
}

/// Runs `property` on a fresh multi-threaded runtime; `None` when `setup` found no server.
fn outcome_of<S, SF, P, PF>(setup: S, property: P) -> Option<Outcome>
where
    S: FnOnce() -> SF,
    SF: Future<Output = Option<Harness>>,
    P: FnOnce(Harness) -> PF,
    PF: Future<Output = Outcome>,
{
    runtime().block_on(async {
        let harness = setup().await?;
        Some(property(harness).await)
    })
}

/// Runs one property on a fresh multi-threaded runtime: a skip passes, printing why (for
/// properties declared skipped; the generated tests of every other property use
/// [`run_property_strict`]).
pub fn run_property<S, SF, P, PF>(name: &str, setup: S, property: P)
where
    S: FnOnce() -> SF,
    SF: Future<Output = Option<Harness>>,
    P: FnOnce(Harness) -> PF,
    PF: Future<Output = Outcome>,
{
    if let Some(Outcome::Skipped(why)) = outcome_of(setup, property) {
        eprintln!("{name}: skipped: {why}");
    }
}

/// Runs one property that is not declared skipped: a skip at runtime fails the test (it would
/// otherwise show as `ok`), telling how to declare it.
///
/// # Panics
/// When the property fails or skips.
pub fn run_property_strict<S, SF, P, PF>(name: &str, setup: S, property: P)
where
    S: FnOnce() -> SF,
    SF: Future<Output = Option<Harness>>,
    P: FnOnce(Harness) -> PF,
    PF: Future<Output = Outcome>,
{
    if let Some(Outcome::Skipped(why)) = outcome_of(setup, property) {
        panic!(
            "{name} skipped at runtime ({why}) but is not declared: add `{name}: \"{why}\"` to \
             `conformance_tests!(setup; skip: {{ .. }})` so it reports as ignored"
        );
    }
}

/// Runs a property declared skipped (an ignored test, run only with `--ignored`): a skip passes.
///
/// # Panics
/// When the property fails.
pub fn run_declared_skip<S, SF, P, PF>(name: &str, setup: S, property: P)
where
    S: FnOnce() -> SF,
    SF: Future<Output = Option<Harness>>,
    P: FnOnce(Harness) -> PF,
    PF: Future<Output = Outcome>,
{
    run_property(name, setup, property);
}

/// Checks a declared skip: the property must answer "skipped" (the backend lacks its
/// capability); one that runs means the declaration hides a property the backend claims.
///
/// # Panics
/// When the property runs (or fails).
pub fn check_declared_skip<S, SF, P, PF>(name: &str, setup: S, property: P)
where
    S: FnOnce() -> SF,
    SF: Future<Output = Option<Harness>>,
    P: FnOnce(Harness) -> PF,
    PF: Future<Output = Outcome>,
{
    if outcome_of(setup, property) == Some(Outcome::Passed) {
        panic!(
            "{name} is declared skipped, but the backend claims the capability it checks and it \
             ran: remove it from the skip list"
        );
    }
}
