//! One ZooKeeper session per `ZkLock`, its heartbeat, how long the leader can be shown to keep it
//! alive, and the batched "is the session still ours" `sync` that answers many renewals at once.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, PoisonError, Weak},
    time::Duration,
};

use futures::FutureExt;

use lock_core::raw::{Batcher, Error, Result, drift_margin};
use tokio::{
    sync::watch,
    time::{Instant, sleep, sleep_until, timeout},
};
use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::{BACKEND, ZkLockConfig};

/// A live (or ended) session: the client, its negotiated timeout, and the time until which the
/// *leader* cannot have expired it, as far as our answered requests prove.
///
/// # What extends trust
///
/// Only the leader expires sessions. A member we are connected to touches our session when it
/// receives a request, and a follower tells the leader about those touches only in its replies to
/// the leader's pings (sent every tickTime / 2). A follower cut off from the leader keeps
/// answering reads for up to syncLimit × tickTime while the leader expires the session, so an
/// answered read proves nothing about the leader. A `sync`, though, is forwarded to the leader
/// and answered only after the leader processed it, on the same follower→leader stream that
/// carries the ping replies: when a `sync` sent at `s` is answered, the leader had received every
/// ping reply the follower sent before forwarding it — including, once a ping has come and gone
/// in between, the touch of every request of ours that had been *answered* by `s - lag`. So the
/// session lives at the leader until at least the send time of the newest such request plus the
/// session timeout ([`Session::synced`]). `lag` is a quarter of the session timeout: ZooKeeper
/// negotiates timeouts of at least 2 × tickTime (its default `minSessionTimeout`), so a ping
/// comes at least every timeout / 4. Requests answered on an earlier connection (another member)
/// never count, and neither does a sync whose connection changed while it was in flight.
pub(crate) struct Session {
    pub(crate) client: zk::Client,
    pub(crate) id: i64,
    /// The timeout negotiated when the session was established. zookeeper-client 0.11 does not
    /// report a timeout renegotiated on a reconnection (it asks for this same value again; the
    /// members of one ensemble are expected to share `minSessionTimeout`/`maxSessionTimeout`).
    pub(crate) timeout: Duration,
    /// Requests answered since the last promotion, the candidates of the next one.
    trust: Mutex<Trust>,
    /// The current connection, told apart by counting state changes.
    connection: Mutex<(zk::StateWatcher, u64)>,
    /// `base + timeout - margin`, where `base` is the newest send time the leader is known to
    /// have been told about (see the type's docs). Its only subscriber is the session's lapse
    /// task, so a confirmation wakes one task, not one future per held lock.
    vouched: watch::Sender<Instant>,
    /// Cancelled by the lapse task when the vouched instant passes without a newer
    /// confirmation, then replaced by a fresh token for leases that come later: every held
    /// lock's `watch_lost` waits on the token that was current when it started.
    lapse: Arc<Mutex<CancellationToken>>,
    /// Cancelled once the session is expired, closed or otherwise terminated.
    pub(crate) ended: CancellationToken,
    /// The batched session check of renewals (see [`Session::check_in`]).
    check_ins: Batcher<(), std::result::Result<(), zk::Error>>,
}

/// The leader-proved base and the requests that may become it.
struct Trust {
    base: Instant,
    answered: VecDeque<Answered>,
}

#[derive(Clone, Copy)]
struct Answered {
    sent: Instant,
    at: Instant,
    connection: u64,
}

/// The pause after a handshake that timed out before `Session::open` tries again (see there
/// why), doubled after each attempt up to [`MAX_CONNECT_RETRY_DELAY`].
const CONNECT_RETRY_DELAY: Duration = Duration::from_millis(10);

/// The longest pause between two connect attempts.
const MAX_CONNECT_RETRY_DELAY: Duration = Duration::from_millis(200);

/// How long zookeeper-client 0.11 waits for a new session's connection and ConnectResponse
/// when asked for `session_timeout` (and no connection timeout): 8 ticks of
/// `max(session_timeout / 20, 1ms)`.
fn handshake_budget(session_timeout: Duration) -> Duration {
    (session_timeout / 20).max(Duration::from_millis(1)) * 8
}

/// How many answered requests are kept as candidates (the oldest are dropped first, which only
/// makes a promotion more conservative).
const MAX_CANDIDATES: usize = 1024;

impl Trust {
    /// A request answered by the member we are connected to: a candidate, nothing more.
    fn record(&mut self, answered: Answered) {
        if self.answered.len() >= MAX_CANDIDATES {
            self.answered.pop_front();
        }
        self.answered.push_back(answered);
    }

