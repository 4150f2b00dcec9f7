//! Renewal groups (issue 24): guards whose leases a driver renews with one request are members
//! of one group in the client's scheduler — one renewal and one timer for all of them — and
//! each still loses exactly what happens to it: its own pushed loss, its group's failure, its
//! group's deadline.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod support;

use support::hold;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::future::BoxFuture;
use lock_core::raw::{GroupRenewError, LostSink, RenewalGroup, SharedGroup, async_trait};
use lock_core::{
    Capabilities, DistributedLock, DynLock, Error, HolderInfo, InMemoryLock, Lease, LockKey,
    LossReason, Result,
};
use tokio::time::{Instant, sleep, timeout};

/// What the test group answers next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    Renew,
    /// A temporary failure (the coordinator unreachable).
    Unavailable,
    /// The shared session ended.
    Gone,
    /// The coordinator refused the renewal (not a failure that a retry could mend).
    Refused,
}

/// The in-memory coordinator, with every lease of one client in one renewal group: the group's
/// renewal renews each member on the coordinator (so the coordinator really holds them as long
/// as the group says), and counts.
#[derive(Debug)]
struct Grouped {
    inner: InMemoryLock,
    group: Arc<MemGroup>,
    /// The group of the keys under [`OTHER`] (a second session, say). It pushes its members'
    /// losses to their [`LostSink`]s, found when it renews them (as etcd's group does for a
    /// member no deletion watch covers); `group` leaves them to `watch_lost`.
    other: Arc<MemGroup>,
    own_renewals: AtomicUsize,
    /// `watch_lost` futures asked for.
    watches: AtomicUsize,
}

/// Keys under this prefix belong to [`Grouped::other`].
const OTHER: &str = "other-group/";

#[derive(Debug)]
struct MemGroup {
    inner: InMemoryLock,
    /// Each member, and its sink when this group pushes losses.
    members: Mutex<HashMap<String, (Lease, Option<LostSink>)>>,
    joined: AtomicUsize,
    left: AtomicUsize,
    renewals: AtomicUsize,
    answer: Mutex<Answer>,
    /// How long a renewal takes before it renews (none by default).
    delay: Mutex<Duration>,
    /// Renewals started and not yet answered, and the most at once.
    in_flight: Arc<AtomicUsize>,
    most_in_flight: AtomicUsize,
    pushes: bool,
}

impl MemGroup {
    fn new(coordinator: &InMemoryLock, pushes: bool) -> Arc<Self> {
        Arc::new(Self {
            pushes,
            inner: coordinator.client(),
            members: Mutex::new(HashMap::new()),
            joined: AtomicUsize::new(0),
            left: AtomicUsize::new(0),
            renewals: AtomicUsize::new(0),
            answer: Mutex::new(Answer::Renew),
            delay: Mutex::new(Duration::ZERO),
            in_flight: Arc::new(AtomicUsize::new(0)),
            most_in_flight: AtomicUsize::new(0),
        })
    }
}

impl Grouped {
    fn new(coordinator: &InMemoryLock) -> Arc<Self> {
        Arc::new(Self {
            inner: coordinator.client(),
            group: MemGroup::new(coordinator, false),
            other: MemGroup::new(coordinator, true),
            own_renewals: AtomicUsize::new(0),
            watches: AtomicUsize::new(0),
        })
    }

    fn answer(&self, answer: Answer) {
        *self.group.answer.lock().unwrap() = answer;
    }
}

