//! One etcd lease shared by every lock entry a client holds with the same TTL.
//!
//! A session's lease is kept alive only on demand — by `renew` of any lock on it, by waiters,
//! and by acquisitions — and concurrent demands share one keepalive round trip: a keepalive
//! acknowledged recently enough answers every caller. Renewing N locks therefore costs about
//! one keepalive per freshness window, not N.

use std::{
    collections::HashSet,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use etcd_client::{LeaseClient, LeaseKeepAliveStream, LeaseKeeper};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{self, Failure, RequestError};

/// Requests sent to etcd by one client, by kind.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) lease_grant: AtomicU64,
    pub(crate) lease_keepalive: AtomicU64,
    pub(crate) lease_revoke: AtomicU64,
    pub(crate) txn: AtomicU64,
    pub(crate) range: AtomicU64,
    pub(crate) watch: AtomicU64,
}

impl Counters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Why a keepalive failed.
#[derive(Debug)]
pub(crate) enum KeepAliveError {
    /// The lease no longer exists: every key attached to it is gone.
    Gone,
    /// The keepalive did not complete; the lease may still be alive.
    Failed(RequestError),
}

#[derive(Debug, Default)]
struct Users {
    /// Name ranges with an entry (held or queued) on this lease. One entry per name per lease:
    /// the entry key is `<name range><lease hex>`.
    names: HashSet<Vec<u8>>,
    /// No longer handed out (empty and being revoked, or dead).
    retired: bool,
    /// Bumped whenever the session goes idle (its last user leaves), so a grace-period reaper
    /// retires it only if it stayed idle since then.
    idle_since: u64,
}

/// What a `LeaseGrant` returned.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grant {
    pub(crate) id: i64,
    /// The TTL asked for, in whole seconds.
    pub(crate) requested_secs: i64,
    /// The TTL the server granted.
    pub(crate) granted: Duration,
    /// When the grant request was sent.
    pub(crate) sent_at: Instant,
}

