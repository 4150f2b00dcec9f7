//! `ZkLock`, the Curator-compatible ZooKeeper mutex: its `Driver` impl and the coordinator's
//! algorithm for acquire, try_acquire, release, inspect and force_release (`renew` and
//! `watch_lost` are in `crate::renew` and `crate::wake`).

use std::{
    fmt,
    sync::{Arc, Mutex, atomic::AtomicBool},
    time::Duration,
};

use futures::{future::BoxFuture, stream::BoxStream};
use lock_core::raw::{
    AcquireWait, Backoff, Capabilities, Driver, Error, FencingGuarantee, FencingToken,
    HolderIdentity, HolderInfo, Lease, LockKey, LossReason, Result, async_trait,
};
use tokio::time::{Instant, timeout_at};
use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::{
    BACKEND, ZkLockConfig,
    client::{Session, outcome_unknown, session_gone, to_error},
    path::{self, lock_dir, sorted_contenders},
    path::{KEEP_NODE, KeepMarker, keep_path},
    queue::{Grant, Kept, Position, Waited, spawn_removal},
    renew::{KeptMarker, delete_keep},
    wake::NodeWatch,
};

/// A ZooKeeper lock client: one session shared by every lock it takes.
///
/// See the crate documentation for the recipe, the TTL rules and the failure semantics.
/// Cloning is cheap; clones share the session.
///
/// An election (`lock_core::Election`, the lock `election/NAME`) is the election of Curator's
/// `LeaderSelector` on the leader path `<root>/election/NAME` (an InterProcessMutex there, the
/// participant id as each node's data): each side waits for the other, and `inspect` reports a
/// Curator leader's participant id as its holder and its node's czxid as its fencing token. Our
/// election nodes' data is the leader's value alone (the client's label, or what it proclaimed),
/// exactly what Curator's `getLeader()` reads as our participant id; the identity is in the
/// session's holder node (`path::session_holder`) and the token in the node's name.
#[derive(Clone)]
pub struct ZkLock {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) config: ZkLockConfig,
    /// Who we are, written as the data of every contender node we create: the node that holds
    /// the lock carries its own holder's identity, so `inspect` can never pair a grant with
    /// another client's identity.
    pub(crate) identity: HolderIdentity,
    pub(crate) current: Mutex<Option<Arc<Session>>>,
    pub(crate) connecting: tokio::sync::Mutex<()>,
    /// Cancelled when the last clone is dropped: stops the session's heartbeat.
    pub(crate) stop: CancellationToken,
    /// Keep markers are TTL nodes until the server refuses one (`Unimplemented`: its
    /// `zookeeper.extendedTypesEnabled` is off); persistent nodes from then on.
    pub(crate) ttl_markers: AtomicBool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Driver state carried by each lease.
pub(crate) struct ZkLease {
    pub(crate) session_id: i64,
    /// Our node's path (relative to the chroot), shared with the `watch_lost` future.
    pub(crate) path: Arc<str>,
    pub(crate) czxid: i64,
    pub(crate) version: i32,
    /// The session watch's epoch when our node's create was sent (see `crate::members`).
    pub(crate) epoch: u32,
    /// The deletion watch on our node, shared by renewals and `watch_lost` (and armed while
    /// waiting, when the lock was waited for).
    pub(crate) watch: Arc<NodeWatch>,
    /// The keep marker this grant wrote (job mode's `at_least`), if any.
    pub(crate) kept: Mutex<Option<KeptMarker>>,
}

impl ZkLock {
    /// A client for `config` that connects lazily, on its first request (no I/O here).
    ///
    /// # Errors
    /// [`Error::Config`] when the configuration is invalid.
    pub fn new(config: ZkLockConfig) -> Result<Self> {
        config.validate()?;
        let identity = HolderIdentity::process(config.label.as_deref())?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                identity,
                current: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
                stop: CancellationToken::new(),
                ttl_markers: AtomicBool::new(true),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ZkLockConfig {
        &self.inner.config
    }
}

/// The error of a grant that came after its local deadline (its node is removed).
fn vanished(op: &'static str) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        op,
        message: "our contender node vanished (session expired or deleted)".into(),
        source: None,
    }
}

