//! One renewal scheduler per client: every [`crate::LockGuard`] of a client is a slot in one
//! shared structure — its lease, its next renewal, its local deadline — served by one task with
//! one timer, instead of a task, a timer and a pair of cancellation tokens per guard.
//!
//! The task sleeps until the earliest instant any slot needs (a renewal, a local deadline, job
//! mode's `at_most`) or until a slot's future is woken. A renewal is still one
//! [`DistributedLock::renew`](crate::DistributedLock::renew) per lease — the drivers batch the
//! renewals that reach them together ([`crate::raw::Batcher`]) — but its future is polled by this
//! task through a per-slot waker, so a tick of N held locks costs N small polls, not N task
//! wake-ups and N timers. The same goes for each lease's
//! [`watch_lost`](crate::DistributedLock::watch_lost) future.
//!
//! Per slot, the rules are the old per-guard watchdog's, unchanged: a renewal starts at
//! [`next_renewal`]; while it is in flight the slot waits for its local deadline (a renewal
//! that has not answered by then loses the lease); a success moves the deadline (counted by the
//! driver from when the request was sent), a temporary failure retries after a backoff, a
//! permanent one or a pushed loss loses the lease at once. A panic in a driver's future loses
//! that slot alone (its lease is released in the background, after `lost()` has fired); the
//! task dying (its runtime shut down) loses every slot it serves the same way.
//!
//! The task runs on the runtime of the first guard it serves and ends when no slot needs it;
//! the next guard starts it again. A client is tied to one runtime anyway (its connections are).
//!
//! **Renewal groups** (issue 24). A guard whose lease belongs to a driver's
//! [`RenewalGroup`](crate::raw::RenewalGroup) (etcd's session lease, ZooKeeper's session) is a
//! *member* slot: it has no renewal and no timer of its own (only job mode's `at_most`). Its
//! group — one per group id, TTL and interval — is renewed like a slot, by one request, and
//! its deadline is every member's: a member's [`Status`] reads it. A tick of N members costs
//! one renewal and O(1) work here; the group's deadline passing, or its renewal failing for
//! good, loses every member (O(N), once). A member's own loss is pushed by its driver to the
//! member's [`LostSink`] (or, for a driver that does not push, by its `watch_lost`), which
//! takes it out of the group.

use std::{
    collections::{BTreeSet, HashMap, VecDeque},
    panic::{AssertUnwindSafe, catch_unwind},
    sync::{
        Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    task::{Context, Poll, Wake, Waker},
    time::Duration,
};

use futures::future::BoxFuture;
use tokio::{
    sync::{Notify, oneshot},
    time::Instant,
};
use tokio_util::sync::CancellationToken;

use crate::{
    DynLock, Error, Lease, LossReason, Result,
    raw::{Backoff, GroupRenewError, SharedGroup},
};

/// How many slots the task serves before it yields to the runtime's other tasks.
const CHUNK: usize = 256;

/// Marks a timer or waker index as a renewal group's (not a slot's).
const GROUP_BIT: usize = 1 << (usize::BITS - 1);

/// At most this many renewals of one client in flight; the rest wait their turn in the order
/// they came due. Locks taken together come due together (the renewal grid), and each renewal
/// in flight holds a few hundred bytes (its lease, the driver's request, the batcher's slot):
/// 100,000 at once would be most of a held lock's memory. The drivers batch what reaches them
/// (Redis 500 keys per script call, PostgreSQL 1,000 per statement, etcd 128 checks per txn), so
/// this many in flight keeps every batch full. Waiting does not touch safety: a lease's
/// deadline moves only from a renewal's send time, and a slot that waits past its local
/// deadline is lost then, as one whose renewal did not answer.
const MAX_IN_FLIGHT: usize = 4096;

/// What a guard, its jobs and its slot share: the local deadline, the renewal count, the loss
/// reason and the `lost()` token. Read without the scheduler's lock.
#[derive(Debug)]
pub(crate) struct Status {
    inner: Mutex<StatusInner>,
    renewals: AtomicU64,
}

/// A renewal group's deadline and renewal count, read by its members' [`Status`].
#[derive(Debug)]
pub(crate) struct GroupClock {
    deadline: Mutex<Instant>,
    renewals: AtomicU64,
}

impl GroupClock {
    fn deadline(&self) -> Instant {
        *locked(&self.deadline)
    }

    /// Moves the deadline to `at` if that is later.
    fn extend(&self, at: Instant) {
        let mut deadline = locked(&self.deadline);
        *deadline = (*deadline).max(at);
    }
}

#[derive(Debug)]
struct StatusInner {
    deadline: Instant,
    reason: Option<LossReason>,
    /// Made on first use (`lost()`, `lost_token()`, a job's view), cancelled once a reason is
    /// recorded: a guard nobody waits on never carries one (a token is ~120 bytes, most of a
    /// held lock's cost where locks are held per entity).
    lost: Option<CancellationToken>,
    /// A group member's group clock (its renewal count when the member joined is in
    /// `Status::renewals`, which a member does not count itself).
    group: Option<Arc<GroupClock>>,
}

impl Status {
    pub(crate) fn new(deadline: Instant) -> Self {
        Self {
            inner: Mutex::new(StatusInner {
                deadline,
                reason: None,
                lost: None,
                group: None,
            }),
            renewals: AtomicU64::new(0),
        }
    }

    /// Makes this status a member of the group whose clock is `clock`.
    fn join(&self, clock: &Arc<GroupClock>) {
        let mut inner = locked(&self.inner);
        self.renewals
            .store(clock.renewals.load(Ordering::Acquire), Ordering::Release);
        inner.group = Some(clock.clone());
    }

    /// The current conservative local deadline (a group member's: its group's).
    pub(crate) fn deadline(&self) -> Instant {
        let inner = locked(&self.inner);
        match &inner.group {
            Some(clock) => inner.deadline.max(clock.deadline()),
            None => inner.deadline,
        }
    }

    /// The loss reason recorded, if any.
    pub(crate) fn reason(&self) -> Option<LossReason> {
        locked(&self.inner).reason
    }

    /// Whether a loss was recorded (the `lost()` token is, or would be, cancelled).
    pub(crate) fn is_marked_lost(&self) -> bool {
        locked(&self.inner).reason.is_some()
    }

    /// The token cancelled on loss (made now if nobody asked before; cancelled at once if the
    /// loss was already recorded).
    pub(crate) fn lost_token(&self) -> CancellationToken {
        let mut inner = locked(&self.inner);
        let lost = inner.reason.is_some();
        inner
            .lost
            .get_or_insert_with(|| {
                let token = CancellationToken::new();
                if lost {
                    token.cancel();
                }
                token
            })
            .clone()
    }

    fn set_deadline(&self, deadline: Instant) {
        locked(&self.inner).deadline = deadline;
    }

    /// Successful renewals (a group member's: its group's since it joined).
    pub(crate) fn renewals(&self) -> u64 {
        let inner = locked(&self.inner);
        let own = self.renewals.load(Ordering::Acquire);
        match &inner.group {
            // A member's `renewals` holds its group's count when it joined.
            Some(clock) => clock.renewals.load(Ordering::Acquire).saturating_sub(own),
            None => own,
        }
    }
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Marks a guard lost once: records the reason and the metric, logs, cancels the token.
pub(crate) fn mark_lost(status: &Status, backend: &'static str, lease: &Lease, reason: LossReason) {
    let token = {
        let mut inner = locked(&status.inner);
        if inner.reason.is_some() {
            return;
        }
        inner.reason = Some(reason);
        inner.lost.clone()
    };
    crate::observe::record_loss(backend, reason);
    tracing::warn!(key = %lease.key(), token = %lease.token(), fencing = ?lease.fencing_token(), %reason, "lock ownership lost");
    if let Some(token) = token {
        token.cancel();
    }
}

/// When to renew next: `renewal_time(now, interval)`, but never so late that the renewal has
/// less than a quarter TTL (or, for a lease with less than that left, half of what is left)
/// to get through before the local deadline: a lease that started old (a direct grant counts
/// from its waiter's request) or an interval close to the TTL would otherwise renew only after
/// the deadline and be lost for nothing.
pub(crate) fn next_renewal(
    now: Instant,
    interval: Duration,
    deadline: Instant,
    ttl: Duration,
) -> Instant {
    let remaining = deadline.saturating_duration_since(now);
    let latest = (now + remaining / 2).max(deadline.checked_sub(ttl / 4).unwrap_or(now));
    renewal_time(now, interval).min(latest)
}

/// When to renew next: `interval` after `now`, moved *earlier* onto a process-wide grid of
/// `interval / 4`, so that every guard of the process with the same interval renews at the
/// same instants and a driver can batch them ([`crate::raw::Batcher`]): a tick of any number of
/// held locks then costs a few round trips instead of one per lock. Renewing early is always
/// safe; the gap between renewals stays between ¾ and 1 interval.
fn renewal_time(now: Instant, interval: Duration) -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let nominal = now + interval;
    let grid = interval / 4;
    let epoch = *EPOCH.get_or_init(Instant::now);
    let Some(since) = nominal.checked_duration_since(epoch) else {
        return nominal;
    };
    if grid.is_zero() {
        return nominal;
    }
    let aligned = since.as_nanos() - since.as_nanos() % grid.as_nanos();
    match u64::try_from(aligned) {
        Ok(nanos) => epoch + Duration::from_nanos(nanos),
        Err(_) => nominal,
    }
}

/// The process-wide instant every [`Tick`] counts from (set before any scheduler exists).
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// An instant of the scheduler's timers in 8 bytes (an `Option<Instant>` takes 16, and a slot
/// keeps three: issue 24): nanoseconds since [`epoch`], plus one.
///
/// Exact for every instant from the epoch on, for 584 years. An instant before the epoch
/// becomes the epoch: every such instant is already past when the scheduler compares it
/// with `now` (the epoch is set before the first scheduler, so `now` is never before it),
/// and the epoch is past too, so no comparison changes its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Tick(std::num::NonZeroU64);

impl Tick {
    fn at(instant: Instant) -> Self {
        let nanos = instant.saturating_duration_since(epoch()).as_nanos();
        // Saturating at 584 years.
        let nanos = u64::try_from(nanos).unwrap_or(u64::MAX);
        Self(std::num::NonZeroU64::MIN.saturating_add(nanos))
    }

    fn instant(self) -> Instant {
        epoch() + Duration::from_nanos(self.0.get() - 1)
    }
}

/// The renewal scheduler of one client (one [`DynLock`]).
pub(crate) struct Scheduler {
    lock: DynLock,
    state: Mutex<State>,
    ready: Arc<Ready>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = locked(&self.state);
        f.debug_struct("Scheduler")
            .field("backend", &self.lock.backend_name())
            .field("slots", &(state.slots.len() - state.free.len()))
            .field("groups", &state.group_ids.len())
            .field("active", &state.active)
            .field("running", &state.running)
            .finish()
    }
}

