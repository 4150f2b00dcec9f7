//! A lost reply for every operation (issue 19), on the shared single-node servers: for each of
//! `try_acquire`, `acquire` (queued), `renew`, `release`, `force_release` and `inspect`, a client
//! behind its own drill proxy sends the request (it reaches the server), its reply is dropped and
//! its connections are reset; then the proxy heals. Invariants:
//!
//! - the outcome is `Indeterminate`, `Unavailable` or a timeout, or it is correct — never a
//!   wrong `Ok` (`Ok(None)` for a free key, a grant the coordinator does not record, `renew`
//!   `Ok` for a lease that is no longer ours, `release` `true` for someone else's grant);
//! - a non-idempotent operation is never blindly re-sent: a `force_release` whose reply was lost
//!   while a waiter was queued must not free the waiter's fresh grant;
//! - nobody else's grant is ever touched (the other holders' guards stay unlost and release
//!   `true`);
//! - after the heal the key is acquirable within the drill TTL + [`SLACK`], and nothing stays
//!   queued (a second `try_acquire` right after a release is granted).
//!
//! Each lost operation's outcome is printed (`--nocapture`) as `OUTCOME <backend> <op> <kind>`.
//!
//! **A lost reply past the first round trip** (`*_nth_reply`): the same operations, with the
//! proxy in `lose_reply(n)` — each connection forwards its first n−1 replies and
//! loses the n-th (then is reset; the first such loss only, then everything passes) — for n = 1, 2, … until the operation completes without
//! losing one (at most [`MAX_TURNS`]): the etcd txn after the lease grant and the keepalive
//! after the txn, ZooKeeper's getChildren/sync/exists after the create, PostgreSQL's statements
//! and COMMIT after BEGIN, Redis's EVAL after EVALSHA answered NOSCRIPT (Redis runs on a
//! private `redis-server` whose script cache is flushed before each operation, so that every
//! script call takes the fallback). Same invariants; printed as `OUTCOME <backend> <op>@<n>`.
//! Needs `--features drivers` (as every drill).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::time::Duration;

use conformance::drill::Proxy;
use drill_support::{Backend, SOON, TTL, inspect_answered};
use lock_core::{DistributedLockExt, DynLock, Error, FencingToken, LockGuard, LockKey};
use tokio::time::{Instant, sleep, timeout};

/// A lost operation's attempt TTL where an orphan must be told apart from an expiry: far longer
/// than the heal bound, so only the driver's own undo frees the key in time.
const ORPHAN_TTL: Duration = Duration::from_secs(10);
/// What the key may take to become acquirable after the heal beyond the drill TTL (a loaded
/// 2-core machine; ZooKeeper's session expiry; the drivers' 500 ms request timeouts).
const SLACK: Duration = Duration::from_secs(3);
/// How long the request gets to reach the server before its connection is reset (loopback: the
/// request is there in well under a millisecond; this is the margin for a loaded machine).
const IN_FLIGHT: Duration = Duration::from_millis(300);

/// The most reply turns lost in turn per operation (none takes more round trips uncancelled,
/// counting the background traffic of its connection).
const MAX_TURNS: u32 = 8;

/// Which replies of the lost operation are lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loss {
    /// Every reply from the first on (the connections reset once the request applied).
    All,
    /// Each connection's n-th reply turn (the first n−1 answered).
    Nth(u32),
}

impl Loss {
    fn label(self, op: &str) -> String {
        match self {
            Loss::All => op.to_owned(),
            Loss::Nth(n) => format!("{op}@{n}"),
        }
    }
}

