//! Renewals answered by one batched session check, and waiters that take over from the holder
//! without listing the queue again — against the local server (`DISTLOCK_TEST_ZK_URL`), with a
//! proxy that counts each session's requests by opcode.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

use support::{ROOT, SESSION, children, config, plain_key, raw_client};

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use lock_core::{DistributedLock, DistributedLockExt, Error, Lease, LossReason};
use lock_zk::{ZkLock, ZkLockConfig};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    time::{Instant, sleep, timeout},
};

const SLACK: Duration = Duration::from_secs(10);

/// ZooKeeper opcodes.
const EXISTS: i32 = 3;
const GET_CHILDREN: i32 = 8;
const GET_CHILDREN2: i32 = 12;
const SYNC: i32 = 9;

async fn until(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + SLACK;
    while !cond().await {
        assert!(Instant::now() < end, "timed out waiting until {what}");
        sleep(Duration::from_millis(5)).await;
    }
}

/// A TCP proxy in front of the server that counts the requests its clients send, by opcode.
#[derive(Clone)]
struct Counter(Arc<Mutex<HashMap<i32, usize>>>);

impl Counter {
    fn get(&self, opcode: i32) -> usize {
        self.0.lock().unwrap().get(&opcode).copied().unwrap_or(0)
    }

    fn lists(&self) -> usize {
        self.get(GET_CHILDREN) + self.get(GET_CHILDREN2)
    }

    /// Requests that check a session or a node: the batched `sync` and `exists`.
    fn checks(&self) -> usize {
        self.get(SYNC) + self.get(EXISTS)
    }
}

async fn counting_proxy(upstream: String) -> (u16, Counter) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let counter = Counter(Arc::default());
    let counts = counter.clone();
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            let Ok(up) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            // Frames are forwarded as they come: no Nagle delays on the way.
            let _ = (down.set_nodelay(true), up.set_nodelay(true));
            let (mut dr, mut dw) = down.into_split();
            let (mut ur, mut uw) = up.into_split();
            let counts = counts.clone();
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
                    if !first && len >= 8 {
                        let opcode = i32::from_be_bytes(frame[8..12].try_into().unwrap());
                        *counts.0.lock().unwrap().entry(opcode).or_default() += 1;
                    }
                    first = false;
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
    (port, counter)
}

/// A client whose session goes through a counting proxy.
async fn counted_client(config: &ZkLockConfig) -> (Arc<ZkLock>, Counter) {
    let (port, counter) = counting_proxy(config.hosts.split(',').next().unwrap().to_owned()).await;
    let mut via = config.clone();
    via.hosts = format!("127.0.0.1:{port}");
    (Arc::new(ZkLock::connect(via).await.unwrap()), counter)
}

