//! Regression tests for the December 2026 review of lock-etcd on a real etcd
//! (`DISTLOCK_TEST_ETCD_URL`), through the drill proxy where a link has to fail.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use conformance::drill::Proxy;
use etcd_client::{GetOptions, PutOptions, SortOrder, SortTarget};
use lock_core::{DistributedLock, DistributedLockExt, Error, LockKey};
use lock_etcd::{EtcdLock, EtcdLockConfig};
use tokio::time::{Instant, sleep, timeout};

const LONG: Duration = Duration::from_secs(30);
const SLACK: Duration = Duration::from_secs(5);

struct Env {
    url: String,
    admin: etcd_client::Client,
}

async fn env() -> Option<Env> {
    let url = conformance::backend_url("DISTLOCK_TEST_ETCD_URL")?;
    let cfg = EtcdLockConfig::from_url(&url).unwrap();
    let admin = etcd_client::Client::connect([format!("http://{}", cfg.endpoints[0])], None)
        .await
        .unwrap();
    Some(Env { url, admin })
}

impl Env {
    async fn client(&self) -> Arc<EtcdLock> {
        Arc::new(EtcdLock::connect_url(&self.url).await.unwrap())
    }

    /// A client whose traffic goes through a fresh drill proxy.
    async fn proxied(&self, tweak: impl FnOnce(&mut EtcdLockConfig)) -> (Proxy, Arc<EtcdLock>) {
        let (proxy, proxied) = Proxy::start_for_url(&self.url).await.unwrap();
        let mut cfg = EtcdLockConfig::from_url(&proxied).unwrap();
        tweak(&mut cfg);
        (proxy, Arc::new(EtcdLock::connect(cfg).await.unwrap()))
    }

    /// Every key under `key`'s range (default prefix), oldest first: (key, lease).
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
}

fn fresh(label: &str) -> LockKey {
    LockKey::new(format!("{label}-{:016x}", rand::random::<u64>())).unwrap()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Review S1 end to end: renewals dropped at every point of their life (never polled, mid
/// keepalive, mid entry check) never make a later renewal of a revoked lease return `Ok`.
#[test]
fn renewals_dropped_mid_flight_never_let_a_revoked_lease_renew() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let lock = env.client().await;
        let ttl = Duration::from_secs(10);
        let key = fresh("s1-dropped");
        let mut lease = lock.try_acquire(&key, ttl).await.unwrap().unwrap();
        let id = EtcdLock::lease_id(&lease).unwrap();
        lock.renew(&mut lease, ttl).await.unwrap();
        for cut_us in [0, 1, 10, 100, 300, 700, 1_000, 2_000, 4_000, 8_000] {
            let _ = timeout(Duration::from_micros(cut_us), lock.renew(&mut lease, ttl)).await;
        }
        sleep(Duration::from_millis(300)).await; // abandoned answers arrive, unread by us
        env.admin.lease_client().revoke(id).await.unwrap();
        let other = env.client().await;
        let theirs = other.try_acquire(&key, ttl).await.unwrap();
        assert!(theirs.is_some(), "the key is free after the revoke");
        let renewed = lock.renew(&mut lease, ttl).await;
        assert!(
            matches!(renewed, Err(Error::NotHeld { .. })),
            "renew of a revoked lease returned {renewed:?}"
        );
        assert!(other.release(&theirs.unwrap()).await.unwrap());
    });
}