pub(crate) struct Session {
    pub(crate) id: i64,
    /// The TTL asked for, in whole seconds (the pool key).
    pub(crate) requested_secs: i64,
    /// The TTL the server granted.
    pub(crate) granted: Duration,
    lease: LeaseClient,
    request_timeout: Duration,
    counters: Arc<Counters>,
    stream: tokio::sync::Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
    /// When the last acknowledged grant/keepalive was sent: the lease lives at least until
    /// `ack + granted`.
    ack: Mutex<Instant>,
    /// Cancelled once the lease is known to be gone.
    pub(crate) gone: CancellationToken,
    users: Mutex<Users>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("lease", &format_args!("{:x}", self.id))
            .field("granted", &self.granted)
            .field("gone", &self.gone.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl Session {
    pub(crate) fn new(
        grant: Grant,
        first_user: Vec<u8>,
        lease: LeaseClient,
        request_timeout: Duration,
        counters: Arc<Counters>,
    ) -> Self {
        Self {
            id: grant.id,
            requested_secs: grant.requested_secs,
            granted: grant.granted,
            ack: Mutex::new(grant.sent_at),
            lease,
            request_timeout,
            counters,
            stream: tokio::sync::Mutex::new(None),
            gone: CancellationToken::new(),
            users: Mutex::new(Users {
                names: HashSet::from([first_user]),
                retired: false,
                idle_since: 0,
            }),
        }
    }

    pub(crate) fn ack(&self) -> Instant {
        *lock(&self.ack)
    }

    /// Registers an entry for `name` unless this session already has one or is retired.
    pub(crate) fn try_add_user(&self, name: &[u8]) -> bool {
        let mut users = lock(&self.users);
        if users.retired || self.gone.is_cancelled() || users.names.contains(name) {
            return false;
        }
        users.names.insert(name.to_vec())
    }

    /// Unregisters `name`. When that left the session empty, returns the idle period it began
    /// (for [`Session::retire_if_idle`]); the session stays usable until retired.
    pub(crate) fn remove_user(&self, name: &[u8]) -> Option<u64> {
        let mut users = lock(&self.users);
        if !users.names.remove(name) || !users.names.is_empty() || users.retired {
            return None;
        }
        users.idle_since += 1;
        Some(users.idle_since)
    }

    /// Retires the session if it has been idle since the idle period `since` began (returns
    /// `true`; the caller revokes the lease). A session used again in between is left alone,
    /// even if it is idle again now (that idle period has a reaper of its own).
    pub(crate) fn retire_if_idle(&self, since: u64) -> bool {
        let mut users = lock(&self.users);
        if users.retired || !users.names.is_empty() || users.idle_since != since {
            return false;
        }
        users.retired = true;
        true
    }

    /// If `name` is the only user, unregisters it and retires the session (returns `true`; the
    /// caller revokes the lease, which deletes the entry with it).
    pub(crate) fn take_last_user(&self, name: &[u8]) -> bool {
        let mut users = lock(&self.users);
        if !users.retired && users.names.len() == 1 && users.names.contains(name) {
            users.names.clear();
            users.retired = true;
            return true;
        }
        false
    }

    pub(crate) fn mark_gone(&self) {
        lock(&self.users).retired = true;
        self.gone.cancel();
    }

    /// Makes sure the lease was confirmed alive by a request sent no longer than `max_age` ago
    /// and after `newer_than`, sending one keepalive if needed (shared with concurrent callers).
    /// Returns when that confirming request was sent.
    ///
    /// A renewal passes its lease's previous base as `newer_than`: every renewal is confirmed by
    /// a keepalive sent after the one that confirmed its predecessor (so a revoked lease is
    /// noticed), while one keepalive still answers every lock whose base is older — about one
    /// keepalive per renewal interval for any number of locks.
    pub(crate) async fn keep_alive(
        &self,
        max_age: Duration,
        newer_than: Option<Instant>,
    ) -> Result<Instant, KeepAliveError> {
        let fresh = |ack: Instant| {
            Instant::now().saturating_duration_since(ack) <= max_age
                && newer_than.is_none_or(|t| ack > t)
        };
        if self.gone.is_cancelled() {
            return Err(KeepAliveError::Gone);
        }
        let ack = self.ack();
        if fresh(ack) {
            return Ok(ack);
        }
        let mut slot = self.stream.lock().await;
        // Someone else may have refreshed it while we waited for the stream.
        let ack = self.ack();
        if fresh(ack) {
            return Ok(ack);
        }
        if self.gone.is_cancelled() {
            return Err(KeepAliveError::Gone);
        }
        let sent = Instant::now();
        Counters::bump(&self.counters.lease_keepalive);
        let outcome = error::request(self.request_timeout, async {
            match slot.as_mut() {
                None => {
                    // Opening the stream sends the first keepalive and waits for its answer
                    // (an error when the lease is gone).
                    let pair = self.lease.clone().keep_alive(self.id).await?;
                    *slot = Some(pair);
                    Ok(true)
                }
                Some((keeper, stream)) => {
                    keeper.keep_alive().await?;
                    match stream.message().await? {
                        Some(resp) => Ok(resp.ttl() > 0),
                        None => Err(etcd_client::Error::LeaseKeepAliveError(
                            "keepalive stream closed".into(),
                        )),
                    }
                }
            }
        })
        .await;
        match outcome {
            Ok(true) => {
                let mut ack = lock(&self.ack);
                *ack = (*ack).max(sent);
                Ok(*ack)
            }
            Ok(false)
            | Err(RequestError {
                failure: Failure::LeaseNotFound,
                ..
            }) => {
                *slot = None;
                self.mark_gone();
                Err(KeepAliveError::Gone)
            }
            Err(e) => {
                // A late answer would be read as the next one's: start a new stream next time.
                *slot = None;
                Err(KeepAliveError::Failed(e))
            }
        }
    }
}