    /// A `sync` (sent at `sync.sent`, answered at `sync.at`) went through the leader: the
    /// newest candidate of the same connection answered by `sync.sent - lag` becomes the base
    /// (candidates of other connections are dropped); the sync itself becomes a candidate.
    /// Returns the base.
    fn promote(&mut self, sync: Answered, lag: Duration) -> Instant {
        if let Some(cutoff) = sync.sent.checked_sub(lag) {
            let mut newest = None::<Instant>;
            self.answered.retain(|a| {
                if a.connection != sync.connection {
                    return false;
                }
                if a.at <= cutoff {
                    newest = Some(newest.map_or(a.sent, |n| n.max(a.sent)));
                    return false;
                }
                true
            });
            if let Some(newest) = newest {
                self.base = self.base.max(newest);
            }
        }
        self.record(sync);
        self.base
    }
}

/// A request about to be sent: when, and on which connection (take it before creating the
/// request's future: zookeeper-client sends a request when the method is called).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Probe {
    pub(crate) sent: Instant,
    connection: u64,
}

impl Session {
    /// Establishes a session (fails fast when no server accepts a connection).
    pub(crate) async fn open(config: &ZkLockConfig, stop: CancellationToken) -> Result<Arc<Self>> {
        let mut connector = zk::Client::connector()
            .with_session_timeout(config.session_timeout)
            .with_fail_eagerly();
        if let Some((user, password)) = &config.auth {
            connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
        }
        // zookeeper-client gives the handshake only a share of the *requested* session timeout
        // (see `handshake_budget`), and the server's reply waits for the createSession
        // transaction to be logged (an fsync): with a short session timeout, a busy server
        // makes the connect fail now and then with "no available hosts" although it is up. An
        // attempt that ran out of that budget is tried again, backing off, for as long as
        // `connect_timeout` (the documented bound on establishing a session) allows; one that
        // failed sooner (a refused connection) is not, so a closed port still fails at once.
        let budget = handshake_budget(config.session_timeout);
        let started = Instant::now();
        let mut attempt = 1;
        let mut delay = CONNECT_RETRY_DELAY;
        let (client, sent) = loop {
            let sent = Instant::now();
            let left = config
                .connect_timeout
                .saturating_sub(sent.saturating_duration_since(started));
            let e = match timeout(left, connector.clone().connect(&config.connect_string())).await {
                Ok(Ok(client)) => break (client, sent),
                Ok(Err(e @ (zk::Error::AuthFailed | zk::Error::NoAuth))) => {
                    return Err(Error::backend(BACKEND, "connect", e));
                }
                Ok(Err(e)) => e,
                Err(_) => {
                    return Err(Error::Unavailable {
                        backend: BACKEND,
                        op: "connect",
                        message: format!("no session within {:?}", config.connect_timeout),
                        source: None,
                    });
                }
            };
            let ran_out = sent.elapsed() >= budget / 2;
            if !ran_out || started.elapsed() + delay >= config.connect_timeout {
                return Err(Error::unavailable(BACKEND, "connect", e));
            }
            tracing::debug!(attempt, error = %e, "zookeeper handshake timed out; trying again");
            attempt += 1;
            sleep(delay).await;
            delay = delay.saturating_mul(2).min(MAX_CONNECT_RETRY_DELAY);
        };
        let negotiated = client.session_timeout();
        if negotiated > config.session_timeout + Duration::from_millis(1) {
            // The server's minSessionTimeout is larger than configured: abandoned locks would
            // be freed later than the TTLs we accept promise.
            return Err(Error::Config(format!(
                "zk: the server raised the session timeout from {:?} to {negotiated:?} (its \
                 minSessionTimeout); configure session_timeout >= {negotiated:?}",
                config.session_timeout
            )));
        }
        if negotiated < Duration::from_millis(4) {
            return Err(Error::Config(format!(
                "zk: the server negotiated an unusable session timeout of {negotiated:?}"
            )));
        }
        // Creating a session is a write the leader applies, starting the session's clock then:
        // the connect's send time is leader-proved.
        let (vouched, vouched_rx) = watch::channel(sent + negotiated - drift_margin(negotiated));
        let lapse = Arc::new(Mutex::new(CancellationToken::new()));
        let session = Arc::new(Self {
            id: client.session_id().0,
            timeout: negotiated,
            client: client.clone(),
            trust: Mutex::new(Trust {
                base: sent,
                answered: VecDeque::new(),
            }),
            connection: Mutex::new((client.state_watcher(), 0)),
            vouched,
            lapse: lapse.clone(),
            ended: CancellationToken::new(),
            check_ins: Batcher::new(MAX_CHECK_IN_BATCH),
        });
        tokio::spawn(watch_lapse(vouched_rx, lapse, session.ended.clone()));
        tracing::debug!(session = %client.session_id(), timeout = ?negotiated, "zookeeper session established");
        tokio::spawn(monitor(
            client,
            Arc::downgrade(&session),
            stop,
            session.ended.clone(),
        ));
        Ok(session)
    }

