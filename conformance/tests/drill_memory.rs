//! The first end-to-end drill, on the in-memory backend: "holder paused past its TTL".
//!
//! Three clients repeatedly acquire (a `LockGuard` with a short TTL), write to a fenced register
//! with their fencing token, and release. In one round c2 is paused between its grant and its
//! write (its watchdog is off, as a paused process's would be) until its lease has expired and a
//! newer holder has written; then its late write must be rejected. After the pause heals every
//! client acquires again. Everything goes into a history that the checker must find clean; the
//! history and its timeline are kept under `target/drill-histories/`.
//!
//! The same drill against a resource that does not check fencing tokens must be caught by the
//! checker — the proof that the checker can fail.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use conformance::drill::{
    CheckOptions, ClientRecorder, History, Hold, Kind, Op, ResourceKind, Rule, Violation, check,
};
use lock_core::{
    DistributedLockExt, DynLock, FencedRegister, FencingToken, InMemoryLock, LockGuard, LockKey,
};
use tokio::{sync::watch, time::timeout};

const TTL: Duration = Duration::from_millis(200);
const ROUNDS: usize = 6;
const PAUSED_CLIENT: &str = "c2";
const PAUSED_ROUND: usize = 1;
const RESOURCE: &str = "register";

/// The protected resource: a fenced register, or (to prove the checker) one that accepts every
/// write. Publishes the highest token written so a paused client can wait for a newer holder's
/// write without sleeping.
struct Resource {
    fenced: bool,
    register: FencedRegister<String>,
    unfenced: Mutex<Option<String>>,
    highest: watch::Sender<u64>,
}

impl Resource {
    fn new(fenced: bool) -> Self {
        Self {
            fenced,
            register: FencedRegister::new(),
            unfenced: Mutex::new(None),
            highest: watch::Sender::new(0),
        }
    }

    /// Writes `value` with `token`: `Err(highest)` when rejected as stale.
    fn write(&self, token: FencingToken, value: String) -> Result<(), Option<FencingToken>> {
        if self.fenced {
            self.register
                .write(token, value)
                .map_err(|e| Some(e.highest))?;
        } else {
            *self.unfenced.lock().unwrap() = Some(value);
        }
        self.highest.send_modify(|h| *h = (*h).max(token.get()));
        Ok(())
    }

    fn value(&self) -> Option<String> {
        if self.fenced {
            self.register.value()
        } else {
            self.unfenced.lock().unwrap().clone()
        }
    }
}

/// Records the moment the guard reports its loss (aborted once the hold ends).
fn watch_loss(rec: &ClientRecorder, guard: &LockGuard) -> tokio::task::JoinHandle<()> {
    let lost = guard.lost();
    let rec = rec.clone();
    let hold = Hold::from(guard);
    tokio::spawn(async move {
        lost.await;
        rec.lost(hold, "the guard's lost() fired");
    })
}

