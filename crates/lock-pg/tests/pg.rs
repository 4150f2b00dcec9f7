//! PostgreSQL-specific behaviour against the real server from `DISTLOCK_TEST_PG_URL`: concurrent
//! table creation, hostile names, the resource-side fenced write, terminated connections.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use conformance::{backend_url, fresh_key};
use futures::future::join_all;
use lock_core::{DistributedLock, DistributedLockExt, Error, FencingToken, LockKey};
use lock_pg::{FenceError, FencedTable, PgLock, PgLockConfig, sqlx};
use tokio::time::{Instant, sleep, timeout};

const LONG: Duration = Duration::from_secs(30);

fn url_with(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

fn suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

async fn admin(url: &str) -> sqlx::PgPool {
    sqlx::PgPool::connect(url).await.expect("admin pool")
}

async fn expire(pool: &sqlx::PgPool, table: &str, key: &LockKey) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {table} SET expires_at = clock_timestamp() - interval '1 second' WHERE name = $1"
    )))
    .bind(key.as_str())
    .execute(pool)
    .await
    .unwrap();
}

/// Several processes' worth of clients creating the same new table at the same instant all
/// succeed, and the table they created works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_use_creates_the_table_once() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let table = format!("distlock_race_{}", suffix());
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (url, table, barrier) = (url.clone(), table.clone(), barrier.clone());
            tokio::spawn(async move {
                let config =
                    PgLockConfig::from_url(&url_with(&url, &format!("table={table}"))).unwrap();
                barrier.wait().await;
                PgLock::connect(config).await
            })
        })
        .collect();
    let mut clients = Vec::new();
    for t in tasks {
        clients.push(t.await.unwrap().expect("every concurrent creator succeeds"));
    }
    let key = fresh_key("race-table");
    let lease = clients[0].try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(clients[1].try_acquire(&key, LONG).await.unwrap().is_none());
    assert!(clients[0].release(&lease).await.unwrap());
    let pool = admin(&url).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE \"{table}\"")))
        .execute(&pool)
        .await
        .unwrap();
}

/// Names with quotes, semicolons, SQL, backslashes and Unicode are plain data: each is its own
/// lock, inspect and release work, and the table survives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_names_are_plain_data() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let a = PgLock::connect_url(&url).await.unwrap();
    let b = PgLock::connect_url(&url).await.unwrap();
    let base = fresh_key("hostile");
    let names = [
        "'; DROP TABLE distlock_leases; --",
        "\"quoted\" name",
        "semi;colon",
        "back\\slash",
        "percent % and _ underscore",
        "$1 $$dollar$$",
        "日本語のロック",
        "emoji \u{1F512}",
        "U&\"\\0041\"",
    ];
    let keys: Vec<LockKey> = names
        .iter()
        .map(|n| LockKey::new(format!("{base}/{n}")).unwrap())
        .collect();
    let mut leases = Vec::new();
    for key in &keys {
        leases.push(a.try_acquire(key, LONG).await.unwrap().expect("free"));
    }
    for (key, lease) in keys.iter().zip(&leases) {
        assert!(b.try_acquire(key, LONG).await.unwrap().is_none(), "{key}");
        let info = b.inspect(key).await.unwrap().expect("held");
        assert_eq!(info.token_digest, Some(lease.token().digest()));
        assert_eq!(info.fencing_token, lease.fencing_token());
    }
    for lease in &leases {
        assert!(a.release(lease).await.unwrap());
    }
    for key in &keys {
        assert_eq!(b.inspect(key).await.unwrap(), None);
    }
    // The table is still there and still works.
    let again = b.try_acquire(&keys[0], LONG).await.unwrap().expect("free");
    assert!(b.release(&again).await.unwrap());
}

