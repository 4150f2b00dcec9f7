//! Connecting and classifying: the connection to whichever servers the topology names (one
//! server, the master a Sentinel set names, followed across failovers, or a Redis Cluster; TLS
//! and credentials), the request budget, and the sorting of the redis crate's errors into what
//! a failed request may have done ([`Failure`]) and the caller's [`Error`]. Every connection
//! variant is a [`ConnectionLike`], so the scripts run on it unchanged.

use std::{
    future::Future,
    io,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use lock_core::raw::{Effect, Error, LockKey, RequestFailure, Result, no_answer};
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, ErrorKind, IntoConnectionInfo, Pipeline,
    ProtocolVersion, PushInfo, PushKind, RedisConnectionInfo, RedisError, RedisFuture, RedisResult,
    ServerErrorKind, Value,
    aio::{
        AsyncPushSender, ConnectionLike, ConnectionManager, ConnectionManagerConfig,
        MultiplexedConnection, SendError,
    },
    cluster_async::ClusterConnection,
};
use tokio::time::{Instant, timeout, timeout_at};

use crate::{RedisLockConfig, RedisTopology, wake::Registry};

/// The backend name in every error of [`crate::RedisLock`].
pub(crate) const BACKEND: &str = "redis";

/// How many times the cluster client retries a request (redirects, reconnects after a
/// failover), within the request budget.
const CLUSTER_RETRIES: u32 = 16;

/// A client for the server at `host:port` with `config`'s database, credentials and TLS
/// (verified only: no plaintext fallback), without any I/O. The driver's connection and the
/// audit's per-master connections both start from it.
pub(crate) fn client_at(config: &RedisLockConfig, host: &str, port: u16) -> Result<redis::Client> {
    let mut redis_info = RedisConnectionInfo::default()
        .set_db(config.db)
        .set_protocol(ProtocolVersion::RESP3);
    if let Some(user) = &config.username {
        redis_info = redis_info.set_username(user);
    }
    if let Some(password) = &config.password {
        redis_info = redis_info.set_password(password.expose());
    }
    let addr = if config.tls {
        // Verified TLS only: `insecure: false`, no plaintext fallback.
        ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: false,
            tls_params: None,
        }
    } else {
        ConnectionAddr::Tcp(host.to_owned(), port)
    };
    let info = addr
        .into_connection_info()
        .map_err(|e| Error::Config(e.to_string()))?
        .set_redis_settings(redis_info);
    if config.tls {
        install_crypto_provider();
        let root_cert = match &config.ca_file {
            Some(path) => Some(std::fs::read(path).map_err(|e| {
                Error::Config(format!("cannot read the CA file {}: {e}", path.display()))
            })?),
            None => None,
        };
        redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: None,
                root_cert,
            },
        )
        .map_err(|e| Error::Config(format!("TLS settings: {e}")))
    } else {
        redis::Client::open(info).map_err(|e| Error::Config(e.to_string()))
    }
}

