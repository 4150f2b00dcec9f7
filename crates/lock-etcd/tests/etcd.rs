//! etcd-specific behaviour on a real etcd (`DISTLOCK_TEST_ETCD_URL`): interoperation with
//! `etcdctl lock`, loss pushed by the server, queue entries whose lease dies, shared sessions.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use std::{process::Stdio, sync::Arc, time::Duration};

use etcd_client::{GetOptions, SortOrder, SortTarget};
use lock_core::{DistributedLock, DistributedLockExt, LockKey, LossReason};
use lock_etcd::{EtcdLock, EtcdLockConfig};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::Command,
    time::{Instant, sleep, timeout},
};

const LONG: Duration = Duration::from_secs(30);
const SLACK: Duration = Duration::from_secs(5);

struct Env {
    url: String,
    endpoint: String,
    admin: etcd_client::Client,
}

async fn env() -> Option<Env> {
    let url = conformance::backend_url("DISTLOCK_TEST_ETCD_URL")?;
    let cfg = EtcdLockConfig::from_url(&url).unwrap();
    let endpoint = cfg.endpoints[0].clone();
    let admin = etcd_client::Client::connect([format!("http://{endpoint}")], None)
        .await
        .unwrap();
    Some(Env {
        url,
        endpoint,
        admin,
    })
}

impl Env {
    async fn client(&self) -> Arc<EtcdLock> {
        Arc::new(EtcdLock::connect_url(&self.url).await.unwrap())
    }

    /// Entries queued under `key` (default prefix), oldest first: (key, lease id).
    async fn entries(&self, key: &LockKey) -> Vec<(String, i64)> {
        let opts = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let resp = self
            .admin
            .kv_client()
            .get(format!("distlock/{key}/"), Some(opts))
            .await
            .unwrap();
        resp.kvs()
            .iter()
            .map(|kv| (kv.key_str().unwrap().to_owned(), kv.lease()))
            .collect()
    }

    /// Deletes one entry from outside (its lease lives on); returns its create revision.
    async fn delete_entry(&self, entry: &str) -> i64 {
        let resp = self
            .admin
            .kv_client()
            .delete(
                entry,
                Some(etcd_client::DeleteOptions::new().with_prev_key()),
            )
            .await
            .unwrap();
        resp.prev_kvs()[0].create_revision()
    }

    /// `lease` holds `key` for real: its entry, created after `deleted` (the revision of the
    /// entry deleted from under it), is the only one queued, and nobody else gets the lock.
    async fn holds_anew(
        &self,
        key: &LockKey,
        lease: &lock_core::Lease,
        deleted: i64,
        other: &EtcdLock,
    ) {
        let fence = lease.fencing_token().unwrap().get();
        assert!(
            fence > u64::try_from(deleted).unwrap(),
            "granted through the deleted entry (revision {deleted}): fence {fence}"
        );
        let entry = String::from_utf8(EtcdLock::entry_key(lease).unwrap()).unwrap();
        assert_eq!(
            self.entries(key).await,
            vec![(entry, EtcdLock::lease_id(lease).unwrap())]
        );
        assert!(other.try_acquire(key, LONG).await.unwrap().is_none());
    }

    async fn revoke(&self, lease: i64) {
        self.admin.lease_client().revoke(lease).await.unwrap();
    }

    fn etcdctl(&self) -> Command {
        let mut cmd = Command::new("etcdctl");
        cmd.env("ETCDCTL_API", "3")
            .arg(format!("--endpoints=http://{}", self.endpoint))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        cmd
    }
}