/// The article's `scheduled_jobs` write: a paused holder whose lease expired and was taken over
/// has its late write rejected as stale (distinct from a missing row) after the new holder wrote,
/// and the rejected transaction changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_holders_fenced_write_is_rejected_after_the_new_holder_wrote() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let a = PgLock::connect_url(&url).await.unwrap();
    let b = PgLock::connect_url(&url).await.unwrap();
    let pool = admin(&url).await;
    let jobs_table = format!("scheduled_jobs_{}", suffix());
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {jobs_table} (id bigint PRIMARY KEY, status text NOT NULL, \
         last_fencing_token bigint)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {jobs_table} VALUES (42, 'pending', NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let jobs = FencedTable::new(&jobs_table, "id", "last_fencing_token").unwrap();
    let write = |token: FencingToken, status: &'static str| {
        let (pool, jobs, jobs_table) = (pool.clone(), jobs.clone(), jobs_table.clone());
        async move {
            let mut tx = pool.begin().await.unwrap();
            jobs.fence(&mut tx, 42_i64, token).await?;
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE {jobs_table} SET status = $1 WHERE id = 42"
            )))
            .bind(status)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok::<_, FenceError>(())
        }
    };

    let key = fresh_key("fenced-write");
    let old = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    write(old.fencing_token().unwrap(), "closed by a")
        .await
        .expect("the holder's first write");
    // a pauses past its TTL; b takes over and writes.
    expire(&pool, "distlock_leases", &key).await;
    let new = b
        .try_acquire(&key, LONG)
        .await
        .unwrap()
        .expect("taken over");
    assert!(new.fencing_token() > old.fencing_token());
    write(new.fencing_token().unwrap(), "closed by b")
        .await
        .expect("the new holder's write");
    // a wakes up and writes with its old token.
    let err = write(old.fencing_token().unwrap(), "late write by a")
        .await
        .unwrap_err();
    match err {
        FenceError::Stale(stale) => {
            assert_eq!(stale.presented, old.fencing_token().unwrap());
            assert_eq!(stale.highest, new.fencing_token().unwrap());
        }
        other => panic!("expected Stale, got {other}"),
    }
    let status: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT status FROM {jobs_table} WHERE id = 42"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(status, "closed by b");
    // Same token again is stale too (strictly newer required); a missing row is NotFound.
    assert!(
        write(new.fencing_token().unwrap(), "x")
            .await
            .unwrap_err()
            .is_stale()
    );
    let mut conn = pool.acquire().await.unwrap();
    assert!(matches!(
        jobs.fence(&mut conn, 7_i64, new.fencing_token().unwrap())
            .await,
        Err(FenceError::NotFound)
    ));
    assert!(!a.release(&old).await.unwrap());
    assert!(b.release(&new).await.unwrap());
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {jobs_table}")))
        .execute(&pool)
        .await
        .unwrap();
}

async fn terminate(pool: &sqlx::PgPool, app: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1) t",
    )
    .bind(app)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// `pg_terminate_backend` on every connection of two clients (pooled and LISTEN) while one
/// holds a guarded lock and the other waits: no panic, no false loss; renew, release and the
/// waiter's hand-off still work on fresh connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_connections_are_replaced_transparently() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let app = format!("distlock_term_{}", suffix());
    let client = || async {
        Arc::new(
            PgLock::connect_url(&url_with(
                &url,
                &format!("application_name={app}&poll_interval=10s"),
            ))
            .await
            .unwrap(),
        )
    };
    let (a, b) = (client().await, client().await);
    let pool = admin(&url).await;
    let key = fresh_key("terminate");

    // Fill a's pool with several idle connections.
    let warm: Vec<_> = (0..4)
        .map(|i| {
            let a = a.clone();
            tokio::spawn(async move {
                let k = fresh_key(&format!("warm{i}"));
                let l = a.try_acquire(&k, LONG).await.unwrap().unwrap();
                a.release(&l).await.unwrap();
            })
        })
        .collect();
    for w in warm {
        w.await.unwrap();
    }

    let ttl = Duration::from_secs(2);
    let guard = a
        .lock(&key)
        .ttl(ttl)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let first_deadline = guard.local_deadline();
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move {
            let got = b.acquire(&key, LONG, Instant::now() + LONG).await;
            (Instant::now(), got)
        })
    };
    // Queued: the waiter is LISTENing now.
    wait_for_queue(&a, &key, 1).await;
    let killed = terminate(&pool, &app).await;
    assert!(killed >= 3, "only {killed} connections terminated");

    // The watchdog renews on fresh connections: lost() stays quiet while it renews twice and
    // the lease outlives its first deadline. Awaited as events (bounded generously), not a
    // sleep: a stalled machine only makes it take longer.
    let renewed_before = guard.renewals();
    let until = Instant::now() + LONG;
    while guard.renewals() < renewed_before + 2 || Instant::now() <= first_deadline {
        assert!(
            Instant::now() < until,
            "{} renewals after terminate",
            guard.renewals() - renewed_before
        );
        tokio::select! {
            () = guard.lost() => panic!("false loss after terminate: {:?}", guard.loss_reason()),
            () = sleep(Duration::from_millis(20)) => {}
        }
    }
    assert!(!guard.is_lost(), "{:?}", guard.loss_reason());
    // Kill them again, then a plain try_acquire by a third party on a dead pool is correct.
    terminate(&pool, &app).await;
    assert!(b.try_acquire(&key, LONG).await.unwrap().is_none());
    assert!(!waiter.is_finished(), "the waiter got a held lock");

    terminate(&pool, &app).await;
    let released_at = Instant::now();
    assert!(
        guard.release().await.unwrap(),
        "release on a fresh connection"
    );
    let (got_at, got) = timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter was not woken (poll interval is 10 s)")
        .unwrap();
    let got = got.unwrap();
    assert!(got_at >= released_at);
    assert!(b.release(&got).await.unwrap());
}

/// With `listen=false` (transaction-pooler mode) waiters poll and still get the lock, and the
/// client claims no `wait_notify`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_mode_without_listen() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let a = PgLock::connect_url(&url).await.unwrap();
    let b = Arc::new(
        PgLock::connect_url(&url_with(&url, "listen=false&poll_interval=100ms"))
            .await
            .unwrap(),
    );
    assert!(!b.capabilities().wait_notify);
    let key = fresh_key("poll");
    let lease = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { b.acquire(&key, LONG, Instant::now() + LONG).await })
    };
    sleep(Duration::from_millis(300)).await;
    assert!(a.release(&lease).await.unwrap());
    let got = timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(got.fencing_token() > lease.fencing_token());
    assert!(b.release(&got).await.unwrap());
}