/// Slots whose futures were woken, losses pushed by drivers, and the task's wake-up.
struct Ready {
    woken: Mutex<Vec<usize>>,
    /// Members' losses pushed through their [`LostSink`], not yet applied.
    pushed: Mutex<Vec<(SlotRef, LossReason)>>,
    notify: Notify,
}

impl Ready {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            woken: Mutex::new(Vec::new()),
            pushed: Mutex::new(Vec::new()),
            notify: Notify::new(),
        })
    }
}

/// Where a driver pushes one renewal-group member's loss, instead of a
/// [`watch_lost`](crate::DistributedLock::watch_lost) future that lock-core keeps and polls
/// for each held lock (see [`RenewalGroup::join`](crate::raw::RenewalGroup::join)).
///
/// A push is applied by the client's renewal scheduler under its lock, before any group
/// renewal that answers after it: a member pushed lost is never given the deadline of a group
/// renewal that answered later. A sink whose guard is gone (released, or lost otherwise) does
/// nothing; pushing twice is pushing once.
#[derive(Clone)]
pub struct LostSink {
    ready: Arc<Ready>,
    at: SlotRef,
}

impl std::fmt::Debug for LostSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LostSink")
    }
}

impl LostSink {
    /// The member's lease is lost, for `reason`.
    pub fn lost(&self, reason: LossReason) {
        locked(&self.ready.pushed).push((self.at, reason));
        self.ready.notify.notify_one();
    }

    /// A sink that no scheduler reads, and where its pushes arrive: for a driver's tests of
    /// its [`RenewalGroup`](crate::raw::RenewalGroup) outside lock-core.
    pub fn detached() -> (Self, PushedLosses) {
        let ready = Ready::new();
        let sink = Self {
            ready: ready.clone(),
            at: SlotRef { index: 0, id: 0 },
        };
        (sink, PushedLosses { ready })
    }
}

/// The losses pushed to a [`LostSink::detached`] sink.
pub struct PushedLosses {
    ready: Arc<Ready>,
}

impl std::fmt::Debug for PushedLosses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PushedLosses")
    }
}

impl PushedLosses {
    /// The losses pushed so far and not yet taken, oldest first.
    pub fn take(&self) -> Vec<LossReason> {
        std::mem::take(&mut *locked(&self.ready.pushed))
            .into_iter()
            .map(|(_, reason)| reason)
            .collect()
    }

    /// Waits for the next push.
    pub async fn next(&self) -> LossReason {
        loop {
            // Registered before the look, so that a push between the two still wakes it.
            let notified = self.ready.notify.notified();
            {
                let mut pushed = locked(&self.ready.pushed);
                if !pushed.is_empty() {
                    return pushed.remove(0).1;
                }
            }
            notified.await;
        }
    }
}

/// A slot's waker: queues the slot's index for a poll (once until it is polled) and wakes the
/// task. A waker outliving its slot can only cause a spurious poll of whatever slot takes the
/// index next, which is harmless.
struct SlotWaker {
    ready: Arc<Ready>,
    index: usize,
    queued: AtomicBool,
}

impl SlotWaker {
    /// The waker of the slot (or, with [`GROUP_BIT`], the group) at `index`.
    fn new(ready: &Arc<Ready>, index: usize) -> Arc<Self> {
        Arc::new(Self {
            ready: ready.clone(),
            index,
            queued: AtomicBool::new(false),
        })
    }
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            locked(&self.ready.woken).push(self.index);
            self.ready.notify.notify_one();
        }
    }
}

struct State {
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// Every running slot sits here once, under its next wake-up.
    timers: BTreeSet<(Tick, usize)>,
    /// Running slots (the task ends when there are none).
    active: usize,
    /// Renewals in flight (at most [`MAX_IN_FLIGHT`]).
    in_flight: usize,
    /// Slots due for a renewal while [`MAX_IN_FLIGHT`] were in flight, in the order they came
    /// due.
    waiting: VecDeque<SlotRef>,
    next_id: u64,
    /// Whether the task is alive.
    running: bool,
    /// Renewal groups with members (their timers sit in `timers` with [`GROUP_BIT`]).
    groups: Vec<Option<Group>>,
    group_free: Vec<usize>,
    group_ids: HashMap<GroupKey, usize>,
}

