//! Regression tests for the outside review of December 2026 (findings S3, S5, S6, L3, L8–L10)
//! against the real server from `DISTLOCK_TEST_PG_URL`, some through the drill proxy.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use conformance::{backend_url, drill::Proxy, fresh_key};
use lock_core::{DistributedLock, Error};
use lock_pg::{PgLock, sqlx};
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

async fn exec(pool: &sqlx::PgPool, sql: String) {
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(pool)
        .await
        .unwrap();
}

/// Waits until `n` backends of `app` sleep in a trigger.
async fn wait_sleeping(pool: &sqlx::PgPool, app: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
             AND wait_event = 'PgSleep'",
        )
        .bind(app)
        .fetch_one(pool)
        .await
        .unwrap();
        if n > 0 {
            return;
        }
        assert!(
            Instant::now() < until,
            "the statement never reached the trigger"
        );
        sleep(Duration::from_millis(10)).await;
    }
}

/// S5: a `force_release` whose connection dies while its statement runs (the statement goes on
/// and commits: the holder removed, the lock granted to the queued waiter) is re-sent on a new
/// connection; the re-sent statement must not remove the waiter's brand-new grant as well. A
/// trigger keeps the operator's statement running long enough to cut its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_release_whose_reply_was_lost_removes_only_the_holder_it_saw() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let sfx = suffix();
    let (table, func, app) = (
        format!("distlock_fr_{sfx}"),
        format!("distlock_fr_slow_{sfx}"),
        format!("distlock_op_{sfx}"),
    );
    let url = url_with(&url, &format!("table={table}"));
    let (proxy, proxied) = Proxy::start_for_url(&url).await.unwrap();
    let operator = PgLock::connect_url(&url_with(
        &proxied,
        &format!("op_timeout=10s&pool_size=1&application_name={app}"),
    ))
    .await
    .unwrap();
    let holder = Arc::new(PgLock::connect_url(&url).await.unwrap());
    let waiter = Arc::new(PgLock::connect_url(&url).await.unwrap());
    let pool = admin(&url).await;
    exec(
        &pool,
        format!(
            "CREATE FUNCTION \"{func}\"() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             IF current_setting('application_name') = '{app}' THEN PERFORM pg_sleep(1.5); \
             END IF; RETURN NULL; END $$"
        ),
    )
    .await;
    exec(
        &pool,
        format!(
            "CREATE TRIGGER slow AFTER UPDATE ON \"{table}\" FOR EACH ROW \
             EXECUTE FUNCTION \"{func}\"()"
        ),
    )
    .await;
    let key = fresh_key("force-retry");

    let x = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    let w = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move { waiter.acquire(&key, LONG, Instant::now() + LONG).await })
    };
    let until = Instant::now() + Duration::from_secs(10);
    while holder.inspect(&key).await.unwrap().and_then(|i| i.waiters) != Some(1) {
        assert!(Instant::now() < until, "the waiter never queued");
        sleep(Duration::from_millis(10)).await;
    }
    let forced = {
        let key = key.clone();
        tokio::spawn(async move { operator.force_release(&key).await })
    };
    // The statement runs (in the trigger): its connection dies, the statement commits anyway.
    wait_sleeping(&pool, &app).await;
    proxy.reset();
    let w = timeout(Duration::from_secs(10), w)
        .await
        .expect("W is granted the lock by the forced statement")
        .unwrap()
        .unwrap();
    assert!(w.fencing_token() > x.fencing_token());
    let removed = timeout(Duration::from_secs(20), forced)
        .await
        .expect("no hang")
        .unwrap();
    println!("force_release returned {removed:?}");
    let now = holder.inspect(&key).await.unwrap();
    assert_eq!(
        now.as_ref().and_then(|i| i.fencing_token),
        w.fencing_token(),
        "the re-sent force_release removed W's grant too: {now:?}"
    );
    assert!(holder.try_acquire(&key, LONG).await.unwrap().is_none());
    assert!(waiter.release(&w).await.unwrap());
    exec(&pool, format!("DROP TABLE \"{table}\"")).await;
    exec(&pool, format!("DROP FUNCTION \"{func}\"()")).await;
}

