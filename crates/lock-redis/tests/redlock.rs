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
