//! Redis-specific behaviour against real servers: the shared one from `DISTLOCK_TEST_REDIS_URL`
//! and, for fault drills, private `redis-server` instances on free ports that these tests start,
//! pause, kill and restart through `scripts/backends.sh` (`conformance::servers::PrivateServer`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use conformance::{
    backend_url, fresh_key,
    servers::{PrivateServer, ServerKind, free_port},
};
use lock_core::{
    DistributedLock, DistributedLockExt, Error, FencingToken, LockKey, LossReason, OwnershipToken,
};
use lock_redis::{RedisLock, RedisLockConfig};
use redis::aio::MultiplexedConnection;
use tokio::time::{Instant, sleep, timeout};

const LONG: Duration = Duration::from_secs(30);

async fn admin(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn shared() -> Option<(String, Arc<RedisLock>, MultiplexedConnection)> {
    let url = backend_url("DISTLOCK_TEST_REDIS_URL")?;
    let lock = Arc::new(RedisLock::connect_url(&url).await.unwrap());
    Some((url.clone(), lock, admin(&url).await))
}

async fn get(admin: &mut MultiplexedConnection, key: &[u8]) -> Option<Vec<u8>> {
    redis::cmd("GET").arg(key).query_async(admin).await.unwrap()
}

async fn exists(admin: &mut MultiplexedConnection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(admin)
        .await
        .unwrap()
        == 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_lives_at_namespace_plus_name_with_a_separate_fence_counter() {
    let Some((_, lock, mut admin)) = shared().await else {
        return;
    };
    let key = fresh_key("layout {tag} a/b ünï");
    let lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    let redis_key = lock.redis_key(&key);
    assert_eq!(redis_key, format!("distlock:{key}"));
    let value = get(&mut admin, redis_key.as_bytes())
        .await
        .expect("the lock key");
    let value = String::from_utf8(value).unwrap();
    let fence = lease.fencing_token().unwrap();
    assert_eq!(value, format!("{}:{fence}", lease.token().expose_hex()));
    let mut fence_key = redis_key.clone().into_bytes();
    fence_key.extend_from_slice(b"\x1ftagged-fence");
    let counter = get(&mut admin, &fence_key)
        .await
        .expect("the fence counter");
    assert_eq!(counter, fence.get().to_string().into_bytes());
    assert!(lock.release(&lease).await.unwrap());
    assert!(!exists(&mut admin, &redis_key).await);
    assert!(
        get(&mut admin, &fence_key).await.is_some(),
        "the fence counter must survive a release"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_set_nx_client_on_the_same_key_name_excludes_us_and_we_exclude_it() {
    let Some((_, lock, mut admin)) = shared().await else {
        return;
    };
    let key = fresh_key("interop");
    let redis_key = lock.redis_key(&key);
    let set_nx = |admin: &mut MultiplexedConnection| {
        let mut admin = admin.clone();
        let redis_key = redis_key.clone();
        async move {
            redis::cmd("SET")
                .arg(&redis_key)
                .arg("other-client")
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async::<Option<String>>(&mut admin)
                .await
                .unwrap()
                .is_some()
        }
    };
    assert!(set_nx(&mut admin).await, "the foreign client takes the key");
    assert!(lock.try_acquire(&key, LONG).await.unwrap().is_none());
    let info = lock.inspect(&key).await.unwrap().expect("held");
    assert_eq!(info.fencing_token, None, "not one of our grants");
    assert!(info.ttl_remaining.is_some());
    // Its plain DEL (no publish) still lets a waiter in, through the holder-ttl/fallback poll.
    let waiter = {
        let (lock, key) = (lock.clone(), key.clone());
        tokio::spawn(async move { lock.acquire(&key, LONG, Instant::now() + LONG).await })
    };
    sleep(Duration::from_millis(200)).await;
    redis::cmd("DEL")
        .arg(&redis_key)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let lease = timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter polls")
        .unwrap()
        .unwrap();
    assert!(!set_nx(&mut admin).await, "we exclude the foreign client");
    assert!(lock.release(&lease).await.unwrap());
    assert!(set_nx(&mut admin).await);
    redis::cmd("DEL")
        .arg(&redis_key)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_client_deleting_the_key_makes_lost_fire() {
    let Some((_, lock, mut admin)) = shared().await else {
        return;
    };
    let key = fresh_key("deleted");
    let ttl = Duration::from_millis(600);
    let guard = lock
        .lock(&key)
        .ttl(ttl)
        .try_acquire()
        .await
        .unwrap()
        .unwrap();
    sleep(ttl / 2).await;
    assert!(!guard.is_lost());
    redis::cmd("DEL")
        .arg(lock.redis_key(&key))
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    timeout(ttl + Duration::from_secs(3), guard.lost())
        .await
        .expect("lost() after the key was deleted");
    assert_eq!(guard.loss_reason(), Some(LossReason::NotHeld));
    assert!(!guard.release().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_scripts_never_touch_another_holder_or_a_foreign_value() {
    let Some((_, lock, mut admin)) = shared().await else {
        return;
    };
    let key = fresh_key("compare");
    let mut lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    let redis_key = lock.redis_key(&key);
    // Somebody else's value of the same shape, and a non-string value, at our key.
    let other = format!("{}:{}", OwnershipToken::generate().expose_hex(), 1);
    for replace in ["string", "hash"] {
        redis::cmd("DEL")
            .arg(&redis_key)
            .query_async::<()>(&mut admin)
            .await
            .unwrap();
        if replace == "string" {
            redis::cmd("SET")
                .arg(&redis_key)
                .arg(&other)
                .query_async::<()>(&mut admin)
                .await
                .unwrap();
        } else {
            redis::cmd("HSET")
                .arg(&redis_key)
                .arg("f")
                .arg("v")
                .query_async::<()>(&mut admin)
                .await
                .unwrap();
        }
        assert!(matches!(
            lock.renew(&mut lease, LONG).await,
            Err(Error::NotHeld { .. })
        ));
        assert!(!lock.release(&lease).await.unwrap());
        assert!(
            exists(&mut admin, &redis_key).await,
            "{replace} was deleted"
        );
        assert!(lock.try_acquire(&key, LONG).await.unwrap().is_none());
    }
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&redis_key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(ttl, -1, "a foreign key's ttl was changed");
    redis::cmd("DEL")
        .arg(&redis_key)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_are_reloaded_after_script_flush() {
    let Some((_, lock, mut admin)) = shared().await else {
        return;
    };
    let key = fresh_key("noscript");
    let mut lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    lock.renew(&mut lease, LONG).await.unwrap();
    assert!(lock.inspect(&key).await.unwrap().is_some());
    assert!(lock.release(&lease).await.unwrap());
    let again = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(again.fencing_token() > lease.fencing_token());
    assert!(lock.release(&again).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_fence_counter_fails_the_grant_without_leaving_a_lock() {
    let Some((_, lock, mut admin)) = shared().await else {
        return;
    };
    let key = LockKey::new(format!("broken-counter-{:016x}", rand::random::<u64>())).unwrap();
    let redis_key = lock.redis_key(&key);
    let fence_key = format!("{{{redis_key}}}\x1ffence");
    redis::cmd("SET")
        .arg(&fence_key)
        .arg("not a number")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let err = lock.try_acquire(&key, LONG).await.unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err}");
    assert!(
        !exists(&mut admin, &redis_key).await,
        "a lock was left behind"
    );
    redis::cmd("DEL")
        .arg(&fence_key)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert_eq!(lease.fencing_token(), Some(FencingToken(1)));
    assert!(lock.release(&lease).await.unwrap());
    redis::cmd("DEL")
        .arg(&fence_key)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_namespace_and_odd_names_work() {
    let Some((url, _, mut admin)) = shared().await else {
        return;
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    let lock = Arc::new(
        RedisLock::connect_url(&format!("{url}{sep}namespace="))
            .await
            .unwrap(),
    );
    let base = fresh_key("ns");
    for name in ["", "}", "{", "}{x}", "x{}y}", " ", "/"] {
        let key = LockKey::new(format!("{base}{name}")).unwrap();
        let lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
        assert!(exists(&mut admin, key.as_str()).await, "{key:?}");
        assert!(lock.try_acquire(&key, LONG).await.unwrap().is_none());
        assert!(lock.release(&lease).await.unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_mid_hold_reports_the_loss_and_the_client_reconnects() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return; // same gate as the other tests: servers are expected to be installed
    }
    let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
    let lock = Arc::new(RedisLock::connect_url(&server.url()).await.unwrap());
    let key = fresh_key("restart");
    let ttl = Duration::from_millis(1500);
    let guard = lock
        .lock(&key)
        .ttl(ttl)
        .try_acquire()
        .await
        .unwrap()
        .unwrap();
    server.ctl("kill").await;
    sleep(Duration::from_millis(100)).await;
    server.ctl("start").await; // no persistence: the lock is gone
    timeout(ttl + Duration::from_secs(5), guard.lost())
        .await
        .expect("lost() after the restart");
    assert!(
        matches!(
            guard.loss_reason(),
            Some(LossReason::NotHeld | LossReason::DeadlinePassed)
        ),
        "{:?}",
        guard.loss_reason()
    );
    // The same client reconnects by itself.
    let until = Instant::now() + Duration::from_secs(10);
    let lease = loop {
        match lock.try_acquire(&key, LONG).await {
            Ok(Some(lease)) => break lease,
            Ok(None) => panic!("the restarted server has no lock"),
            Err(e) => {
                assert!(e.is_temporary(), "{e}");
                assert!(Instant::now() < until, "no reconnect: {e}");
                sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(lock.release(&lease).await.unwrap());
    drop(guard);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_is_indeterminate_and_a_late_grant_is_removed() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
    let url = format!(
        "{}?response_timeout=200ms&connect_timeout=200ms&reconnect_retries=0",
        server.url()
    );
    let lock = Arc::new(RedisLock::connect_url(&url).await.unwrap());
    let mut admin = admin(&server.url()).await;
    let key = fresh_key("unknown");
    let redis_key = lock.redis_key(&key);

    // Load the scripts first, so the requests sent while the server is stopped can apply late.
    let warm = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(lock.release(&warm).await.unwrap());
    let fence_before = warm.fencing_token().unwrap().get();

    server.ctl("pause").await; // the request is sent, but no reply comes
    let err = lock.try_acquire(&key, LONG).await.unwrap_err();
    assert!(matches!(err, Error::Indeterminate { .. }), "{err}");
    // A dropped attempt mid-request must not leave a lock either.
    let dropped = timeout(Duration::from_millis(50), lock.try_acquire(&key, LONG)).await;
    assert!(dropped.is_err());
    server.ctl("resume").await; // the queued acquires now apply: late grants

    // The cleanup removes them long before their 30 s ttl.
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if !exists(&mut admin, &redis_key).await {
            sleep(Duration::from_millis(300)).await;
            if !exists(&mut admin, &redis_key).await {
                break;
            }
        }
        assert!(Instant::now() < until, "a late grant was left behind");
        sleep(Duration::from_millis(50)).await;
    }
    let counter: Option<u64> = redis::cmd("GET")
        .arg(format!("{{{redis_key}}}\x1ffence"))
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        counter > Some(fence_before),
        "the late grant did not happen, the test proves nothing: {counter:?}"
    );
    let lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(lock.release(&lease).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_is_unavailable_and_fails_fast() {
    let config = RedisLockConfig::from_url("redis://127.0.0.1:1").unwrap();
    let lock = RedisLock::connect_lazy(config.clone()).unwrap();
    let key = fresh_key("unreachable");
    let start = Instant::now();
    let err = lock.try_acquire(&key, LONG).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(matches!(
        RedisLock::connect(config).await,
        Err(Error::Unavailable { .. })
    ));
}

/// Checks `condition` every `every` until it holds; fails the test with `what` once `within` has
/// passed (bounded, generous: the machine may be loaded).
async fn wait_until(
    within: Duration,
    every: Duration,
    what: &str,
    mut condition: impl AsyncFnMut() -> bool,
) {
    let until = Instant::now() + within;
    while !condition().await {
        assert!(Instant::now() < until, "{what}");
        sleep(every).await;
    }
}

/// `calls` of `cmdstat_<command>` in `INFO commandstats` (0 when the command never ran).
async fn command_calls(admin: &mut MultiplexedConnection, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_guarded_locks_renew_with_a_few_script_calls_per_tick() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    // A private server, so the command counters are ours alone.
    let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
    let lock = Arc::new(RedisLock::connect_url(&server.url()).await.unwrap());
    let mut admin = admin(&server.url()).await;
    // More locks than one script call takes (500), so a batch is sent in several chunks.
    const N: usize = 1200;
    let ttl = Duration::from_secs(3);
    let mut guards = Vec::with_capacity(N);
    for i in 0..N {
        let key = fresh_key(&format!("batch-{i}"));
        let guard = lock.lock(&key).ttl(ttl).try_acquire().await.unwrap();
        guards.push(guard.expect("a fresh key is free"));
    }
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    // Every successful renewal runs one PEXPIRE inside the script; wait for three ticks' worth.
    wait_until(
        Duration::from_secs(30),
        Duration::from_millis(100),
        "the watchdogs do not renew",
        async || command_calls(&mut admin, "pexpire").await >= 3 * N as u64,
    )
    .await;
    let scripts = command_calls(&mut admin, "evalsha").await;
    let renewed = command_calls(&mut admin, "pexpire").await;
    // Unbatched this is one call per renewal; batched, a few per grid instant (the guards'
    // acquisition spreads them over several instants, and a loaded machine over more). A
    // tenfold margin separates the two without depending on the machine's load.
    assert!(
        scripts * 10 <= renewed,
        "{scripts} script calls for {renewed} renewals: not batched"
    );
    assert!(guards.iter().all(|g| !g.is_lost()));
    assert!(guards.iter().all(|g| g.renewals() >= 1));
    for guard in guards {
        assert!(guard.release().await.unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_deleted_from_outside_is_not_held_while_the_rest_of_its_batch_renews() {
    let Some((_, lock, mut admin)) = shared().await else {
        return;
    };
    let ttl = Duration::from_secs(10);
    let mut leases = Vec::new();
    for i in 0..20 {
        let key = fresh_key(&format!("batch-deleted-{i}"));
        leases.push(lock.try_acquire(&key, ttl).await.unwrap().unwrap());
    }
    let deleted = 10;
    redis::cmd("DEL")
        .arg(lock.redis_key(leases[deleted].key()))
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let longer = Duration::from_secs(60);
    // Submitted together (`join_all` polls each once before any can complete): the first goes
    // alone, the 19 others (the deleted one among them) share the next batch.
    let results = futures::future::join_all(
        leases
            .iter_mut()
            .map(|lease| lock.renew(lease, longer))
            .collect::<Vec<_>>(),
    )
    .await;
    for (i, result) in results.into_iter().enumerate() {
        if i == deleted {
            assert!(matches!(result, Err(Error::NotHeld { .. })), "{result:?}");
        } else {
            result.unwrap();
        }
    }
    for (i, lease) in leases.iter().enumerate() {
        let pttl: i64 = redis::cmd("PTTL")
            .arg(lock.redis_key(lease.key()))
            .query_async(&mut admin)
            .await
            .unwrap();
        if i == deleted {
            assert_eq!(pttl, -2, "the deleted lock must stay deleted");
        } else {
            assert!(
                pttl > ttl.as_millis() as i64,
                "lock {i} not renewed: {pttl}"
            );
            assert_eq!(lease.ttl(), longer);
            assert!(lock.release(lease).await.unwrap());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_renewal_of_a_batch_without_reply_is_indeterminate() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
    let url = format!(
        "{}?response_timeout=200ms&reconnect_retries=0",
        server.url()
    );
    let lock = Arc::new(RedisLock::connect_url(&url).await.unwrap());
    let mut leases = Vec::new();
    for i in 0..5 {
        let key = fresh_key(&format!("batch-unknown-{i}"));
        leases.push(lock.try_acquire(&key, LONG).await.unwrap().unwrap());
    }
    let deadlines: Vec<_> = leases.iter().map(|l| l.local_deadline()).collect();
    server.ctl("pause").await;
    let results = futures::future::join_all(
        leases
            .iter_mut()
            .map(|lease| lock.renew(lease, LONG))
            .collect::<Vec<_>>(),
    )
    .await;
    server.ctl("resume").await;
    for result in results {
        assert!(
            matches!(result, Err(Error::Indeterminate { .. })),
            "{result:?}"
        );
    }
    // An unconfirmed renewal never moves the local deadline.
    for (lease, before) in leases.iter().zip(deadlines) {
        assert_eq!(lease.local_deadline(), before);
    }
}

/// A RESP3 connection that receives every wake-up published on `url`'s server.
async fn wake_listener(
    url: &str,
) -> (
    MultiplexedConnection,
    tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let config = redis::AsyncConnectionConfig::new().set_push_sender(tx);
    let mut conn = redis::Client::open(format!("{url}?protocol=resp3").as_str())
        .unwrap()
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap();
    conn.psubscribe("distlock\x1fwake:*").await.unwrap();
    (conn, rx)
}

/// The next wake-up message (channel, payload), skipping subscription confirmations.
async fn next_wake(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>,
) -> (Vec<u8>, Vec<u8>) {
    loop {
        let info = timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("no wake-up was published")
            .unwrap();
        if info.kind == redis::PushKind::PMessage
            && let [
                _,
                redis::Value::BulkString(channel),
                redis::Value::BulkString(payload),
            ] = &info.data[..]
        {
            return (channel.clone(), payload.clone());
        }
    }
}

async fn wait_for_mark(admin: &mut MultiplexedConnection, redis_key: &str) {
    wait_until(
        Duration::from_secs(10),
        Duration::from_millis(10),
        "no waiter marked the lock",
        async || {
            let value = get(admin, redis_key.as_bytes()).await.unwrap();
            value.ends_with(b":w")
        },
    )
    .await;
}

async fn queued(admin: &mut MultiplexedConnection, redis_key: &str) -> i64 {
    redis::cmd("ZCARD")
        .arg(format!("{{{redis_key}}}\x1fwaiters"))
        .query_async(admin)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_only_when_a_waiter_marked_the_lock() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
    // No fallback poll within the test: only the published wake-up can wake the waiter.
    let url = format!("{}?max_poll_interval=60s", server.url());
    let lock = Arc::new(RedisLock::connect_url(&url).await.unwrap());
    let mut admin = admin(&server.url()).await;
    let (_listener, mut wakes) = wake_listener(&server.url()).await;
    let key = fresh_key("publish");
    let redis_key = lock.redis_key(&key);

    let lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(lock.release(&lease).await.unwrap());
    assert_eq!(
        command_calls(&mut admin, "publish").await,
        0,
        "nobody waits"
    );

    let holder = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waiter = {
        let (lock, key) = (lock.clone(), key.clone());
        tokio::spawn(async move { lock.acquire(&key, LONG, Instant::now() + LONG).await })
    };
    // The waiter marks the holder's value (keeping its format for inspect and its ttl).
    wait_for_mark(&mut admin, &redis_key).await;
    assert_eq!(queued(&mut admin, &redis_key).await, 1);
    let info = lock.inspect(&key).await.unwrap().unwrap();
    assert_eq!(info.fencing_token, holder.fencing_token());
    assert_eq!(info.token_digest, Some(holder.token().digest()));
    assert!(info.ttl_remaining.unwrap() > Duration::from_secs(20));
    assert_eq!(
        info.waiters,
        Some(1),
        "inspect counts the live registration"
    );
    assert!(lock.release(&holder).await.unwrap());
    let (channel, _waiter_id) = next_wake(&mut wakes).await;
    assert!(channel.starts_with(b"distlock\x1fwake:"), "{channel:?}");
    let lease = timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter was not woken by the release")
        .unwrap()
        .unwrap();
    assert_eq!(command_calls(&mut admin, "publish").await, 1);
    assert_eq!(queued(&mut admin, &redis_key).await, 0);
    assert_eq!(lock.inspect(&key).await.unwrap().unwrap().waiters, Some(0));
    assert!(lease.fencing_token() > holder.fencing_token());
    assert!(lock.release(&lease).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_release_wakes_one_waiter_and_skips_dead_registrations() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
    let url = format!("{}?max_poll_interval=60s", server.url());
    let holder_client = RedisLock::connect_url(&url).await.unwrap();
    let mut admin = admin(&server.url()).await;
    let (_listener, mut wakes) = wake_listener(&server.url()).await;
    let key = fresh_key("wake-one");
    let redis_key = holder_client.redis_key(&key);
    let holder = holder_client
        .try_acquire(&key, LONG)
        .await
        .unwrap()
        .unwrap();

    // Two waiters, each on a client of its own.
    let mut waiters = Vec::new();
    for expected in 1..=2 {
        let client = Arc::new(RedisLock::connect_url(&url).await.unwrap());
        let key = key.clone();
        let task = tokio::spawn(async move {
            let lease = client
                .acquire(&key, LONG, Instant::now() + LONG)
                .await
                .unwrap();
            (client, lease)
        });
        wait_until(
            Duration::from_secs(10),
            Duration::from_millis(10),
            &format!("waiter {expected} never queued"),
            async || queued(&mut admin, &redis_key).await >= expected,
        )
        .await;
        waiters.push(task);
    }
    // A registration whose waiter died long ago (expired score) is skipped.
    redis::cmd("ZADD")
        .arg(format!("{{{redis_key}}}\x1fwaiters"))
        .arg(1)
        .arg("00000000000000aa:1")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    assert!(holder_client.release(&holder).await.unwrap());
    let (first_channel, _) = next_wake(&mut wakes).await;
    assert!(!first_channel.ends_with(b"00000000000000aa"));
    // Exactly one waiter gets the lock; the other stays queued, not woken.
    wait_until(
        Duration::from_secs(10),
        Duration::from_millis(5),
        "no waiter was woken by the release",
        async || waiters.iter().any(tokio::task::JoinHandle::is_finished),
    )
    .await;
    let winner = waiters
        .iter()
        .position(tokio::task::JoinHandle::is_finished);
    let winner = waiters.remove(winner.unwrap());
    let rest = waiters.remove(0);
    let (winner_client, lease) = winner.await.unwrap();
    assert_eq!(
        queued(&mut admin, &redis_key).await,
        1,
        "the other waiter stays queued"
    );
    assert_eq!(
        command_calls(&mut admin, "publish").await,
        1,
        "one wake-up per release"
    );
    assert!(!rest.is_finished());
    // Its release wakes the other one.
    assert!(winner_client.release(&lease).await.unwrap());
    let (second_channel, _) = next_wake(&mut wakes).await;
    assert_ne!(first_channel, second_channel);
    let (other_client, lease) = timeout(Duration::from_secs(10), rest)
        .await
        .expect("the second waiter was not woken")
        .unwrap();
    assert!(other_client.release(&lease).await.unwrap());
    assert_eq!(queued(&mut admin, &redis_key).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_or_timed_out_waiter_leaves_the_queue() {
    let Some((url, _, mut admin)) = shared().await else {
        return;
    };
    // Registrations then live 11 s: only an explicit removal empties the queue in time.
    let separator = if url.contains('?') { '&' } else { '?' };
    let lock = RedisLock::connect_url(&format!("{url}{separator}max_poll_interval=5s"))
        .await
        .unwrap();
    let key = fresh_key("queue-cleanup");
    let redis_key = lock.redis_key(&key);
    let holder = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    // Each waiter is seen registered before it goes, so that an empty queue afterwards proves
    // the removal (a waiter that never registered would leave it empty as well).
    // Timed out.
    let (result, ()) = tokio::join!(
        lock.acquire(&key, LONG, Instant::now() + Duration::from_secs(3)),
        wait_until(
            Duration::from_secs(10),
            Duration::from_millis(10),
            "the waiter that times out never queued",
            async || queued(&mut admin, &redis_key).await == 1,
        ),
    );
    let err = result.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    wait_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        "a timed-out waiter stays registered",
        async || queued(&mut admin, &redis_key).await == 0,
    )
    .await;
    // Dropped.
    tokio::select! {
        result = lock.acquire(&key, LONG, Instant::now() + LONG) => {
            panic!("the lock is held, yet: {result:?}");
        }
        () = wait_until(
            Duration::from_secs(10),
            Duration::from_millis(10),
            "the waiter to drop never queued",
            async || queued(&mut admin, &redis_key).await == 1,
        ) => {}
    }
    wait_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        "a dropped waiter stays registered",
        async || queued(&mut admin, &redis_key).await == 0,
    )
    .await;
    assert!(lock.release(&holder).await.unwrap());
}

/// Starts `acquire` on `lock` and polls it until the waiter is registered in the queue,
/// returning the still pending future.
/// Loads the release and inspect scripts into a fresh server (an `EVALSHA` answered
/// `NOSCRIPT` counts as a call too), so that the script calls counted afterwards are requests.
async fn load_scripts(lock: &RedisLock) {
    let key = fresh_key("load-scripts");
    let mut lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    // The renew script too: a waiter confirms a hand-off with it.
    lock.renew(&mut lease, LONG).await.unwrap();
    lock.inspect(&key).await.unwrap().unwrap();
    assert!(lock.release(&lease).await.unwrap());
}

async fn queued_waiter<'a>(
    lock: &'a RedisLock,
    key: &'a LockKey,
    ttl: Duration,
    admin: &mut MultiplexedConnection,
) -> std::pin::Pin<Box<dyn Future<Output = lock_core::Result<lock_core::Lease>> + Send + 'a>> {
    queued_waiter_until(lock, key, ttl, Instant::now() + LONG, admin).await
}

/// [`queued_waiter`] with a deadline.
async fn queued_waiter_until<'a>(
    lock: &'a RedisLock,
    key: &'a LockKey,
    ttl: Duration,
    deadline: Instant,
    admin: &mut MultiplexedConnection,
) -> std::pin::Pin<Box<dyn Future<Output = lock_core::Result<lock_core::Lease>> + Send + 'a>> {
    let redis_key = lock.redis_key(key);
    let before = queued(admin, &redis_key).await;
    let mut waiter = Box::pin(lock.acquire(key, ttl, deadline));
    tokio::select! {
        result = &mut waiter => panic!("the lock is held, yet: {result:?}"),
        () = wait_until(
            Duration::from_secs(10),
            Duration::from_millis(5),
            "the waiter never queued",
            async || queued(admin, &redis_key).await > before,
        ) => {}
    }
    waiter
}

/// A hand-off on a private server (so that the script calls counted are these clients' alone,
/// and no fallback poll fires within a test): a holder on one client, the waiter on another.
struct Handoff {
    server: PrivateServer,
    admin: MultiplexedConnection,
    holder_client: RedisLock,
    waiter_client: RedisLock,
    key: LockKey,
    holder: lock_core::Lease,
}

impl Handoff {
    async fn start(name: &str) -> Option<Self> {
        backend_url("DISTLOCK_TEST_REDIS_URL")?;
        let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
        let url = format!("{}?max_poll_interval=60s", server.url());
        let holder_client = RedisLock::connect_url(&url).await.unwrap();
        let waiter_client = RedisLock::connect_url(&url).await.unwrap();
        let admin = admin(&server.url()).await;
        let key = fresh_key(name);
        let holder = holder_client
            .try_acquire(&key, LONG)
            .await
            .unwrap()
            .unwrap();
        Some(Self {
            server,
            admin,
            holder_client,
            waiter_client,
            key,
            holder,
        })
    }

    /// Releases the holder and inspects the lock at once; returns the `EVALSHA` count from
    /// before the release (the scripts loaded first) and what `inspect` saw: the waiter's grant.
    async fn release_holder(&self) -> (u64, lock_core::HolderInfo) {
        load_scripts(&self.holder_client).await;
        let calls = command_calls(&mut admin(&self.server.url()).await, "evalsha").await;
        assert!(self.holder_client.release(&self.holder).await.unwrap());
        let info = self.holder_client.inspect(&self.key).await.unwrap();
        (
            calls,
            info.expect("the release granted the lock to the waiter"),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_hands_the_lock_to_the_first_waiter_which_confirms_it_with_one_renewal() {
    let Some(mut h) = Handoff::start("grant").await else {
        return;
    };
    let waiter = queued_waiter(&h.waiter_client, &h.key, LONG, &mut h.admin).await;

    // The release itself made the waiter the holder: a new grant, not a free lock.
    let (calls, info) = h.release_holder().await;
    assert!(info.fencing_token > h.holder.fencing_token());
    assert_ne!(info.token_digest, Some(h.holder.token().digest()));
    assert_eq!(info.waiters, Some(0));
    let lease = timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the grant never reached the waiter")
        .unwrap();
    assert_eq!(lease.fencing_token(), info.fencing_token);
    assert_eq!(Some(lease.token().digest()), info.token_digest);
    // The release gave the waiter only a short first lease (a dead waiter would hold the lock
    // that long at most); the waiter extended it to its TTL before `acquire` returned.
    assert!(info.ttl_remaining.unwrap() <= Duration::from_millis(1500));
    assert!(lease.remaining() > LONG / 2, "{:?}", lease.remaining());
    assert_eq!(lease.ttl(), LONG);
    assert_eq!(
        command_calls(&mut h.admin, "evalsha").await - calls,
        3,
        "the release, the inspect and the waiter's confirming renewal; the waiter learnt of its \
         grant from the message alone (no attempt)"
    );
    assert!(h.waiter_client.release(&lease).await.unwrap());
    assert!(h.holder_client.inspect(&h.key).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_seen_late_is_confirmed_by_an_attempt_that_restarts_its_ttl() {
    let Some(mut h) = Handoff::start("late-grant").await else {
        return;
    };
    // The waiter's registration is older than a quarter of its TTL when the grant comes, so
    // the message alone is not trusted: the next attempt finds the grant (as it would after a
    // lost message) and restarts its TTL. (The wait lets the registration age; the TTL leaves
    // the waiter seconds to release its lease afterwards.)
    let ttl = Duration::from_secs(2);
    let waiter = queued_waiter(&h.waiter_client, &h.key, ttl, &mut h.admin).await;
    let queued_at = Instant::now();
    sleep(ttl / 4 + Duration::from_millis(100)).await;
    let (calls, info) = h.release_holder().await;
    let lease = timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter never took its grant")
        .unwrap();
    assert_eq!(lease.fencing_token(), info.fencing_token);
    assert_eq!(Some(lease.token().digest()), info.token_digest);
    assert!(lease.acquired_at() > queued_at);
    assert_eq!(
        command_calls(&mut h.admin, "evalsha").await - calls,
        3,
        "the release, the inspect and the waiter's confirming attempt"
    );
    assert!(h.waiter_client.release(&lease).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_granted_as_it_gives_up_passes_the_lock_on() {
    let Some((url, lock, mut admin)) = shared().await else {
        return;
    };
    let waiter_client = RedisLock::connect_url(&url).await.unwrap();
    let key = fresh_key("grant-give-up");
    let holder = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    let first = queued_waiter(&waiter_client, &key, LONG, &mut admin).await;
    let second = queued_waiter(&waiter_client, &key, LONG, &mut admin).await;
    // The release grants the lock to the first waiter, which is not polled any more (no
    // waiter is polled until awaited below; a grant is made by the release alone): it
    // gives up (its future is dropped) without having taken the grant.
    assert!(lock.release(&holder).await.unwrap());
    let granted = lock.inspect(&key).await.unwrap().expect("granted");
    assert!(granted.fencing_token > holder.fencing_token());
    drop(first);
    // Leaving, it passes the grant on to the second waiter at once, long before its TTL.
    let lease = timeout(Duration::from_secs(10), second)
        .await
        .expect("the grant of a waiter that gave up was not passed on")
        .unwrap();
    assert!(lease.fencing_token() > granted.fencing_token);
    assert!(waiter_client.release(&lease).await.unwrap());
    assert!(lock.inspect(&key).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_came_by_the_deadline_is_taken_not_timed_out() {
    let Some(mut h) = Handoff::start("deadline-grant").await else {
        return;
    };
    // Room for queueing on a loaded machine: the waiter must be queued before its deadline.
    // The release grants only a first lease of 1.5 s (counted by the waiter from its
    // registration), so the deadline comes well within it.
    let deadline = Instant::now() + Duration::from_millis(1200);
    let waiter = queued_waiter_until(&h.waiter_client, &h.key, LONG, deadline, &mut h.admin).await;
    let (_, info) = h.release_holder().await;
    // The waiter is next polled after its deadline, with the grant message already there.
    tokio::time::sleep_until(deadline + Duration::from_millis(50)).await;
    let lease = waiter
        .await
        .expect("the grant was dropped for the deadline");
    assert_eq!(lease.fencing_token(), info.fencing_token);
    assert!(h.waiter_client.release(&lease).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_times_out_has_left_the_queue_when_acquire_returns() {
    let Some((url, lock, mut admin)) = shared().await else {
        return;
    };
    let key = fresh_key("timeout-leaves");
    let redis_key = lock.redis_key(&key);
    let holder = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    // The waiter's process exits as soon as `acquire` returns (`distlock run --wait`):
    // nothing it left to the background runs.
    let waiter_key = key.clone();
    let err = conformance::run_then_exit(move || async move {
        let waiter = RedisLock::connect_url(&url).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(1);
        waiter
            .acquire(&waiter_key, LONG, deadline)
            .await
            .unwrap_err()
    })
    .await;
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert_eq!(
        queued(&mut admin, &redis_key).await,
        0,
        "the waiter is still queued"
    );
    // Every attempt of it was answered: nothing can arrive late, so no undo marker is left.
    let markers: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{{{redis_key}}}\x1fundone:*"))
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(markers.is_empty(), "{markers:?}");
    // So the release does not hand the lock to the gone waiter.
    assert!(lock.release(&holder).await.unwrap());
    assert!(lock.inspect(&key).await.unwrap().is_none());
}

/// `{<lock key>}\x1ffence`: the fence counter of a key without a hash tag.
fn fence_key(lock: &RedisLock, key: &LockKey) -> String {
    format!("{{{}}}\x1ffence", lock.redis_key(key))
}

/// Checks one grant of `key` to `lease` against what Redis stored: the counter and the lock's
/// value carry exactly the lease's fence.
async fn assert_stored_fence(
    admin: &mut MultiplexedConnection,
    lock: &RedisLock,
    lease: &lock_core::Lease,
) {
    let fence = lease.fencing_token().unwrap().get();
    let counter = get(admin, fence_key(lock, lease.key()).as_bytes()).await;
    assert_eq!(counter, Some(fence.to_string().into_bytes()), "the counter");
    let value = get(admin, lock.redis_key(lease.key()).as_bytes())
        .await
        .expect("the lock key");
    let value = String::from_utf8(value).unwrap();
    let value = value.strip_suffix(":w").unwrap_or(&value);
    assert_eq!(
        value,
        format!("{}:{fence}", lease.token().expose_hex()),
        "the stored value"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_above_2_pow_53_are_exact_and_strictly_increase() {
    let Some((url, lock, mut admin)) = shared().await else {
        return;
    };
    let key = fresh_key("fence-precision");
    // 2^53 (an operator bumping the counter, or a very long-lived lock): from here on, a double
    // holds only every other integer, so grants through one would repeat fences.
    let start: u64 = 1 << 53;
    redis::cmd("SET")
        .arg(fence_key(&lock, &key))
        .arg(start)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let mut previous = start;
    for _ in 0..4 {
        let lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
        let fence = lease.fencing_token().unwrap().get();
        assert!(fence > previous, "fence {fence} after {previous}");
        assert_stored_fence(&mut admin, &lock, &lease).await;
        previous = fence;
        assert!(lock.release(&lease).await.unwrap());
    }
    // The direct hand-off mints its fence in the release script and publishes it.
    let holder = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(holder.fencing_token().unwrap().get() > previous);
    // No fallback poll: nothing but the release touches the counter from here on.
    let separator = if url.contains('?') { '&' } else { '?' };
    let waiter_client = RedisLock::connect_url(&format!("{url}{separator}max_poll_interval=60s"))
        .await
        .unwrap();
    let waiter = queued_waiter(&waiter_client, &key, LONG, &mut admin).await;
    // 2^54: the release's INCR makes it 2^54 + 1, which a double rounds back to 2^54.
    let bumped: u64 = 1 << 54;
    redis::cmd("SET")
        .arg(fence_key(&lock, &key))
        .arg(bumped)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    assert!(lock.release(&holder).await.unwrap());
    let granted = timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter was not granted the lock")
        .unwrap();
    assert_eq!(granted.fencing_token(), Some(FencingToken(bumped + 1)));
    assert_stored_fence(&mut admin, &lock, &granted).await;
    assert_eq!(
        lock.inspect(&key).await.unwrap().unwrap().fencing_token,
        granted.fencing_token()
    );
    assert!(waiter_client.release(&granted).await.unwrap());
    // The counter's whole range is exact, up to i64::MAX; past it a grant fails, typed, and
    // leaves no lock.
    let max = i64::MAX as u64;
    redis::cmd("SET")
        .arg(fence_key(&lock, &key))
        .arg(max - 1)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let last = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert_eq!(last.fencing_token(), Some(FencingToken(max)));
    assert_stored_fence(&mut admin, &lock, &last).await;
    assert!(lock.release(&last).await.unwrap());
    let err = lock.try_acquire(&key, LONG).await.unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err}");
    assert!(!exists(&mut admin, &lock.redis_key(&key)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_reply_comes_after_its_local_deadline_is_undone_never_returned() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
    // Replies may take long, so that a late one is still read (and must be refused).
    let url = format!("{}?response_timeout=10s", server.url());
    let lock = RedisLock::connect_url(&url).await.unwrap();
    let mut admin = admin(&server.url()).await;
    let key = fresh_key("late-reply");
    let redis_key = lock.redis_key(&key);
    load_scripts(&lock).await;
    let ttl = Duration::from_secs(1);
    let stall = Duration::from_millis(1500);

    // try_acquire: the server stalls longer than the TTL, then grants (its own TTL starts
    // only then): the reply comes past the lease's local deadline.
    server.ctl("pause").await;
    let (result, ()) = tokio::join!(lock.try_acquire(&key, ttl), async {
        sleep(stall).await;
        server.ctl("resume").await;
    });
    let err = result.expect_err("a lease past its local deadline was returned");
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
    assert!(err.is_temporary());
    // Undone before returning, long before the server's TTL would have freed it.
    assert!(
        !exists(&mut admin, &redis_key).await,
        "the late grant was left behind: {err}"
    );

    // acquire: the late grant is undone and the wait goes on to a valid lease.
    server.ctl("pause").await;
    let (result, ()) = tokio::join!(
        lock.acquire(&key, ttl, Instant::now() + Duration::from_secs(20)),
        async {
            sleep(stall).await;
            server.ctl("resume").await;
        }
    );
    let lease = result.unwrap();
    assert!(lease.is_locally_valid());
    assert_stored_fence(&mut admin, &lock, &lease).await;
    assert!(lock.release(&lease).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_error_after_the_grant_leaves_no_lock() {
    let Some((url, lock, mut admin)) = shared().await else {
        return;
    };
    let separator = if url.contains('?') { '&' } else { '?' };
    let waiter = RedisLock::connect_url(&format!("{url}{separator}max_poll_interval=60s"))
        .await
        .unwrap();
    let key = fresh_key("script-error");
    let redis_key = lock.redis_key(&key);
    let queue = format!("{{{redis_key}}}\x1fwaiters");
    // A foreign holder whose TTL wakes the waiter (no release, no fallback poll meanwhile).
    redis::cmd("SET")
        .arg(&redis_key)
        .arg("foreign")
        .arg("PX")
        .arg(2000)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let mut waiting = Box::pin(waiter.acquire(&key, LONG, Instant::now() + LONG));
    tokio::select! {
        result = &mut waiting => panic!("the lock is held, yet: {result:?}"),
        () = wait_until(
            Duration::from_secs(10),
            Duration::from_millis(5),
            "the waiter never queued",
            async || queued(&mut admin, &redis_key).await == 1,
        ) => {}
    }
    // The queue key becomes a string: the waiter's next attempt is granted (`SET NX`), then
    // its script fails on the queue; Lua does not roll the grant back.
    redis::cmd("SET")
        .arg(&queue)
        .arg("not a queue")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let err = timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter never tried again")
        .unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err}");
    let counter = get(&mut admin, fence_key(&lock, &key).as_bytes()).await;
    assert!(counter.is_some(), "no grant was attempted");
    assert!(
        !exists(&mut admin, &redis_key).await,
        "a grant nobody holds was left behind"
    );
    redis::cmd("DEL")
        .arg(&queue)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
}

/// A proxy in front of a private server that can reorder one request behind a reconnect: the
/// next request after [`ReorderProxy::hold_next`] reaches the server `delay` late, and its
/// connection is cut on the client's side at once (the client sees it dropped, reconnects and
/// sends its clean-up on a new connection, which passes straight through).
struct ReorderProxy {
    port: u16,
    hold: Arc<std::sync::atomic::AtomicBool>,
    delivered: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl ReorderProxy {
    async fn start(upstream: u16, delay: Duration) -> Self {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let hold = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let delivered = Arc::new(tokio::sync::Notify::new());
        let (hold2, delivered2) = (hold.clone(), delivered.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let server = tokio::net::TcpStream::connect(("127.0.0.1", upstream))
                    .await
                    .unwrap();
                let (mut client_r, mut client_w) = client.into_split();
                let (mut server_r, mut server_w) = server.into_split();
                let cut = Arc::new(tokio::sync::Notify::new());
                let (hold, delivered, cut2) = (hold2.clone(), delivered2.clone(), cut.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match client_r.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if hold.swap(false, Ordering::AcqRel) {
                            cut2.notify_one();
                            sleep(delay).await;
                            let _ = server_w.write_all(&buf[..n]).await;
                            delivered.notify_one();
                            // Keep the server's side open while it runs the request.
                            sleep(Duration::from_secs(2)).await;
                            return;
                        }
                        if server_w.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        tokio::select! {
                            () = cut.notified() => {
                                let _ = client_w.shutdown().await;
                                return;
                            }
                            read = server_r.read(&mut buf) => match read {
                                Ok(0) | Err(_) => return,
                                Ok(n) => {
                                    if client_w.write_all(&buf[..n]).await.is_err() {
                                        return;
                                    }
                                }
                            },
                        }
                    }
                });
            }
        });
        Self {
            port,
            hold,
            delivered,
            task,
        }
    }

    fn hold_next(&self) {
        self.hold.store(true, std::sync::atomic::Ordering::Release);
    }
}

impl Drop for ReorderProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_arrives_after_its_clean_up_on_a_new_connection_does_nothing() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
    // Long enough for the reconnect and the clean-up's answer on a loaded machine.
    let proxy = ReorderProxy::start(server.port, Duration::from_secs(2)).await;
    let lock = RedisLock::connect_url(&format!(
        "redis://127.0.0.1:{}?response_timeout=5s",
        proxy.port
    ))
    .await
    .unwrap();
    let mut admin = admin(&server.url()).await;
    let key = fresh_key("reordered");
    let redis_key = lock.redis_key(&key);
    load_scripts(&lock).await;
    let warm = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(lock.release(&warm).await.unwrap());
    let counter = get(&mut admin, fence_key(&lock, &key).as_bytes()).await;
    let scripts = command_calls(&mut admin, "evalsha").await;

    // The attempt's connection drops while the attempt is still on its way; the clean-up is
    // answered on a new connection, and only then does the attempt reach the server.
    let delivered = proxy.delivered.notified();
    proxy.hold_next();
    let err = lock.try_acquire(&key, LONG).await.unwrap_err();
    assert!(matches!(err, Error::Indeterminate { .. }), "{err}");
    timeout(Duration::from_secs(10), delivered)
        .await
        .expect("the held attempt was never delivered");
    wait_until(
        Duration::from_secs(10),
        Duration::from_millis(10),
        "the server never ran the late attempt",
        async || command_calls(&mut admin, "evalsha").await >= scripts + 2,
    )
    .await;
    assert!(
        !exists(&mut admin, &redis_key).await,
        "the late attempt granted a lock nobody holds"
    );
    assert_eq!(
        get(&mut admin, fence_key(&lock, &key).as_bytes()).await,
        counter,
        "the late attempt ran"
    );
    let lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(lock.release(&lease).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_registration_never_shortens_the_queue_of_the_others() {
    let Some((url, lock, mut admin)) = shared().await else {
        return;
    };
    let separator = if url.contains('?') { '&' } else { '?' };
    // A polls rarely: its registration lives 21 s. B polls at the default: 2 s.
    let a = RedisLock::connect_url(&format!("{url}{separator}max_poll_interval=10s"))
        .await
        .unwrap();
    let b = RedisLock::connect_url(&url).await.unwrap();
    let key = fresh_key("queue-ttl");
    let redis_key = lock.redis_key(&key);
    let queue = format!("{{{redis_key}}}\x1fwaiters");
    let holder = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waiter_a = queued_waiter(&a, &key, LONG, &mut admin).await;
    // B registers (every attempt of it used to set the queue's TTL to its own 2 s) and gives up
    // (room to queue before its deadline on a loaded machine).
    let deadline = Instant::now() + Duration::from_secs(3);
    let err = queued_waiter_until(&b, &key, LONG, deadline, &mut admin)
        .await
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert_eq!(queued(&mut admin, &redis_key).await, 1, "A is still queued");
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&queue)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        pttl > 10_000,
        "the queue expires in {pttl} ms, long before A's registration (21 s)"
    );
    // So the release still hands the lock to A, without waiting for A's 10 s poll.
    assert!(lock.release(&holder).await.unwrap());
    let lease = timeout(Duration::from_secs(5), waiter_a)
        .await
        .expect("A was not granted the lock")
        .unwrap();
    assert!(a.release(&lease).await.unwrap());
}

/// The argument counts of the `EVALSHA`s in the server's slow log whose first key is
/// `redis_key` and that pass `numkeys` keys (the slow log keeps at most 32 arguments of a
/// command and ends the list with `... (N more arguments)`).
async fn logged_script_args(
    admin: &mut MultiplexedConnection,
    redis_key: &str,
    numkeys: &str,
) -> Vec<usize> {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query_async(admin)
        .await
        .unwrap();
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        _ => String::new(),
    };
    let mut counts = Vec::new();
    for entry in entries {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let Some(redis::Value::Array(args)) = fields.get(3) else {
            continue;
        };
        let args: Vec<String> = args.iter().map(text).collect();
        if args.len() < 4
            || !args[0].eq_ignore_ascii_case("evalsha")
            || args[2] != numkeys
            || args[3] != redis_key
        {
            continue;
        }
        let more = args
            .last()
            .and_then(|a| a.strip_prefix("... ("))
            .and_then(|a| a.strip_suffix(" more arguments)"))
            .and_then(|n| n.parse::<usize>().ok());
        counts.push(match more {
            Some(n) => args.len() - 1 + n,
            None => args.len(),
        });
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_attempts_keep_failing_sends_a_bounded_request() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
    let mut admin = admin(&server.url()).await;
    for (name, value) in [
        ("slowlog-log-slower-than", "0"),
        ("slowlog-max-len", "100000"),
    ] {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async::<()>(&mut admin)
            .await
            .unwrap();
    }
    let holder_client = RedisLock::connect_url(&server.url()).await.unwrap();
    let (proxy, proxied) = conformance::drill::Proxy::start_for_url(&server.url())
        .await
        .unwrap();
    // Quick polls and quick response timeouts: many failed attempts in little time.
    let waiter_client = RedisLock::connect_url(&format!(
        "{proxied}?response_timeout=20ms&connect_timeout=200ms&reconnect_retries=0&max_poll_interval=20ms"
    ))
    .await
    .unwrap();
    let key = fresh_key("failing-waiter");
    let redis_key = holder_client.redis_key(&key);
    let holder = holder_client
        .try_acquire(&key, LONG)
        .await
        .unwrap()
        .unwrap();
    let mut waiter = queued_waiter(&waiter_client, &key, LONG, &mut admin).await;
    // Every attempt now applies (it registers the waiter) but its reply is lost.
    proxy.drop_replies();
    let failing = 60;
    tokio::select! {
        result = &mut waiter => panic!("the lock is held, yet: {result:?}"),
        () = wait_until(
            Duration::from_secs(30),
            Duration::from_millis(20),
            "the waiter's attempts stopped",
            async || logged_script_args(&mut admin, &redis_key, "6").await.len() >= failing,
        ) => {}
    }
    proxy.pass();
    // Each attempt carried its own member and at most 16 earlier ones: 2 + 1 + 6 keys + 6
    // arguments + 16. Unbounded, the n-th failed attempt carried n (and Lua's `unpack` fails
    // past about 8,000).
    let counts = logged_script_args(&mut admin, &redis_key, "6").await;
    let most = counts.iter().copied().max().unwrap();
    assert!(
        most <= 2 + 1 + 6 + 6 + 16,
        "an attempt carried {most} arguments after {} attempts",
        counts.len()
    );
    // The waiter recovers, and is handed the lock; nothing of its failed attempts stays queued.
    assert!(holder_client.release(&holder).await.unwrap());
    let lease = timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter never got the lock")
        .unwrap();
    wait_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        "members of failed attempts stay queued",
        async || queued(&mut admin, &redis_key).await == 0,
    )
    .await;
    assert!(waiter_client.release(&lease).await.unwrap());
}

/// How late past its deadline an `acquire` against a frozen server may return: the leaving's
/// grace (200 ms) plus scheduling on a loaded 2-core machine.
const DEADLINE_SLACK: Duration = Duration::from_millis(800);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_against_a_frozen_server_returns_by_its_deadline() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let server = PrivateServer::start(ServerKind::Redis, free_port()).await;
    let mut admin = admin(&server.url()).await;
    let holder_client = RedisLock::connect_url(&server.url()).await.unwrap();
    let key = fresh_key("frozen");
    let redis_key = holder_client.redis_key(&key);
    let ttl = Duration::from_secs(2);
    let holder = holder_client.try_acquire(&key, ttl).await.unwrap().unwrap();
    // Queued waiters (default settings: a request budget of 4.2 s), each on its own client.
    let mut waiters = Vec::new();
    for i in 0..4 {
        let client = Arc::new(RedisLock::connect_url(&server.url()).await.unwrap());
        // Room to queue on a loaded machine; the deadline then passes while frozen.
        let deadline = Instant::now() + Duration::from_secs(3);
        let task = {
            let (client, key) = (client.clone(), key.clone());
            tokio::spawn(async move {
                let result = client.acquire(&key, LONG, deadline).await;
                (Instant::now().saturating_duration_since(deadline), result)
            })
        };
        wait_until(
            Duration::from_secs(10),
            Duration::from_millis(5),
            "a waiter never queued",
            async || queued(&mut admin, &redis_key).await > i,
        )
        .await;
        waiters.push((client, task));
    }
    server.ctl("pause").await;
    // A client that starts waiting while the server is frozen (its connection never answers).
    let late_client =
        RedisLock::connect_lazy(RedisLockConfig::from_url(&server.url()).unwrap()).unwrap();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(1);
    let result = late_client.acquire(&key, LONG, deadline).await;
    let late = Instant::now().saturating_duration_since(deadline);
    assert!(
        matches!(result, Err(Error::Timeout { .. })),
        "{result:?} after {:?}",
        started.elapsed()
    );
    let mut overshoots = vec![late];
    for (_, task) in &mut waiters {
        let (over, result) = task.await.unwrap();
        assert!(matches!(result, Err(Error::Timeout { .. })), "{result:?}");
        overshoots.push(over);
    }
    server.ctl("resume").await;
    eprintln!("acquire returned past its deadline by {overshoots:?}");
    for over in &overshoots {
        assert!(
            *over <= DEADLINE_SLACK,
            "acquire returned {over:?} past its deadline"
        );
    }
    // Once resumed, the leavings (and the undo of the attempts the freeze cut) finish in the
    // background: the queue empties, and after the holder's TTL the lock is free.
    wait_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        "waiters that gave up stay queued",
        async || queued(&mut admin, &redis_key).await == 0,
    )
    .await;
    drop(holder);
    wait_until(
        ttl + Duration::from_secs(10),
        Duration::from_millis(20),
        "a grant nobody holds was left behind",
        async || !exists(&mut admin, &redis_key).await,
    )
    .await;
    let lease = holder_client
        .acquire(&key, LONG, Instant::now() + Duration::from_secs(2))
        .await
        .unwrap();
    assert!(holder_client.release(&lease).await.unwrap());
}

/// `{<lock key>}\x1fholder`: the holder key of a key without a hash tag.
fn holder_key(lock: &RedisLock, key: &LockKey) -> String {
    format!("{{{}}}\x1fholder", lock.redis_key(key))
}

/// `url` with `options` added to its query string.
fn with_options(url: &str, options: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{options}")
}

/// The identity `inspect` shows for `key`, as text.
async fn shown_holder(lock: &RedisLock, key: &LockKey) -> Option<String> {
    let info = lock.inspect(key).await.unwrap()?;
    info.holder.map(|h| h.as_str().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_current_holders_identity_and_never_a_previous_ones() {
    let Some((url, observer, mut admin)) = shared().await else {
        return;
    };
    let first = RedisLock::connect_url(&with_options(&url, "label=first-holder"))
        .await
        .unwrap();
    let second = RedisLock::connect_url(&with_options(&url, "label=second@holder"))
        .await
        .unwrap();
    let key = fresh_key("holder-identity");
    let pid = format!("pid={}", std::process::id());

    let mut lease = first.try_acquire(&key, LONG).await.unwrap().unwrap();
    let shown = shown_holder(&observer, &key)
        .await
        .expect("no identity shown");
    assert!(shown.ends_with(" label=first-holder"), "{shown}");
    assert!(
        shown.contains(&pid) && shown.starts_with("host="),
        "{shown}"
    );
    // The identity lives as long as the grant: a renewal extends it too.
    first.renew(&mut lease, 3 * LONG).await.unwrap();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(holder_key(&observer, &key))
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(pttl > LONG.as_millis() as i64, "holder key pttl {pttl}");
    // The lock changes hands: the next holder's identity, never the previous one's.
    assert!(first.release(&lease).await.unwrap());
    assert!(!exists(&mut admin, &holder_key(&observer, &key)).await);
    let lease = second.try_acquire(&key, LONG).await.unwrap().unwrap();
    let shown = shown_holder(&first, &key).await.expect("no identity shown");
    assert!(shown.ends_with(" label=second@holder"), "{shown}");

    // A grant by a client that writes no holder key (an older version: same value format,
    // another token and fence) while the previous holder's key is still there: no identity.
    let old_client_grant = format!("{}:{}", OwnershipToken::generate().expose_hex(), 1u64 << 40);
    redis::cmd("SET")
        .arg(observer.redis_key(&key))
        .arg(&old_client_grant)
        .arg("PX")
        .arg(30_000)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    assert!(exists(&mut admin, &holder_key(&observer, &key)).await);
    let info = observer.inspect(&key).await.unwrap().unwrap();
    assert_eq!(info.fencing_token, Some(FencingToken(1 << 40)));
    assert_eq!(info.holder, None, "a previous holder's identity was shown");
    // A foreign value (another library's `SET NX`): no identity either.
    redis::cmd("SET")
        .arg(observer.redis_key(&key))
        .arg("foreign")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    assert_eq!(observer.inspect(&key).await.unwrap().unwrap().holder, None);
    assert!(!second.release(&lease).await.unwrap());
    assert!(observer.force_release(&key).await.unwrap());
    assert!(!exists(&mut admin, &holder_key(&observer, &key)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_grant_to_a_waiter_records_the_waiters_identity() {
    let Some((url, observer, mut admin)) = shared().await else {
        return;
    };
    let holder_client = RedisLock::connect_url(&with_options(&url, "label=releaser"))
        .await
        .unwrap();
    // No fallback poll within the test: the lock is the waiter's right after the release only
    // through the release's grant.
    let waiter_client = RedisLock::connect_url(&with_options(
        &url,
        "label=waiter-granted&max_poll_interval=60s",
    ))
    .await
    .unwrap();
    let key = fresh_key("holder-handoff");
    let holder = holder_client
        .try_acquire(&key, LONG)
        .await
        .unwrap()
        .unwrap();
    let waiter = queued_waiter(&waiter_client, &key, LONG, &mut admin).await;
    assert!(holder_client.release(&holder).await.unwrap());
    let info = observer
        .inspect(&key)
        .await
        .unwrap()
        .expect("the release granted the lock to the waiter");
    assert!(info.fencing_token > holder.fencing_token());
    let shown = info.holder.expect("no identity next to the direct grant");
    assert!(shown.as_str().ends_with(" label=waiter-granted"), "{shown}");
    let lease = timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the grant never reached the waiter")
        .unwrap();
    assert_eq!(lease.fencing_token(), info.fencing_token);
    assert!(waiter_client.release(&lease).await.unwrap());
    assert!(!exists(&mut admin, &holder_key(&observer, &key)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_marked_for_waiters_with_a_queue_key_of_another_type_releases_without_error() {
    let Some((_url, lock, mut admin)) = shared().await else {
        return;
    };
    for force in [false, true] {
        let key = fresh_key("queue-not-a-zset");
        let redis_key = lock.redis_key(&key);
        let lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
        // As a waiter would have marked it, then the queue key became a string.
        redis::cmd("APPEND")
            .arg(&redis_key)
            .arg(":w")
            .query_async::<()>(&mut admin)
            .await
            .unwrap();
        let queue = format!("{{{redis_key}}}\x1fwaiters");
        redis::cmd("SET")
            .arg(&queue)
            .arg("not a sorted set")
            .arg("PX")
            .arg(30_000)
            .query_async::<()>(&mut admin)
            .await
            .unwrap();
        let released = if force {
            lock.force_release(&key).await
        } else {
            lock.release(&lease).await
        };
        assert!(released.unwrap(), "force: {force}");
        assert!(!exists(&mut admin, &redis_key).await, "force: {force}");
        assert_eq!(
            get(&mut admin, queue.as_bytes()).await.as_deref(),
            Some(&b"not a sorted set"[..])
        );
        redis::cmd("DEL")
            .arg(&queue)
            .query_async::<()>(&mut admin)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_the_server_does_not_have_is_a_config_error() {
    let Some((url, _lock, _admin)) = shared().await else {
        return;
    };
    let mut config = RedisLockConfig::from_url(&url).unwrap();
    config.db = 99;
    let err = RedisLock::connect(config.clone()).await.unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(!err.is_temporary());
    // A lazy client learns it on its first request.
    let lazy = RedisLock::connect_lazy(config).unwrap();
    let key = fresh_key("bad-db");
    let err = lazy.try_acquire(&key, LONG).await.unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    let err = lazy.inspect(&key).await.unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
}
