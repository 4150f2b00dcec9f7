//! Cancellation at every poll for elections: `campaign`, `resign` and `proclaim` dropped after
//! their 1st, 2nd, … poll (until one completes uncancelled, at most [`MAX_POLLS`]), with the
//! same checks as the lock operations' (a child of `cancel`, whose helpers it shares): the
//! election's key is free again within its TTL plus slack, nobody stays queued, terms still
//! increase, every background clean-up finishes — and a dropped `proclaim` leaves the leader
//! leading with its term.

use lock_core::{DynLock, Election};
use tokio::time::{Instant, timeout};

use super::{
    MAX_POLLS, assert_left_nothing, cancel_ttl, covered, drop_after, fence_of_a_grant, poll_up_to,
    queued, telling_ttl,
};
use crate::{
    Harness, Outcome,
    properties::{SLACK, fencing_claimed, release, take},
};

/// A fresh election name (a valid key segment).
fn election_name(label: &str) -> String {
    format!("cancel-{label}-{:016x}", rand::random::<u64>())
}

/// `client`'s election on a fresh name, campaigning with a TTL that outlasts the checks' wait
/// (so a leaked grant fails them), or `None` where elections are refused (no fencing tokens).
fn election(h: &Harness, client: &DynLock, label: &str) -> Option<Election> {
    if !fencing_claimed(client) {
        return None;
    }
    Some(
        Election::new(client.clone(), &election_name(label))
            .expect("a valid election name")
            .ttl(telling_ttl(h)),
    )
}

/// A `campaign` queued behind a leader and dropped after any of its polls — while it waits,
/// or after the leader resigned with the grant on its way to it — leaves nothing behind: the
/// election's key is free within the campaign's TTL, nobody stays queued, terms increase.
pub async fn campaign_dropped_at_any_poll_leaves_nothing_behind(h: Harness) -> Outcome {
    let [a, b, leader] = <[DynLock; 3]>::try_from(h.clients(3).await).ok().unwrap();
    let ttl = cancel_ttl(&h, &a);
    let mut completed_at = None;
    for n in 1..=MAX_POLLS {
        let Some(election) = election(&h, &a, "campaign") else {
            return Outcome::Skipped("elections need fencing tokens");
        };
        let key = election.key().clone();
        let before = fence_of_a_grant(&a, &key).await;
        let held = take(&leader, &key, super::LONG_TTL).await;
        let mut polls = 0;
        let mut attempt = Box::pin(election.campaign(super::LONG_TTL));
        let early = tokio::select! {
            out = poll_up_to(attempt.as_mut(), n, &mut polls) => out,
            () = queued(&leader, &key) => None,
        };
        if let Some(out) = early {
            panic!("campaign completed while another led: {out:?}");
        }
        assert!(release(&leader, &held).await);
        let late = timeout(SLACK, poll_up_to(attempt.as_mut(), n, &mut polls))
            .await
            .unwrap_or(None);
        drop(attempt);
        let since = Instant::now();
        match late {
            Some(Ok(leadership)) => {
                if let Some(before) = before {
                    assert!(leadership.term() > before, "a term not above {before:?}");
                }
                assert!(
                    leadership.resign().await.unwrap(),
                    "the new leader's resign"
                );
                completed_at = Some(n);
                break;
            }
            Some(Err(e)) => panic!("a campaign for a released election failed: {e}"),
            None => {
                let what = format!("campaign dropped after poll {n} ({polls} polls)");
                assert_left_nothing(&what, (&a, &b), &key, ttl, since, before, None).await;
            }
        }
    }
    covered("campaign", completed_at).await
}

/// A `resign` dropped after any of its polls leaves nothing behind: the election's key is free
/// within the leadership's TTL (the dropped leadership gives it back in the background), terms
/// increase.
pub async fn resign_dropped_at_any_poll_leaves_nothing_behind(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    let ttl = cancel_ttl(&h, &a);
    let mut completed_at = None;
    for n in 1..=MAX_POLLS {
        let Some(election) = election(&h, &a, "resign") else {
            return Outcome::Skipped("elections need fencing tokens");
        };
        let key = election.key().clone();
        let before = fence_of_a_grant(&a, &key).await;
        let leadership = election
            .try_campaign()
            .await
            .unwrap()
            .expect("nobody else campaigns in a fresh election");
        let out = drop_after(Box::pin(leadership.resign()), n).await;
        let since = Instant::now();
        let what = format!("resign dropped after poll {n}");
        match out {
            Some(Ok(true)) => completed_at = Some(n),
            Some(Ok(false)) => panic!("{what}: a resign of a live leadership found it gone"),
            Some(Err(e)) => panic!("{what}: resign failed: {e}"),
            None => {}
        }
        assert_left_nothing(&what, (&a, &b), &key, ttl, since, before, None).await;
        if completed_at.is_some() {
            break;
        }
    }
    covered("resign", completed_at).await
}

/// A `proclaim` dropped after any of its polls leaves the leader leading: its leadership is not
/// lost, the election still shows its term (with the old value or the new one), a later
/// proclaim takes effect, and the resign frees the election for the next campaigner.
pub async fn proclaim_dropped_at_any_poll_keeps_the_leader(h: Harness) -> Outcome {
    let [a, b] = <[DynLock; 2]>::try_from(h.clients(2).await).ok().unwrap();
    if !a.capabilities().relabel {
        return Outcome::Skipped("relabel not claimed (proclaim needs it)");
    }
    let mut completed_at = None;
    for n in 1..=MAX_POLLS {
        let Some(election) = election(&h, &a, "proclaim") else {
            return Outcome::Skipped("elections need fencing tokens");
        };
        let leadership = election
            .try_campaign()
            .await
            .unwrap()
            .expect("nobody else campaigns in a fresh election");
        let term = leadership.term();
        let out = drop_after(Box::pin(leadership.proclaim("dropped")), n).await;
        let what = format!("proclaim dropped after poll {n}");
        if let Some(Err(e)) = &out {
            panic!("{what}: proclaim failed: {e}");
        }
        assert!(!leadership.is_lost(), "{what}: the leadership was lost");
        // The outcome of a dropped proclaim may land a moment later; then a new one wins.
        timeout(SLACK, leadership.proclaim("final"))
            .await
            .unwrap_or_else(|_| panic!("{what}: a later proclaim hung"))
            .unwrap_or_else(|e| panic!("{what}: a later proclaim failed: {e}"));
        let seen = election
            .leader()
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{what}: nobody leads"));
        assert_eq!(seen.term, Some(term), "{what}: the term changed");
        assert_eq!(seen.value.as_deref(), Some("final"), "{what}: {seen:?}");
        assert!(leadership.resign().await.unwrap(), "{what}: resign");
        let next = Election::new(
            b.clone(),
            election.key().as_str().trim_start_matches("election/"),
        )
        .expect("the same election")
        .ttl(telling_ttl(&h));
        let successor = timeout(SLACK, next.campaign(SLACK))
            .await
            .unwrap_or_else(|_| panic!("{what}: the next campaign hung"))
            .unwrap_or_else(|e| panic!("{what}: the next campaign failed: {e}"));
        assert!(
            successor.term() > term,
            "{what}: the next term is not newer"
        );
        assert!(successor.resign().await.unwrap());
        if out.is_some() {
            completed_at = Some(n);
            break;
        }
    }
    covered("proclaim", completed_at).await
}