/// Builds the connection `config` names, without any I/O (it connects on first use and
/// reconnects by itself); RESP3 push messages go to `wakeups`.
pub(crate) fn connect_lazy(config: &RedisLockConfig, wakeups: &Arc<Registry>) -> Result<Conn> {
    let client = client_at(config, &config.host, config.port)?;
    // A script's reply may also wait for its `WAIT` (replica acknowledgement).
    let timeout = config.timeout.saturating_add(config.wait_allowance());
    let manager_config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(config.reconnect_retries)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(1))
        .set_push_sender(wakeups.clone())
        .set_automatic_resubscription();
    let conn = match &config.topology {
        RedisTopology::Single => Conn::Single(
            ConnectionManager::new_lazy_with_config(client, manager_config)
                .map_err(|e| Error::Config(e.to_string()))?,
        ),
        RedisTopology::Sentinel {
            sentinels,
            master_name,
        } => Conn::Sentinel(Arc::new(SentinelConn::new(SentinelSettings {
            sentinels: sentinels.clone(),
            master_name: master_name.clone(),
            redis_info: client.get_connection_info().redis_settings().clone(),
            connect_timeout: config.connect_timeout,
            timeout: config.timeout,
            response_timeout: timeout,
            wakeups: wakeups.clone(),
        }))),
        RedisTopology::Cluster { nodes } => {
            let mut builder = redis::cluster::ClusterClientBuilder::new(
                nodes
                    .iter()
                    .map(|(h, p)| ConnectionAddr::Tcp(h.clone(), *p))
                    .collect::<Vec<_>>(),
            )
            .use_protocol(ProtocolVersion::RESP3)
            .connection_timeout(config.connect_timeout)
            .response_timeout(timeout)
            // Redirects (MOVED/ASK) and a failover's reconnects use these retries too; a re-sent
            // request is harmless (see the scripts: an attempt finds its own grant, the rest
            // compare tokens or fences). Our own deadline still bounds each request.
            .retries(CLUSTER_RETRIES)
            .push_sender(wakeups.clone());
            if let Some(user) = &config.username {
                builder = builder.username(user);
            }
            if let Some(password) = &config.password {
                builder = builder.password(password.expose());
            }
            let cluster = builder
                .build()
                .map_err(|e| Error::Config(format!("cluster settings: {e}")))?;
            let cluster_config = redis::cluster::ClusterConfig::new()
                .set_connection_timeout(config.connect_timeout)
                .set_response_timeout(timeout);
            Conn::Cluster(cluster.get_pending_async_connection_with_config(cluster_config))
        }
    };
    Ok(conn)
}

/// Checks that a new client's server answers (`PING`), classifying a refusal.
pub(crate) async fn ping(conn: &Conn, config: &RedisLockConfig) -> Result<()> {
    let mut conn = conn.clone();
    let budget = config.request_budget();
    match timeout(budget, redis::cmd("PING").query_async::<()>(&mut conn)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) if e.kind() == ErrorKind::RESP3NotSupported => Err(Error::unsupported(
            BACKEND,
            "servers without RESP3 (Redis 6 or newer is required; 7.0 is supported)",
        )),
        // Rejected credentials or an untrusted server certificate: retrying cannot help.
        Ok(Err(e)) if is_refused_security(&e) => Err(Error::backend(BACKEND, "connect", e)),
        Ok(Err(e)) => Err(refused_database(config, &e)
            .unwrap_or_else(|| Error::unavailable(BACKEND, "connect", e))),
        Err(_) => Err(no_answer(BACKEND, "connect", budget)),
    }
}

/// One client's connection.
#[derive(Clone)]
pub(crate) enum Conn {
    /// One server: a reconnecting multiplexed connection.
    Single(ConnectionManager),
    /// The master the sentinels name, re-resolved after a failover.
    Sentinel(Arc<SentinelConn>),
    /// Redis Cluster: the redis crate's async cluster client (MOVED/ASK, slot map refresh).
    Cluster(ClusterConnection),
}

impl Conn {
    /// Subscribes to `channel` (RESP3 push messages go to the client's wake-up registry); a
    /// reconnection (or, on Sentinel, a new master) subscribes again by itself.
    pub(crate) async fn subscribe(&self, channel: &[u8]) -> RedisResult<()> {
        match self {
            Self::Single(m) => m.clone().subscribe(channel).await,
            Self::Sentinel(s) => s.subscribe(channel).await,
            Self::Cluster(c) => c.clone().subscribe(channel).await,
        }
    }

    /// On a Cluster: subscribes to the shard channel `channel` (`SSUBSCRIBE`) on the node
    /// serving its slot; the cluster client subscribes again after a reconnect or a slot move
    /// it learns of (a slot refresh), on the slot's node then.
    pub(crate) async fn ssubscribe(&self, channel: &[u8]) -> RedisResult<()> {
        match self {
            Self::Cluster(c) => c.clone().ssubscribe(channel).await,
            Self::Single(_) | Self::Sentinel(_) => Err(not_a_cluster()),
        }
    }