/// A key without `/`, so it maps verbatim to `distlock/<key>` for etcdctl.
fn fresh(label: &str) -> LockKey {
    LockKey::new(format!("{label}-{:016x}", rand::random::<u64>())).unwrap()
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

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn etcdctl_lock_excludes_us() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        if !etcdctl_installed() {
            assert!(
                std::env::var("DISTLOCK_REQUIRE_BACKENDS").as_deref() != Ok("1"),
                "etcdctl is not installed but DISTLOCK_REQUIRE_BACKENDS=1"
            );
            eprintln!("skipping: etcdctl is not installed");
            return;
        }
        let key = fresh("interop-ctl");
        let lock = env.client().await;
        let mut child = env
            .etcdctl()
            .args(["lock", "--ttl=5", &format!("distlock/{key}")])
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = timeout(SLACK, out.next_line()).await.unwrap().unwrap();
        let held_key = line.expect("etcdctl prints the key it holds");
        assert!(
            held_key.starts_with(&format!("distlock/{key}/")),
            "{held_key}"
        );

        assert!(lock.try_acquire(&key, LONG).await.unwrap().is_none());
        let info = lock.inspect(&key).await.unwrap().expect("etcdctl's holder");
        assert_eq!(info.token_digest, None, "etcdctl stores no token");
        assert_eq!(
            info.holder, None,
            "etcdctl puts an empty value: no identity"
        );

        // A waiter queues behind etcdctl and is granted when it unlocks (SIGTERM → Unlock).
        let waiter = {
            let (lock, key) = (lock.clone(), key.clone());
            tokio::spawn(async move { lock.acquire(&key, LONG, Instant::now() + LONG).await })
        };
        sleep(Duration::from_millis(300)).await;
        assert!(
            !waiter.is_finished(),
            "granted while etcdctl holds the lock"
        );
        let pid = Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap());
        kill(pid, Signal::SIGTERM).unwrap();
        let lease = timeout(SLACK, waiter).await.unwrap().unwrap().unwrap();
        assert!(lock.release(&lease).await.unwrap());
        let _ = child.wait().await;
    });
}

#[test]
fn we_exclude_etcdctl_lock() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        if !etcdctl_installed() {
            assert!(
                std::env::var("DISTLOCK_REQUIRE_BACKENDS").as_deref() != Ok("1"),
                "etcdctl is not installed but DISTLOCK_REQUIRE_BACKENDS=1"
            );
            eprintln!("skipping: etcdctl is not installed");
            return;
        }
        let key = fresh("interop-ours");
        let lock = env.client().await;
        let lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
        let mut child = env
            .etcdctl()
            .args([
                "lock",
                "--ttl=5",
                &format!("distlock/{key}"),
                "echo",
                "etcdctl-acquired",
            ])
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        // etcdctl queues behind our key: nothing is printed while we hold it.
        assert!(
            timeout(Duration::from_millis(1500), out.next_line())
                .await
                .is_err(),
            "etcdctl acquired a lock we hold"
        );
        assert_eq!(env.entries(&key).await.len(), 2, "etcdctl is queued");
        assert!(lock.release(&lease).await.unwrap());
        let line = timeout(SLACK, out.next_line()).await.unwrap().unwrap();
        assert_eq!(line.as_deref(), Some("etcdctl-acquired"));
        assert!(child.wait().await.unwrap().success());
    });
}

#[test]
fn lease_revoked_from_outside_fires_lost_without_waiting_for_a_renewal() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let lock = env.client().await;
        let key = fresh("revoked");
        // A 30 s TTL: the watchdog's first renewal is 10 s away, so only a push can be this fast.
        let guard = lock
            .lock(&key)
            .ttl(LONG)
            .try_acquire()
            .await
            .unwrap()
            .unwrap();
        let id = EtcdLock::lease_id(guard.granted_lease()).unwrap();
        let start = Instant::now();
        env.revoke(id).await;
        timeout(Duration::from_secs(3), guard.lost())
            .await
            .expect("lost() must fire when the lease is revoked");
        assert!(start.elapsed() < Duration::from_secs(3));
        assert_eq!(guard.loss_reason(), Some(LossReason::Revoked));
        assert_eq!(guard.renewals(), 0);
        assert!(!guard.release().await.unwrap());
        // The client recovers: a new session is made for the next lock.
        let again = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
        assert_ne!(EtcdLock::lease_id(&again), Some(id));
        assert!(lock.release(&again).await.unwrap());
    });
}