/// Review S8: renew proves the entry itself, not only the shared lease. After an operator's
/// `force_release` (or a delete of the key), renew says `NotHeld` although a neighbour lock on
/// the same lease keeps renewing fine.
#[test]
fn renew_after_force_release_is_not_held_while_the_neighbour_renews() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (lock, operator) = (env.client().await, env.client().await);
        let ttl = Duration::from_secs(10);
        let (kx, ky, kz) = (
            fresh("s8-victim"),
            fresh("s8-neighbour"),
            fresh("s8-deleted"),
        );
        let mut x = lock.try_acquire(&kx, ttl).await.unwrap().unwrap();
        let mut y = lock.try_acquire(&ky, ttl).await.unwrap().unwrap();
        let mut z = lock.try_acquire(&kz, ttl).await.unwrap().unwrap();
        assert_eq!(EtcdLock::lease_id(&x), EtcdLock::lease_id(&y));
        assert!(operator.force_release(&kx).await.unwrap());
        env.admin
            .kv_client()
            .delete(EtcdLock::entry_key(&z).unwrap(), None)
            .await
            .unwrap();
        // The neighbour's renewal sends a fresh keepalive first.
        lock.renew(&mut y, ttl).await.unwrap();
        let renewed = lock.renew(&mut x, ttl).await;
        assert!(
            matches!(renewed, Err(Error::NotHeld { .. })),
            "renew after force_release returned {renewed:?}"
        );
        let renewed = lock.renew(&mut z, ttl).await;
        assert!(
            matches!(renewed, Err(Error::NotHeld { .. })),
            "renew after the key was deleted returned {renewed:?}"
        );
        lock.renew(&mut y, ttl).await.unwrap();
        assert!(!lock.release(&x).await.unwrap());
        assert!(lock.release(&y).await.unwrap());
    });
}

/// Issue 24: a tick of guards costs one keepalive, not a read per lock: an entry whose deletion
/// watch is in place renews without a read, and its deletion (or its move to another lease) is
/// pushed instead — the holder learns of an operator's `force_release` without any renewal.
#[test]
fn watched_entries_renew_with_one_keepalive_and_their_deletion_is_pushed() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (lock, operator) = (env.client().await, env.client().await);
        let ttl = Duration::from_secs(10);
        let keys: Vec<LockKey> = (0..20).map(|i| fresh(&format!("watched{i}"))).collect();
        let mut leases = Vec::new();
        for k in &keys {
            leases.push(lock.try_acquire(k, ttl).await.unwrap().unwrap());
        }
        // What the guards' scheduler does: poll every lease's `watch_lost`.
        let losses: Vec<_> = leases
            .iter()
            .map(|l| tokio::spawn(lock.watch_lost(l)))
            .collect();
        let until = Instant::now() + LONG;
        while !leases.iter().all(EtcdLock::is_entry_watched) {
            assert!(
                Instant::now() < until,
                "the deletion watches were never created"
            );
            sleep(Duration::from_millis(10)).await;
        }

        let before = lock.request_counts();
        let renewals = leases.iter_mut().map(|l| {
            let lock = lock.clone();
            async move { lock.renew(l, ttl).await }
        });
        for r in futures::future::join_all(renewals).await {
            r.unwrap();
        }
        let after = lock.request_counts();
        assert_eq!(after.txn, before.txn, "{before:?} -> {after:?}");
        assert_eq!(after.range, before.range, "{before:?} -> {after:?}");
        assert!(
            after.lease_keepalive - before.lease_keepalive <= 1,
            "{before:?} -> {after:?}"
        );

        // An operator's override is pushed: no renewal needed to learn it.
        let mut losses = losses.into_iter();
        let victim = losses.next().unwrap();
        assert!(operator.force_release(&keys[0]).await.unwrap());
        let reason = timeout(SLACK, victim)
            .await
            .expect("the deletion was not pushed");
        eprintln!("force_release pushed: {reason:?}");
        assert!(!EtcdLock::is_entry_watched(&leases[0]));
        let renewed = lock.renew(&mut leases[0], ttl).await;
        assert!(
            matches!(renewed, Err(Error::NotHeld { .. })),
            "renew after force_release returned {renewed:?}"
        );

        // So is a put that moves the entry off our lease (it would no longer expire with it).
        let moved = losses.next().unwrap();
        env.admin
            .kv_client()
            .put(EtcdLock::entry_key(&leases[1]).unwrap(), "tampered", None)
            .await
            .unwrap();
        timeout(SLACK, moved)
            .await
            .expect("the move to another lease was not pushed")
            .unwrap();

        // The rest are untouched and still renew without a read.
        let rest: Vec<_> = losses.collect();
        let before = lock.request_counts();
        for l in &mut leases[2..] {
            lock.renew(l, ttl).await.unwrap();
        }
        assert_eq!(lock.request_counts().txn, before.txn);
        assert!(rest.iter().all(|t| !t.is_finished()));
        for l in &leases[2..] {
            assert!(lock.release(l).await.unwrap());
        }
        env.admin
            .kv_client()
            .delete(EtcdLock::entry_key(&leases[1]).unwrap(), None)
            .await
            .unwrap();
    });
}