/// One round: acquire, (pause), write, release. Returns whether it got the lock.
async fn round(
    history: &History,
    rec: &ClientRecorder,
    lock: &DynLock,
    key: &LockKey,
    resource: &Resource,
    pause: bool,
) -> bool {
    let op = rec.acquire(key, TTL);
    let mut builder = lock
        .lock(key.as_str())
        .ttl(TTL)
        .wait(Duration::from_secs(10));
    if pause {
        // A paused process's watchdog is paused with it.
        builder = builder.no_watchdog();
    }
    let guard = match builder.acquire().await {
        Ok(guard) => guard,
        Err(e) => {
            op.error(&e);
            return false;
        }
    };
    op.granted(&guard);
    let loss = watch_loss(rec, &guard);
    let token = guard.fencing_token().expect("memory mints fencing tokens");

    if pause {
        let fault = history.fault("paused", Some(rec.id()));
        // The pause: past the TTL, and until a newer holder has written (so the resource knows
        // a newer token — fencing can only reject what it can compare against).
        tokio::time::sleep(2 * TTL).await;
        let mut highest = resource.highest.subscribe();
        timeout(
            Duration::from_secs(10),
            highest.wait_for(|h| *h > token.get()),
        )
        .await
        .expect("another client should take over and write while c2 is paused")
        .expect("resource gone");
        fault.heal();
    } else {
        // A little work while holding, so that contenders queue up.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let value = format!("{}#{token}", rec.id());
    let write = rec.write(&guard, RESOURCE, value.clone());
    match resource.write(token, value) {
        Ok(()) => write.ok(),
        Err(highest) => write.rejected(highest),
    }

    // The renewals the watchdog made: the checker holds others to the renewed deadline.
    rec.guard_renewed(&guard);
    let release = rec.release(&guard);
    loss.abort();
    match guard.release().await {
        Ok(released) => release.released(released),
        Err(e) => release.error(&e),
    }
    true
}

/// Runs the drill and returns its history and the checker's verdict (after saving both).
async fn drill(name: &str, fenced: bool) -> (History, Vec<Violation>) {
    let coordinator = InMemoryLock::new();
    let history = History::new(name);
    let resource = Arc::new(Resource::new(fenced));
    let key = conformance::fresh_key("drill-memory");
    let clients: Vec<(ClientRecorder, DynLock)> = ["c1", "c2", "c3"]
        .into_iter()
        .map(|id| {
            let lock: DynLock = Arc::new(coordinator.client());
            (history.client(id), lock)
        })
        .collect();

    // Phase 1: rounds, with c2 paused in one of them.
    let mut tasks = Vec::new();
    for (rec, lock) in clients.clone() {
        let (history, resource, key) = (history.clone(), resource.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            for n in 0..ROUNDS {
                let pause = rec.id() == PAUSED_CLIENT && n == PAUSED_ROUND;
                round(&history, &rec, &lock, &key, &resource, pause).await;
            }
        }));
    }
    for task in tasks {
        task.await.expect("client task panicked");
    }

    // Phase 2, after the heal: every client acquires again.
    let mut tasks = Vec::new();
    for (rec, lock) in clients {
        let (history, resource, key) = (history.clone(), resource.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            assert!(round(&history, &rec, &lock, &key, &resource, false).await);
        }));
    }
    for task in tasks {
        task.await.expect("client task panicked");
    }

    history.final_state(
        RESOURCE,
        ResourceKind::Register,
        resource.value().into_iter().collect(),
    );
    let violations = check(
        &history.snapshot(),
        &CheckOptions {
            ttl: Some(TTL),
            ..CheckOptions::default()
        },
    );
    let files = history.save(&violations).expect("save the drill's history");
    eprintln!(
        "{name}: {} records, {} violation(s); history {} timeline {}",
        history.snapshot().len(),
        violations.len(),
        files.json.display(),
        files.svg.display()
    );
    (history, violations)
}

/// The late write of the paused client: (its outcome kind, the token it presented).
fn late_write(history: &History) -> (Kind, u64) {
    let records = history.snapshot();
    let start = records
        .iter()
        .find(|r| r.kind == Kind::FaultEnd)
        .expect("the pause healed");
    let invoke = records
        .iter()
        .find(|r| {
            r.seq > start.seq
                && r.kind == Kind::Invoke
                && r.op == Some(Op::Write)
                && r.client.as_deref() == Some(PAUSED_CLIENT)
        })
        .expect("the paused client wrote after the pause");
    let done = records
        .iter()
        .find(|r| r.op_id == invoke.op_id && r.kind != Kind::Invoke)
        .expect("the late write completed");
    (done.kind, invoke.fencing.expect("fenced write"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_holder_drill_on_the_memory_backend() {
    let (history, violations) = drill("memory_paused_holder", true).await;
    assert!(violations.is_empty(), "{violations:#?}");

    let records = history.snapshot();
    let (outcome, token) = late_write(&history);
    assert_eq!(
        outcome,
        Kind::Fail,
        "the paused holder's late write must be rejected"
    );
    // A newer holder was granted a larger token while c2 was paused.
    let newer = records.iter().any(|r| {
        r.kind == Kind::Ok && r.granted == Some(true) && r.fencing.is_some_and(|f| f > token)
    });
    assert!(newer);
    // The paused holder learned it lost the lease, and its release was a no-op.
    assert!(records.iter().any(|r| {
        r.kind == Kind::Lost
            && r.client.as_deref() == Some(PAUSED_CLIENT)
            && r.fencing == Some(token)
    }));
    let grants = records
        .iter()
        .filter(|r| r.kind == Kind::Ok && r.granted == Some(true))
        .count();
    assert_eq!(grants, 3 * ROUNDS + 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fencing_the_checker_catches_the_paused_holders_write() {
    let (history, violations) = drill("memory_paused_holder_unfenced", false).await;
    let (outcome, _) = late_write(&history);
    assert_eq!(
        outcome,
        Kind::Ok,
        "an unfenced resource accepts the late write"
    );
    let rules: BTreeSet<Rule> = violations.iter().map(|v| v.rule).collect();
    assert!(
        rules.contains(&Rule::StaleWriteAccepted),
        "the stale write must be reported: {violations:#?}"
    );
    assert!(
        rules.contains(&Rule::WriteOutsideHold),
        "the write came after the holder's guard reported the loss: {violations:#?}"
    );
}
