//! Leases and holder descriptions.

use std::{any::Any, fmt, sync::Arc, time::Duration};

use tokio::time::Instant;

use crate::{FencingToken, LockKey, OwnershipToken, TokenDigest};

/// What one successful acquisition grants: the key, the secret ownership token, the fencing
/// token (when the backend mints one), the TTL and a conservative local deadline.
///
/// The local deadline is measured on the monotonic clock from the moment the request was *sent*
/// (`sent_at + ttl - margin`), so it can only be earlier than the coordinator's own expiry. Stop
/// trusting the lease at that deadline even if the coordinator has not expired it yet.
#[derive(Clone)]
pub struct Lease {
    key: LockKey,
    token: OwnershipToken,
    fencing: Option<FencingToken>,
    ttl: Duration,
    acquired_at: Instant,
    local_deadline: Instant,
    backend_state: Option<Arc<dyn Any + Send + Sync>>,
}

impl Lease {
    /// Builds a lease for a grant whose request was sent at `sent_at`.
    pub fn new(
        key: LockKey,
        token: OwnershipToken,
        fencing: Option<FencingToken>,
        ttl: Duration,
        sent_at: Instant,
    ) -> Self {
        Self {
            key,
            token,
            fencing,
            ttl,
            acquired_at: sent_at,
            local_deadline: local_deadline(sent_at, ttl),
            backend_state: None,
        }
    }

    /// Attaches driver-private state (a session lease id, a node path, …) to the lease.
    pub fn with_backend_state<T: Any + Send + Sync>(mut self, state: T) -> Self {
        self.backend_state = Some(Arc::new(state));
        self
    }

    /// The driver-private state attached with [`Lease::with_backend_state`], if it has type `T`.
    pub fn backend_state<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.backend_state.as_deref()?.downcast_ref()
    }

    /// Records a successful renewal whose request was sent at `sent_at`.
    pub fn renewed(&mut self, ttl: Duration, sent_at: Instant) {
        self.ttl = ttl;
        self.local_deadline = local_deadline(sent_at, ttl);
    }

    /// The lock key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The secret ownership token of this acquisition.
    pub fn token(&self) -> &OwnershipToken {
        &self.token
    }

    /// The fencing token minted with the grant, if the backend mints them.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.fencing
    }

    /// The TTL of the last grant or renewal.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// When the granting request was sent (monotonic clock): the start of the hold.
    pub fn acquired_at(&self) -> Instant {
        self.acquired_at
    }

    /// The conservative local deadline (monotonic clock).
    pub fn local_deadline(&self) -> Instant {
        self.local_deadline
    }

    /// Time left before the local deadline (zero once it has passed).
    pub fn remaining(&self) -> Duration {
        self.local_deadline
            .saturating_duration_since(Instant::now())
    }

    /// `true` while the local deadline has not passed.
    pub fn is_locally_valid(&self) -> bool {
        Instant::now() < self.local_deadline
    }
}

/// The margin subtracted from a TTL for clock-rate differences and scheduling: 1 % + 5 ms,
/// never more than half the TTL.
pub fn drift_margin(ttl: Duration) -> Duration {
    (ttl / 100 + Duration::from_millis(5)).min(ttl / 2)
}

fn local_deadline(sent_at: Instant, ttl: Duration) -> Instant {
    sent_at + ttl - drift_margin(ttl)
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("token", &self.token.digest())
            .field("fencing", &self.fencing)
            .field("ttl", &self.ttl)
            .field("remaining", &self.remaining())
            .finish_non_exhaustive()
    }
}

/// Who holds a key right now, as far as the coordinator knows (from [`crate::DistributedLock::inspect`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderInfo {
    /// Digest of the holder's ownership token (never the token itself).
    pub token_digest: Option<TokenDigest>,
    /// The holder's fencing token.
    pub fencing_token: Option<FencingToken>,
    /// Time left on the holder's lease, when the coordinator keeps one per lock.
    pub ttl_remaining: Option<Duration>,
    /// Contenders queued behind the holder, when the backend queues them.
    pub waiters: Option<usize>,
}