/// Issue 24: guards on one session are one renewal group — a tick is one keepalive, no read
/// and no per-lock renewal; the group keeps every entry (the reaper leaves members alone, and
/// etcd holds them past their first deadline); an operator's override of one member is pushed
/// to that guard alone.
#[test]
fn guards_on_one_session_renew_as_one_group() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (lock, operator) = (env.client().await, env.client().await);
        let user: lock_core::DynLock = lock.clone();
        let ttl = Duration::from_secs(3);
        let keys: Vec<LockKey> = (0..30).map(|i| fresh(&format!("group{i}"))).collect();
        let mut guards = Vec::new();
        for k in &keys {
            let guard = user.lock(k.as_str()).ttl(ttl).try_acquire().await.unwrap();
            guards.push(guard.expect("a fresh key is free"));
        }
        // Past the first deadlines the acquisitions gave: only the group renewed them (a
        // member left in the reaper's queue would be deleted at its first deadline).
        sleep(ttl / 2).await;
        let before = lock.request_counts();
        sleep(ttl * 3 / 2).await;
        let after = lock.request_counts();
        assert_eq!(after.txn, before.txn, "{before:?} -> {after:?}");
        assert_eq!(after.range, before.range, "{before:?} -> {after:?}");
        let keepalives = after.lease_keepalive - before.lease_keepalive;
        assert!(
            // About 2 renewals fall in the window; retries of a keepalive that timed out on a
            // loaded machine may add a few (its backoff is 125–500 ms).
            (1..=10).contains(&keepalives),
            "{keepalives} keepalives for 1.5 s of 30 guards renewed every 1 s"
        );
        for (g, k) in guards.iter().zip(&keys) {
            assert!(!g.is_lost(), "{k}: {:?}", g.loss_reason());
            assert!(g.renewals() >= 1, "{k} counted no renewal");
            assert_eq!(env.entries(k).await.len(), 1, "{k}: entry gone while held");
        }

        // An operator's override of one member: pushed to it alone.
        assert!(operator.force_release(&keys[0]).await.unwrap());
        timeout(SLACK, guards[0].lost())
            .await
            .expect("the deletion was not pushed");
        sleep(ttl).await;
        for (i, g) in guards.iter().enumerate() {
            assert_eq!(g.is_lost(), i == 0, "{}: {:?}", keys[i], g.loss_reason());
        }
        for g in guards {
            g.release().await.unwrap();
        }
        for k in &keys {
            assert!(env.entries(k).await.is_empty(), "{k} left behind");
        }
    });
}

/// Review S3: a grant confirmed only after its local deadline passed (every chunk on the link
/// delayed past the TTL) is withdrawn, never returned; the key is left free.
#[test]
fn a_grant_confirmed_after_its_local_deadline_is_never_returned() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (proxy, lock) = env.proxied(|c| c.timeout = Duration::from_secs(20)).await;
        let ttl = lock.capabilities().min_ttl;
        let key = fresh("s3-late");
        // Every chunk delayed: the lease grant and the put together take longer than the TTL.
        proxy.delay(ttl / 4);
        let start = Instant::now();
        let got = lock.try_acquire(&key, ttl).await;
        eprintln!("late grant after {:?}: {got:?}", start.elapsed());
        match &got {
            Err(Error::Unavailable { .. }) => {}
            Ok(Some(lease)) => panic!(
                "try_acquire returned a lease {:?} past its local deadline (valid: {})",
                lease.local_deadline().elapsed(),
                lease.is_locally_valid()
            ),
            other => panic!("expected Unavailable, got {other:?}"),
        }
        proxy.pass();
        // Withdrawn: the key is free for another client within the TTL.
        let other = env.client().await;
        let until = Instant::now() + ttl + SLACK;
        let theirs = other
            .acquire(&key, ttl, until)
            .await
            .expect("the withdrawn grant must not block the key");
        assert!(other.release(&theirs).await.unwrap());
    });
}