/// A group's index in [`State::groups`], in 4 bytes (the index plus one), so that a slot's
/// `Option` of it fits beside the slot's phase instead of adding 16 bytes to every slot.
#[derive(Clone, Copy, PartialEq, Eq)]
struct GroupAt(std::num::NonZeroU32);

impl GroupAt {
    /// `None` past 2³² − 2 groups (a slot then renews on its own).
    fn new(index: usize) -> Option<Self> {
        let at = u32::try_from(index.checked_add(1)?).ok()?;
        std::num::NonZeroU32::new(at).map(Self)
    }

    fn index(self) -> usize {
        // u32 → usize is lossless on every target tokio runs on (32 and 64 bits).
        self.0.get() as usize - 1
    }
}

/// Which members one group renewal serves: the driver's group, the TTL, the interval.
type GroupKey = (usize, Duration, Duration);

/// A renewal group's slot: one renewal, one timer and one deadline for all its members.
struct Group {
    /// Told apart from a later group at the same index.
    id: u64,
    key: GroupKey,
    handle: SharedGroup,
    clock: Arc<GroupClock>,
    members: usize,
    next_renew: Instant,
    retry: Option<Box<Backoff>>,
    /// The renewal in flight (taken out while the task polls it).
    renewing: Option<GroupRenewal>,
    in_flight: bool,
    /// The instant under which the group sits in the timer set.
    wake: Option<Tick>,
    waker: Arc<SlotWaker>,
}

type GroupRenewal = BoxFuture<'static, std::result::Result<Instant, GroupRenewError>>;

impl Group {
    fn ttl(&self) -> Duration {
        self.key.1
    }

    fn interval(&self) -> Duration {
        self.key.2
    }

    fn next_wake(&self) -> Instant {
        let deadline = self.clock.deadline();
        if self.in_flight {
            deadline
        } else {
            deadline.min(self.next_renew)
        }
    }
}

impl State {
    fn new() -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            timers: BTreeSet::new(),
            active: 0,
            in_flight: 0,
            waiting: VecDeque::new(),
            next_id: 0,
            running: false,
            groups: Vec::new(),
            group_free: Vec::new(),
            group_ids: HashMap::new(),
        }
    }

    fn slot(&mut self, at: SlotRef) -> Option<&mut Slot> {
        self.slots
            .get_mut(at.index)?
            .as_mut()
            .filter(|s| s.id == at.id)
    }

    fn unschedule(&mut self, index: usize, slot: &mut Slot) {
        if let Some(at) = slot.wake.take() {
            self.timers.remove(&(at, index));
        }
    }

    /// Moves a running slot to its next wake-up in the timer set (a group member without
    /// `at_most` has none).
    fn reschedule(&mut self, index: usize) {
        let Self { slots, timers, .. } = self;
        let slot = slot_mut(slots, index);
        if let Some(at) = slot.wake.take() {
            timers.remove(&(at, index));
        }
        slot.wake = slot.next_wake();
        if let Some(wake) = slot.wake {
            timers.insert((wake, index));
        }
    }

    /// Moves a group to its next wake-up in the timer set.
    fn reschedule_group(&mut self, index: usize) {
        let Self { groups, timers, .. } = self;
        let Some(Some(group)) = groups.get_mut(index) else {
            return;
        };
        if let Some(at) = group.wake.take() {
            timers.remove(&(at, index | GROUP_BIT));
        }
        let wake = Tick::at(group.next_wake());
        group.wake = Some(wake);
        timers.insert((wake, index | GROUP_BIT));
    }

    /// Adds `lease` to the group `handle` names (made now if it has no member yet); returns its
    /// index.
    fn join_group(
        &mut self,
        ready: &Arc<Ready>,
        handle: SharedGroup,
        interval: Duration,
        lease: &Lease,
    ) -> usize {
        let key = (handle.id(), lease.ttl(), interval);
        let index = match self.group_ids.get(&key) {
            Some(&index) => index,
            None => {
                let index = match self.group_free.pop() {
                    Some(i) => i,
                    None => {
                        self.groups.push(None);
                        self.groups.len() - 1
                    }
                };
                let deadline = lease.local_deadline();
                let id = self.next_id;
                self.next_id += 1;
                self.groups[index] = Some(Group {
                    id,
                    key,
                    handle,
                    clock: Arc::new(GroupClock {
                        deadline: Mutex::new(deadline),
                        renewals: AtomicU64::new(0),
                    }),
                    members: 0,
                    next_renew: next_renewal(Instant::now(), interval, deadline, lease.ttl()),
                    retry: None,
                    renewing: None,
                    in_flight: false,
                    wake: None,
                    waker: SlotWaker::new(ready, index | GROUP_BIT),
                });
                self.group_ids.insert(key, index);
                index
            }
        };
        if let Some(Some(group)) = self.groups.get_mut(index) {
            group.members += 1;
            // The member's own deadline speaks for the group (the `RenewalGroup` contract).
            group.clock.extend(lease.local_deadline());
        }
        self.reschedule_group(index);
        index
    }

    /// Takes `slot` out of its group, if it is a member (`lost`: because it was lost, see
    /// [`RenewalGroup::leave_lost`](crate::raw::RenewalGroup::leave_lost)): the driver renews its lease no more and the lease keeps
    /// the deadline the group's renewals gave it. Hands back the group if this was its last
    /// member.
    fn leave_group(&mut self, slot: usize, lost: bool) -> Option<Group> {
        let Self { slots, groups, .. } = self;
        let slot = slots.get_mut(slot)?.as_mut()?;
        let index = slot.group.take()?.index();
        let group = groups.get(index)?.as_ref()?;
        slot.lease.extend_local_deadline(group.clock.deadline());
        if lost {
            group.handle.leave_lost(&slot.lease);
        } else {
            group.handle.leave(&slot.lease);
        }
        self.left_group(index)
    }

    /// A member left group `index`: the group goes with its last member (its renewal in flight
    /// is handed back, to be dropped outside the lock).
    fn left_group(&mut self, index: usize) -> Option<Group> {
        let group = self.groups.get_mut(index)?.as_mut()?;
        group.members -= 1;
        if group.members > 0 {
            return None;
        }
        let group = self.groups[index].take()?;
        if let Some(at) = group.wake {
            self.timers.remove(&(at, index | GROUP_BIT));
        }
        self.group_ids.remove(&group.key);
        self.group_free.push(index);
        Some(group)
    }
}

/// Where a guard's slot is.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotRef {
    index: usize,
    id: u64,
}

type Renewal = BoxFuture<'static, (Lease, Result<()>)>;

struct Slot {
    id: u64,
    /// The lease as last renewed.
    lease: Lease,
    status: Arc<Status>,
    interval: Option<Duration>,
    /// Job mode's `at_most`: no renewal after this, and the guard is lost then.
    renew_until: Option<Tick>,
    next_renew: Option<Tick>,
    /// Only while renewals fail temporarily.
    retry: Option<Box<Backoff>>,
    /// The instant under which the slot sits in the timer set.
    wake: Option<Tick>,
    /// Made when the slot first has a future to poll: a member whose loss its driver pushes
    /// has none.
    waker: Option<Arc<SlotWaker>>,
    /// The driver's `watch_lost` (`None` for a member whose loss is pushed to a [`LostSink`]).
    watch: Option<BoxFuture<'static, LossReason>>,
    /// The renewal in flight (taken out while the task polls it).
    renewing: Option<Renewal>,
    phase: Phase,
    end: End,
    /// The renewal group renewing this slot's lease (a member has no renewal of its own).
    group: Option<GroupAt>,
}

