//! Leader election over any lock: campaign, lead until lost, resign; who leads now; a stream of
//! leader changes.
//!
//! An [`Election`] is the lock on the key `election/<name>`: its holder is the leader. The
//! leader's *value* ([`Leader::value`]) is the label of its connection (the `label=` option of
//! the URL, `distlock elect --value`, or [`crate::InMemoryLock::with_label`]) until it
//! [proclaims](Leadership::proclaim) another; beside it the connection records its
//! [`HolderIdentity`] (host, pid, start time and that label, [`Leader::holder`]). Its *term*
//! is the grant's fencing token, strictly increasing per key on every backend that claims
//! fencing. It works on every backend with no driver support beyond the lock itself, and a
//! backend that mints no fencing tokens is refused ([`Error::Unsupported`], before any I/O):
//! an election without terms cannot fence.
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use lock_core::{Election, FencedRegister, InMemoryLock};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> lock_core::Result<()> {
//! let coordinator = InMemoryLock::new();
//! let scheduler_a = Arc::new(coordinator.client().with_label("scheduler-a")?);
//! let scheduler_b = Arc::new(coordinator.client().with_label("scheduler-b")?);
//! let election_a = Election::new(scheduler_a, "order-scheduler")?.ttl(Duration::from_secs(10));
//! let election_b = Election::new(scheduler_b, "order-scheduler")?.ttl(Duration::from_secs(10));
//!
//! // A leads (its lease renews itself until it resigns or loses it).
//! let leadership = election_a.campaign(Duration::from_secs(5)).await?;
//! // B is not leader while A is, and sees who is.
//! assert!(election_b.try_campaign().await?.is_none());
//! let leader = election_b.leader().await?.expect("A leads");
//! assert_eq!(leader.term, Some(leadership.term()));
//! assert_eq!(leader.value.as_deref(), Some("scheduler-a"));
//! assert!(leader.holder.is_some_and(|who| who.as_str().ends_with("label=scheduler-a")));
//!
//! // The term is a fencing token: the resource refuses a deposed leader's writes.
//! let ledger = FencedRegister::new();
//! ledger.write(leadership.term(), "scan by A").expect("A's term is current");
//! let old_term = leadership.term();
//! tokio::select! {
//!     () = leadership.lost() => eprintln!("deposed: {:?}", leadership.loss_reason()),
//!     () = async { /* the leader's work */ } => {}
//! }
//! assert!(leadership.resign().await?);
//!
//! let leadership = election_b.campaign(Duration::from_secs(5)).await?;
//! assert!(leadership.term() > old_term);
//! ledger.write(leadership.term(), "scan by B").expect("B's term is newer");
//! assert!(ledger.write(old_term, "late scan by A").is_err());
//! leadership.resign().await?;
//! # Ok(()) }
//! ```
//!
//! # Compared with etcd and Curator
//!
//! [`Election::campaign`] / [`Leadership::resign`] / [`Election::leader`] / [`Election::observe`]
//! map to etcd's `concurrency.Election` (`Campaign`, `Resign`, `Leader`, `Observe`) and to
//! Apache Curator's `LeaderSelector` (`start` until `takeLeadership` is called, returning from
//! it, `getLeader`, a listener). Unlike those (and client-go's `leaderelection`), every
//! leadership has a term that fences by default: pass [`Leadership::term`] to the protected
//! resource with each write, so that a leader that was paused past its lease and deposed has its
//! late writes refused.
//!
//! On etcd and ZooKeeper it **interoperates** with them: the drivers put the lock
//! `election/<name>` where the native recipe keeps the election of that path, and that recipe
//! is the same mutex as our lock, so each side waits for the other and [`Election::leader`]
//! reports a foreign leader (its value as [`Leader::value`], no [`Leader::holder`], its create
//! revision / czxid as the term):
//!
//! | backend | the election `<name>` is | a foreign leader's value |
//! |---|---|---|
//! | etcd, key prefix `P` (`distlock/`) | `etcdctl elect Pelection/<name>` (Go's `concurrency.Election` on that prefix) | what it proclaimed |
//! | ZooKeeper, root `R` (`/distlock`) | Curator's `LeaderSelector` on the leader path `R/election/<name>` | its participant id |
//!
//! `/` and `%` in `<name>` are percent-escaped as in any lock key (and `lock-` is written
//! `lock%2D` on ZooKeeper). What they read for our leader is exactly its value: the candidate
//! key's value on etcd (what `Election.Observe` / `etcdctl elect -l` print), the contender
//! node's data on ZooKeeper (Curator's participant id). Our identity and ownership token are
//! kept where no peer parses them — on etcd a sidecar key `<prefix>\0holder/…` written in the
//! same txn on the same lease, on ZooKeeper the token in the node's name and the identity in
//! an ephemeral node of the session outside the election's directory (see each driver's
//! README). A leader of ours without a value shows them its identity (`host=… pid=… since=…`),
//! never its token. Curator's `LeaderLatch` (its `latch-` nodes) does not interoperate. On
//! Redis and PostgreSQL the election is our lock only.
//!
//! # Proclaim and push
//!
//! [`Leadership::proclaim`] is etcd's `Proclaim`: the leader changes its value (and the label of
//! its identity) while keeping its grant and term, by a write that compares on the grant
//! ([`crate::raw::Driver::relabel`], [`crate::Capabilities::relabel`]); [`Election::leader`]
//! and [`Election::observe`] then report the new value with the same term, and so does
//! `etcdctl elect -l` / Curator's `getLeader()` on those backends.
//!
//! [`Election::observe`] re-reads the leader whenever the backend pushes that the holder may
//! have changed ([`crate::raw::Driver::watch_holder`]), and polls at its interval as a safety
//! net.
//!
//! | backend | proclaim | observe |
//! |---|---|---|
//! | memory | yes | polls |
//! | etcd | yes: a txn on the entry's create revision, same lease (`etcdctl elect -l` shows it) | pushed: a watch on the election's range |
//! | ZooKeeper | yes: `setData` on our node with its version (Curator's `getLeader()` shows it) | pushed: a child watch on the directory and a data watch on its first node, re-armed |
//! | PostgreSQL | yes: an `UPDATE` guarded by the grant's owner token and fence | polls (its notifications go to queued waiters only, not to observers) |
//! | Redis (single, Sentinel, Cluster) | yes: a script rewrites the holder key only while the lock holds this grant's token | polls |
//!
//! # What is not here
//!
//! A pushed observe still reads the leader after each push: a term that begins and ends within
//! one read's round trip is not seen; a polled one misses a term shorter than its interval.

use std::{fmt, time::Duration};

use futures::{Stream, StreamExt, stream::BoxStream};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::{
    DistributedLockExt, DynLock, Error, FencingGuarantee, FencingToken, HolderIdentity, HolderInfo,
    LockGuard, LockKey, LossReason, Result, TokenDigest,
};

/// The prefix of every election's lock key.
const PREFIX: &str = "election/";

/// A named election over a lock client: see the [module docs](self).
#[derive(Clone)]
pub struct Election {
    lock: DynLock,
    key: LockKey,
    ttl: Duration,
}

impl Election {
    /// The lease TTL of a leadership when none is set: a crashed leader is replaced within
    /// about this long.
    pub const DEFAULT_TTL: Duration = Duration::from_secs(10);

    /// The election `name` on `lock`'s coordinator (its lock key is `election/<name>`).
    ///
    /// # Errors
    /// [`Error::InvalidKey`], without I/O, when `name` is not a valid [`LockKey`] or is too long
    /// once prefixed.
    pub fn new(lock: DynLock, name: &str) -> Result<Self> {
        LockKey::new(name)?;
        let key = LockKey::new(format!("{PREFIX}{name}"))?;
        Ok(Self {
            lock,
            key,
            ttl: Self::DEFAULT_TTL,
        })
    }

    /// Sets the lease TTL of a leadership ([`Election::DEFAULT_TTL`] by default). The watchdog
    /// renews it every third of it while leading; a leader that dies is replaced after at most
    /// about this long. Checked against the backend's limits by the campaign, before any I/O.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The election's lock key (`election/<name>`).
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// Waits up to `wait` to become leader: queued behind the current leader where the backend
    /// queues waiters, woken where it notifies. The leadership then renews itself (the lock's
    /// watchdog) until [`Leadership::resign`] or until it is lost.
    ///
    /// # Errors
    /// Before any I/O: [`Error::Unsupported`] when the backend does not claim fencing tokens (no
    /// terms), [`Error::InvalidTtl`] for a TTL the backend refuses. [`Error::Timeout`] when
    /// `wait` passes; the backend's errors.
    ///
    /// # Cancellation safety
    /// Dropping the future while it waits leaves nothing behind that blocks other campaigners.
    pub async fn campaign(&self, wait: Duration) -> Result<Leadership> {
        let started = Instant::now();
        loop {
            let left = wait.saturating_sub(started.elapsed());
            let guard = self.builder().wait(left).acquire().await?;
            if let Some(leadership) = self.lead(guard).await? {
                return Ok(leadership);
            }
            // The grant arrived past its local deadline (a slow reply): campaign again while
            // the wait allows.
            if started.elapsed() >= wait {
                return Err(Error::Timeout {
                    key: self.key.as_str().to_owned(),
                    waited: started.elapsed(),
                });
            }
        }
    }

    /// One attempt: `Ok(None)` when someone else leads.
    ///
    /// # Errors
    /// As [`Election::campaign`] (without `Timeout`), and [`Error::NotHeld`] when the grant
    /// arrived already past its local deadline (it was given back).
    pub async fn try_campaign(&self) -> Result<Option<Leadership>> {
        let Some(guard) = self.builder().try_acquire().await? else {
            return Ok(None);
        };
        match self.lead(guard).await? {
            Some(leadership) => Ok(Some(leadership)),
            None => Err(Error::NotHeld {
                key: self.key.as_str().to_owned(),
            }),
        }
    }

    /// The current leader as the coordinator reports it (the lock's `inspect`); `None` when
    /// nobody leads.
    ///
    /// # Errors
    /// The backend's errors.
    pub async fn leader(&self) -> Result<Option<Leader>> {
        Ok(self.lock.inspect(&self.key).await?.map(Leader::from_info))
    }

    /// A stream of leader changes, read every `every` and on every push of the backend: the
    /// first item is the current leader (or `None`), then one item each time it changes —
    /// `Some` for a new term or for the same leader's proclaimed value, `None` when nobody
    /// leads any more. Each `Some` item's term is at least every earlier item's, and greater
    /// unless it is a proclaim (a read that shows an older term than one already seen is not
    /// reported).
    ///
    /// Pushed where the backend watches (etcd, ZooKeeper: see the [module docs](self)), the
    /// interval then only a safety net; polled otherwise, so a term that begins and ends between two
    /// reads is **not** seen; read faster than leaderships change to see every term. A failed
    /// read yields its error and reading goes on at the next tick or push (drop the stream to
    /// stop). A zero `every` yields one [`Error::Config`] and ends, without I/O.
    pub fn observe(
        &self,
        every: Duration,
    ) -> impl Stream<Item = Result<Option<Leader>>> + Send + 'static {
        let state = Observer {
            lock: self.lock.clone(),
            pushes: None,
            key: self.key.clone(),
            every,
            ticks: None,
            last: None,
            highest: None,
            done: false,
        };
        futures::stream::unfold(state, Observer::next)
    }

    fn builder(&self) -> crate::LockBuilder {
        self.lock
            .lock(&self.key)
            .ttl(self.ttl)
            .require_fencing(FencingGuarantee::SingleNode)
    }

    /// A leadership from a fresh grant, or `None` (given back) when it arrived lost.
    async fn lead(&self, guard: LockGuard) -> Result<Option<Leadership>> {
        if guard.is_lost() {
            tracing::warn!(key = %self.key, reason = ?guard.loss_reason(), "a leadership was lost before it began; giving it back");
            let _ = guard.release().await;
            return Ok(None);
        }
        let Some(term) = guard.fencing_token() else {
            let _ = guard.release().await;
            return Err(Error::Backend {
                backend: self.lock.backend_name(),
                op: "campaign",
                message: "the backend claims fencing but granted no fencing token".into(),
                source: None,
            });
        };
        Ok(Some(Leadership {
            guard,
            term,
            lock: self.lock.clone(),
        }))
    }
}

