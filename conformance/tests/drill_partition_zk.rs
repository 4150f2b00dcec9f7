//! Drill: a ZooKeeper holder connected to a follower that is partitioned from the leader.
//!
//! A private 3-member ensemble (never the shared one of `backends.sh up3`): members 1 and 2 form
//! the ensemble first, then member 3 joins as a follower. Member 3 reaches members 1 and 2 only
//! through drill proxies on their quorum and election ports (it has the highest id, so it is the
//! one that opens every connection with them), so blackholing those proxies cuts member 3 — and
//! only member 3 — off from the leader, while its clients stay connected to it.
//!
//! **Every link with member 3 is one member 3 opened.** ZooKeeper keeps an election connection
//! only when the higher id opened it; when a lower id opens one, the higher id closes it and
//! connects back to the *address the lower id advertised* — its own listening port, which would
//! bypass the proxies (seen: a "cut" leader went on winning elections over such a direct link,
//! and the majority had no leader for 40–120 s). So members 1 and 2 know member 3's election
//! port as [`UNLISTENED`] (nothing listens there: their attempts are refused at once) and every
//! election link with member 3 is the one it opens through the proxies.
//!
//! Client `a` (connected to member 3 only) holds the lock, client `b` (connected to members 1
//! and 2) waits for it; then member 3 is cut off. A follower cut off from its leader keeps
//! answering its clients' reads for syncLimit × tickTime (here 5 s, longer than the 2 s session),
//! while the leader expires `a`'s session and grants the lock to `b`. The drill requires that
//! `a`'s guard reports the loss **before** `b` is granted, that `b`'s fencing token is larger,
//! and that the recorded history passes the checker. Before lock-zk counted only answers that
//! went through the leader, `a` went on trusting the lock for seconds after `b` had it.
//!
//! Each ensemble is a `conformance::servers::PrivateCluster`: `backends.sh`'s ensemble members on
//! free ports and a data directory of their own, each member's `zoo.cfg` given the drill's timing
//! and its own view of the others' addresses (the proxies) as lines over `backends.sh`'s; the
//! proxies take ephemeral ports, the unlistened election port is a free one. The members are
//! stopped and their data deleted at the end, also when the drill fails half-way (then the end of
//! each member's log is printed first).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::{
    net::SocketAddr,
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use conformance::{
    drill::{ClientRecorder, History, Hold, Proxy},
    servers::{ClusterKind, PrivateCluster, free_port},
};
use drill_support::{FencedLog, SOON, block_on, client, finish, write};
use lock_core::{DistributedLockExt, DynLock, LockGuard, LockKey};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    task::JoinHandle,
    time::{Instant, sleep},
};

const TICK_MS: u64 = 200;
/// How long a member waits at most between two rounds of election notifications (ZooKeeper's
/// default, 60 s, doubles from 200 ms: a member that started before its peers listened would
/// wait up to a minute to try them again).
const MAX_NOTIFICATION_INTERVAL_MS: u64 = 1000;
/// A follower gives up on a silent leader after SYNC_LIMIT × TICK_MS = 5 s.
const SYNC_LIMIT: u64 = 25;
/// The clients' session timeout, and the drill's TTL (ZooKeeper's smallest).
const SESSION: Duration = Duration::from_secs(2);
const JAR: &str = "/usr/share/java/zookeeper.jar";

/// The private ensemble: its members (`backends.sh`'s, stopped and deleted on drop) and the
/// proxies that carry the links the drill cuts.
struct Ensemble {
    members: PrivateCluster,
    proxies: Vec<Proxy>,
}

impl Ensemble {
    /// Ports and a data directory chosen, nothing started.
    fn planned() -> Self {
        Self {
            members: PrivateCluster::planned(ClusterKind::Zk),
            proxies: Vec::new(),
        }
    }

    /// The members' client ports.
    fn client_ports(&self) -> [u16; 3] {
        self.members.ports
    }

    /// Each member's own quorum and election ports (where it listens).
    fn direct(&self) -> [(u16, u16); 3] {
        let (quorum, election) = (
            self.members.peer_ports(),
            self.members
                .election_ports()
                .expect("an ensemble has election ports"),
        );
        [0, 1, 2].map(|i| (quorum[i], election[i]))
    }