/// How a lost operation ended.
#[derive(Debug)]
enum Outcome<T> {
    /// `Ok` — to be judged per operation.
    Ok(T),
    /// `Indeterminate`, `Unavailable` or `Timeout`: the caller knows it does not know.
    Unknown(&'static str),
}

/// Classifies `result`; any other error (or no return within [`SOON`]) fails the drill.
fn classify<T: std::fmt::Debug>(
    backend: Backend,
    op: &str,
    result: Result<lock_core::Result<T>, tokio::time::error::Elapsed>,
) -> Outcome<T> {
    let outcome = match result {
        Ok(Ok(value)) => Outcome::Ok(value),
        Ok(Err(Error::Indeterminate { .. })) => Outcome::Unknown("indeterminate"),
        Ok(Err(Error::Unavailable { .. })) => Outcome::Unknown("unavailable"),
        Ok(Err(Error::Timeout { .. })) => Outcome::Unknown("timeout"),
        Ok(Err(e)) => panic!(
            "{} {op} without a reply returned {e} — neither Indeterminate, Unavailable, \
             Timeout nor a correct answer",
            backend.name()
        ),
        Err(_) => panic!("{} {op} without a reply did not return", backend.name()),
    };
    let kind = match &outcome {
        Outcome::Ok(v) => format!("ok {v:?}"),
        Outcome::Unknown(k) => (*k).to_owned(),
    };
    println!("OUTCOME {} {op} {kind}", backend.name());
    outcome
}

/// A client behind its own proxy.
struct Linked {
    lock: DynLock,
    proxy: Proxy,
    loss: Loss,
}

impl Linked {
    async fn new(url: &str, loss: Loss) -> Self {
        let (proxy, proxied) = Proxy::start_for_url(url).await.expect("start a proxy");
        let lock = drill_support::client(&proxied).await;
        Self { lock, proxy, loss }
    }

    /// Whether the proxy lost a reply (always, for [`Loss::All`]; for [`Loss::Nth`], only if
    /// some connection got that far).
    fn lost_any(&self) -> bool {
        self.loss == Loss::All || self.proxy.lost_turns() > 0
    }