/// A missing table with `create_table=false` is a configuration error, not a panic or a retry
/// loop; a wrong password-free host is `Unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_table_and_unreachable_server_are_typed_errors() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let err = PgLock::connect_url(&url_with(
        &url,
        &format!("table=distlock_absent_{}&create_table=false", suffix()),
    ))
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    let err = PgLock::connect_url("postgres://postgres@127.0.0.1:1/distlock?connect_timeout=1")
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
}

/// An acquire whose request applies but whose reply is lost (a proxy drops the replies) ends in
/// `Indeterminate` within its timeouts — never `Ok(None)` or a hang — and the possible grant is
/// undone by the attempt's token as soon as the server is reachable again, long before its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_reply_on_acquire_is_indeterminate_and_undone() {
    use conformance::drill::Proxy;
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let (proxy, proxied) = Proxy::start_for_url(&url).await.unwrap();
    let a = PgLock::connect_url(&url_with(
        &proxied,
        "op_timeout=1s&connect_timeout=1&pool_size=1",
    ))
    .await
    .unwrap();
    let b = PgLock::connect_url(&url).await.unwrap();
    let key = fresh_key("lost-reply");
    // Warm a's only connection, so the acquire below is sent on it.
    let warm = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(a.release(&warm).await.unwrap());

    proxy.drop_replies();
    let start = Instant::now();
    let err = timeout(Duration::from_secs(20), a.try_acquire(&key, LONG))
        .await
        .expect("no hang")
        .expect_err("the reply was lost");
    assert!(matches!(err, Error::Indeterminate { .. }), "{err}");
    assert!(err.is_temporary());
    assert!(start.elapsed() < Duration::from_secs(10));
    // The request applied: the key is held by a's lost attempt, which a cannot use.
    let info = b
        .inspect(&key)
        .await
        .unwrap()
        .expect("the lost grant applied");
    assert!(info.fencing_token > warm.fencing_token());

    proxy.pass();
    let got = b
        .acquire(&key, LONG, Instant::now() + Duration::from_secs(10))
        .await
        .expect("the lost grant is undone after the heal, well before its 30 s ttl");
    assert!(got.fencing_token() > info.fencing_token);
    assert!(b.release(&got).await.unwrap());
}

/// The watchdogs of many guards held by one client renew through shared statements: per tick,
/// a handful of statements (each one transaction) however many locks are held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_guards_renew_in_a_few_statements_per_tick() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    const N: usize = 300;
    let lock = Arc::new(PgLock::connect_url(&url).await.unwrap());
    let base = fresh_key("batch-guards");
    let mut guards = Vec::new();
    for i in 0..N {
        let guard = lock
            .lock(format!("{base}/{i}").as_str())
            .ttl(Duration::from_secs(6))
            .watchdog(Duration::from_millis(500))
            .try_acquire()
            .await
            .unwrap()
            .expect("free");
        guards.push(guard);
    }
    let renewals = |guards: &[lock_core::LockGuard]| guards.iter().map(|g| g.renewals()).sum();
    // From the first renewal on, count statements over a few ticks.
    let until = Instant::now() + Duration::from_secs(60);
    while renewals(&guards) == 0 {
        assert!(Instant::now() < until, "the watchdogs do not renew");
        sleep(Duration::from_millis(20)).await;
    }
    let (statements_before, renewals_before): (u64, u64) =
        (lock.statements_sent(), renewals(&guards));
    while renewals(&guards) < renewals_before + 3 * N as u64 {
        assert!(Instant::now() < until, "the watchdogs do not renew");
        sleep(Duration::from_millis(20)).await;
    }
    let statements = lock.statements_sent() - statements_before;
    let renewed = renewals(&guards) - renewals_before;
    // Unbatched this is one statement per renewal; batched, a few per grid instant (slow
    // acquisitions on a loaded machine spread the guards over more instants). A fivefold
    // margin separates the two without depending on the machine's load.
    assert!(
        statements * 5 < renewed,
        "{renewed} renewals took {statements} statements"
    );
    assert!(guards.iter().all(|g| !g.is_lost()));
    for guard in guards {
        assert!(guard.release().await.unwrap());
    }
}