    /// On a Cluster: ends the shard subscription `channel` (`SUNSUBSCRIBE`).
    pub(crate) async fn sunsubscribe(&self, channel: &[u8]) -> RedisResult<()> {
        match self {
            Self::Cluster(c) => c.clone().sunsubscribe(channel).await,
            Self::Single(_) | Self::Sentinel(_) => Err(not_a_cluster()),
        }
    }

    /// Whether this connection speaks to a Cluster (renewals are then grouped by slot; wake-ups
    /// go by sharded pub/sub).
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(m) => m.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
            Self::Sentinel(s) => {
                let s = s.clone();
                Box::pin(async move {
                    let m = s.current().await?;
                    let reply = m.conn.clone().req_packed_command(cmd).await;
                    // A server's error answer comes as a value (turned into an error later).
                    match &reply {
                        Err(e) => s.observe(&m, e),
                        Ok(Value::ServerError(e)) => s.observe(&m, &RedisError::from(e.clone())),
                        Ok(_) => {}
                    }
                    reply
                })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(m) => m.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Sentinel(s) => {
                let s = s.clone();
                Box::pin(async move {
                    let m = s.current().await?;
                    let reply = m
                        .conn
                        .clone()
                        .req_packed_commands(pipeline, offset, count)
                        .await;
                    match &reply {
                        Err(e) => s.observe(&m, e),
                        Ok(values) => {
                            for v in values.iter() {
                                if let Value::ServerError(e) = v {
                                    s.observe(&m, &RedisError::from(e.clone()));
                                }
                            }
                        }
                    }
                    reply
                })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(m) => m.get_db(),
            Self::Cluster(c) => c.get_db(),
            Self::Sentinel(s) => s.db,
        }
    }
}

/// What a Sentinel-managed master's connection needs to follow a failover.
///
/// The master's connection never reconnects by itself: a connection that did (the redis
/// crate's `ConnectionManager` reconnects to the address it had, also while idle) could land on
/// an old master that restarted empty at that address after a failover, and grant there without
/// any error until the sentinels demote it. Here a disconnect (the connection's push, or a
/// request's error) makes the next request ask the sentinels again and check the node's `ROLE`
/// on the new connection itself, before anything else is sent on it.
pub(crate) struct SentinelConn {
    sentinels: Vec<(String, u16)>,
    master_name: String,
    /// Database, credentials and protocol of the master connection.
    redis_info: RedisConnectionInfo,
    db: i64,
    connect_timeout: Duration,
    timeout: Duration,
    /// The master connection's response timeout (with the `WAIT` allowance).
    response_timeout: Duration,
    /// The master and its connection; `None` until the first request.
    current: Mutex<Option<Master>>,
    /// Set by an answer that suggests a failover: the next request asks the sentinels again.
    stale: AtomicBool,
    /// One resolution at a time.
    resolving: tokio::sync::Mutex<()>,
    /// Channels subscribed so far, subscribed again on a new connection.
    channels: Mutex<Vec<Vec<u8>>>,
    wakeups: Arc<Registry>,
}

/// The master a [`SentinelConn`] talks to, and its one connection.
#[derive(Clone)]
struct Master {
    host: String,
    port: u16,
    conn: MultiplexedConnection,
    /// Set once the connection is gone (its disconnect push, or a request's error): it is
    /// never used again.
    dead: Arc<AtomicBool>,
}

/// The push sender of a master connection: marks the connection dead on its disconnect, and
/// hands every push on to the waiters' registry.
struct MasterPushes {
    dead: Arc<AtomicBool>,
    wakeups: Arc<Registry>,
}

impl AsyncPushSender for MasterPushes {
    fn send(&self, info: PushInfo) -> std::result::Result<(), SendError> {
        if info.kind == PushKind::Disconnection {
            self.dead.store(true, Ordering::Release);
        }
        self.wakeups.send(info)
    }
}