    /// Runs `op` with its replies lost: [`Loss::All`]: the request goes out, once `applied`
    /// completes (bounded by [`SOON`]) every connection is reset — replies still dropped on the
    /// new ones; [`Loss::Nth`]: each connection loses its n-th reply and is reset then, while
    /// `applied` runs alongside. The proxy heals once `op` returned.
    async fn lost<T>(
        &self,
        op: impl Future<Output = lock_core::Result<T>>,
        applied: impl Future<Output = ()>,
    ) -> Result<lock_core::Result<T>, tokio::time::error::Elapsed> {
        match self.loss {
            Loss::All => self.proxy.drop_replies(),
            Loss::Nth(n) => self.proxy.lose_reply(n),
        }
        let reset = async {
            let _ = timeout(SOON, applied).await;
            if self.loss == Loss::All {
                self.proxy.reset();
            }
            std::future::pending::<()>().await;
        };
        let result = tokio::select! {
            result = timeout(SOON, op) => result,
            () = reset => unreachable!("the reset never completes"),
        };
        if self.loss == Loss::All {
            self.proxy.reset();
        }
        self.proxy.pass();
        result
    }
}

/// The holder the coordinator records for `key` is the grant with fencing token `fencing`.
async fn holder_is(lock: &DynLock, key: &LockKey, fencing: Option<FencingToken>) -> bool {
    let info = inspect_answered(lock, key).await;
    info.is_some_and(|info| info.fencing_token == fencing)
}

/// After the heal: `lock` is granted the key within TTL + [`SLACK`], and once released it is
/// granted again at once (nothing stays queued ahead of it).
async fn acquirable_after_heal(lock: &DynLock, key: &LockKey, healed: Instant) {
    let deadline = healed + TTL + SLACK;
    let lease = lock
        .acquire(key, TTL, deadline)
        .await
        .unwrap_or_else(|e| panic!("the key is not acquirable within TTL + slack: {e}"));
    released(lock.release(&lease).await);
    let again = lock
        .try_acquire(key, TTL)
        .await
        .expect("try_acquire")
        .expect("granted at once after a release: nothing stays queued");
    released(lock.release(&again).await);
}

/// A direct client's release of its own lease deleted it — or, on a loaded machine, its first
/// send timed out and the re-send found the entry gone, which the driver rightly calls
/// `Indeterminate` (that send may have deleted it; with this drill's 1 s TTL it may also have
/// expired). Whether the key is then free is what the caller goes on to check.
fn released(result: lock_core::Result<bool>) {
    match result {
        Ok(deleted) => assert!(deleted, "release found its own lease gone"),
        Err(e @ Error::Indeterminate { .. }) => println!("release indeterminate under load: {e}"),
        Err(e) => panic!("release: {e}"),
    }
}

/// A holder connected directly, renewed by its guard.
async fn hold(lock: &DynLock, key: &LockKey) -> LockGuard {
    timeout(SOON, lock.lock(key.as_str()).ttl(TTL).wait(SOON).acquire())
        .await
        .expect("acquire timed out")
        .expect("acquire")
}

/// The guard is still trusted and its lease still renewed by the coordinator.
async fn still_held(what: &str, guard: &LockGuard) {
    let renewed = guard.renewals();
    let until = Instant::now() + SOON;
    while guard.renewals() <= renewed && !guard.is_lost() && Instant::now() < until {
        sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !guard.is_lost() && guard.renewals() > renewed,
        "{what}'s grant was touched (lost: {}, renewals {renewed} -> {})",
        guard.is_lost(),
        guard.renewals()
    );
}

async fn lost_try_acquire(backend: Backend, url: &str, direct: &DynLock, loss: Loss) -> bool {
    let key = conformance::fresh_key("lost-try-acquire");
    let c = Linked::new(url, loss).await;
    let result = c
        .lost(c.lock.try_acquire(&key, ORPHAN_TTL), sleep(IN_FLIGHT))
        .await;
    let healed = Instant::now();
    match classify(backend, &loss.label("try_acquire"), result) {
        Outcome::Ok(None) => panic!("{} try_acquire: busy for a free key", backend.name()),
        Outcome::Ok(Some(lease)) => {
            // Correct only if the coordinator records exactly this grant.
            assert!(
                holder_is(direct, &key, lease.fencing_token()).await,
                "try_acquire granted a lease the coordinator does not record"
            );
            assert!(c.lock.release(&lease).await.expect("release"));
        }
        Outcome::Unknown(_) => {}
    }
    // No orphan: the lost attempt's 10 s TTL would outlive this bound.
    acquirable_after_heal(direct, &key, healed).await;
    c.lost_any()
}

async fn lost_queued_acquire(backend: Backend, url: &str, direct: &DynLock, loss: Loss) -> bool {
    let key = conformance::fresh_key("lost-acquire");
    let holder = hold(direct, &key).await;
    let c = Linked::new(url, loss).await;
    // A short wait: a driver that keeps waiting without replies ends with `Timeout` then.
    let acquire = c.lock.acquire(&key, TTL, Instant::now() + 2 * TTL);
    let result = c
        .lost(acquire, async {
            // Queued behind the holder; the holder's release hands the key over, and the grant's
            // reply is the one lost.
            sleep(IN_FLIGHT / 2).await;
            assert!(holder.release().await.expect("release"));
            sleep(IN_FLIGHT / 2).await;
        })
        .await;
    let healed = Instant::now();
    match classify(backend, &loss.label("acquire"), result) {
        Outcome::Ok(lease) => {
            assert!(
                holder_is(direct, &key, lease.fencing_token()).await,
                "acquire granted a lease the coordinator does not record"
            );
            assert!(c.lock.release(&lease).await.expect("release"));
        }
        Outcome::Unknown(_) => {}
    }
    acquirable_after_heal(direct, &key, healed).await;
    // The queued client works again and is not stuck behind its own lost entry.
    let lease = c
        .lock
        .acquire(&key, TTL, Instant::now() + TTL + SLACK)
        .await
        .expect("the client acquires after the heal");
    assert!(c.lock.release(&lease).await.expect("release"));
    c.lost_any()
}

async fn lost_renew(backend: Backend, url: &str, direct: &DynLock, loss: Loss) -> bool {
    let key = conformance::fresh_key("lost-renew");
    let c = Linked::new(url, loss).await;
    let mut lease = c
        .lock
        .try_acquire(&key, TTL)
        .await
        .expect("try_acquire")
        .expect("free");
    let before = lease.local_deadline();
    let result = c
        .lost(c.lock.renew(&mut lease, TTL), sleep(IN_FLIGHT))
        .await;
    let healed = Instant::now();
    match classify(backend, &loss.label("renew"), result) {
        Outcome::Ok(()) => {
            // Correct only while the coordinator still records this lease, for at least as
            // long as its new local deadline says.
            assert!(lease.local_deadline() >= before);
            let still = holder_is(direct, &key, lease.fencing_token()).await;
            assert!(
                still || !lease.is_locally_valid(),
                "renew Ok on a lease the coordinator no longer records, locally valid for {:?}",
                lease.remaining()
            );
        }
        Outcome::Unknown(_) => {}
    }
    // The operator removes our grant (a session-bound lease outlives its TTL while the session
    // lives) and somebody else is granted.
    let _ = healed;
    let _ = direct
        .force_release_grant(&key, lease.fencing_token().expect("fenced"))
        .await;
    let other = direct
        .acquire(&key, TTL, Instant::now() + TTL + SLACK)
        .await
        .expect("the key is acquirable after the force release");
    // The next renew answers from the coordinator's real state, and touches nobody else.
    match c.lock.renew(&mut lease, TTL).await {
        Err(Error::NotHeld { .. }) => {}
        other => panic!("renew of a lease taken over by another grant returned {other:?}"),
    }
    assert!(holder_is(direct, &key, other.fencing_token()).await);
    assert!(direct.release(&other).await.expect("release"));
    acquirable_after_heal(direct, &key, Instant::now()).await;
    c.lost_any()
}

async fn lost_release(backend: Backend, url: &str, direct: &DynLock, loss: Loss) -> bool {
    let key = conformance::fresh_key("lost-release");
    let c = Linked::new(url, loss).await;
    let lease = c
        .lock
        .try_acquire(&key, TTL)
        .await
        .expect("try_acquire")
        .expect("free");
    let result = c.lost(c.lock.release(&lease), sleep(IN_FLIGHT)).await;
    let healed = Instant::now();
    match classify(backend, &loss.label("release"), result) {
        // `false` would say the lease had been lost before: it was ours until this release.
        Outcome::Ok(released) => assert!(released, "release of our own lease returned false"),
        Outcome::Unknown(_) => {}
    }
    let other = hold(direct, &key).await;
    assert!(
        Instant::now() <= healed + TTL + SLACK,
        "the key was not acquirable within TTL + slack"
    );
    // The stale retry must not release someone else's grant.
    let stale = timeout(SOON, c.lock.release(&lease))
        .await
        .expect("the stale release returns")
        .expect("the stale release");
    assert!(
        !stale,
        "a stale release returned true for someone else's grant"
    );
    still_held("the new holder", &other).await;
    assert!(other.release().await.expect("release"));
    acquirable_after_heal(direct, &key, Instant::now()).await;
    c.lost_any()
}

/// `grant`: the lost call is `force_release_grant` of the holder's fencing token (one step on
/// every driver) instead of `force_release` (which may look the holder up first).
async fn lost_force_release(
    backend: Backend,
    url: &str,
    direct: &DynLock,
    waiter: &DynLock,
    grant: bool,
    loss: Loss,
) -> bool {
    let op = if grant {
        "force_release_grant"
    } else {
        "force_release"
    };
    if !direct.capabilities().force_release {
        drill_support::skip(op, backend, "no force_release capability");
        return false;
    }
    let key = conformance::fresh_key("lost-force-release");
    let first = hold(direct, &key).await;
    let fence = first.fencing_token().expect("these backends fence");
    // A waiter queued behind the holder: the force release hands it a fresh grant, which a
    // blindly re-sent force release would free.
    let (granted_tx, granted_rx) = tokio::sync::oneshot::channel();
    let queued = tokio::spawn({
        let (waiter, key) = (waiter.clone(), key.clone());
        async move {
            let guard = timeout(
                SOON * 2,
                waiter.lock(key.as_str()).ttl(TTL).wait(SOON * 2).acquire(),
            )
            .await
            .expect("the waiter's acquire returns")
            .expect("the waiter is granted");
            let _ = granted_tx.send(());
            guard
        }
    });
    // The waiter is queued (or polling) before the operator acts.
    sleep(IN_FLIGHT).await;
    let c = Linked::new(url, loss).await;
    let call = async {
        if grant {
            c.lock.force_release_grant(&key, fence).await
        } else {
            c.lock.force_release(&key).await
        }
    };
    let result = c
        .lost(call, async {
            // Reset once the waiter holds (the removal applied), or after a while if it did not.
            let _ = timeout(SOON / 4, granted_rx).await;
        })
        .await;
    match classify(backend, &loss.label(op), result) {
        Outcome::Ok(removed) => assert!(removed, "{op} removed nobody from a held key"),
        Outcome::Unknown(_) => {}
    }
    if holder_is(direct, &key, Some(fence)).await {
        // Not applied (the driver looked the holder up first and lost that reply): the holder
        // is untouched and the waiter still queued.
        println!("APPLIED {} {op} no", backend.name());
        still_held("the holder", &first).await;
        assert!(first.release().await.expect("release"));
    } else {
        println!("APPLIED {} {op} yes", backend.name());
        assert!(
            timeout(SOON, first.lost()).await.is_ok(),
            "the force-released holder never learned of it"
        );
        let _ = first.release().await;
    }
    let second = timeout(SOON, queued)
        .await
        .expect("the waiter is granted")
        .expect("the waiter's task");
    // The waiter's fresh grant survives the lost reply (no re-sent force release).
    still_held("the waiter", &second).await;
    assert!(holder_is(direct, &key, second.fencing_token()).await);
    assert!(second.release().await.expect("the waiter's release"));
    acquirable_after_heal(direct, &key, Instant::now()).await;
    c.lost_any()
}

async fn lost_inspect(backend: Backend, url: &str, direct: &DynLock, loss: Loss) -> bool {
    let key = conformance::fresh_key("lost-inspect");
    let holder = hold(direct, &key).await;
    let c = Linked::new(url, loss).await;
    let result = c.lost(c.lock.inspect(&key), sleep(IN_FLIGHT)).await;
    match classify(backend, &loss.label("inspect"), result) {
        Outcome::Ok(info) => {
            let info = info.expect("inspect without a reply says a held key is free");
            assert_eq!(info.fencing_token, holder.fencing_token());
        }
        Outcome::Unknown(_) => {}
    }
    still_held("the holder", &holder).await;
    assert!(holder.release().await.expect("release"));
    acquirable_after_heal(direct, &key, Instant::now()).await;
    // The client works again through the healed proxy.
    assert!(c.lock.inspect(&key).await.expect("inspect").is_none());
    c.lost_any()
}

async fn lost_replies(backend: Backend, url: String) {
    let started = Instant::now();
    let direct = drill_support::client(&url).await;
    let waiter = drill_support::client(&url).await;
    warm(&direct).await;
    lost_try_acquire(backend, &url, &direct, Loss::All).await;
    lost_queued_acquire(backend, &url, &direct, Loss::All).await;
    lost_renew(backend, &url, &direct, Loss::All).await;
    lost_release(backend, &url, &direct, Loss::All).await;
    lost_force_release(backend, &url, &direct, &waiter, false, Loss::All).await;
    lost_force_release(backend, &url, &direct, &waiter, true, Loss::All).await;
    lost_inspect(backend, &url, &direct, Loss::All).await;
    assert!(
        lock_core::raw::cleanup::finish(SOON).await,
        "the clean-ups did not finish"
    );
    println!("{} lost replies: {:?}", backend.name(), started.elapsed());
}

/// Runs every operation once on a fresh key, so that each lost reply below is the reply of the
/// request that acts. On Redis the server then has every script cached: on a cold cache the
/// first `try_acquire`'s lost reply was the `NOSCRIPT` answer, its fallback never went out,
/// nothing was granted and there was no orphan to undo — a run right after the server started
/// passed with the driver's undo removed (`conformance/mutants/drill-05`).
async fn warm(lock: &DynLock) {
    let key = conformance::fresh_key("lost-warm");
    let mut lease = lock
        .try_acquire(&key, TTL)
        .await
        .expect("try_acquire")
        .expect("a fresh key is free");
    lock.renew(&mut lease, TTL).await.expect("renew");
    lock.inspect(&key).await.expect("inspect");
    assert!(lock.release(&lease).await.expect("release"));
    lock.force_release(&key).await.expect("force_release");
}

/// Every operation loses its reply turn 1, 2, … in turn, until it completes without losing one.
/// `prepare` runs before each (Redis: the private server forgets its scripts).
async fn nth_replies(backend: Backend, url: String, prepare: impl AsyncFn()) {
    let started = Instant::now();
    let direct = drill_support::client(&url).await;
    let waiter = drill_support::client(&url).await;
    let ops = [
        "try_acquire",
        "acquire",
        "renew",
        "release",
        "force_release",
        "force_release_grant",
        "inspect",
    ];
    for op in ops {
        let mut covered = None;
        for n in 1..=MAX_TURNS {
            prepare().await;
            let (url, direct, loss) = (url.as_str(), &direct, Loss::Nth(n));
            let lost = match op {
                "try_acquire" => lost_try_acquire(backend, url, direct, loss).await,
                "acquire" => lost_queued_acquire(backend, url, direct, loss).await,
                "renew" => lost_renew(backend, url, direct, loss).await,
                "release" => lost_release(backend, url, direct, loss).await,
                "force_release" => {
                    lost_force_release(backend, url, direct, &waiter, false, loss).await
                }
                "force_release_grant" => {
                    lost_force_release(backend, url, direct, &waiter, true, loss).await
                }
                _ => lost_inspect(backend, url, direct, loss).await,
            };
            if !lost {
                covered = Some(n - 1);
                break;
            }
        }
        match covered {
            Some(turns) => println!(
                "NTH {} {op}: completes within {turns} reply turns; each lost in turn",
                backend.name()
            ),
            None => println!(
                "NTH {} {op}: reply turns 1..={MAX_TURNS} lost in turn (still more)",
                backend.name()
            ),
        }
    }
    assert!(
        lock_core::raw::cleanup::finish(SOON).await,
        "the clean-ups did not finish"
    );
    println!(
        "{} n-th lost replies: {:?}",
        backend.name(),
        started.elapsed()
    );
}

fn run_nth(backend: Backend) {
    let Some(url) = backend.shared_url() else {
        drill_support::skip("nth_lost_replies", backend, "no server URL set");
        return;
    };
    drill_support::block_on(nth_replies(backend, url, async || {}));
}

/// A `redis-server` of this drill's own on a free port (a `backends.sh` instance, stopped on
/// drop), so that its script cache can be flushed without touching the shared server.
struct PrivateRedis {
    port: u16,
    _server: conformance::servers::PrivateServer,
}

impl PrivateRedis {
    async fn start() -> Self {
        use conformance::servers::{PrivateServer, ServerKind, free_port};
        let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
        Self {
            port: server.port,
            _server: server,
        }
    }