/// One batch statement renews every lease still held and answers `NotHeld` only for the ones
/// that were taken over or deleted from outside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_not_held_only_for_the_locks_lost_from_outside() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    const N: usize = 40;
    let a = PgLock::connect_url(&url).await.unwrap();
    let b = PgLock::connect_url(&url).await.unwrap();
    let pool = admin(&url).await;
    let base = fresh_key("batch-not-held");
    let keys: Vec<LockKey> = (0..N)
        .map(|i| LockKey::new(format!("{base}/{i:02}")).unwrap())
        .collect();
    let mut leases = Vec::new();
    for key in &keys {
        leases.push(a.try_acquire(key, LONG).await.unwrap().expect("free"));
    }
    // Lease 7 expires and b takes it over; lease 23's row is deleted by hand.
    expire(&pool, "distlock_leases", &keys[7]).await;
    let taken = b.try_acquire(&keys[7], LONG).await.unwrap().expect("taken");
    sqlx::query("DELETE FROM distlock_leases WHERE name = $1")
        .bind(keys[23].as_str())
        .execute(&pool)
        .await
        .unwrap();

    let before = a.statements_sent();
    let deadlines: Vec<Instant> = leases.iter().map(|l| l.local_deadline()).collect();
    let results = join_all(leases.iter_mut().map(|lease| a.renew(lease, LONG))).await;
    let statements = a.statements_sent() - before;
    assert!(statements <= 4, "{N} renewals took {statements} statements");
    for (i, result) in results.iter().enumerate() {
        match i {
            7 | 23 => assert!(
                matches!(result, Err(Error::NotHeld { .. })),
                "lease {i}: {result:?}"
            ),
            _ => assert!(result.is_ok(), "lease {i}: {result:?}"),
        }
    }
    for (i, (lease, before)) in leases.iter().zip(&deadlines).enumerate() {
        if i != 7 && i != 23 {
            assert!(lease.local_deadline() > *before, "lease {i} not extended");
        }
    }
    // The other holder is untouched, and the renewed leases are still ours.
    assert_eq!(
        b.inspect(&keys[7]).await.unwrap().unwrap().token_digest,
        Some(taken.token().digest())
    );
    for (i, lease) in leases.iter().enumerate() {
        assert_eq!(
            a.release(lease).await.unwrap(),
            i != 7 && i != 23,
            "lease {i}"
        );
    }
    assert!(b.release(&taken).await.unwrap());
}

/// The same lease renewed twice at once (two copies, different TTLs) among other renewals:
/// both are answered, neither breaks the batch, and the table holds one of the two TTLs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lease_renewed_twice_in_a_batch_is_answered_twice() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let a = PgLock::connect_url(&url).await.unwrap();
    let base = fresh_key("batch-twice");
    let mut others = Vec::new();
    for i in 0..10 {
        let key = LockKey::new(format!("{base}/{i}")).unwrap();
        others.push(a.try_acquire(&key, LONG).await.unwrap().expect("free"));
    }
    let key = LockKey::new(format!("{base}/twice")).unwrap();
    let lease = a.try_acquire(&key, LONG).await.unwrap().expect("free");
    let (mut long, mut short) = (lease.clone(), lease.clone());
    let (r1, r2, rest) = tokio::join!(
        a.renew(&mut long, Duration::from_secs(60)),
        a.renew(&mut short, Duration::from_secs(20)),
        join_all(others.iter_mut().map(|l| a.renew(l, LONG)))
    );
    r1.unwrap();
    r2.unwrap();
    assert!(rest.iter().all(Result::is_ok), "{rest:?}");
    let remaining = a
        .inspect(&key)
        .await
        .unwrap()
        .unwrap()
        .ttl_remaining
        .unwrap();
    assert!(
        remaining <= Duration::from_secs(20) || remaining > Duration::from_secs(50),
        "{remaining:?}"
    );
    assert!(a.release(&lease).await.unwrap());
    for l in &others {
        assert!(a.release(l).await.unwrap());
    }
}

/// Waits (bounded) until `inspect` shows `n` queued waiters behind the holder of `key`.
async fn wait_for_queue(lock: &PgLock, key: &LockKey, n: usize) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let waiters = lock.inspect(key).await.unwrap().and_then(|h| h.waiters);
        if waiters == Some(n) {
            return;
        }
        assert!(
            Instant::now() < until,
            "expected {n} queued waiters, inspect shows {waiters:?}"
        );
        sleep(Duration::from_millis(10)).await;
    }
}

type Waiter = tokio::task::JoinHandle<Result<lock_core::Lease, Error>>;

fn spawn_acquire(lock: &Arc<PgLock>, key: &LockKey, deadline: Instant) -> Waiter {
    let (lock, key) = (lock.clone(), key.clone());
    tokio::spawn(async move { lock.acquire(&key, LONG, deadline).await })
}

/// Each release wakes only the first waiter of the queue, and waiters get the lock in the order
/// they queued: with a 30 s fallback poll, every waiter behind the first sends no statement
/// while the lock passes down the line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_only_the_first_queued_waiter() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let url = url_with(&url, "poll_interval=30s");
    let holder = PgLock::connect_url(&url).await.unwrap();
    let key = fresh_key("wake-one");
    let mut lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    let mut clients = Vec::new();
    let mut waiters = Vec::new();
    for n in 1..=4 {
        let client = Arc::new(PgLock::connect_url(&url).await.unwrap());
        waiters.push(Some(spawn_acquire(&client, &key, Instant::now() + LONG)));
        wait_for_queue(&holder, &key, n).await;
        clients.push(client);
    }
    let mut releaser: &PgLock = &holder;
    for turn in 0..4 {
        let sent: Vec<u64> = clients.iter().map(|c| c.statements_sent()).collect();
        assert!(releaser.release(&lease).await.unwrap());
        let got = timeout(Duration::from_secs(10), waiters[turn].take().unwrap())
            .await
            .unwrap_or_else(|_| panic!("waiter {turn}, first in line, did not get the lock"))
            .unwrap()
            .unwrap();
        assert!(got.fencing_token() > lease.fencing_token());
        for (i, client) in clients.iter().enumerate().skip(turn + 1) {
            assert_eq!(
                client.statements_sent(),
                sent[i],
                "waiter {i} was woken by the release meant for waiter {turn}"
            );
        }
        wait_for_queue(&holder, &key, 3 - turn).await;
        lease = got;
        releaser = &clients[turn];
    }
    assert!(releaser.release(&lease).await.unwrap());
}

