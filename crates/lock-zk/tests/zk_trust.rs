//! How far the driver trusts its session, against the local server (`DISTLOCK_TEST_ZK_URL`):
//! only answers that went through the leader extend it (a `sync`), never a read the connected
//! member served on its own; a lease never claims more than the session vouches for; a lease
//! that would be born expired is never handed out; a guard lost to a lapsed window removes its
//! node once the session is back; and `acquire` never overstays its deadline.
//!
//! A "member cut off from the leader" is played by a proxy that forwards every request except
//! `sync`, which it swallows: reads, writes and pings are answered as a follower partitioned
//! from the leader answers them (for syncLimit × tickTime), but nothing proves the leader heard
//! of the session. The 3-member version of this is the drill `drill_partition_zk`.
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

use lock_core::{DistributedLock, DistributedLockExt, Error, LossReason};
use lock_zk::{ZkLock, ZkLockConfig};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    time::{Instant, sleep, timeout},
};

const SLACK: Duration = Duration::from_secs(10);
const SYNC: i32 = 9;

async fn until(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + SLACK;
    while !cond().await {
        assert!(Instant::now() < end, "timed out waiting until {what}");
        sleep(Duration::from_millis(10)).await;
    }
}

/// A proxy in front of the server that swallows `sync` requests while `cut` is set (their
/// callers never get an answer) and forwards everything else.
async fn leaderless_proxy(upstream: String) -> (u16, Arc<AtomicBool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let cut = Arc::new(AtomicBool::new(false));
    let swallow = cut.clone();
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            let Ok(up) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let _ = (down.set_nodelay(true), up.set_nodelay(true));
            let (mut dr, mut dw) = down.into_split();
            let (mut ur, mut uw) = up.into_split();
            let swallow = swallow.clone();
            // Client to server: length-prefixed frames; the first of a connection is the
            // ConnectRequest, every later one starts with xid and opcode.
            tokio::spawn(async move {
                let mut first = true;
                loop {
                    let mut frame = vec![0u8; 4];
                    if dr.read_exact(&mut frame).await.is_err() {
                        return;
                    }
                    let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
                    frame.resize(4 + len, 0);
                    if dr.read_exact(&mut frame[4..]).await.is_err() {
                        return;
                    }
                    let is_sync = !first
                        && len >= 8
                        && i32::from_be_bytes(frame[8..12].try_into().unwrap()) == SYNC;
                    first = false;
                    if is_sync && swallow.load(Ordering::SeqCst) {
                        continue;
                    }
                    if uw.write_all(&frame).await.is_err() {
                        return;
                    }
                }
            });
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut ur, &mut dw).await;
            });
        }
    });
    (port, cut)
}

async fn client_behind_leaderless_proxy(config: &ZkLockConfig) -> (Arc<ZkLock>, Arc<AtomicBool>) {
    let (port, cut) = leaderless_proxy(config.hosts.split(',').next().unwrap().to_owned()).await;
    let mut via = config.clone();
    via.hosts = format!("127.0.0.1:{port}");
    via.timeout = SESSION / 2;
    (Arc::new(ZkLock::connect(via).await.unwrap()), cut)
}

/// S2 + L11: reads answered by the connected member keep flowing, but without an answered
/// `sync` nothing proves the leader heard of the session: the guard reports the loss within one
/// session timeout. Once syncs get through again, the lost guard's node is removed without
/// anyone calling `release`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_the_leader_never_saw_extend_no_trust_and_the_lost_node_goes_once_back() {
    let Some(config) = config() else { return };
    no_trust_without_the_leader(config).await;
}

/// The same with the guard a member of the session watch on the lock root (a session's locks
/// past `session_watch_from`): the lost member's node goes when it leaves the watch, as a node
/// with a watch of its own goes when its `watch_lost` ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_watch_member_lost_to_a_lapse_has_its_node_removed_once_back() {
    let Some(mut config) = config() else { return };
    config.session_watch_from = Some(0);
    no_trust_without_the_leader(config).await;
}