/// S6: with a session default of `synchronous_commit = off` (as a role or database default
/// gives), every grant, renewal and durable release still commits synchronously. A deferred
/// constraint trigger records the setting each write of the lease table commits with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_commit_durably_whatever_the_session_default() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let sfx = suffix();
    let (table, log, func) = (
        format!("distlock_sync_{sfx}"),
        format!("distlock_sync_log_{sfx}"),
        format!("distlock_sync_fn_{sfx}"),
    );
    let base = url_with(
        &url,
        &format!("table={table}&options[synchronous_commit]=off"),
    );
    // `a` releases durably; `b` keeps the default asynchronous release.
    let a = Arc::new(
        PgLock::connect_url(&url_with(&base, "async_release=false"))
            .await
            .unwrap(),
    );
    let b = PgLock::connect_url(&base).await.unwrap();
    let pool = admin(&url).await;
    exec(
        &pool,
        format!("CREATE TABLE \"{log}\" (kind text NOT NULL, setting text NOT NULL)"),
    )
    .await;
    exec(
        &pool,
        format!(
            "CREATE FUNCTION \"{func}\"() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             INSERT INTO \"{log}\" VALUES (CASE \
                 WHEN TG_OP = 'INSERT' OR NEW.fence <> OLD.fence THEN 'grant' \
                 WHEN NEW.owner IS NULL THEN 'free' \
                 WHEN NEW.expires_at <> OLD.expires_at THEN 'extend' \
                 ELSE 'queue' END, current_setting('synchronous_commit')); \
             RETURN NULL; END $$"
        ),
    )
    .await;
    exec(
        &pool,
        format!(
            "CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT OR UPDATE ON \"{table}\" \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION \"{func}\"()"
        ),
    )
    .await;
    let key = fresh_key("sync-commit");
    // Bare upsert (insert), renewal, durable release.
    let mut lease = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    a.renew(&mut lease, LONG).await.unwrap();
    assert!(a.release(&lease).await.unwrap());
    // A waiter's polled grant (update of a free row).
    let lease = a.acquire(&key, LONG, Instant::now() + LONG).await.unwrap();
    // A direct grant made by b's (asynchronous) release to a's queued waiter.
    assert!(a.release(&lease).await.unwrap());
    let held = b.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waiting = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move { a.acquire(&key, LONG, Instant::now() + LONG).await })
    };
    let until = Instant::now() + Duration::from_secs(10);
    while b.inspect(&key).await.unwrap().and_then(|i| i.waiters) != Some(1) {
        assert!(Instant::now() < until, "the waiter never queued");
        sleep(Duration::from_millis(10)).await;
    }
    assert!(b.release(&held).await.unwrap());
    let granted = waiting.await.unwrap().unwrap();
    // A force release that frees the lock.
    assert!(b.force_release(&key).await.unwrap());
    assert!(a.release(&granted).await.is_ok());

    let rows: Vec<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT kind, setting FROM \"{log}\""
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let grants = rows.iter().filter(|(kind, _)| kind == "grant").count();
    assert!(grants >= 3, "{rows:?}");
    assert!(rows.iter().any(|(kind, _)| kind == "extend"), "{rows:?}");
    for (kind, setting) in &rows {
        if kind != "queue" && !(kind == "free" && setting == "off") {
            assert_ne!(
                setting, "off",
                "a {kind} committed asynchronously: {rows:?}"
            );
        }
    }
    // a's releases (async_release=false) freed the lock durably.
    assert!(
        rows.iter()
            .filter(|(k, s)| k == "free" && s != "off")
            .count()
            >= 2,
        "{rows:?}"
    );
    exec(&pool, format!("DROP TABLE \"{table}\", \"{log}\"")).await;
    exec(&pool, format!("DROP FUNCTION \"{func}\"()")).await;
}