/// A waiter that gives up leaves the queue, so the next release wakes the one behind it at
/// once rather than a waiter that is gone (which would leave it to its 30 s fallback poll).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_gives_up_leaves_the_queue() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let url = url_with(&url, "poll_interval=30s");
    let holder = PgLock::connect_url(&url).await.unwrap();
    let (quitter, stayer) = (
        Arc::new(PgLock::connect_url(&url).await.unwrap()),
        Arc::new(PgLock::connect_url(&url).await.unwrap()),
    );
    let key = fresh_key("give-up");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    let quits = spawn_acquire(&quitter, &key, Instant::now() + Duration::from_secs(5));
    wait_for_queue(&holder, &key, 1).await;
    let stays = spawn_acquire(&stayer, &key, Instant::now() + LONG);
    wait_for_queue(&holder, &key, 2).await;
    let err = quits.await.unwrap().expect_err("the holder keeps the lock");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    wait_for_queue(&holder, &key, 1).await;
    assert!(holder.release(&lease).await.unwrap());
    let got = timeout(Duration::from_secs(10), stays)
        .await
        .expect("the release woke the waiter that had given up")
        .unwrap()
        .unwrap();
    assert!(stayer.release(&got).await.unwrap());
}

/// A queued waiter that vanished without leaving (a crash) only delays the next one by its
/// fallback delay: the release wakes the dead entry, and the live waiter's next attempt takes
/// the lock. Simulated with an entry on a channel nobody listens to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_first_waiter_only_delays_the_next_one() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let url = url_with(&url, "poll_interval=300ms");
    let holder = PgLock::connect_url(&url).await.unwrap();
    let waiter = Arc::new(PgLock::connect_url(&url).await.unwrap());
    let key = fresh_key("dead-head");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    let pool = admin(&url).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET waiters = ARRAY['distlock_w_nobody:1 ' || \
         ((extract(epoch FROM clock_timestamp()) + 3600) * 1000)::bigint] WHERE name = $1",
        holder.config().table.quoted()
    )))
    .bind(key.as_str())
    .execute(&pool)
    .await
    .unwrap();
    let waits = spawn_acquire(&waiter, &key, Instant::now() + LONG);
    wait_for_queue(&holder, &key, 2).await;
    assert!(holder.release(&lease).await.unwrap());
    let got = timeout(Duration::from_secs(10), waits)
        .await
        .expect("a dead first entry stalls the queue")
        .unwrap()
        .unwrap();
    assert!(got.fencing_token() > lease.fencing_token());
    assert!(waiter.release(&got).await.unwrap());
}

/// A lease table created by an older version (no `waiters` column) gains the column on first
/// use, and then queues; with `create_table=false` it is a configuration error naming the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_table_gains_the_queue_column() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let pool = admin(&url).await;
    let table = format!("distlock_old_{}", suffix());
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (name text PRIMARY KEY, owner text, fence bigint NOT NULL, \
         expires_at timestamptz NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let err = PgLock::connect_url(&url_with(
        &url,
        &format!("table={table}&create_table=false"),
    ))
    .await
    .expect_err("no waiters column");
    assert!(
        matches!(&err, Error::Config(m) if m.contains("waiters")),
        "{err}"
    );
    let url = url_with(&url, &format!("table={table}"));
    let a = PgLock::connect_url(&url).await.unwrap();
    let b = Arc::new(PgLock::connect_url(&url).await.unwrap());
    let key = fresh_key("old-table");
    let lease = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waits = spawn_acquire(&b, &key, Instant::now() + LONG);
    wait_for_queue(&a, &key, 1).await;
    assert!(a.release(&lease).await.unwrap());
    let got = timeout(Duration::from_secs(10), waits)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(b.release(&got).await.unwrap());
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await
        .unwrap();
}