/// Where a running slot's renewal stands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waits for `next_renew`.
    Idle,
    /// Due, in [`State::waiting`] for a place in flight.
    Waiting,
    /// In flight.
    InFlight,
}

enum End {
    Running,
    /// Lost: nothing renews or watches it any more; the lease waits for the guard's release.
    Lost,
    /// A future of the slot panicked (or the task died): its lease is being released in the
    /// background, which answers here.
    Died(Option<oneshot::Receiver<Result<bool>>>),
}

/// What a guard's release takes out of its slot.
pub(crate) enum Taken {
    /// The lease as last renewed, still to be released.
    Lease(Lease),
    /// The slot died and a background release of this lease started (its answer, if it could
    /// be started).
    Died(Option<oneshot::Receiver<Result<bool>>>, Lease),
}

impl Slot {
    fn next_wake(&self) -> Option<Tick> {
        if self.group.is_some() {
            // The group's timer serves the deadline.
            return self.renew_until;
        }
        let deadline = Tick::at(self.lease.local_deadline());
        let mut wake = deadline;
        if self.phase == Phase::Idle
            && let Some(t) = self.next_renew
        {
            wake = wake.min(t);
        }
        Some(self.renew_until.map_or(wake, |t| t.min(wake)))
    }

    /// The local deadline (a group member's: its group's).
    fn deadline(&self) -> Instant {
        if self.group.is_some() {
            self.status.deadline()
        } else {
            self.lease.local_deadline()
        }
    }
}

/// Each client's scheduler by the client's address, and the map's size at its last sweep.
type Registry = (HashMap<usize, Weak<Scheduler>>, usize);

fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The scheduler of `lock`, created on first use; one per client for as long as any of its
/// guards lives.
pub(crate) fn for_lock(lock: &DynLock) -> Arc<Scheduler> {
    let key = Arc::as_ptr(lock).cast::<()>() as usize;
    let mut registry = locked(registry());
    let (map, swept_at) = &mut *registry;
    if let Some(found) = map.get(&key).and_then(Weak::upgrade) {
        return found;
    }
    // A live scheduler holds its client, so the address cannot have been reused by another
    // client while the entry was alive: a dead entry is simply replaced.
    // The timers' epoch is set before the first scheduler (see `Tick`).
    epoch();
    let scheduler = Arc::new(Scheduler {
        lock: lock.clone(),
        state: Mutex::new(State::new()),
        ready: Ready::new(),
    });
    map.insert(key, Arc::downgrade(&scheduler));
    if map.len() > 2 * (*swept_at).max(16) {
        map.retain(|_, w| w.strong_count() > 0);
        *swept_at = map.len();
    }
    scheduler
}

/// What a new slot is given.
pub(crate) struct NewSlot {
    pub(crate) lease: Lease,
    pub(crate) status: Arc<Status>,
    pub(crate) interval: Option<Duration>,
    pub(crate) renew_until: Option<Instant>,
}

impl Scheduler {
    /// The client this scheduler renews with.
    pub(crate) fn client(&self) -> &DynLock {
        &self.lock
    }

    /// Adds a guard's lease. A lease already lost (its loss recorded) gets a slot that only
    /// keeps it for the release.
    pub(crate) fn register(self: &Arc<Self>, new: NewSlot) -> SlotRef {
        let running = !new.status.is_marked_lost();
        // A renewed lease the driver renews in a group joins it.
        let group = new
            .interval
            .filter(|_| running)
            .and_then(|interval| Some((self.lock.renewal_group(&new.lease)?, interval)));
        let (at, spawn) = {
            let mut state = locked(&self.state);
            let index = match state.free.pop() {
                Some(i) => i,
                None => {
                    state.slots.push(None);
                    state.slots.len() - 1
                }
            };
            let id = state.next_id;
            state.next_id += 1;
            let at = SlotRef { index, id };
            let mut pushes = false;
            let group = group.and_then(|(handle, interval)| {
                // Every index is at most the vector's length; past 2³² − 2 groups the lease
                // renews on its own.
                GroupAt::new(state.groups.len())?;
                // Under the lock, with the slot's place taken: a loss the driver pushes at
                // once is applied only once the slot is in place, below.
                let sink = LostSink {
                    ready: self.ready.clone(),
                    at,
                };
                pushes = handle.join(&new.lease, &sink);
                let index = state.join_group(&self.ready, handle, interval, &new.lease);
                if let Some(group) = state.groups[index].as_ref() {
                    new.status.join(&group.clock);
                }
                GroupAt::new(index)
            });
            let watch = (running && !pushes).then(|| self.lock.watch_lost(&new.lease));
            let next_renew = new
                .interval
                .filter(|_| running && group.is_none())
                .map(|i| {
                    next_renewal(
                        Instant::now(),
                        i,
                        new.lease.local_deadline(),
                        new.lease.ttl(),
                    )
                });
            let waker = watch.is_some().then(|| SlotWaker::new(&self.ready, index));
            let mut slot = Slot {
                id,
                lease: new.lease,
                status: new.status,
                interval: new.interval,
                renew_until: new.renew_until.map(Tick::at),
                next_renew: next_renew.map(Tick::at),
                retry: None,
                wake: None,
                waker: waker.clone(),
                watch,
                renewing: None,
                phase: Phase::Idle,
                end: if running { End::Running } else { End::Lost },
                group,
            };
            let mut spawn = false;
            if running {
                slot.wake = slot.next_wake();
                if let Some(wake) = slot.wake {
                    state.timers.insert((wake, index));
                }
                state.active += 1;
                spawn = !std::mem::replace(&mut state.running, true);
            }
            state.slots[index] = Some(slot);
            drop(state);
            if let Some(waker) = waker {
                // The task polls the watch once, which registers its waker.
                waker.wake_by_ref();
            }
            (at, spawn)
        };
        if spawn {
            let task = TaskRun {
                scheduler: self.clone(),
                armed: true,
            };
            tokio::spawn(tokio::task::unconstrained(task.run()));
        }
        at
    }

    /// Applies the losses drivers pushed (a sink whose slot is gone, or lost already, is
    /// ignored).
    fn apply_pushed(&self, state: &mut State) {
        let pushed = std::mem::take(&mut *locked(&self.ready.pushed));
        for (at, reason) in pushed {
            if state
                .slot(at)
                .is_some_and(|slot| matches!(slot.end, End::Running))
            {
                self.lose(state, at.index, reason);
            }
        }
    }

    /// Removes a guard's slot (stopping its renewals: a renewal in flight is dropped, as a
    /// stopped watchdog's was) and hands back its lease.
    pub(crate) fn take(&self, at: SlotRef) -> Option<Taken> {
        let (slot, _gone) = {
            let mut state = locked(&self.state);
            state.slot(at)?;
            let gone = state.leave_group(at.index, false);
            let mut slot = state.slots.get_mut(at.index)?.take()?;
            state.unschedule(at.index, &mut slot);
            state.free.push(at.index);
            if matches!(slot.end, End::Running) {
                state.active -= 1;
            }
            if slot.phase == Phase::InFlight {
                state.in_flight -= 1;
            }
            (slot, gone)
        };
        // Its futures (and a group that went with it) are dropped here, outside the lock.
        let Slot { lease, end, .. } = slot;
        Some(match end {
            End::Died(rx) => Taken::Died(rx, lease),
            End::Running | End::Lost => Taken::Lease(lease),
        })
    }

    /// Polls what a waker or timer index names: a group's renewal or a slot's futures.
    fn poll(&self, index: usize) {
        if index & GROUP_BIT != 0 {
            self.poll_group(index & !GROUP_BIT);
        } else {
            self.poll_slot(index);
        }
    }