/// S6: an UNLOGGED lease table (emptied by a crash: fences restart) and a temporary one
/// (private to one session: no exclusion) are refused with a configuration error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unlogged_and_temporary_lease_tables_are_refused() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let table = format!("distlock_unlogged_{}", suffix());
    let pool = admin(&url).await;
    exec(
        &pool,
        format!(
            "CREATE UNLOGGED TABLE \"{table}\" (name text PRIMARY KEY, owner text, \
             fence bigint NOT NULL, expires_at timestamptz NOT NULL, \
             waiters text[] NOT NULL DEFAULT '{{}}')"
        ),
    )
    .await;
    let err = PgLock::connect_url(&url_with(&url, &format!("table={table}")))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Config(m) if m.contains("UNLOGGED")),
        "{err}"
    );
    exec(&pool, format!("DROP TABLE \"{table}\"")).await;

    let err = PgLock::connect_url(&url_with(&url, "table=pg_temp.distlock_leases"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    // A temporary table that shadows the name through the search path is refused too.
    let temp = format!("distlock_temp_{}", suffix());
    let shadowed = url_with(
        &url,
        &format!("table={temp}&options[search_path]=pg_temp,public"),
    );
    match PgLock::connect_url(&shadowed).await {
        Err(Error::Config(_)) => {}
        Ok(lock) => {
            // Created as a regular table: it must then be a logged one.
            let (p,): (String,) =
                sqlx::query_as("SELECT relpersistence::text FROM pg_class WHERE relname = $1")
                    .bind(&temp)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            assert_eq!(p, "p");
            drop(lock);
            exec(&pool, format!("DROP TABLE \"{temp}\"")).await;
        }
        Err(e) => panic!("{e}"),
    }
}

/// S3: a grant whose reply arrives after the lease's local deadline (the proxy delays every
/// chunk by more than half the TTL) is never handed out: `try_acquire` answers a temporary
/// error, `acquire` keeps trying until its deadline, and neither returns an expired lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_reply_comes_after_its_local_deadline_is_not_returned() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let (proxy, proxied) = Proxy::start_for_url(&url).await.unwrap();
    let a = PgLock::connect_url(&url_with(&proxied, "pool_size=1&listen=false"))
        .await
        .unwrap();
    let key = fresh_key("late-reply");
    // Prepares the statements on a's one connection.
    let warm = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(a.release(&warm).await.unwrap());
    let warm = a.acquire(&key, LONG, Instant::now() + LONG).await.unwrap();
    assert!(a.release(&warm).await.unwrap());

    proxy.delay(Duration::from_millis(250));
    let ttl = Duration::from_millis(300);
    match timeout(Duration::from_secs(20), a.try_acquire(&key, ttl))
        .await
        .expect("no hang")
    {
        Ok(Some(lease)) => panic!(
            "try_acquire returned a lease {:?} past its local deadline",
            lease.local_deadline().elapsed()
        ),
        Ok(None) => panic!("nobody else holds the key"),
        Err(e) => assert!(
            matches!(e, Error::Unavailable { .. }) && e.is_temporary(),
            "{e}"
        ),
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    match timeout(Duration::from_secs(20), a.acquire(&key, ttl, deadline))
        .await
        .expect("no hang")
    {
        Ok(lease) => panic!(
            "acquire returned a lease {:?} past its local deadline",
            lease.local_deadline().elapsed()
        ),
        Err(e) => assert!(e.is_temporary(), "{e}"),
    }
    proxy.pass();
}

/// L9: an attempt whose statement completed but whose reply cannot be read (here: a fence the
/// driver refuses) still undoes its grant, instead of leaving the key held for its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_reply_cannot_be_read_is_undone() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let a = PgLock::connect_url(&url).await.unwrap();
    let pool = admin(&url).await;
    let key = fresh_key("unreadable-reply");
    sqlx::query(
        "INSERT INTO distlock_leases (name, owner, fence, expires_at) \
         VALUES ($1, NULL, -10, clock_timestamp())",
    )
    .bind(key.as_str())
    .execute(&pool)
    .await
    .unwrap();
    let err = a.try_acquire(&key, LONG).await.unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err}");
    let (owner,): (Option<String>,) =
        sqlx::query_as("SELECT owner FROM distlock_leases WHERE name = $1")
            .bind(key.as_str())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        owner, None,
        "the grant nobody can use holds the key for its TTL"
    );
}

