//! One ZooKeeper session per `ZkLock`, its heartbeat and how long it can be vouched for.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use lock_core::{Error, Result, drift_margin};
use tokio::{
    sync::watch,
    time::{Instant, sleep, timeout},
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
    vouched: watch::Sender<Instant>,
    /// Cancelled once the session is expired, closed or otherwise terminated.
    pub(crate) ended: CancellationToken,
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
        let (vouched, _) = watch::channel(sent + negotiated - drift_margin(negotiated));
        let session = Arc::new(Self {
            id: client.session_id().0,
            timeout: negotiated,
            client: client.clone(),
            vouched,
            ended: CancellationToken::new(),
        });
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

    /// A receiver of the vouched-for instant.
    pub(crate) fn vouched(&self) -> watch::Receiver<Instant> {
        self.vouched.subscribe()
    }

    /// `true` once the session can no longer be used.
    pub(crate) fn is_ended(&self) -> bool {
        self.ended.is_cancelled() || self.client.state().is_terminated()
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