/// A release hands the lock to the first queued waiter in the same statement: as soon as
/// `release` returns, the waiter is the holder (next fence, its token, queue empty), and its
/// `acquire` returns that grant without sending another statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_grants_the_lock_to_the_first_waiter() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    // No fallback poll during the test: only the release can hand the lock over.
    let url = url_with(&url, "poll_interval=30s");
    let holder = PgLock::connect_url(&url).await.unwrap();
    let waiter = Arc::new(PgLock::connect_url(&url).await.unwrap());
    let key = fresh_key("direct-grant");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waits = spawn_acquire(&waiter, &key, Instant::now() + LONG);
    wait_for_queue(&holder, &key, 1).await;
    let sent = waiter.statements_sent();
    assert!(holder.release(&lease).await.unwrap());
    let info = holder
        .inspect(&key)
        .await
        .unwrap()
        .expect("the release granted the lock to the waiter");
    let next = FencingToken(lease.fencing_token().unwrap().get() + 1);
    assert_eq!(info.fencing_token, Some(next));
    assert_ne!(info.token_digest, Some(lease.token().digest()));
    assert_eq!(info.waiters, Some(0), "the granted entry left the queue");
    let got = timeout(Duration::from_secs(10), waits)
        .await
        .expect("the waiter did not learn of its grant")
        .unwrap()
        .unwrap();
    assert_eq!(got.fencing_token(), Some(next));
    assert_eq!(info.token_digest, Some(got.token().digest()));
    // The release granted only the entry's short first lease (a dead waiter would hold the
    // lock that long at most); the waiter took the grant from the notification, without an
    // attempt, and extended it to its TTL with one renewal before `acquire` returned.
    assert!(info.ttl_remaining.unwrap() <= Duration::from_millis(1500));
    assert_eq!(
        waiter.statements_sent(),
        sent + 1,
        "the waiter needed more than its confirming renewal to take a lock it was granted"
    );
    assert_eq!(got.ttl(), LONG);
    assert!(got.remaining() > LONG / 2, "{:?}", got.remaining());
    assert!(!holder.release(&lease).await.unwrap());
    assert!(waiter.release(&got).await.unwrap());
    assert_eq!(holder.inspect(&key).await.unwrap(), None);
}

/// A waiter granted the lock by a release just as it gives up (its `acquire` future dropped
/// without seeing the grant) frees the grant on its way out: the lock is free again long
/// before the 30 s TTL of the grant. Current-thread runtime, so the dropped future is
/// provably never polled after the release.
#[tokio::test]
async fn a_waiter_granted_as_it_gives_up_frees_the_grant() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let url = url_with(&url, "poll_interval=30s");
    let holder = PgLock::connect_url(&url).await.unwrap();
    let quitter = PgLock::connect_url(&url).await.unwrap();
    let next = PgLock::connect_url(&url).await.unwrap();
    let key = fresh_key("grant-on-give-up");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    let mut quits = quitter.acquire(&key, LONG, Instant::now() + LONG);
    tokio::select! {
        got = &mut quits => panic!("the holder keeps the lock, yet: {got:?}"),
        () = wait_for_queue(&holder, &key, 1) => {}
    }
    assert!(holder.release(&lease).await.unwrap());
    let info = holder.inspect(&key).await.unwrap().expect("granted");
    assert_eq!(
        info.fencing_token,
        Some(FencingToken(lease.fencing_token().unwrap().get() + 1)),
        "the release granted the lock to the waiter"
    );
    drop(quits);
    let started = Instant::now();
    let got = next
        .acquire(&key, LONG, started + Duration::from_secs(10))
        .await
        .expect("the grant to the waiter that gave up blocks the lock");
    assert!(got.fencing_token() > info.fencing_token);
    assert!(next.release(&got).await.unwrap());
}

/// A grant whose notification came by the deadline is taken, not dropped for a timeout (and
/// then handed on): the waiter is next polled after its deadline, the grant already there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_came_by_the_deadline_is_taken_not_timed_out() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let url = url_with(&url, "poll_interval=30s");
    let holder = PgLock::connect_url(&url).await.unwrap();
    let waiter = PgLock::connect_url(&url).await.unwrap();
    let key = fresh_key("deadline-grant");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    // Room for queueing on a loaded machine: the waiter must be queued before its deadline.
    // The release grants only a first lease of 1.5 s (counted by the waiter from its attempt),
    // so the deadline comes well within it.
    let deadline = Instant::now() + Duration::from_millis(1200);
    let mut waits = waiter.acquire(&key, LONG, deadline);
    tokio::select! {
        got = &mut waits => panic!("the holder keeps the lock, yet: {got:?}"),
        () = wait_for_queue(&holder, &key, 1) => {}
    }
    assert!(holder.release(&lease).await.unwrap());
    let info = holder.inspect(&key).await.unwrap().expect("granted");
    tokio::time::sleep_until(deadline + Duration::from_millis(50)).await;
    let got = waits.await.expect("the grant was dropped for the deadline");
    assert_eq!(got.fencing_token(), info.fencing_token);
    assert!(waiter.release(&got).await.unwrap());
}

/// Rewrites the channel of every queue entry of `key` to one nobody listens on (keeping the
/// rest of each entry), so a release's notification to them is lost.
async fn lose_notifications(pool: &sqlx::PgPool, lock: &PgLock, key: &LockKey) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET waiters = ARRAY(SELECT regexp_replace(w, '^[^:]+:', 'distlock_w_nobody:') \
         FROM unnest(waiters) WITH ORDINALITY AS q(w, o) ORDER BY o) WHERE name = $1",
        lock.config().table.quoted()
    )))
    .bind(key.as_str())
    .execute(pool)
    .await
    .unwrap();
}

