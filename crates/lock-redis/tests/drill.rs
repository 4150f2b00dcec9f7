//! Network fault drills through the conformance suite's TCP proxy, between one client and the
//! shared Redis: a partitioned holder stops trusting its lease before anyone else is granted,
//! and a grant whose reply is lost is reported `Indeterminate` and removed.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use conformance::{backend_url, drill::Proxy, fresh_key};
use lock_core::{DistributedLock, DistributedLockExt, Error, LossReason};
use lock_redis::RedisLock;
use tokio::time::{Instant, sleep, timeout};

const LONG: Duration = Duration::from_secs(30);
const FAST: &str = "response_timeout=200ms&connect_timeout=200ms&reconnect_retries=0";

async fn proxied_client(url: &str) -> (Proxy, Arc<RedisLock>) {
    let (proxy, proxied) = Proxy::start_for_url(url).await.unwrap();
    let sep = if proxied.contains('?') { '&' } else { '?' };
    let lock = RedisLock::connect_url(&format!("{proxied}{sep}{FAST}"))
        .await
        .unwrap();
    (proxy, Arc::new(lock))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_holder_stops_trusting_its_lease_before_anyone_else_is_granted() {
    let Some(url) = backend_url("DISTLOCK_TEST_REDIS_URL") else {
        return;
    };
    let (proxy, a) = proxied_client(&url).await;
    let b = Arc::new(RedisLock::connect_url(&url).await.unwrap());
    let key = fresh_key("partition");
    let ttl = Duration::from_secs(1);
    let guard = a.lock(&key).ttl(ttl).try_acquire().await.unwrap().unwrap();
    proxy.blackhole();
    // Whether the holder still trusted its lease is judged when the contender's acquire returns
    // (audit F5: a timestamp taken after awaiting `lost()` left a margin of the drift margin):
    // the lost token, or the local deadline, which only moves forward, so its final value bounds
    // every earlier one.
    let a_lost = guard.lost_token();
    let contender = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move {
            let lease = b.acquire(&key, LONG, Instant::now() + LONG).await;
            (Instant::now(), a_lost.is_cancelled(), lease)
        })
    };
    timeout(ttl + Duration::from_secs(5), guard.lost())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "lost() while partitioned: renewals {} lost {} reason {:?} connections {}",
                guard.renewals(),
                guard.is_lost(),
                guard.loss_reason(),
                proxy.connections()
            )
        });
    assert_eq!(guard.loss_reason(), Some(LossReason::DeadlinePassed));
    let (granted_at, lost_before_grant, lease) = contender.await.unwrap();
    let lease = lease.unwrap();
    assert!(
        lost_before_grant || guard.local_deadline() <= granted_at,
        "the partitioned holder still trusted its lease when the contender got it"
    );
    // Heal: the partitioned client's stale release is refused, and it recovers by itself.
    proxy.pass();
    assert!(
        !guard.release().await.unwrap_or(false),
        "a stale release removed the new holder"
    );
    assert!(b.inspect(&key).await.unwrap().is_some());
    assert!(b.release(&lease).await.unwrap());
    let until = Instant::now() + Duration::from_secs(10);
    let again = loop {
        match a.try_acquire(&key, LONG).await {
            Ok(Some(lease)) => break lease,
            Ok(None) => panic!("nobody should hold the key"),
            Err(e) => {
                assert!(e.is_temporary(), "{e}");
                assert!(Instant::now() < until, "the client did not recover: {e}");
                sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert!(a.release(&again).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_reply_is_lost_is_indeterminate_and_removed() {
    let Some(url) = backend_url("DISTLOCK_TEST_REDIS_URL") else {
        return;
    };
    let (proxy, a) = proxied_client(&url).await;
    let b = Arc::new(RedisLock::connect_url(&url).await.unwrap());
    let key = fresh_key("lost-reply");
    // Load the scripts through the proxy first, so the attempt below really applies.
    let warm = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(a.release(&warm).await.unwrap());
    let fence_before = warm.fencing_token().unwrap();

    proxy.drop_replies();
    let err = a.try_acquire(&key, LONG).await.unwrap_err();
    assert!(matches!(err, Error::Indeterminate { .. }), "{err}");
    proxy.pass();

    // The grant did apply (its fence was minted), yet the key frees up long before its ttl.
    let start = Instant::now();
    let lease = b
        .acquire(&key, LONG, Instant::now() + Duration::from_secs(10))
        .await
        .expect("the lost grant was left behind");
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(
        lease.fencing_token().unwrap().get() >= fence_before.get() + 2,
        "the lost grant did not happen, the drill proves nothing"
    );
    assert!(b.release(&lease).await.unwrap());
}