async fn no_trust_without_the_leader(config: ZkLockConfig) {
    let raw = raw_client(&config).await;
    let (a, cut) = client_behind_leaderless_proxy(&config).await;
    let key = plain_key();
    let dir = format!("{ROOT}/{key}");
    let guard = a
        .lock(&key)
        .ttl(SESSION)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    cut.store(true, Ordering::SeqCst);
    let cut_at = Instant::now();
    // The member still answers: reads work the whole time.
    let reads = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move {
            let mut answered = 0u32;
            while Instant::now() < cut_at + SESSION {
                if a.inspect(&key).await.is_ok_and(|h| h.is_some()) {
                    answered += 1;
                }
                sleep(Duration::from_millis(50)).await;
            }
            answered
        })
    };
    timeout(SESSION * 4, guard.lost())
        .await
        .expect("the guard trusted reads that never reached the leader");
    let lost_after = cut_at.elapsed();
    eprintln!(
        "lost {lost_after:?} after the cut ({:?})",
        guard.loss_reason()
    );
    // By construction at most one session timeout after the cut (the window counts from a
    // request sent before it); the rest is slack for a loaded machine.
    assert!(
        lost_after <= SESSION * 2,
        "lost only {lost_after:?} after the last sync that could have reached the leader"
    );
    assert_eq!(guard.loss_reason(), Some(LossReason::DeadlinePassed));
    assert!(
        reads.await.unwrap() > 0,
        "the member stopped answering reads"
    );
    assert_eq!(
        children(&raw, &dir).await.len(),
        1,
        "the node is still there"
    );
    // Back: the session is vouched for again, and the lost guard's node goes by itself.
    cut.store(false, Ordering::SeqCst);
    until("the lost guard's node is removed", async || {
        children(&raw, &dir).await.is_empty()
    })
    .await;
    assert!(!guard.release().await.unwrap());
    // The client works again.
    let again = a.try_acquire(&key, SESSION).await.unwrap().expect("free");
    assert!(a.release(&again).await.unwrap());
}

/// S3: while the session cannot be vouched for, a node that is first in line gives no lease:
/// `try_acquire` fails with a temporary error and leaves no node, and `acquire` keeps trying
/// until its deadline, then times out and leaves no node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_would_be_born_expired_is_never_handed_out() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let (a, cut) = client_behind_leaderless_proxy(&config).await;
    let key = plain_key();
    let dir = format!("{ROOT}/{key}");
    let probe = a.try_acquire(&key, SESSION).await.unwrap().expect("free");
    assert!(a.release(&probe).await.unwrap());
    cut.store(true, Ordering::SeqCst);
    // Wait for the lapse (a watch_lost future reports it).
    let other = plain_key();
    let lease = a.try_acquire(&other, SESSION).await.unwrap().expect("free");
    timeout(SESSION * 4, a.watch_lost(&lease))
        .await
        .expect("the window lapses without syncs");
    let err = a.try_acquire(&key, SESSION).await.unwrap_err();
    assert!(
        matches!(err, Error::Unavailable { .. }) && err.to_string().contains("vouched"),
        "{err}"
    );
    assert!(
        children(&raw, &dir).await.is_empty(),
        "try_acquire left its node"
    );
    let started = Instant::now();
    let err = a
        .acquire(&key, SESSION, Instant::now() + SESSION)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(
        started.elapsed() < SESSION + Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    until("acquire's node is removed", async || {
        children(&raw, &dir).await.is_empty()
    })
    .await;
    cut.store(false, Ordering::SeqCst);
}

