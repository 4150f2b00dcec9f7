//! Job drills on every backend (`memory://` and the shared single-node servers, all through
//! `distlock::connect`), each recording a history that the checker must find clean (kept with
//! its timeline under `target/drill-histories/<backend>_<drill>.{json,svg}`):
//!
//! 1. `slow_downstream_kept`: a job under `run_exclusive` whose downstream call takes 3 × TTL.
//!    The watchdog keeps the lease: a contender polling meanwhile always finds the key busy, and
//!    the job's fenced write is accepted.
//! 2. `slow_downstream_cancelled`: the same job, but its client's link is blackholed right after
//!    the grant, so no renewal can reach the coordinator. The loss cancels the job
//!    (`run_exclusive` returns `Err(NotHeld)`) and is recorded before a contender is granted;
//!    the downstream request that was already in flight (it escaped the cancellation) answers
//!    after the contender's write and its write is rejected by the fence.
//! 3. `delivered_twice_skip` / `delivered_twice_wait`: two instances receive the same job id at
//!    the same moment and both call `run_exclusive` on `job/<id>`; the job's effect is a
//!    read of its status, the job's work, then its fenced effect and `pending → done`, with
//!    nothing but the lock around them. With no wait the instance that got the lock holds it
//!    until the other has tried, which must have skipped; with a wait the other is granted only
//!    after the first released and finds the job done. Exactly one effect, by the instance that
//!    got the lock.
//! 4. `force_released_holder`: an operator's `force_release` while c1 holds and c2 waits: c2 is
//!    granted, c1's guard reports the loss, c1's stale write is rejected; the checker accepts
//!    the overlap only because the force-release is on record.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use conformance::drill::{Fault, History, Hold, Kind, Op};
use drill_support::{Client, FencedLog, RESOURCE, SOON, TTL, finish, linked_client, seq_of, write};
use lock_core::{DistributedLockExt, Error, FencingToken, JobContext, LockKey, LockOptions};
use tokio::{
    sync::{Barrier, Notify, oneshot, watch},
    time::{Instant, sleep, timeout},
};

/// The downstream call's duration: three TTLs.
const SLOW: Duration = Duration::from_secs(3);
const WAIT: Duration = Duration::from_secs(20);

fn hold_of(ctx: &JobContext) -> Hold {
    Hold {
        key: ctx.key().clone(),
        token: ctx.token_digest(),
        fencing: ctx.fencing_token(),
        ttl: TTL,
    }
}

fn fencing(hold: &Hold) -> u64 {
    hold.fencing.map_or(0, FencingToken::get)
}