fn late_grant(op: &'static str) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        op,
        message: "the lock was ours only after the session could no longer be vouched for \
                  (the leader may already have expired it); our node was removed"
            .into(),
        source: None,
    }
}

impl ZkLock {
    /// Deletes our node (the grant of `lease`), compare on its version: `Ok(true)` deleted,
    /// `Ok(false)` it was already gone.
    pub(crate) async fn delete_own(&self, lease: &Lease, op: &'static str) -> Result<bool> {
        let Some(state) = lease.backend_state::<ZkLease>() else {
            return Ok(false);
        };
        let Some(session) = self.session_of(state) else {
            return Ok(false);
        };
        let client = &session.client;
        let mut version = state.version;
        let mut lost_once = false;
        // Past its local deadline the node may be gone for other reasons: the background
        // removal of a lapsed lease (`spawn_removal`) or the session's expiry, after which
        // somebody else may hold the lock. A NoNode is then never taken for our own delete.
        let valid = lease.is_locally_valid();
        for _ in 0..4 {
            match self.call(client.delete(&state.path, Some(version))).await {
                Ok(()) => {
                    state.watch.set_lost(LossReason::Revoked);
                    return Ok(true);
                }
                // After a lost reply, NoNode most likely means our own delete was applied — if
                // the lease was still ours when it was sent (the drill_soak history of seed
                // 16464468869008735375: a lapsed lease's release said `true` after its node had
                // been removed in the background and another client granted).
                Err(zk::Error::NoNode) => return Ok(lost_once && valid),
                // The session ended, taking our ephemeral node with it. If a delete of ours went
                // unanswered first, we cannot tell whether it or the session end released it.
                Err(e) if session_gone(&e) && lost_once => {
                    return Err(Error::Indeterminate {
                        backend: BACKEND,
                        op,
                        key: lease.key().as_str().to_owned(),
                        message: format!(
                            "the delete went unanswered and then the session ended ({e}); the node is gone with the session"
                        ),
                    });
                }
                Err(e) if session_gone(&e) => return Ok(false),
                Err(zk::Error::BadVersion) => {
                    // Somebody wrote to our node; it is still ours if it is the same node.
                    match self.call(client.check_stat(&state.path)).await {
                        Ok(Some(stat))
                            if stat.czxid == state.czxid && stat.ephemeral_owner == session.id =>
                        {
                            version = stat.version;
                        }
                        Ok(_) => return Ok(false),
                        Err(e) => return Err(to_error(op, e)),
                    }
                }
                Err(e) if outcome_unknown(&e) => lost_once = true,
                Err(e) => return Err(to_error(op, e)),
            }
        }
        // Unreachable for now (a partition, a lapsed trust window): keep trying in the
        // background, so the node does not block everyone once the session is back.
        spawn_removal(
            session.clone(),
            state.path.clone(),
            state.czxid,
            self.inner.config.timeout,
        );
        Err(Error::Unavailable {
            backend: BACKEND,
            op,
            message: "no reply to the delete; it is retried in the background until the node \
                      or the session is gone"
                .into(),
            source: None,
        })
    }

