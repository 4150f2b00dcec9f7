//! `Leadership::proclaim` and a pushed `Election::observe` on the local ZooKeeper
//! (`DISTLOCK_TEST_ZK_URL`): the proclaimed value is the data of our node — what Curator's
//! `LeaderSelector.getLeader()` reads as the leader's participant id (the data of the first
//! contender node) — a deposed leader's proclaim changes nothing, and a change is observed long
//! before a 30 s poll.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use futures::StreamExt;
use lock_core::{DistributedLock, Election, Error};
use lock_zk::{ZkLock, ZkLockConfig};
use tokio::time::{Instant, timeout};
use zookeeper_client as zk;

const ROOT: &str = "/distlock-test";
const SLACK: Duration = Duration::from_secs(5);

fn config(url: &str, label: &str) -> ZkLockConfig {
    let mut config = ZkLockConfig::from_url(url).unwrap();
    config.root = ROOT.into();
    config.label = Some(label.into());
    config
}

async fn clients(labels: &[&str]) -> Option<(Vec<Arc<ZkLock>>, zk::Client)> {
    let url = conformance::backend_url("DISTLOCK_TEST_ZK_URL")?;
    let mut out = Vec::new();
    for label in labels {
        out.push(Arc::new(
            ZkLock::connect(config(&url, label)).await.unwrap(),
        ));
    }
    let raw = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(5))
        .connect(&config(&url, "raw").hosts)
        .await
        .unwrap();
    Some((out, raw))
}

fn fresh(label: &str) -> String {
    format!("{label}-{:016x}", rand::random::<u64>())
}

/// The data of the first contender under `dir`: what Curator's `getLeader()` reports.
async fn first_data(raw: &zk::Client, dir: &str) -> String {
    let mut nodes = raw.list_children(dir).await.unwrap();
    nodes.sort_by(|a, b| a[a.len() - 10..].cmp(&b[b.len() - 10..]));
    let (data, _) = raw.get_data(&format!("{dir}/{}", nodes[0])).await.unwrap();
    String::from_utf8(data).unwrap()
}

/// The leader proclaims: `leader()` and the node's data show the new value with the same term;
/// a deposed leader's proclaim (its node deleted by an operator, its session alive) is refused
/// and the new leader's value is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proclaim_changes_the_node_data_and_a_deposed_leader_changes_nothing() {
    let Some((locks, raw)) = clients(&["a", "b"]).await else {
        return;
    };
    let (a, b) = (&locks[0], &locks[1]);
    let name = fresh("proclaim");
    let dir = format!("{ROOT}/election/{name}");
    let ea = Election::new(a.clone(), &name).unwrap();
    let eb = Election::new(b.clone(), &name).unwrap();
    let lead = ea.campaign(SLACK).await.unwrap();
    assert_eq!(
        first_data(&raw, &dir).await,
        "a",
        "the node's data is the value alone"
    );
    lead.proclaim("scheduler-2").await.unwrap();
    assert_eq!(first_data(&raw, &dir).await, "scheduler-2");
    // Twice: the node's version moved on, the grant did not.
    let shown = lead.proclaim("scheduler-3").await.unwrap();
    assert_eq!(first_data(&raw, &dir).await, "scheduler-3");
    let leader = eb.leader().await.unwrap().expect("a leads");
    assert_eq!(leader.term, Some(lead.term()));
    assert_eq!(leader.value.as_deref(), Some("scheduler-3"));
    assert_eq!(leader.holder.as_ref(), Some(&shown));
    // Still the same grant, and not taken for lost: it renews (a data change fired our node's
    // watch, which must not count as its deletion).
    let mut lease = lead.granted_lease().clone();
    let ttl = lease.ttl();
    a.renew(&mut lease, ttl).await.unwrap();
    assert!(!lead.is_lost(), "a proclaim made the leadership lost");

    assert!(b.force_release(ea.key()).await.unwrap());
    let next = eb.campaign(SLACK).await.unwrap();
    let before = eb.leader().await.unwrap().map(|l| (l.term, l.holder));
    let refused = lock_core::raw::relabel(a.as_ref(), lead.granted_lease(), "late").await;
    assert!(matches!(refused, Err(Error::NotHeld { .. })), "{refused:?}");
    let after = eb.leader().await.unwrap().map(|l| (l.term, l.holder));
    assert_eq!(
        after, before,
        "a deposed leader's proclaim changed the leader"
    );
    assert_eq!(first_data(&raw, &dir).await, "b");
    assert!(next.resign().await.unwrap());
}

/// With a 30 s poll interval, a grant, a proclaim and a resign are each observed within a few
/// seconds: ZooKeeper pushes them (a child watch on the lock directory, a data watch on its
/// first contender, re-armed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_is_pushed_by_watches() {
    let Some((locks, _raw)) = clients(&["watcher", "leader"]).await else {
        return;
    };
    let name = fresh("observe");
    let observed = Election::new(locks[0].clone(), &name).unwrap();
    let ours = Election::new(locks[1].clone(), &name).unwrap();
    let mut changes = Box::pin(observed.observe(Duration::from_secs(30)));
    let mut next = async || {
        let started = Instant::now();
        let item = timeout(SLACK, changes.next())
            .await
            .expect("observed before the 30 s poll: pushed")
            .expect("the stream goes on")
            .unwrap();
        (item, started.elapsed())
    };
    assert_eq!(next().await.0, None);
    for round in 0..2 {
        let lead = ours.campaign(SLACK).await.unwrap();
        let (seen, _) = next().await;
        assert_eq!(
            seen.and_then(|l| l.term),
            Some(lead.term()),
            "round {round}"
        );
        lead.proclaim("v2").await.unwrap();
        let (seen, _) = next().await;
        let seen = seen.expect("a leader");
        assert_eq!(seen.term, Some(lead.term()));
        assert_eq!(seen.value.as_deref(), Some("v2"));
        assert!(seen.holder.unwrap().as_str().ends_with(" label=v2"));
        assert!(lead.resign().await.unwrap());
        assert_eq!(next().await.0, None, "round {round}");
    }
}