/// 1. The watchdog keeps the lease through a downstream call of 3 × TTL.
async fn slow_downstream_kept(backend: &str, url: String) {
    assert!(SLOW >= 3 * TTL);
    let history = History::new(format!("{backend}_slow_downstream_kept"));
    let key = conformance::fresh_key("drill-slow-kept");
    let log = FencedLog::new();
    let c1 = Client::new(&history, "c1", &url).await;
    let c2 = Client::new(&history, "c2", &url).await;

    let (started_tx, started_rx) = oneshot::channel();
    let release_op = Arc::new(Mutex::new(None));
    let acquire = c1.rec.acquire(&key, TTL);
    let job = {
        let (rec, log, release_op) = (c1.rec.clone(), log.clone(), release_op.clone());
        c1.lock.run_exclusive(
            key.as_str(),
            LockOptions::with_ttl(TTL),
            move |ctx: JobContext| async move {
                let hold = hold_of(&ctx);
                acquire.granted(hold.clone());
                let _ = started_tx.send(());
                // The slow downstream call.
                sleep(SLOW).await;
                let op = rec.write(hold.clone(), RESOURCE, "c1#after-slow-call");
                let accepted = if ctx.is_lost() {
                    op.fail("ownership lost before the write");
                    false
                } else {
                    match log.write(
                        fencing(&hold),
                        &hold.token.to_string(),
                        "c1#after-slow-call".into(),
                    ) {
                        Ok(()) => {
                            op.ok();
                            true
                        }
                        Err(h) => {
                            op.rejected(Some(FencingToken(h)));
                            false
                        }
                    }
                };
                *release_op.lock().unwrap() = Some(rec.release(hold));
                accepted
            },
        )
    };
    let job = tokio::spawn(job);
    timeout(SOON, started_rx)
        .await
        .expect("the job starts")
        .expect("the job starts");

    // A contender polls while the job runs: the key stays busy the whole time.
    let mut polls = 0;
    while !job.is_finished() {
        let op = c2.rec.acquire(&key, TTL);
        match timeout(SOON, c2.lock.try_acquire(&key, TTL)).await {
            Ok(Ok(None)) => op.busy(),
            Ok(Ok(Some(lease))) => {
                op.granted(&lease);
                // Only legitimate once the job has released.
                if release_op.lock().unwrap().is_none() && !job.is_finished() {
                    panic!("the contender was granted while the job was running");
                }
                // Recorded like every other operation: an unrecorded release leaves the grant
                // "held" in the history, and c2's next grant below reads as a double grant
                // (seen in a clean CI-like run when c2 won the race with the job's end).
                let op = c2.rec.release(&lease);
                match c2.lock.release(&lease).await {
                    Ok(released) => op.released(released),
                    Err(e) => op.error(&e),
                }
                break;
            }
            Ok(Err(e)) => {
                op.error(&e);
                panic!("the contender's try_acquire failed: {e}");
            }
            Err(_) => panic!("the contender's try_acquire hung"),
        }
        polls += 1;
        sleep(Duration::from_millis(250)).await;
    }
    let outcome = timeout(SOON, job).await.expect("the job ends").unwrap();
    if let Some(op) = release_op.lock().unwrap().take() {
        op.ok();
    }
    assert!(
        matches!(outcome, Ok(Some(true))),
        "the job must complete with its write accepted: {outcome:?}"
    );
    assert!(
        polls >= 6,
        "the contender polled only {polls} times during the job"
    );
    eprintln!(
        "{}: job completed after {SLOW:?} (ttl {TTL:?}), contender busy {polls} times",
        history.name()
    );

    // Liveness: the contender acquires once the job released.
    let held = c2
        .acquire(&key, WAIT)
        .await
        .expect("c2 acquires after the job");
    assert!(fencing(&held.hold) > 0);
    assert!(write(&c2.rec, &held.hold, &log, "c2#1"));
    assert_eq!(c2.release(held).await, Some(true));
    finish(&history, &log, &[]);
}