/// S9: a bare `Lease` with a TTL far longer than the session claims no more than the session
/// vouches for, when granted and when renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_lease_never_claims_more_than_the_session_vouches_for() {
    let Some(config) = config() else { return };
    let a = ZkLock::connect(config.clone()).await.unwrap();
    let key = plain_key();
    let mut lease = a
        .try_acquire(&key, SESSION * 30)
        .await
        .unwrap()
        .expect("free");
    assert!(
        lease.remaining() <= SESSION,
        "a lease trusted for {:?} on a {SESSION:?} session",
        lease.remaining()
    );
    assert!(lease.is_locally_valid());
    a.renew(&mut lease, SESSION * 30).await.unwrap();
    assert!(
        lease.remaining() <= SESSION,
        "renewed for {:?} on a {SESSION:?} session",
        lease.remaining()
    );
    assert!(lease.is_locally_valid());
    assert!(a.release(&lease).await.unwrap());
}

/// L3: `acquire(deadline = now + 1 s)` against a server that stopped answering (the drill
/// proxy's blackhole: the connection stays open, nothing comes back) returns `Timeout` within
/// the deadline plus a small slack, not after an operation timeout per request. The session is
/// long (10 s) so that the client library does not give up on the connection first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_against_a_frozen_server_returns_by_its_deadline() {
    let Some(config) = config() else { return };
    let (proxy, mut via) = proxied(&config).await;
    via.session_timeout = Duration::from_secs(10);
    let a = ZkLock::connect(via).await.unwrap();
    let raw = raw_client(&config).await;
    for held in [false, true] {
        let key = plain_key();
        let dir = format!("{ROOT}/{key}");
        // Held by someone else (the waiter must queue), or free (the create itself hangs).
        let holder = ZkLock::connect(config.clone()).await.unwrap();
        let theirs = if held {
            Some(holder.try_acquire(&key, SESSION).await.unwrap().unwrap())
        } else {
            None
        };
        proxy.blackhole();
        let started = Instant::now();
        let err = a
            .acquire(
                &key,
                Duration::from_secs(10),
                started + Duration::from_secs(1),
            )
            .await
            .unwrap_err();
        let took = started.elapsed();
        proxy.pass();
        eprintln!("held={held}: {err} after {took:?}");
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        // Slack: the foreground removal grace (100 ms) and scheduling on a loaded machine.
        assert!(
            took < Duration::from_millis(1500),
            "acquire(deadline = now + 1 s) returned after {took:?}"
        );
        until("the waiter's node is gone", async || {
            children(&raw, &dir).await.len() == usize::from(held)
        })
        .await;
        if let Some(theirs) = theirs {
            assert!(holder.release(&theirs).await.unwrap());
        }
    }
}

/// L2: the reply of our create is lost (the request applies, the connection then dies): the
/// waiter syncs, finds the node it created by its token and takes the lock with it — exactly one
/// node of ours, no orphan queued ahead of or behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_reply_is_lost_leaves_exactly_one_node() {
    let Some(config) = config() else { return };
    let (proxy, mut via) = proxied(&config).await;
    via.session_timeout = Duration::from_secs(4);
    via.timeout = Duration::from_secs(1);
    let a = Arc::new(ZkLock::connect(via).await.unwrap());
    let raw = raw_client(&config).await;
    let key = plain_key();
    let dir = format!("{ROOT}/{key}");
    // The lock directory exists, so the very first create is the one whose reply is lost.
    raw.mkdir(
        &dir,
        &zookeeper_client::CreateMode::Container.with_acls(zookeeper_client::Acls::anyone_all()),
    )
    .await
    .unwrap();
    proxy.drop_replies();
    let task = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move {
            a.acquire(&key, Duration::from_secs(4), Instant::now() + SLACK)
                .await
        })
    };
    until("the create is applied", async || {
        children(&raw, &dir).await.len() == 1
    })
    .await;
    let created = children(&raw, &dir).await;
    proxy.pass();
    let lease = timeout(SLACK * 2, task)
        .await
        .expect("acquire hangs")
        .unwrap()
        .expect("acquired with the node whose reply was lost");
    assert_eq!(
        children(&raw, &dir).await,
        created,
        "a second node was created"
    );
    let info = a.inspect(&key).await.unwrap().expect("held");
    assert_eq!(info.token_digest, Some(lease.token().digest()));
    assert!(a.release(&lease).await.unwrap());
    assert!(children(&raw, &dir).await.is_empty());
}

