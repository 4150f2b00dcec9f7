//! Shared by the per-backend drills (`drill_backends.rs`, `drill_restart.rs`, `drill_cluster.rs`):
//! which servers to use, an in-process client's recorded operations, a holder process whose
//! events are pumped into the history, a fenced log resource, and the final check.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use conformance::drill::Hold;
use conformance::drill::{
    CheckOptions, ClientRecorder, History, HolderEvent, HolderProcess, PendingOp, ResourceKind,
    Rule, Violation, check, holder::HolderOptions,
};
use conformance::servers::ServerKind;
use lock_core::{
    DistributedLockExt, DynLock, Error, FencingToken, HolderInfo, LockGuard, LockKey, TokenDigest,
};
use tokio::{sync::watch, task::JoinHandle, time::Instant};

/// The bound on anything that must happen (process start, failover, a loaded 2-core machine).
pub const SOON: Duration = Duration::from_secs(20);
/// Every drill's lease TTL: the smallest every backend here honours (etcd's 1 s lease with the
/// test servers' 500 ms election timeout; ZooKeeper's 1 s session).
pub const TTL: Duration = Duration::from_secs(1);
/// The fenced resource every drill writes to.
pub const RESOURCE: &str = "log";
/// The holder binary (built with this package's `drivers` feature by `--all-features`).
pub const HOLDER_BIN: &str = env!("CARGO_BIN_EXE_distlock-drill-holder");

/// The coordinators.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Redis,
    Etcd,
    Zk,
    Pg,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Redis => "redis",
            Backend::Etcd => "etcd",
            Backend::Zk => "zk",
            Backend::Pg => "pg",
        }
    }

    fn env_var(self) -> &'static str {
        match self {
            Backend::Redis => "DISTLOCK_TEST_REDIS_URL",
            Backend::Etcd => "DISTLOCK_TEST_ETCD_URL",
            Backend::Zk => "DISTLOCK_TEST_ZK_URL",
            Backend::Pg => "DISTLOCK_TEST_PG_URL",
        }
    }

    /// Short client-side timeouts, so a lost reply becomes an error within a drill's budget.
    pub fn options(self) -> &'static str {
        match self {
            Backend::Redis => "timeout=500ms&connect_timeout=500ms",
            Backend::Etcd => "timeout=500ms&connect_timeout=1s",
            Backend::Zk => "session_timeout=1s&timeout=500ms&connect_timeout=1s",
            Backend::Pg => "timeout=500ms&connect_timeout=1s",
        }
    }

    /// The shared single-node server's URL with [`Backend::options`], or `None` (skip; fails
    /// under `DISTLOCK_REQUIRE_BACKENDS=1`).
    pub fn shared_url(self) -> Option<String> {
        let url = conformance::backend_url(self.env_var())?;
        if !cfg!(feature = "drivers") {
            panic!(
                "the drills need the holder binary built with the `drivers` feature: \
                 cargo test -p distlock-conformance --features drivers"
            );
        }
        Some(with_query(&url, self.options()))
    }
}

/// `url` with `query` appended to its query string.
pub fn with_query(url: &str, query: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{query}")
}

/// Runs a drill on its own two-worker runtime (every drill test is a plain `#[test]`).
pub fn block_on<F: std::future::Future>(drill: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(drill)
}

/// Says why a drill does not run on a backend (visible with `--nocapture` and in the test log).
pub fn skip(drill: &str, backend: Backend, why: &str) {
    println!("SKIP {drill} on {}: {why}", backend.name());
    eprintln!("SKIP {drill} on {}: {why}", backend.name());
}

pub async fn client(url: &str) -> DynLock {
    tokio::time::timeout(SOON, distlock::connect(url))
        .await
        .expect("connect timed out")
        .expect("connect")
}

/// (the newest accepted fencing token and its owner, every accepted value)
type LogState = (Option<(u64, String)>, Vec<String>);

/// An append-only log that checks fencing: a write is accepted iff its fencing token is newer
/// than every accepted one, or equal to the newest with the same owner (that holder writing
/// again).
///
/// Every accepted write is appended to a file before it is acknowledged, and the drill's final
/// state is read back from that file ([`FencedLog::read_back`]), not from the in-process state
/// that acknowledged the writes: an acknowledgement whose write did not reach the store shows as
/// [`Rule::AcknowledgedWriteLost`].
#[derive(Debug)]
pub struct FencedLog {
    state: Mutex<LogState>,
    path: std::path::PathBuf,
}