/// 2. Renewals made impossible: the loss cancels the job before a contender is granted.
async fn slow_downstream_cancelled(backend: &str, url: String) {
    let history = History::new(format!("{backend}_slow_downstream_cancelled"));
    let key = conformance::fresh_key("drill-slow-cancel");
    let log = FencedLog::new();
    let (c1, link) = linked_client(&history, "c1", &url).await;
    let c2 = Client::new(&history, "c2", &url).await;

    let (started_tx, started_rx) = oneshot::channel();
    let contender_wrote = Arc::new(Notify::new());
    let (late_tx, late_rx) = oneshot::channel::<Option<bool>>();
    let c1_hold: Arc<Mutex<Option<Hold>>> = Arc::new(Mutex::new(None));
    // The job's context, so the contender can ask it whether c1 still trusts its lease.
    let c1_ctx: Arc<Mutex<Option<JobContext>>> = Arc::new(Mutex::new(None));
    let lost_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let dropped_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let acquire = c1.rec.acquire(&key, TTL);
    let job = {
        let (rec, log, contender_wrote, c1_hold, c1_ctx, lost_at, dropped_at) = (
            c1.rec.clone(),
            log.clone(),
            contender_wrote.clone(),
            c1_hold.clone(),
            c1_ctx.clone(),
            lost_at.clone(),
            dropped_at.clone(),
        );
        c1.lock.run_exclusive(
            key.as_str(),
            LockOptions::with_ttl(TTL),
            move |ctx: JobContext| async move {
                // Notes when the job's future is dropped (cancelled).
                let _cancelled = OnDrop(dropped_at);
                let hold = hold_of(&ctx);
                acquire.granted(hold.clone());
                *c1_hold.lock().unwrap() = Some(hold.clone());
                *c1_ctx.lock().unwrap() = Some(ctx.clone());
                // Record the loss the moment the guard reports it.
                tokio::spawn({
                    let (lost, rec, hold) = (ctx.lost(), rec.clone(), hold.clone());
                    async move {
                        lost.await;
                        rec.lost(hold, "run_exclusive's lost signal fired");
                        *lost_at.lock().unwrap() = Some(Instant::now());
                    }
                });
                let _ = started_tx.send(());
                // The downstream request is on the wire: cancelling the job does not recall it.
                // It answers after 3 × TTL (and, to make the order certain, after the contender
                // wrote) and then applies its write with the token it was sent with.
                let downstream = tokio::spawn(async move {
                    let wrote = contender_wrote.notified();
                    sleep(SLOW).await;
                    let _ = timeout(SOON, wrote).await;
                    let op = rec.write(hold.clone(), RESOURCE, "c1#late-downstream");
                    let accepted = match log.write(
                        fencing(&hold),
                        &hold.token.to_string(),
                        "c1#late-downstream".into(),
                    ) {
                        Ok(()) => {
                            op.ok();
                            true
                        }
                        Err(h) => {
                            op.rejected(Some(FencingToken(h)));
                            false
                        }
                    };
                    let _ = late_tx.send(Some(accepted));
                });
                // The job waits for the downstream answer; a loss drops this future.
                let _ = downstream.await;
                "completed"
            },
        )
    };
    let job = tokio::spawn(job);
    timeout(SOON, started_rx)
        .await
        .expect("the job starts")
        .expect("the job starts");

    link.set(Fault::Blackhole);
    let started = Instant::now();
    let fault = history.fault("blackholed", Some("c1"));
    // Whether the job's future had been dropped is read the moment c2's acquire returns (not
    // after awaiting the job, which would make the order true by construction).
    let contender = tokio::spawn({
        let (acquire, dropped_at, c1_ctx) = (
            c2.start_acquire(&key, WAIT),
            dropped_at.clone(),
            c1_ctx.clone(),
        );
        async move {
            let held = acquire.await;
            let dropped_by_then = dropped_at.lock().unwrap().is_some();
            // The job's own view (`lost()` fired or the local deadline passed).
            let trusted_by_then = c1_ctx
                .lock()
                .unwrap()
                .as_ref()
                .is_some_and(|c| !c.is_lost());
            (held, Instant::now(), dropped_by_then, trusted_by_then)
        }
    });

    let outcome = timeout(SOON, job).await.expect("the job ends").unwrap();
    let cancelled_at = Instant::now();
    assert!(
        matches!(outcome, Err(Error::NotHeld { .. })),
        "the loss must cancel the job with NotHeld: {outcome:?}"
    );
    let (held2, granted_at, dropped_before_grant, c1_trusted_at_grant) = contender.await.unwrap();
    let held2 = held2.expect("c2 is granted");
    assert!(
        !c1_trusted_at_grant,
        "c2 was granted at {:?} while c1's job still trusted the lease",
        granted_at - started
    );
    // (run_exclusive itself returns only after its release attempt through the dead link.)
    assert!(
        dropped_before_grant,
        "c1's job was still running when c2 was granted at {:?} (dropped at {:?})",
        granted_at - started,
        dropped_at.lock().unwrap().map(|at| at - started),
    );
    let lost_at = lost_at.lock().unwrap().expect("the loss was recorded");
    let dropped_at = dropped_at
        .lock()
        .unwrap()
        .expect("the job's future was dropped");
    let hold1 = c1_hold.lock().unwrap().clone().unwrap();
    assert!(fencing(&held2.hold) > fencing(&hold1));
    // (The lost record's position against c2's grant record, a race of the drift margin, is left
    // to the checker, which compares both with c1's renewed deadline.)
    assert!(write(&c2.rec, &held2.hold, &log, "c2#1"));
    contender_wrote.notify_one();

    // The in-flight downstream answers late; the fence rejects its write.
    let late = timeout(SOON + SLOW, late_rx)
        .await
        .expect("the downstream answers")
        .unwrap();
    assert_eq!(
        late,
        Some(false),
        "the cancelled job's late write must be rejected after the contender's"
    );
    assert!(
        !log.values().iter().any(|v| v.starts_with("c1#")),
        "no write of the cancelled job may be accepted: {:?}",
        log.values()
    );

    let until = started + 2 * TTL;
    tokio::time::sleep_until(until).await;
    link.pass();
    fault.heal();
    eprintln!(
        "{}: c1 lost after {:?}, job dropped after {:?}, run_exclusive returned after {:?}, c2 granted after {:?}",
        history.name(),
        lost_at - started,
        dropped_at - started,
        cancelled_at - started,
        granted_at - started
    );
    assert_eq!(c2.release(held2).await, Some(true));
    // Liveness: c1 acquires again through the healed link.
    let again = c1
        .acquire(&key, WAIT)
        .await
        .expect("c1 acquires after the heal");
    assert!(write(&c1.rec, &again.hold, &log, "c1#2"));
    assert_eq!(c1.release(again).await, Some(true));
    drop(link);
    finish(&history, &log, &[]);
}