/// A waiter whose lease dies while it queues (keepalives that did not get through while the
/// cluster elected a leader, an operator's revoke) never gets the lock through that entry, and
/// does not give up either: it queues again on a live lease and is granted within its deadline.
#[test]
fn a_waiter_whose_lease_dies_while_queued_queues_again_on_a_live_lease() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (a, b) = (env.client().await, env.client().await);
        let key = fresh("dead-waiter");
        let held = a.try_acquire(&key, LONG).await.unwrap().unwrap();
        let waiter = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move { b.acquire(&key, LONG, Instant::now() + LONG).await })
        };
        let until = Instant::now() + SLACK;
        let entries = loop {
            let e = env.entries(&key).await;
            if e.len() == 2 || Instant::now() > until {
                break e;
            }
            sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(entries.len(), 2, "the waiter queued");
        let dead = entries[1].1;
        // The waiter's lease dies while it queues; then the holder releases.
        env.revoke(dead).await;
        assert!(a.release(&held).await.unwrap());
        let lease = timeout(SLACK, waiter)
            .await
            .expect("the waiter must be granted, not hang")
            .unwrap()
            .expect("a waiter whose entry died queues again within its deadline");
        let live = EtcdLock::lease_id(&lease).unwrap();
        assert_ne!(live, dead, "granted through the revoked lease");
        // Its new entry, on the live lease, is the only one: it holds the lock for real.
        assert_eq!(
            env.entries(&key).await,
            vec![(
                String::from_utf8(EtcdLock::entry_key(&lease).unwrap()).unwrap(),
                live
            )]
        );
        assert!(a.try_acquire(&key, LONG).await.unwrap().is_none());
        assert!(b.release(&lease).await.unwrap());
        assert!(env.entries(&key).await.is_empty());
    });
}

#[test]
fn a_waiter_keeps_its_entry_alive_past_its_ttl() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (a, b) = (env.client().await, env.client().await);
        let ttl = a.capabilities().min_ttl;
        let key = fresh("long-wait");
        let guard = a.lock(&key).ttl(ttl).try_acquire().await.unwrap().unwrap();
        let waiter = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move { b.acquire(&key, ttl, Instant::now() + LONG).await })
        };
        sleep(ttl * 3).await;
        assert!(!waiter.is_finished());
        assert_eq!(
            env.entries(&key).await.len(),
            2,
            "the waiter's entry expired"
        );
        assert!(guard.release().await.unwrap());
        let lease = timeout(SLACK, waiter).await.unwrap().unwrap().unwrap();
        assert!(b.release(&lease).await.unwrap());
    });
}

#[test]
fn min_ttl_is_what_the_server_grants() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let lock = env.client().await;
        let granted = env.admin.lease_client().grant(1, None).await.unwrap();
        env.revoke(granted.id()).await;
        let caps = lock.capabilities();
        assert_eq!(
            caps.min_ttl,
            Duration::from_secs(u64::try_from(granted.ttl()).unwrap())
        );
        assert_eq!(caps.ttl_granularity, Duration::from_secs(1));
        let below = caps.min_ttl - Duration::from_millis(1);
        let key = fresh("min-ttl");
        assert!(matches!(
            lock.try_acquire(&key, below).await,
            Err(lock_core::Error::InvalidTtl { .. })
        ));
    });
}

