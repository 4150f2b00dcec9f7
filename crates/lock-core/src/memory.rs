//! The in-memory reference backend.

use std::{
    collections::{HashMap, VecDeque},
    fmt,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use futures::future::BoxFuture;
use tokio::{
    sync::oneshot,
    time::{Instant, sleep_until},
};
use tokio_util::sync::CancellationToken;

use crate::{
    Capabilities, Error, FencingGuarantee, FencingToken, HolderIdentity, HolderInfo, Lease,
    LockKey, LossReason, OwnershipToken, Result,
    raw::{AcquireWait, Backoff, Driver},
};

const BACKEND: &str = "memory";

/// The reference backend: a coordinator living in this process.
///
/// Every clone made with [`InMemoryLock::client`] is an independent client of the same
/// coordinator (as separate service instances would be). It has every capability: TTL leases on
/// [`tokio::time`] (so tests can pause time), renewals, fencing tokens from one counter, FIFO
/// hand-off to waiters on release or expiry, loss reports and `force_release`. Test hooks
/// ([`InMemoryLock::force_expire`], [`InMemoryLock::set_offline`]) simulate what faults do to a real coordinator.
#[derive(Clone)]
pub struct InMemoryLock {
    coordinator: Arc<Coordinator>,
    offline: Arc<AtomicBool>,
    identity: Option<HolderIdentity>,
}

#[derive(Default)]
struct Coordinator {
    state: Mutex<State>,
    requests: AtomicU64,
}

#[derive(Default)]
struct State {
    entries: HashMap<LockKey, Entry>,
    last_fence: u64,
    next_waiter: u64,
}

#[derive(Default)]
struct Entry {
    holder: Option<Holder>,
    waiters: VecDeque<Waiter>,
}

struct Holder {
    token: OwnershipToken,
    fence: FencingToken,
    expires_at: Instant,
    revoked: CancellationToken,
    identity: Option<HolderIdentity>,
}

struct Waiter {
    id: u64,
    ttl: Duration,
    grant: oneshot::Sender<Grant>,
    identity: Option<HolderIdentity>,
}

struct Grant {
    token: OwnershipToken,
    fence: FencingToken,
    granted_at: Instant,
    revoked: CancellationToken,
}

/// Driver state carried in each lease: the token the coordinator cancels when it takes the lease
/// away.
struct Revocation(CancellationToken);

impl State {
    /// Expires a lapsed holder and hands a free lock to the first live waiter, in order.
    fn settle(&mut self, key: &LockKey, now: Instant) {
        let Some(entry) = self.entries.get_mut(key) else {
            return;
        };
        if entry.holder.as_ref().is_some_and(|h| h.expires_at <= now)
            && let Some(old) = entry.holder.take()
        {
            old.revoked.cancel();
        }
        while entry.holder.is_none() {
            let Some(waiter) = entry.waiters.pop_front() else {
                break;
            };
            let fence = FencingToken(self.last_fence + 1);
            let revoked = CancellationToken::new();
            let grant = Grant {
                token: OwnershipToken::generate(),
                fence,
                granted_at: now,
                revoked: revoked.clone(),
            };
            let token = grant.token;
            if waiter.grant.send(grant).is_ok() {
                self.last_fence = fence.0;
                entry.holder = Some(Holder {
                    token,
                    fence,
                    expires_at: now + waiter.ttl,
                    revoked,
                    identity: waiter.identity,
                });
            }
        }
        if entry.holder.is_none() && entry.waiters.is_empty() {
            self.entries.remove(key);
        }
    }

    fn grant_now(
        &mut self,
        key: &LockKey,
        ttl: Duration,
        now: Instant,
        identity: Option<HolderIdentity>,
    ) -> Option<Lease> {
        self.settle(key, now);
        let entry = self.entries.entry(key.clone()).or_default();
        if entry.holder.is_some() {
            return None;
        }
        self.last_fence += 1;
        let fence = FencingToken(self.last_fence);
        let token = OwnershipToken::generate();
        let revoked = CancellationToken::new();
        entry.holder = Some(Holder {
            token,
            fence,
            expires_at: now + ttl,
            revoked: revoked.clone(),
            identity,
        });
        Some(
            Lease::new(key.clone(), token, Some(fence), ttl, now)
                .with_backend_state(Revocation(revoked)),
        )
    }

    fn holder_of(&mut self, lease: &Lease, now: Instant) -> Option<&mut Holder> {
        self.settle(lease.key(), now);
        self.entries
            .get_mut(lease.key())?
            .holder
            .as_mut()
            .filter(|h| h.token == *lease.token())
    }
}

impl InMemoryLock {
    /// A new coordinator and a first client of it.
    pub fn new() -> Self {
        Self {
            coordinator: Arc::default(),
            offline: Arc::default(),
            identity: HolderIdentity::process(None).ok(),
        }
    }

    /// Another independent client of the same coordinator.
    pub fn client(&self) -> Self {
        Self {
            coordinator: self.coordinator.clone(),
            offline: Arc::default(),
            identity: HolderIdentity::process(None).ok(),
        }
    }

    /// This client with `label` in the [`HolderIdentity`] it records next to its grants.
    ///
    /// # Errors
    /// [`Error::Config`] for a label [`HolderIdentity::check_label`] refuses.
    pub fn with_label(mut self, label: &str) -> Result<Self> {
        self.identity = Some(HolderIdentity::process(Some(label))?);
        Ok(self)
    }

    /// Test hook: while offline, every request of *this* client fails with
    /// [`Error::Unavailable`] (a partition between this client and the coordinator).
    pub fn set_offline(&self, offline: bool) {
        self.offline.store(offline, Ordering::SeqCst);
    }

    /// How many requests reached the coordinator from any client (for "no I/O" checks).
    pub fn requests(&self) -> u64 {
        self.coordinator.requests.load(Ordering::SeqCst)
    }

    /// Test hook: the coordinator forgets the holder's remaining TTL, as if it had run out
    /// (the holder is not told).
    pub fn force_expire(&self, key: &LockKey) {
        let mut state = self.coordinator.lock_state();
        if let Some(holder) = state.entries.get_mut(key).and_then(|e| e.holder.as_mut()) {
            holder.expires_at = Instant::now();
        }
    }

    /// An operator deletes the lock: the holder is told through `watch_lost`, and the next waiter
    /// is granted. Returns whether there was a holder.
    fn revoke(&self, key: &LockKey, only: Option<FencingToken>) -> bool {
        let mut state = self.coordinator.lock_state();
        let old = state
            .entries
            .get_mut(key)
            .and_then(|e| e.holder.take_if(|h| only.is_none_or(|f| h.fence == f)));
        if let Some(old) = &old {
            old.revoked.cancel();
        }
        state.settle(key, Instant::now());
        old.is_some()
    }

    fn request(&self, op: &'static str) -> Result<MutexGuard<'_, State>> {
        if self.offline.load(Ordering::SeqCst) {
            return Err(Error::Unavailable {
                backend: BACKEND,
                op,
                message: "client is offline (test hook)".into(),
                source: None,
            });
        }
        self.coordinator.requests.fetch_add(1, Ordering::SeqCst);
        Ok(self.coordinator.lock_state())
    }
}

impl Coordinator {
    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Default for InMemoryLock {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for InMemoryLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InMemoryLock")
            .field("offline", &self.offline.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Removes a waiter that gave up (deadline or dropped future) and returns a grant that raced
/// with its departure to the queue, so nothing is left that blocks others.
struct QueuedWaiter<'a> {
    lock: &'a InMemoryLock,
    key: LockKey,
    id: u64,
    grant: oneshot::Receiver<Grant>,
    done: bool,
}

impl Drop for QueuedWaiter<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut state = self.lock.coordinator.lock_state();
        if let Some(entry) = state.entries.get_mut(&self.key) {
            entry.waiters.retain(|w| w.id != self.id);
        }
        if let Ok(grant) = self.grant.try_recv()
            && let Some(entry) = state.entries.get_mut(&self.key)
            && entry
                .holder
                .as_ref()
                .is_some_and(|h| h.token == grant.token)
        {
            entry.holder = None;
        }
        state.settle(&self.key, Instant::now());
    }
}

fn lease_from(key: &LockKey, ttl: Duration, grant: Grant) -> Lease {
    Lease::new(
        key.clone(),
        grant.token,
        Some(grant.fence),
        ttl,
        grant.granted_at,
    )
    .with_backend_state(Revocation(grant.revoked))
}

#[async_trait]
impl Driver for InMemoryLock {
    fn backend_name(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            lease_ttl: true,
            renew: true,
            fencing: FencingGuarantee::Quorum,
            wait_notify: true,
            fair_queue: true,
            lost_notify: true,
            force_release: true,
            keep_until: true,
            relabel: true,
            min_ttl: Duration::from_millis(1),
            ..Default::default()
        }
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        let mut state = self.request("try_acquire")?;
        Ok(state.grant_now(key, ttl, Instant::now(), self.identity.clone()))
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        let wait = AcquireWait::new(key, deadline, Backoff::default())?;
        let (mut waiter, mut expires_at) = {
            let mut state = self.request("acquire")?;
            let now = Instant::now();
            if let Some(lease) = state.grant_now(key, ttl, now, self.identity.clone()) {
                return Ok(lease);
            }
            state.next_waiter += 1;
            let id = state.next_waiter;
            let (tx, rx) = oneshot::channel();
            let entry = state.entries.entry(key.clone()).or_default();
            entry.waiters.push_back(Waiter {
                id,
                ttl,
                grant: tx,
                identity: self.identity.clone(),
            });
            let expires_at = entry.holder.as_ref().map_or(now, |h| h.expires_at);
            let waiter = QueuedWaiter {
                lock: self,
                key: key.clone(),
                id,
                grant: rx,
                done: false,
            };
            (waiter, expires_at)
        };
        loop {
            tokio::select! {
                biased;
                grant = &mut waiter.grant => {
                    if let Ok(grant) = grant {
                        waiter.done = true;
                        return Ok(lease_from(key, ttl, grant));
                    }
                    return Err(wait.timeout());
                }
                () = sleep_until(expires_at.min(wait.deadline())) => {}
            }
            if Instant::now() >= wait.deadline() {
                drop(waiter);
                return Err(wait.timeout());
            }
            // The holder's TTL ran out: expire it, which hands the lock to the queue's head.
            let mut state = self.request("acquire")?;
            let now = Instant::now();
            state.settle(key, now);
            expires_at = state
                .entries
                .get(key)
                .and_then(|e| e.holder.as_ref())
                .map_or(now + Duration::from_millis(1), |h| h.expires_at);
        }
    }

    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        let mut state = self.request("renew")?;
        let now = Instant::now();
        let holder = state
            .holder_of(lease, now)
            .ok_or_else(|| Error::not_held(lease.key()))?;
        holder.expires_at = now + ttl;
        lease.renewed(ttl, now);
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let mut state = self.request("release")?;
        let now = Instant::now();
        if state.holder_of(lease, now).is_none() {
            return Ok(false);
        }
        if let Some(entry) = state.entries.get_mut(lease.key()) {
            entry.holder = None;
        }
        state.settle(lease.key(), now);
        Ok(true)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let mut state = self.request("inspect")?;
        let now = Instant::now();
        state.settle(key, now);
        Ok(state.entries.get(key).and_then(|entry| {
            entry.holder.as_ref().map(|h| HolderInfo {
                token_digest: Some(h.token.digest()),
                fencing_token: Some(h.fence),
                ttl_remaining: Some(h.expires_at.saturating_duration_since(now)),
                waiters: Some(
                    entry
                        .waiters
                        .iter()
                        .filter(|w| !w.grant.is_closed())
                        .count(),
                ),
                holder: h.identity.clone(),
            })
        }))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        drop(self.request("force_release")?);
        Ok(self.revoke(key, None))
    }

    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        drop(self.request("force_release")?);
        Ok(self.revoke(key, Some(holder)))
    }

    async fn relabel(&self, lease: &Lease, holder: &HolderIdentity) -> Result<()> {
        let mut state = self.request("relabel")?;
        let found = state
            .holder_of(lease, Instant::now())
            .ok_or_else(|| Error::not_held(lease.key()))?;
        found.identity = Some(holder.clone());
        Ok(())
    }

    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        match lease.backend_state::<Revocation>() {
            Some(Revocation(token)) => {
                let token = token.clone();
                Box::pin(async move {
                    token.cancelled().await;
                    LossReason::Revoked
                })
            }
            None => Box::pin(std::future::pending()),
        }
    }
}