impl fmt::Debug for Election {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Election")
            .field("backend", &self.lock.backend_name())
            .field("key", &self.key)
            .field("ttl", &self.ttl)
            .finish()
    }
}

/// The state of [`Election::observe`]'s stream.
struct Observer {
    lock: DynLock,
    /// The backend's pushes ([`DistributedLock::watch_holder`](crate::DistributedLock::watch_holder)) while its watch is armed.
    pushes: Option<BoxStream<'static, ()>>,
    key: LockKey,
    every: Duration,
    ticks: Option<tokio::time::Interval>,
    /// The last item reported (`None` before the first).
    last: Option<Option<Leader>>,
    /// The highest term reported.
    highest: Option<FencingToken>,
    done: bool,
}

impl Observer {
    async fn next(mut self) -> Option<(Result<Option<Leader>>, Self)> {
        if self.done {
            return None;
        }
        if self.every.is_zero() {
            self.done = true;
            let e = Error::Config("the observe interval must be positive".into());
            return Some((Err(e), self));
        }
        loop {
            let every = self.every;
            let ticks = self.ticks.get_or_insert_with(|| {
                let mut ticks = tokio::time::interval(every);
                ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
                ticks
            });
            if let Some(pushes) = &mut self.pushes {
                tokio::select! {
                    _ = ticks.tick() => {}
                    push = pushes.next() => if push.is_none() {
                        // The watch broke: read now, arming it again first.
                        self.pushes = None;
                    },
                }
            } else {
                ticks.tick().await;
            }
            if self.pushes.is_none()
                && let Some(mut pushes) = self.lock.watch_holder(&self.key)
            {
                // Its first item says the watch is armed: every change after the read below is
                // pushed. A watch that is not armed within a poll interval is dropped (this
                // round polls; the next arms again).
                if let Ok(Some(())) = tokio::time::timeout(every, pushes.next()).await {
                    self.pushes = Some(pushes);
                }
            }
            match self.lock.inspect(&self.key).await {
                Err(e) => return Some((Err(e), self)),
                Ok(info) => {
                    let now = info.map(Leader::from_info);
                    if self.is_news(now.as_ref()) {
                        if let Some(term) = now.as_ref().and_then(|l| l.term) {
                            self.highest = Some(term);
                        }
                        self.last = Some(now.clone());
                        return Some((Ok(now), self));
                    }
                }
            }
        }
    }