#[test]
fn locks_of_one_client_share_a_lease_and_release_independently() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (a, b) = (env.client().await, env.client().await);
        let ttl = Duration::from_secs(5);
        let keys: Vec<LockKey> = (0..20).map(|i| fresh(&format!("shared{i}"))).collect();
        let mut leases = Vec::new();
        for k in &keys {
            leases.push(a.try_acquire(k, ttl).await.unwrap().unwrap());
        }
        let id = EtcdLock::lease_id(&leases[0]).unwrap();
        assert!(leases.iter().all(|l| EtcdLock::lease_id(l) == Some(id)));
        assert_eq!(a.session_count(), 1);

        // Renewing all of them at once costs one keepalive and a few batched entry checks, not
        // twenty: a lone first one, then everything that queued behind it — and, when the
        // machine is loaded, a third or fourth wave of renewals that reached the batcher only
        // after the previous check was sent (seen once: 3 txns in a two-lane run on 2 cores).
        let before = a.request_counts();
        let renewals = leases.iter_mut().map(|l| {
            let a = a.clone();
            async move { a.renew(l, ttl).await }
        });
        for r in futures::future::join_all(renewals).await {
            r.unwrap();
        }
        let after = a.request_counts();
        assert!(
            after.total() - before.total() <= 5,
            "{before:?} -> {after:?}"
        );
        assert_eq!(after.lease_keepalive - before.lease_keepalive, 1);
        assert!(after.txn - before.txn <= 4, "{before:?} -> {after:?}");

        // Releasing one deletes only its key; the lease lives on for the others.
        assert!(a.release(&leases[0]).await.unwrap());
        let l0 = b.try_acquire(&keys[0], ttl).await.unwrap().unwrap();
        for k in &keys[1..] {
            assert!(b.try_acquire(k, ttl).await.unwrap().is_none(), "{k}");
        }
        let ttl_left = env
            .admin
            .lease_client()
            .time_to_live(id, None)
            .await
            .unwrap();
        assert!(ttl_left.ttl() > 0, "the shared lease was revoked early");
        assert!(b.release(&l0).await.unwrap());

        // After the last release the idle lease is revoked once its grace period ends.
        for l in &leases[1..] {
            assert!(a.release(l).await.unwrap());
        }
        no_sessions_left(&a).await;
        let ttl_left = env
            .admin
            .lease_client()
            .time_to_live(id, None)
            .await
            .unwrap();
        assert_eq!(ttl_left.ttl(), -1, "the unused lease must be revoked");
    });
}

#[test]
fn an_unrenewed_lock_expires_even_while_its_neighbour_on_the_shared_lease_is_renewed() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (a, b) = (env.client().await, env.client().await);
        let ttl = Duration::from_secs(2);
        let (kx, ky) = (fresh("unrenewed"), fresh("renewed"));
        let start = Instant::now();
        let x = a.try_acquire(&kx, ttl).await.unwrap().unwrap();
        let y = a.lock(&ky).ttl(ttl).try_acquire().await.unwrap().unwrap();
        assert_eq!(
            EtcdLock::lease_id(&x),
            EtcdLock::lease_id(y.granted_lease())
        );
        // x is never renewed: b gets it after about its ttl although y's watchdog keeps the
        // shared lease alive.
        let got = b
            .acquire(&kx, ttl, Instant::now() + ttl * 3)
            .await
            .expect("an unrenewed lock must lapse on its own ttl");
        assert!(start.elapsed() >= ttl * 9 / 10, "{:?}", start.elapsed());
        assert!(!a.release(&x).await.unwrap());
        assert!(!y.is_lost());
        assert!(b.try_acquire(&ky, ttl).await.unwrap().is_none());
        assert!(y.release().await.unwrap());
        assert!(b.release(&got).await.unwrap());
    });
}

/// Waits until `key` has `n` queue entries.
async fn queued(env: &Env, key: &LockKey, n: usize) -> Vec<(String, i64)> {
    let until = Instant::now() + SLACK;
    loop {
        let e = env.entries(key).await;
        if e.len() == n || Instant::now() > until {
            assert_eq!(e.len(), n, "queue entries of {key}");
            return e;
        }
        sleep(Duration::from_millis(10)).await;
    }
}

#[test]
fn the_next_in_line_takes_over_without_reading_again() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (a, b) = (env.client().await, env.client().await);
        let key = fresh("next-in-line");
        let held = a.try_acquire(&key, LONG).await.unwrap().unwrap();
        let before = b.request_counts();
        let waiter = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move { b.acquire(&key, LONG, Instant::now() + LONG).await })
        };
        queued(&env, &key, 2).await;
        assert!(a.release(&held).await.unwrap());
        let lease = timeout(SLACK, waiter).await.unwrap().unwrap().unwrap();
        let after = b.request_counts();
        // The put (which also reads who is ahead), at most one read of the queue when its
        // watch started after the put (another client wrote in between), none after the
        // predecessor went: a re-read then would make it three.
        assert!(after.txn - before.txn <= 2, "{before:?} -> {after:?}");
        assert_eq!(after.watch - before.watch, 1, "{before:?} -> {after:?}");
        assert_eq!(after.range, before.range, "{before:?} -> {after:?}");
        assert!(lease.fencing_token() > held.fencing_token());
        assert!(b.release(&lease).await.unwrap());
    });
}

