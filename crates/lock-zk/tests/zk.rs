//! ZooKeeper-specific behaviour against the local server (`DISTLOCK_TEST_ZK_URL`): loss reports,
//! session expiry, and interoperation with Apache Curator's InterProcessMutex node layout.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

use support::{ROOT, SESSION, children, config, plain_key, raw_client};

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use conformance::fresh_key;
use lock_core::{DistributedLock, DistributedLockExt, Error, LossReason};
use lock_zk::ZkLock;
use tokio::time::{Instant, timeout};
use zookeeper_client as zk;

const SLACK: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_deleted_from_outside_fires_lost() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let a = Arc::new(ZkLock::connect(config.clone()).await.unwrap());
    let key = plain_key();
    let dir = format!("{ROOT}/{key}");
    let guard = a
        .lock(&key)
        .ttl(SESSION)
        .try_acquire()
        .await
        .unwrap()
        .unwrap();
    let mut lease = guard.granted_lease().clone();
    let nodes = children(&raw, &dir).await;
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    // Curator's layout: _c_<uuid>-lock-<10-digit sequence>
    let name = &nodes[0];
    assert!(
        name.starts_with("_c_") && name[39..].starts_with("-lock-") && name.len() == 55,
        "{name}"
    );
    raw.delete(&format!("{dir}/{name}"), None).await.unwrap();
    let start = Instant::now();
    timeout(SLACK, guard.lost())
        .await
        .expect("lost() must fire");
    assert_eq!(guard.loss_reason(), Some(LossReason::Revoked));
    assert!(start.elapsed() < SESSION, "lost took {:?}", start.elapsed());
    assert!(matches!(
        a.renew(&mut lease, SESSION).await,
        Err(Error::NotHeld { .. })
    ));
    assert!(!guard.release().await.unwrap());
    // The client itself is fine: it takes the key again.
    let again = a
        .try_acquire(&key, SESSION)
        .await
        .unwrap()
        .expect("free again");
    assert!(again.fencing_token() > lease.fencing_token());
    assert!(a.release(&again).await.unwrap());
}

/// Issue 24: the guards of one client are one renewal group (its session): they renew
/// together — every guard's renewals follow its session's syncs — for several sessions'
/// length, and a node deleted from outside loses that guard alone (pushed by its watch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guards_of_one_session_renew_as_one_group_and_lose_alone() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let a = Arc::new(ZkLock::connect(config.clone()).await.unwrap());
    let keys: Vec<_> = (0..20).map(|_| plain_key()).collect();
    let mut guards = Vec::new();
    for key in &keys {
        let guard = a.lock(key).ttl(SESSION).try_acquire().await.unwrap();
        guards.push(guard.expect("a fresh key is free"));
    }
    let one = a.renewal_group(guards[0].granted_lease()).expect("grouped");
    let other = a
        .renewal_group(guards[19].granted_lease())
        .expect("grouped");
    assert_eq!(one.id(), other.id(), "one session, one group");
    tokio::time::sleep(SESSION * 3).await;
    for (g, k) in guards.iter().zip(&keys) {
        assert!(!g.is_lost(), "{k}: {:?}", g.loss_reason());
        assert!(g.renewals() >= 3, "{k}: {} renewals", g.renewals());
    }

    let dir = format!("{ROOT}/{}", keys[7]);
    let nodes = children(&raw, &dir).await;
    raw.delete(&format!("{dir}/{}", nodes[0]), None)
        .await
        .unwrap();
    timeout(SLACK, guards[7].lost())
        .await
        .expect("the deletion was not pushed");
    assert_eq!(guards[7].loss_reason(), Some(LossReason::Revoked));
    tokio::time::sleep(SESSION * 2).await;
    for (i, g) in guards.iter().enumerate() {
        assert_eq!(g.is_lost(), i == 7, "{}: {:?}", keys[i], g.loss_reason());
    }
    for g in guards {
        g.release().await.unwrap();
    }
}

