//! Leader election over any lock: campaign, lead until lost, resign; who leads now; a stream of
//! leader changes.
//!
//! An [`Election`] is the lock on the key `election/<name>`: its holder is the leader. The
//! leader's *value* is the [`HolderIdentity`] its connection records beside each grant (host,
//! pid and the `label=` option of the URL, or [`crate::InMemoryLock::with_label`]); its *term*
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
//! reports a foreign leader (its value as [`Leader::holder`], its create revision / czxid as the
//! term):
//!
//! | backend | the election `<name>` is | a foreign leader's value |
//! |---|---|---|
//! | etcd, key prefix `P` (`distlock/`) | `etcdctl elect Pelection/<name>` (Go's `concurrency.Election` on that prefix) | what it proclaimed |
//! | ZooKeeper, root `R` (`/distlock`) | Curator's `LeaderSelector` on the leader path `R/election/<name>` | its participant id |
//!
//! `/` and `%` in `<name>` are percent-escaped as in any lock key (and `lock-` is written
//! `lock%2D` on ZooKeeper). Our leader's value as they see it is what our entry stores: on etcd
//! `<token hex> <identity>`, on ZooKeeper the identity. Curator's `LeaderLatch` (its `latch-`
//! nodes) does not interoperate. On Redis and PostgreSQL the election is our lock only.
//!
//! # What is not here
//!
//! There is no `proclaim(value)`: the leader's value is the identity the connection records
//! beside its grant, and changing it while holding the lock would need a driver operation that
//! does not exist. Use a connection with the label you want (`label=` in its URL).
//!
//! [`Election::observe`] polls (no backend pushes leader changes through the lock interface): a
//! term that begins and ends between two polls is not seen.

use std::{fmt, time::Duration};

use futures::Stream;
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

    /// A stream of leader changes, polled every `every`: the first item is the current leader
    /// (or `None`), then one item each time it changes — `Some` for a new term, `None` when
    /// nobody leads any more. Each `Some` item's term is greater than every earlier item's (a
    /// poll that reads an older term than one already seen is not reported).
    ///
    /// Polled, so a term that begins and ends between two polls is **not** seen; poll faster
    /// than leaderships change to see every term. A failed poll yields its error and polling
    /// goes on at the next tick (drop the stream to stop). A zero `every` yields one
    /// [`Error::Config`] and ends, without I/O.
    pub fn observe(
        &self,
        every: Duration,
    ) -> impl Stream<Item = Result<Option<Leader>>> + Send + 'static {
        let state = Observer {
            lock: self.lock.clone(),
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
        Ok(Some(Leadership { guard, term }))
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
            ticks.tick().await;
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
                (Some(term), Some(highest)) => term > highest,
                (Some(_), None) => true,
                // No terms (a backend without fencing): a change of holder is news.
                (None, _) => last.as_ref().is_none_or(|l| l.holder != leader.holder),
            },
        }
    }
}

/// A won election: leads until [`Leadership::resign`] or until [`Leadership::lost`] fires.
/// Dropping it resigns in the background (the TTL is the last resort).
pub struct Leadership {
    guard: LockGuard,
    term: FencingToken,
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
    /// Who leads: the identity its connection recorded beside the grant.
    pub holder: Option<HolderIdentity>,
    /// Time left on the leader's lease, when the coordinator keeps one per lock.
    pub ttl_remaining: Option<Duration>,
}

impl Leader {
    fn from_info(info: HolderInfo) -> Self {
        Self {
            term: info.fencing_token,
            holder: info.holder,
            ttl_remaining: info.ttl_remaining,
        }
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
            key: all[0].key.clone(),
            every: Duration::from_millis(10),
            ticks: None,
            last: None,
            highest: None,
            done: false,
        };
        let at = |t: u64| Leader {
            term: Some(FencingToken(t)),
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
            DistributedLock::inspect(&self.0, key).await
        }
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
        let shown = format!("{lead:?} {:?} {:?}", all[0], all[0].leader().await.unwrap());
        assert!(!shown.contains(&token), "{shown}");
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