/// A grant whose notification never arrives is found by the waiter's next attempt (its
/// fallback poll), which takes it — the same fence, a lease that renews and releases — instead
/// of waiting behind its own grant until the TTL runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_notification_is_lost_is_found_by_the_next_attempt() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let holder = PgLock::connect_url(&url).await.unwrap();
    let waiter = Arc::new(
        PgLock::connect_url(&url_with(&url, "poll_interval=300ms"))
            .await
            .unwrap(),
    );
    let pool = admin(&url).await;
    let key = fresh_key("lost-grant");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waits = spawn_acquire(&waiter, &key, Instant::now() + LONG);
    wait_for_queue(&holder, &key, 1).await;
    lose_notifications(&pool, &holder, &key).await;
    assert!(holder.release(&lease).await.unwrap());
    let info = holder.inspect(&key).await.unwrap().expect("granted");
    let granted = FencingToken(lease.fencing_token().unwrap().get() + 1);
    assert_eq!(info.fencing_token, Some(granted));
    let mut got = timeout(Duration::from_secs(10), waits)
        .await
        .expect("the waiter did not find its grant (it waits for the 30 s TTL)")
        .unwrap()
        .unwrap();
    assert_eq!(got.fencing_token(), Some(granted));
    assert_eq!(info.token_digest, Some(got.token().digest()));
    let after = holder.inspect(&key).await.unwrap().unwrap();
    assert_eq!(after.waiters, Some(0), "the waiter's entry left the queue");
    waiter.renew(&mut got, LONG).await.unwrap();
    assert!(waiter.release(&got).await.unwrap());
    assert_eq!(holder.inspect(&key).await.unwrap(), None);
}

/// A grant made while the waiter's `LISTEN` connection was just terminated (its notification
/// lost with the connection) is found once the waiter tries again, with the granted fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_made_while_the_listener_is_down_is_found() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let app = format!("distlock_listen_{}", suffix());
    let holder = PgLock::connect_url(&url).await.unwrap();
    let waiter = Arc::new(
        PgLock::connect_url(&url_with(
            &url,
            &format!("application_name={app}&poll_interval=30s"),
        ))
        .await
        .unwrap(),
    );
    let pool = admin(&url).await;
    let key = fresh_key("listener-down");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waits = spawn_acquire(&waiter, &key, Instant::now() + LONG);
    wait_for_queue(&holder, &key, 1).await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND query ILIKE 'LISTEN%') t",
    )
    .bind(&app)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(killed, 1, "the waiter's LISTEN connection");
    assert!(holder.release(&lease).await.unwrap());
    let granted = FencingToken(lease.fencing_token().unwrap().get() + 1);
    let info = holder.inspect(&key).await.unwrap().expect("granted");
    assert_eq!(info.fencing_token, Some(granted));
    let got = timeout(Duration::from_secs(10), waits)
        .await
        .expect("the waiter did not find its grant")
        .unwrap()
        .unwrap();
    assert_eq!(got.fencing_token(), Some(granted));
    assert_eq!(info.token_digest, Some(got.token().digest()));
    assert!(waiter.release(&got).await.unwrap());
    assert_eq!(holder.inspect(&key).await.unwrap(), None);
}

/// An entry written by an older client (`<channel>:<number> <expiry>`, no grant owner) is only
/// woken by a release, with the bare number as payload, and the lock is left free for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_clients_entry_is_woken_not_granted() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let holder = PgLock::connect_url(&url).await.unwrap();
    let pool = admin(&url).await;
    let channel = format!("distlock_w_{}", suffix());
    let mut listener = sqlx::postgres::PgListener::connect(&url).await.unwrap();
    listener.listen(&channel).await.unwrap();
    let key = fresh_key("old-entry");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET waiters = ARRAY[$2 || ':7 ' || \
         ((extract(epoch FROM clock_timestamp()) + 3600) * 1000)::bigint] WHERE name = $1",
        holder.config().table.quoted()
    )))
    .bind(key.as_str())
    .bind(&channel)
    .execute(&pool)
    .await
    .unwrap();
    assert!(holder.release(&lease).await.unwrap());
    let notified = timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("the old entry was not woken")
        .unwrap();
    assert_eq!(notified.channel(), channel);
    assert_eq!(notified.payload(), "7");
    assert_eq!(holder.inspect(&key).await.unwrap(), None, "left free");
    let again = holder.try_acquire(&key, LONG).await.unwrap().expect("free");
    assert_eq!(
        again.fencing_token(),
        Some(FencingToken(lease.fencing_token().unwrap().get() + 1))
    );
    assert!(holder.release(&again).await.unwrap());
}