impl RenewalGroup for MemGroup {
    fn id(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    fn join(&self, lease: &Lease, lost: &LostSink) -> bool {
        self.joined.fetch_add(1, Ordering::SeqCst);
        let sink = self.pushes.then(|| lost.clone());
        let old = self
            .members
            .lock()
            .unwrap()
            .insert(lease.key().as_str().to_owned(), (lease.clone(), sink));
        assert!(old.is_none(), "{} joined twice", lease.key());
        self.pushes
    }

    fn leave(&self, lease: &Lease) {
        self.left.fetch_add(1, Ordering::SeqCst);
        let gone = self.members.lock().unwrap().remove(lease.key().as_str());
        assert!(gone.is_some(), "{} left without having joined", lease.key());
    }

    fn renew(
        &self,
        ttl: Duration,
        _until: Instant,
    ) -> BoxFuture<'static, std::result::Result<Instant, GroupRenewError>> {
        self.renewals.fetch_add(1, Ordering::SeqCst);
        let answer = *self.answer.lock().unwrap();
        let delay = *self.delay.lock().unwrap();
        let members: Vec<(Lease, Option<LostSink>)> =
            self.members.lock().unwrap().values().cloned().collect();
        let inner = self.inner.clone();
        let now_in_flight = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_in_flight
            .fetch_max(now_in_flight, Ordering::SeqCst);
        let in_flight = InFlight(self.in_flight.clone());
        Box::pin(async move {
            let _in_flight = in_flight;
            let sent_at = Instant::now();
            if !delay.is_zero() {
                // A coordinator that answers late: the renewal is pending meanwhile.
                sleep(delay).await;
            }
            match answer {
                Answer::Renew => {}
                Answer::Unavailable => {
                    return Err(GroupRenewError::Failed(Error::Unavailable {
                        backend: "grouped",
                        op: "renew",
                        message: "unreachable (this test's fault)".into(),
                        source: None,
                    }));
                }
                Answer::Gone => return Err(GroupRenewError::Lost(LossReason::SessionExpired)),
                Answer::Refused => {
                    return Err(GroupRenewError::Failed(Error::Backend {
                        backend: "grouped",
                        op: "renew",
                        message: "refused (this test's fault)".into(),
                        source: None,
                    }));
                }
            }
            for (mut lease, sink) in members {
                let renewed = DistributedLock::renew(&inner, &mut lease, ttl).await;
                // A member whose grant is gone is pushed — by the group, before it answers,
                // when it pushes; else by the member's own watch_lost.
                if let (Err(Error::NotHeld { .. }), Some(sink)) = (renewed, sink) {
                    sink.lost(LossReason::NotHeld);
                }
            }
            Ok(sent_at)
        })
    }
}

/// Counts a renewal out of flight when its future ends or is dropped.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[async_trait]
impl lock_core::raw::Driver for Grouped {
    fn backend_name(&self) -> &'static str {
        "grouped"
    }
    fn capabilities(&self) -> Capabilities {
        DistributedLock::capabilities(&self.inner)
    }
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        DistributedLock::try_acquire(&self.inner, key, ttl).await
    }
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        self.own_renewals.fetch_add(1, Ordering::SeqCst);
        DistributedLock::renew(&self.inner, lease, ttl).await
    }
    async fn release(&self, lease: &Lease) -> Result<bool> {
        DistributedLock::release(&self.inner, lease).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        DistributedLock::inspect(&self.inner, key).await
    }
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        DistributedLock::force_release(&self.inner, key).await
    }
    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        self.watches.fetch_add(1, Ordering::SeqCst);
        DistributedLock::watch_lost(&self.inner, lease)
    }
    fn renewal_group(&self, lease: &Lease) -> Option<SharedGroup> {
        if lease.key().as_str().starts_with(OTHER) {
            Some(self.other.clone())
        } else {
            Some(self.group.clone())
        }
    }
}

/// 1,000 guards of one client in one group: a tick is one group renewal and no renewal of a
/// lease of its own; every guard's deadline and renewal count follow the group's, and the
/// coordinator holds every key all along. An operator's force-release loses that one guard
/// (pushed) and takes it out of the group; the rest go on. Releasing the rest empties the
/// group: every member that joined left.
#[tokio::test(start_paused = true)]
async fn a_tick_of_many_members_is_one_group_renewal_and_each_loss_stays_its_own() {
    let (coordinator, driver, lock) = setup();
    let ttl = Duration::from_secs(3);
    let n = 1000;
    let guards = hold(&lock, "groups/many", n, ttl).await;
    assert_eq!(driver.group.joined.load(Ordering::SeqCst), n);

    // Three TTLs: about nine intervals of 1 s.
    sleep(ttl * 3).await;
    let group_renewals = driver.group.renewals.load(Ordering::SeqCst);
    assert!(
        (7..=13).contains(&group_renewals),
        "{group_renewals} group renewals in 9 intervals"
    );
    assert_eq!(
        driver.own_renewals.load(Ordering::SeqCst),
        0,
        "a member renewed on its own"
    );
    for g in &guards {
        assert!(!g.is_lost(), "{:?} lost: {:?}", g.key(), g.loss_reason());
        assert!(
            (group_renewals as u64).abs_diff(g.renewals()) <= 1,
            "{} renewals counted, the group made {group_renewals}",
            g.renewals()
        );
        assert!(g.local_deadline() > Instant::now() + ttl / 2);
        let held = coordinator.client().inspect(g.key()).await.unwrap();
        assert!(held.is_some(), "{} expired on the coordinator", g.key());
    }

    // The operator removes one holder: pushed, that guard alone is lost and leaves.
    let victim = &guards[17];
    force_release(&coordinator, victim).await;
    timeout(ttl, victim.lost())
        .await
        .expect("a force-release was not pushed");
    assert_eq!(victim.loss_reason(), Some(LossReason::Revoked));
    assert_eq!(driver.group.left.load(Ordering::SeqCst), 1);
    sleep(ttl * 2).await;
    for (i, g) in guards.iter().enumerate() {
        assert_eq!(g.is_lost(), i == 17, "{}: {:?}", g.key(), g.loss_reason());
    }

    for g in guards {
        g.release().await.unwrap();
    }
    assert_eq!(driver.group.left.load(Ordering::SeqCst), n);
    assert!(driver.group.members.lock().unwrap().is_empty());
}

