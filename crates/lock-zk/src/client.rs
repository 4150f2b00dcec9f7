//! Connecting and the session: establishing one ZooKeeper session per `ZkLock` (digest auth, the
//! handshake's retries), telling its connections apart, its heartbeat, and the classification of
//! zookeeper-client's errors (outcome unknown, session gone, refused).

use std::{
    future::Future,
    sync::{Arc, Mutex, PoisonError, Weak, atomic::AtomicUsize},
    time::Duration,
};

use futures::FutureExt;

use lock_core::raw::{Batcher, Error, Failure, Result, drift_margin, no_answer};
use tokio::{
    sync::watch,
    time::{Instant, sleep, timeout, timeout_at},
};
use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::{
    BACKEND, ZkAcl, ZkLock, ZkLockConfig,
    lock::ZkLease,
    members::RootWatch,
    renew::{MAX_CHECK_IN_BATCH, Trust, lag, watch_lapse},
};

pub(crate) type ZkResult<T> = std::result::Result<T, zk::Error>;

/// A live (or ended) session: the client, its negotiated timeout, and the time until which the
/// *leader* cannot have expired it, as far as our answered requests prove.
///
/// What extends that time (only a `sync` answered through the leader does) is explained and
/// accounted in [`crate::renew`].
pub(crate) struct Session {
    pub(crate) client: zk::Client,
    pub(crate) id: i64,
    /// The timeout negotiated when the session was established. zookeeper-client 0.11 does not
    /// report a timeout renegotiated on a reconnection (it asks for this same value again; the
    /// members of one ensemble are expected to share `minSessionTimeout`/`maxSessionTimeout`).
    pub(crate) timeout: Duration,
    /// Requests answered since the last promotion, the candidates of the next one.
    pub(crate) trust: Mutex<Trust>,
    /// The current connection, told apart by counting state changes.
    connection: Mutex<(zk::StateWatcher, u64)>,
    /// `base + timeout - margin`, where `base` is the newest send time the leader is known to
    /// have been told about (see the type's docs). Its only subscriber is the session's lapse
    /// task, so a confirmation wakes one task, not one future per held lock.
    pub(crate) vouched: watch::Sender<Instant>,
    /// Cancelled by the lapse task when the vouched instant passes without a newer
    /// confirmation, then replaced by a fresh token for leases that come later: every held
    /// lock's `watch_lost` waits on the token that was current when it started. Each is a
    /// child of `ended`, so the session's end cancels it as well.
    pub(crate) lapse: Arc<Mutex<CancellationToken>>,
    /// Cancelled once the session is expired, closed or otherwise terminated.
    pub(crate) ended: CancellationToken,
    /// The batched session check of renewals (see [`Session::check_in`]).
    pub(crate) check_ins: Batcher<(), std::result::Result<(), zk::Error>>,
    /// The renewal-group members (held locks) of this session.
    pub(crate) members: AtomicUsize,
    /// Whether this session's holder node is written ([`crate::path::session_holder`]).
    pub(crate) holder_published: std::sync::atomic::AtomicBool,
    /// The watch on the lock root that covers members past
    /// [`ZkLockConfig::session_watch_from`] (see `crate::members`).
    pub(crate) root_watch: Arc<RootWatch>,
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

/// A request about to be sent: when, and on which connection (take it before creating the
/// request's future: zookeeper-client sends a request when the method is called).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Probe {
    pub(crate) sent: Instant,
    pub(crate) connection: u64,
}