impl FencedLog {
    pub fn new() -> Arc<Self> {
        let dir = conformance::drill::history::histories_dir().join("resources");
        std::fs::create_dir_all(&dir).expect("create the fenced logs' directory");
        let path = dir.join(format!("log-{:016x}.jsonl", rand::random::<u64>()));
        std::fs::File::create(&path).expect("create the fenced log's file");
        Arc::new(Self {
            state: Mutex::default(),
            path,
        })
    }

    /// `Err(highest)` when stale. Panics when the accepted write cannot be stored.
    pub fn write(&self, fencing: u64, owner: &str, value: String) -> Result<(), u64> {
        use std::io::Write as _;
        let mut state = self.state.lock().unwrap();
        if let Some((highest, who)) = &state.0
            && (fencing < *highest || (fencing == *highest && who != owner))
        {
            return Err(*highest);
        }
        let mut line = serde_json::to_string(&value).expect("a string serialises");
        line.push('\n');
        std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .and_then(|mut file| file.write_all(line.as_bytes()))
            .expect("append the accepted write to the log's file");
        state.0 = Some((fencing, owner.to_owned()));
        state.1.push(value);
        Ok(())
    }

    /// The accepted values as the process acknowledged them.
    pub fn values(&self) -> Vec<String> {
        self.state.lock().unwrap().1.clone()
    }

    /// The accepted values as stored, read back from the log's file.
    pub fn read_back(&self) -> Vec<String> {
        let text = std::fs::read_to_string(&self.path).expect("read the log's file back");
        text.lines()
            .map(|line| serde_json::from_str(line).expect("a stored value"))
            .collect()
    }

    /// The newest accepted fencing token.
    pub fn highest(&self) -> Option<u64> {
        self.state.lock().unwrap().0.as_ref().map(|(h, _)| *h)
    }
}

impl Drop for FencedLog {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Writes `value` to `log` with `hold`'s tokens, recorded; `true` when accepted.
pub fn write(rec: &ClientRecorder, hold: &Hold, log: &FencedLog, value: &str) -> bool {
    let op = rec.write(hold.clone(), RESOURCE, value);
    let fencing = hold.fencing.map_or(0, FencingToken::get);
    match log.write(fencing, &hold.token.to_string(), value.to_owned()) {
        Ok(()) => {
            op.ok();
            true
        }
        Err(highest) => {
            op.rejected(Some(FencingToken(highest)));
            false
        }
    }
}

/// An in-process client: a lock client and its recorder.
#[derive(Clone)]
pub struct Client {
    pub rec: ClientRecorder,
    pub lock: DynLock,
}

/// A guard and the task recording its loss.
pub struct Held {
    pub guard: LockGuard,
    pub hold: Hold,
    rec: ClientRecorder,
    loss: JoinHandle<()>,
    lost_at: Arc<Mutex<Option<Instant>>>,
}

impl Held {
    /// Records the guard's renewals so far and the local deadline they gave (the checker
    /// extends the grant's definite lease to it). Called by `release` and `wait_lost`; call it
    /// too wherever a drill wants a renewal on record before something happens.
    pub fn note_renewals(&self) {
        self.rec.guard_renewed(&self.guard);
    }

    /// When the guard's `lost()` fired, if it did.
    pub fn lost_at(&self) -> Option<Instant> {
        *self.lost_at.lock().unwrap()
    }

    /// Waits (up to `timeout`) for the loss to be recorded.
    pub async fn wait_lost(&self, timeout: Duration) -> Option<Instant> {
        let deadline = Instant::now() + timeout;
        tokio::time::timeout_at(deadline, self.guard.lost())
            .await
            .ok()?;
        // The renewals the guard made before its loss (its deadline no longer moves).
        self.note_renewals();
        // The recorder task runs right after the token is cancelled.
        while self.lost_at().is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.lost_at()
    }
}

impl Client {
    pub async fn new(history: &History, id: &str, url: &str) -> Self {
        Self {
            rec: history.client(id),
            lock: client(url).await,
        }
    }