/// L2: a create applied twice without our hearing of it (here: the reply of the first is lost
/// and a second node with our token appears meanwhile, as when a retry went to a member that had
/// not applied the first yet). The waiter adopts the first node carrying its token and deletes
/// every other one: it never waits behind its own orphan, and no orphan stays queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_other_node_carrying_our_token_is_deleted() {
    let Some(config) = config() else { return };
    let (proxy, mut via) = proxied(&config).await;
    via.session_timeout = Duration::from_secs(4);
    via.timeout = Duration::from_secs(1);
    let a = Arc::new(ZkLock::connect(via).await.unwrap());
    let raw = raw_client(&config).await;
    let key = plain_key();
    let dir = format!("{ROOT}/{key}");
    let open = zookeeper_client::Acls::anyone_all();
    raw.mkdir(
        &dir,
        &zookeeper_client::CreateMode::Container.with_acls(open),
    )
    .await
    .unwrap();
    proxy.drop_replies();
    let task = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move {
            a.acquire(&key, Duration::from_secs(4), Instant::now() + SLACK)
                .await
        })
    };
    until("the create is applied", async || {
        children(&raw, &dir).await.len() == 1
    })
    .await;
    let ours = children(&raw, &dir).await.remove(0);
    // `_c_<uuid>-lock-<seq>`: a second node with the same token, queued behind the first.
    let marker = ours[..ours.len() - 10].to_owned();
    let (_, seq) = raw
        .create(
            &format!("{dir}/{marker}"),
            &[],
            &zookeeper_client::CreateMode::EphemeralSequential.with_acls(open),
        )
        .await
        .unwrap();
    assert_eq!(children(&raw, &dir).await.len(), 2);
    proxy.pass();
    let lease = timeout(SLACK * 2, task)
        .await
        .expect("acquire hangs")
        .unwrap()
        .expect("acquired with the first node carrying our token");
    assert_eq!(
        children(&raw, &dir).await,
        vec![ours.clone()],
        "the other node with our token ({marker}{seq}) was left, or a third was created"
    );
    let info = a.inspect(&key).await.unwrap().expect("held");
    assert_eq!(info.token_digest, Some(lease.token().digest()));
    assert!(a.release(&lease).await.unwrap());
    assert!(children(&raw, &dir).await.is_empty());
}

/// S9: the server lowers the session timeout (its `maxSessionTimeout`, 60 s on the test server)
/// below the one configured: leases count the negotiated timeout, not the TTL nor the configured
/// timeout, and `renew` accepts the lease's own (negotiated) TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_count_the_negotiated_session_timeout() {
    let Some(mut config) = config() else { return };
    config.session_timeout = Duration::from_secs(600);
    let a = ZkLock::connect(config.clone()).await.unwrap();
    let negotiated = a.zk_client().await.unwrap().session_timeout();
    if negotiated >= config.session_timeout {
        eprintln!("skipping: the server accepted a {negotiated:?} session");
        return;
    }
    // The shortest TTL it claims is the negotiated timeout, not the one asked for (a TTL between
    // the two would be refused for nothing).
    assert_eq!(a.capabilities().min_ttl, negotiated);
    let key = plain_key();
    let mut lease = a
        .try_acquire(&key, config.session_timeout)
        .await
        .unwrap()
        .expect("free");
    assert!(
        lease.remaining() <= negotiated && lease.ttl() <= negotiated,
        "trusted for {:?} (ttl {:?}) on a {negotiated:?} session",
        lease.remaining(),
        lease.ttl()
    );
    let ttl = lease.ttl();
    a.renew(&mut lease, ttl).await.unwrap();
    assert!(lease.remaining() <= negotiated);
    assert!(a.release(&lease).await.unwrap());
}