/// The settings of a [`SentinelConn`].
pub(crate) struct SentinelSettings {
    pub(crate) sentinels: Vec<(String, u16)>,
    pub(crate) master_name: String,
    pub(crate) redis_info: RedisConnectionInfo,
    pub(crate) connect_timeout: Duration,
    pub(crate) timeout: Duration,
    pub(crate) response_timeout: Duration,
    pub(crate) wakeups: Arc<Registry>,
}

impl SentinelConn {
    pub(crate) fn new(s: SentinelSettings) -> Self {
        Self {
            db: s.redis_info.db(),
            sentinels: s.sentinels,
            master_name: s.master_name,
            redis_info: s.redis_info,
            connect_timeout: s.connect_timeout,
            timeout: s.timeout,
            response_timeout: s.response_timeout,
            current: Mutex::new(None),
            stale: AtomicBool::new(false),
            resolving: tokio::sync::Mutex::new(()),
            channels: Mutex::new(Vec::new()),
            wakeups: s.wakeups,
        }
    }

    /// The current master, if its connection is usable without asking the sentinels.
    fn usable(&self) -> Option<Master> {
        if self.stale.load(Ordering::Acquire) {
            return None;
        }
        self.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .filter(|m| !m.dead.load(Ordering::Acquire))
    }

    /// The master's connection, asking the sentinels first when there is none yet, an earlier
    /// answer suggested a failover, or the connection is gone (every reconnect goes through
    /// the sentinels and `ROLE`).
    async fn current(&self) -> RedisResult<Master> {
        if let Some(m) = self.usable() {
            return Ok(m);
        }
        let _one = self.resolving.lock().await;
        if let Some(m) = self.usable() {
            return Ok(m);
        }
        let (host, port) = self.resolve().await?;
        let previous = self
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(m) = &previous
            && m.host == host
            && m.port == port
            && !m.dead.load(Ordering::Acquire)
        {
            self.stale.store(false, Ordering::Release);
            return Ok(m.clone());
        }
        let master = self.connect(host, port).await?;
        let replaced = self
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(master.clone());
        self.stale.store(false, Ordering::Release);
        if let Some(old) = replaced {
            if (old.host.as_str(), old.port) != (master.host.as_str(), master.port) {
                tracing::info!(
                    master = %self.master_name,
                    from = %format!("{}:{}", old.host, old.port),
                    to = %format!("{}:{}", master.host, master.port),
                    "the sentinels name a new master; following it"
                );
            }
            // Waiters try again at once on the new connection (their grant messages may be lost).
            self.wakeups.wake_all();
        }
        Ok(master)
    }