    /// Sets member `id`'s configuration: the drill's timing, and `peers[i]`, how it reaches
    /// member `i + 1`'s quorum and election ports.
    fn configure(&mut self, id: usize, peers: [(u16, u16); 3]) {
        let mut lines = vec![
            format!("tickTime={TICK_MS}"),
            "initLimit=50".to_owned(),
            format!("syncLimit={SYNC_LIMIT}"),
            format!("minSessionTimeout={}", 2 * TICK_MS),
            "maxSessionTimeout=60000".to_owned(),
            // An unknown key is set as the system property `zookeeper.<key>`.
            format!("fastleader.maxNotificationInterval={MAX_NOTIFICATION_INTERVAL_MS}"),
        ];
        for (i, (quorum, election)) in peers.iter().enumerate() {
            lines.push(format!("server.{}=127.0.0.1:{quorum}:{election}", i + 1));
        }
        self.members.set_member_args(id - 1, &lines);
    }

    /// Starts members `ids` (configured before) with one `backends.sh start`, in that order.
    async fn start(&self, ids: &[usize]) {
        let which: Vec<usize> = ids.iter().map(|id| id - 1).collect();
        if let Err(out) = self.members.start_members(&which).await {
            panic!("members {ids:?} did not start: {out}");
        }
    }

    /// What member `id`'s log says, for failure messages.
    fn log_tail(&self, id: usize) -> String {
        self.members.log_tail(id - 1, 20)
    }
}

/// The `Mode:` of the member on `port` (`leader`, `follower`, ...), empty when it does not say.
async fn mode(port: u16) -> String {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    let _ = s.write_all(b"srvr").await;
    let mut out = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut out)).await;
    out.lines()
        .find_map(|l| l.strip_prefix("Mode: "))
        .unwrap_or("")
        .trim()
        .to_owned()
}