/// Review L1: an entry on this client's lease that no attempt of this client owns (a put that
/// applied after its attempt gave up) never blocks the lock for good: the next attempt deletes
/// it and succeeds instead of failing with "already exists".
#[test]
fn a_leftover_entry_on_our_lease_is_removed_by_the_next_attempt() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let lock = env.client().await;
        let ttl = Duration::from_secs(20);
        let anchor = lock
            .try_acquire(&fresh("l1-anchor"), ttl)
            .await
            .unwrap()
            .unwrap();
        let id = EtcdLock::lease_id(&anchor).unwrap();
        let key = fresh("l1-leftover");
        // What a late put leaves: our lease, our layout, a token no attempt holds.
        env.admin
            .kv_client()
            .put(
                format!("distlock/{key}/{id:x}"),
                "00112233445566778899aabbccddeeff",
                Some(PutOptions::new().with_lease(id)),
            )
            .await
            .unwrap();
        let got = lock.try_acquire(&key, ttl).await;
        let lease = got
            .expect("a leftover entry must not be a permanent error")
            .expect("nobody else holds the key");
        assert!(lock.release(&lease).await.unwrap());
        assert!(env.entries(&key).await.is_empty());
        assert!(lock.release(&anchor).await.unwrap());
    });
}

/// Review L1: a put whose replies are lost (it applied) is withdrawn once the link works
/// again; it is never reported held, and nothing of it is left to block others.
#[test]
fn a_put_whose_reply_was_lost_leaves_nothing_behind() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (proxy, lock) = env
            .proxied(|c| c.timeout = Duration::from_millis(500))
            .await;
        let ttl = Duration::from_secs(20);
        // A session first, so the next attempt's only request is the put.
        let anchor = lock
            .try_acquire(&fresh("l1-anchor"), ttl)
            .await
            .unwrap()
            .unwrap();
        let key = fresh("l1-lost-reply");
        proxy.drop_replies();
        let got = lock.try_acquire(&key, ttl).await;
        assert!(
            matches!(
                got,
                Err(Error::Indeterminate { .. } | Error::Unavailable { .. })
            ),
            "{got:?}"
        );
        // The put applied (only its reply was lost); so may have the withdrawal, whose reply is
        // lost too. Either way, once the link is back nothing of the attempt is left.
        proxy.pass();
        let until = Instant::now() + SLACK * 2;
        while !env.entries(&key).await.is_empty() {
            assert!(
                Instant::now() < until,
                "the lost put's entry was never removed"
            );
            sleep(Duration::from_millis(50)).await;
        }
        let other = env.client().await;
        let theirs = other.try_acquire(&key, ttl).await.unwrap().unwrap();
        assert!(other.release(&theirs).await.unwrap());
        let again = lock.try_acquire(&key, ttl).await.unwrap();
        assert!(again.is_some(), "this client can take the key again");
        assert!(lock.release(&again.unwrap()).await.unwrap());
        assert!(lock.release(&anchor).await.unwrap());
    });
}