/// The group's renewal failing temporarily is retried until the group's deadline, at which
/// every member is lost (`DeadlinePassed`) and no sooner; the coordinator never held a key
/// for less long than the guard believed. A group whose session ended loses every member at
/// once with that reason.
#[tokio::test(start_paused = true)]
async fn a_group_that_cannot_renew_loses_every_member_at_its_deadline_or_at_once() {
    let (coordinator, driver, lock) = setup();
    let ttl = Duration::from_secs(3);
    let guards = hold(&lock, "groups/failing", 50, ttl).await;
    sleep(ttl).await;
    let deadline = guards[0].local_deadline();
    assert!(guards.iter().all(|g| g.local_deadline() == deadline));

    driver.answer(Answer::Unavailable);
    let before = driver.group.renewals.load(Ordering::SeqCst);
    sleep_until_just_before(deadline).await;
    assert!(
        driver.group.renewals.load(Ordering::SeqCst) > before + 1,
        "the failing renewal was not retried"
    );
    for g in &guards {
        assert!(!g.is_lost(), "{} lost before its deadline", g.key());
        // The coordinator still holds it: the deadline was never later than its expiry.
        assert!(held_by_coordinator(&coordinator, g).await, "{}", g.key());
    }
    timeout(ttl, guards[0].lost())
        .await
        .expect("not lost a TTL after its group's deadline");
    assert!(Instant::now() >= deadline);
    for g in &guards {
        assert!(g.is_lost());
        assert_eq!(g.loss_reason(), Some(LossReason::DeadlinePassed));
    }
    assert_eq!(driver.group.left.load(Ordering::SeqCst), 50);
    drop(guards);

    // A second group (the first is gone with its members) whose session ends.
    driver.answer(Answer::Renew);
    let guards = hold(&lock, "groups/gone", 50, ttl).await;
    sleep(ttl / 2).await;
    driver.answer(Answer::Gone);
    let asked = Instant::now();
    timeout(ttl, guards[0].lost())
        .await
        .expect("not lost a TTL after its session ended");
    assert!(
        asked.elapsed() <= ttl / 2,
        "a lost session took {:?} to lose its members",
        asked.elapsed()
    );
    for g in &guards {
        assert_eq!(g.loss_reason(), Some(LossReason::SessionExpired));
    }
}