    /// Polls a slot's futures (its watch, its renewal in flight) and applies what they answer.
    fn poll_slot(&self, index: usize) {
        let (at, mut watch, mut renewing, waker) = {
            let mut state = locked(&self.state);
            let Some(Some(slot)) = state.slots.get_mut(index) else {
                return;
            };
            if !matches!(slot.end, End::Running) {
                return;
            }
            let waker = slot
                .waker
                .get_or_insert_with(|| SlotWaker::new(&self.ready, index))
                .clone();
            waker.queued.store(false, Ordering::Release);
            (
                SlotRef { index, id: slot.id },
                slot.watch.take(),
                slot.renewing.take(),
                waker,
            )
        };
        let waker = Waker::from(waker);
        let mut cx = Context::from_waker(&waker);
        let mut panicked = false;
        let mut pushed = None;
        if let Some(f) = watch.as_mut() {
            match catch_unwind(AssertUnwindSafe(|| f.as_mut().poll(&mut cx))) {
                Ok(Poll::Ready(reason)) => pushed = Some(reason),
                Ok(Poll::Pending) => {}
                Err(_) => panicked = true,
            }
        }
        let mut renewed = None;
        if !panicked
            && pushed.is_none()
            && let Some(f) = renewing.as_mut()
        {
            match catch_unwind(AssertUnwindSafe(|| f.as_mut().poll(&mut cx))) {
                Ok(Poll::Ready(answer)) => renewed = Some(answer),
                Ok(Poll::Pending) => {}
                Err(_) => panicked = true,
            }
        }
        let mut state = locked(&self.state);
        let Some(slot) = state.slot(at) else {
            // Released meanwhile: its futures go with it.
            drop(state);
            return;
        };
        if panicked {
            self.die(&mut state, index);
            return;
        }
        if let Some(reason) = pushed {
            self.lose(&mut state, index, reason);
            return;
        }
        slot.watch = watch;
        if let Some((lease, result)) = renewed {
            self.renewed(&mut state, index, lease, result);
        } else {
            slot.renewing = renewing;
        }
    }

    /// A slot's timer is due: lose it at its deadline or `at_most`, else start its renewal.
    /// Returns whether a renewal started (to be polled).
    fn fire(&self, state: &mut State, index: usize, now: Instant) -> bool {
        let Some(Some(slot)) = state.slots.get_mut(index) else {
            return false;
        };
        if !matches!(slot.end, End::Running) {
            return false;
        }
        if now >= slot.deadline() {
            self.lose(state, index, LossReason::DeadlinePassed);
            return false;
        }
        if slot.renew_until.is_some_and(|t| Tick::at(now) >= t) {
            self.lose(state, index, LossReason::HeldTooLong);
            return false;
        }
        let mut started = false;
        if slot.phase == Phase::Idle && slot.next_renew.is_some_and(|t| Tick::at(now) >= t) {
            if state.in_flight < MAX_IN_FLIGHT {
                self.start_renewal(state, index);
                started = true;
            } else {
                slot.phase = Phase::Waiting;
                let id = slot.id;
                state.waiting.push_back(SlotRef { index, id });
            }
        }
        state.reschedule(index);
        started
    }

    /// Starts the renewal of a running slot (to be polled, which sends it).
    fn start_renewal(&self, state: &mut State, index: usize) {
        let slot = slot_mut(&mut state.slots, index);
        let mut lease = slot.lease.clone();
        let ttl = lease.ttl();
        let client = self.lock.clone();
        slot.renewing = Some(Box::pin(async move {
            let result = client.renew(&mut lease, ttl).await;
            (lease, result)
        }));
        slot.phase = Phase::InFlight;
        state.in_flight += 1;
        state.reschedule(index);
    }

    /// Starts the renewals that waited for a place in flight, as places free up. Returns the
    /// slots to poll.
    fn start_waiting(&self, state: &mut State, out: &mut Vec<usize>) {
        while state.in_flight < MAX_IN_FLIGHT && out.len() < CHUNK {
            let Some(at) = state.waiting.pop_front() else {
                return;
            };
            if state
                .slot(at)
                .is_some_and(|s| s.phase == Phase::Waiting && matches!(s.end, End::Running))
            {
                self.start_renewal(state, at.index);
                out.push(at.index);
            }
        }
    }

    /// A renewal answered.
    fn renewed(&self, state: &mut State, index: usize, lease: Lease, result: Result<()>) {
        let slot = slot_mut(&mut state.slots, index);
        let now = Instant::now();
        // The deadline before this answer: once it has passed the guard has said it is lost
        // (`is_lost()` compares with it), so an answer that comes later — the timer of the
        // deadline not yet served — never makes it look held again.
        let passed = now >= slot.status.deadline();
        // The lease as the renewal left it (as the watchdog always kept it).
        slot.lease = lease;
        slot.phase = Phase::Idle;
        state.in_flight -= 1;
        if passed {
            self.lose(state, index, LossReason::DeadlinePassed);
            return;
        }
        match result {
            Ok(()) => {
                slot.status.set_deadline(slot.lease.local_deadline());
                slot.status.renewals.fetch_add(1, Ordering::AcqRel);
                slot.retry = None;
                let interval = slot.interval.unwrap_or(slot.lease.ttl() / 3);
                slot.next_renew = Some(Tick::at(next_renewal(
                    now,
                    interval,
                    slot.lease.local_deadline(),
                    slot.lease.ttl(),
                )));
            }
            Err(e) if e.is_temporary() => {
                tracing::warn!(key = %slot.lease.key(), error = %e, "lease renewal failed; retrying until the local deadline");
                let interval = slot.interval;
                let retry = slot.retry.get_or_insert_with(|| retry_backoff(interval));
                slot.next_renew = Some(Tick::at(now + retry.next_delay()));
            }
            Err(e) => {
                tracing::warn!(key = %slot.lease.key(), error = %e, "lease renewal refused");
                self.lose(state, index, refusal(&e));
                return;
            }
        }
        state.reschedule(index);
    }

    /// The slot is lost: nothing renews or watches it any more (a member leaves its group; a
    /// group left empty is dropped here, under the lock: its renewal's future only waits).
    fn lose(&self, state: &mut State, index: usize, reason: LossReason) {
        let _gone = state.leave_group(index, true);
        let State {
            slots,
            timers,
            active,
            in_flight,
            ..
        } = state;
        let slot = slot_mut(slots, index);
        slot.end = End::Lost;
        slot.watch = None;
        slot.renewing = None;
        slot.retry = None;
        if slot.phase == Phase::InFlight {
            *in_flight -= 1;
        }
        slot.phase = Phase::Idle;
        if let Some(at) = slot.wake.take() {
            timers.remove(&(at, index));
        }
        *active -= 1;
        mark_lost(&slot.status, self.lock.backend_name(), &slot.lease, reason);
    }

    /// A group's timer is due: lose its members at its deadline, else start its renewal.
    /// Returns whether a renewal started (to be polled).
    fn fire_group(&self, state: &mut State, index: usize, now: Instant) -> bool {
        let Some(Some(group)) = state.groups.get_mut(index) else {
            return false;
        };
        group.wake = None;
        if now >= group.clock.deadline() {
            self.lose_group(state, index, LossReason::DeadlinePassed);
            return false;
        }
        let mut started = false;
        if !group.in_flight && now >= group.next_renew {
            let until = group.clock.deadline();
            group.renewing = Some(group.handle.renew(group.ttl(), until));
            group.in_flight = true;
            started = true;
        }
        state.reschedule_group(index);
        started
    }