impl Session {
    /// Establishes a session (fails fast when no server accepts a connection).
    pub(crate) async fn open(config: &ZkLockConfig, stop: CancellationToken) -> Result<Arc<Self>> {
        let mut connector = zk::Client::connector()
            .with_session_timeout(config.session_timeout)
            .with_fail_eagerly();
        if let Some((user, password)) = &config.auth {
            connector =
                connector.with_auth("digest", format!("{user}:{}", password.expose()).as_bytes());
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
                Err(_) => return Err(no_answer(BACKEND, "connect", config.connect_timeout)),
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
        // Each lapse token is a child of `ended`: the session's end cancels it too, so a held
        // lock's `watch_lost` waits on one token for both (see `ZkLock::lost_signal`).
        let ended = CancellationToken::new();
        let lapse = Arc::new(Mutex::new(ended.child_token()));
        let session = Arc::new(Self {
            id: client.session_id().0,
            timeout: negotiated,
            client: client.clone(),
            trust: Mutex::new(Trust::new(sent, lag(negotiated))),
            connection: Mutex::new((client.state_watcher(), 0)),
            vouched,
            lapse: lapse.clone(),
            ended,
            check_ins: Batcher::new(MAX_CHECK_IN_BATCH),
            members: AtomicUsize::new(0),
            holder_published: std::sync::atomic::AtomicBool::new(false),
            root_watch: Arc::new(RootWatch::new(config.root(), config.timeout)),
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
    pub(crate) fn connection(&self) -> u64 {
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

/// `fut` bounded by `limit`; running out is reported as [`zk::Error::Timeout`] (outcome unknown).
pub(crate) async fn call<T>(
    limit: Duration,
    fut: impl Future<Output = ZkResult<T>>,
) -> ZkResult<T> {
    timeout(limit, fut).await.unwrap_or(Err(zk::Error::Timeout))
}

/// `fut` bounded by the instant `until`, like [`call`].
pub(crate) async fn call_until<T>(
    until: Instant,
    fut: impl Future<Output = ZkResult<T>>,
) -> ZkResult<T> {
    timeout_at(until, fut)
        .await
        .unwrap_or(Err(zk::Error::Timeout))
}

/// The request may or may not have been applied. zookeeper-client fails in-flight requests with
/// a custom error ("no response from connection in …ms", I/O errors) when it gives up on a
/// connection: the request may have reached the server, so that is an unknown outcome too.
pub(crate) fn outcome_unknown(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::ConnectionLoss | zk::Error::Timeout | zk::Error::Custom(_)
    )
}

/// The session is gone, and with it every ephemeral node it owned.
pub(crate) fn session_gone(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::SessionExpired | zk::Error::ClientClosed | zk::Error::SessionMoved
    )
}

/// A zookeeper-client error as lock-core's [`Failure`] class, from the two backend-specific
/// classes above: an unknown outcome, and a session gone (a request in flight when it ended may
/// have applied first, so that is unknown too); no host taking the connection sent nothing; any
/// other error is the server's answer.
pub(crate) fn classify(e: &zk::Error) -> Failure {
    match e {
        zk::Error::NoHosts => Failure::NotSent,
        e if outcome_unknown(e) || session_gone(e) => Failure::Unknown,
        _ => Failure::Refused,
    }
}

/// The caller's error for a failed request of `op`, by [`classify`]. An unknown outcome is
/// `Unavailable` whatever the operation (the `Effect::Read` row of
/// [`lock_core::raw::failure`]): an operation that must tell an unknown write apart handles it
/// before calling this (the contender's `create` looks for its node by token, `release` sends
/// its delete again).
pub(crate) fn to_error(op: &'static str, e: zk::Error) -> Error {
    match classify(&e) {
        Failure::Refused => Error::backend(BACKEND, op, e),
        _ => Error::unavailable(BACKEND, op, e),
    }
}

impl ZkLock {
    /// Connects: establishes the session now.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad configuration or a server that raises the session timeout;
    /// [`Error::Unavailable`] when no server answers.
    pub async fn connect(config: ZkLockConfig) -> Result<Self> {
        let this = Self::new(config)?;
        this.session().await?;
        Ok(this)
    }

    /// With `acl=creator`, proves the credentials before anything runs. ZooKeeper's digest
    /// scheme accepts any password at `addauth` — a wrong one only names another identity — so
    /// the lock root's ACL is the check: the root is created persistent (never reaped, unlike the
    /// lock directories) with `CREATOR_ALL_ACL`, and reading its ACL needs READ or ADMIN on it,
    /// which only the identity that created it has. `NoAuth` there is a refused credential
    /// ([`Error::Backend`] during `connect`, which the CLI reports as 78), also on a key nobody
    /// holds.
    async fn claim_root(&self, session: &Session) -> Result<()> {
        let root = self.inner.config.root();
        if root.is_empty() {
            return Ok(());
        }
        let client = &session.client;
        let refused = || {
            let user = self
                .inner
                .config
                .auth
                .as_ref()
                .map_or("", |(user, _)| user.as_str());
            Error::backend(
                BACKEND,
                "connect",
                format!(
                    "the lock root {root} refuses the digest identity of user {user:?}: a wrong \
                     password, or a root created by other credentials (ZooKeeper accepts any \
                     digest password at login; the root's ACL is what checks it)"
                ),
            )
        };
        match self.call(client.get_acl(root)).await {
            Ok(_) => return Ok(()),
            Err(zk::Error::NoAuth) => return Err(refused()),
            Err(zk::Error::NoNode) => {}
            Err(e) => return Err(to_error("connect", e)),
        }
        let persistent = zk::CreateMode::Persistent.with_acls(self.acls());
        match self.call(client.mkdir(root, &persistent)).await {
            Ok(()) => {}
            Err(zk::Error::NoAuth) => return Err(refused()),
            Err(e) => return Err(to_error("connect", e)),
        }
        // Created by us or, in a race, by another client: only the creator may read its ACL.
        match self.call(client.get_acl(root)).await {
            Ok(_) => Ok(()),
            Err(zk::Error::NoAuth) => Err(refused()),
            Err(e) => Err(to_error("connect", e)),
        }
    }

    /// [`ZkLock::connect`] with [`ZkLockConfig::from_url`].
    ///
    /// # Errors
    /// As [`ZkLockConfig::from_url`] and [`ZkLock::connect`].
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(ZkLockConfig::from_url(url)?).await
    }

    /// The underlying `zookeeper-client` session (connecting if needed), e.g. to read its session
    /// id or to share it. Lock nodes are ephemeral to this session: closing it releases them.
    ///
    /// # Errors
    /// As [`ZkLock::connect`].
    pub async fn zk_client(&self) -> Result<zk::Client> {
        Ok(self.session().await?.client.clone())
    }

    pub(crate) fn current(&self) -> Option<Arc<Session>> {
        self.inner
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The live session, establishing a new one when there is none or the last one ended.
    pub(crate) async fn session(&self) -> Result<Arc<Session>> {
        if let Some(s) = self.current().filter(|s| !s.is_ended()) {
            return Ok(s);
        }
        let _connecting = self.inner.connecting.lock().await;
        if let Some(s) = self.current().filter(|s| !s.is_ended()) {
            return Ok(s);
        }
        let session = Session::open(&self.inner.config, self.inner.stop.child_token()).await?;
        if self.inner.config.acl == ZkAcl::Creator {
            // Every new session before it is used, a lazily connected client's too; a refused
            // one is dropped unused (its monitor ends with it).
            self.claim_root(&session).await?;
        }
        *self
            .inner
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(session.clone());
        Ok(session)
    }

    /// The session `lease` was granted in, if it is still the live one.
    pub(crate) fn session_of(&self, state: &ZkLease) -> Option<Arc<Session>> {
        self.current()
            .filter(|s| s.id == state.session_id && !s.is_ended())
    }

    pub(crate) fn acls(&self) -> zk::Acls<'static> {
        match self.inner.config.acl {
            ZkAcl::Open => zk::Acls::anyone_all(),
            ZkAcl::Creator => zk::Acls::creator_all(),
        }
    }

    pub(crate) async fn call<T>(&self, fut: impl Future<Output = ZkResult<T>>) -> ZkResult<T> {
        call(self.inner.config.timeout, fut).await
    }

    /// `timeout` from now: the bound of a step of several requests.
    pub(crate) fn op_deadline(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.inner.config.timeout)
            .unwrap_or(now + ZkLockConfig::MAX_TIMEOUT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Classifying by [`Failure`] keeps the error each client error gave callers before.
    #[test]
    fn each_client_error_keeps_its_caller_error() {
        use zk::Error as E;
        for e in [
            E::ConnectionLoss,
            E::Timeout,
            E::SessionExpired,
            E::ClientClosed,
            E::SessionMoved,
            E::NoHosts,
        ] {
            let shown = e.to_string();
            assert!(
                matches!(to_error("op", e), Error::Unavailable { .. }),
                "{shown}"
            );
        }
        for e in [
            E::NoNode,
            E::NoAuth,
            E::BadVersion,
            E::NodeExists,
            E::NotEmpty,
            E::AuthFailed,
            E::InvalidAcl,
        ] {
            let shown = e.to_string();
            assert!(
                matches!(to_error("op", e), Error::Backend { .. }),
                "{shown}"
            );
        }
        assert_eq!(classify(&E::NoHosts), Failure::NotSent);
        assert_eq!(classify(&E::ConnectionLoss), Failure::Unknown);
        assert_eq!(classify(&E::SessionExpired), Failure::Unknown);
        assert_eq!(classify(&E::NoNode), Failure::Refused);
    }
}