/// Waits until member `id`'s log has a line containing `needle`.
async fn wait_log(ensemble: &Ensemble, id: usize, needle: &str) {
    let deadline = Instant::now() + SOON;
    while !ensemble
        .members
        .log_tail(id - 1, usize::MAX)
        .contains(needle)
    {
        assert!(
            Instant::now() < deadline,
            "member {id} never logged {needle:?}; its log:\n{}",
            ensemble.log_tail(id)
        );
        sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_mode(ensemble: &Ensemble, id: usize, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = mode(ensemble.client_ports()[id - 1]).await;
        if ok(&m) {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "member {id} never got a suitable mode (last: {m:?}); its log:\n{}",
            ensemble.log_tail(id)
        );
        sleep(Duration::from_millis(100)).await;
    }
}

/// The drills of this file run one at a time: two private ensembles (six JVMs) at once on a
/// 2-core machine stall elections past the clients' session timeouts.
static ONE_ENSEMBLE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A guard and when its `lost()` fired.
struct Held {
    guard: LockGuard,
    hold: Hold,
    lost_at: Arc<Mutex<Option<Instant>>>,
    _loss: JoinHandle<()>,
}

async fn acquire(rec: &ClientRecorder, lock: &DynLock, key: &LockKey, wait: Duration) -> Held {
    let op = rec.acquire(key, SESSION);
    let guard = match tokio::time::timeout(
        wait + SOON,
        lock.lock(key.as_str()).ttl(SESSION).wait(wait).acquire(),
    )
    .await
    {
        Ok(Ok(guard)) => guard,
        Ok(Err(e)) => {
            op.error(&e);
            panic!("{}: acquire failed: {e}", rec.id());
        }
        Err(_) => {
            op.unknown("acquire did not return by its deadline");
            panic!("{}: acquire hung", rec.id());
        }
    };
    op.granted(&guard);
    let hold = Hold::from(&guard);
    let lost_at = Arc::new(Mutex::new(None));
    let loss = tokio::spawn({
        let (lost, rec, hold, lost_at) = (guard.lost(), rec.clone(), hold.clone(), lost_at.clone());
        async move {
            lost.await;
            *lost_at.lock().unwrap() = Some(Instant::now());
            rec.lost(hold, "the guard's lost() fired");
        }
    });
    Held {
        guard,
        hold,
        lost_at,
        _loss: loss,
    }
}

fn url(ports: &[u16]) -> String {
    let hosts: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    format!(
        "zk://{}?session_timeout={}ms&op_timeout=1s&connect_timeout=10s&root=/drill",
        hosts.join(","),
        SESSION.as_millis()
    )
}

#[test]
fn zk_holder_on_a_partitioned_follower_loses_before_the_leader_grants_another() {
    // The ensemble needs what the shared ZooKeeper needs (Java and the Debian package).
    if conformance::backend_url("DISTLOCK_TEST_ZK_URL").is_none() {
        return;
    }
    assert!(
        Path::new(JAR).exists(),
        "{JAR} is missing (scripts/backends.sh install)"
    );
    let _one = ONE_ENSEMBLE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    block_on(drill());
}

async fn drill() {
    let mut ensemble = Ensemble::planned();
    let direct = ensemble.direct();
    // Members 1 and 2 never open an election link with member 3 (see the module documentation):
    // they know its election port as one nothing listens on.
    let view_of_majority = [direct[0], direct[1], (direct[2].0, free_port())];
    ensemble.configure(1, view_of_majority);
    ensemble.configure(2, view_of_majority);
    ensemble.start(&[1, 2]).await;
    let serving = |m: &str| m == "leader" || m == "follower";
    wait_mode(&ensemble, 1, serving).await;
    wait_mode(&ensemble, 2, serving).await;
    // Member 3 reaches 1 and 2 only through proxies on their quorum and election ports.
    let mut via = direct;
    for (i, peer) in via.iter_mut().enumerate().take(2) {
        let to = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let quorum = Proxy::start(to(direct[i].0)).await.unwrap();
        let election = Proxy::start(to(direct[i].1)).await.unwrap();
        *peer = (quorum.addr().port(), election.addr().port());
        ensemble.proxies.push(quorum);
        ensemble.proxies.push(election);
    }
    ensemble.configure(3, via);
    ensemble.start(&[3]).await;
    wait_mode(&ensemble, 3, |m| m == "follower").await;
    let client_ports = ensemble.client_ports();
    let leader = if mode(client_ports[0]).await == "leader" {
        1
    } else {
        2
    };
    eprintln!("ensemble up: member 3 follows member {leader} through the drill proxies");

    let history = History::new("zk_partitioned_follower");
    history.note(format!(
        "3-member ensemble, tickTime {TICK_MS} ms, syncLimit {SYNC_LIMIT}; a on follower 3, b on members 1 and 2"
    ));
    let log = FencedLog::new();
    let key = conformance::fresh_key("drill-pf");
    let (rec_a, rec_b) = (history.client("a"), history.client("b"));
    let a = client(&url(&client_ports[2..])).await;
    let b = client(&url(&client_ports[..2])).await;

    let held_a = acquire(&rec_a, &a, &key, SOON).await;
    assert!(write(&rec_a, &held_a.hold, &log, "a#1"));
    let waiter = tokio::spawn({
        let (rec_b, b, key) = (rec_b.clone(), b.clone(), key.clone());
        async move {
            let held = acquire(&rec_b, &b, &key, Duration::from_secs(60)).await;
            (Instant::now(), held)
        }
    });
    // b is queued behind a (two contenders) before the cut.
    let deadline = Instant::now() + SOON;
    while !matches!(b.inspect(&key).await, Ok(Some(h)) if h.waiters == Some(1)) {
        assert!(Instant::now() < deadline, "b never queued behind a");
        sleep(Duration::from_millis(20)).await;
    }
    // Let a renew a few times through the follower first.
    sleep(SESSION).await;
    assert!(!held_a.guard.is_lost(), "a lost the lock before the cut");
    assert!(write(&rec_a, &held_a.hold, &log, "a#2"));

    let cut = history.fault("partition follower 3 from the leader", Some("zk member 3"));
    for proxy in &ensemble.proxies {
        proxy.blackhole();
    }
    let cut_at = Instant::now();
    let (granted_at, held_b) = tokio::time::timeout(Duration::from_secs(60), waiter)
        .await
        .expect("b was never granted after the leader expired a's session")
        .unwrap();
    assert!(write(&rec_b, &held_b.hold, &log, "b#1"));
    let lost_at = *held_a.lost_at.lock().unwrap();
    // After the grant, a late loss still shows (for the message), within the follower's 5 s.
    let lost_at = match lost_at {
        Some(at) => at,
        None => {
            let _ = tokio::time::timeout(Duration::from_secs(15), held_a.guard.lost()).await;
            sleep(Duration::from_millis(10)).await;
            held_a
                .lost_at
                .lock()
                .unwrap()
                .expect("a never reported the loss")
        }
    };
    let since = |t: Instant| t.saturating_duration_since(cut_at);
    eprintln!(
        "cut at +0; a lost at +{:?} ({:?}); b granted at +{:?} (fence {:?} after {:?})",
        since(lost_at),
        held_a.guard.loss_reason(),
        since(granted_at),
        held_b.guard.fencing_token(),
        held_a.guard.fencing_token()
    );
    assert!(
        lost_at <= granted_at,
        "a's guard trusted the lock for {:?} after the leader had granted it to b",
        lost_at - granted_at
    );
    assert!(held_b.guard.fencing_token() > held_a.guard.fencing_token());
    // A stale write by a is refused by the fence.
    assert!(!write(&rec_a, &held_a.hold, &log, "a#3"));

    for proxy in &ensemble.proxies {
        proxy.pass();
    }
    cut.heal();
    release_recorded(&rec_b, held_b.hold, held_b.guard).await;
    drop(held_a);
    // Healed: the majority side serves the lock again at once.
    let again = acquire(&rec_b, &b, &key, SOON).await;
    assert!(write(&rec_b, &again.hold, &log, "b#2"));
    release_recorded(&rec_b, again.hold, again.guard).await;
    finish(&history, &log, &[]);
    drop(ensemble);
}

/// Drill: the **leader** of a private 3-member ensemble is cut off from both followers while
/// the holder's client, and a waiter's, are connected to it only. Member 3 is made the leader
/// (it starts first, so the first election it takes part in is won by the highest id), and every
/// link between it and members 1 and 2 runs through drill proxies: its own connections to their
/// quorum and election ports, and theirs to its quorum port (the election links are all its own,
/// see the module documentation). Blackholing the five proxies isolates it.
/// A leader without a quorum goes on answering its clients (reads, and syncs while no proposal
/// is outstanding) until it gives up after syncLimit × tickTime; meanwhile the followers elect a
/// new leader, which expires the holder's session and grants the lock to `b`. Requires: the
/// holder's `lost()` precedes `b`'s grant, fences increase, the waiter on the old leader's side
/// is never granted during the partition, and the history passes the checker.
#[test]
fn zk_holder_on_an_isolated_leader_loses_before_the_new_leader_grants_another() {
    if conformance::backend_url("DISTLOCK_TEST_ZK_URL").is_none() {
        return;
    }
    assert!(
        Path::new(JAR).exists(),
        "{JAR} is missing (scripts/backends.sh install)"
    );
    let _one = ONE_ENSEMBLE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    block_on(leader_drill());
}

/// An acquisition that may fail (the waiter on the isolated side): when it returned, and the
/// guard if granted. Recorded in the history either way.
/// Releases `guard` within [`SOON`], recording the release of `hold` in `rec`'s history.
async fn release_recorded(rec: &ClientRecorder, hold: Hold, guard: LockGuard) {
    let release = rec.release(hold);
    match tokio::time::timeout(SOON, guard.release()).await {
        Ok(Ok(released)) => release.released(released),
        Ok(Err(e)) => release.error(&e),
        Err(_) => release.unknown("release timed out"),
    }
}

async fn try_to_acquire(
    rec: &ClientRecorder,
    lock: &DynLock,
    key: &LockKey,
    wait: Duration,
) -> (Instant, Option<LockGuard>) {
    let op = rec.acquire(key, SESSION);
    let result = tokio::time::timeout(
        wait + SOON,
        lock.lock(key.as_str()).ttl(SESSION).wait(wait).acquire(),
    )
    .await;
    let at = Instant::now();
    match result {
        Ok(Ok(guard)) => {
            op.granted(&guard);
            (at, Some(guard))
        }
        Ok(Err(e)) => {
            op.error(&e);
            (at, None)
        }
        Err(_) => {
            op.unknown("acquire did not return by its deadline");
            (at, None)
        }
    }
}

async fn leader_drill() {
    let mut ensemble = Ensemble::planned();
    let direct = ensemble.direct();
    let to = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    // proxied[i]: member i + 1's quorum and election ports as the other members reach them
    // (those proxies, in `ensemble.proxies`, are the ones the cut blackholes).
    let mut proxied = direct;
    for (i, peer) in proxied.iter_mut().enumerate() {
        let quorum = Proxy::start(to(direct[i].0)).await.unwrap();
        peer.0 = quorum.addr().port();
        ensemble.proxies.push(quorum);
        // Member 3's election port is never opened by the others (see the module documentation).
        if i < 2 {
            let election = Proxy::start(to(direct[i].1)).await.unwrap();
            election.blackhole();
            peer.1 = election.addr().port();
            ensemble.proxies.push(election);
        }
    }
    // Members 1 and 2 reach each other's election ports through gates that are never cut: closed
    // until member 3 leads, so that they cannot elect one of them before member 3 is heard.
    let mut gates = Vec::new();
    let mut gated = direct;
    for (i, peer) in gated.iter_mut().enumerate().take(2) {
        let gate = Proxy::start(to(direct[i].1)).await.unwrap();
        gate.blackhole();
        peer.1 = gate.addr().port();
        gates.push(gate);
    }
    // Member 3 reaches 1 and 2 through their proxies; 1 and 2 reach each other through the
    // gates, 3's quorum port through its proxy, and 3's election port not at all: their election
    // link with member 3 is only ever the one it opens.
    let view_of_3 = [proxied[0], proxied[1], direct[2]];
    let unlistened = (proxied[2].0, free_port());
    ensemble.configure(3, view_of_3);
    ensemble.configure(1, [direct[0], gated[1], unlistened]);
    ensemble.configure(2, [gated[0], direct[1], unlistened]);
    ensemble.start(&[3, 1, 2]).await;
    // All three look for a leader; once each listens, member 3's links to 1 and 2 open: all
    // three look at once, with empty logs, so the highest id, 3, wins.
    for id in 1..=3 {
        wait_log(&ensemble, id, "is accepting connections now").await;
    }
    for proxy in &ensemble.proxies {
        proxy.pass();
    }
    wait_mode(&ensemble, 3, |m| m == "leader" || m == "follower").await;
    let client_ports = ensemble.client_ports();
    let m3 = mode(client_ports[2]).await;
    assert_eq!(
        m3,
        "leader",
        "member 3 did not win the first election; its log:\n{}",
        ensemble.log_tail(3)
    );
    for gate in &gates {
        gate.pass();
    }
    wait_mode(&ensemble, 1, |m| m == "follower").await;
    wait_mode(&ensemble, 2, |m| m == "follower").await;
    eprintln!("ensemble up: member 3 leads, every link to it through the drill proxies");

    let history = History::new("zk_isolated_leader");
    history.note(format!(
        "3-member ensemble, tickTime {TICK_MS} ms, syncLimit {SYNC_LIMIT}; a and w on leader 3, b on members 1 and 2"
    ));
    let log = FencedLog::new();
    let key = conformance::fresh_key("drill-il");
    let (rec_a, rec_w, rec_b) = (
        history.client("a"),
        history.client("w"),
        history.client("b"),
    );
    let a = client(&url(&client_ports[2..])).await;
    let w = client(&url(&client_ports[2..])).await;
    let b = client(&url(&client_ports[..2])).await;

    let held_a = acquire(&rec_a, &a, &key, SOON).await;
    assert!(write(&rec_a, &held_a.hold, &log, "a#1"));
    // w queues first (on the leader), then b (on the followers).
    let minority = tokio::spawn({
        let (rec_w, w, key) = (rec_w.clone(), w.clone(), key.clone());
        async move { try_to_acquire(&rec_w, &w, &key, Duration::from_secs(60)).await }
    });
    let queued = |n: usize| {
        let (a, key) = (a.clone(), key.clone());
        async move {
            let deadline = Instant::now() + SOON;
            while !matches!(a.inspect(&key).await, Ok(Some(h)) if h.waiters == Some(n)) {
                assert!(Instant::now() < deadline, "{n} waiters never queued");
                sleep(Duration::from_millis(20)).await;
            }
        }
    };
    queued(1).await;
    let waiter = tokio::spawn({
        let (rec_b, b, key) = (rec_b.clone(), b.clone(), key.clone());
        async move {
            // b's members lose their leader too: its session may expire during the election
            // (its acquire then fails); it tries again, each attempt recorded.
            let until = Instant::now() + Duration::from_secs(120);
            loop {
                let (at, guard) = try_to_acquire(&rec_b, &b, &key, Duration::from_secs(60)).await;
                if let Some(guard) = guard {
                    return (at, guard);
                }
                assert!(Instant::now() < until, "b was never granted");
                sleep(Duration::from_millis(100)).await;
            }
        }
    });
    queued(2).await;
    sleep(SESSION).await;
    assert!(!held_a.guard.is_lost(), "a lost the lock before the cut");
    assert!(write(&rec_a, &held_a.hold, &log, "a#2"));

    let cut = history.fault("isolate leader 3 from members 1 and 2", Some("zk member 3"));
    for proxy in &ensemble.proxies {
        proxy.blackhole();
    }
    let cut_at = Instant::now();
    let (granted_at, guard_b) = tokio::time::timeout(Duration::from_secs(180), waiter)
        .await
        .expect("b was never granted after the new leader expired a's session")
        .unwrap();
    let hold_b = Hold::from(&guard_b);
    assert!(write(&rec_b, &hold_b, &log, "b#1"));
    let lost_at = *held_a.lost_at.lock().unwrap();
    let lost_at = match lost_at {
        Some(at) => at,
        None => {
            let _ = tokio::time::timeout(Duration::from_secs(15), held_a.guard.lost()).await;
            sleep(Duration::from_millis(10)).await;
            held_a
                .lost_at
                .lock()
                .unwrap()
                .expect("a never reported the loss")
        }
    };
    let since = |t: Instant| t.saturating_duration_since(cut_at);
    eprintln!(
        "leader cut at +0; a lost at +{:?} ({:?}); b granted at +{:?} (fence {:?} after {:?})",
        since(lost_at),
        held_a.guard.loss_reason(),
        since(granted_at),
        guard_b.fencing_token(),
        held_a.guard.fencing_token()
    );
    assert!(
        lost_at <= granted_at,
        "a's guard trusted the lock for {:?} after the new leader had granted it to b",
        lost_at - granted_at
    );
    assert!(guard_b.fencing_token() > held_a.guard.fencing_token());
    assert!(!write(&rec_a, &held_a.hold, &log, "a#3"));
    // Freed on the majority side while still cut: w, on the old leader, is not granted.
    release_recorded(&rec_b, hold_b, guard_b).await;
    sleep(SESSION).await;
    let healed_at = Instant::now();
    for proxy in &ensemble.proxies {
        proxy.pass();
    }
    // The fault lasts until member 3 serves again (it rejoins as a follower and syncs first):
    // w's client, which knows only member 3, can be served from then on.
    wait_mode(&ensemble, 3, |m| m == "follower").await;
    cut.heal();
    drop(held_a);
    let (w_at, w_guard) = tokio::time::timeout(Duration::from_secs(90), minority)
        .await
        .expect("w's acquire never returned")
        .unwrap();
    let w_guard = match w_guard {
        Some(guard) => {
            assert!(
                w_at >= healed_at,
                "w, on the isolated leader, was granted {:?} before the heal",
                healed_at - w_at
            );
            guard
        }
        // It gave up (its session or connection lost): once healed its client locks again.
        None => {
            let (_, guard) = try_to_acquire(&rec_w, &w, &key, SOON).await;
            guard.expect("w acquires after the heal")
        }
    };
    let hold_w = Hold::from(&w_guard);
    assert!(write(&rec_w, &hold_w, &log, "w#1"));
    release_recorded(&rec_w, hold_w, w_guard).await;
    // An acquire that starts after the heal, whatever the timing above: w's waiting acquire
    // began before it and may have been granted between member 3 rejoining and the drill seeing
    // it (before the heal is recorded), which leaves the checker's liveness rule unexercised.
    let (_, again) = try_to_acquire(&rec_w, &w, &key, SOON).await;
    let again = again.expect("w acquires a free key after the heal");
    let hold_again = Hold::from(&again);
    assert!(write(&rec_w, &hold_again, &log, "w#2"));
    release_recorded(&rec_w, hold_again, again).await;
    finish(&history, &log, &[]);
    drop(ensemble);
}
