//! Drill: an etcd holder on a member partitioned from the majority of a 3-member cluster.
//!
//! The holder's client talks only to one member; that member's peer links are cut (both
//! directions), while the other two keep a quorum and a leader. Only the leader expires leases,
//! and the partitioned member can forward neither keepalives nor linearizable reads to it, so
//! the holder cannot renew: its guard's `lost()` must fire before the majority grants the lock
//! to a contender connected to it. Then the partition heals and everyone can lock again.
//!
//! The cluster is private to this drill (`conformance::servers::PrivateCluster`: `backends.sh`'s
//! cluster members on ports and a data directory of their own, stopped and deleted at the end),
//! so the shared `up3` cluster is never touched. Each member's peer port is
//! behind a small proxy of this file that can cut the member off: every connection *to* the
//! isolated member, and every connection the isolated member opened *to* the others (found by
//! the owner of the connecting socket in `/proc`), is closed while the partition lasts; the
//! majority's links to each other stay up.
//!
//! `etcd_isolated_leader_holder` cuts the **leader** instead, with the holder's client and a
//! second, waiting client attached to it: the holder's `lost()` must precede the grant the new
//! majority makes to a contender, and the waiter on the old leader's side must not be granted
//! while the partition lasts (after the heal it may be). Runs where the cluster drills run
//! (`DISTLOCK_TEST_ETCD3_URL` set, i.e. `backends.sh up3`), with the `etcd` binary of that setup.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::{
    net::SocketAddr,
    process::{Command, Stdio},
    sync::Arc,
    time::Duration,
};

use conformance::{
    drill::History,
    servers::{ClusterKind, PrivateCluster},
};
use drill_support::{Backend, Client, FencedLog, SOON, TTL, finish, write};
use lock_core::FencingToken;
use tokio::{
    net::{TcpListener, TcpStream},
    sync::watch,
    time::{Instant, sleep},
};

const WAIT: Duration = Duration::from_secs(30);

/// Who is cut off: the isolated member's pid, and whether this proxy fronts that member.
type Partition = Option<u32>;

/// A TCP proxy in front of one member's peer port.
struct PeerProxy {
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for PeerProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl PeerProxy {
    /// Listens on a free port; forwards to `upstream` once known (set before the member starts).
    async fn start(
        upstream: SocketAddr,
        fronts_pid: watch::Receiver<Option<u32>>,
        partition: watch::Receiver<Partition>,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, peer)) = listener.accept().await {
                let (fronts_pid, mut partition) = (fronts_pid.clone(), partition.clone());
                tokio::spawn(async move {
                    // Completes only if this connection is to be cut (else stays pending, so
                    // the copy below is never interrupted).
                    let cut = async {
                        loop {
                            let isolated = *partition.borrow_and_update();
                            if let Some(pid) = isolated
                                && (*fronts_pid.borrow() == Some(pid)
                                    || opened_by(pid, peer.port(), addr.port()))
                            {
                                return;
                            }
                            if partition.changed().await.is_err() {
                                std::future::pending::<()>().await;
                            }
                        }
                    };
                    let mut cut = std::pin::pin!(cut);
                    // Decided before a byte moves: a connection the partition covers never
                    // reaches the upstream member. (Polling the copy first, as an unbiased
                    // select may, let the isolated member's first message through — a vote
                    // with a higher term that deposed the majority's leader, so the majority
                    // had no leader for seconds and the drill failed on liveness.)
                    if futures::poll!(cut.as_mut()).is_ready() {
                        return;
                    }
                    let Ok(mut outbound) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        biased;
                        () = &mut cut => {}
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    }
                });
            }
        });
        Self { addr, accept }
    }
}

/// Whether the process `pid` owns the socket connected from `local_port` to `remote_port` on
/// loopback (our accepted connection's peer): `/proc/net/tcp` gives the socket's inode, the
/// process's fds show whether it holds it.
fn opened_by(pid: u32, local_port: u16, remote_port: u16) -> bool {
    let port_of = |field: &str| {
        field
            .rsplit_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
    };
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return false;
    };
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() > 9 && port_of(f[1]) == Some(local_port) && port_of(f[2]) == Some(remote_port))
                .then(|| format!("socket:[{}]", f[9]))
        })
        .collect();
    if inodes.is_empty() {
        return false;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
    })
}