    /// The current connection's number: bumped by every state change (a disconnection, a
    /// reconnection) seen since the last look.
    fn connection(&self) -> u64 {
        let mut guard = self
            .connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (states, number) = &mut *guard;
        while states.changed().now_or_never().is_some() {
            *number += 1;
        }
        *number
    }

    /// Call right before sending a request whose answer is reported with [`Session::answered`]
    /// or [`Session::synced`].
    pub(crate) fn probe(&self) -> Probe {
        let connection = self.connection();
        Probe {
            sent: Instant::now(),
            connection,
        }
    }

    /// A request sent at `probe` was answered by the member we are connected to. That alone
    /// extends no trust (a follower cut off from the leader still answers); it becomes a
    /// candidate for the next [`Session::synced`].
    pub(crate) fn answered(&self, probe: Probe) {
        let at = Instant::now();
        if self.connection() != probe.connection {
            return;
        }
        self.trust
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record(Answered {
                sent: probe.sent,
                at,
                connection: probe.connection,
            });
    }

    /// The time a ping from the leader can take to come round (see the type's docs).
    fn lag(&self) -> Duration {
        lag(self.timeout)
    }

    /// A `sync` sent at `probe` was answered: every request of ours answered on the same
    /// connection at least [`Session::lag`] before `probe.sent` was reported to the leader, so
    /// the newest of them moves the vouched window (see the type's docs).
    pub(crate) fn synced(&self, probe: Probe) {
        let at = Instant::now();
        let connection = self.connection();
        if connection != probe.connection {
            return;
        }
        let base = self
            .trust
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .promote(
                Answered {
                    sent: probe.sent,
                    at,
                    connection,
                },
                self.lag(),
            );
        let until = base + self.timeout - drift_margin(self.timeout);
        self.vouched.send_if_modified(|v| {
            let newer = until > *v;
            if newer {
                *v = until;
            }
            newer
        });
    }

    /// Until when the session is vouched for (see [`Session::synced`]).
    pub(crate) fn vouched_until(&self) -> Instant {
        *self.vouched.borrow()
    }

    /// The newest send time the leader is known to have heard of: the session (and every
    /// ephemeral node it owns) lives at least until this plus the timeout.
    pub(crate) fn vouched_base(&self) -> Instant {
        self.trust
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .base
    }

    /// Waits until the session is vouched for beyond now (`true`), or it ended (`false`).
    pub(crate) async fn wait_vouched(&self) -> bool {
        let mut rx = self.vouched.subscribe();
        loop {
            if self.is_ended() {
                return false;
            }
            if *rx.borrow_and_update() > Instant::now() {
                return true;
            }
            tokio::select! {
                () = self.ended.cancelled() => return false,
                changed = rx.changed() => if changed.is_err() { return false },
            }
        }
    }