/// L3: `try_acquire` against a server that stopped answering is bounded as a whole (twice
/// `timeout`, whatever it retries), and fails with a temporary error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_acquire_against_a_frozen_server_is_bounded() {
    let Some(config) = config() else { return };
    let (proxy, mut via) = proxied(&config).await;
    via.session_timeout = Duration::from_secs(10);
    via.timeout = Duration::from_millis(500);
    let a = ZkLock::connect(via).await.unwrap();
    let key = plain_key();
    proxy.blackhole();
    let started = Instant::now();
    let err = a
        .try_acquire(&key, Duration::from_secs(10))
        .await
        .unwrap_err();
    let took = started.elapsed();
    proxy.pass();
    eprintln!("{err} after {took:?}");
    assert!(err.is_temporary(), "{err}");
    // 2 × timeout, plus scheduling on a loaded machine.
    assert!(
        took < Duration::from_millis(1500),
        "try_acquire took {took:?}"
    );
}

/// `force_release` whose delete of the holder's node goes unanswered (its reply lost, the
/// connection reset) sends the delete of that exact path again; finding it gone, it cannot tell
/// its own delete from the holder's release and answers `Indeterminate` — not `Unavailable`,
/// which promises that nothing happened, when the holder was in fact removed. Judged by what
/// happened to the holder (read directly, not through the proxy), so a heartbeat that shifts the
/// lost reply to another request cannot make it pass or fail wrongly: held afterwards → the call
/// must not claim a removal; removed → it must say so or say it does not know. Seen red before
/// the re-send: `Unavailable` with the holder removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_release_whose_delete_reply_is_lost_does_not_say_nothing_happened() {
    let Some(config) = config() else { return };
    let (proxy, mut via) = proxied(&config).await;
    // Long sessions: heartbeats (the client's pings, the driver's syncs) come seconds apart.
    via.session_timeout = Duration::from_secs(20);
    via.timeout = Duration::from_secs(2);
    let forcer = ZkLock::connect(via).await.unwrap();
    let mut direct = config.clone();
    direct.session_timeout = Duration::from_secs(20);
    let holder = ZkLock::connect(direct).await.unwrap();
    let mut removed_unseen = 0;
    for _ in 0..3 {
        // How many reply turns a force_release takes, counted on a key of its own.
        let dry = plain_key();
        let ttl = Duration::from_secs(20);
        let _held = holder.try_acquire(&dry, ttl).await.unwrap().expect("free");
        proxy.pass();
        assert!(forcer.force_release(&dry).await.unwrap());
        let turns = u32::try_from(proxy.reply_turns()).unwrap();
        let key = plain_key();
        let _held = holder.try_acquire(&key, ttl).await.unwrap().expect("free");
        // The last of them — the delete's reply — is lost once, its connection reset.
        proxy.lose_reply(turns);
        let got = forcer.force_release(&key).await;
        let removed = holder.inspect(&key).await.unwrap().is_none();
        eprintln!(
            "{turns} turns; lost {}; got {got:?}; removed {removed}",
            proxy.lost_turns()
        );
        if removed {
            assert!(
                matches!(got, Ok(true) | Err(Error::Indeterminate { .. })),
                "the holder was removed, yet force_release answered {got:?}"
            );
            if matches!(got, Err(Error::Indeterminate { .. })) {
                return;
            }
            removed_unseen += 1;
        } else {
            assert!(
                !matches!(got, Ok(true)),
                "force_release claimed a removal that did not happen"
            );
        }
    }
    panic!(
        "the delete's reply was never the one lost in 3 tries ({removed_unseen} removals answered Ok(true))"
    );
}

/// A drill proxy in front of the test server's first host, and `config` pointed at it.
async fn proxied(config: &ZkLockConfig) -> (conformance::drill::Proxy, ZkLockConfig) {
    let upstream = tokio::net::lookup_host(config.hosts.split(',').next().unwrap())
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = conformance::drill::Proxy::start(upstream).await.unwrap();
    let mut via = config.clone();
    via.hosts = proxy.addr().to_string();
    (proxy, via)
}