/// Review L3: with the server unreachable (every byte held), eight `acquire`s with a 1 s
/// deadline on one client — queued on one keepalive, one lease grant, their puts — all return
/// `Timeout` by the deadline plus a small slack; a `try_acquire` is bounded by one request
/// timeout.
#[test]
fn acquire_against_a_stalled_server_returns_by_its_deadline() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (proxy, lock) = env.proxied(|c| c.timeout = Duration::from_secs(2)).await;
        let ttl = Duration::from_secs(6);
        // One held lock: its session is what the next acquisitions keep alive first.
        let held = lock
            .try_acquire(&fresh("l3-held"), ttl)
            .await
            .unwrap()
            .unwrap();
        // Past the freshness window (ttl/8): the next acquisition needs a keepalive.
        sleep(ttl / 8 + Duration::from_millis(100)).await;
        proxy.blackhole();
        let wait = Duration::from_secs(1);
        let start = Instant::now();
        let keys: Vec<LockKey> = (0..8).map(|i| fresh(&format!("l3-stalled-{i}"))).collect();
        let attempts = keys.iter().map(|key| {
            let lock = lock.clone();
            async move {
                let r = lock.acquire(key, ttl, start + wait).await;
                (r, start.elapsed())
            }
        });
        // Noisy 2-core machine: scheduling, not I/O, is what the slack covers.
        let slack = Duration::from_millis(500);
        let mut worst = Duration::ZERO;
        for (r, took) in futures::future::join_all(attempts).await {
            assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
            assert!(took <= wait + slack, "acquire returned after {took:?}");
            worst = worst.max(took);
        }
        eprintln!("8 acquires with a 1 s deadline against a stalled etcd: slowest {worst:?}");
        let start = Instant::now();
        let r = lock.try_acquire(&fresh("l3-try"), ttl).await;
        let took = start.elapsed();
        assert!(r.is_err(), "{r:?}");
        assert!(
            took <= Duration::from_secs(2) + slack,
            "try_acquire took {took:?}"
        );
        proxy.pass();
        // Nothing of the timed-out attempts stays queued once the link is back (their clean-ups
        // went to the background), and each key can be taken at once.
        let until = Instant::now() + ttl + SLACK;
        for key in &keys {
            while !env.entries(key).await.is_empty() {
                assert!(Instant::now() < until, "a timed-out attempt left its entry");
                sleep(Duration::from_millis(50)).await;
            }
            let l = lock.try_acquire(key, ttl).await.unwrap();
            assert!(l.is_some(), "{key} is not free after the heal");
            assert!(lock.release(&l.unwrap()).await.unwrap());
        }
        // Everything works again once the link heals.
        let key = fresh("l3-after");
        let l = lock
            .acquire(&key, ttl, Instant::now() + SLACK)
            .await
            .unwrap();
        assert!(lock.release(&l).await.unwrap());
        let _ = lock.release(&held).await;
    });
}

/// Review L3: waiters on clients of their own, queued behind a holder when the link stalls,
/// return by their deadline although leaving the queue (a txn, or revoking the waiter's own
/// lease) cannot get through; their entries are gone soon after the link heals (long before
/// their 30 s leases could expire).
#[test]
fn queued_waiters_return_by_their_deadline_when_the_link_stalls() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (proxy, proxied) = Proxy::start_for_url(&env.url).await.unwrap();
        let holder = env.client().await;
        let ttl = LONG;
        let key = fresh("l3-queued");
        let held = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
        let mut waiters = Vec::new();
        for _ in 0..4 {
            // The default request timeout (5 s): the deadline must be what bounds the wait.
            waiters.push(Arc::new(EtcdLock::connect_url(&proxied).await.unwrap()));
        }
        let wait = Duration::from_millis(1500);
        let start = Instant::now();
        let tasks: Vec<_> = waiters
            .iter()
            .map(|w| {
                let (w, key) = (w.clone(), key.clone());
                tokio::spawn(async move {
                    let r = w.acquire(&key, ttl, start + wait).await;
                    (r.map(|l| l.fencing_token()), start.elapsed())
                })
            })
            .collect();
        let until = Instant::now() + SLACK;
        while env.entries(&key).await.len() < 5 {
            assert!(Instant::now() < until, "the waiters never queued");
            sleep(Duration::from_millis(10)).await;
        }
        proxy.blackhole();
        // The foreground grace for leaving the queue (150 ms) plus scheduling noise.
        let slack = Duration::from_millis(500);
        for t in tasks {
            let (r, took) = t.await.unwrap();
            assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
            assert!(
                took <= wait + slack,
                "a queued waiter returned after {took:?}"
            );
        }
        proxy.pass();
        let until = Instant::now() + SLACK;
        while env.entries(&key).await.len() > 1 {
            assert!(Instant::now() < until, "a timed-out waiter left its entry");
            sleep(Duration::from_millis(50)).await;
        }
        assert!(holder.release(&held).await.unwrap());
    });
}