    /// The lapse token current now: cancelled as soon as the vouched instant passes without a
    /// newer confirmation. Take it *before* checking [`Session::vouched_until`], so a lapse
    /// between the two cannot be missed.
    pub(crate) fn lapse_token(&self) -> CancellationToken {
        self.lapse
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// One round trip that proves the session alive now, shared by every caller that arrives
    /// while one is in flight ([`Batcher`]): a tick of any number of renewals costs a handful of
    /// requests. `Ok` means a `sync` sent after this call began was answered on this session (so
    /// it went through the leader, and [`Session::synced`] moved the vouched window as far as
    /// that proves); every watch armed before the call that fired by then has already been
    /// delivered to its receiver (the member sends a watch event before the reply to any later
    /// request of the session — for a sync, it applies everything the leader had committed
    /// before replying — and the client dispatches both from one task in arrival order).
    pub(crate) async fn check_in(
        self: &Arc<Self>,
        limit: Duration,
    ) -> std::result::Result<(), zk::Error> {
        let session = Arc::downgrade(self);
        let run = move |items: Vec<()>| {
            let session = session.clone();
            async move {
                let answer = match session.upgrade() {
                    Some(s) => s.sync(limit).await,
                    None => Err(zk::Error::ClientClosed),
                };
                vec![answer; items.len()]
            }
        };
        // No answer: the batch task died (runtime shutdown); its outcome is unknown.
        self.check_ins
            .submit((), run)
            .await
            .unwrap_or(Err(zk::Error::ConnectionLoss))
    }

    /// One `sync` (bounded by `limit`), reported to [`Session::synced`] when answered.
    pub(crate) async fn sync(&self, limit: Duration) -> std::result::Result<(), zk::Error> {
        let probe = self.probe();
        match timeout(limit, self.client.sync("/")).await {
            Ok(Ok(())) => {
                self.synced(probe);
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(zk::Error::Timeout),
        }
    }

    /// `true` once the session can no longer be used.
    pub(crate) fn is_ended(&self) -> bool {
        self.ended.is_cancelled() || self.client.state().is_terminated()
    }
}

/// A quarter of the session timeout: how long a ping from the leader can take to come round
/// (ZooKeeper negotiates at least 2 × tickTime and the leader pings every tickTime / 2).
fn lag(timeout: Duration) -> Duration {
    timeout / 4
}

/// How many renewals one batched session check answers at most (they all share its one read).
const MAX_CHECK_IN_BATCH: usize = 100_000;

/// Cancels the current lapse token whenever the vouched instant passes without a newer
/// confirmation (and installs a fresh one for later leases). One task per session, woken only
/// when the vouched instant moves or passes, however many locks are held.
async fn watch_lapse(
    mut vouched: watch::Receiver<Instant>,
    lapse: Arc<Mutex<CancellationToken>>,
    ended: CancellationToken,
) {
    loop {
        let until = *vouched.borrow_and_update();
        tokio::select! {
            () = ended.cancelled() => return,
            () = sleep_until(until) => {
                if *vouched.borrow() <= Instant::now() {
                    let old = std::mem::replace(
                        &mut *lapse.lock().unwrap_or_else(PoisonError::into_inner),
                        CancellationToken::new(),
                    );
                    old.cancel();
                    // Wait for a newer confirmation before looking at the deadline again.
                    tokio::select! {
                        () = ended.cancelled() => return,
                        changed = vouched.changed() => if changed.is_err() { return },
                    }
                }
            }
            changed = vouched.changed() => if changed.is_err() { return },
        }
    }
}

/// Heartbeats (a `sync` one [`lag`] after the previous one was answered, so that each proves the
/// one before it and the vouched window keeps moving while nothing else is sent) and marks the
/// session ended when it terminates or its `ZkLock` is dropped.
async fn monitor(
    client: zk::Client,
    session: Weak<Session>,
    stop: CancellationToken,
    ended: CancellationToken,
) {
    let mut states = client.state_watcher();
    let period = lag(client.session_timeout());
    loop {
        if states.peek_state().is_terminated() {
            break;
        }
        tokio::select! {
            () = stop.cancelled() => break,
            state = states.changed() => {
                if state.is_terminated() {
                    tracing::warn!(session = %client.session_id(), %state, "zookeeper session ended");
                    break;
                }
            }
            () = sleep(period) => {
                let Some(s) = session.upgrade() else { break };
                let _ = s.sync(period.saturating_mul(2)).await;
            }
        }
    }
    ended.cancel();
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn at(t0: Instant, sent: u64, answered: u64, connection: u64) -> Answered {
        Answered {
            sent: t0 + MS * u32::try_from(sent).unwrap(),
            at: t0 + MS * u32::try_from(answered).unwrap(),
            connection,
        }
    }

    fn trust(t0: Instant) -> Trust {
        Trust {
            base: t0,
            answered: VecDeque::new(),
        }
    }

    /// With a 1 s session the lag is 250 ms.
    const LAG: Duration = Duration::from_millis(250);

    #[test]
    fn answered_reads_alone_never_move_the_base() {
        let t0 = Instant::now();
        let mut t = trust(t0);
        for i in 1..100 {
            t.record(at(t0, i * 10, i * 10 + 1, 0));
        }
        assert_eq!(t.base, t0);
    }

    #[test]
    fn a_sync_proves_only_what_was_answered_a_lag_before_it_was_sent() {
        let t0 = Instant::now();
        let mut t = trust(t0);
        t.record(at(t0, 100, 110, 0));
        t.record(at(t0, 300, 310, 0));
        // Sent at 500: only the request answered by 250 counts.
        assert_eq!(t.promote(at(t0, 500, 510, 0), LAG), t0 + MS * 100);
        // Sent at 700: the one answered at 310 (and not the sync answered at 510).
        assert_eq!(t.promote(at(t0, 700, 705, 0), LAG), t0 + MS * 300);
        // Sent at 800: the sync answered at 510 now counts; its send time is the base.
        assert_eq!(t.promote(at(t0, 800, 805, 0), LAG), t0 + MS * 500);
        // Never backwards.
        assert_eq!(t.promote(at(t0, 801, 802, 0), LAG), t0 + MS * 500);
    }

    #[test]
    fn requests_of_another_connection_never_count() {
        let t0 = Instant::now();
        let mut t = trust(t0);
        t.record(at(t0, 100, 110, 0));
        // A sync on the next connection (another member, perhaps) proves nothing about them.
        assert_eq!(t.promote(at(t0, 1000, 1010, 1), LAG), t0);
        assert!(t.answered.iter().all(|a| a.connection == 1));
        // Its own requests count once a later sync of that connection proves them.
        assert_eq!(t.promote(at(t0, 1300, 1310, 1), LAG), t0 + MS * 1000);
    }
}