    /// The operator override: removes the holder of `key` (any holder, or only the grant whose
    /// fencing token — its node's czxid — is `holder`).
    async fn force_release_if(&self, key: &LockKey, holder: Option<FencingToken>) -> Result<bool> {
        const OP: &str = "force_release";
        let session = self.session().await?;
        let dir = lock_dir(self.inner.config.root(), key);
        for _ in 0..5 {
            let kept = self.keep_of(&session, &dir, OP).await?;
            let current = self.holder_node(&session, &dir, OP).await?;
            // A keep marker of an earlier grant holds the lock (job mode's `at_least`): it is
            // the holder to remove.
            if let Some((marker, version)) = &kept
                && current
                    .as_ref()
                    .is_none_or(|c| c.fence != marker.fence_token())
            {
                if holder.is_some_and(|h| marker.fence_token() != Some(h)) {
                    return Ok(false);
                }
                let deleted = delete_keep(
                    &session.client,
                    &keep_path(&dir),
                    Some(marker.fence),
                    Some(*version),
                    self.op_deadline(),
                )
                .await;
                match deleted {
                    Ok(()) => {
                        tracing::warn!(%key, "kept lock (job mode's at_least) freed by force_release");
                        return Ok(true);
                    }
                    Err(zk::Error::NoNode | zk::Error::BadVersion) => continue,
                    Err(e) => return Err(to_error(OP, e)),
                }
            }
            let Some(current) = current else {
                return Ok(false);
            };
            // Node paths are never reused, so the grant confirmed by its czxid is removed by
            // deleting exactly this path.
            if holder.is_some_and(|h| current.fence != Some(h)) {
                return Ok(false);
            }
            // The delete of exactly this path is idempotent: sent again while its outcome is
            // unknown. Once one went unanswered, "gone" can be our delete or its holder's
            // release, and a failure can follow an applied delete: the answer is then
            // Indeterminate, never a promise that nothing happened.
            let mut unanswered = None;
            for _ in 0..3 {
                match self.call(session.client.delete(&current.path, None)).await {
                    Ok(()) => {
                        tracing::warn!(%key, digest = ?current.digest, "lock holder removed by force_release");
                        // Its own keep marker (a job with `at_least`) would hold the lock on.
                        if let Some((marker, version)) = kept {
                            let _ = delete_keep(
                                &session.client,
                                &keep_path(&dir),
                                Some(marker.fence),
                                Some(version),
                                self.op_deadline(),
                            )
                            .await;
                        }
                        return Ok(true);
                    }
                    Err(e) if outcome_unknown(&e) => unanswered = Some(e),
                    Err(e) => match unanswered {
                        None if e == zk::Error::NoNode => break, // released meanwhile: look again
                        None => return Err(to_error(OP, e)),
                        Some(first) => return Err(indeterminate_removal(key, &first, &e)),
                    },
                }
            }
            if let Some(first) = unanswered {
                return Err(indeterminate_removal(key, &first, &first));
            }
        }
        Ok(false)
    }

    /// The keep marker of lock directory `dir` and its version, if there is one (a marker we
    /// cannot parse is an error: never taken for a free lock).
    async fn keep_of(
        &self,
        session: &Session,
        dir: &str,
        op: &'static str,
    ) -> Result<Option<(KeepMarker, i32)>> {
        match self.call(session.client.get_data(&keep_path(dir))).await {
            Ok((data, stat)) => match KeepMarker::decode(&data) {
                Some(marker) => Ok(Some((marker, stat.version))),
                None => Err(Error::Backend {
                    backend: BACKEND,
                    op,
                    message: format!("{dir}/{KEEP_NODE} is not a distlock keep marker"),
                    source: None,
                }),
            },
            Err(zk::Error::NoNode) => Ok(None),
            Err(e) => Err(to_error(op, e)),
        }
    }

    /// The first contender of lock directory `dir` (the holder): its node, fencing token
    /// (czxid) and the number of contenders queued behind it; `None` when nobody holds. Looks
    /// again when the holder goes between listing and reading its node.
    async fn holder_node(
        &self,
        session: &Session,
        dir: &str,
        op: &'static str,
    ) -> Result<Option<HolderNode>> {
        for _ in 0..5 {
            let children = match self.call(session.client.list_children(dir)).await {
                Ok(c) => c,
                Err(zk::Error::NoNode) => return Ok(None),
                Err(e) => return Err(to_error(op, e)),
            };
            let sorted = sorted_contenders(children);
            let Some(first) = sorted.first() else {
                return Ok(None);
            };
            let path = format!("{dir}/{first}");
            // Data and Stat come from one read of the same node: the identity is the one its
            // creator wrote, whatever happened to the lock since. Curator writes its IP there
            // and older distlock versions nothing (`from_stored` sanitises; empty is None).
            let read = match self.call(session.client.get_data(&path)).await {
                Ok((data, stat)) => Ok((HolderIdentity::from_stored(&data), stat)),
                // A foreign node we may see but not read (a Curator client with its own ACL):
                // the holder is still shown, without an identity, as before node data was read.
                Err(zk::Error::NoAuth) => self
                    .call(session.client.check_stat(&path))
                    .await
                    .and_then(|stat| stat.ok_or(zk::Error::NoNode))
                    .map(|stat| (None, stat)),
                Err(e) => Err(e),
            };
            match read {
                Ok((identity, stat)) => {
                    let identity = if self.is_election_dir(dir) {
                        self.election_holder(session, identity, stat.ephemeral_owner)
                            .await
                    } else {
                        identity
                    };
                    return Ok(Some(HolderNode {
                        digest: path::token_digest_of(first),
                        fence: u64::try_from(stat.czxid).ok().map(FencingToken),
                        queued: sorted.len() - 1,
                        identity,
                        path,
                    }));
                }
                Err(zk::Error::NoNode) => continue, // released meanwhile: look again
                Err(e) => return Err(to_error(op, e)),
            }
        }
        Err(Error::Unavailable {
            backend: BACKEND,
            op,
            message: "the holder kept changing".into(),
            source: None,
        })
    }
}