/// L10: an acquire whose statement is stuck on the server (behind another transaction's
/// insert of the row) times out; the first undo finds nothing, and the statement commits its
/// grant later. The undo keeps trying and removes it, long before the grant's 30 s TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_that_commits_after_the_first_undo_is_still_undone() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let a = PgLock::connect_url(&url_with(&url, "op_timeout=500ms"))
        .await
        .unwrap();
    let b = PgLock::connect_url(&url).await.unwrap();
    let pool = admin(&url).await;
    let key = fresh_key("late-commit");
    let warm = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(a.release(&warm).await.unwrap());
    let other = fresh_key("late-commit");
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO distlock_leases (name, owner, fence, expires_at) \
         VALUES ($1, NULL, 1, clock_timestamp())",
    )
    .bind(other.as_str())
    .execute(&mut *tx)
    .await
    .unwrap();
    let err = a.try_acquire(&other, LONG).await.unwrap_err();
    assert!(matches!(err, Error::Indeterminate { .. }), "{err}");
    // The stuck statement goes on and grants as soon as the row is there.
    tx.commit().await.unwrap();
    let got = b
        .acquire(&other, LONG, Instant::now() + Duration::from_secs(8))
        .await
        .expect("the grant that committed after the first undo was never undone");
    assert!(b.release(&got).await.unwrap());
}

/// L3: `acquire(deadline = now + 1 s)` against a server that stopped answering (the proxy
/// blackholes every byte) returns `Timeout` by the deadline plus a small slack — both when the
/// first attempt is stuck and when a queued waiter's leaving is — instead of a whole
/// `timeout` per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_against_a_frozen_server_ends_by_its_deadline() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    // The slack: the leaving of a queued waiter may take 250 ms past the deadline; the rest is
    // room for scheduling on a loaded 2-core machine (measured here: 1.00 s and 1.25 s).
    const SLACK: Duration = Duration::from_millis(1000);
    let (proxy, proxied) = Proxy::start_for_url(&url).await.unwrap();
    let a = Arc::new(PgLock::connect_url(&proxied).await.unwrap());
    let b = PgLock::connect_url(&url).await.unwrap();
    let key = fresh_key("frozen");
    let ttl = Duration::from_secs(2);
    let warm = a.try_acquire(&key, ttl).await.unwrap().unwrap();
    assert!(a.release(&warm).await.unwrap());

    // A stuck attempt.
    proxy.blackhole();
    let start = Instant::now();
    let err = timeout(
        Duration::from_secs(30),
        a.acquire(&key, ttl, start + Duration::from_secs(1)),
    )
    .await
    .expect("no hang")
    .unwrap_err();
    let took = start.elapsed();
    println!("stuck attempt: {err} after {took:?}");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(took < Duration::from_secs(1) + SLACK, "{took:?}");

    // A queued waiter whose server freezes while it waits.
    proxy.pass();
    let held = b.try_acquire(&key, LONG).await.unwrap().unwrap();
    let waiting = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move {
            let start = Instant::now();
            let res = a.acquire(&key, ttl, start + Duration::from_secs(1)).await;
            (res, start.elapsed())
        })
    };
    // Freeze once it is queued (or, on a slow machine, whenever it ends first).
    while b.inspect(&key).await.unwrap().and_then(|i| i.waiters) != Some(1)
        && !waiting.is_finished()
    {
        sleep(Duration::from_millis(10)).await;
    }
    proxy.blackhole();
    let (res, took) = timeout(Duration::from_secs(30), waiting)
        .await
        .expect("no hang")
        .unwrap();
    let err = res.unwrap_err();
    println!("queued waiter: {err} after {took:?}");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(took < Duration::from_secs(1) + SLACK, "{took:?}");
    proxy.reset();
    proxy.pass();
    assert!(b.release(&held).await.unwrap());
}