    /// Polls a group's renewal in flight and applies its answer.
    fn poll_group(&self, index: usize) {
        let (id, mut renewing, waker) = {
            let mut state = locked(&self.state);
            let Some(Some(group)) = state.groups.get_mut(index) else {
                return;
            };
            group.waker.queued.store(false, Ordering::Release);
            let Some(renewing) = group.renewing.take() else {
                return;
            };
            (group.id, renewing, group.waker.clone())
        };
        let waker = Waker::from(waker);
        let mut cx = Context::from_waker(&waker);
        let answer = catch_unwind(AssertUnwindSafe(|| renewing.as_mut().poll(&mut cx)));
        let mut state = locked(&self.state);
        // A group whose last member left meanwhile is gone; its index may serve a new one,
        // whose renewal is its own.
        let Some(Some(group)) = state
            .groups
            .get_mut(index)
            .filter(|g| g.as_ref().is_some_and(|g| g.id == id))
        else {
            return;
        };
        match answer {
            Ok(Poll::Pending) => group.renewing = Some(renewing),
            Ok(Poll::Ready(result)) => {
                drop(renewing);
                self.group_renewed(&mut state, index, result);
            }
            Err(_) => {
                drop(renewing);
                for member in members(&state, index) {
                    self.die(&mut state, member);
                }
            }
        }
    }

    /// A group's renewal answered.
    fn group_renewed(
        &self,
        state: &mut State,
        index: usize,
        result: std::result::Result<Instant, GroupRenewError>,
    ) {
        // A loss pushed before this answer is applied first: that member is not renewed by
        // it (the `LostSink` contract).
        self.apply_pushed(state);
        let Some(Some(group)) = state.groups.get_mut(index) else {
            return;
        };
        let now = Instant::now();
        group.in_flight = false;
        // As a slot's: once the deadline has passed, every member has said it is lost.
        if now >= group.clock.deadline() {
            self.lose_group(state, index, LossReason::DeadlinePassed);
            return;
        }
        match result {
            Ok(sent_at) => {
                let ttl = group.ttl();
                group
                    .clock
                    .extend(crate::lease::local_deadline(sent_at, ttl));
                group.clock.renewals.fetch_add(1, Ordering::AcqRel);
                group.retry = None;
                group.next_renew = next_renewal(now, group.interval(), group.clock.deadline(), ttl);
            }
            Err(GroupRenewError::Failed(e)) if e.is_temporary() => {
                tracing::warn!(error = %e, members = group.members, "renewal group failed to renew; retrying until the local deadline");
                let interval = group.interval();
                let retry = group
                    .retry
                    .get_or_insert_with(|| retry_backoff(Some(interval)));
                group.next_renew = now + retry.next_delay();
            }
            Err(GroupRenewError::Failed(e)) => {
                tracing::warn!(error = %e, members = group.members, "renewal group renewal refused");
                self.lose_group(state, index, refusal(&e));
                return;
            }
            Err(GroupRenewError::Lost(reason)) => {
                tracing::warn!(%reason, members = group.members, "renewal group lost");
                self.lose_group(state, index, reason);
                return;
            }
        }
        state.reschedule_group(index);
    }

    /// Every member of group `index` is lost (which removes the group with its last one).
    fn lose_group(&self, state: &mut State, index: usize, reason: LossReason) {
        for member in members(state, index) {
            self.lose(state, member, reason);
        }
    }

    /// A future of the slot panicked, or the task died: nothing renews the lease any more, so
    /// nobody may go on trusting it — and nobody gains by keeping it until its TTL runs out, so
    /// it is released in the background at once (after `lost()` has fired: the release waits
    /// for the token, so no other client can be granted the key while this guard still looks
    /// held).
    fn die(&self, state: &mut State, index: usize) {
        let slot = slot_mut(&mut state.slots, index);
        tracing::error!(key = %slot.lease.key(), "the lock watchdog stopped unexpectedly; releasing the lease");
        let (tx, rx) = oneshot::channel();
        let (client, lost, latest) = (
            self.lock.clone(),
            slot.status.lost_token(),
            slot.lease.clone(),
        );
        // Queued before the loss wakes anyone, so that on a single-threaded runtime the key is
        // free by the time a waiter on `lost()` looks.
        let spawned = crate::raw::cleanup::spawn(async move {
            lost.cancelled().await;
            let _ = tx.send(client.release(&latest).await);
        });
        self.lose(state, index, LossReason::RenewFailed);
        slot_mut(&mut state.slots, index).end = End::Died(spawned.then_some(rx));
    }
}

/// The loss a refused renewal (a slot's or a group's) causes.
fn refusal(e: &Error) -> LossReason {
    if matches!(e, Error::NotHeld { .. }) {
        LossReason::NotHeld
    } else {
        LossReason::RenewFailed
    }
}

/// The pauses between retries of a renewal that failed temporarily (a slot's or a group's),
/// until the local deadline.
fn retry_backoff(interval: Option<Duration>) -> Box<Backoff> {
    Box::new(
        interval
            .map(|i| Backoff::new(i / 8, i / 2))
            .unwrap_or_default(),
    )
}

/// The running members of group `index` (a scan: only when the group is lost).
fn members(state: &State, index: usize) -> Vec<usize> {
    state
        .slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            s.as_ref()
                .filter(|s| {
                    s.group.map(GroupAt::index) == Some(index) && matches!(s.end, End::Running)
                })
                .map(|_| i)
        })
        .collect()
}

fn slot_mut(slots: &mut [Option<Slot>], index: usize) -> &mut Slot {
    match slots.get_mut(index) {
        Some(Some(slot)) => slot,
        // Callers look the slot up first, under the same lock.
        _ => unreachable!("a slot looked up under the same lock"),
    }
}

/// The task. Dropped unfinished (a panic of its own, its runtime shutting down), it loses
/// every slot it served as a panicking slot is lost, and marks itself stopped so that the next
/// guard starts a new one.
struct TaskRun {
    scheduler: Arc<Scheduler>,
    /// Cleared when the task ends by itself (under the lock that also clears `running`, after
    /// which a new task may start and must not be disturbed by this one's drop).
    armed: bool,
}

impl Drop for TaskRun {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let s = &self.scheduler;
        let mut state = locked(&s.state);
        state.running = false;
        for index in 0..state.slots.len() {
            if matches!(&state.slots[index], Some(slot) if matches!(slot.end, End::Running)) {
                s.die(&mut state, index);
            }
        }
    }
}

