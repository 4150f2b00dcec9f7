//! Job mode's `at_least` on ZooKeeper, where the lease is the session: the keep marker
//! (`crate::renew::KeptMarker` in lock-zk) as the servers hold it. On the single server of
//! `backends.sh up` (`extendedTypesEnabled=true`) it is a TTL node the server deletes by itself;
//! on the ensemble of `backends.sh up3` (ZooKeeper's default, no TTL nodes) a persistent node the
//! next acquirer deletes once the leader's clock has passed it. Either way nobody is granted the
//! key before `at_least` from the grant, with the holder's client gone.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

use support::{ROOT, SESSION, children, config, plain_key, raw_client};

use std::{sync::Arc, time::Duration};

use conformance::backend_url;
use futures::future::join_all;
use lock_core::{DistributedLock, DistributedLockExt, FencingToken, LockKey};
use lock_zk::{ZkLock, ZkLockConfig};
use tokio::time::{Instant, sleep};
use zookeeper_client as zk;

const AT_LEAST: Duration = Duration::from_secs(2);
const SLACK: Duration = Duration::from_secs(10);
/// The marker's name in the lock directory.
const KEEP: &str = "%keep";

/// The servers' `znode.container.checkIntervalMs` (`backends.sh`): how late after its TTL the
/// leader deletes a TTL node.
const CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// A job that ends at once under `at_least` on a client that is then dropped (its session
/// closed, its node gone with it): returns the time the job was asked for.
async fn kept_job(config: &ZkLockConfig, key: &LockKey, at_least: Duration) -> Instant {
    let holder = Arc::new(ZkLock::connect(config.clone()).await.unwrap());
    let start = Instant::now();
    let ran = holder
        .lock(key)
        .ttl(SESSION)
        .at_least(at_least)
        .run(|_| async {})
        .await
        .unwrap();
    assert_eq!(ran, Some(()));
    drop(holder);
    start
}

