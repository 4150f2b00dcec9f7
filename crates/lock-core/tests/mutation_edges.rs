//! Exact values of lock-core's small building blocks (fenced register, lease arithmetic, holder
//! identities), written for the mutants `scripts/mutants.sh core` found surviving: each test
//! names the behaviour a surviving mutant changed.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::time::Duration;

use lock_core::{
    FencedRegister, FencingToken, HolderIdentity, Lease, LockKey, LossReason, OwnershipToken,
    drift_margin,
};
use tokio::time::{Instant, advance};

#[test]
fn the_register_reports_the_highest_accepted_token_and_its_counts() {
    let r = FencedRegister::new();
    assert_eq!(r.highest_token(), None);
    assert_eq!((r.accepted(), r.rejected()), (0, 0));
    r.write(FencingToken(5), 'a').unwrap();
    assert_eq!(r.highest_token(), Some(FencingToken(5)));
    // A rejected write leaves the highest token alone.
    assert!(r.write(FencingToken(3), 'b').is_err());
    assert_eq!(r.highest_token(), Some(FencingToken(5)));
    r.write(FencingToken(9), 'c').unwrap();
    assert_eq!(r.highest_token(), Some(FencingToken(9)));
    assert_eq!((r.accepted(), r.rejected()), (2, 1));
    let debug = format!("{r:?}");
    assert!(debug.contains("accepted: 2"), "{debug}");
    assert!(debug.contains("rejected: 1"), "{debug}");
}

#[test]
fn the_drift_margin_is_one_percent_plus_5ms_and_at_most_half_the_ttl() {
    assert_eq!(
        drift_margin(Duration::from_secs(1)),
        Duration::from_millis(15)
    );
    assert_eq!(
        drift_margin(Duration::from_secs(30)),
        Duration::from_millis(305)
    );
    // Half the TTL caps it for tiny TTLs.
    assert_eq!(
        drift_margin(Duration::from_millis(6)),
        Duration::from_millis(3)
    );
    assert_eq!(
        drift_margin(Duration::from_millis(10)),
        Duration::from_millis(5)
    );
}

#[tokio::test(start_paused = true)]
async fn a_lease_trusts_exactly_ttl_minus_margin_from_its_send_time() {
    let key = LockKey::new("mutation/lease").unwrap();
    let token = OwnershipToken::generate();
    let ttl = Duration::from_secs(1);
    let sent = Instant::now();
    let lease = Lease::new(key.clone(), token, Some(FencingToken(4)), ttl, sent);
    assert_eq!(lease.key(), &key);
    assert_eq!(*lease.token(), token);
    assert_eq!(lease.fencing_token(), Some(FencingToken(4)));
    assert_eq!(lease.ttl(), ttl);
    assert_eq!(lease.acquired_at(), sent);
    assert_eq!(lease.local_deadline(), sent + Duration::from_millis(985));
    assert_eq!(lease.remaining(), Duration::from_millis(985));
    assert!(lease.is_locally_valid());

    advance(Duration::from_millis(984)).await;
    assert_eq!(lease.remaining(), Duration::from_millis(1));
    assert!(lease.is_locally_valid());
    advance(Duration::from_millis(1)).await;
    // At the deadline itself the lease is no longer trusted.
    assert_eq!(lease.remaining(), Duration::ZERO);
    assert!(!lease.is_locally_valid());
    advance(Duration::from_secs(5)).await;
    assert_eq!(lease.remaining(), Duration::ZERO);

    // A renewal moves the deadline to its own send time and keeps the rest.
    let mut renewed = lease.clone();
    let resent = Instant::now();
    renewed.renewed(Duration::from_secs(2), resent);
    assert_eq!(renewed.ttl(), Duration::from_secs(2));
    assert_eq!(
        renewed.local_deadline(),
        resent + Duration::from_secs(2) - Duration::from_millis(25)
    );
    assert_eq!(renewed.acquired_at(), sent);
    assert_eq!(renewed.fencing_token(), Some(FencingToken(4)));
    assert!(renewed.is_locally_valid());
}

#[tokio::test(start_paused = true)]
async fn a_lease_carries_its_backend_state_by_type() {
    let key = LockKey::new("mutation/state").unwrap();
    let token = OwnershipToken::generate();
    let lease = Lease::new(key, token, None, Duration::from_secs(3), Instant::now());
    assert!(lease.backend_state::<u32>().is_none());
    let lease = lease.with_backend_state(7_u32);
    assert_eq!(lease.backend_state::<u32>(), Some(&7));
    assert!(lease.backend_state::<String>().is_none());
    let debug = format!("{lease:?}");
    assert!(debug.contains("mutation/state"), "{debug}");
    assert!(debug.contains("remaining"), "{debug}");
    assert!(debug.contains("fencing: None"), "{debug}");
    assert!(debug.contains("ttl: 3s"), "{debug}");
}

#[test]
fn holder_labels_are_checked_at_their_limits() {
    let max = "a".repeat(HolderIdentity::MAX_LABEL_LEN);
    assert!(HolderIdentity::check_label(&max).is_ok());
    assert!(HolderIdentity::check_label(&format!("{max}a")).is_err());
    for ok in ["a", "Z9", "-", "_", ".", ":", "/", "@"] {
        assert!(HolderIdentity::check_label(ok).is_ok(), "{ok:?}");
    }
    for bad in ["", " ", "a b", "a\tb", "a,b", "a=b", "ä"] {
        assert!(HolderIdentity::check_label(bad).is_err(), "{bad:?}");
    }
    let id = HolderIdentity::process(Some(&max)).unwrap();
    assert!(id.as_str().ends_with(&format!(" label={max}")), "{id}");
    assert!(
        HolderIdentity::process(None)
            .unwrap()
            .as_str()
            .starts_with("host=")
    );
}