async fn renew_all(lock: &ZkLock, leases: &mut [Lease]) -> Vec<lock_core::Result<()>> {
    futures::future::join_all(leases.iter_mut().map(|l| lock.renew(l, SESSION))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_of_renewals_costs_a_few_requests_and_a_deleted_node_fails_only_its_own() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let (a, counter) = counted_client(&config).await;
    const N: usize = 40;
    let mut keys = Vec::new();
    let mut leases = Vec::new();
    for _ in 0..N {
        let key = plain_key();
        leases.push(a.try_acquire(&key, SESSION).await.unwrap().unwrap());
        keys.push(key);
    }
    // The first round reads each node once (arming its deletion watch).
    assert!(renew_all(&a, &mut leases).await.iter().all(Result::is_ok));
    // Later rounds: one batched session `sync` for all of them (plus the session's heartbeat,
    // a `sync` every quarter timeout, more of which fall into a round the slower the machine).
    // Unbatched, a round is N requests; a quarter of that tells the two apart on any load.
    for _ in 0..3 {
        let before = counter.checks();
        assert!(renew_all(&a, &mut leases).await.iter().all(Result::is_ok));
        let sent = counter.checks() - before;
        assert!(
            (1..=N / 4).contains(&sent),
            "{N} renewals took {sent} sync/exists requests"
        );
    }
    // One node deleted from outside: exactly that renewal fails, at once, in the same batch.
    let victim = 17;
    let dir = format!("{ROOT}/{}", keys[victim]);
    let node = children(&raw, &dir).await.remove(0);
    raw.delete(&format!("{dir}/{node}"), None).await.unwrap();
    let results = renew_all(&a, &mut leases).await;
    for (i, r) in results.iter().enumerate() {
        if i == victim {
            assert!(matches!(r, Err(Error::NotHeld { .. })), "{r:?}");
        } else {
            assert!(r.is_ok(), "lease {i}: {r:?}");
        }
    }
    for (i, lease) in leases.iter().enumerate() {
        assert_eq!(a.release(lease).await.unwrap(), i != victim);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guards_renew_with_far_fewer_requests_than_locks_and_one_revoked_lock_is_lost_alone() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let (a, counter) = counted_client(&config).await;
    const N: usize = 60;
    let mut keys = Vec::new();
    let mut guards = Vec::new();
    for _ in 0..N {
        let key = plain_key();
        guards.push(
            a.lock(&key)
                .ttl(SESSION * 3)
                .watchdog(SESSION / 2)
                .try_acquire()
                .await
                .unwrap()
                .unwrap(),
        );
        keys.push(key);
    }
    until("every guard renewed once", async || {
        guards.iter().all(|g| g.renewals() >= 1)
    })
    .await;
    let renewed =
        |guards: &[lock_core::LockGuard]| guards.iter().map(|g| g.renewals()).sum::<u64>();
    let (r0, e0) = (renewed(&guards), counter.checks());
    until("every guard renewed three more times", async || {
        guards.iter().all(|g| g.renewals() >= 4)
    })
    .await;
    let (renewals, requests) = (renewed(&guards) - r0, counter.checks() - e0);
    // At most 4 grid instants per watchdog interval, a couple of batches each, plus the
    // heartbeats of however long the window took: unbatched it would be one per renewal.
    assert!(
        requests * 3 < usize::try_from(renewals).unwrap(),
        "{renewals} renewals sent {requests} sync/exists requests"
    );
    // One node deleted from outside: that guard is lost, the others keep renewing.
    let victim = 23;
    let dir = format!("{ROOT}/{}", keys[victim]);
    let node = children(&raw, &dir).await.remove(0);
    raw.delete(&format!("{dir}/{node}"), None).await.unwrap();
    timeout(SLACK, guards[victim].lost())
        .await
        .expect("the revoked guard reports its loss");
    assert_eq!(guards[victim].loss_reason(), Some(LossReason::Revoked));
    let mut stale = guards[victim].granted_lease().clone();
    assert!(matches!(
        a.renew(&mut stale, SESSION * 3).await,
        Err(Error::NotHeld { .. })
    ));
    let before: Vec<u64> = guards.iter().map(|g| g.renewals()).collect();
    until("the other guards renewed twice more", async || {
        guards
            .iter()
            .zip(&before)
            .enumerate()
            .all(|(i, (g, b))| i == victim || g.renewals() >= b + 2)
    })
    .await;
    for (i, g) in guards.into_iter().enumerate() {
        assert_eq!(g.is_lost(), i == victim, "guard {i}");
        assert_eq!(g.release().await.unwrap(), i != victim, "guard {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_behind_the_holder_takes_over_without_listing_again() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let holder = Arc::new(ZkLock::connect(config.clone()).await.unwrap());
    let (waiter, counter) = counted_client(&config).await;
    let key = plain_key();
    let dir = format!("{ROOT}/{key}");
    let held = holder.try_acquire(&key, SESSION).await.unwrap().unwrap();
    let lists = counter.lists();
    let exists = counter.get(EXISTS);
    let task = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move { waiter.acquire(&key, SESSION, Instant::now() + SLACK).await })
    };
    // Queued (one listing), and watching its own node and the holder's (two exists).
    until("the waiter watches", async || {
        counter.lists() > lists && counter.get(EXISTS) >= exists + 2
    })
    .await;
    assert_eq!(children(&raw, &dir).await.len(), 2);
    let lists = counter.lists();
    assert!(holder.release(&held).await.unwrap());
    let lease = timeout(SLACK, task).await.unwrap().unwrap().unwrap();
    assert_eq!(counter.lists(), lists, "the waiter listed the queue again");
    assert!(lease.fencing_token() > held.fencing_token());
    let info = waiter.inspect(&key).await.unwrap().expect("held");
    assert_eq!(info.token_digest, Some(lease.token().digest()));
    assert_eq!(info.fencing_token, lease.fencing_token());
    // The watch armed while waiting serves the renewals.
    let mut lease = lease;
    waiter.renew(&mut lease, SESSION).await.unwrap();
    assert!(waiter.release(&lease).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_own_node_goes_with_the_holders_does_not_take_the_lock() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let holder = Arc::new(ZkLock::connect(config.clone()).await.unwrap());
    let (waiter, counter) = counted_client(&config).await;
    let key = plain_key();
    let dir = format!("{ROOT}/{key}");
    let held = holder.try_acquire(&key, SESSION).await.unwrap().unwrap();
    let exists = counter.get(EXISTS);
    let task = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move { waiter.acquire(&key, SESSION, Instant::now() + SLACK).await })
    };
    until("the waiter watches", async || {
        counter.get(EXISTS) >= exists + 2
    })
    .await;
    let nodes = children(&raw, &dir).await;
    assert_eq!(nodes.len(), 2);
    // Our node first, then the holder's, in one transaction: its events arrive back to back.
    let mut multi = raw.new_multi_writer();
    multi
        .add_delete(&format!("{dir}/{}", nodes[1]), None)
        .unwrap();
    multi
        .add_delete(&format!("{dir}/{}", nodes[0]), None)
        .unwrap();
    multi.commit().await.unwrap();
    let lease = timeout(SLACK, task).await.unwrap().unwrap().unwrap();
    // It queued again with a new node, which is the one holding the lock.
    let info = waiter
        .inspect(&key)
        .await
        .unwrap()
        .expect("held by the waiter");
    assert_eq!(info.token_digest, Some(lease.token().digest()));
    assert_eq!(info.fencing_token, lease.fencing_token());
    assert!(!holder.release(&held).await.unwrap());
    assert!(waiter.release(&lease).await.unwrap());
}

/// Waiters queued behind the holder, more than a waiter watches at once; two of them give up
/// (one right behind the holder, one deep in the queue). Nobody is granted before the holder
/// releases, there is never more than one holder, and the rest are served in queue order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_that_give_up_in_the_middle_do_not_let_their_successors_jump_the_holder() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let holder = Arc::new(ZkLock::connect(config.clone()).await.unwrap());
    // Counted, to see the deep waiter go back to waiting after its predecessor gave up.
    let (waiters, counts) = counted_client(&config).await;
    let key = plain_key();
    let dir = format!("{ROOT}/{key}");
    let held = holder.try_acquire(&key, SESSION).await.unwrap().unwrap();
    let released = Arc::new(AtomicBool::new(false));
    let inside = Arc::new(AtomicBool::new(false));
    let order = Arc::new(Mutex::new(Vec::new()));
    const W: usize = 20;
    let mut tasks = Vec::new();
    for i in 0..W {
        let (waiters, key) = (waiters.clone(), key.clone());
        let (released, inside, order) = (released.clone(), inside.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let lease = waiters
                .acquire(&key, SESSION, Instant::now() + SLACK * 3)
                .await
                .unwrap();
            assert!(
                released.load(Ordering::SeqCst),
                "waiter {i} jumped the holder"
            );
            assert!(!inside.swap(true, Ordering::SeqCst), "two holders");
            order.lock().unwrap().push(i);
            tokio::task::yield_now().await;
            inside.store(false, Ordering::SeqCst);
            assert!(waiters.release(&lease).await.unwrap());
        }));
        // Queue them one by one, so the queue order is the spawn order.
        until("the waiter queued", async || {
            children(&raw, &dir).await.len() == i + 2
        })
        .await;
    }
    // Give up: the one right behind the holder and one behind the watched window.
    let gave_up = [0, 18];
    let (lists, checks) = (counts.lists(), counts.checks());
    for &i in &gave_up {
        tasks[i].abort();
    }
    until("their nodes are gone", async || {
        children(&raw, &dir).await.len() == 1 + W - gave_up.len()
    })
    .await;
    // Their successors woke up, and must still wait for the holder. Awaited as events, not a
    // sleep: waiter 19 (behind the watched window) lists again and re-arms its watch (the
    // removals of the two nodes send neither); waiter 1 decides without a request, on the
    // deletion event, which its session delivers before the reply to any later request.
    until(
        "the deep waiter listed again and watches again",
        async || counts.lists() > lists && counts.checks() > checks,
    )
    .await;
    waiters.inspect(&key).await.unwrap();
    tokio::task::yield_now().await;
    assert!(order.lock().unwrap().is_empty());
    let info = holder.inspect(&key).await.unwrap().unwrap();
    assert_eq!(info.token_digest, Some(held.token().digest()));
    released.store(true, Ordering::SeqCst);
    assert!(holder.release(&held).await.unwrap());
    for (i, t) in tasks.into_iter().enumerate() {
        if !gave_up.contains(&i) {
            timeout(SLACK * 3, t).await.unwrap().unwrap();
        }
    }
    let expected: Vec<usize> = (0..W).filter(|i| !gave_up.contains(i)).collect();
    assert_eq!(*order.lock().unwrap(), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_watch_lost_future_of_a_lease_fires_when_its_node_is_deleted() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let a = ZkLock::connect(config.clone()).await.unwrap();
    let key = plain_key();
    let lease = a.try_acquire(&key, SESSION).await.unwrap().unwrap();
    // Three independent watchers of one lease, each polled once here — which registers it with
    // the lease's node watch (or sends the request arming it) — before its own task polls on,
    // so every one is registered before the deletion (an event, not a sleep).
    let mut watchers = Vec::new();
    for _ in 0..3 {
        let mut watcher = a.watch_lost(&lease);
        assert!(
            futures::poll!(&mut watcher).is_pending(),
            "lost before the node was deleted"
        );
        watchers.push(tokio::spawn(watcher));
    }
    let dir = format!("{ROOT}/{key}");
    let node = children(&raw, &dir).await.remove(0);
    raw.delete(&format!("{dir}/{node}"), None).await.unwrap();
    for w in watchers {
        let reason = timeout(SLACK, w)
            .await
            .expect("a watch_lost future was never woken")
            .unwrap();
        assert_eq!(reason, LossReason::Revoked);
    }
}
