//! Election drill on every backend (`memory://` and the shared single-node servers, through
//! `distlock::connect`): **a partitioned leader learns it is deposed before anyone else leads.**
//!
//! Leader `a` campaigns through its own fault link and writes with its term; then its link is
//! blackholed (no renewal reaches the coordinator, no reply comes back), and `b` campaigns. The
//! drill records when `a`'s `lost()` fired and when `b` was elected, both on this process's
//! monotonic clock: `a` must have stopped trusting its leadership first (its local deadline is
//! never later than the moment the coordinator could elect someone else), `b`'s term is greater,
//! and once `b` wrote, a late write with `a`'s term is refused; healed, `a` leads again with a
//! newer term still. The history (campaigns as grants,
//! the loss, the writes) is checked like every drill's and kept with its timeline under
//! `target/drill-histories/<backend>_election_partitioned_leader.{json,svg}`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use conformance::drill::{Fault, History, Hold};
use drill_support::{FencedLog, SOON, TTL, finish, linked_client, write};
use lock_core::Election;
use tokio::time::{Instant, timeout};

async fn partitioned_leader(backend: &str, url: String) {
    let history = History::new(format!("{backend}_election_partitioned_leader"));
    let name = format!("drill-{:016x}", rand::random::<u64>());
    let log = FencedLog::new();
    let (a, link) = linked_client(&history, "a", &url).await;
    let (b, _b_link) = linked_client(&history, "b", &url).await;
    let ea = Election::new(a.lock.clone(), &name).unwrap().ttl(TTL);
    let eb = Election::new(b.lock.clone(), &name).unwrap().ttl(TTL);

    let key = ea.key().clone();
    let op = a.rec.acquire(&key, TTL);
    let lead_a = timeout(SOON, ea.campaign(SOON))
        .await
        .expect("a's campaign returns")
        .expect("a leads");
    let hold_a = Hold::from(lead_a.granted_lease());
    op.granted(hold_a.clone());
    assert!(write(&a.rec, &hold_a, &log, "a#1"), "the leader's write");

    let cut = history.fault("a's link blackholed", Some("a"));
    link.set(Fault::Blackhole);
    let cut_at = Instant::now();

    // a's loss, recorded as soon as it fires.
    let lost = {
        let (lost, rec, hold) = (lead_a.lost(), a.rec.clone(), hold_a.clone());
        tokio::spawn(async move {
            lost.await;
            let at = Instant::now();
            rec.lost(hold, "the leadership's lost() fired");
            at
        })
    };
    let op = b.rec.acquire(&key, TTL);
    let lead_b = timeout(SOON * 2, eb.campaign(SOON))
        .await
        .expect("b's campaign returns")
        .expect("b is elected once a's lease is gone");
    let elected_at = Instant::now();
    let hold_b = Hold::from(lead_b.granted_lease());
    op.granted(hold_b.clone());
    let lost_at = timeout(SOON, lost)
        .await
        .expect("a's lost() fires")
        .unwrap();
    assert!(
        lost_at <= elected_at,
        "{backend}: b was elected {:?} after the cut, before a's lost() fired ({:?} after)",
        elected_at - cut_at,
        lost_at - cut_at
    );
    assert!(lead_b.term() > lead_a.term(), "b's term after a's");
    assert!(
        write(&b.rec, &hold_b, &log, "b#1"),
        "the new leader's write"
    );
    // a, still cut off, writes late with its old term: refused.
    assert!(
        !write(&a.rec, &hold_a, &log, "a#late"),
        "a deposed leader's write was accepted"
    );
    let leader = eb.leader().await.unwrap().expect("b leads");
    assert_eq!(leader.term, Some(lead_b.term()));
    eprintln!(
        "{}: a lost its leadership {:?} after the cut, b elected {:?} after (ttl {TTL:?}); terms {} then {}",
        history.name(),
        lost_at - cut_at,
        elected_at - cut_at,
        lead_a.term(),
        lead_b.term()
    );
    cut.heal();
    link.pass();
    let op = a.rec.release(hold_a);
    match lead_a.resign().await {
        Ok(resigned) => {
            assert!(
                !resigned,
                "a deposed leader's resign must not report success"
            );
            op.released(false);
        }
        Err(e) => op.error(&e),
    }
    let term_b = lead_b.term();
    let op = b.rec.release(hold_b);
    op.released(lead_b.resign().await.expect("b resigns"));
    // Healed, a leads again, with a newer term still.
    let op = a.rec.acquire(&key, TTL);
    let again = timeout(SOON, ea.campaign(SOON))
        .await
        .expect("a's new campaign returns")
        .expect("a leads again after the heal");
    let hold = Hold::from(again.granted_lease());
    op.granted(hold.clone());
    assert!(again.term() > term_b, "a's new term after b's");
    assert!(
        write(&a.rec, &hold, &log, "a#2"),
        "the healed leader's write"
    );
    let op = a.rec.release(hold);
    op.released(again.resign().await.expect("a resigns"));
    finish(&history, &log, &[]);
}

#[test]
fn a_partitioned_leader_is_told_before_a_new_leader_is_elected() {
    drill_support::block_on(async {
        let mut drills = Vec::new();
        for (backend, url) in drill_support::drill_targets() {
            let Some(url) = url else { continue };
            drills.push(tokio::spawn(async move {
                partitioned_leader(backend, url).await;
            }));
        }
        for drill in drills {
            drill.await.expect("the drill");
        }
    });
}