impl ZkLock {
    /// Whether `dir` is an election's directory ([`path::is_election_dir`]).
    pub(crate) fn is_election_dir(&self, dir: &str) -> bool {
        path::is_election_dir(self.inner.config.root(), dir)
    }

    /// The data of our contender node in lock directory `dir`: our identity, or in an election's
    /// directory our value alone ([`path::candidate_value`]).
    pub(crate) fn node_data(&self, dir: &str) -> &str {
        if self.is_election_dir(dir) {
            path::candidate_value(&self.inner.identity)
        } else {
            self.inner.identity.as_str()
        }
    }

    /// Writes `session`'s holder node (`path::session_holder`: our identity without its
    /// label, ephemeral) once per session, before its first election node, so that whoever
    /// reads our election node can find who we are. Best effort within `until`: without it our
    /// leader shows its value and no identity.
    pub(crate) async fn publish_holder(&self, session: &Session, until: Instant) {
        use std::sync::atomic::Ordering;
        if session.holder_published.load(Ordering::Acquire) {
            return;
        }
        let Some(identity) = self.inner.identity.unlabelled() else {
            return;
        };
        let root = self.inner.config.root();
        let node = path::session_holder(root, session.id);
        let ephemeral = zk::CreateMode::Ephemeral.with_acls(self.acls());
        for _ in 0..2 {
            let created = crate::client::call_until(
                until,
                session
                    .client
                    .create(&node, identity.as_bytes(), &ephemeral),
            )
            .await;
            match created {
                Ok(_) | Err(zk::Error::NodeExists) => {
                    session.holder_published.store(true, Ordering::Release);
                    return;
                }
                Err(zk::Error::NoNode) => {
                    // Persistent, as the root: never reaped between our mkdir and our create.
                    let parents = zk::CreateMode::Persistent.with_acls(self.acls());
                    let dir = path::holders_dir(root);
                    let made =
                        crate::client::call_until(until, session.client.mkdir(&dir, &parents));
                    if let Err(e) = made.await
                        && e != zk::Error::NodeExists
                    {
                        tracing::debug!(error = %e, "cannot create the holder nodes' directory");
                        return;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot write this session's holder node");
                    return;
                }
            }
        }
    }

    /// The identity of an election node's holder: its data when that is a whole identity of
    /// ours (no value, or an older distlock), else its owner session's holder node with the
    /// data as label when the data is a label of ours; otherwise (a Curator participant, or a
    /// holder node we cannot read) the data alone, which [`lock_core::Leader`] shows as the value.
    async fn election_holder(
        &self,
        session: &Session,
        data: Option<HolderIdentity>,
        owner: i64,
    ) -> Option<HolderIdentity> {
        let value = data?;
        if value.is_process_form() || HolderIdentity::check_label(value.as_str()).is_err() {
            return Some(value);
        }
        let node = path::session_holder(self.inner.config.root(), owner);
        let who = match self.call(session.client.get_data(&node)).await {
            Ok((who, _)) => HolderIdentity::from_stored(&who),
            Err(_) => None,
        };
        match who {
            Some(who) if who.is_process_form() && who.label().is_none() => {
                HolderIdentity::from_stored(format!("{who} label={value}").as_bytes())
            }
            _ => Some(value),
        }
    }

    /// The watches of [`Driver::watch_holder`] on lock directory `dir`; `None` when they could
    /// not be set (the stream then ends, and the caller polls and asks again).
    async fn arm_holder_watch(&self, dir: &str) -> Option<Vec<zk::OneshotWatcher>> {
        let session = self.session().await.ok()?;
        let client = &session.client;
        match self.call(client.list_and_watch_children(dir)).await {
            Ok((children, on_children)) => {
                let mut watchers = vec![on_children];
                if let Some(first) = sorted_contenders(children).first() {
                    match self
                        .call(client.get_and_watch_data(&format!("{dir}/{first}")))
                        .await
                    {
                        Ok((_, _, on_data)) => watchers.push(on_data),
                        // Gone already (the child watch fires), or a foreign node we may not
                        // read (its relabels are not pushed, its deletion is).
                        Err(zk::Error::NoNode | zk::Error::NoAuth) => {}
                        Err(_) => return None,
                    }
                }
                Some(watchers)
            }
            Err(zk::Error::NoNode) => {
                let (_, on_create) = self.call(client.check_and_watch_stat(dir)).await.ok()?;
                Some(vec![on_create])
            }
            Err(_) => None,
        }
    }
}

/// What [`ZkLock::holder_node`] found.
struct HolderNode {
    path: String,
    digest: Option<lock_core::raw::TokenDigest>,
    fence: Option<FencingToken>,
    queued: usize,
    identity: Option<HolderIdentity>,
}

#[async_trait]
impl Driver for ZkLock {
    fn backend_name(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            renew: true,
            session_bound: true,
            fencing: FencingGuarantee::Quorum,
            wait_notify: true,
            fair_queue: true,
            lost_notify: true,
            force_release: true,
            relabel: true,
            // A keep marker outlives the session (see `crate::renew::KeptMarker`).
            keep_until: true,
            // The lease is the session: a TTL is honoured up to the session timeout the server
            // negotiated (it may lower the one asked for, to its maxSessionTimeout), so that is
            // the shortest TTL worth asking for; the configured one until a session exists.
            min_ttl: self
                .current()
                .map_or(self.inner.config.session_timeout, |session| session.timeout),
            // `check_ttl` caps every TTL at this anyway; saying so lets callers (`distlock
            // check`) show the real limit instead of "none".
            max_ttl: Capabilities::MAX_TTL,
            ..Default::default()
        }
    }