async fn marker(raw: &zk::Client, key: &LockKey) -> Option<zk::Stat> {
    raw.check_stat(&format!("{ROOT}/{key}/{KEEP}"))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_server_with_ttl_nodes_the_server_deletes_the_marker_itself() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let key = plain_key();
    let start = kept_job(&config, &key, AT_LEAST).await;
    // The holder's node went with its client; the marker alone holds the lock.
    assert_eq!(children(&raw, &format!("{ROOT}/{key}")).await, [KEEP]);
    let other = ZkLock::connect(config.clone()).await.unwrap();
    let shown = other
        .inspect(&key)
        .await
        .unwrap()
        .expect("held by the marker");
    assert!(shown.fencing_token.is_some(), "{shown:?}");
    assert!(other.try_acquire(&key, SESSION).await.unwrap().is_none());
    // Nobody asks again: the server alone removes it, never before at_least.
    let gone = loop {
        if marker(&raw, &key).await.is_none() {
            break Instant::now();
        }
        assert!(
            start.elapsed() < AT_LEAST + CHECK_INTERVAL + SLACK,
            "the server kept the marker"
        );
        sleep(Duration::from_millis(100)).await;
    };
    assert!(
        gone >= start + AT_LEAST,
        "deleted {:?} after the job",
        gone - start
    );
    assert_eq!(other.inspect(&key).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_ttl_nodes_the_marker_stays_until_the_next_acquirer_deletes_it() {
    let Some(url) = backend_url("DISTLOCK_TEST_ZK3_URL") else {
        return;
    };
    let mut config = ZkLockConfig::from_url(&url).unwrap();
    config.session_timeout = SESSION;
    config.root = ROOT.into();
    let raw = raw_client(&config).await;
    let key = plain_key();
    let start = kept_job(&config, &key, AT_LEAST).await;
    assert!(
        marker(&raw, &key).await.is_some(),
        "no keep marker after the job"
    );
    let next = Arc::new(ZkLock::connect(config.clone()).await.unwrap());
    assert!(next.try_acquire(&key, SESSION).await.unwrap().is_none());
    // No TTL node: the marker is still there well after the leader's container checks would
    // have deleted one (clients cannot tell the two kinds apart by their Stat).
    sleep((start + AT_LEAST + CHECK_INTERVAL * 3).saturating_duration_since(Instant::now())).await;
    assert!(
        marker(&raw, &key).await.is_some(),
        "the persistent marker was deleted"
    );
    let lease = next
        .acquire(&key, SESSION, Instant::now() + SLACK)
        .await
        .unwrap();
    assert!(
        marker(&raw, &key).await.is_none(),
        "the marker outlived the next grant"
    );
    assert!(next.release(&lease).await.unwrap());
    // A release after at_least leaves no marker behind either.
    let start = Instant::now();
    let guard = next
        .lock(&key)
        .ttl(SESSION)
        .at_least(Duration::from_millis(300))
        .acquire()
        .await
        .unwrap();
    assert!(
        marker(&raw, &key).await.is_some(),
        "no marker while the job runs"
    );
    sleep(Duration::from_millis(400).saturating_sub(start.elapsed())).await;
    assert!(guard.release().await.unwrap());
    assert!(marker(&raw, &key).await.is_none());
    assert!(next.try_acquire(&key, SESSION).await.unwrap().is_some());
}

/// The server's TTL sweep lists the TTL nodes that have passed, then posts their deletes one by
/// one behind the emptied lock directories of the same pass (6 ms apart), and such a delete
/// checks only that the path holds a childless TTL node. A grant that replaced a passed marker
/// in between once lost its new marker to the delete meant for the old one (the periodic job of
/// `same_job_every_backend` ran twice in a period). On a private server, between two checks: a
/// marker passes and 400 lock directories are emptied; as soon as the pass that lists them
/// begins, the next grant with `at_least` replaces the marker — and nobody is granted before
/// that `at_least`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_outlives_the_sweep_of_the_one_it_replaced() {
    use conformance::servers::{PrivateServer, ServerKind, free_port};
    if config().is_none() {
        return;
    }
    let server = PrivateServer::start(ServerKind::Zk, free_port()).await;
    let mut config = ZkLockConfig::from_url(&server.url()).unwrap();
    config.session_timeout = SESSION;
    config.root = ROOT.into();
    let raw = raw_client(&config).await;
    let open = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    let container = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
    raw.create("/emptied", b"", &open).await.unwrap();
    let other = ZkLock::connect(config.clone()).await.unwrap();
    let at_least = Duration::from_secs(3);
    for round in 0..3 {
        let key = plain_key();
        // The sweep's phase: an emptied probe directory goes at the next check (every second).
        let probe = format!("/emptied/probe{round}");
        raw.create(&probe, b"", &container).await.unwrap();
        raw.create(&format!("{probe}/x"), b"", &open).await.unwrap();
        raw.delete(&format!("{probe}/x"), None).await.unwrap();
        while raw.check_stat(&probe).await.unwrap().is_some() {
            sleep(Duration::from_millis(5)).await;
        }
        // Before the next check: a marker that passes, and 400 emptied directories (a pass of
        // 2.4 s, which lists the passed marker among them).
        kept_job(&config, &key, Duration::from_millis(300)).await;
        let dirs: Vec<String> = (0..400).map(|i| format!("/emptied/r{round}-{i}")).collect();
        let children: Vec<String> = dirs.iter().map(|d| format!("{d}/x")).collect();
        join_all(dirs.iter().map(|d| raw.create(d, b"", &container))).await;
        join_all(children.iter().map(|c| raw.create(c, b"", &open))).await;
        join_all(children.iter().map(|c| raw.delete(c, None))).await;
        // The pass has begun once one of them is gone.
        while raw.list_children("/emptied").await.unwrap().len() == dirs.len() {
            sleep(Duration::from_millis(5)).await;
        }
        let start = kept_job(&config, &key, at_least).await;
        while start.elapsed() < at_least - Duration::from_millis(300) {
            if other.try_acquire(&key, SESSION).await.unwrap().is_some() {
                panic!(
                    "round {round}: granted {:?} after a grant kept for {at_least:?}",
                    start.elapsed()
                );
            }
            sleep(Duration::from_millis(50)).await;
        }
        // The next round's pass starts clean.
        while !raw.list_children("/emptied").await.unwrap().is_empty() {
            sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_release_frees_a_kept_lock() {
    let Some(config) = config() else { return };
    let key = plain_key();
    kept_job(&config, &key, Duration::from_secs(60)).await;
    let admin = ZkLock::connect(config.clone()).await.unwrap();
    let kept = admin.inspect(&key).await.unwrap().expect("kept");
    let fence = kept.fencing_token.expect("the keeper's fencing token");
    let other = FencingToken(fence.0 + 1);
    assert!(!admin.force_release_grant(&key, other).await.unwrap());
    assert!(admin.force_release_grant(&key, fence).await.unwrap());
    assert!(admin.try_acquire(&key, SESSION).await.unwrap().is_some());
}

/// A lease's `acquired_at` on ZooKeeper is the session's vouched send time, up to about half a
/// session timeout before the grant on an idle session: `at_least` still counts from the grant
/// (the guard's start), so the job's lock is kept for all of it, not released at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_counts_from_the_grant_on_a_session_that_was_idle() {
    let Some(mut config) = config() else { return };
    config.session_timeout = Duration::from_secs(8);
    let holder = Arc::new(ZkLock::connect(config.clone()).await.unwrap());
    // Idle: the vouched send time falls behind (heartbeats every quarter timeout).
    sleep(Duration::from_secs(3)).await;
    let key = plain_key();
    let start = Instant::now();
    let guard = holder
        .lock(&key)
        .ttl(config.session_timeout)
        .at_least(AT_LEAST)
        .acquire()
        .await
        .unwrap();
    let behind = start.saturating_duration_since(guard.granted_lease().acquired_at());
    assert!(guard.release().await.unwrap());
    let other = ZkLock::connect(config.clone()).await.unwrap();
    let free = other
        .try_acquire(&key, config.session_timeout)
        .await
        .unwrap();
    assert!(
        free.is_none() || start.elapsed() >= AT_LEAST,
        "free {:?} after a job with at_least {AT_LEAST:?} (its lease counted from {behind:?} before the request)",
        start.elapsed()
    );
}