/// A waiter's queue watch is parked for its client's next wait on the same lock (a watch
/// created while others write can be registered "unsynced" at etcd and deliver its events up
/// to 100 ms late): the second hand-off opens no watch, and is as exact as the first — the
/// deletions it saw while parked (its own earlier release among them) count for nothing.
#[test]
fn a_second_wait_on_the_same_lock_reuses_the_parked_queue_watch() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (a, b) = (env.client().await, env.client().await);
        let key = fresh("parked-watch");
        let mut last_fence = None;
        let mut watches = Vec::new();
        for _ in 0..3 {
            let held = a.try_acquire(&key, LONG).await.unwrap().unwrap();
            assert!(held.fencing_token() > last_fence);
            let before = b.request_counts();
            let waiter = {
                let (b, key) = (b.clone(), key.clone());
                tokio::spawn(async move { b.acquire(&key, LONG, Instant::now() + LONG).await })
            };
            queued(&env, &key, 2).await;
            // Still A's: the parked watch's old events (the earlier releases of both) grant
            // nothing. (Absence of an event: a bounded look.)
            sleep(Duration::from_millis(100)).await;
            assert!(!waiter.is_finished(), "granted while A holds");
            assert!(a.release(&held).await.unwrap());
            let lease = timeout(SLACK, waiter).await.unwrap().unwrap().unwrap();
            watches.push(b.request_counts().watch - before.watch);
            assert!(lease.fencing_token() > held.fencing_token());
            assert!(a.try_acquire(&key, LONG).await.unwrap().is_none());
            last_fence = lease.fencing_token();
            assert!(b.release(&lease).await.unwrap());
        }
        assert_eq!(watches, [1, 0, 0], "watches opened per wait");
    });
}

/// A waiter whose entry is deleted from outside (its lease lives on) never gets the lock through
/// it: it queues again (a new entry, a new create revision) and is granted through that one.
#[test]
fn a_next_in_line_waiter_whose_key_is_deleted_queues_again() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (a, b) = (env.client().await, env.client().await);
        let key = fresh("deleted-waiter");
        let held = a.try_acquire(&key, LONG).await.unwrap().unwrap();
        let waiter = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move { b.acquire(&key, LONG, Instant::now() + LONG).await })
        };
        let entries = queued(&env, &key, 2).await;
        // Only the waiter's key goes (its lease stays alive); then the holder releases.
        let deleted = env.delete_entry(&entries[1].0).await;
        assert!(a.release(&held).await.unwrap());
        let lease = timeout(SLACK, waiter)
            .await
            .expect("the waiter must be granted, not hang")
            .unwrap()
            .expect("a waiter whose entry was deleted queues again within its deadline");
        env.holds_anew(&key, &lease, deleted, &a).await;
        assert!(b.release(&lease).await.unwrap());
    });
}

#[test]
fn a_waiter_behind_one_that_gives_up_waits_for_the_holder() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (a, b, c) = (env.client().await, env.client().await, env.client().await);
        let key = fresh("middle-gives-up");
        let held = a.try_acquire(&key, LONG).await.unwrap().unwrap();
        let middle = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move { b.acquire(&key, LONG, Instant::now() + LONG).await })
        };
        queued(&env, &key, 2).await;
        let last = {
            let (c, key) = (c.clone(), key.clone());
            tokio::spawn(async move { c.acquire(&key, LONG, Instant::now() + LONG).await })
        };
        queued(&env, &key, 3).await;
        // The middle waiter gives up: its entry goes, the holder still holds.
        middle.abort();
        queued(&env, &key, 2).await;
        sleep(Duration::from_millis(300)).await;
        assert!(
            !last.is_finished(),
            "the last waiter took the lock while it was held"
        );
        assert!(a.release(&held).await.unwrap());
        let lease = timeout(SLACK, last).await.unwrap().unwrap().unwrap();
        assert!(lease.fencing_token() > held.fencing_token());
        assert!(c.release(&lease).await.unwrap());
    });
}