/// A waiter that times out has left the queue when `acquire` returns: it is never handed the
/// lock afterwards (its client may exit at once).
#[test]
fn a_waiter_that_times_out_has_left_the_queue_when_acquire_returns() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let holder = env.client().await;
        let key = fresh("leave-on-timeout");
        let held = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
        for _ in 0..3 {
            let waiter = env.client().await;
            let r = waiter
                .acquire(&key, LONG, Instant::now() + Duration::from_millis(300))
                .await;
            assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
            let left = env.entries(&key).await;
            assert_eq!(
                left.len(),
                1,
                "a timed-out waiter is still queued: {left:?}"
            );
        }
        assert!(holder.release(&held).await.unwrap());
    });
}

/// Review L4: a waiter with its watch open still re-reads its place on a bounded period, so a
/// silent watch (a member cut off from the cluster, a lost event) cannot put it to sleep until
/// its deadline.
#[test]
fn a_waiter_rereads_its_place_while_its_watch_is_open() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (holder, waiter) = (env.client().await, env.client().await);
        let ttl = Duration::from_secs(2);
        let key = fresh("l4-reread");
        let held = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
        let before = waiter.request_counts();
        let task = {
            let (waiter, key) = (waiter.clone(), key.clone());
            tokio::spawn(async move { waiter.acquire(&key, ttl, Instant::now() + LONG).await })
        };
        // The re-read period for a 2 s TTL is 1 s: in 3.5 s at least two more looks.
        sleep(Duration::from_millis(3500)).await;
        let after = waiter.request_counts();
        assert!(!task.is_finished());
        assert!(
            after.txn - before.txn >= 3,
            "the waiter looked at the queue {} time(s) in 3.5 s with its watch open",
            after.txn - before.txn - 1
        );
        assert!(holder.release(&held).await.unwrap());
        let lease = timeout(SLACK, task).await.unwrap().unwrap().unwrap();
        assert!(waiter.release(&lease).await.unwrap());
    });
}

/// Review L12: with an empty prefix an application's key under `NAME/` does not block the lock
/// `NAME`, and a lock under a prefix that nests in another (`P/` + `b` vs `P/b/` + `x`) is
/// independent of it.
#[test]
fn keys_that_are_no_entries_never_block_a_lock() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let with_prefix = |prefix: &str| {
            let mut cfg = EtcdLockConfig::from_url(&env.url).unwrap();
            cfg.prefix = prefix.to_owned();
            cfg
        };
        let ttl = Duration::from_secs(10);
        // Empty prefix: `NAME/settings` belongs to an application, not to a contender.
        let bare = EtcdLock::connect(with_prefix("")).await.unwrap();
        let name = fresh("l12-bare");
        let app_key = format!("{name}/settings");
        env.admin
            .kv_client()
            .put(app_key.clone(), "v", None)
            .await
            .unwrap();
        let got = bare.try_acquire(&name, ttl).await.unwrap();
        let lease = got.expect("an application key blocked the lock");
        let info = bare.inspect(&name).await.unwrap().unwrap();
        assert_eq!(info.fencing_token, lease.fencing_token());
        assert!(bare.release(&lease).await.unwrap());
        env.admin.kv_client().delete(app_key, None).await.unwrap();

        // Nested prefixes: `P/` + `b` and `P/b/` + `x` are different locks.
        let p = format!("l12-nest-{:x}/", rand::random::<u64>());
        let outer = EtcdLock::connect(with_prefix(&p)).await.unwrap();
        let inner = EtcdLock::connect(with_prefix(&format!("{p}b/")))
            .await
            .unwrap();
        let x = inner
            .try_acquire(&LockKey::new("x").unwrap(), ttl)
            .await
            .unwrap()
            .expect("free");
        let b = outer
            .try_acquire(&LockKey::new("b").unwrap(), ttl)
            .await
            .unwrap();
        let b = b.expect("the nested prefix's lock blocked this one");
        assert!(outer.release(&b).await.unwrap());
        assert!(inner.release(&x).await.unwrap());
    });
}