    /// Records the invoke now and returns a future doing the acquisition (`wait` up to
    /// `wait`), so a drill can spawn it after the invoke is in the history.
    pub fn start_acquire(
        &self,
        key: &LockKey,
        wait: Duration,
    ) -> impl Future<Output = Option<Held>> + Send + 'static {
        let op = self.rec.acquire(key, TTL);
        let (rec, lock, key) = (self.rec.clone(), self.lock.clone(), key.clone());
        async move { finish_acquire(op, &rec, &lock, &key, wait).await }
    }

    pub async fn acquire(&self, key: &LockKey, wait: Duration) -> Option<Held> {
        self.start_acquire(key, wait).await
    }

    /// Releases `held` (recorded); returns what the release returned.
    pub async fn release(&self, held: Held) -> Option<bool> {
        held.note_renewals();
        let Held {
            guard, hold, loss, ..
        } = held;
        let op = self.rec.release(hold);
        loss.abort();
        // Why the guard gave the lease up, if it did (a release answering `false` is then
        // explained in the test's output).
        let reason = guard.loss_reason();
        match tokio::time::timeout(SOON, guard.release()).await {
            Ok(Ok(released)) => {
                if !released {
                    eprintln!(
                        "{}: release answered not held; the guard's loss reason: {reason:?}",
                        self.rec.id()
                    );
                }
                op.released(released);
                Some(released)
            }
            Ok(Err(e)) => {
                eprintln!("{}: release failed: {e}", self.rec.id());
                op.error(&e);
                None
            }
            Err(_) => {
                eprintln!("{}: release timed out", self.rec.id());
                op.unknown("release timed out");
                None
            }
        }
    }
}

async fn finish_acquire(
    op: PendingOp,
    rec: &ClientRecorder,
    lock: &DynLock,
    key: &LockKey,
    wait: Duration,
) -> Option<Held> {
    let acquired = tokio::time::timeout(
        wait + SOON,
        lock.lock(key.as_str()).ttl(TTL).wait(wait).acquire(),
    )
    .await;
    let guard = match acquired {
        Ok(Ok(guard)) => guard,
        Ok(Err(e)) => {
            eprintln!("{}: acquire failed: {e}", rec.id());
            op.error(&e);
            return None;
        }
        Err(_) => {
            eprintln!("{}: acquire did not return by its deadline", rec.id());
            op.unknown("acquire did not return by its deadline");
            return None;
        }
    };
    op.granted(&guard);
    let hold = Hold::from(&guard);
    let lost_at = Arc::new(Mutex::new(None));
    let loss = tokio::spawn({
        let (lost, rec, hold, lost_at) = (guard.lost(), rec.clone(), hold.clone(), lost_at.clone());
        async move {
            lost.await;
            rec.lost(hold, "the guard's lost() fired");
            *lost_at.lock().unwrap() = Some(Instant::now());
        }
    });
    Some(Held {
        guard,
        hold,
        rec: rec.clone(),
        loss,
        lost_at,
    })
}

/// What a holder process did, as seen by its pump.
#[derive(Debug, Default)]
pub struct HolderSeen {
    pub hold: Option<Hold>,
    pub writes: u64,
    pub rejected: u64,
    /// Receive times of the holder's writes and of its loss report.
    pub write_times: Vec<Instant>,
    pub lost_at: Option<Instant>,
}

/// A holder process whose events are recorded as they arrive: its grant, each write (applied to
/// the fenced log), its loss, its release.
pub struct Holder {
    pub process: HolderProcess,
    pub rec: ClientRecorder,
    pub seen: Arc<Mutex<HolderSeen>>,
    release: Arc<Mutex<Option<PendingOp>>>,
    pump: JoinHandle<()>,
}