/// L8 (the scenario of the review's `malformed_entry.sh`, through the driver): entries some other
/// tool wrote into a lock's queue — not parseable, a bigint overflow, a channel `pg_notify`
/// refuses — are skipped and dropped by the next write; release, force release, queueing and
/// inspect keep working on that row, and a release still hands the lock to the real waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_queue_entries_are_skipped_and_dropped() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let holder = PgLock::connect_url(&url).await.unwrap();
    let waiter = Arc::new(PgLock::connect_url(&url).await.unwrap());
    let pool = admin(&url).await;
    let key = fresh_key("malformed-entry");
    let far = "99999999999999"; // ms since the epoch, far in the future
    let foreign = vec![
        "some-tool-wrote-this".to_owned(),
        "x:1 99999999999999999999999".to_owned(),
        format!(":1 {far}"),
        format!("{}:1 {far}", "c".repeat(64)),
        format!("bad-channel:1 {far} 1 1000000 {}", "a".repeat(32)),
        format!("x:1 {far} 1 99999999999999999 {}", "a".repeat(32)),
        // One past each bound (the patterns are unbounded; `length` checks bound the fields).
        format!("x:{} {far}", "1".repeat(21)),
        format!("x:1 1{far}{far}"),
        format!("x:1 {far} {} 1000000 {}", "1".repeat(20), "a".repeat(32)),
        format!(
            "x:1 {far} 1 1000000 {} {}",
            "a".repeat(32),
            "41".repeat(201)
        ),
        format!("x:1 {far} 1 1000000 {} 4", "a".repeat(32)),
    ];
    let set_foreign = || {
        sqlx::query("UPDATE distlock_leases SET waiters = $2 || waiters WHERE name = $1")
            .bind(key.as_str())
            .bind(foreign.clone())
    };

    // The holder releases and the operator force-releases a row with foreign entries.
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    set_foreign().execute(&pool).await.unwrap();
    let info = holder.inspect(&key).await.unwrap().expect("held");
    assert_eq!(info.waiters, Some(0), "foreign entries are no waiters");
    assert!(holder.release(&lease).await.unwrap());
    let forced = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    set_foreign().execute(&pool).await.unwrap();
    assert!(holder.force_release(&key).await.unwrap());
    assert!(!holder.release(&forced).await.unwrap());

    // A waiter queues behind them and is granted the lock by the release.
    let lease = holder.try_acquire(&key, LONG).await.unwrap().unwrap();
    set_foreign().execute(&pool).await.unwrap();
    let waits = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move { waiter.acquire(&key, LONG, Instant::now() + LONG).await })
    };
    let until = Instant::now() + Duration::from_secs(10);
    while holder.inspect(&key).await.unwrap().and_then(|i| i.waiters) != Some(1) {
        assert!(Instant::now() < until, "the waiter never queued");
        sleep(Duration::from_millis(10)).await;
    }
    assert!(holder.release(&lease).await.unwrap());
    let got = timeout(Duration::from_secs(10), waits)
        .await
        .expect("the release handed the lock to the waiter")
        .unwrap()
        .unwrap();
    assert_eq!(
        holder
            .inspect(&key)
            .await
            .unwrap()
            .and_then(|i| i.fencing_token),
        got.fencing_token()
    );
    let (waiters,): (Vec<String>,) =
        sqlx::query_as("SELECT waiters FROM distlock_leases WHERE name = $1")
            .bind(key.as_str())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        waiters.iter().all(|w| !foreign.contains(w)),
        "foreign entries are dropped by the next write: {waiters:?}"
    );
    assert!(waiter.release(&got).await.unwrap());
}