/// An acquisition learns who owns the lock from the newest keys of the range its put reads
/// (33: ours and up to 32 ahead). When those are all keys that are no entries (an
/// application's keys under `NAME/` with an empty prefix), the owner is further back: it must
/// neither be missed (a second holder) nor be invented (a lock nobody holds refused). Seen red
/// with the put taking "no older entry among the newest" for ownership.
#[test]
fn many_keys_that_are_no_entries_neither_hide_the_holder_nor_block_the_lock() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let mut cfg = EtcdLockConfig::from_url(&env.url).unwrap();
        cfg.prefix = String::new();
        let (a, b) = (
            EtcdLock::connect(cfg.clone()).await.unwrap(),
            EtcdLock::connect(cfg).await.unwrap(),
        );
        let ttl = Duration::from_secs(10);
        let name = fresh("many-app-keys");
        let app_keys = |from: usize| (from..from + 40).map(|i| format!("{name}/app-{i:03}"));
        for k in app_keys(0) {
            env.admin.kv_client().put(k, "v", None).await.unwrap();
        }
        // 40 older keys, none an entry: the lock is free.
        let held = a.try_acquire(&name, ttl).await.unwrap();
        let held = held.expect("keys that are no entries blocked the lock");
        // 40 more keys after the holder's entry: the newest 33 hold no entry but the new one.
        for k in app_keys(40) {
            env.admin.kv_client().put(k, "v", None).await.unwrap();
        }
        assert!(
            b.try_acquire(&name, ttl).await.unwrap().is_none(),
            "a second holder: the holder's entry was behind the newest keys"
        );
        let waiter = tokio::spawn({
            let name = name.clone();
            async move {
                let got = b.acquire(&name, ttl, Instant::now() + LONG).await;
                (b, got)
            }
        });
        sleep(Duration::from_millis(300)).await;
        assert!(!waiter.is_finished(), "the waiter was granted a held lock");
        assert!(a.release(&held).await.unwrap());
        let (b, got) = timeout(SLACK, waiter).await.unwrap().unwrap();
        let lease = got.unwrap();
        assert!(lease.fencing_token() > held.fencing_token());
        assert!(b.release(&lease).await.unwrap());
        env.admin
            .kv_client()
            .delete(
                format!("{name}/"),
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            )
            .await
            .unwrap();
    });
}

/// A release whose request applied but whose replies are lost is sent again, and the re-send
/// (finding the entry gone) answers `Indeterminate`: not `Unavailable` — which promises that
/// nothing applied — and not `Ok(false)`, which would say the lease had been lost before.
/// Seen red before the re-send: `Unavailable` once the first request timed out (the failure
/// the etcd partition drills hit when a loaded majority answered one release late).
#[test]
fn a_release_whose_reply_is_lost_is_sent_again_and_says_it_does_not_know() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (proxy, lock) = env.proxied(|c| c.timeout = Duration::from_secs(1)).await;
        let key = fresh("release-lost-reply");
        let lease = lock
            .try_acquire(&key, Duration::from_secs(20))
            .await
            .unwrap()
            .expect("free");
        proxy.drop_replies();
        let release = tokio::spawn({
            let lock = Arc::clone(&lock);
            async move { lock.release(&lease).await }
        });
        // The delete applied and a reply was discarded. Then every connection open now is
        // reset before anything passes again, so the delete's reply can never arrive: healing
        // alone resets only the connections that discarded bytes, and on a loaded machine the
        // discarded turn was once another connection's while the delete's reply, not read yet,
        // then passed (`Ok(true)`). A reset is processed before the heal (the proxy's
        // connection task polls its reset first). Then the re-send goes through.
        let until = Instant::now() + SLACK;
        while !env.entries(&key).await.is_empty() || proxy.reply_turns() == 0 {
            assert!(Instant::now() < until, "the release never reached etcd");
            sleep(Duration::from_millis(10)).await;
        }
        proxy.reset();
        proxy.pass();
        let got = timeout(LONG, release)
            .await
            .expect("release returns")
            .unwrap();
        assert!(matches!(got, Err(Error::Indeterminate { .. })), "{got:?}");
    });
}
