//! Drill 6: coordinators that replicate.
//!
//! * `etcd_leader_loss` / `zk_leader_loss`: a lock is held on the 3-member cluster of
//!   `backends.sh up3` (`DISTLOCK_TEST_{ETCD3,ZK3}_URL`); its current leader is SIGKILLed while
//!   a contender waits; the history must stay clean (no double holder, fencing monotonic) and
//!   every client acquires again after re-election; the member is started again at the end.
//! * `redis_replica_failover`: a measured demonstration of the unsafety lock-redis documents
//!   ("a replica is promoted … the lock itself may be granted twice"), on a private primary and a
//!   private replica whose replication link runs through the drill proxy: the link is
//!   partitioned (asynchronous replication lagging), c1 is granted on the primary, the replica is
//!   promoted (`REPLICAOF NO ONE`) and c2 is granted the same lock on it while c1 still holds.
//!   The fence counter was replicated before the partition, so c2 gets the same fencing token as
//!   c1 and the fenced resource rejects c2's write. The only violations allowed are the
//!   documented ones (`DoubleGrant`, `FencingNotIncreasing`), and they must show.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::time::Duration;

use conformance::{
    drill::{History, Proxy, Rule},
    servers::{ServerKind, free_port},
};
use drill_support::{
    Backend, Client, FencedLog, PrivateServer, SOON, TTL, backends, finish, with_query, write,
};
use lock_core::FencingToken;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    process::Command,
    time::{Instant, sleep},
};

const WAIT: Duration = Duration::from_secs(30);
/// The members of the `up3` cluster at `url` (`etcd://h:p,h:p,h:p`): each one's client port and
/// `backends.sh` instance name (`<prefix>-<i>`, in the order of the URL, which `backends.sh env`
/// writes in the order of its port list).
fn members(url: &str, prefix: &str) -> Vec<(u16, String)> {
    let hosts = url.split_once("://").map_or(url, |(_, rest)| rest);
    let hosts = hosts.split(['/', '?']).next().unwrap_or_default();
    hosts
        .split(',')
        .enumerate()
        .map(|(i, host)| {
            let port = host
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse().ok())
                .unwrap_or_else(|| panic!("no port in {host:?} of {url}"));
            (port, format!("{prefix}-{}", i + 1))
        })
        .collect()
}

/// Starts a killed cluster member again, even when the drill fails half-way.
struct RestartOnDrop(Option<String>);

impl Drop for RestartOnDrop {
    fn drop(&mut self) {
        if let Some(name) = self.0.take() {
            let _ = std::process::Command::new(drill_support::backends_sh())
                .args(["start", &name])
                .output();
        }
    }
}

async fn etcd_leader(members: &[(u16, String)]) -> String {
    let endpoints: Vec<String> = members
        .iter()
        .map(|(p, _)| format!("http://127.0.0.1:{p}"))
        .collect();
    let deadline = Instant::now() + SOON;
    loop {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args([
                "--endpoints",
                &endpoints.join(","),
                "endpoint",
                "status",
                "-w",
                "json",
            ])
            .output()
            .await
            .expect("etcdctl");
        if let Ok(serde_json::Value::Array(statuses)) = serde_json::from_slice(&out.stdout) {
            for s in statuses {
                let member = s["Status"]["header"]["member_id"].as_u64();
                let leader = s["Status"]["leader"].as_u64();
                if member.is_some() && member == leader {
                    let endpoint = s["Endpoint"].as_str().unwrap_or("");
                    if let Some((_, name)) = members
                        .iter()
                        .find(|(p, _)| endpoint.ends_with(&format!(":{p}")))
                    {
                        return name.clone();
                    }
                }
            }
        }
        assert!(Instant::now() < deadline, "no etcd leader found");
        sleep(Duration::from_millis(100)).await;
    }
}

async fn zk_mode(port: u16) -> String {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    let _ = s.write_all(b"srvr").await;
    let mut out = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut out)).await;
    out
}

async fn zk_leader(members: &[(u16, String)]) -> String {
    let deadline = Instant::now() + SOON;
    loop {
        for (port, name) in members {
            if zk_mode(*port).await.contains("Mode: leader") {
                return name.clone();
            }
        }
        assert!(Instant::now() < deadline, "no ZooKeeper leader found");
        sleep(Duration::from_millis(100)).await;
    }
}

