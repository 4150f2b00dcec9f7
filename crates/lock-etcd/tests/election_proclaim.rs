//! `Leadership::proclaim` and a pushed `Election::observe` on a real etcd
//! (`DISTLOCK_TEST_ETCD_URL`): the proclaimed value is what `etcdctl elect -l` prints, a deposed
//! leader's proclaim changes nothing, and a change is observed long before a 30 s poll.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use std::{process::Stdio, sync::Arc, time::Duration};

use futures::StreamExt;
use lock_core::{DistributedLock, Election, Error};
use lock_etcd::{EtcdLock, EtcdLockConfig};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::Command,
    time::{Instant, timeout},
};

const SLACK: Duration = Duration::from_secs(5);

async fn client(label: &str) -> Option<Arc<EtcdLock>> {
    let url = conformance::backend_url("DISTLOCK_TEST_ETCD_URL")?;
    let mut cfg = EtcdLockConfig::from_url(&url).unwrap();
    cfg.label = Some(label.to_owned());
    Some(Arc::new(EtcdLock::connect(cfg).await.unwrap()))
}

fn fresh(label: &str) -> String {
    format!("{label}-{:016x}", rand::random::<u64>())
}

fn etcdctl_installed() -> bool {
    std::process::Command::new("etcdctl")
        .arg("version")
        .env("ETCDCTL_API", "3")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The leader proclaims: `leader()` and `etcdctl elect -l` show the new value with the same
/// term; a deposed leader's proclaim (its entry deleted, its session lease alive) is refused by
/// the compare and leaves no entry behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proclaim_changes_the_value_etcdctl_sees_and_a_deposed_leader_changes_nothing() {
    let Some(a) = client("a").await else { return };
    let b = client("b").await.unwrap();
    let name = fresh("proclaim");
    let ea = Election::new(a.clone(), &name).unwrap();
    let eb = Election::new(b.clone(), &name).unwrap();
    let lead = ea.campaign(SLACK).await.unwrap();

    let listener = etcdctl_installed().then(|| {
        let endpoint = a.config().endpoints[0].clone();
        let mut child = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints=http://{endpoint}"))
            .args(["elect", "-l", &format!("distlock/election/{name}")])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        (child, lines)
    });
    assert!(
        listener.is_some() || !conformance::backends_required(),
        "etcdctl is not installed but DISTLOCK_REQUIRE_BACKENDS=1"
    );
    let has_listener = listener.is_some();
    let mut listener = listener;
    let mut next_value = async || {
        let (_, lines) = listener.as_mut()?;
        let _key = timeout(SLACK, lines.next_line()).await.ok()?.ok()??;
        timeout(SLACK, lines.next_line()).await.ok()?.ok()?
    };
    if let Some(value) = next_value().await {
        assert!(value.ends_with(" label=a"), "not a's identity");
    }

    let shown = lead.proclaim("scheduler-2").await.unwrap();
    assert!(shown.as_str().ends_with(" label=scheduler-2"), "{shown}");
    let leader = eb.leader().await.unwrap().expect("a leads");
    assert_eq!(leader.term, Some(lead.term()));
    assert_eq!(leader.holder.as_ref(), Some(&shown));
    if has_listener {
        let value = next_value()
            .await
            .expect("etcdctl prints the proclaimed value");
        assert!(
            value.ends_with(shown.as_str()),
            "etcdctl shows the old value"
        );
    }

    // Still the same grant, and not taken for lost: it renews (a data change fired our node's
    // watch, which must not count as its deletion).
    let mut lease = lead.granted_lease().clone();
    let ttl = lease.ttl();
    a.renew(&mut lease, ttl).await.unwrap();
    assert!(!lead.is_lost(), "a proclaim made the leadership lost");

    // Deposed: its entry deleted by an operator while its session lease lives on; b leads.
    assert!(b.force_release(ea.key()).await.unwrap());
    let next = eb.campaign(SLACK).await.unwrap();
    let before = eb.leader().await.unwrap().map(|l| (l.term, l.holder));
    // The driver's compare, whatever the leadership noticed locally.
    let refused = lock_core::raw::relabel(a.as_ref(), lead.granted_lease(), "late").await;
    assert!(matches!(refused, Err(Error::NotHeld { .. })), "{refused:?}");
    let after = eb.leader().await.unwrap().map(|l| (l.term, l.holder));
    assert_eq!(
        after, before,
        "a deposed leader's proclaim changed the leader"
    );
    assert!(next.resign().await.unwrap());
    // No entry of a's came back to lead next.
    assert_eq!(eb.leader().await.unwrap(), None);
}

/// With a 30 s poll interval, a grant, a proclaim and a resign are each observed within a
/// few seconds: etcd pushes them (a watch on the election's range).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_is_pushed_by_a_watch() {
    let Some(watcher) = client("watcher").await else {
        return;
    };
    let leader = client("leader").await.unwrap();
    let name = fresh("observe");
    let observed = Election::new(watcher, &name).unwrap();
    let ours = Election::new(leader, &name).unwrap();
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
    let lead = ours.campaign(SLACK).await.unwrap();
    let (seen, _) = next().await;
    assert_eq!(seen.and_then(|l| l.term), Some(lead.term()));
    lead.proclaim("v2").await.unwrap();
    let (seen, _) = next().await;
    let seen = seen.expect("a leader");
    assert_eq!(seen.term, Some(lead.term()));
    assert!(seen.holder.unwrap().as_str().ends_with(" label=v2"));
    assert!(lead.resign().await.unwrap());
    assert_eq!(next().await.0, None);
}
