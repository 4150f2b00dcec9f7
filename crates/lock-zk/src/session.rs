//! One ZooKeeper session per `ZkLock`, its heartbeat, how long it can be vouched for, and the
//! batched "is the session still ours" read that answers many renewals at once.

use std::{
    sync::{Arc, Mutex, PoisonError, Weak},
    time::Duration,
};

use lock_core::{Batcher, Error, Result, drift_margin};
use tokio::{
    sync::watch,
    time::{Instant, sleep, sleep_until, timeout},
};
use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::{BACKEND, ZkLockConfig};

/// A live (or ended) session: the client, its negotiated timeout, and the time until which the
/// server cannot have expired it, as far as our confirmed requests prove.
pub(crate) struct Session {
    pub(crate) client: zk::Client,
    pub(crate) id: i64,
    pub(crate) timeout: Duration,
    /// `sent_at + timeout - margin` of the latest request the server answered: the server
    /// touches a session on every request, so it cannot expire it before `sent_at + timeout`.
    /// Its only subscriber is the session's lapse task, so a confirmation wakes one task, not
    /// one future per held lock.
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

impl Session {
    /// Establishes a session (fails fast when no server accepts a connection).
    pub(crate) async fn open(config: &ZkLockConfig, stop: CancellationToken) -> Result<Arc<Self>> {
        let mut connector = zk::Client::connector()
            .with_session_timeout(config.session_timeout)
            .with_fail_eagerly();
        if let Some((user, password)) = &config.auth {
            connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
        }
        let sent = Instant::now();
        let client = match timeout(
            config.connect_timeout,
            connector.connect(&config.connect_string()),
        )
        .await
        {
            Ok(Ok(client)) => client,
            Ok(Err(e @ (zk::Error::AuthFailed | zk::Error::NoAuth))) => {
                return Err(Error::backend(BACKEND, "connect", e));
            }
            Ok(Err(e)) => return Err(Error::unavailable(BACKEND, "connect", e)),
            Err(_) => {
                return Err(Error::Unavailable {
                    backend: BACKEND,
                    op: "connect",
                    message: format!("no session within {:?}", config.connect_timeout),
                    source: None,
                });
            }
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
        let (vouched, vouched_rx) = watch::channel(sent + negotiated - drift_margin(negotiated));
        let lapse = Arc::new(Mutex::new(CancellationToken::new()));
        let session = Arc::new(Self {
            id: client.session_id().0,
            timeout: negotiated,
            client: client.clone(),
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

    /// Records that a request sent at `sent` was answered.
    pub(crate) fn confirm(&self, sent: Instant) {
        let until = sent + self.timeout - drift_margin(self.timeout);
        self.vouched.send_if_modified(|v| {
            let newer = until > *v;
            if newer {
                *v = until;
            }
            newer
        });
    }

    /// Until when the session is vouched for (see [`Session::confirm`]).
    pub(crate) fn vouched_until(&self) -> Instant {
        *self.vouched.borrow()
    }

    /// When the latest answered request was sent: the server had heard from us then, so the
    /// session (and every ephemeral node it owns) lives until at least that plus the timeout.
    pub(crate) fn last_confirmed_send(&self) -> Instant {
        self.vouched_until() - (self.timeout - drift_margin(self.timeout))
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
    /// requests. `Ok` means a read sent after this call began was answered on this session, so
    /// the session was alive (and confirmed, see [`Session::confirm`]) when the server
    /// processed it; every watch armed before the call that fired by then has already been
    /// delivered to its receiver (the server sends a watch event before the reply to any later
    /// request of the session, and the client dispatches both from one task in arrival order).
    pub(crate) async fn check_in(
        self: &Arc<Self>,
        limit: Duration,
    ) -> std::result::Result<(), zk::Error> {
        let client = self.client.clone();
        let session = Arc::downgrade(self);
        let run = move |items: Vec<()>| {
            let client = client.clone();
            let session = session.clone();
            async move {
                let sent = Instant::now();
                let answer = match timeout(limit, client.check_stat("/")).await {
                    Ok(Ok(_)) => {
                        if let Some(s) = session.upgrade() {
                            s.confirm(sent);
                        }
                        Ok(())
                    }
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err(zk::Error::Timeout),
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

    /// `true` once the session can no longer be used.
    pub(crate) fn is_ended(&self) -> bool {
        self.ended.is_cancelled() || self.client.state().is_terminated()
    }
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

/// Heartbeats (a cheap read every timeout/5, so the vouched window keeps moving while nothing
/// else is sent) and marks the session ended when it terminates or its `ZkLock` is dropped.
async fn monitor(
    client: zk::Client,
    session: Weak<Session>,
    stop: CancellationToken,
    ended: CancellationToken,
) {
    let mut states = client.state_watcher();
    let period = client.session_timeout() / 5;
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
                let sent = Instant::now();
                if let Ok(Ok(_)) = timeout(period * 2, client.check_stat("/")).await {
                    match session.upgrade() {
                        Some(s) => s.confirm(sent),
                        None => break,
                    }
                }
            }
        }
    }
    ended.cancel();
}