#[test]
fn concurrent_first_acquisitions_share_one_new_lease() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let a = env.client().await;
        let keys: Vec<LockKey> = (0..32).map(|i| fresh(&format!("together{i}"))).collect();
        let before = a.request_counts();
        let leases = futures::future::join_all(keys.iter().map(|k| {
            let a = a.clone();
            async move { a.try_acquire(k, LONG).await.unwrap().unwrap() }
        }))
        .await;
        let after = a.request_counts();
        assert_eq!(
            after.lease_grant - before.lease_grant,
            1,
            "{before:?} -> {after:?}"
        );
        assert_eq!(a.session_count(), 1);
        for l in &leases {
            assert!(a.release(l).await.unwrap());
        }
        no_sessions_left(&a).await;
    });
}

/// Waits (bounded) until the client's idle leases were revoked.
async fn no_sessions_left(a: &EtcdLock) {
    let until = Instant::now() + SLACK;
    while a.session_count() > 0 {
        assert!(Instant::now() < until, "an idle lease was never revoked");
        sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn a_lock_taken_and_released_in_a_loop_reuses_its_lease() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (a, b) = (env.client().await, env.client().await);
        let ttl = Duration::from_secs(10);
        let key = fresh("loop");
        let first = a.try_acquire(&key, ttl).await.unwrap().unwrap();
        assert!(a.release(&first).await.unwrap());
        // The driver's idle grace period (lock.rs: a quarter of the TTL, at most 1 s). A gap
        // between a release and the next acquisition that a stalled machine stretches past it
        // may cost one revoke and one new grant (measured, see the idle-gaps test); none else.
        let grace = (ttl / 4).min(Duration::from_secs(1));
        let mut long_gaps = 0u64;
        let mut idle_since = Instant::now();
        let before = a.request_counts();
        for _ in 0..10 {
            let l = a.try_acquire(&key, ttl).await.unwrap().unwrap();
            long_gaps += u64::from(Instant::now().duration_since(idle_since) >= grace);
            idle_since = Instant::now();
            assert!(a.release(&l).await.unwrap());
        }
        let after = a.request_counts();
        // A put and a delete per cycle on the lease kept from the first cycle.
        assert!(
            after.lease_grant - before.lease_grant <= long_gaps,
            "{long_gaps} gaps past {grace:?}: {before:?} -> {after:?}"
        );
        assert_eq!(after.txn - before.txn, 20, "{before:?} -> {after:?}");
        assert!(
            after.lease_revoke - before.lease_revoke <= long_gaps,
            "{long_gaps} gaps past {grace:?}: {before:?} -> {after:?}"
        );
        let revoked_in_loop = after.lease_revoke - before.lease_revoke;
        // The released lock is free for others meanwhile, and the idle lease goes in the end.
        let l = b.try_acquire(&key, ttl).await.unwrap().unwrap();
        assert!(b.release(&l).await.unwrap());
        no_sessions_left(&a).await;
        no_sessions_left(&b).await;
        assert_eq!(
            a.request_counts().lease_revoke,
            before.lease_revoke + revoked_in_loop + 1
        );
    });
}

#[test]
fn a_waiter_further_back_whose_key_is_deleted_queues_again() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (a, b, c) = (env.client().await, env.client().await, env.client().await);
        let key = fresh("deleted-further-back");
        let held = a.try_acquire(&key, LONG).await.unwrap().unwrap();
        let second = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move { b.acquire(&key, LONG, Instant::now() + LONG).await })
        };
        queued(&env, &key, 2).await;
        let third = {
            let (c, key) = (c.clone(), key.clone());
            tokio::spawn(async move { c.acquire(&key, LONG, Instant::now() + LONG).await })
        };
        let entries = queued(&env, &key, 3).await;
        // Only the last waiter's key goes (its lease lives); then the lock passes down the queue.
        let deleted = env.delete_entry(&entries[2].0).await;
        assert!(a.release(&held).await.unwrap());
        let lease = timeout(SLACK, second).await.unwrap().unwrap().unwrap();
        assert!(b.release(&lease).await.unwrap());
        let lease = timeout(SLACK, third)
            .await
            .expect("the waiter must be granted, not hang")
            .unwrap()
            .expect("a waiter whose entry was deleted queues again within its deadline");
        env.holds_anew(&key, &lease, deleted, &a).await;
        assert!(c.release(&lease).await.unwrap());
    });
}