    /// A new connection to the master at `host:port` (as the sentinels named it), checked with
    /// `ROLE` on that connection before anything else goes over it, and subscribed to the
    /// channels. Any failure is a refusal: nothing was sent.
    async fn connect(&self, host: String, port: u16) -> RedisResult<Master> {
        let info = ConnectionAddr::Tcp(host.clone(), port)
            .into_connection_info()?
            .set_redis_settings(self.redis_info.clone());
        let client = redis::Client::open(info)?;
        let dead = Arc::new(AtomicBool::new(false));
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.response_timeout))
            .set_push_sender(MasterPushes {
                dead: dead.clone(),
                wakeups: self.wakeups.clone(),
            });
        let mut conn = timeout(
            self.connect_timeout.saturating_add(self.timeout),
            client.get_multiplexed_async_connection_with_config(&config),
        )
        .await
        .map_err(|_| refused("master connect timed out"))?
        .map_err(|e| {
            if e.is_connection_refusal() {
                e
            } else {
                refused(&format!("cannot connect to the master {host}:{port}: {e}"))
            }
        })?;
        let role: Value = timeout(self.timeout, redis::cmd("ROLE").query_async(&mut conn))
            .await
            .map_err(|_| refused("no answer to ROLE"))?
            .map_err(|e| refused(&format!("ROLE on {host}:{port}: {e}")))?;
        if !is_master(&role) {
            self.stale.store(true, Ordering::Release);
            return Err(self.not_a_master(&host, port));
        }
        let channels = self
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for channel in &channels {
            // A failed subscription leaves the waiters to their fallback polls.
            if let Err(e) = conn.subscribe(channel).await {
                tracing::debug!(error = %e, "cannot subscribe on the new master connection");
            }
        }
        Ok(Master {
            host,
            port,
            conn,
            dead,
        })
    }

    fn not_a_master(&self, host: &str, port: u16) -> RedisError {
        refused(&format!(
            "{host}:{port}, named master {:?} by a sentinel, reports itself a replica (ROLE)",
            self.master_name
        ))
    }

    /// Asks the sentinels in order for the master's address and checks with `ROLE` that the
    /// node it names is a master: a replica (a stale sentinel, a failover under way) is refused.
    async fn resolve(&self) -> RedisResult<(String, u16)> {
        let mut last = refused("no sentinel answered");
        for (host, port) in &self.sentinels {
            match self.ask(host, *port).await {
                Ok(Some(addr)) => match self.check_master(&addr).await {
                    Ok(()) => return Ok(addr),
                    Err(e) => last = e,
                },
                Ok(None) => {
                    last = refused(&format!(
                        "sentinel {host}:{port} knows no master named {:?}",
                        self.master_name
                    ));
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    async fn ask(&self, host: &str, port: u16) -> RedisResult<Option<(String, u16)>> {
        let client = redis::Client::open(ConnectionAddr::Tcp(host.to_owned(), port))?;
        let mut c = timeout(
            self.connect_timeout,
            client.get_multiplexed_async_connection(),
        )
        .await
        .map_err(|_| refused("sentinel connect timed out"))??;
        let reply: Option<(String, String)> = timeout(
            self.timeout,
            redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(&self.master_name)
                .query_async(&mut c),
        )
        .await
        .map_err(|_| refused("no answer from the sentinel"))??;
        Ok(reply.and_then(|(h, p)| Some((h, p.parse().ok()?))))
    }

    async fn check_master(&self, (host, port): &(String, u16)) -> RedisResult<()> {
        let info = ConnectionAddr::Tcp(host.clone(), *port)
            .into_connection_info()?
            .set_redis_settings(
                self.redis_info
                    .clone()
                    .set_protocol(redis::ProtocolVersion::RESP2),
            );
        let client = redis::Client::open(info)?;
        let mut c = timeout(
            self.connect_timeout,
            client.get_multiplexed_async_connection(),
        )
        .await
        .map_err(|_| refused("master connect timed out"))??;
        let role: Value = timeout(self.timeout, redis::cmd("ROLE").query_async(&mut c))
            .await
            .map_err(|_| refused("no answer to ROLE"))??;
        if is_master(&role) {
            Ok(())
        } else {
            Err(self.not_a_master(host, *port))
        }
    }

    /// An answer that may mean the master moved (a dropped or refused connection, a timeout,
    /// `READONLY` from a demoted master): ask the sentinels again before the next request. A
    /// dropped connection is never used again.
    fn observe(&self, master: &Master, e: &RedisError) {
        if e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.is_unrecoverable_error()
            || e.kind() == ErrorKind::Io && !e.is_timeout()
        {
            master.dead.store(true, Ordering::Release);
        }
        let moved = e.is_connection_refusal()
            || e.is_connection_dropped()
            || e.is_timeout()
            || e.kind() == ErrorKind::Io
            || e.kind() == ErrorKind::Server(ServerErrorKind::MasterDown)
            || is_read_only(e);
        if moved {
            self.stale.store(true, Ordering::Release);
        }
    }

    async fn subscribe(&self, channel: &[u8]) -> RedisResult<()> {
        {
            let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
            if !channels.iter().any(|c| c == channel) {
                channels.push(channel.to_vec());
            }
        }
        let m = self.current().await?;
        let reply = m.conn.clone().subscribe(channel).await;
        if let Err(e) = &reply {
            self.observe(&m, e);
        }
        reply
    }
}

/// Whether a `ROLE` reply says master.
fn is_master(role: &Value) -> bool {
    matches!(role, Value::Array(parts)
        if matches!(parts.first(), Some(Value::BulkString(r)) if r == b"master"))
}

/// A replica refused a write (`READONLY`), also when a script reports it inside its own error
/// (the acquire script's `pcall` of the fence counter's `INCR`): nothing was written, since a
/// replica accepts no write at all.
pub(crate) fn is_read_only(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
        || e.to_string()
            .contains("READONLY You can't write against a read only replica")
}

/// Sharded pub/sub is used on a Cluster only (a single server would accept it, but the wake
/// channel there is the client's own, subscribed once).
fn not_a_cluster() -> RedisError {
    RedisError::from((
        ErrorKind::Client,
        "sharded pub/sub is used on a Cluster connection only",
    ))
}

/// A failure before anything reached the master: `Unavailable`, never an unknown outcome.
fn refused(message: &str) -> RedisError {
    RedisError::from(io::Error::new(
        io::ErrorKind::ConnectionRefused,
        message.to_owned(),
    ))
}

/// Sends every script call (`EVALSHA`) together with `WAIT replicas timeout` in one pipeline,
/// so both go on the same connection: a `WAIT` on another connection (after a reconnect, or to
/// a new master) would count none of our writes and answer at once. The `WAIT`'s answer of the
/// latest call is kept in `acked`.
pub(crate) struct Acked {
    pub(crate) conn: Conn,
    pub(crate) replicas: u32,
    pub(crate) timeout: Duration,
    /// How many replicas the latest `WAIT` counted (or why it failed).
    pub(crate) acked: Option<RedisResult<i64>>,
}

impl Acked {
    /// A connection of `conn` that sends each script with its `WAIT`, as `config` asks.
    pub(crate) fn new(conn: &Conn, config: &RedisLockConfig) -> Self {
        Self {
            conn: conn.clone(),
            replicas: config.replicas,
            timeout: config.replica_timeout,
            acked: None,
        }
    }
    /// Whether the latest `WAIT` counted the replicas asked for; otherwise why not.
    pub(crate) fn confirmed(&self) -> Result<(), String> {
        match &self.acked {
            Some(Ok(n)) if *n >= i64::from(self.replicas) => Ok(()),
            Some(Ok(n)) => Err(format!(
                "WAIT: {n} of {} replicas acknowledged the write within {:?}",
                self.replicas, self.timeout
            )),
            Some(Err(e)) => Err(format!("WAIT failed: {e}")),
            None => Err("WAIT got no answer".to_owned()),
        }
    }
}

impl ConnectionLike for Acked {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let is_script = matches!(cmd.args_iter().next(), Some(redis::Arg::Simple(name)) if name.eq_ignore_ascii_case(b"EVALSHA"));
        if !is_script {
            return self.conn.req_packed_command(cmd);
        }
        Box::pin(async move {
            self.acked = None;
            let mut pipe = redis::pipe();
            pipe.add_command(cmd.clone())
                .cmd("WAIT")
                .arg(self.replicas)
                .arg(
                    u64::try_from(self.timeout.as_millis())
                        .unwrap_or(u64::MAX)
                        .max(1),
                );
            let mut values = self.conn.req_packed_commands(&pipe, 0, 2).await?;
            let (Some(wait), Some(reply), true) = (values.pop(), values.pop(), values.is_empty())
            else {
                return Err(RedisError::from(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a script and its WAIT did not get two answers",
                )));
            };
            self.acked = Some(match wait {
                Value::Int(n) => Ok(n),
                Value::ServerError(e) => Err(e.into()),
                other => Err(RedisError::from(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unexpected WAIT answer {other:?}"),
                ))),
            });
            reply.extract_error()
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.conn.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

/// How a failed request ended, as far as the lock is concerned: the classes of the shared
/// [`lock_core::raw::Failure`], still carrying the redis error (a refused database is told by
/// it, before the shared mapping: [`map_failure`]) and `Clone` (every lock of a failed batch of
/// renewals gets the same failure). [`RequestFailure::from`] turns it into the shared type.
#[derive(Clone)]
pub(crate) enum Failure {
    /// Nothing reached the server (connection refused, server loading, …).
    NotSent(RedisError),
    /// The request may have been applied: sent, but no reply (timeout, dropped connection).
    Unknown(String),
    /// The server answered with an error (a script may have run partly: Lua does not roll back).
    Refused(RedisError),
}

impl From<Failure> for RequestFailure {
    fn from(failure: Failure) -> Self {
        match failure {
            Failure::NotSent(e) => Self::not_sent(e),
            Failure::Unknown(message) => Self::unknown(message),
            Failure::Refused(e) => Self::refused(e),
        }
    }
}

/// The end of one request's budget, or `by` when that comes first.
pub(crate) fn request_until(config: &RedisLockConfig, by: Option<Instant>) -> Instant {
    let budget = after(config.request_budget());
    by.map_or(budget, |by| by.min(budget))
}

/// `now + d`, saturating far in the future instead of overflowing.
pub(crate) fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
}

/// Runs one request until `until` and classifies its failure (no reply by then: unknown).
pub(crate) async fn run_until<T>(
    request: impl Future<Output = redis::RedisResult<T>>,
    until: Instant,
) -> Result<T, Failure> {
    let started = Instant::now();
    match timeout_at(until, request).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(classify(e)),
        Err(_) => Err(Failure::Unknown(format!(
            "no reply within {:?}",
            until.saturating_duration_since(started)
        ))),
    }
}

/// The caller's error for a failed write `op` on `key`: a refused database is a configuration
/// error (the pre-classification only Redis has); the rest maps by the shared table
/// ([`RequestFailure::into_error`]): nothing sent `Unavailable`, an unknown outcome
/// `Indeterminate`, a server's refusal `Backend`.
pub(crate) fn map_failure(
    config: &RedisLockConfig,
    op: &'static str,
    key: &LockKey,
    failure: Failure,
) -> Error {
    if let Failure::NotSent(e) | Failure::Refused(e) = &failure
        && let Some(config) = refused_database(config, e)
    {
        return config;
    }
    RequestFailure::from(failure).into_error(BACKEND, op, key, Effect::Write)
}

/// A connect failure that retrying cannot fix: the server refused the credentials or the
/// permissions, or TLS did not trust the server's certificate.
pub(crate) fn is_refused_security(e: &RedisError) -> bool {
    if e.kind() == ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
    {
        return true;
    }
    lock_core::raw::is_rejected_certificate(e) || e.to_string().contains("invalid peer certificate")
}

/// The server refused the `SELECT` of the configured database (a number beyond its
/// `databases`): a permanent misconfiguration, so [`Error::Config`], never `Unavailable`.
pub(crate) fn refused_database(config: &RedisLockConfig, e: &RedisError) -> Option<Error> {
    (e.to_string().contains("refused to switch database")).then(|| {
        Error::Config(format!(
            "the redis server refused database {} (SELECT): {e}",
            config.db
        ))
    })
}

/// rustls needs a process-wide crypto provider; install ring's unless the application already
/// chose one (losing a race to another installer is fine).
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

pub(crate) fn classify(e: RedisError) -> Failure {
    if e.is_connection_refusal() || is_read_only(&e) {
        return Failure::NotSent(e);
    }
    match e.kind() {
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly
            // A redirect the cluster client ran out of retries to follow: that node ran nothing.
            | ServerErrorKind::Moved
            | ServerErrorKind::Ask,
        ) => Failure::NotSent(e),
        ErrorKind::Server(_) if e.code() == Some("BUSY") => Failure::NotSent(e),
        // The cluster client had no connection to send it on.
        ErrorKind::ClusterConnectionNotFound => Failure::NotSent(e),
        ErrorKind::Io => Failure::Unknown(e.to_string()),
        _ if e.is_timeout() || e.is_connection_dropped() => Failure::Unknown(e.to_string()),
        _ => Failure::Refused(e),
    }
}