impl Holder {
    pub async fn spawn(
        history: &History,
        id: &str,
        url: &str,
        key: &LockKey,
        write_every: Option<Duration>,
        log: Arc<FencedLog>,
    ) -> Self {
        let rec = history.client(id);
        let mut options = HolderOptions::new(url, key.clone(), TTL);
        options.write_every = write_every;
        let acquire = rec.acquire(key, TTL);
        let process = HolderProcess::spawn_with(HOLDER_BIN.as_ref(), &options)
            .await
            .expect("start the holder");
        let seen = Arc::new(Mutex::new(HolderSeen::default()));
        let release: Arc<Mutex<Option<PendingOp>>> = Arc::new(Mutex::new(None));
        let mut feed = process.feed();
        let pump = tokio::spawn({
            let (seen, release, key, rec) =
                (seen.clone(), release.clone(), key.clone(), rec.clone());
            async move {
                let mut acquire = Some(acquire);
                while let Some((at, event)) = feed.next(Duration::from_secs(600)).await {
                    let hold = seen.lock().unwrap().hold.clone();
                    match event {
                        HolderEvent::Acquired { fencing, token, .. } => {
                            // The holder reports a digest; a stand-in with the same identity
                            // (the checker only compares tokens for equality).
                            let hold = Hold {
                                key: key.clone(),
                                token: TokenDigest::of(token.as_bytes()),
                                fencing: fencing.map(FencingToken),
                                ttl: TTL,
                            };
                            if let Some(op) = acquire.take() {
                                op.granted(hold.clone());
                            }
                            seen.lock().unwrap().hold = Some(hold);
                        }
                        HolderEvent::Write { seq, .. } => {
                            let hold = hold.expect("a write before the grant");
                            let ok = write(&rec, &hold, &log, &format!("{}#{seq}", rec.id()));
                            let mut seen = seen.lock().unwrap();
                            seen.writes += 1;
                            seen.rejected += u64::from(!ok);
                            seen.write_times.push(at);
                        }
                        HolderEvent::Lost { reason } => {
                            if let Some(hold) = hold {
                                rec.lost(hold, reason);
                            }
                            seen.lock().unwrap().lost_at = Some(at);
                        }
                        HolderEvent::Released { released } => {
                            if let Some(op) = release.lock().unwrap().take() {
                                op.released(released);
                            }
                        }
                        HolderEvent::Error { message } => {
                            if let Some(op) = acquire.take() {
                                op.fail(&message);
                            } else if let Some(op) = release.lock().unwrap().take() {
                                op.fail(&message);
                            }
                        }
                        HolderEvent::Renewed {
                            renewals,
                            deadline_mono_ns: Some(ns),
                        } => {
                            // The holder's local deadline, placed on this process's clock (both
                            // read the machine's monotonic clock).
                            let deadline = conformance::drill::holder::monotonic_to_instant(ns);
                            if let (Some(hold), Some(deadline)) = (hold, deadline) {
                                rec.renewed(hold, deadline, renewals);
                            }
                        }
                        HolderEvent::Started { .. } | HolderEvent::Renewed { .. } => {}
                    }
                }
                // Killed before its grant was reported: the outcome is unknown.
                drop(acquire);
            }
        });
        Self {
            process,
            rec,
            seen,
            release,
            pump,
        }
    }

    /// Waits for the grant; returns its fencing token.
    pub async fn wait_acquired(&self) -> u64 {
        let (fencing, _, _) =
            self.process.wait_acquired(SOON).await.unwrap_or_else(|| {
                panic!("the holder did not acquire: {:?}", self.process.events())
            });
        // Let the pump record it.
        while self.seen.lock().unwrap().hold.is_none() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        fencing.expect("every backend here mints fencing tokens")
    }