/// Three etcd members of our own, their peer proxies, and the partition switch.
struct Cluster {
    members: PrivateCluster,
    _proxies: Vec<PeerProxy>,
    partition: watch::Sender<Partition>,
}

impl Cluster {
    /// Starts the cluster and waits for its leader. The members' own ports are picked free and
    /// released before etcd binds them, in the range the kernel also gives outgoing connections
    /// their local ports from: a member that found its port taken meanwhile (`backends.sh`
    /// refuses to start it, or it exits with "address already in use"; seen once in a two-lane
    /// run) means a new cluster on new ports.
    async fn start() -> Self {
        for _ in 0..3 {
            if let Some(cluster) = Self::try_start().await {
                return cluster;
            }
        }
        panic!("three private clusters in a row lost a port to another process before binding it");
    }

    /// [`Cluster::start`] once: `None` when a member could not bind its ports.
    async fn try_start() -> Option<Self> {
        let mut members = PrivateCluster::planned(ClusterKind::Etcd);
        let (partition, partition_rx) = watch::channel(None);
        let mut proxies = Vec::new();
        let mut fronts = Vec::new();
        for listen_peer in members.peer_ports() {
            let (pid_tx, pid_rx) = watch::channel(None);
            let upstream: SocketAddr = format!("127.0.0.1:{listen_peer}").parse().unwrap();
            proxies.push(PeerProxy::start(upstream, pid_rx, partition_rx.clone()).await);
            fronts.push(pid_tx);
        }
        // Each member advertises its proxy as its peer address, so every peer link goes
        // through one; a token of its own keeps leftovers of another run out.
        let initial: Vec<String> = (0..3)
            .map(|i| format!("{}=http://{}", members.member(i), proxies[i].addr))
            .collect();
        let token = format!("drill-{:x}", rand::random::<u64>());
        for (i, proxy) in proxies.iter().enumerate() {
            let args = [
                "--initial-advertise-peer-urls".to_owned(),
                format!("http://{}", proxy.addr),
                "--initial-cluster".to_owned(),
                initial.join(","),
                "--initial-cluster-token".to_owned(),
                token.clone(),
            ];
            members.set_member_args(i, &args);
        }
        if let Err(out) = members.start_members(&[0, 1, 2]).await {
            let port_taken = out.contains("already in use")
                || (0..3).any(|i| members.log_tail(i, 50).contains("address already in use"));
            assert!(port_taken, "the private cluster did not start: {out}");
            eprintln!("a member's port was taken before it bound it; new ports: {out}");
            return None;
        }
        for (i, front) in fronts.iter().enumerate() {
            front.send_replace(members.pid(i));
        }
        let cluster = Self {
            members,
            _proxies: proxies,
            partition,
        };
        let until = Instant::now() + SOON;
        while cluster.leader(&[0, 1, 2]).await.is_none() {
            if cluster.lost_a_port() {
                eprintln!(
                    "a member's port was taken before it bound it; new ports:{}",
                    cluster.logs()
                );
                return None;
            }
            assert!(
                Instant::now() < until,
                "the private cluster never elected a leader: {}",
                cluster.logs()
            );
            sleep(Duration::from_millis(100)).await;
        }
        Some(cluster)
    }

    /// Whether a member has exited because one of its ports was in use.
    fn lost_a_port(&self) -> bool {
        (0..3).any(|i| {
            self.members
                .pid(i)
                .is_none_or(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
                && self
                    .members
                    .log_tail(i, 50)
                    .contains("address already in use")
        })
    }

    /// Member `i`'s name (as etcd knows it).
    fn name(&self, i: usize) -> String {
        self.members.member(i)
    }

    /// A URL with every member's endpoint.
    fn url_all(&self) -> String {
        format!("{}?{}", self.members.url(), Backend::Etcd.options())
    }

    fn url(&self, i: usize) -> String {
        format!(
            "{}?{}",
            self.members.url_of(i..i + 1),
            Backend::Etcd.options()
        )
    }

    /// The member the given members agree is the leader (asked with `etcdctl endpoint status`).
    async fn leader(&self, among: &[usize]) -> Option<usize> {
        let endpoints: Vec<String> = among
            .iter()
            .map(|&i| format!("http://127.0.0.1:{}", self.members.ports[i]))
            .collect();
        let out = tokio::process::Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &endpoints.join(",")])
            .args(["--dial-timeout=1s", "--command-timeout=2s"])
            .args(["endpoint", "status", "-w", "json"])
            .kill_on_drop(true)
            .output()
            .await
            .ok()?;
        let serde_json::Value::Array(statuses) = serde_json::from_slice(&out.stdout).ok()? else {
            return None;
        };
        if statuses.len() != among.len() {
            return None;
        }
        let mut leaders = statuses.iter().map(|s| s["Status"]["leader"].as_u64());
        let first = leaders.next()??;
        if first == 0 || leaders.any(|l| l != Some(first)) {
            return None;
        }
        let at = statuses
            .iter()
            .find(|s| s["Status"]["header"]["member_id"].as_u64() == Some(first))?;
        let endpoint = at["Endpoint"].as_str()?;
        among
            .iter()
            .copied()
            .find(|&i| endpoint.ends_with(&format!(":{}", self.members.ports[i])))
    }

    /// The end of each member's log, for a failure message.
    fn logs(&self) -> String {
        let mut out = String::new();
        for i in 0..3 {
            let tail = self.members.log_tail(i, 5);
            out.push_str(&format!("\n--- {} ---\n{tail}", self.name(i)));
        }
        out
    }

    fn isolate(&self, i: usize) {
        self.partition.send_replace(self.members.pid(i));
    }

    fn heal(&self) {
        self.partition.send_replace(None);
    }
}