/// Two groups in one scheduler (two sessions of one client): each renews its own members,
/// and one group's end loses its members and none of the other's, which go on renewing.
#[tokio::test(start_paused = true)]
async fn two_groups_of_one_client_renew_and_end_apart() {
    let (_coordinator, driver, lock) = setup();
    let ttl = Duration::from_secs(3);
    let ours = hold(&lock, "groups/apart", 20, ttl).await;
    let others = hold(&lock, &format!("{OTHER}apart"), 20, ttl).await;
    assert_eq!(driver.group.joined.load(Ordering::SeqCst), 20);
    assert_eq!(driver.other.joined.load(Ordering::SeqCst), 20);
    sleep(ttl).await;
    assert!(driver.group.renewals.load(Ordering::SeqCst) >= 2);
    assert!(driver.other.renewals.load(Ordering::SeqCst) >= 2);
    assert_eq!(driver.own_renewals.load(Ordering::SeqCst), 0);

    *driver.other.answer.lock().unwrap() = Answer::Gone;
    timeout(ttl, others[0].lost())
        .await
        .expect("the other group's members were not lost when its session ended");
    for g in &others {
        assert_eq!(
            g.loss_reason(),
            Some(LossReason::SessionExpired),
            "{}",
            g.key()
        );
    }
    assert_eq!(driver.other.left.load(Ordering::SeqCst), 20);
    // Ours go on: renewed by their own group past several TTLs, none lost.
    let renewed = driver.group.renewals.load(Ordering::SeqCst);
    sleep(ttl * 3).await;
    assert!(driver.group.renewals.load(Ordering::SeqCst) >= renewed + 4);
    for g in &ours {
        assert!(!g.is_lost(), "{} lost with the other group", g.key());
        assert!(g.local_deadline() > Instant::now());
    }
    drop(others);
    for g in ours {
        assert!(g.release().await.unwrap());
    }
    assert_eq!(driver.group.left.load(Ordering::SeqCst), 20);
    assert!(driver.group.members.lock().unwrap().is_empty());
    // A group goes with its last member: nothing renews for nobody.
    let (ours_done, others_done) = (
        driver.group.renewals.load(Ordering::SeqCst),
        driver.other.renewals.load(Ordering::SeqCst),
    );
    sleep(ttl * 3).await;
    assert_eq!(driver.group.renewals.load(Ordering::SeqCst), ours_done);
    assert_eq!(driver.other.renewals.load(Ordering::SeqCst), others_done);
}

/// A group renewal the coordinator answers late is pending meanwhile: its answer still
/// reaches the scheduler (woken through the group's own waker), every member stays held, and
/// a group never has two renewals in flight.
#[tokio::test(start_paused = true)]
async fn a_group_renewal_answered_late_still_renews_every_member() {
    let (coordinator, driver, lock) = setup();
    let ttl = Duration::from_secs(3);
    // Most of the renewal interval (a third of the TTL).
    *driver.group.delay.lock().unwrap() = Duration::from_millis(800);
    let guards = hold(&lock, "groups/late", 20, ttl).await;
    sleep(ttl * 5).await;
    let renewals = driver.group.renewals.load(Ordering::SeqCst);
    assert!(renewals >= 8, "{renewals} group renewals in five TTLs");
    assert_eq!(driver.group.most_in_flight.load(Ordering::SeqCst), 1);
    for g in &guards {
        assert!(!g.is_lost(), "{} lost", g.key());
        assert!(g.local_deadline() > Instant::now());
        assert!(held_by_coordinator(&coordinator, g).await, "{}", g.key());
    }
}

/// A group renewal the coordinator refuses (no temporary failure) loses every member at
/// once, with `RenewFailed`: it is not retried until the deadline as an unreachable
/// coordinator is.
#[tokio::test(start_paused = true)]
async fn a_refused_group_renewal_loses_every_member_at_once() {
    let (_coordinator, driver, lock) = setup();
    let ttl = Duration::from_secs(3);
    let guards = hold(&lock, "groups/refused", 20, ttl).await;
    sleep(ttl / 2).await;
    driver.answer(Answer::Refused);
    let asked = Instant::now();
    timeout(ttl, guards[0].lost())
        .await
        .expect("not lost a TTL after its renewal was refused");
    let deadline = guards[0].local_deadline();
    assert!(
        Instant::now() < deadline,
        "lost only at the deadline ({:?} after the refusal): retried as a temporary failure",
        asked.elapsed()
    );
    for g in &guards {
        assert_eq!(
            g.loss_reason(),
            Some(LossReason::RenewFailed),
            "{}",
            g.key()
        );
    }
}