/// A grant announced more than a quarter of the TTL after the attempt that queued was sent is
/// not taken from the notification alone (the lease would start too long ago): one statement
/// confirms and extends it, and the lease counts from that statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_grant_is_confirmed_by_one_statement() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let url = url_with(&url, "poll_interval=30s");
    let holder = PgLock::connect_url(&url).await.unwrap();
    let waiter = Arc::new(PgLock::connect_url(&url).await.unwrap());
    let key = fresh_key("late-grant");
    // Long enough that a stalled machine still finds the grant live when it confirms it.
    let ttl = Duration::from_secs(2);
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waits = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move { waiter.acquire(&key, ttl, Instant::now() + LONG).await })
    };
    wait_for_queue(&holder, &key, 1).await;
    let sent = waiter.statements_sent();
    sleep(ttl / 4 + Duration::from_millis(200)).await; // past ttl/4 since its last attempt
    let released_at = Instant::now();
    assert!(holder.release(&lease).await.unwrap());
    let got = timeout(Duration::from_secs(10), waits)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        got.fencing_token(),
        Some(FencingToken(lease.fencing_token().unwrap().get() + 1))
    );
    assert_eq!(
        waiter.statements_sent(),
        sent + 1,
        "one confirming statement"
    );
    assert!(
        got.acquired_at() >= released_at,
        "the lease counts from the confirmation"
    );
    assert!(waiter.release(&got).await.unwrap());
}

/// A waiter that gives up while the server is unreachable, just after a release granted it the
/// lock, keeps trying to leave the queue in the background: once the network heals, the grant
/// it never heard of is freed, long before its 30 s TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_to_a_waiter_that_left_during_an_outage_is_freed_after_it() {
    use conformance::drill::Proxy;
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let (proxy, proxied) = Proxy::start_for_url(&url).await.unwrap();
    let holder = PgLock::connect_url(&url).await.unwrap();
    let waiter = Arc::new(
        PgLock::connect_url(&url_with(
            &proxied,
            "op_timeout=1s&connect_timeout=1&pool_size=1&poll_interval=30s",
        ))
        .await
        .unwrap(),
    );
    let key = fresh_key("grant-outage");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waits = spawn_acquire(&waiter, &key, Instant::now() + LONG);
    wait_for_queue(&holder, &key, 1).await;
    proxy.blackhole();
    assert!(holder.release(&lease).await.unwrap());
    let info = holder.inspect(&key).await.unwrap().expect("granted");
    assert_eq!(
        info.fencing_token,
        Some(FencingToken(lease.fencing_token().unwrap().get() + 1))
    );
    let accepted = proxy.accepted();
    waits.abort();
    // Its first attempt to leave fails; a retry opens a new connection (bounded wait: without
    // retries there is none, and the check below fails).
    let until = Instant::now() + Duration::from_secs(5);
    while proxy.accepted() == accepted && Instant::now() < until {
        sleep(Duration::from_millis(10)).await;
    }
    // Held requests die with their connections: only a retry after the heal can free the grant.
    proxy.reset();
    proxy.pass();
    let got = holder
        .acquire(&key, LONG, Instant::now() + Duration::from_secs(10))
        .await
        .expect("the grant to the waiter that left stays until its TTL");
    assert!(got.fencing_token() > info.fencing_token);
    assert!(holder.release(&got).await.unwrap());
}

/// A waiter cancelled while its first queueing attempt is in flight (its entry written, the
/// reply not yet read) still leaves the queue: the next release does not hand the lock to the
/// gone waiter for its 30 s TTL. The proxy delays the waiter's traffic so the reply is provably
/// unread when the entry shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_cancelled_mid_attempt_is_not_granted_the_lock() {
    use conformance::drill::Proxy;
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let (proxy, proxied) = Proxy::start_for_url(&url).await.unwrap();
    let holder = PgLock::connect_url(&url).await.unwrap();
    let waiter = Arc::new(
        PgLock::connect_url(&url_with(&proxied, "op_timeout=20s&poll_interval=30s"))
            .await
            .unwrap(),
    );
    let key = fresh_key("cancel-mid-attempt");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    proxy.delay(Duration::from_millis(300));
    let waits = spawn_acquire(&waiter, &key, Instant::now() + LONG);
    wait_for_queue(&holder, &key, 1).await;
    waits.abort();
    assert!(holder.release(&lease).await.unwrap());
    let got = holder
        .acquire(&key, LONG, Instant::now() + Duration::from_secs(10))
        .await
        .expect("the lock went to the cancelled waiter");
    assert!(got.fencing_token() > lease.fencing_token());
    assert!(holder.release(&got).await.unwrap());
}

/// A waiter that times out has left the queue when `acquire` returns: run on a runtime of its
/// own that is shut down at once (like a process that exits on the timeout, `distlock run
/// --wait`), it leaves nothing for the background, and the next release does not hand the
/// lock to the gone waiter for its 30 s TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_times_out_has_left_the_queue_when_acquire_returns() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let holder = PgLock::connect_url(&url).await.unwrap();
    let key = fresh_key("timeout-leaves");
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waiter_key = key.clone();
    let err = conformance::run_then_exit(move || async move {
        let waiter = PgLock::connect_url(&url).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(1);
        waiter
            .acquire(&waiter_key, LONG, deadline)
            .await
            .unwrap_err()
    })
    .await;
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    let info = holder.inspect(&key).await.unwrap().unwrap();
    assert_eq!(info.waiters, Some(0), "the waiter is still queued");
    assert!(holder.release(&lease).await.unwrap());
    assert!(holder.inspect(&key).await.unwrap().is_none());
}