    /// Whether `now` is a change to report.
    fn is_news(&self, now: Option<&Leader>) -> bool {
        let Some(last) = &self.last else {
            return true;
        };
        match (now, last) {
            (None, None) => false,
            (None, Some(_)) => true,
            (Some(leader), _) => match (leader.term, self.highest) {
                // A newer term, or the same leader proclaiming a new value.
                (Some(term), Some(highest)) => {
                    term > highest
                        || (term == highest
                            && last
                                .as_ref()
                                .is_some_and(|l| l.term == Some(term) && !l.says_the_same(leader)))
                }
                (Some(_), None) => true,
                // No terms (a backend without fencing): a change of holder is news.
                (None, _) => last.as_ref().is_none_or(|l| !l.says_the_same(leader)),
            },
        }
    }
}

/// A won election: leads until [`Leadership::resign`] or until [`Leadership::lost`] fires.
/// Dropping it resigns in the background (the TTL is the last resort).
pub struct Leadership {
    guard: LockGuard,
    term: FencingToken,
    lock: DynLock,
}

impl Leadership {
    /// This leadership's term: the fencing token to pass to protected resources with every
    /// write. Strictly greater than every earlier term of the election.
    pub fn term(&self) -> FencingToken {
        self.term
    }

    /// Completes when leadership is lost (as [`LockGuard::lost`]): a renewal refused or failed,
    /// the local deadline passed, or the coordinator reported the lease gone. Stop leading then.
    /// Never completes after a clean resign.
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.guard.lost()
    }

    /// A token cancelled when leadership is lost, for spawned work.
    pub fn lost_token(&self) -> CancellationToken {
        self.guard.lost_token()
    }

    /// `true` once leadership can no longer be trusted (see [`LockGuard::is_lost`]).
    pub fn is_lost(&self) -> bool {
        self.guard.is_lost()
    }

    /// Why leadership was lost, once it was.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.guard.loss_reason()
    }

    /// The election's lock key.
    pub fn key(&self) -> &LockKey {
        self.guard.key()
    }

    /// The lease as granted (see [`LockGuard::granted_lease`]): for runbooks and
    /// fault-injection tests.
    pub fn granted_lease(&self) -> &crate::Lease {
        self.guard.granted_lease()
    }

    /// A loggable digest of the leadership's ownership token.
    pub fn token_digest(&self) -> TokenDigest {
        self.guard.token_digest()
    }

    /// etcd's `Proclaim`: the leader changes its value without losing leadership. Its value
    /// becomes `value` — on etcd and ZooKeeper exactly the bytes their peers read — and the
    /// identity recorded beside the grant this process's identity with the label `value` (as a
    /// connection with `label=<value>` records it, returned), so [`Election::leader`] and
    /// [`Election::observe`] report both, with the same term. The write compares on this grant
    /// (never a blind write): a deposed leader's proclaim changes nothing.
    ///
    /// # Errors
    /// Before any I/O: [`Error::Config`] when `value` is not a valid label (1 to 64 ASCII
    /// letters, digits and `-_.:/@`, [`HolderIdentity::check_label`]); [`Error::Unsupported`]
    /// when the backend does not claim [`Capabilities::relabel`]; [`Error::NotHeld`] when
    /// leadership was already lost here. Then [`Error::NotHeld`] when the coordinator no longer
    /// records this grant as the leader (nothing changed), [`Error::Indeterminate`] when the
    /// reply was lost (the value may or may not have changed), `Unavailable`.
    ///
    /// [`Capabilities::relabel`]: crate::Capabilities::relabel
    pub async fn proclaim(&self, value: &str) -> Result<HolderIdentity> {
        HolderIdentity::check_label(value)?;
        if self.is_lost() {
            return Err(Error::not_held(self.key()));
        }
        crate::raw::relabel(self.lock.as_ref(), self.guard.granted_lease(), value).await
    }

    /// Resigns: releases the lock iff still ours, so that the next campaigner is granted
    /// promptly. `Ok(false)` when leadership had already been lost.
    ///
    /// # Errors
    /// The backend's error; the lease then expires by its TTL.
    pub async fn resign(self) -> Result<bool> {
        self.guard.release().await
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("key", self.guard.key())
            .field("term", &self.term)
            .field("token", &self.guard.token_digest())
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// The leader as the coordinator reports it ([`Election::leader`], [`Election::observe`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The leader's term (its grant's fencing token).
    pub term: Option<FencingToken>,
    /// The leader's value, as its peers read it: for one of ours, the label it campaigned with
    /// or last proclaimed (`None` when it has none); for a foreign leader (`etcdctl elect`,
    /// Curator's `LeaderSelector`), what it proclaimed / its participant id, as printable ASCII.
    pub value: Option<String>,
    /// Who leads, when the leader is one of ours: the identity its connection recorded beside
    /// the grant (host, pid, start time and the value as `label=`). `None` for a foreign leader,
    /// which records nothing but its value.
    pub holder: Option<HolderIdentity>,
    /// Time left on the leader's lease, when the coordinator keeps one per lock.
    pub ttl_remaining: Option<Duration>,
}