#[test]
fn stored_identities_are_trimmed_and_shown_as_stored() {
    let id = HolderIdentity::from_stored(b"  host=a pid=1  ").unwrap();
    assert_eq!(id.as_str(), "host=a pid=1");
    assert_eq!(id.to_string(), "host=a pid=1");
    assert_eq!(format!("{id:?}"), "HolderIdentity(\"host=a pid=1\")");
    assert!(HolderIdentity::from_stored(b"   ").is_none());
    assert!(HolderIdentity::from_stored(b"").is_none());
    assert_eq!(
        HolderIdentity::from_stored(b"x\x00y").unwrap().as_str(),
        "xy"
    );
}

#[test]
fn the_process_identity_names_this_host() {
    let Ok(host) = std::fs::read_to_string("/proc/sys/kernel/hostname") else {
        return;
    };
    let host: String = host
        .trim()
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(64)
        .collect();
    if host.is_empty() {
        return;
    }
    let id = HolderIdentity::process(None).unwrap();
    assert!(id.as_str().starts_with(&format!("host={host} ")), "{id}");
}

#[tokio::test]
async fn a_labelled_memory_client_records_its_label_with_its_grants() {
    use lock_core::{DistributedLock, InMemoryLock};
    let coordinator = InMemoryLock::new();
    let client = coordinator.client().with_label("nightly-report").unwrap();
    let key = LockKey::new("mutation/label").unwrap();
    let lease = client
        .try_acquire(&key, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("free");
    let info = coordinator
        .client()
        .inspect(&key)
        .await
        .unwrap()
        .expect("held");
    assert_eq!(info.fencing_token, lease.fencing_token());
    let holder = info.holder.expect("the grant's identity");
    assert!(
        holder.as_str().ends_with(" label=nightly-report"),
        "{holder}"
    );
    assert!(coordinator.client().with_label("has space").is_err());
    assert!(client.release(&lease).await.unwrap());
}

/// A waiter that gives up leaves the queue and only itself: the waiter behind it is still
/// handed the lock at the release (not at the holder's TTL or its own deadline).
#[tokio::test(start_paused = true)]
async fn a_waiter_that_gives_up_removes_only_itself_from_the_queue() {
    use lock_core::{DistributedLock, InMemoryLock};
    let coordinator = InMemoryLock::new();
    let (holder, w1, w2) = (
        coordinator.client(),
        coordinator.client(),
        coordinator.client(),
    );
    let key = LockKey::new("mutation/queue").unwrap();
    let long = Duration::from_secs(30);
    let held = holder.try_acquire(&key, long).await.unwrap().expect("free");
    let second = tokio::spawn({
        let key = key.clone();
        async move {
            w2.acquire(&key, long, Instant::now() + Duration::from_secs(20))
                .await
        }
    });
    tokio::task::yield_now().await;
    // w1 queues behind w2 and gives up after 1 s.
    let gave_up = w1
        .acquire(&key, long, Instant::now() + Duration::from_secs(1))
        .await;
    assert!(gave_up.is_err(), "{gave_up:?}");
    let waiters = coordinator
        .client()
        .inspect(&key)
        .await
        .unwrap()
        .unwrap()
        .waiters;
    assert_eq!(waiters, Some(1), "only w2 is still queued");
    assert!(holder.release(&held).await.unwrap());
    let granted = tokio::time::timeout(Duration::from_secs(2), second)
        .await
        .expect("w2 is handed the lock at the release")
        .unwrap()
        .expect("w2's acquire");
    assert!(granted.fencing_token() > held.fencing_token());
}

#[test]
fn the_memory_clients_debug_says_whether_it_is_offline() {
    let client = lock_core::InMemoryLock::new();
    assert!(format!("{client:?}").starts_with("InMemoryLock"));
    assert!(format!("{client:?}").contains("offline: false"));
    client.set_offline(true);
    assert!(format!("{client:?}").contains("offline: true"));
}

#[test]
fn the_memory_coordinator_advertises_a_1ms_minimum_ttl() {
    use lock_core::{DistributedLock, FencingGuarantee, InMemoryLock};
    let caps = InMemoryLock::new().capabilities();
    assert_eq!(caps.min_ttl, Duration::from_millis(1));
    assert_eq!(caps.fencing, FencingGuarantee::Quorum);
    assert!(caps.renew && caps.wait_notify && caps.fair_queue && caps.force_release);
}

/// The "lock ownership lost" warning names its reason in words: one text per reason.
#[test]
fn each_loss_reason_reads_as_its_own_words() {
    let shown: Vec<String> = [
        LossReason::NotHeld,
        LossReason::DeadlinePassed,
        LossReason::Revoked,
        LossReason::SessionExpired,
        LossReason::RenewFailed,
        LossReason::HeldTooLong,
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    assert_eq!(
        shown,
        [
            "renewal refused: not held",
            "local deadline passed without renewal",
            "revoked by the coordinator",
            "session expired",
            "renewal failed",
            "held for its at_most limit",
        ]
    );
}