/// A group that pushes its members' losses to their sinks: no `watch_lost` future is asked for
/// its members (the bytes it saves per held lock), a member whose grant is gone is lost at the
/// group's next renewal, with the reason pushed, and leaves; its neighbours go on. A member of
/// a group that does not push still gets its `watch_lost`.
#[tokio::test(start_paused = true)]
async fn a_group_that_pushes_losses_needs_no_watch_per_member() {
    let (coordinator, driver, lock) = setup();
    let ttl = Duration::from_secs(3);
    let pushed = hold(&lock, &format!("{OTHER}pushed"), 20, ttl).await;
    assert_eq!(driver.other.joined.load(Ordering::SeqCst), 20);
    assert_eq!(
        driver.watches.load(Ordering::SeqCst),
        0,
        "a member whose loss is pushed got a watch_lost future"
    );
    let polled = hold(&lock, "groups/polled", 1, ttl).await;
    assert_eq!(driver.watches.load(Ordering::SeqCst), 1);

    let victim = &pushed[5];
    force_release(&coordinator, victim).await;
    let renewals = driver.other.renewals.load(Ordering::SeqCst);
    // Found by the next renewal (one interval, a third of the TTL), not at the deadline.
    timeout(ttl / 2, victim.lost())
        .await
        .expect("a member the group found gone was not lost");
    assert!(driver.other.renewals.load(Ordering::SeqCst) > renewals);
    assert_eq!(victim.loss_reason(), Some(LossReason::NotHeld));
    assert_eq!(driver.other.left.load(Ordering::SeqCst), 1);
    sleep(ttl * 2).await;
    for (i, g) in pushed.iter().enumerate() {
        assert_eq!(g.is_lost(), i == 5, "{}: {:?}", g.key(), g.loss_reason());
    }
    assert!(!polled[0].is_lost());
    for g in pushed {
        g.release().await.unwrap();
    }
    assert_eq!(driver.other.left.load(Ordering::SeqCst), 20);
    assert!(driver.other.members.lock().unwrap().is_empty());
}

/// A member's sink outlives its guard (a driver may still hold a clone when the guard is
/// released): a late push through it never reaches the guard that takes its place in the
/// scheduler next — whether that guard makes its group anew at the same place or joins a group
/// that lived on. Slots and groups are told apart by ids that only grow.
#[tokio::test(start_paused = true)]
async fn a_released_members_late_push_never_reaches_the_next_guard_in_its_place() {
    let (_coordinator, driver, lock) = setup();
    let ttl = Duration::from_secs(3);
    // Keeps the client's scheduler (and its ids) alive throughout.
    let keeper = hold(&lock, "groups/keeper", 1, ttl).await;
    // Holds one guard on `name` in the other group, releases it, and hands back its sink.
    let released_sink = |name: &'static str| {
        let (lock, driver) = (lock.clone(), driver.clone());
        async move {
            let held = hold(&lock, &format!("{OTHER}{name}"), 1, ttl).await;
            let sink = {
                let members = driver.other.members.lock().unwrap();
                let (_, sink) = &members[&format!("{OTHER}{name}/0")];
                sink.clone()
                    .expect("the other group keeps its members' sinks")
            };
            for g in held {
                assert!(g.release().await.unwrap());
            }
            sink
        }
    };
    // 1. The released guard was its group's only member: the next guard makes the group anew.
    let sink = released_sink("first").await;
    let next = hold(&lock, &format!("{OTHER}next"), 1, ttl).await;
    sink.lost(LossReason::Revoked);
    // 2. The group lives on (`next` stays in it): the released guard's place goes to a guard
    // that joins it.
    let sink = released_sink("second").await;
    let third = hold(&lock, &format!("{OTHER}third"), 1, ttl).await;
    sink.lost(LossReason::Revoked);
    sleep(ttl * 2).await;
    for g in [&keeper[0], &next[0], &third[0]] {
        assert!(
            !g.is_lost(),
            "a released member's push reached {}: {:?}",
            g.key(),
            g.loss_reason()
        );
    }
    for g in keeper.into_iter().chain(next).chain(third) {
        assert!(g.release().await.unwrap());
    }
}

/// A coordinator and a client of it whose every lease is in a renewal group.
fn setup() -> (InMemoryLock, Arc<Grouped>, DynLock) {
    let coordinator = InMemoryLock::new();
    let driver = Grouped::new(&coordinator);
    let lock: DynLock = driver.clone();
    (coordinator, driver, lock)
}

/// An operator's `release --force` of `guard`'s key, which the coordinator held.
async fn force_release(coordinator: &InMemoryLock, guard: &lock_core::LockGuard) {
    assert!(
        coordinator
            .client()
            .force_release(guard.key())
            .await
            .unwrap(),
        "{} was not held",
        guard.key()
    );
}

/// Whether the coordinator still records `guard`'s key as held.
async fn held_by_coordinator(coordinator: &InMemoryLock, guard: &lock_core::LockGuard) -> bool {
    coordinator
        .client()
        .inspect(guard.key())
        .await
        .unwrap()
        .is_some()
}

async fn sleep_until_just_before(at: Instant) {
    tokio::time::sleep_until(at - Duration::from_millis(20)).await;
}
