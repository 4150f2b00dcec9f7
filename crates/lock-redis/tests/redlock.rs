//! Redlock drills on three private masters (`support::Masters`): fencing is refused before any
//! I/O, one master down still works, two down is `Unavailable`, and a master restarted without
//! persistence while a lock is held gives the lock to a second client — the double grant
//! Redlock's analysis predicts (Kleppmann, "How to do distributed locking"), measured here.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

use std::time::Duration;

use conformance::{
    backend_url,
    drill::{CheckOptions, History, Hold, Rule, check},
    fresh_key,
};
use lock_core::{DistributedLock, DistributedLockExt, Error, FencingGuarantee};
use lock_redis::{RedlockConfig, RedlockLock};
use support::Masters;
use tokio::time::Instant;

const FAST: &str =
    "namespace=redlock-drill:&connect_timeout=200ms&response_timeout=300ms&reconnect_retries=0";
const TTL: Duration = Duration::from_secs(30);

async fn masters() -> Option<Masters> {
    backend_url("DISTLOCK_TEST_REDIS_URL")?;
    Some(tokio::task::spawn_blocking(Masters::start).await.unwrap())
}

#[tokio::test]
async fn redlock_refuses_fencing_before_any_io() {
    // Nothing listens there: any I/O would fail with Unavailable, not Unsupported.
    let config = RedlockConfig::from_url("redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3").unwrap();
    let lock = std::sync::Arc::new(RedlockLock::connect_lazy(config).unwrap());
    assert_eq!(lock.capabilities().fencing, FencingGuarantee::None);
    let started = Instant::now();
    let err = lock
        .lock("redlock/fenced")
        .require_fencing(FencingGuarantee::SingleNode)
        .try_acquire()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "no I/O was tried"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_works_with_one_of_three_masters_down_and_is_unavailable_with_two() {
    let Some(mut masters) = masters().await else {
        return;
    };
    let lock = RedlockLock::connect_url(&masters.url(FAST)).await.unwrap();
    let key = fresh_key("redlock-down");
    masters.nodes[0].kill();
    let mut lease = lock
        .try_acquire(&key, TTL)
        .await
        .unwrap()
        .expect("2 of 3 grant");
    lock.renew(&mut lease, TTL).await.unwrap();
    assert!(lock.inspect(&key).await.unwrap().is_some());
    let other = RedlockLock::connect_url(&masters.url(FAST)).await.unwrap();
    assert!(
        other.try_acquire(&key, TTL).await.unwrap().is_none(),
        "held on a majority"
    );
    assert!(lock.release(&lease).await.unwrap());

    masters.nodes[1].kill();
    let err = lock.try_acquire(&key, TTL).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
    assert!(err.is_temporary());
    // A lease held on two masters cannot be renewed once one of them is gone.
    masters.nodes[0].start();
    masters.nodes[1].start();
    let mut lease = settle(&lock, &key).await;
    masters.nodes[2].kill();
    masters.nodes[1].kill();
    let err = lock.renew(&mut lease, TTL).await.unwrap_err();
    assert!(
        matches!(err, Error::Unavailable { .. } | Error::Indeterminate { .. }),
        "{err}"
    );
}

/// Acquires once every master answers again after a restart.
async fn settle(lock: &RedlockLock, key: &lock_core::LockKey) -> lock_core::Lease {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        match lock.try_acquire(key, TTL).await {
            Ok(Some(lease)) => return lease,
            other => {
                assert!(
                    Instant::now() < until,
                    "no grant after the restart: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// a holds the lock on masters 1 and 2 (master 3 is down when it acquires). Master 2 restarts
/// without persistence (the key is gone) and master 3 comes back: b gets masters 2 and 3, a
/// majority, while a's lease is still valid. Redlock cannot prevent this, and with no fencing
/// token the resource cannot tell the two holders apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_redlock_master_restarted_without_persistence_mid_hold_double_grant() {
    let Some(mut masters) = masters().await else {
        return;
    };
    let url = masters.url(FAST);
    let a = RedlockLock::connect_url(&url).await.unwrap();
    let b = RedlockLock::connect_url(&url).await.unwrap();
    let history = History::new("redlock_restart_without_persistence");
    let (ra, rb) = (history.client("a"), history.client("b"));
    let key = fresh_key("redlock-restart");

    masters.nodes[2].kill();
    let op = ra.acquire(&key, TTL);
    let lease_a = a
        .try_acquire(&key, TTL)
        .await
        .unwrap()
        .expect("masters 1 and 2 grant");
    op.granted(&lease_a);
    let fault = history.fault("master 2 restarted empty, master 3 back", Some("redis"));
    masters.nodes[1].kill();
    masters.nodes[1].start();
    masters.nodes[2].start();
    fault.heal();
    let op = rb.acquire(&key, TTL);
    let until = Instant::now() + Duration::from_secs(10);
    let lease_b = loop {
        match b.try_acquire(&key, TTL).await {
            Ok(Some(lease)) => break lease,
            // Refused while a restarted master is not back yet (its silence may hide a's
            // share): asked again until the masters are all up, then the double grant shows.
            Ok(None) if Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(None) => panic!("b was refused: no double grant (update the README's table)"),
            Err(e) => {
                assert!(e.is_temporary() && Instant::now() < until, "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    op.granted(&lease_b);
    let double = lease_a.is_locally_valid() && lease_b.is_locally_valid();
    assert!(
        double,
        "both leases valid at once: the predicted double grant"
    );
    // a's renewal still finds a majority? Master 1 has a's key, masters 2 and 3 have b's.
    let mut renewing = lease_a.clone();
    let op = ra.renew(Hold::from(&lease_a), TTL);
    // (a's first request to the restarted master may meet the dead connection: retried.)
    let until = Instant::now() + Duration::from_secs(10);
    let renewed = loop {
        match a.renew(&mut renewing, TTL).await {
            Err(e) if e.is_temporary() && Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other,
        }
    };
    match &renewed {
        Ok(()) => op.ok(),
        Err(e) => op.error(e),
    }
    assert!(matches!(renewed, Err(Error::NotHeld { .. })), "{renewed:?}");
    ra.lost(Hold::from(&lease_a), "renewal refused by a majority");
    let op = rb.release(Hold::from(&lease_b));
    assert!(b.release(&lease_b).await.unwrap());
    op.released(true);
    history.note(
        "a held masters 1+2; master 2 restarted empty; b got masters 2+3 while a's lease was valid",
    );
    eprintln!(
        "redlock: master restarted without persistence mid-hold: second grant while the first lease \
         was valid: {double} (a learned it at its next renewal: NotHeld)"
    );
    let violations = check(&history.snapshot(), &CheckOptions::default());
    let files = history.save(&violations).unwrap();
    assert!(
        violations.iter().any(|v| v.rule == Rule::DoubleGrant),
        "the checker must see the double grant: {}",
        files.svg.display()
    );
    let unexpected: Vec<_> = violations
        .iter()
        .filter(|v| !matches!(v.rule, Rule::DoubleGrant | Rule::NotLinearizable))
        .collect();
    assert!(
        unexpected.is_empty(),
        "see {}: {unexpected:#?}",
        files.svg.display()
    );
}

/// A master's own connection, for reading what the drill left there.
async fn admin(server: &support::Server) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://{}", server.addr()))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn get(admin: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query_async(admin).await.unwrap()
}

/// Resumes the frozen master however the drill ends (a failed assertion included), so the
/// topology's drop can kill it.
struct Thaw<'a>(&'a support::Server);

impl Drop for Thaw<'_> {
    fn drop(&mut self) {
        if self.0.pid().is_some() {
            self.0.resume();
        }
    }
}

/// One of three masters frozen (`SIGSTOP`: its port still accepts connections, nothing is ever
/// answered). With the default timeouts, every call is decided by the two live masters: a TTL of
/// 1 s (and 3 s) is granted within the goal (2 × the slowest live round trip + the per-master
/// timeout), `acquire` returns within its deadline, renew and release within the request
/// budget; a client built while the master is frozen works too. A refused attempt returns
/// without waiting for its undo, and the undo still reaches the frozen master once it is
/// thawed: the late `SET` it had buffered leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_redlock_one_of_three_masters_frozen() {
    let Some(masters) = masters().await else {
        return;
    };
    let url = masters.url("namespace=redlock-frozen:");
    let lock = RedlockLock::connect_url(&url).await.unwrap();
    let budget = Duration::from_secs(1); // the default `timeout`: the per-master timeout
    let key = fresh_key("redlock-frozen");
    // Every connection is up before the freeze (a grant and its release on all three).
    let lease = lock.try_acquire(&key, TTL).await.unwrap().unwrap();
    assert!(lock.release(&lease).await.unwrap());
    let frozen = &masters.nodes[0];
    let mut live = [
        admin(&masters.nodes[1]).await,
        admin(&masters.nodes[2]).await,
    ];
    let mut frozen_admin = admin(frozen).await;
    frozen.pause();
    let _thaw = Thaw(frozen);
    let rtt = {
        let started = Instant::now();
        for c in &mut live {
            redis::cmd("PING").query_async::<()>(c).await.unwrap();
        }
        started.elapsed()
    };
    let goal = rtt * 2 + budget;
    let mut report = Vec::new();

    for ttl in [Duration::from_secs(1), Duration::from_secs(3)] {
        let started = Instant::now();
        let got = lock.try_acquire(&key, ttl).await;
        let took = started.elapsed();
        report.push(format!("try_acquire(ttl {ttl:?}): {took:?}"));
        let mut lease = got
            .unwrap_or_else(|e| panic!("ttl {ttl:?}: {e} after {took:?}"))
            .unwrap_or_else(|| panic!("ttl {ttl:?}: refused after {took:?}"));
        assert!(
            took < goal,
            "ttl {ttl:?}: granted after {took:?} (goal {goal:?})"
        );
        assert!(lease.is_locally_valid());

        let started = Instant::now();
        lock.renew(&mut lease, ttl).await.unwrap();
        let took = started.elapsed();
        report.push(format!("renew(ttl {ttl:?}): {took:?}"));
        assert!(took < goal, "renewed after {took:?} (goal {goal:?})");

        let started = Instant::now();
        assert!(lock.release(&lease).await.unwrap());
        let took = started.elapsed();
        report.push(format!("release: {took:?}"));
        assert!(took < goal, "released after {took:?} (goal {goal:?})");
    }

    // acquire with a 1 s deadline: a free key at once, a held one refused by the deadline.
    let deadline = Duration::from_secs(1);
    let started = Instant::now();
    let lease = lock
        .acquire(&key, Duration::from_secs(1), Instant::now() + deadline)
        .await
        .unwrap();
    let took = started.elapsed();
    report.push(format!("acquire(free, deadline 1s): {took:?}"));
    assert!(took < deadline, "acquire took {took:?}");
    assert!(lock.release(&lease).await.unwrap());
    let lease = lock.try_acquire(&key, TTL).await.unwrap().unwrap();
    let other = RedlockLock::connect_url(&url).await.unwrap();
    let started = Instant::now();
    let err = other
        .acquire(&key, Duration::from_secs(1), Instant::now() + deadline)
        .await
        .unwrap_err();
    let took = started.elapsed();
    report.push(format!("acquire(held, deadline 1s): {took:?} ({err})"));
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(
        took < deadline + Duration::from_millis(300),
        "acquire outlived its deadline: {took:?}"
    );
    assert!(lock.release(&lease).await.unwrap());

    // A client built while the master is frozen (its connection there never completes).
    let started = Instant::now();
    let fresh = RedlockLock::connect_url(&url).await.unwrap();
    let lease = fresh
        .try_acquire(&key, Duration::from_secs(1))
        .await
        .unwrap()
        .expect("the two live masters grant");
    let took = started.elapsed();
    report.push(format!("connect + try_acquire by a new client: {took:?}"));
    assert!(took < goal * 2, "a new client took {took:?}");
    assert!(fresh.release(&lease).await.unwrap());

    // A refused attempt: one live master is held by someone else, the other grants, the frozen
    // one never answers. The refusal comes within the validity time, without waiting for the
    // undo; the undo deletes the live grant in the background.
    let name = lock.redis_key(&key);
    let foreign = "someone-else";
    redis::cmd("SET")
        .arg(&name)
        .arg(foreign)
        .arg("PX")
        .arg(60_000)
        .query_async::<()>(&mut live[0])
        .await
        .unwrap();
    let ttl = Duration::from_secs(1);
    let started = Instant::now();
    let refused = lock.try_acquire(&key, ttl).await;
    let took = started.elapsed();
    report.push(format!(
        "try_acquire(one live master held): {took:?} ({refused:?})"
    ));
    assert!(
        matches!(refused, Ok(None) | Err(Error::Unavailable { .. })),
        "{refused:?}"
    );
    assert!(took < ttl + budget, "refused after {took:?}");
    let until = Instant::now() + Duration::from_secs(5);
    while get(&mut live[1], &name).await.is_some() {
        assert!(
            Instant::now() < until,
            "the undo did not reach the live master"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(get(&mut live[0], &name).await.as_deref(), Some(foreign));

    // Thawed, the frozen master runs what it had buffered (the late SETs among it); the undo
    // still in the background reaches it, and nothing of ours is left there.
    frozen.resume();
    assert!(
        lock_core::raw::cleanup::finish(Duration::from_secs(30)).await,
        "the undo did not finish"
    );
    let left = get(&mut frozen_admin, &name).await;
    assert!(left.is_none(), "left on the thawed master: {left:?}");
    eprintln!(
        "redlock, one of three masters frozen: {}",
        report.join("; ")
    );
}