/// A TCP proxy to the server whose traffic can be blackholed (bytes dropped, connection kept).
struct Proxy {
    port: u16,
    blackhole: Arc<AtomicBool>,
}

impl Proxy {
    async fn start(upstream: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let blackhole = Arc::new(AtomicBool::new(false));
        let hole = blackhole.clone();
        tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let Ok(up) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (dr, dw) = down.into_split();
                let (ur, uw) = up.into_split();
                tokio::spawn(pump(dr, uw, hole.clone()));
                tokio::spawn(pump(ur, dw, hole.clone()));
            }
        });
        Self { port, blackhole }
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    blackhole: Arc<AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if !blackhole.load(Ordering::SeqCst) && to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_holder_loses_before_its_session_expires_and_the_next_token_is_larger() {
    let Some(config) = config() else { return };
    let proxy = Proxy::start(config.hosts.split(',').next().unwrap().to_owned()).await;
    let mut via_proxy = config.clone();
    via_proxy.hosts = format!("127.0.0.1:{}", proxy.port);
    via_proxy.timeout = SESSION;
    let a = Arc::new(ZkLock::connect(via_proxy).await.unwrap());
    let b = Arc::new(ZkLock::connect(config.clone()).await.unwrap());
    let key = fresh_key("partition");
    // A TTL far longer than the session: the session, not the TTL, bounds the holder's trust.
    let guard = a
        .lock(&key)
        .ttl(SESSION * 30)
        .try_acquire()
        .await
        .unwrap()
        .unwrap();
    let old = guard.granted_lease().clone();
    // Whether a still trusted its lock is judged when the waiter's acquire returns (audit F5: a
    // timestamp taken after awaiting `lost()` left a margin of the drift margin): the lost token,
    // or the local deadline, which only moves forward, so its final value bounds every earlier one.
    let a_lost = guard.lost_token();
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move {
            let l = b.acquire(&key, SESSION, Instant::now() + SLACK * 2).await;
            (Instant::now(), a_lost.is_cancelled(), l)
        })
    };
    tokio::time::sleep(SESSION / 2).await;
    let cut_at = Instant::now();
    proxy.blackhole.store(true, Ordering::SeqCst);
    let lost_reason = {
        timeout(SLACK, guard.lost())
            .await
            .expect("lost() must fire while partitioned");
        guard.loss_reason()
    };
    let (granted_at, lost_before_grant, new) = waiter.await.unwrap();
    let new = new.expect("the waiter gets the lock once the server expired a's session");
    let deadline = guard.local_deadline();
    // Nothing answered after the cut, so no renewal (a renewal group's included) can have
    // moved the deadline past what a request sent before it proves.
    assert!(
        deadline <= cut_at + SESSION,
        "the local deadline moved {:?} past the session's last provable instant",
        deadline.saturating_duration_since(cut_at + SESSION)
    );
    assert!(
        lost_before_grant || deadline <= granted_at,
        "the partitioned holder still trusted its lock {:?} after the waiter got it",
        deadline.saturating_duration_since(granted_at)
    );
    assert!(
        granted_at >= cut_at + SESSION / 2,
        "granted before the session could expire"
    );
    assert!(
        matches!(
            lost_reason,
            Some(LossReason::DeadlinePassed | LossReason::SessionExpired)
        ),
        "{lost_reason:?}"
    );
    assert!(new.fencing_token().unwrap() > old.fencing_token().unwrap());
    // Heal: a learns its session expired, cannot renew or release the stale lease, and works
    // again with a new session.
    proxy.blackhole.store(false, Ordering::SeqCst);
    let mut stale = old.clone();
    let until = Instant::now() + SLACK;
    loop {
        match a.renew(&mut stale, SESSION).await {
            Err(Error::NotHeld { .. }) => break,
            Err(e) if e.is_temporary() && Instant::now() < until => {}
            other => panic!("renew of the expired lease: {other:?}"),
        }
    }
    assert!(
        !a.release(&old).await.unwrap(),
        "a stale release must not free b's lock"
    );
    let again = loop {
        match a.try_acquire(&key, SESSION).await {
            Ok(r) => break r,
            Err(e) if e.is_temporary() && Instant::now() < until => {}
            Err(e) => panic!("{e}"),
        }
    };
    assert!(again.is_none(), "b still holds it");
    assert!(b.release(&new).await.unwrap());
    let again = a
        .try_acquire(&key, SESSION)
        .await
        .unwrap()
        .expect("a works again");
    assert!(again.fencing_token() > new.fencing_token());
    assert!(a.release(&again).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_curator_contender_made_by_hand_makes_us_wait_in_line() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let a = Arc::new(ZkLock::connect(config.clone()).await.unwrap());
    let key = plain_key();
    let dir = format!("{ROOT}/{key}");
    raw.mkdir(
        &dir,
        &zk::CreateMode::Container.with_acls(zk::Acls::anyone_all()),
    )
    .await
    .unwrap();
    // What Curator's InterProcessMutex creates for acquire() on <root>/<key>.
    let prefix = format!("{dir}/_c_{}-lock-", uuid::Uuid::new_v4());
    let (stat, seq) = raw
        .create(
            &prefix,
            b"10.0.0.1",
            &zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all()),
        )
        .await
        .unwrap();
    let curator_node = format!("{prefix}{seq}");
    assert!(a.try_acquire(&key, SESSION).await.unwrap().is_none());
    let info = a
        .inspect(&key)
        .await
        .unwrap()
        .expect("held by the Curator node");
    assert_eq!(
        info.fencing_token.map(|t| t.get()),
        u64::try_from(stat.czxid).ok()
    );
    // Curator's node data (its IP) is shown as the holder: foreign, but sanitised and honest.
    assert_eq!(info.holder.as_ref().map(|h| h.as_str()), Some("10.0.0.1"));
    assert_eq!(
        children(&raw, &dir).await.len(),
        1,
        "try_acquire left its node behind"
    );
    let waiter = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move { a.acquire(&key, SESSION, Instant::now() + SLACK * 2).await })
    };
    // Our contender queues behind Curator's, and watches it.
    let until = Instant::now() + SLACK;
    while children(&raw, &dir).await.len() < 2 {
        assert!(Instant::now() < until, "our contender never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!waiter.is_finished());
    let queued = children(&raw, &dir).await;
    assert_eq!(queued[0], curator_node.rsplit('/').next().unwrap());
    raw.delete(&curator_node, None).await.unwrap();
    let lease = timeout(SLACK, waiter)
        .await
        .unwrap()
        .unwrap()
        .expect("granted after Curator's release");
    assert!(lease.fencing_token().unwrap().get() > u64::try_from(stat.czxid).unwrap());
    // While we hold it, a Curator client would see our node first and wait.
    let ours = children(&raw, &dir).await;
    assert_eq!(ours.len(), 1);
    assert!(a.release(&lease).await.unwrap());
    assert!(children(&raw, &dir).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_must_cover_the_session_and_unreachable_fails_fast() {
    let Some(config) = config() else { return };
    let a = ZkLock::connect(config.clone()).await.unwrap();
    assert_eq!(a.capabilities().min_ttl, SESSION);
    let key = fresh_key("ttl");
    let err = a.try_acquire(&key, SESSION / 2).await.unwrap_err();
    assert!(matches!(err, Error::InvalidTtl { .. }), "{err}");
    // A session timeout the server raises (below its minSessionTimeout) is refused. Each time:
    // zookeeper-client gives the handshake 8 ms of a 10 ms session, and the server's reply waits
    // for the createSession to be logged; about one connect in a hundred ran out of that (and
    // failed as Unavailable) before the driver tried such handshakes again.
    let mut tiny = config.clone();
    tiny.session_timeout = Duration::from_millis(10);
    for _ in 0..100 {
        let err = ZkLock::connect(tiny.clone()).await.unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
    }
    let mut closed = config;
    closed.hosts = "127.0.0.1:1".into();
    let start = Instant::now();
    let err = ZkLock::connect(closed).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
    assert!(start.elapsed() < SLACK);
}