    /// Sends one command and returns the first line of the reply.
    async fn command(&self, args: &[&str]) -> Option<String> {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .ok()?;
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        stream.write_all(req.as_bytes()).await.ok()?;
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).await.ok()?;
        Some(line.trim_end().to_owned())
    }

    /// Forgets every cached script: the next EVALSHA of each is answered NOSCRIPT.
    async fn flush_scripts(&self) {
        assert_eq!(
            self.command(&["SCRIPT", "FLUSH"]).await.as_deref(),
            Some("+OK"),
            "SCRIPT FLUSH on the private server"
        );
    }
}

fn run(backend: Backend) {
    let Some(url) = backend.shared_url() else {
        drill_support::skip("lost_replies", backend, "no server URL set");
        return;
    };
    drill_support::block_on(lost_replies(backend, url));
}

#[test]
fn redis() {
    run(Backend::Redis);
}

#[test]
fn etcd() {
    run(Backend::Etcd);
}

#[test]
fn zk() {
    run(Backend::Zk);
}

#[test]
fn pg() {
    run(Backend::Pg);
}

#[test]
fn redis_nth_reply() {
    // The shared server's URL says whether Redis is set up; the drill runs on a private one.
    if Backend::Redis.shared_url().is_none() {
        drill_support::skip("nth_lost_replies", Backend::Redis, "no server URL set");
        return;
    }
    drill_support::block_on(async {
        let redis = PrivateRedis::start().await;
        let url = drill_support::with_query(
            &format!("redis://127.0.0.1:{}/0", redis.port),
            Backend::Redis.options(),
        );
        nth_replies(Backend::Redis, url, async || redis.flush_scripts().await).await;
    });
}

#[test]
fn etcd_nth_reply() {
    run_nth(Backend::Etcd);
}

#[test]
fn zk_nth_reply() {
    run_nth(Backend::Zk);
}

#[test]
fn pg_nth_reply() {
    run_nth(Backend::Pg);
}