    /// Waits until the pump has applied `n` writes.
    pub async fn wait_writes(&self, n: u64) {
        let deadline = Instant::now() + SOON;
        while self.seen.lock().unwrap().writes < n {
            assert!(
                Instant::now() < deadline,
                "the holder wrote only {} times: {:?}",
                self.seen.lock().unwrap().writes,
                self.process.events()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Closes the holder's stdin (it releases and exits), recording the release.
    pub fn release(&mut self) {
        let hold = self.seen.lock().unwrap().hold.clone().expect("held");
        *self.release.lock().unwrap() = Some(self.rec.release(hold));
        self.process.release();
    }

    /// Waits until the holder exited and its events are all recorded.
    pub async fn finish(mut self) -> std::process::ExitStatus {
        let status = self
            .process
            .wait_exit(SOON)
            .await
            .expect("the holder should exit");
        tokio::time::timeout(SOON, &mut self.pump)
            .await
            .expect("the pump should end with the holder's output")
            .expect("pump panicked");
        status
    }
}

/// Records the log's final state, checks the history, saves it, and fails on any violation
/// whose rule is not in `expected` (documented limits measured by the drill). Returns every
/// violation.
pub fn finish(history: &History, log: &FencedLog, expected: &[Rule]) -> Vec<Violation> {
    // Read back from the store, independently of what acknowledged the writes.
    history.final_state(RESOURCE, ResourceKind::Log, log.read_back());
    let options = CheckOptions {
        ttl: Some(TTL),
        liveness_margin: Duration::from_secs(5),
        ..CheckOptions::default()
    };
    let violations = check(&history.snapshot(), &options);
    let files = history.save(&violations).expect("save the drill's history");
    eprintln!(
        "{}: {} records, {} violation(s); {} {}",
        history.name(),
        history.snapshot().len(),
        violations.len(),
        files.json.display(),
        files.svg.display()
    );
    // `check` ran the mutex model too; this reports its search size per key.
    for report in conformance::drill::check_mutex_model(&history.snapshot(), &options) {
        eprintln!(
            "{}: mutex model on {}: {} operations, {} states, {:?}, {:?}",
            history.name(),
            report.key,
            report.operations,
            report.states,
            report.elapsed,
            report.verdict
        );
    }
    // A documented double grant is a history no single-holder order explains, too.
    let model_expected = expected
        .iter()
        .any(|r| matches!(r, Rule::DoubleGrant | Rule::StaleReleaseTookEffect));
    let unexpected: Vec<&Violation> = violations
        .iter()
        .filter(|v| {
            let allowed =
                expected.contains(&v.rule) || (model_expected && v.rule == Rule::NotLinearizable);
            !allowed
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "{}: the checker found violations (timeline: {}): {unexpected:#?}",
        history.name(),
        files.svg.display()
    );
    violations
}

/// The seq of the first record matching `f`.
pub fn seq_of(history: &History, f: impl Fn(&conformance::drill::Record) -> bool) -> Option<u64> {
    history.snapshot().iter().find(|r| f(r)).map(|r| r.seq)
}

#[allow(unused_imports)] // not every drill binary faults a server
pub use conformance::servers::{backends, backends_sh};

/// A server instance of our own (never a shared one, see [`conformance::servers`]) on a port
/// from the drills' ranges, whose [`PrivateServer::url`] carries the drills' short timeouts.
pub struct PrivateServer {
    pub backend: Backend,
    server: conformance::servers::PrivateServer,
}

impl PrivateServer {
    /// Starts `backend` on `port` (etcd's peer port: another free one).
    pub async fn start(backend: Backend, port: u16) -> Self {
        let kind = match backend {
            Backend::Redis => ServerKind::Redis,
            Backend::Etcd => ServerKind::Etcd,
            Backend::Zk => ServerKind::Zk,
            Backend::Pg => ServerKind::Pg,
        };
        let server = conformance::servers::PrivateServer::start(kind, port).await;
        Self { backend, server }
    }

    /// `backends.sh ACTION <instance>` (start, kill, stop, pause, resume).
    pub async fn ctl(&self, action: &str) {
        self.server.ctl(action).await;
    }

    /// The instance's URL with [`Backend::options`].
    pub fn url(&self) -> String {
        with_query(&self.server.url(), self.backend.options())
    }

    /// Its client port.
    #[allow(dead_code)] // not every drill binary needs it
    pub fn port(&self) -> u16 {
        self.server.port
    }
}

// ---------------------------------------------------------------------------------------------
// Reliability drills (`drill_jobs.rs`, `drill_soak.rs`): every backend including `memory://`,
// each client behind its own fault link.

/// The backends of the reliability drills: `memory://` (a fresh in-process coordinator) and the
/// shared single-node servers (`None`: no URL set, skip).
pub fn drill_targets() -> Vec<(&'static str, Option<String>)> {
    let mut targets = vec![(
        "memory",
        Some(format!("memory://drill-{:016x}", rand::random::<u64>())),
    )];
    for backend in [Backend::Redis, Backend::Etcd, Backend::Zk, Backend::Pg] {
        targets.push((backend.name(), backend.shared_url()));
    }
    targets
}

/// The URL of the reliability drills' backend `name` (see [`drill_targets`]).
pub fn drill_target(name: &str) -> Option<String> {
    drill_targets()
        .into_iter()
        .find(|(n, _)| *n == name)
        .and_then(|(_, url)| url)
}

/// How long the in-process fault link lets a request wait before the "client" gives up (the
/// servers' drills use the drivers' 500 ms operation timeouts).
const LOCAL_OP_TIMEOUT: Duration = Duration::from_millis(500);

/// A client's fault link: the drill [`conformance::drill::Proxy`] for a server, or — for
/// `memory://`, which has no connection — a wrapper around the client that applies the same
/// faults to its calls ([`SwitchLock`]).
pub enum Link {
    Proxy(conformance::drill::Proxy),
    Local(watch::Sender<conformance::drill::Fault>),
}

impl Link {
    pub fn set(&self, fault: conformance::drill::Fault) {
        match self {
            Link::Proxy(p) => p.set(fault),
            Link::Local(tx) => {
                tx.send_replace(fault);
            }
        }
    }

    pub fn pass(&self) {
        self.set(conformance::drill::Fault::Pass);
    }

    /// Resets the connections open now (a no-op in process: there are none).
    pub fn reset(&self) {
        if let Link::Proxy(p) = self {
            p.reset();
        }
    }
}

/// A client connected through its own fault link.
pub async fn linked_client(history: &History, id: &str, url: &str) -> (Client, Link) {
    if url.starts_with("memory://") {
        let inner = client(url).await;
        let (tx, rx) = watch::channel(conformance::drill::Fault::Pass);
        let lock: DynLock = Arc::new(SwitchLock { inner, fault: rx });
        let client = Client {
            rec: history.client(id),
            lock,
        };
        (client, Link::Local(tx))
    } else {
        let (proxy, proxied) = conformance::drill::Proxy::start_for_url(url)
            .await
            .expect("start a proxy");
        (Client::new(history, id, &proxied).await, Link::Proxy(proxy))
    }
}

/// An in-process client whose calls suffer the proxy's faults: blackholed calls wait for the
/// heal (and give up after [`LOCAL_OP_TIMEOUT`] without effect, reported as an unknown
/// outcome), dropped replies apply the call and then report an unknown outcome (an acquire's
/// grant is undone by a compare-and-release first, as a driver does), delays delay both ways.
#[derive(Debug)]
pub struct SwitchLock {
    inner: DynLock,
    fault: watch::Receiver<conformance::drill::Fault>,
}

enum Gate {
    Go,
    DropReply,
    TimedOut,
}

impl SwitchLock {
    async fn gate(&self) -> Gate {
        use conformance::drill::Fault;
        let fault = *self.fault.borrow();
        match fault {
            Fault::Pass => Gate::Go,
            Fault::Delay(d) => {
                tokio::time::sleep(d).await;
                Gate::Go
            }
            Fault::DropReplies => Gate::DropReply,
            Fault::Blackhole => {
                let mut rx = self.fault.clone();
                match tokio::time::timeout(
                    LOCAL_OP_TIMEOUT,
                    rx.wait_for(|f| *f != Fault::Blackhole),
                )
                .await
                {
                    Ok(_) => Gate::Go,
                    Err(_) => Gate::TimedOut,
                }
            }
        }
    }

    async fn reply(&self) {
        let fault = *self.fault.borrow();
        if let conformance::drill::Fault::Delay(d) = fault {
            tokio::time::sleep(d).await;
        }
    }

    fn unknown(&self, op: &'static str, key: &LockKey, why: &str) -> lock_core::Error {
        lock_core::Error::Indeterminate {
            backend: "memory",
            op,
            key: key.to_string(),
            message: format!("{why} (in-process fault link)"),
        }
    }
}

#[conformance::async_trait]
impl lock_core::raw::Driver for SwitchLock {
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }

    fn capabilities(&self) -> lock_core::Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(
        &self,
        key: &LockKey,
        ttl: Duration,
    ) -> lock_core::Result<Option<lock_core::Lease>> {
        self.inner.capabilities().check_ttl(ttl)?;
        match self.gate().await {
            Gate::Go => {
                let r = self.inner.try_acquire(key, ttl).await;
                self.reply().await;
                r
            }
            Gate::TimedOut => Err(self.unknown("try_acquire", key, "no reply")),
            Gate::DropReply => {
                if let Ok(Some(lease)) = self.inner.try_acquire(key, ttl).await {
                    let _ = self.inner.release(&lease).await;
                }
                tokio::time::sleep(LOCAL_OP_TIMEOUT).await;
                Err(self.unknown("try_acquire", key, "reply lost"))
            }
        }
    }

    async fn renew(&self, lease: &mut lock_core::Lease, ttl: Duration) -> lock_core::Result<()> {
        self.inner.capabilities().check_ttl(ttl)?;
        match self.gate().await {
            Gate::Go => {
                let r = self.inner.renew(lease, ttl).await;
                self.reply().await;
                r
            }
            Gate::TimedOut => Err(self.unknown("renew", lease.key(), "no reply")),
            Gate::DropReply => {
                // Applied on the coordinator; the client never learns it.
                let mut copy = lease.clone();
                let _ = self.inner.renew(&mut copy, ttl).await;
                tokio::time::sleep(LOCAL_OP_TIMEOUT).await;
                Err(self.unknown("renew", lease.key(), "reply lost"))
            }
        }
    }

    async fn release(&self, lease: &lock_core::Lease) -> lock_core::Result<bool> {
        match self.gate().await {
            Gate::Go => {
                let r = self.inner.release(lease).await;
                self.reply().await;
                r
            }
            Gate::TimedOut => Err(self.unknown("release", lease.key(), "no reply")),
            Gate::DropReply => {
                let _ = self.inner.release(lease).await;
                tokio::time::sleep(LOCAL_OP_TIMEOUT).await;
                Err(self.unknown("release", lease.key(), "reply lost"))
            }
        }
    }

    async fn inspect(&self, key: &LockKey) -> lock_core::Result<Option<lock_core::HolderInfo>> {
        match self.gate().await {
            Gate::Go => self.inner.inspect(key).await,
            _ => Err(self.unknown("inspect", key, "no reply")),
        }
    }

    fn watch_lost(
        &self,
        lease: &lock_core::Lease,
    ) -> futures::future::BoxFuture<'static, lock_core::LossReason> {
        self.inner.watch_lost(lease)
    }
}

/// Writes `value` to `log` with `held`'s tokens unless its guard already reports the loss (a
/// correct client checks before writing; the fence catches what slips through). Recorded;
/// `Some(accepted)`, or `None` when the client did not write.
pub fn write_if_held(
    rec: &ClientRecorder,
    held: &Held,
    log: &FencedLog,
    value: &str,
) -> Option<bool> {
    let op = rec.write(held.hold.clone(), RESOURCE, value);
    if held.guard.is_lost() {
        op.fail("ownership lost before the write: not written");
        return None;
    }
    let fencing = held.hold.fencing.map_or(0, FencingToken::get);
    match log.write(fencing, &held.hold.token.to_string(), value.to_owned()) {
        Ok(()) => {
            op.ok();
            Some(true)
        }
        Err(highest) => {
            op.rejected(Some(FencingToken(highest)));
            Some(false)
        }
    }
}

/// `lock`'s answer to who holds `key`, asking again while the read fails for now
/// (`Unavailable`: a connection the proxy just reset is being replaced, or a server slow under a
/// loaded host let the drill's short request timeout pass) until [`SOON`] has passed. A read
/// changes nothing, so its failure says nothing about a drill's question.
///
/// # Panics
/// On any other error, or when it still fails after [`SOON`].
pub async fn inspect_answered(lock: &DynLock, key: &LockKey) -> Option<HolderInfo> {
    let until = Instant::now() + SOON;
    loop {
        match lock.inspect(key).await {
            Ok(info) => return info,
            Err(e @ Error::Unavailable { .. }) if Instant::now() < until => {
                eprintln!("inspect failed for now, asking again: {e}");
                // No event says when the read can succeed; poll gently.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("inspect: {e:?}"),
        }
    }
}