/// The drills of this file take turns: three private clusters of three members each, with
/// 50 ms heartbeats, on a loaded 2-core machine starve each other — a majority then misses
/// its heartbeats and elects for seconds (no leader, a 1 s waiter lease expiring), which
/// fails a drill's liveness steps for reasons that are the machine's, not the driver's.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A drill that failed poisoned it; the next one still runs alone.
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn etcd_installed() -> bool {
    Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

async fn partitioned_member_holder() {
    let cluster = Cluster::start().await;
    let leader = cluster.leader(&[0, 1, 2]).await.expect("a leader");
    // The holder's member is a follower, so the majority keeps the leader.
    let isolated = (leader + 1) % 3;
    let majority = (leader + 2) % 3;
    let history = History::new("etcd_partitioned_member_holder");
    let key = conformance::fresh_key("drill-partition");
    let log = FencedLog::new();
    let holder = Client::new(&history, "holder", &cluster.url(isolated)).await;
    let contender = Client::new(&history, "contender", &cluster.url(majority)).await;

    let held = holder
        .acquire(&key, WAIT)
        .await
        .expect("the holder acquires");
    let f1 = held.hold.fencing.map_or(0, FencingToken::get);
    assert!(write(&holder.rec, &held.hold, &log, "holder#0"));
    // The contender queues on the majority side.
    let waiting = tokio::spawn(contender.start_acquire(&key, WAIT));
    sleep(TTL / 2).await;
    assert!(!waiting.is_finished(), "granted while held");

    let fault = history.fault(
        "member partitioned from the majority",
        Some(&cluster.name(isolated)),
    );
    let cut = Instant::now();
    cluster.isolate(isolated);
    // The holder writes while it trusts its lease.
    let writer = {
        let (rec, hold, log) = (holder.rec.clone(), held.hold.clone(), Arc::clone(&log));
        let guard_lost = held.guard.lost();
        tokio::spawn(async move {
            let mut lost = std::pin::pin!(guard_lost);
            for n in 1.. {
                tokio::select! {
                    biased;
                    () = &mut lost => return,
                    () = sleep(Duration::from_millis(20)) => {}
                }
                write(&rec, &hold, &log, &format!("holder#{n}"));
            }
        })
    };
    let granted = waiting
        .await
        .unwrap()
        .expect("the majority grants the contender once the holder's lease expired");
    let granted_at = Instant::now();
    // By then the holder must have stopped trusting its lease (and writing).
    let lost_at = if held.guard.is_lost() {
        held.wait_lost(SOON).await
    } else {
        None
    };
    writer.abort();
    let f2 = granted.hold.fencing.map_or(0, FencingToken::get);
    assert!(f2 > f1, "fencing must increase: {f1} then {f2}");
    assert!(write(&contender.rec, &granted.hold, &log, "contender#1"));
    let lost_at = lost_at
        .expect("the partitioned holder still trusted its lease when the contender was granted");
    eprintln!(
        "{}: member {} cut off; holder lost ({:?}) {:?} after the cut, contender granted {:?} \
         after the cut ({:?} after the loss); fence {f1} then {f2}",
        history.name(),
        cluster.name(isolated),
        held.guard.loss_reason(),
        lost_at - cut,
        granted_at - cut,
        granted_at - lost_at,
    );
    assert!(lost_at < granted_at);
    history.note(format!(
        "holder on {} (partitioned); contender on {}",
        cluster.name(isolated),
        cluster.name(majority)
    ));
    assert_eq!(contender.release(granted).await, Some(true));

    cluster.heal();
    fault.heal();
    let _ = holder.release(held).await;
    // Liveness: once healed, the holder's member rejoins and its client can lock again.
    let again = holder
        .acquire(&key, WAIT)
        .await
        .expect("the holder acquires again after the heal");
    assert!(write(&holder.rec, &again.hold, &log, "holder#again"));
    assert_eq!(holder.release(again).await, Some(true));
    finish(&history, &log, &[]);
}

/// The leader is isolated while the holder's client, and a waiter's, talk only to it.
async fn isolated_leader_holder() {
    let cluster = Cluster::start().await;
    let leader = cluster.leader(&[0, 1, 2]).await.expect("a leader");
    let majority = (leader + 1) % 3;
    let history = History::new("etcd_isolated_leader_holder");
    let key = conformance::fresh_key("drill-leader-cut");
    let log = FencedLog::new();
    let holder = Client::new(&history, "holder", &cluster.url(leader)).await;
    let minority = Client::new(&history, "minority-waiter", &cluster.url(leader)).await;
    let contender = Client::new(&history, "contender", &cluster.url(majority)).await;

    let held = holder
        .acquire(&key, WAIT)
        .await
        .expect("the holder acquires");
    let f1 = held.hold.fencing.map_or(0, FencingToken::get);
    assert!(write(&holder.rec, &held.hold, &log, "holder#0"));
    // Both waiters queue before the cut: the one on the leader first.
    let minority_waiting = tokio::spawn({
        let wait = minority.start_acquire(&key, WAIT);
        async move {
            let held = wait.await;
            (Instant::now(), held)
        }
    });
    sleep(TTL / 4).await;
    let waiting = tokio::spawn(contender.start_acquire(&key, WAIT));
    sleep(TTL / 4).await;
    assert!(
        !waiting.is_finished() && !minority_waiting.is_finished(),
        "granted while held"
    );
    held.note_renewals();

    let fault = history.fault(
        "leader partitioned from the other members",
        Some(&cluster.name(leader)),
    );
    let cut = Instant::now();
    cluster.isolate(leader);
    let granted = waiting
        .await
        .unwrap()
        .expect("the majority grants the contender once the holder's lease expired");
    let granted_at = Instant::now();
    let lost_at = if held.guard.is_lost() {
        held.wait_lost(SOON).await
    } else {
        None
    };
    let f2 = granted.hold.fencing.map_or(0, FencingToken::get);
    assert!(f2 > f1, "fencing must increase: {f1} then {f2}");
    assert!(write(&contender.rec, &granted.hold, &log, "contender#1"));
    let lost_at = lost_at.expect(
        "the holder on the isolated leader still trusted its lease when the contender was granted",
    );
    eprintln!(
        "{}: leader {} cut off; holder lost ({:?}) {:?} after the cut, contender granted {:?} \
         after the cut ({:?} after the loss); fence {f1} then {f2}",
        history.name(),
        cluster.name(leader),
        held.guard.loss_reason(),
        lost_at - cut,
        granted_at - cut,
        granted_at - lost_at,
    );
    assert!(lost_at < granted_at);
    // Freed on the majority side while still cut: the waiter on the old leader stays waiting
    // (or fails), it is never granted across the partition.
    assert_eq!(contender.release(granted).await, Some(true));
    sleep(TTL * 2).await;
    let healed = Instant::now();
    cluster.heal();
    fault.heal();
    let _ = holder.release(held).await;
    match tokio::time::timeout(WAIT + SOON, minority_waiting).await {
        Ok(Ok((at, Some(late)))) => {
            assert!(
                at >= healed,
                "the waiter on the isolated leader was granted {:?} before the heal",
                healed - at
            );
            assert!(write(&minority.rec, &late.hold, &log, "minority#1"));
            let _ = minority.release(late).await;
        }
        Ok(Ok((_, None))) => {
            // It gave up during the partition; once healed its client locks again.
            let late = minority
                .acquire(&key, WAIT)
                .await
                .expect("the minority waiter acquires after the heal");
            assert!(write(&minority.rec, &late.hold, &log, "minority#1"));
            assert_eq!(minority.release(late).await, Some(true));
        }
        Ok(Err(e)) => panic!("the minority waiter's task: {e}"),
        Err(_) => panic!("the minority waiter never returned"),
    }
    history.note(format!(
        "holder and a waiter on leader {} (isolated); contender on {}",
        cluster.name(leader),
        cluster.name(majority)
    ));
    let again = holder
        .acquire(&key, WAIT)
        .await
        .expect("the holder acquires again after the heal");
    assert!(write(&holder.rec, &again.hold, &log, "holder#again"));
    assert_eq!(holder.release(again).await, Some(true));
    finish(&history, &log, &[]);
}

/// The same private cluster loses its leader (SIGKILL of our own member, `backends.sh kill`) while a lock
/// is held and a contender waits, both clients knowing every member: with the client requiring
/// a leader, requests refused during the election are retried, the history stays clean, and
/// the contender is granted once the two remaining members have elected a new leader.
async fn leader_killed_while_held() {
    let cluster = Cluster::start().await;
    let history = History::new("etcd_private_cluster_leader_killed");
    let key = conformance::fresh_key("drill-leader-killed");
    let log = FencedLog::new();
    let c1 = Client::new(&history, "c1", &cluster.url_all()).await;
    let c2 = Client::new(&history, "c2", &cluster.url_all()).await;
    let held = c1.acquire(&key, WAIT).await.expect("c1 acquires");
    let f1 = held.hold.fencing.map_or(0, FencingToken::get);
    assert!(write(&c1.rec, &held.hold, &log, "c1#1"));
    let waiting = tokio::spawn(c2.start_acquire(&key, WAIT));
    let leader = cluster.leader(&[0, 1, 2]).await.expect("a leader");
    let fault = history.fault("leader killed", Some(&cluster.name(leader)));
    let killed = Instant::now();
    cluster.members.ctl("kill", leader).await;
    sleep(TTL).await;
    if !held.guard.is_lost() {
        write(&c1.rec, &held.hold, &log, "c1#2");
    }
    let _ = c1.release(held).await;
    let granted = waiting
        .await
        .unwrap()
        .expect("c2 is granted after the re-election");
    let f2 = granted.hold.fencing.map_or(0, FencingToken::get);
    assert!(
        f2 > f1,
        "fencing must increase across the leader change: {f1} then {f2}"
    );
    assert!(write(&c2.rec, &granted.hold, &log, "c2#1"));
    eprintln!(
        "{}: killed {}; c2 granted {:?} after the kill; fence {f1} then {f2}",
        history.name(),
        cluster.name(leader),
        killed.elapsed()
    );
    fault.heal();
    assert_ne!(c2.release(granted).await, Some(false), "c2 lost its lock");
    let again = c1.acquire(&key, WAIT).await.expect("c1 acquires again");
    assert!(write(&c1.rec, &again.hold, &log, "c1#3"));
    assert_eq!(c1.release(again).await, Some(true));
    finish(&history, &log, &[]);
}

#[test]
fn etcd_private_cluster_leader_killed() {
    if conformance::backend_url("DISTLOCK_TEST_ETCD3_URL").is_none() {
        drill_support::skip(
            "private_cluster_leader_killed",
            Backend::Etcd,
            "up3 is not running",
        );
        return;
    }
    assert!(etcd_installed(), "etcd is not installed");
    let _one_cluster_at_a_time = one_at_a_time();
    drill_support::block_on(leader_killed_while_held());
}

#[test]
fn etcd_partitioned_member_holder() {
    if conformance::backend_url("DISTLOCK_TEST_ETCD3_URL").is_none() {
        drill_support::skip(
            "partitioned_member_holder",
            Backend::Etcd,
            "up3 is not running",
        );
        return;
    }
    assert!(etcd_installed(), "etcd is not installed");
    let _one_cluster_at_a_time = one_at_a_time();
    drill_support::block_on(partitioned_member_holder());
}

#[test]
fn etcd_isolated_leader_holder() {
    if conformance::backend_url("DISTLOCK_TEST_ETCD3_URL").is_none() {
        drill_support::skip(
            "isolated_leader_holder",
            Backend::Etcd,
            "up3 is not running",
        );
        return;
    }
    assert!(etcd_installed(), "etcd is not installed");
    let _one_cluster_at_a_time = one_at_a_time();
    drill_support::block_on(isolated_leader_holder());
}
