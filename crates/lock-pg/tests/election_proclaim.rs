//! `Leadership::proclaim` on the real server from `DISTLOCK_TEST_PG_URL`: the row's holder
//! identity changes, the grant and its fence do not; a deposed leader's proclaim (an `UPDATE`
//! guarded by name, owner token and fence) changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use lock_core::{DistributedLock, Election, Error};
use lock_pg::{PgLock, PgLockConfig};

const SLACK: Duration = Duration::from_secs(5);

async fn client(label: &str) -> Option<Arc<PgLock>> {
    let url = conformance::backend_url("DISTLOCK_TEST_PG_URL")?;
    let mut config = PgLockConfig::from_url(&url).unwrap();
    config.label = Some(label.to_owned());
    Some(Arc::new(PgLock::connect(config).await.unwrap()))
}

fn fresh(label: &str) -> String {
    format!("{label}-{:016x}", rand::random::<u64>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proclaim_changes_the_value_not_the_term_and_a_deposed_leader_changes_nothing() {
    let Some(a) = client("a").await else { return };
    let b = client("b").await.unwrap();
    let name = fresh("proclaim");
    let ea = Election::with_driver(a.clone(), &name).unwrap();
    let eb = Election::with_driver(b.clone(), &name).unwrap();
    let lead = ea.campaign(SLACK).await.unwrap();
    for value in ["scheduler-2", "scheduler-3"] {
        let shown = lead.proclaim(value).await.unwrap();
        let leader = eb.leader().await.unwrap().expect("a leads");
        assert_eq!(leader.term, Some(lead.term()));
        assert_eq!(leader.holder.as_ref(), Some(&shown));
    }
    // Still the same grant: it renews and resigns as before.
    let mut lease = lead.granted_lease().clone();
    a.renew(&mut lease, Duration::from_secs(10)).await.unwrap();

    assert!(b.force_release(ea.key()).await.unwrap());
    let next = eb.campaign(SLACK).await.unwrap();
    let before = eb.leader().await.unwrap().map(|l| (l.term, l.holder));
    assert!(
        before
            .as_ref()
            .unwrap()
            .1
            .as_ref()
            .unwrap()
            .as_str()
            .ends_with(" label=b")
    );
    let refused = lock_core::raw::relabel(a.as_ref(), lead.granted_lease(), "late").await;
    assert!(matches!(refused, Err(Error::NotHeld { .. })), "{refused:?}");
    let after = eb.leader().await.unwrap().map(|l| (l.term, l.holder));
    assert_eq!(
        after, before,
        "a deposed leader's proclaim changed the leader"
    );
    assert!(!lead.resign().await.unwrap());
    assert!(next.resign().await.unwrap());
}