/// Sets the instant it is dropped.
struct OnDrop(Arc<Mutex<Option<Instant>>>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        *self.0.lock().unwrap() = Some(Instant::now());
    }
}

/// The jobs table: each job's status. A delivery reads it, does the job's work, applies the
/// job's effect (a fenced append to the log) and marks the job done: separate steps with nothing
/// but the lock around them, as a job calling an outside service has. Two deliveries running at
/// once both find the job pending and both apply it.
#[derive(Default)]
struct Jobs {
    done: Mutex<HashMap<String, String>>,
}

impl Jobs {
    fn is_done(&self, id: &str) -> bool {
        self.done.lock().unwrap().contains_key(id)
    }

    fn mark_done(&self, id: &str, by: &str) {
        self.done
            .lock()
            .unwrap()
            .insert(id.to_owned(), by.to_owned());
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Delivery {
    Skipped,
    Applied,
    FoundDone,
}

/// How far the two deliveries are, so the first one's job can hold the lock until the second
/// has tried (without these waits a slow start of the second would let it pass the first).
#[derive(Clone, Copy, Debug, Default)]
struct Progress {
    /// Deliveries that invoked their acquisition.
    invoked: u32,
    /// Jobs that started (were granted).
    entered: u32,
    /// Deliveries whose `run_exclusive` returned.
    returned: u32,
}

/// 3. The same job delivered twice at the same moment.
///
/// The lock alone keeps the effect single: with no wait the job that got the lock holds it until
/// the other delivery has tried, so the other must have skipped; with a wait the other is granted
/// only after the first released and finds the job done. A lock that grants both lets both jobs in
/// (they then wait for nothing and both apply the job, or the fence rejects one: either fails the
/// drill).
async fn delivered_twice(backend: &str, url: String, wait: bool) {
    let variant = if wait { "wait" } else { "skip" };
    let history = History::new(format!("{backend}_delivered_twice_{variant}"));
    let job_id = format!("{:016x}", rand::random::<u64>());
    let key = LockKey::new(format!("conformance/drill-job/{job_id}")).unwrap();
    let log = FencedLog::new();
    let jobs = Arc::new(Jobs::default());
    let i1 = Client::new(&history, "i1", &url).await;
    let i2 = Client::new(&history, "i2", &url).await;
    let barrier = Arc::new(Barrier::new(2));
    let (progress, _) = watch::channel(Progress::default());
    let progress = Arc::new(progress);

    let deliver = |instance: Client| {
        let (key, log, jobs, barrier, job_id, progress) = (
            key.clone(),
            log.clone(),
            jobs.clone(),
            barrier.clone(),
            job_id.clone(),
            progress.clone(),
        );
        async move {
            let mut opts = LockOptions::with_ttl(TTL);
            if wait {
                opts = opts.wait(WAIT);
            }
            barrier.wait().await;
            let acquire = Arc::new(Mutex::new(Some(instance.rec.acquire(&key, TTL))));
            progress.send_modify(|p| p.invoked += 1);
            let release = Arc::new(Mutex::new(None));
            let rec = instance.rec.clone();
            let (acq, rel, job_progress) = (acquire.clone(), release.clone(), progress.clone());
            let outcome = instance
                .lock
                .run_exclusive(key.as_str(), opts, move |ctx: JobContext| async move {
                    let hold = hold_of(&ctx);
                    acq.lock().unwrap().take().unwrap().granted(hold.clone());
                    job_progress.send_modify(|p| p.entered += 1);
                    // Hold the lock until the other delivery tried: skip mode, until its
                    // try returned (busy); wait mode, until it is waiting. Both jobs inside at
                    // once (a broken lock) end the wait at once.
                    let mut seen = job_progress.subscribe();
                    let _ = timeout(
                        SOON,
                        seen.wait_for(|p| {
                            p.entered >= 2
                                || if wait {
                                    p.invoked >= 2
                                } else {
                                    p.returned >= 1
                                }
                        }),
                    )
                    .await;
                    let value = format!("{job_id} done by {}", rec.id());
                    let op = rec.write(hold.clone(), RESOURCE, &value);
                    let result = if ctx.is_lost() {
                        op.fail("ownership lost before the update");
                        None
                    } else if jobs.is_done(&job_id) {
                        op.fail("the job is done: nothing to apply");
                        Some(Delivery::FoundDone)
                    } else {
                        // The job's work between reading its status and applying its effect.
                        sleep(Duration::from_millis(200)).await;
                        match log.write(fencing(&hold), &hold.token.to_string(), value.clone()) {
                            Ok(()) => {
                                op.ok();
                                jobs.mark_done(&job_id, rec.id());
                                Some(Delivery::Applied)
                            }
                            Err(h) => {
                                op.rejected(Some(FencingToken(h)));
                                None
                            }
                        }
                    };
                    *rel.lock().unwrap() = Some(rec.release(hold));
                    result
                })
                .await;
            progress.send_modify(|p| p.returned += 1);
            if let Some(op) = release.lock().unwrap().take() {
                op.ok();
            }
            let delivery = match outcome {
                Ok(None) => {
                    acquire.lock().unwrap().take().unwrap().busy();
                    Delivery::Skipped
                }
                Ok(Some(Some(d))) => d,
                other => panic!("{}: the delivery failed: {other:?}", instance.rec.id()),
            };
            (instance.rec.id().to_owned(), delivery)
        }
    };
    let (d1, d2) = tokio::join!(
        tokio::spawn(deliver(i1.clone())),
        tokio::spawn(deliver(i2.clone()))
    );
    let (d1, d2) = (d1.unwrap(), d2.unwrap());
    eprintln!("{}: {d1:?}, {d2:?}", history.name());
    let (winner, other) = match (&d1.1, &d2.1) {
        (Delivery::Applied, _) => (&d1, &d2),
        (_, Delivery::Applied) => (&d2, &d1),
        _ => panic!("one delivery must apply the job: {d1:?} {d2:?}"),
    };
    let expected = if wait {
        Delivery::FoundDone
    } else {
        Delivery::Skipped
    };
    assert_eq!(
        other.1,
        expected,
        "{} applied the job; {} must have {}: {d1:?} {d2:?}",
        winner.0,
        other.0,
        if wait {
            "waited for the lock and found the job done"
        } else {
            "skipped because the key was held"
        }
    );
    assert_eq!(
        log.values(),
        vec![format!("{job_id} done by {}", winner.0)],
        "exactly one effect, by {}",
        winner.0
    );
    if wait {
        // The other was granted only after the winner had started its release.
        let released = seq_of(&history, |r| {
            r.kind == Kind::Invoke
                && r.op == Some(Op::Release)
                && r.client.as_deref() == Some(winner.0.as_str())
        })
        .expect("the winner's release is recorded");
        let granted = seq_of(&history, |r| {
            r.kind == Kind::Ok
                && r.granted == Some(true)
                && r.client.as_deref() == Some(other.0.as_str())
        })
        .expect("the waiting delivery's grant is recorded");
        assert!(
            released < granted,
            "{} was granted (record {granted}) before {} released (record {released})",
            other.0,
            winner.0
        );
    }
    // Liveness: the key is free again for both instances.
    for instance in [&i1, &i2] {
        let held = instance
            .acquire(&key, WAIT)
            .await
            .expect("the job's key is free again");
        assert_eq!(instance.release(held).await, Some(true));
    }
    finish(&history, &log, &[]);
}

async fn delivered_twice_skip(backend: &str, url: String) {
    delivered_twice(backend, url, false).await;
}

async fn delivered_twice_wait(backend: &str, url: String) {
    delivered_twice(backend, url, true).await;
}

/// Drill 4: an operator force-releases a held lock while a contender waits; the contender is
/// granted while the old holder still believes (until its guard learns the loss), which the
/// checker must accept only because the intervention is on record; the old holder's guard
/// reports the loss and its stale write is rejected by the fence.
async fn force_released_holder(backend: &str, url: String) {
    let history = History::new(format!("{backend}_force_released_holder"));
    let key = conformance::fresh_key("drill-force-release");
    let log = FencedLog::new();
    let c1 = Client::new(&history, "c1", &url).await;
    let c2 = Client::new(&history, "c2", &url).await;
    let operator = Client::new(&history, "operator", &url).await;

    let held1 = c1.acquire(&key, WAIT).await.expect("c1 acquires");
    assert!(write(&c1.rec, &held1.hold, &log, "c1#1"));
    let contender = tokio::spawn(c2.start_acquire(&key, WAIT));
    let op = operator.rec.force_release(&key);
    match timeout(SOON, operator.lock.force_release(&key)).await {
        Ok(Ok(true)) => op.ok(),
        Ok(Ok(false)) => panic!("force_release found no holder although c1 holds"),
        Ok(Err(e)) => {
            op.error(&e);
            panic!("force_release failed: {e}");
        }
        Err(_) => panic!("force_release hung"),
    }
    let held2 = contender
        .await
        .unwrap()
        .expect("c2 is granted after the force-release");
    assert!(fencing(&held2.hold) > fencing(&held1.hold));
    assert!(write(&c2.rec, &held2.hold, &log, "c2#1"));
    held1
        .wait_lost(SOON)
        .await
        .expect("the force-released holder's guard must report the loss");
    assert!(
        !write(&c1.rec, &held1.hold, &log, "c1#stale"),
        "the force-released holder's write must be rejected"
    );
    assert_ne!(c1.release(held1).await, Some(true));
    assert_eq!(c2.release(held2).await, Some(true));
    finish(&history, &log, &[]);
}

/// One `#[test]` per backend for a drill, each on its own runtime.
macro_rules! drill {
    ($drill:ident) => {
        mod $drill {
            fn run(backend: &'static str) {
                let Some(url) = super::drill_support::drill_target(backend) else {
                    println!(
                        "SKIP {} on {backend}: no server URL set",
                        stringify!($drill)
                    );
                    return;
                };
                super::drill_support::block_on(super::$drill(backend, url));
            }

            #[test]
            fn memory() {
                run("memory");
            }

            #[test]
            fn redis() {
                run("redis");
            }

            #[test]
            fn etcd() {
                run("etcd");
            }

            #[test]
            fn zk() {
                run("zk");
            }

            #[test]
            fn pg() {
                run("pg");
            }
        }
    };
}

drill!(slow_downstream_kept);
drill!(slow_downstream_cancelled);
drill!(delivered_twice_skip);
drill!(delivered_twice_wait);
drill!(force_released_holder);