#[test]
fn held_locks_share_one_watch_stream_and_each_deletion_reaches_only_its_guard() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let a = env.client().await;
        let ttl = Duration::from_secs(10);
        let keys: Vec<LockKey> = (0..40).map(|i| fresh(&format!("watched{i}"))).collect();
        let mut guards = Vec::new();
        for k in &keys {
            guards.push(a.lock(k).ttl(ttl).try_acquire().await.unwrap().unwrap());
        }
        // Half of them go at once: their watches are forgotten, some while still being created.
        let kept = guards.split_off(20);
        for g in guards {
            assert!(g.release().await.unwrap());
        }
        // Two of the rest are deleted from outside: exactly those two are lost. A third, the
        // sentinel, is deleted after them: the shared stream delivers events in revision
        // order, so once the sentinel's guard is told, every event of the two deletions has
        // been dispatched (an awaited event instead of a sleep), and no other guard may be lost.
        const SENTINEL: usize = 19;
        let lost = |i: usize| i == 3 || i == 17 || i == SENTINEL;
        for victim in [3, 17, SENTINEL] {
            env.admin
                .kv_client()
                .delete(
                    EtcdLock::entry_key(kept[victim].granted_lease()).unwrap(),
                    None,
                )
                .await
                .unwrap();
        }
        for victim in [3, 17, SENTINEL] {
            timeout(SLACK, kept[victim].lost())
                .await
                .expect("the deleted lock's guard must be told");
        }
        tokio::task::yield_now().await;
        for (i, g) in kept.iter().enumerate() {
            assert_eq!(g.is_lost(), lost(i), "guard {i}");
        }
        for (i, g) in kept.into_iter().enumerate() {
            assert_eq!(g.release().await.unwrap(), !lost(i), "guard {i}");
        }
    });
}

#[test]
fn an_idle_lease_used_again_within_its_grace_period_is_kept() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let a = env.client().await;
        // A 4 s TTL: the idle grace period is 1 s. Cycles 100 ms apart for about 1.5 s: every
        // idle gap is far shorter than the grace period (room for a loaded machine's stalls),
        // though the first releases' reapers fire in later gaps.
        let ttl = Duration::from_secs(4);
        // The driver's grace period (lock.rs: a quarter of the TTL, at most 1 s).
        let grace = (ttl / 4).min(Duration::from_secs(1));
        let key = fresh("idle-gaps");
        let before = a.request_counts();
        // Each idle gap measured from before the release that starts it (the lease goes idle
        // inside it) to after the acquisition that ends it (which takes the lease inside it):
        // a gap shorter than the grace period cannot have seen its reaper revoke the lease.
        // A stall that makes one longer allows one more lease grant, no more.
        let (mut gaps, mut long_gaps) = (Vec::new(), 0);
        let mut idle_since = None;
        for _ in 0..15 {
            let l = a.try_acquire(&key, ttl).await.unwrap().unwrap();
            if let Some(since) = idle_since {
                let gap = Instant::now().duration_since(since);
                long_gaps += usize::from(gap >= grace);
                gaps.push(gap);
            }
            idle_since = Some(Instant::now());
            assert!(a.release(&l).await.unwrap());
            sleep(Duration::from_millis(100)).await;
        }
        let after = a.request_counts();
        let grants = after.lease_grant - before.lease_grant;
        assert!(
            grants >= 1 && grants <= 1 + long_gaps as u64,
            "a lease idle for less than its grace period {grace:?} was revoked: {grants} grants \
             with {long_gaps} gaps of the grace period or more ({gaps:?}); {before:?} -> {after:?}"
        );
        assert!(
            long_gaps < gaps.len(),
            "every gap outlasted the grace period ({gaps:?}): nothing was tested"
        );
        no_sessions_left(&a).await;
    });
}