impl TaskRun {
    async fn run(mut self) {
        let s = self.scheduler.clone();
        let sleep = tokio::time::sleep_until(Instant::now() + Duration::from_secs(3600));
        tokio::pin!(sleep);
        let mut woken = Vec::new();
        let mut due = Vec::new();
        loop {
            // Pushed losses first, then woken futures: renewals that answered move their
            // slots' timers.
            s.apply_pushed(&mut locked(&s.state));
            std::mem::swap(&mut woken, &mut *locked(&s.ready.woken));
            for chunk in woken.chunks(CHUNK) {
                for &index in chunk {
                    s.poll(index);
                }
                if woken.len() > CHUNK {
                    tokio::task::yield_now().await;
                }
            }
            woken.clear();
            // Renewals that waited for the places those answers freed.
            loop {
                locked_start_waiting(&s, &mut due);
                if due.is_empty() {
                    break;
                }
                poll_each(&s, &mut due).await;
            }
            // Then every slot whose time has come.
            let now = Instant::now();
            let now_tick = Tick::at(now);
            loop {
                {
                    let mut state = locked(&s.state);
                    while due.len() < CHUNK {
                        match state.timers.first() {
                            Some(&(at, index)) if at <= now_tick => {
                                state.timers.pop_first();
                                if index & GROUP_BIT != 0 {
                                    if s.fire_group(&mut state, index & !GROUP_BIT, now) {
                                        due.push(index);
                                    }
                                    continue;
                                }
                                if let Some(Some(slot)) = state.slots.get_mut(index) {
                                    slot.wake = None;
                                }
                                if s.fire(&mut state, index, now) {
                                    due.push(index);
                                }
                            }
                            _ => break,
                        }
                    }
                }
                if due.is_empty() {
                    break;
                }
                // The renewals that started are polled once, which sends them.
                poll_each(&s, &mut due).await;
            }
            let next = {
                let mut state = locked(&s.state);
                if state.active == 0 {
                    state.running = false;
                    self.armed = false;
                    return;
                }
                state.timers.first().map(|&(at, _)| at.instant())
            };
            if !locked(&s.ready.woken).is_empty() || !locked(&s.ready.pushed).is_empty() {
                continue;
            }
            let more_to_start = {
                let state = locked(&s.state);
                state.in_flight < MAX_IN_FLIGHT && !state.waiting.is_empty()
            };
            if more_to_start {
                continue;
            }
            if let Some(at) = next {
                sleep.as_mut().reset(at);
            }
            tokio::select! {
                () = s.ready.notify.notified() => {}
                () = &mut sleep, if next.is_some() => {}
            }
        }
    }
}

/// Polls each slot of `due` once, empties it, and yields to the runtime's other tasks.
async fn poll_each(s: &Scheduler, due: &mut Vec<usize>) {
    for &index in due.iter() {
        s.poll(index);
    }
    due.clear();
    tokio::task::yield_now().await;
}