/// The issue-18 drill on PostgreSQL: the server is unreachable (every byte held by the proxy,
/// as a frozen server's kernel would hold it) for 3 × TTL while 8 clients `acquire` with a 1 s
/// deadline. Every acquire returns by its deadline plus the slack; after the heal the held
/// statements reach the server and may grant, yet once a TTL has passed nothing is held or
/// queued and the next acquire succeeds at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_waiters_against_a_frozen_server_end_in_time_and_leave_nothing() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    // As in acquire_against_a_frozen_server_ends_by_its_deadline, plus 8 clients on 2 cores.
    const SLACK: Duration = Duration::from_millis(1000);
    let ttl = Duration::from_secs(1);
    let (proxy, proxied) = Proxy::start_for_url(&url).await.unwrap();
    let observer = PgLock::connect_url(&url).await.unwrap();
    let key = fresh_key("frozen-drill");
    let mut clients = Vec::new();
    for _ in 0..8 {
        let c = Arc::new(PgLock::connect_url(&proxied).await.unwrap());
        let warm = c.try_acquire(&key, ttl).await.unwrap().unwrap();
        assert!(c.release(&warm).await.unwrap());
        clients.push(c);
    }
    let held = clients[0].try_acquire(&key, ttl).await.unwrap().unwrap();

    proxy.blackhole();
    let frozen_at = Instant::now();
    let waits: Vec<_> = clients
        .iter()
        .map(|c| {
            let (c, key) = (c.clone(), key.clone());
            tokio::spawn(async move {
                let start = Instant::now();
                let res = c.acquire(&key, ttl, start + Duration::from_secs(1)).await;
                (res.map(|l| l.fencing_token()), start.elapsed())
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for w in waits {
        let (res, took) = timeout(Duration::from_secs(30), w)
            .await
            .expect("no hang")
            .unwrap();
        assert!(
            matches!(res, Err(Error::Timeout { .. })),
            "nobody can be granted a lock by a frozen server: {res:?}"
        );
        slowest = slowest.max(took);
    }
    println!("slowest acquire against the frozen server: {slowest:?}");
    assert!(slowest < Duration::from_secs(1) + SLACK, "{slowest:?}");
    // Frozen for 3 × TTL, then everything held is delivered.
    sleep((frozen_at + 3 * ttl).saturating_duration_since(Instant::now())).await;
    proxy.pass();
    drop(held);
    sleep(ttl + Duration::from_millis(300)).await;
    let info = observer.inspect(&key).await.unwrap();
    assert!(info.is_none(), "still held a TTL after the heal: {info:?}");
    let got = observer
        .try_acquire(&key, LONG)
        .await
        .unwrap()
        .expect("the next acquire succeeds at once");
    let info = observer.inspect(&key).await.unwrap().unwrap();
    assert_eq!(info.waiters, Some(0), "entries left in the queue");
    assert!(observer.release(&got).await.unwrap());
}

/// L10: an acquire whose reply was lost, dropped by its caller while it is still undoing the
/// possible grant (the server unreachable for the undo too), leaves the undo to the
/// background, which removes the grant once the server answers again — long before its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_during_its_undo_still_undoes_its_grant() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let (proxy, proxied) = Proxy::start_for_url(&url).await.unwrap();
    let a = PgLock::connect_url(&url_with(
        &proxied,
        "op_timeout=500ms&connect_timeout=2&pool_size=1",
    ))
    .await
    .unwrap();
    let b = PgLock::connect_url(&url).await.unwrap();
    let key = fresh_key("dropped-undo");
    // Prepares the acquire statement on a's one connection.
    let warm = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(a.release(&warm).await.unwrap());

    proxy.drop_replies();
    // The statement applies, its reply is lost; the undo then waits for a connection whose
    // replies are lost too, and the caller gives up on it.
    let dropped = timeout(Duration::from_millis(1200), a.try_acquire(&key, LONG)).await;
    assert!(
        dropped.is_err(),
        "expected the caller to drop it: {dropped:?}"
    );
    let info = b.inspect(&key).await.unwrap();
    assert!(info.is_some(), "the lost grant applied");
    proxy.pass();
    let got = b
        .acquire(&key, LONG, Instant::now() + Duration::from_secs(8))
        .await
        .expect("the grant of the dropped acquire was never undone");
    assert!(b.release(&got).await.unwrap());
}