/// Issue 25 C13: `inspect` from any client names the current holder (its identity is written by
/// the put that creates its entry), across a release to a queued waiter and a new acquisition;
/// an older distlock's entry (token only) reads as no identity.
#[test]
fn inspect_names_the_current_holder_never_a_previous_one() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let labelled = |label: &str| {
            let url = format!(
                "{}{}label={label}",
                env.url,
                if env.url.contains('?') { '&' } else { '?' }
            );
            async move { Arc::new(EtcdLock::connect_url(&url).await.unwrap()) }
        };
        let (a, b, observer) = (
            labelled("holder-a").await,
            labelled("holder-b").await,
            env.client().await,
        );
        let key = fresh("identity");
        let holder_of = |info: Option<lock_core::HolderInfo>| {
            info.expect("held")
                .holder
                .map(|h| h.as_str().to_owned())
                .unwrap_or_default()
        };
        let pid = format!(" pid={} ", std::process::id());

        let first = a.try_acquire(&key, LONG).await.unwrap().unwrap();
        let shown = holder_of(observer.inspect(&key).await.unwrap());
        assert!(
            shown.starts_with("host=") && shown.contains(&pid),
            "{shown}"
        );
        assert!(shown.ends_with(" label=holder-a"), "{shown}");

        // A queued waiter does not change who is shown; the hand-off does.
        let waiter = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move { b.acquire(&key, LONG, Instant::now() + LONG).await })
        };
        queued(&env, &key, 2).await;
        let shown = holder_of(observer.inspect(&key).await.unwrap());
        assert!(shown.ends_with(" label=holder-a"), "while b waits: {shown}");
        assert!(a.release(&first).await.unwrap());
        let second = timeout(SLACK, waiter).await.unwrap().unwrap().unwrap();
        let shown = holder_of(a.inspect(&key).await.unwrap());
        assert!(
            shown.ends_with(" label=holder-b"),
            "after the hand-off: {shown}"
        );

        // Released, then taken again by the first client on the same (reused) lease.
        assert!(b.release(&second).await.unwrap());
        let third = a.try_acquire(&key, LONG).await.unwrap().unwrap();
        let shown = holder_of(b.inspect(&key).await.unwrap());
        assert!(
            shown.ends_with(" label=holder-a"),
            "after release and acquire: {shown}"
        );
        assert!(a.release(&third).await.unwrap());
        let unlabelled = observer.try_acquire(&key, LONG).await.unwrap().unwrap();
        let shown = holder_of(a.inspect(&key).await.unwrap());
        assert!(shown.contains(&pid) && !shown.contains("label="), "{shown}");
        assert!(observer.release(&unlabelled).await.unwrap());

        // An entry written by an older distlock: the token alone.
        let lease = env.admin.lease_client().grant(30, None).await.unwrap().id();
        let token = lock_core::OwnershipToken::generate();
        env.admin
            .kv_client()
            .put(
                format!("distlock/{key}/{lease:x}"),
                token.expose_hex(),
                Some(etcd_client::PutOptions::new().with_lease(lease)),
            )
            .await
            .unwrap();
        let info = observer
            .inspect(&key)
            .await
            .unwrap()
            .expect("the old entry holds it");
        assert_eq!(info.token_digest, Some(token.digest()));
        assert_eq!(info.holder, None);
        env.revoke(lease).await;
    });
}

/// Issue 25 C13: a bad label is a configuration error before any I/O (port 1 is closed: any
/// request would fail as `Unavailable`), from the URL and from the struct.
#[test]
fn a_bad_label_is_a_config_error_before_any_io() {
    rt().block_on(async {
        for url in [
            "etcd://127.0.0.1:1?label=a%20b",
            "etcd://127.0.0.1:1?label=",
        ] {
            let err = EtcdLock::connect_url(url).await.unwrap_err();
            assert!(matches!(err, lock_core::Error::Config(_)), "{url}: {err:?}");
        }
        let mut cfg = EtcdLockConfig::new(["127.0.0.1:1"]);
        cfg.label = Some("x".repeat(65));
        let err = EtcdLock::connect(cfg).await.unwrap_err();
        assert!(matches!(err, lock_core::Error::Config(_)), "{err:?}");
    });
}