impl Leader {
    /// A holder identity in distlock's form is one of ours (its label is the value); any other
    /// text a driver reports is a foreign leader's value.
    fn from_info(info: HolderInfo) -> Self {
        let (value, holder) = match info.holder {
            Some(ours) if ours.is_process_form() => (ours.label().map(str::to_owned), Some(ours)),
            Some(foreign) => (Some(foreign.as_str().to_owned()), None),
            None => (None, None),
        };
        Self {
            term: info.fencing_token,
            value,
            holder,
            ttl_remaining: info.ttl_remaining,
        }
    }

    /// Whether `other` is the same leader saying the same: value and identity.
    fn says_the_same(&self, other: &Self) -> bool {
        self.value == other.value && self.holder == other.holder
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use futures::StreamExt;

    use super::*;
    use crate::{
        Capabilities, DistributedLock, InMemoryLock, Lease,
        raw::{Driver, async_trait},
    };

    fn elections(n: usize) -> (InMemoryLock, Vec<Election>) {
        let coordinator = InMemoryLock::new();
        let all = (0..n)
            .map(|i| {
                let client = coordinator.client().with_label(&format!("c{i}")).unwrap();
                Election::new(Arc::new(client), "scheduler").unwrap()
            })
            .collect();
        (coordinator, all)
    }

    const WAIT: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn resign_hands_over_to_the_waiting_campaigner_with_a_greater_term() {
        let (_c, all) = elections(2);
        let (a, b) = (&all[0], all[1].clone());
        let first = a.campaign(WAIT).await.unwrap();
        assert_eq!(first.key().as_str(), "election/scheduler");
        let waiter = tokio::spawn(async move { b.campaign(WAIT).await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "granted while another leads");
        let old = first.term();
        assert!(first.resign().await.unwrap());
        let second = waiter.await.unwrap().unwrap();
        assert!(second.term() > old, "{:?} after {old:?}", second.term());
        assert!(a.try_campaign().await.unwrap().is_none());
        assert!(second.resign().await.unwrap());
        let third = a.try_campaign().await.unwrap().expect("nobody leads");
        assert!(third.resign().await.unwrap());
    }

    #[tokio::test]
    async fn leader_agrees_with_the_handle_and_is_none_after_resign() {
        let (_c, all) = elections(2);
        assert_eq!(all[1].leader().await.unwrap(), None);
        let lead = all[0].campaign(WAIT).await.unwrap();
        let leader = all[1].leader().await.unwrap().expect("a leader");
        assert_eq!(leader.term, Some(lead.term()));
        let who = leader.holder.expect("the leader's identity");
        assert!(who.as_str().ends_with(" label=c0"), "{who}");
        assert!(
            leader
                .ttl_remaining
                .is_some_and(|t| t <= Election::DEFAULT_TTL)
        );
        assert!(lead.resign().await.unwrap());
        assert_eq!(all[1].leader().await.unwrap(), None);
    }

    #[test]
    fn a_leader_of_ours_has_its_label_as_value_and_a_foreign_one_its_text() {
        let info = |holder: Option<HolderIdentity>| HolderInfo {
            token_digest: None,
            fencing_token: Some(FencingToken(7)),
            ttl_remaining: None,
            waiters: None,
            holder,
        };
        let ours = HolderIdentity::process(Some("10.0.0.7:8080")).unwrap();
        let leader = Leader::from_info(info(Some(ours.clone())));
        assert_eq!(leader.value.as_deref(), Some("10.0.0.7:8080"));
        assert_eq!(leader.holder, Some(ours));
        let bare = HolderIdentity::process(None).unwrap();
        let leader = Leader::from_info(info(Some(bare.clone())));
        assert_eq!((leader.value, leader.holder), (None, Some(bare)));
        let foreign = HolderIdentity::from_stored(b"http://10.0.0.8:80 primary").unwrap();
        let leader = Leader::from_info(info(Some(foreign)));
        assert_eq!(leader.value.as_deref(), Some("http://10.0.0.8:80 primary"));
        assert_eq!((leader.holder, leader.term), (None, Some(FencingToken(7))));
        let nobody = Leader::from_info(info(None));
        assert_eq!((nobody.value, nobody.holder), (None, None));
    }

    #[tokio::test(start_paused = true)]
    async fn observe_sees_every_term_in_order_when_polled_faster_than_changes() {
        let (_c, all) = elections(3);
        // The stream is driven by a task of its own, as a watcher would be.
        let (tx, mut changes) = tokio::sync::mpsc::unbounded_channel();
        let stream = all[0].observe(Duration::from_millis(10));
        let watcher = tokio::spawn(stream.for_each(move |item| {
            let _ = tx.send(item);
            async {}
        }));
        // The first item (nobody leads) before the first campaign.
        let first = changes.recv().await.expect("an item").unwrap();
        assert_eq!(first, None);
        let first = None;
        let mut expected = vec![None];
        for round in 0..6 {
            let lead = all[round % 3].campaign(WAIT).await.unwrap();
            expected.push(Some(lead.term()));
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(lead.resign().await.unwrap());
            expected.push(None);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut seen = vec![first];
        while seen.len() < expected.len() {
            let item = tokio::time::timeout(Duration::from_secs(1), changes.recv())
                .await
                .expect("an item")
                .expect("the stream goes on")
                .unwrap();
            seen.push(item.map(|l| l.term.expect("a term")));
        }
        assert_eq!(seen, expected);
        // Nothing more while nothing changes.
        assert!(
            tokio::time::timeout(Duration::from_millis(500), changes.recv())
                .await
                .is_err()
        );
        watcher.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn observe_never_reports_an_older_term_or_repeats_one() {
        let (_c, all) = elections(1);
        let mut observer = Observer {
            lock: all[0].lock.clone(),
            pushes: None,
            key: all[0].key.clone(),
            every: Duration::from_millis(10),
            ticks: None,
            last: None,
            highest: None,
            done: false,
        };
        let at = |t: u64| Leader {
            term: Some(FencingToken(t)),
            value: None,
            holder: None,
            ttl_remaining: None,
        };
        assert!(observer.is_news(Some(&at(5))));
        observer.last = Some(Some(at(5)));
        observer.highest = Some(FencingToken(5));
        assert!(!observer.is_news(Some(&at(5))), "the same term twice");
        assert!(
            !observer.is_news(Some(&at(4))),
            "an older term (a stale read)"
        );
        assert!(observer.is_news(None));
        observer.last = Some(None);
        assert!(!observer.is_news(None));
        assert!(!observer.is_news(Some(&at(5))), "an old term after a gap");
        assert!(observer.is_news(Some(&at(6))));
        let zero = all[0].observe(Duration::ZERO).collect::<Vec<_>>().await;
        assert!(
            matches!(zero.as_slice(), [Err(Error::Config(_))]),
            "{zero:?}"
        );
    }

    #[tokio::test]
    async fn bad_names_and_ttls_are_refused_before_io() {
        let coordinator = InMemoryLock::new();
        let lock: DynLock = Arc::new(coordinator.client());
        let too_long = "x".repeat(LockKey::MAX_LEN - PREFIX.len() + 1);
        for bad in ["", "new\nline", "nul\0", too_long.as_str()] {
            assert!(
                matches!(
                    Election::new(lock.clone(), bad),
                    Err(Error::InvalidKey { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(Election::new(lock.clone(), &"x".repeat(LockKey::MAX_LEN - PREFIX.len())).is_ok());
        let before = coordinator.requests();
        for ttl in [Duration::ZERO, Capabilities::MAX_TTL * 2] {
            let e = Election::new(lock.clone(), "ttl").unwrap().ttl(ttl);
            assert!(matches!(
                e.campaign(WAIT).await,
                Err(Error::InvalidTtl { .. })
            ));
            assert!(matches!(
                e.try_campaign().await,
                Err(Error::InvalidTtl { .. })
            ));
        }
        assert_eq!(
            coordinator.requests(),
            before,
            "a refused campaign made a request"
        );
    }

    /// The in-memory backend with its fencing tokens hidden.
    #[derive(Debug)]
    struct Unfenced(InMemoryLock);

    #[async_trait]
    impl Driver for Unfenced {
        fn backend_name(&self) -> &'static str {
            "unfenced"
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                fencing: FencingGuarantee::None,
                ..DistributedLock::capabilities(&self.0)
            }
        }
        async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
            DistributedLock::try_acquire(&self.0, key, ttl).await
        }
        async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
            DistributedLock::renew(&self.0, lease, ttl).await
        }
        async fn release(&self, lease: &Lease) -> Result<bool> {
            DistributedLock::release(&self.0, lease).await
        }
        async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
            // No fencing, so no term to report.
            let info = DistributedLock::inspect(&self.0, key).await?;
            Ok(info.map(|info| HolderInfo {
                fencing_token: None,
                ..info
            }))
        }
    }

    /// Without terms (a backend without fencing), a change of holder is news and the same
    /// holder read again is not.
    #[tokio::test(start_paused = true)]
    async fn observe_without_terms_reports_each_change_of_holder_once() {
        let coordinator = InMemoryLock::new();
        let client = |label: &str| Unfenced(coordinator.client().with_label(label).unwrap());
        let (a, b) = (client("a"), client("b"));
        let election = Election::new(Arc::new(client("watcher")), "plain").unwrap();
        let key = election.key().clone();
        let mut stream = Box::pin(election.observe(Duration::from_millis(10)));
        let mut next = async || {
            tokio::time::timeout(Duration::from_secs(1), stream.next())
                .await
                .map(|item| item.expect("the stream goes on").unwrap())
        };
        assert_eq!(next().await.expect("the first read"), None);
        let ttl = Duration::from_secs(10);
        let held = Driver::try_acquire(&a, &key, ttl).await.unwrap().unwrap();
        let first = next().await.expect("a leads").expect("a leader");
        assert_eq!(first.term, None);
        // The holder changes between two reads: never seen free.
        assert!(Driver::release(&a, &held).await.unwrap());
        let held = Driver::try_acquire(&b, &key, ttl).await.unwrap().unwrap();
        let second = next()
            .await
            .expect("a change of holder is news")
            .expect("a leader");
        assert_ne!(first.holder, second.holder);
        assert!(next().await.is_err(), "the same holder was reported again");
        assert!(Driver::release(&b, &held).await.unwrap());
    }

    #[tokio::test]
    async fn a_backend_without_fencing_is_refused_before_io() {
        let coordinator = InMemoryLock::new();
        let election = Election::new(Arc::new(Unfenced(coordinator.client())), "x").unwrap();
        let before = coordinator.requests();
        assert!(matches!(
            election.campaign(WAIT).await,
            Err(Error::Unsupported { .. })
        ));
        assert!(matches!(
            election.try_campaign().await,
            Err(Error::Unsupported { .. })
        ));
        assert_eq!(coordinator.requests(), before);
    }

    #[tokio::test]
    async fn a_revoked_leadership_is_lost_and_debug_hides_the_token() {
        let (coordinator, all) = elections(2);
        let lead = all[0].campaign(WAIT).await.unwrap();
        let token = lead.guard.granted_lease().token().expose_hex();
        let for_spawned_work = lead.lost_token();
        assert!(
            format!("{lead:?}")
                .starts_with(r#"Leadership { key: LockKey("election/scheduler"), term: "#)
                && format!("{lead:?}").ends_with("lost: false }"),
            "{lead:?}"
        );
        let shown = format!("{lead:?} {:?} {:?}", all[0], all[0].leader().await.unwrap());
        assert!(!shown.contains(&token), "{shown}");
        assert_eq!(
            format!("{:?}", all[0]),
            r#"Election { backend: "memory", key: LockKey("election/scheduler"), ttl: 10s }"#
        );
        assert!(!lead.is_lost());
        assert!(
            DistributedLock::force_release(&coordinator, all[0].key())
                .await
                .unwrap()
        );
        tokio::time::timeout(WAIT, lead.lost())
            .await
            .expect("lost() fires");
        assert!(lead.is_lost());
        assert!(
            for_spawned_work.is_cancelled(),
            "the token for spawned work was not cancelled"
        );
        assert_eq!(lead.loss_reason(), Some(LossReason::Revoked));
        let next = all[1]
            .try_campaign()
            .await
            .unwrap()
            .expect("free after the revocation");
        assert!(next.term() > lead.term());
        assert!(
            !lead.resign().await.unwrap(),
            "a lost leadership's resign succeeded"
        );
        assert!(next.resign().await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn a_partitioned_leader_is_lost_before_the_next_leader_is_elected() {
        let coordinator = InMemoryLock::new();
        let cut = coordinator.client();
        let ttl = Duration::from_secs(3);
        let a = Election::new(Arc::new(cut.clone()), "p").unwrap().ttl(ttl);
        let b = Election::new(Arc::new(coordinator.client()), "p")
            .unwrap()
            .ttl(ttl);
        let lead = a.campaign(WAIT).await.unwrap();
        cut.set_offline(true); // its renewals fail from now on
        let contender = tokio::spawn(async move {
            let next = b.campaign(ttl * 10).await;
            (Instant::now(), next)
        });
        tokio::time::timeout(ttl * 2, lead.lost())
            .await
            .expect("lost() fires when renewals fail");
        let lost_at = Instant::now();
        let (elected_at, next) = contender.await.unwrap();
        let next = next.unwrap();
        assert!(
            lost_at <= elected_at,
            "a new leader before the old one knew it was deposed"
        );
        assert_eq!(lead.loss_reason(), Some(LossReason::DeadlinePassed));
        assert!(next.term() > lead.term());
        assert!(next.resign().await.unwrap());
    }

    #[tokio::test]
    async fn proclaim_changes_the_value_not_the_term_and_a_deposed_leader_changes_nothing() {
        let coordinator = InMemoryLock::new();
        let a =
            Election::new(Arc::new(coordinator.client().with_label("a").unwrap()), "p").unwrap();
        let b =
            Election::new(Arc::new(coordinator.client().with_label("b").unwrap()), "p").unwrap();
        let lead = a.campaign(WAIT).await.unwrap();
        let shown = lead.proclaim("scheduler-2").await.unwrap();
        assert!(shown.as_str().ends_with(" label=scheduler-2"), "{shown}");
        let leader = b.leader().await.unwrap().expect("a leader");
        assert_eq!(leader.term, Some(lead.term()));
        assert_eq!(leader.value.as_deref(), Some("scheduler-2"));
        assert_eq!(leader.holder.as_ref(), Some(&shown));
        // Bad values are refused before any I/O.
        let before = coordinator.requests();
        for bad in ["", "two words", "new\nline", &"x".repeat(65)] {
            assert!(
                matches!(lead.proclaim(bad).await, Err(Error::Config(_))),
                "{bad:?}"
            );
        }
        assert_eq!(coordinator.requests(), before);
        // Deposed (revoked): refused, and the new leader's value is untouched.
        assert!(
            DistributedLock::force_release(&coordinator, a.key())
                .await
                .unwrap()
        );
        let next = b.campaign(WAIT).await.unwrap();
        let value = b.leader().await.unwrap().expect("b leads").holder;
        assert!(matches!(
            lead.proclaim("late").await,
            Err(Error::NotHeld { .. })
        ));
        let after = b.leader().await.unwrap().expect("b leads");
        assert_eq!((after.term, after.holder), (Some(next.term()), value));
        assert!(next.resign().await.unwrap());
    }

    #[tokio::test]
    async fn proclaim_is_refused_before_io_without_the_capability_or_through_a_dyn_lock() {
        let (coordinator, all) = elections(1);
        let lead = all[0].campaign(WAIT).await.unwrap();
        let before = coordinator.requests();
        // Through a DynLock (Election::new): it proclaims.
        lead.proclaim("x").await.unwrap();
        lead.resign().await.unwrap();
        let unfenced = Arc::new(NoRelabel(coordinator.client()));
        let e = Election::new(unfenced, "q").unwrap();
        let lead = e.campaign(WAIT).await.unwrap();
        let before_proclaim = coordinator.requests();
        assert!(matches!(
            lead.proclaim("x").await,
            Err(Error::Unsupported { .. })
        ));
        assert_eq!(coordinator.requests(), before_proclaim);
        assert!(before <= before_proclaim);
        lead.resign().await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn observe_reports_a_proclaimed_value_with_the_same_term() {
        let coordinator = InMemoryLock::new();
        let a = Election::new(Arc::new(coordinator.client()), "o").unwrap();
        let mut changes = Box::pin(a.observe(Duration::from_millis(10)));
        assert_eq!(changes.next().await.unwrap().unwrap(), None);
        let lead = a.campaign(WAIT).await.unwrap();
        let first = changes.next().await.unwrap().unwrap().expect("a leader");
        let shown = lead.proclaim("v2").await.unwrap();
        let second = changes.next().await.unwrap().unwrap().expect("a leader");
        assert_eq!(first.term, second.term);
        assert_eq!(second.holder, Some(shown));
        lead.resign().await.unwrap();
    }

    /// The in-memory backend behind a watch the test pushes by hand, or one without `relabel`.
    #[derive(Debug)]
    struct Pushed(InMemoryLock, tokio::sync::broadcast::Sender<()>);

    #[derive(Debug)]
    struct NoRelabel(InMemoryLock);

    macro_rules! forward {
        ($t:ty, $name:literal, $caps:expr) => {
            #[async_trait]
            impl Driver for $t {
                fn backend_name(&self) -> &'static str {
                    $name
                }
                fn capabilities(&self) -> Capabilities {
                    ($caps)(DistributedLock::capabilities(&self.0))
                }
                async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
                    DistributedLock::try_acquire(&self.0, key, ttl).await
                }
                async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
                    DistributedLock::renew(&self.0, lease, ttl).await
                }
                async fn release(&self, lease: &Lease) -> Result<bool> {
                    DistributedLock::release(&self.0, lease).await
                }
                async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
                    DistributedLock::inspect(&self.0, key).await
                }
                async fn relabel(&self, lease: &Lease, holder: &HolderIdentity) -> Result<()> {
                    Driver::relabel(&self.0, lease, holder).await
                }
                fn watch_holder(
                    &self,
                    key: &LockKey,
                ) -> Option<futures::stream::BoxStream<'static, ()>> {
                    self.pushes(key)
                }
            }
        };
    }
    forward!(Pushed, "pushed", |c| c);
    forward!(NoRelabel, "norelabel", |c| Capabilities {
        relabel: false,
        ..c
    });

    impl Pushed {
        fn pushes(&self, _key: &LockKey) -> Option<futures::stream::BoxStream<'static, ()>> {
            let rx = self.1.subscribe();
            // The first item: armed.
            let pushes = futures::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.ok().map(|()| ((), rx))
            });
            Some(Box::pin(futures::stream::once(async {}).chain(pushes)))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn observe_rereads_on_a_push_long_before_its_poll_interval() {
        let coordinator = InMemoryLock::new();
        let (tx, _) = tokio::sync::broadcast::channel(16);
        let pushed = Arc::new(Pushed(coordinator.client(), tx.clone()));
        let a = Election::new(pushed, "w").unwrap();
        let b = Election::new(Arc::new(coordinator.client()), "w").unwrap();
        let mut changes = Box::pin(a.observe(Duration::from_secs(30)));
        assert_eq!(changes.next().await.unwrap().unwrap(), None);
        let started = Instant::now();
        let lead = b.campaign(WAIT).await.unwrap();
        let _ = tx.send(()); // no receiver when the watch is not armed
        let seen = changes.next().await.unwrap().unwrap().expect("a leader");
        assert_eq!(seen.term, Some(lead.term()));
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "seen after {:?}: the push was not read",
            started.elapsed()
        );
        // A broken watch (the sender gone) falls back to polling and still sees changes.
        drop(tx);
        assert!(lead.resign().await.unwrap());
        assert_eq!(changes.next().await.unwrap().unwrap(), None);
    }

    impl NoRelabel {
        fn pushes(&self, _key: &LockKey) -> Option<futures::stream::BoxStream<'static, ()>> {
            None
        }
    }

    #[tokio::test]
    async fn a_dropped_campaign_leaves_nothing_behind() {
        let (_c, all) = elections(3);
        let lead = all[0].campaign(WAIT).await.unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(50), all[1].campaign(WAIT))
                .await
                .is_err()
        );
        assert!(lead.resign().await.unwrap());
        let next = tokio::time::timeout(WAIT, all[2].campaign(WAIT))
            .await
            .expect("a dropped campaign blocks others")
            .unwrap();
        next.resign().await.unwrap();
    }
}
