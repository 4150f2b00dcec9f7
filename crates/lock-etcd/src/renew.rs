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
use tokio::{sync::watch, time::Instant};
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
    /// The keepalive stream, taken out by the one keepalive in flight.
    stream: Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
    /// The answer channel of the keepalive in flight, if any.
    inflight: Mutex<Option<watch::Receiver<Option<Answer>>>>,
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
            stream: Mutex::new(None),
            inflight: Mutex::new(None),
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
    /// Returns when that confirming request was sent. Gives up at `until` (the caller's budget)
    /// with a temporary failure; the keepalive itself goes on and answers whoever waits for it.
    ///
    /// A renewal passes its lease's previous base as `newer_than`: every renewal is confirmed by
    /// a keepalive sent after the one that confirmed its predecessor (so a revoked lease is
    /// noticed), while one keepalive still answers every lock whose base is older — about one
    /// keepalive per renewal interval for any number of locks.
    ///
    /// Each keepalive runs in a task of its own that owns the session's stream while its request
    /// is out and always reads its answer (or discards the stream), so a caller that gives up or
    /// is dropped never leaves an unread answer behind for the next one (review S1). Callers
    /// that join a keepalive in flight all get its answer at once, success or failure (L3).
    pub(crate) async fn keep_alive(
        self: &Arc<Self>,
        max_age: Duration,
        newer_than: Option<Instant>,
        until: Instant,
    ) -> Result<Instant, KeepAliveError> {
        let fresh = |ack: Instant| {
            Instant::now().saturating_duration_since(ack) <= max_age
                && newer_than.is_none_or(|t| ack > t)
        };
        loop {
            if self.gone.is_cancelled() {
                return Err(KeepAliveError::Gone);
            }
            let ack = self.ack();
            if fresh(ack) {
                return Ok(ack);
            }
            if Instant::now() >= until {
                return Err(KeepAliveError::Failed(out_of_budget()));
            }
            let mut answer = self.join_or_send();
            let answer = tokio::select! {
                biased;
                changed = answer.wait_for(Option::is_some) => match changed {
                    Ok(a) => a.clone(),
                    Err(_) => None,
                },
                () = tokio::time::sleep_until(until) => {
                    return Err(KeepAliveError::Failed(out_of_budget()));
                }
            };
            match answer {
                Some(Answer::Alive(sent)) => {
                    if newer_than.is_none_or(|t| sent > t) {
                        return Ok(self.ack().max(sent));
                    }
                    // An older keepalive than we need (only possible right after a new
                    // base): send the next one.
                }
                Some(Answer::Gone) => return Err(KeepAliveError::Gone),
                Some(Answer::Failed { failure, message }) => {
                    return Err(KeepAliveError::Failed(RequestError {
                        failure,
                        source: message.to_string().into(),
                    }));
                }
                None => {
                    return Err(KeepAliveError::Failed(RequestError {
                        failure: Failure::Unknown,
                        source: "the keepalive task ended without an answer".into(),
                    }));
                }
            }
        }
    }

    /// The answer channel of the keepalive in flight, starting one if there is none.
    fn join_or_send(self: &Arc<Self>) -> watch::Receiver<Option<Answer>> {
        let mut inflight = lock(&self.inflight);
        if let Some(rx) = inflight.as_ref() {
            return rx.clone();
        }
        let (tx, rx) = watch::channel(None);
        *inflight = Some(rx.clone());
        let sent = Instant::now();
        Counters::bump(&self.counters.lease_keepalive);
        tokio::spawn(self.clone().send_keepalive(sent, tx));
        rx
    }

    /// One keepalive round trip on the session's stream, answered to every caller waiting.
    async fn send_keepalive(self: Arc<Self>, sent: Instant, tx: watch::Sender<Option<Answer>>) {
        // The stream is out of the slot while this request is: nobody else can read its answer.
        let taken = lock(&self.stream).take();
        let lease = self.lease.clone();
        let id = self.id;
        let outcome = error::request(self.request_timeout, async move {
            match taken {
                None => {
                    // Opening the stream sends the first keepalive and waits for its answer
                    // (an error when the lease is gone).
                    let pair = lease.clone().keep_alive(id).await?;
                    Ok((pair, true))
                }
                Some((mut keeper, mut stream)) => {
                    keeper.keep_alive().await?;
                    match stream.message().await? {
                        Some(resp) => Ok(((keeper, stream), resp.ttl() > 0)),
                        None => Err(etcd_client::Error::LeaseKeepAliveError(
                            "keepalive stream closed".into(),
                        )),
                    }
                }
            }
        })
        .await;
        // On any failure the stream stays out of the slot (dropped): a late answer on it can
        // never be read as the next request's.
        let answer = match outcome {
            Ok((pair, true)) => {
                *lock(&self.stream) = Some(pair);
                let mut ack = lock(&self.ack);
                *ack = (*ack).max(sent);
                Answer::Alive(sent)
            }
            Ok((_, false))
            | Err(RequestError {
                failure: Failure::LeaseNotFound,
                ..
            }) => {
                self.mark_gone();
                Answer::Gone
            }
            Err(e) => Answer::Failed {
                failure: e.failure,
                message: e.source.to_string().into(),
            },
        };
        *lock(&self.inflight) = None;
        let _ = tx.send(Some(answer));
    }
}