fn locked_start_waiting(s: &Scheduler, out: &mut Vec<usize>) {
    let mut state = locked(&s.state);
    s.start_waiting(&mut state, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 24: a held lock's memory in lock-core is mostly its slot (in the scheduler's
    /// vector) and its `Status` (an allocation of its own): renewal groups must not grow them.
    #[test]
    fn a_slot_and_a_status_stay_small() {
        let (slot, status) = (size_of::<Option<Slot>>(), size_of::<Status>());
        eprintln!("slot {slot} B, status {status} B");
        // 264 B before renewal groups (a member's group index sits in the phase's padding);
        // 240 B since the lease is 88 B, not 112; 216 B since its three instants are `Tick`s.
        assert!(slot <= 216, "a slot takes {slot} B");
        // 48 B before: with its `Arc` counts, 72 B or less stays in glibc's 80-byte chunk.
        assert!(status <= 56, "a status takes {status} B");
    }

    /// A tick is exact from the epoch on, and an instant before the epoch compares as the
    /// epoch: past, as it was.
    #[test]
    fn ticks_are_exact_and_an_instant_before_the_epoch_is_the_epoch() {
        let epoch = epoch();
        for later in [0, 1, 999, 1_000_000_007, 86_400 * 1_000_000_000 * 365] {
            let at = epoch + Duration::from_nanos(later);
            assert_eq!(Tick::at(at).instant(), at);
        }
        let now = Instant::now();
        assert!(Tick::at(now) < Tick::at(now + Duration::from_nanos(1)));
        if let Some(before) = epoch.checked_sub(Duration::from_secs(1)) {
            assert_eq!(Tick::at(before), Tick::at(epoch));
            assert!(Tick::at(before) <= Tick::at(now));
        }
        assert_eq!(size_of::<Option<Tick>>(), 8);
    }

    #[test]
    fn renewal_times_share_a_grid_and_are_never_late() {
        let interval = Duration::from_millis(2000);
        let base = Instant::now();
        let mut seen = std::collections::BTreeSet::new();
        for offset_ms in (0..2000).step_by(7) {
            let now = base + Duration::from_millis(offset_ms);
            let at = renewal_time(now, interval);
            assert!(at <= now + interval, "never later than one interval");
            assert!(at > now + interval * 3 / 4, "at most a quarter early");
            seen.insert(at);
        }
        // 2 s of acquisition times land on at most 5 distinct renewal instants.
        assert!(seen.len() <= 5, "{} distinct renewal times", seen.len());
    }

    /// A group that is never renewed here: the timer-set test below only moves its timer.
    #[derive(Debug)]
    struct IdleGroup;

    impl crate::raw::RenewalGroup for IdleGroup {
        fn id(&self) -> usize {
            1
        }

        fn join(&self, _lease: &Lease, _lost: &LostSink) -> bool {
            false
        }

        fn leave(&self, _lease: &Lease) {}

        fn renew(
            &self,
            _ttl: Duration,
            _until: Instant,
        ) -> BoxFuture<'static, std::result::Result<Instant, GroupRenewError>> {
            Box::pin(std::future::pending())
        }
    }

    /// Group 0 with one member, due at `at`, renewed every third of `ttl` from `now`.
    fn idle_group(now: Instant, ttl: Duration, at: Tick) -> Group {
        Group {
            id: 0,
            key: (1, ttl, ttl / 3),
            handle: Arc::new(IdleGroup),
            clock: Arc::new(GroupClock {
                deadline: Mutex::new(now + ttl),
                renewals: AtomicU64::new(0),
            }),
            members: 1,
            next_renew: now + ttl / 3,
            retry: None,
            renewing: None,
            in_flight: false,
            wake: Some(at),
            waker: SlotWaker::new(&Ready::new(), GROUP_BIT),
        }
    }

    /// A group's timer and a slot's can sit under the same instant (both on the renewal grid):
    /// moving the group's takes out the group's entry, never the slot's, or the slot would
    /// never be served again — its local deadline included.
    #[tokio::test(start_paused = true)]
    async fn moving_a_groups_timer_leaves_a_slots_timer_at_the_same_instant() {
        let mut state = State::new();
        let now = Instant::now();
        let at = Tick::at(now);
        let ttl = Duration::from_secs(3);
        state.groups.push(Some(idle_group(now, ttl, at)));
        // Slot 0 and group 0, both due at `at`.
        state.timers.insert((at, 0));
        state.timers.insert((at, GROUP_BIT));
        state.reschedule_group(0);
        let moved = Tick::at(now + ttl / 3);
        assert_eq!(
            state.timers.iter().copied().collect::<Vec<_>>(),
            vec![(at, 0), (moved, GROUP_BIT)],
            "the slot's timer stays, the group's moves to its next renewal"
        );
    }

    /// A released guard's timer leaves the timer set with its slot (else the task would wake
    /// for it, or serve whatever slot takes its place, at the old instant); the scheduler's
    /// `Debug` counts the slots in use, not the vector's length.
    #[tokio::test(start_paused = true)]
    async fn a_released_guard_leaves_no_timer_behind() {
        use crate::DistributedLockExt;
        let lock: DynLock = Arc::new(crate::InMemoryLock::new());
        let ttl = Duration::from_secs(3);
        let a = lock.lock("renewer/timers/a").ttl(ttl).try_acquire().await;
        let b = lock.lock("renewer/timers/b").ttl(ttl).try_acquire().await;
        let (a, b) = (a.unwrap().unwrap(), b.unwrap().unwrap());
        let scheduler = for_lock(&lock);
        let timers = || locked(&scheduler.state).timers.len();
        assert_eq!(timers(), 2);
        assert!(a.release().await.unwrap());
        assert_eq!(timers(), 1, "the released guard's timer stayed");
        let debug = format!("{scheduler:?}");
        assert!(
            debug.starts_with("Scheduler") && debug.contains("slots: 1,"),
            "{debug}"
        );
        assert!(b.release().await.unwrap());
        assert_eq!(timers(), 0);
    }

    /// A detached sink (drivers' tests read their pushes through it) hands its pushes over
    /// one by one or all at once, in the order they came, and `next` waits for one.
    #[tokio::test(start_paused = true)]
    async fn a_detached_sink_hands_its_pushes_over_in_order() {
        let (sink, pushed) = LostSink::detached();
        assert_eq!(format!("{sink:?}"), "LostSink");
        assert_eq!(format!("{pushed:?}"), "PushedLosses");
        assert!(pushed.take().is_empty());
        assert!(
            tokio::time::timeout(Duration::from_secs(1), pushed.next())
                .await
                .is_err(),
            "next() answered with nothing pushed"
        );
        sink.lost(LossReason::Revoked);
        sink.lost(LossReason::NotHeld);
        sink.clone().lost(LossReason::SessionExpired);
        let first = tokio::time::timeout(Duration::from_secs(1), pushed.next()).await;
        assert_eq!(first.ok(), Some(LossReason::Revoked));
        assert_eq!(
            pushed.take(),
            vec![LossReason::NotHeld, LossReason::SessionExpired]
        );
        assert!(pushed.take().is_empty());
    }

    /// The last member leaving takes its group's timer out, and only the group's: a slot's
    /// timer under the same instant stays.
    #[tokio::test(start_paused = true)]
    async fn a_group_gone_with_its_last_member_leaves_a_slots_timer_at_the_same_instant() {
        let mut state = State::new();
        let now = Instant::now();
        let at = Tick::at(now);
        let ttl = Duration::from_secs(3);
        let group = idle_group(now, ttl, at);
        state.group_ids.insert(group.key, 0);
        state.groups.push(Some(group));
        state.timers.insert((at, 0));
        state.timers.insert((at, GROUP_BIT));
        assert!(
            state.left_group(0).is_some(),
            "the last member's group goes"
        );
        assert_eq!(
            state.timers.iter().copied().collect::<Vec<_>>(),
            vec![(at, 0)]
        );
        assert!(state.group_ids.is_empty());
        assert_eq!(state.group_free, vec![0]);
    }

    /// The registry of schedulers forgets clients whose scheduler is gone (it is swept as it
    /// grows, so it stays bounded however many clients come and go) and never a live one: a
    /// client keeps its one scheduler across every sweep.
    #[tokio::test(start_paused = true)]
    async fn the_scheduler_registry_stays_bounded_and_keeps_live_clients() {
        let live: DynLock = Arc::new(crate::InMemoryLock::new());
        let scheduler = for_lock(&live);
        // Kept alive, so that no address is reused: every entry below stays a distinct dead one.
        let mut gone = Vec::new();
        for _ in 0..300 {
            let client: DynLock = Arc::new(crate::InMemoryLock::new());
            drop(for_lock(&client));
            gone.push(client);
        }
        assert!(
            Arc::ptr_eq(&scheduler, &for_lock(&live)),
            "a sweep dropped a live client's scheduler"
        );
        // Swept whenever it doubles past 16 live entries (other tests' clients included).
        let entries = locked(registry()).0.len();
        assert!(entries <= 100, "{entries} entries for 300 clients gone");
    }

    /// The in-memory coordinator behind renewals that take 50 ms.
    #[derive(Debug)]
    struct SlowRenewals(crate::InMemoryLock);

    #[crate::raw::async_trait]
    impl crate::raw::Driver for SlowRenewals {
        fn backend_name(&self) -> &'static str {
            "slow-renewals"
        }
        fn capabilities(&self) -> crate::Capabilities {
            crate::DistributedLock::capabilities(&self.0)
        }
        async fn try_acquire(&self, key: &crate::LockKey, ttl: Duration) -> Result<Option<Lease>> {
            crate::DistributedLock::try_acquire(&self.0, key, ttl).await
        }
        async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
            tokio::time::sleep(Duration::from_millis(50)).await;
            crate::DistributedLock::renew(&self.0, lease, ttl).await
        }
        async fn release(&self, lease: &Lease) -> Result<bool> {
            crate::DistributedLock::release(&self.0, lease).await
        }
        async fn inspect(&self, key: &crate::LockKey) -> Result<Option<crate::HolderInfo>> {
            crate::DistributedLock::inspect(&self.0, key).await
        }
        fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
            crate::DistributedLock::watch_lost(&self.0, lease)
        }
    }

    /// A guard released, or lost, while its renewal is in flight gives its place in flight
    /// back (the places are capped: places never given back would stop every later renewal,
    /// and every held lock would be lost at its deadline).
    #[tokio::test(start_paused = true)]
    async fn guards_released_or_lost_while_their_renewal_is_in_flight_give_their_place_back() {
        use crate::DistributedLockExt;
        let coordinator = crate::InMemoryLock::new();
        let lock: DynLock = Arc::new(SlowRenewals(coordinator.client()));
        let ttl = Duration::from_secs(3);
        let acquire = |key: String| {
            let lock = lock.clone();
            async move {
                let guard = lock.lock(key).ttl(ttl).try_acquire().await;
                guard.unwrap().expect("a fresh key is free")
            }
        };
        let keeper = acquire("renewer/in-flight/keeper".into()).await;
        let scheduler = for_lock(&lock);
        let in_flight = || locked(&scheduler.state).in_flight;
        // 64 guards on `prefix`, once their renewals are out together.
        let hold_in_flight = |prefix: &'static str| async move {
            let mut guards = Vec::new();
            for i in 0..64 {
                guards.push(acquire(format!("renewer/in-flight/{prefix}/{i}")).await);
            }
            tokio::time::timeout(ttl, async {
                while in_flight() < 60 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await
            .expect("the renewals never went out together");
            guards
        };
        // Released.
        let guards = hold_in_flight("released").await;
        for g in guards {
            assert!(g.release().await.unwrap());
        }
        assert!(in_flight() <= 1, "{} places in flight kept", in_flight());
        // Lost: an operator's force-release, pushed while the renewal is out.
        let guards = hold_in_flight("lost").await;
        for g in &guards {
            assert!(
                crate::DistributedLock::force_release(&coordinator, g.key())
                    .await
                    .unwrap()
            );
        }
        for g in &guards {
            tokio::time::timeout(Duration::from_millis(10), g.lost())
                .await
                .expect("a force-release was not pushed at once");
        }
        assert!(in_flight() <= 1, "{} places in flight kept", in_flight());
        drop(guards);
        tokio::time::sleep(ttl * 2).await;
        assert!(in_flight() <= 1, "{} places in flight kept", in_flight());
        assert!(!keeper.is_lost());
        assert!(keeper.renewals() >= 4, "{}", keeper.renewals());
        assert!(keeper.release().await.unwrap());
    }

    /// The task dropped unfinished (its runtime shut down) loses every slot it served: nothing
    /// renews them any more, so no guard may go on looking held.
    #[test]
    fn a_task_whose_runtime_shuts_down_loses_every_slot() {
        use crate::DistributedLockExt;
        let lock: DynLock = Arc::new(crate::InMemoryLock::new());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let guards: Vec<_> = runtime.block_on(async {
            let mut guards = Vec::new();
            for i in 0..3 {
                let guard = lock
                    .lock(format!("renewer/runtime-gone/{i}"))
                    .ttl(Duration::from_secs(30))
                    .try_acquire()
                    .await;
                guards.push(guard.unwrap().expect("a fresh key is free"));
            }
            guards
        });
        assert!(guards.iter().all(|g| !g.is_lost()));
        drop(runtime);
        for g in &guards {
            assert!(g.is_lost(), "{} still looks held", g.key());
            assert_eq!(g.loss_reason(), Some(LossReason::RenewFailed));
        }
    }
}