    // Bounded as a whole: twice `timeout` (a create and a listing) for everything after the
    // session, however many times the create is retried or looked for.
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        let session = self.session().await?;
        let now = Instant::now();
        // A create and a listing; a keep marker's read, touch and delete when there is one.
        let budget = self.inner.config.timeout.saturating_mul(5);
        let until = now
            .checked_add(budget)
            .unwrap_or(now + ZkLockConfig::MAX_TIMEOUT);
        let mut c = self.contender(session, key, Some(until));
        c.create("try_acquire").await?;
        let mut position = c.position("try_acquire").await?;
        if matches!(position, Position::First) && c.keep_seen() {
            match c.clear_keep(None).await? {
                Kept::Free => {}
                Kept::Held => position = Position::Behind(Vec::new()),
                Kept::Gone => position = Position::Gone,
            }
        }
        match position {
            Position::First => match c.grant(key, ttl) {
                Grant::Lease(lease) => Ok(Some(lease)),
                Grant::Late => {
                    c.remove(self.inner.config.timeout).await;
                    Err(late_grant("try_acquire"))
                }
                Grant::Gone => Err(vanished("try_acquire")),
            },
            Position::Behind { .. } => {
                c.remove(self.inner.config.timeout).await;
                Ok(None)
            }
            Position::Gone => Err(vanished("try_acquire")),
        }
    }

    // Every request gets at most what is left of the deadline; a waiter that gives up deletes
    // its node within `REMOVE_GRACE` or leaves that to the background clean-up.
    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        // The watch on the predecessor wakes us; the backoff is only a slow safety re-check.
        let backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(5));
        let mut wait = AcquireWait::new(key, deadline, backoff)?;
        // Past the deadline every error is a timeout: that is what the caller waited for.
        let timed_out = |wait: &AcquireWait, e: Error| {
            if Instant::now() >= deadline {
                wait.timeout()
            } else {
                e
            }
        };
        loop {
            let session = match timeout_at(deadline, self.session()).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    wait.retry_after(e).await.map_err(|e| timed_out(&wait, e))?;
                    continue;
                }
                Err(_) => return Err(wait.timeout()),
            };
            let mut c = self.contender(session.clone(), key, Some(deadline));
            if let Err(e) = c.create("acquire").await {
                drop(c);
                wait.retry_after(e).await.map_err(|e| timed_out(&wait, e))?;
                continue;
            }
            loop {
                let step = match c.position("acquire").await {
                    Ok(Position::First) => Ok(true),
                    Ok(Position::Gone) => break,
                    Ok(Position::Behind(ahead)) => match c.wait_behind(&ahead, &mut wait).await {
                        Ok(Waited::Granted) => Ok(true),
                        Ok(Waited::Relist) => Ok(false),
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                };
                let step = match step {
                    Ok(true) if c.keep_seen() => match c.clear_keep(Some(&mut wait)).await {
                        Ok(Kept::Free) => continue, // list again: still first?
                        Ok(Kept::Held) => Ok(()),
                        Ok(Kept::Gone) => break,
                        Err(e) => Err(e),
                    },
                    Ok(true) => match c.grant(key, ttl) {
                        Grant::Lease(lease) => return Ok(lease),
                        Grant::Gone => break,
                        Grant::Late => Err(late_grant("acquire")),
                    },
                    Ok(false) => Ok(()),
                    Err(e) => Err(e),
                };
                if let Err(e) = step {
                    if matches!(e, Error::Timeout { .. }) || Instant::now() >= deadline {
                        c.remove_in_time().await;
                        return Err(wait.timeout());
                    }
                    if session.is_ended() {
                        break;
                    }
                    if let Err(e) = wait.retry_after(e).await {
                        let e = timed_out(&wait, e);
                        c.remove_in_time().await;
                        return Err(e);
                    }
                }
            }
            // Our node is gone (session expired or deleted from outside): start over.
            tracing::debug!(%key, "contender node vanished while waiting; re-queueing");
            if Instant::now() >= wait.deadline() {
                return Err(wait.timeout());
            }
        }
    }

    // Confirms that our node still exists under the live session, and moves the lease's
    // deadline to the session's vouched window: see `ZkLock::renew_lease` in `crate::renew`.
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        self.renew_lease(lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        if let Some(state) = lease.backend_state::<ZkLease>()
            && let Some(session) = self.session_of(state)
        {
            self.drop_keep(state, &session).await;
        }
        self.delete_own(lease, "release").await
    }

    async fn hold_at_least(&self, lease: &Lease, at_least: Duration) -> Result<()> {
        self.write_keep(lease, at_least, "hold_at_least").await
    }

    async fn keep(&self, lease: &mut Lease, left: Duration) -> Result<bool> {
        self.keep_lease(lease, left).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let session = self.session().await?;
        let dir = lock_dir(self.inner.config.root(), key);
        let kept = self.keep_of(&session, &dir, "inspect").await?;
        let holder = self.holder_node(&session, &dir, "inspect").await?;
        Ok(match (holder, kept) {
            // A keep marker of an earlier grant holds the lock; the first contender waits for
            // it. (A marker that has passed shows until the server deletes it as a TTL node
            // or the next acquirer does: who is first in line tells the leader's time only
            // by writing.)
            (first, Some((marker, _)))
                if first
                    .as_ref()
                    .is_none_or(|f| f.fence != marker.fence_token()) =>
            {
                Some(HolderInfo {
                    token_digest: None,
                    fencing_token: marker.fence_token(),
                    ttl_remaining: None,
                    waiters: Some(first.map_or(0, |f| f.queued + 1)),
                    holder: HolderIdentity::from_stored(marker.holder.as_bytes()),
                })
            }
            (first, _) => first.map(|h| HolderInfo {
                token_digest: h.digest,
                fencing_token: h.fence,
                ttl_remaining: None,
                waiters: Some(h.queued),
                holder: h.identity,
            }),
        })
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.force_release_if(key, None).await
    }

    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        self.force_release_if(key, Some(holder)).await
    }

    /// `setData` on our own node with its version: the data is the holder identity, or in an
    /// election's directory the new value alone (what a Curator `getLeader()` reports as the
    /// participant id; the identity's label is read from it, see `path::session_holder`). A `BadVersion` is looked at: the
    /// same node (czxid, our session as its ephemeral owner) is still ours (node paths are never
    /// reused, and our node existing means it is still first), so it is written at its current
    /// version; a missing node or an ended session is `NotHeld`.
    async fn relabel(&self, lease: &Lease, holder: &HolderIdentity) -> Result<()> {
        const OP: &str = "relabel";
        let not_held = || Error::not_held(lease.key());
        let Some(state) = lease.backend_state::<ZkLease>() else {
            return Err(not_held());
        };
        let Some(session) = self.session_of(state) else {
            return Err(not_held());
        };
        let client = &session.client;
        let data = if self.is_election_dir(path::dir_of(&state.path)) {
            path::candidate_value(holder)
        } else {
            holder.as_str()
        }
        .as_bytes();
        let mut version = state.version;
        for _ in 0..4 {
            match self
                .call(client.set_data(&state.path, data, Some(version)))
                .await
            {
                Ok(_) => return Ok(()),
                Err(zk::Error::NoNode) => return Err(not_held()),
                Err(e) if session_gone(&e) => return Err(not_held()),
                Err(zk::Error::BadVersion) => match self.call(client.check_stat(&state.path)).await
                {
                    Ok(Some(stat))
                        if stat.czxid == state.czxid && stat.ephemeral_owner == session.id =>
                    {
                        version = stat.version;
                    }
                    Ok(_) => return Err(not_held()),
                    Err(e) if session_gone(&e) => return Err(not_held()),
                    Err(e) => return Err(to_error(OP, e)),
                },
                Err(e) if outcome_unknown(&e) => {
                    return Err(Error::Indeterminate {
                        backend: BACKEND,
                        op: OP,
                        key: lease.key().as_str().to_owned(),
                        message: format!("the setData of our node went unanswered ({e})"),
                    });
                }
                Err(e) => return Err(to_error(OP, e)),
            }
        }
        Err(Error::Unavailable {
            backend: BACKEND,
            op: OP,
            message: "our node's data kept changing".into(),
            source: None,
        })
    }

    /// A child watch on the lock directory (a contender created or deleted) and a data watch on
    /// its first contender (a relabel), both re-armed after each event; an exists watch on the
    /// directory while it does not exist. Each item comes after the watches are armed again.
    fn watch_holder(&self, key: &LockKey) -> Option<BoxStream<'static, ()>> {
        let dir = lock_dir(self.inner.config.root(), key);
        let state = (self.clone(), dir, None::<Vec<zk::OneshotWatcher>>);
        Some(Box::pin(futures::stream::unfold(
            state,
            |(lock, dir, armed)| async move {
                if let Some(watchers) = armed {
                    let events = watchers.into_iter().map(|w| Box::pin(w.changed()));
                    futures::future::select_all(events).await;
                }
                let watchers = lock.arm_holder_watch(&dir).await?;
                Some(((), (lock, dir, Some(watchers))))
            },
        )))
    }

    // The node's deletion watch, the session's end and its vouched window's lapse: see
    // `ZkLock::lost_signal` in `crate::wake`.
    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        self.lost_signal(lease)
    }

    /// The lease's session: one batched `sync` renews every guard on it (see
    /// `SessionGroup` in `renew.rs`).
    fn renewal_group(&self, lease: &Lease) -> Option<lock_core::raw::SharedGroup> {
        let session = self.session_of(lease.backend_state::<ZkLease>()?)?;
        Some(Arc::new(crate::renew::SessionGroup {
            session,
            limit: self.inner.config.timeout,
            watch_from: self.inner.config.session_watch_from,
        }))
    }
}

/// `force_release`'s answer once a delete of the holder's node went unanswered (`first`) and
/// the last attempt ended with `last`: it may have removed the holder.
fn indeterminate_removal(key: &LockKey, first: &zk::Error, last: &zk::Error) -> Error {
    Error::Indeterminate {
        backend: BACKEND,
        op: "force_release",
        key: key.as_str().to_owned(),
        message: format!(
            "the delete of the holder's node went unanswered ({first}); the last attempt: {last}"
        ),
    }
}

impl fmt::Debug for ZkLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkLock")
            .field("config", &self.inner.config)
            .field("session", &self.current().map(|s| zk::SessionId(s.id)))
            .finish_non_exhaustive()
    }
}