async fn leader_loss(backend: Backend, url: String, members: Vec<(u16, String)>) {
    let history = History::new(format!("{}_cluster_leader_loss", backend.name()));
    let key = conformance::fresh_key("drill-leader");
    let log = FencedLog::new();
    let c1 = Client::new(&history, "c1", &url).await;
    let c2 = Client::new(&history, "c2", &url).await;

    let held1 = c1.acquire(&key, WAIT).await.expect("c1 acquires");
    let f1 = held1.hold.fencing.map_or(0, FencingToken::get);
    assert!(write(&c1.rec, &held1.hold, &log, "c1#1"));

    let leader = match backend {
        Backend::Etcd => etcd_leader(&members).await,
        _ => zk_leader(&members).await,
    };
    let contender = tokio::spawn(c2.start_acquire(&key, WAIT));
    let fault = history.fault("leader killed", Some(&leader));
    let mut restart = RestartOnDrop(Some(leader.clone()));
    let killed = Instant::now();
    backends(&[], &["kill", &leader]).await;

    // c1 keeps working while it trusts its lease, then releases.
    sleep(TTL).await;
    let kept = !held1.guard.is_lost();
    if kept {
        write(&c1.rec, &held1.hold, &log, "c1#2");
    }
    let released = c1.release(held1).await;
    let held2 = contender
        .await
        .unwrap()
        .expect("c2 is granted after re-election");
    let granted = killed.elapsed();
    let f2 = held2.hold.fencing.map_or(0, FencingToken::get);
    assert!(
        f2 > f1,
        "fencing must increase across the leader change: {f1} then {f2}"
    );
    assert!(write(&c2.rec, &held2.hold, &log, "c2#1"));

    backends(&[], &["start", &leader]).await;
    restart.0 = None;
    fault.heal();
    eprintln!(
        "{}: killed leader {leader}; c1 {} (release returned {released:?}); c2 granted {granted:?} after the kill; fence {f1} then {f2}",
        history.name(),
        if kept {
            "kept its lease past one TTL"
        } else {
            "lost its lease"
        },
    );
    history.note(format!("killed leader {leader}; c1 kept its lease: {kept}"));
    // Right after the member's return a release may still fail with a temporary error (recorded;
    // the lease then ends by its TTL), but it must never report that c2 had lost the lock.
    assert_ne!(c2.release(held2).await, Some(false), "c2 lost its lock");
    // Liveness after re-election and the member's return.
    let again = c1.acquire(&key, WAIT).await.expect("c1 acquires again");
    assert!(write(&c1.rec, &again.hold, &log, "c1#3"));
    assert_eq!(c1.release(again).await, Some(true));
    finish(&history, &log, &[]);
}

#[test]
fn etcd_leader_loss() {
    let Some(url) = conformance::backend_url("DISTLOCK_TEST_ETCD3_URL") else {
        drill_support::skip("cluster_leader_loss", Backend::Etcd, "up3 is not running");
        return;
    };
    let members = members(&url, "etcd3");
    let url = with_query(&url, Backend::Etcd.options());
    drill_support::block_on(leader_loss(Backend::Etcd, url, members));
}

#[test]
fn zk_leader_loss() {
    let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK3_URL") else {
        drill_support::skip("cluster_leader_loss", Backend::Zk, "up3 is not running");
        return;
    };
    let members = members(&url, "zk3");
    let url = with_query(&url, Backend::Zk.options());
    drill_support::block_on(leader_loss(Backend::Zk, url, members));
}

// No leader-loss drill for Redis or PostgreSQL: Redis has no quorum (its failover is
// `redis_replica_failover`) and the test PostgreSQL is a single server. (An always-ignored
// empty test used to stand here; a test with nothing to run could not fail.)

async fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .await
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn redis_failover() {
    let primary = PrivateServer::start(Backend::Redis, free_port()).await;
    let proxy = Proxy::start(([127, 0, 0, 1], primary.port()).into())
        .await
        .expect("proxy");
    // The replica follows the primary through the proxy, whose blackhole partitions the link.
    let proxied = proxy.addr().port().to_string();
    let replica = conformance::servers::PrivateServer::start_with(
        ServerKind::Redis,
        free_port(),
        &["--replicaof", "127.0.0.1", &proxied],
    )
    .await;
    let replica_port = replica.port;
    let deadline = Instant::now() + SOON;
    while !redis_cli(replica_port, &["info", "replication"])
        .await
        .contains("master_link_status:up")
    {
        assert!(Instant::now() < deadline, "the replica did not link up");
        sleep(Duration::from_millis(20)).await;
    }

    let history = History::new("redis_replica_failover");
    let key = conformance::fresh_key("drill-failover");
    let log = FencedLog::new();
    let c1 = Client::new(&history, "c1", &primary.url()).await;
    // One grant first: the fence counter exists and is replicated.
    let warm = c1.acquire(&key, WAIT).await.expect("warm-up");
    assert_eq!(c1.release(warm).await, Some(true));
    while !redis_cli(replica_port, &["dbsize"])
        .await
        .trim()
        .starts_with('1')
    {
        assert!(Instant::now() < deadline, "the counter did not replicate");
        sleep(Duration::from_millis(10)).await;
    }

    // Replication lags (the link is partitioned); c1 is granted on the primary.
    proxy.blackhole();
    let fault = history.fault(
        "replication link partitioned, replica promoted",
        Some("redis"),
    );
    let held1 = c1
        .acquire(&key, WAIT)
        .await
        .expect("c1 acquires on the primary");
    let f1 = held1.hold.fencing.map_or(0, FencingToken::get);
    assert!(write(&c1.rec, &held1.hold, &log, "c1#1"));
    // Failover: the replica is promoted and clients move to it.
    assert!(
        redis_cli(replica_port, &["replicaof", "no", "one"])
            .await
            .contains("OK")
    );
    let replica_url = with_query(
        &format!("redis://127.0.0.1:{replica_port}"),
        Backend::Redis.options(),
    );
    let c2 = Client::new(&history, "c2", &replica_url).await;
    let op = c2.rec.acquire(&key, TTL);
    let second = lock_core::DistributedLock::try_acquire(&*c2.lock, &key, TTL).await;
    let two_holders = matches!(second, Ok(Some(_)));
    let c1_still_trusts = !held1.guard.is_lost();
    let mut f2 = None;
    match second {
        Ok(Some(lease)) => {
            op.granted(&lease);
            f2 = lease.fencing_token().map(FencingToken::get);
            let hold = conformance::drill::Hold::from(&lease);
            let accepted = write(&c2.rec, &hold, &log, "c2#1");
            eprintln!(
                "redis_replica_failover: second grant on the promoted replica while c1 {} — fence {f1} and {f2:?}; c2's write {}",
                if c1_still_trusts {
                    "still trusted its lease"
                } else {
                    "had lost"
                },
                if accepted {
                    "ACCEPTED"
                } else {
                    "rejected by the fenced resource"
                }
            );
            assert!(
                !accepted,
                "the counter survived the failover (replicated before the partition), so the \
                 fenced resource must reject the second holder's write"
            );
            let release = c2.rec.release(&hold);
            match lock_core::DistributedLock::release(&*c2.lock, &lease).await {
                Ok(r) => release.released(r),
                Err(e) => release.error(&e),
            }
        }
        Ok(None) => op.busy(),
        Err(e) => op.error(&e),
    }
    history.note(format!(
        "promoted replica granted the lock again: {two_holders}; fence {f1} then {f2:?}"
    ));
    // The old primary dies; c1 stops trusting its lease by its local deadline.
    primary.ctl("kill").await;
    assert!(
        held1.wait_lost(SOON).await.is_some(),
        "c1 must stop trusting its lease once the primary is gone"
    );
    let _ = c1.release(held1).await;
    proxy.pass();
    fault.heal();
    // Liveness on the new primary.
    let c3 = Client::new(&history, "c3", &replica_url).await;
    let held3 = c3
        .acquire(&key, WAIT)
        .await
        .expect("c3 acquires on the new primary");
    let _ = write(&c3.rec, &held3.hold, &log, "c3#1");
    assert_eq!(c3.release(held3).await, Some(true));

    let violations = finish(
        &history,
        &log,
        &[Rule::DoubleGrant, Rule::FencingNotIncreasing],
    );
    assert!(
        two_holders,
        "expected the documented unsafety: the promoted replica grants the lock again"
    );
    assert!(
        violations
            .iter()
            .any(|v| v.rule == Rule::FencingNotIncreasing),
        "the second grant reuses the fencing token: {violations:#?}"
    );
    let readme = include_str!("../../crates/lock-redis/README.md");
    assert!(
        readme.contains("a replica is promoted")
            && readme.contains("the lock itself may be granted twice"),
        "lock-redis's README must document that a failover can grant the lock twice"
    );
    drop(replica);
}

#[test]
fn redis_replica_failover() {
    if conformance::backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        drill_support::skip("replica_failover", Backend::Redis, "no Redis here");
        return;
    }
    drill_support::block_on(redis_failover());
}