/// What one keepalive round trip found, for every caller that waited for it.
#[derive(Clone, Debug)]
enum Answer {
    /// The lease was alive when the keepalive sent at this instant reached the leader.
    Alive(Instant),
    /// The lease does not exist any more.
    Gone,
    /// No answer; the lease may still be alive.
    Failed { failure: Failure, message: Arc<str> },
}

fn out_of_budget() -> RequestError {
    RequestError {
        failure: Failure::Unknown,
        source: "no keepalive answer within the caller's deadline".into(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    async fn etcd() -> Option<etcd_client::Client> {
        let url = conformance::backend_url("DISTLOCK_TEST_ETCD_URL")?;
        let cfg = crate::EtcdLockConfig::from_url(&url).unwrap();
        let endpoints: Vec<String> = cfg
            .endpoints
            .iter()
            .map(|e| format!("http://{e}"))
            .collect();
        Some(etcd_client::Client::connect(endpoints, None).await.unwrap())
    }

    /// Review S1: a keepalive whose caller is dropped at any point (before its request is
    /// sent, while it is out, while its answer is being read) never leaves an answer behind
    /// that a later keepalive would read as its own: after a revoke the next one says `Gone`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_keepalive_never_answers_a_later_one() {
        let Some(client) = etcd().await else { return };
        let sent_at = Instant::now();
        let granted = client.lease_client().grant(30, None).await.unwrap();
        let session = Arc::new(Session::new(
            Grant {
                id: granted.id(),
                requested_secs: 30,
                granted: Duration::from_secs(30),
                sent_at,
            },
            b"n/".to_vec(),
            client.lease_client(),
            Duration::from_secs(5),
            Arc::new(Counters::default()),
        ));
        let far = || Instant::now() + Duration::from_secs(10);
        // Opens the stream.
        session
            .keep_alive(Duration::ZERO, None, far())
            .await
            .unwrap();
        // Cut points from "never polled" to "answer almost read".
        for cut_us in [0, 1, 10, 50, 100, 200, 400, 700, 1_000, 2_000, 5_000] {
            let base = session.ack();
            let renewal = session.keep_alive(Duration::ZERO, Some(base), far());
            let _ = tokio::time::timeout(Duration::from_micros(cut_us), renewal).await;
        }
        {
            // Polled exactly once, then dropped.
            let renewal = session.keep_alive(Duration::ZERO, Some(session.ack()), far());
            let mut renewal = std::pin::pin!(renewal);
            let _ = futures::poll!(renewal.as_mut());
        }
        // Every abandoned keepalive's answer has arrived by now (or been discarded).
        tokio::time::sleep(Duration::from_millis(300)).await;
        client.lease_client().revoke(granted.id()).await.unwrap();
        for _ in 0..3 {
            let next = session
                .keep_alive(Duration::ZERO, Some(session.ack()), far())
                .await;
            assert!(
                matches!(next, Err(KeepAliveError::Gone)),
                "a keepalive after the revoke answered {next:?}: it read an abandoned one's answer"
            );
        }
    }

    /// Review L3: callers that joined a keepalive that fails are all answered when it does,
    /// and a caller's own budget bounds its wait.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_waiting_on_a_stalled_keepalive_get_their_answer_by_their_budget() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ETCD_URL") else {
            return;
        };
        let (proxy, proxied) = conformance::drill::Proxy::start_for_url(&url)
            .await
            .unwrap();
        let cfg = crate::EtcdLockConfig::from_url(&proxied).unwrap();
        let client = etcd_client::Client::connect([format!("http://{}", cfg.endpoints[0])], None)
            .await
            .unwrap();
        let sent_at = Instant::now();
        let granted = client.lease_client().grant(30, None).await.unwrap();
        let session = Arc::new(Session::new(
            Grant {
                id: granted.id(),
                requested_secs: 30,
                granted: Duration::from_secs(30),
                sent_at,
            },
            b"n/".to_vec(),
            client.lease_client(),
            Duration::from_secs(5),
            Arc::new(Counters::default()),
        ));
        session
            .keep_alive(
                Duration::ZERO,
                None,
                Instant::now() + Duration::from_secs(5),
            )
            .await
            .unwrap();
        proxy.blackhole();
        let start = Instant::now();
        let budget = Duration::from_millis(700);
        let waits = (0..8).map(|_| {
            let session = session.clone();
            async move {
                let r = session
                    .keep_alive(Duration::ZERO, Some(session.ack()), start + budget)
                    .await;
                (r.is_err(), start.elapsed())
            }
        });
        for (failed, took) in futures::future::join_all(waits).await {
            assert!(failed, "a blackholed keepalive succeeded");
            assert!(
                took < budget + Duration::from_millis(500),
                "waited {took:?}"
            );
        }
        proxy.pass();
        let _ = client.lease_client().revoke(granted.id()).await;
    }
}
