//! Redis: `RedisLock` vs `SET NX PX` + an `EVALSHA` compare-and-delete (no fence), vs the same
//! guarantee as ours made bare (one `EVALSHA` granting with `SET NX PX` and minting the fence
//! with `INCR`, one compare-and-delete `EVALSHA`), vs the same plus the other steps lock-redis's
//! scripts take on an uncontended cycle (what those steps cost, apart from the driver's own
//! client-side work), vs `rslock`.

use std::{sync::Arc, time::Duration};

use lock_core::raw::async_trait;
use lock_core::{DynLock, HolderIdentity, LockKey, OwnershipToken};
use lock_redis::{RedisLock, RedisLockConfig};
use redis::aio::MultiplexedConnection;

use super::{AfterIdle, Backend, Counts, Cycle, DistlockCycle, RequestCounter, Res, info_calls};
use crate::report::Kind;

/// The bare release: compare the stored token, then delete.
const COMPARE_DELETE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// The bare grant with the guarantee `RedisLock` gives: `SET NX PX` and a fence from `INCR` in
/// one atomic step, the fence stored with the token so a compare-and-delete checks both.
const FENCED_ACQUIRE: &str = r"
local fence = redis.call('INCR', KEYS[2])
if redis.call('SET', KEYS[1], ARGV[1] .. ':' .. fence, 'NX', 'PX', ARGV[2]) then
  return fence
end
return false
";

/// [`FENCED_ACQUIRE`] with the other steps of lock-redis's acquire script on an uncontended
/// grant: the undo-marker check, the fence read back as the counter's string (exact past 2^53),
/// and the holder key (token, fence and identity) written beside the lock.
const DRIVER_PATH_ACQUIRE: &str = r"
if redis.call('EXISTS', KEYS[3]) == 1 then
  return redis.error_reply('a late attempt, already undone')
end
local incr = redis.pcall('INCR', KEYS[2])
if type(incr) == 'table' then
  return redis.error_reply('fence counter: ' .. tostring(incr.err))
end
local fence = redis.call('GET', KEYS[2])
if redis.call('SET', KEYS[1], ARGV[1] .. fence, 'NX', 'PX', ARGV[2]) then
  redis.call('SET', KEYS[4], ARGV[1] .. fence .. ' ' .. ARGV[3], 'PX', ARGV[2])
  return fence
end
return redis.call('PTTL', KEYS[1])
";

/// [`COMPARE_DELETE`] as lock-redis's release runs it when nobody waits: compare the owner
/// prefix, delete the lock and its holder key, look for a waiter's mark.
const DRIVER_PATH_RELEASE: &str = r"
local value = redis.pcall('GET', KEYS[1])
if type(value) == 'string' and string.sub(value, 1, #ARGV[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  if string.sub(value, -2) == ':w' then
    return 2
  end
  return 1
end
return 0
";

/// The Redis backend at a URL.
pub struct Redis {
    url: String,
}

impl Redis {
    /// Checks the URL (no I/O).
    ///
    /// # Errors
    /// When the URL is not a valid distlock Redis URL.
    pub fn new(url: &str) -> Res<Self> {
        RedisLockConfig::from_url(url)?;
        Ok(Self {
            url: url.to_owned(),
        })
    }

    async fn connection(&self) -> Res<MultiplexedConnection> {
        // The driver's query options (namespace, …) mean nothing to the bare client.
        let base = self.url.split('?').next().unwrap_or(&self.url);
        Ok(redis::Client::open(base)?
            .get_multiplexed_async_connection_with_config(&self.bare_config()?)
            .await?)
    }

    /// The bare variants' connection settings: the driver's connect and response timeouts
    /// (the redis crate's own default response timer is 500 ms against the driver's 1 s; timers
    /// of different lengths land in different slots of the runtime's timer wheel, so the
    /// variants would not pay the same timer work per request).
    fn bare_config(&self) -> Res<redis::AsyncConnectionConfig> {
        let c = RedisLockConfig::from_url(&self.url)?;
        Ok(redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(c.connect_timeout))
            .set_response_timeout(Some(c.timeout)))
    }
}

impl Redis {
    /// A multiplexed connection speaking RESP3, as the driver's does.
    async fn resp3(&self) -> Res<MultiplexedConnection> {
        let base = self.url.split('?').next().unwrap_or(&self.url);
        let info = redis::IntoConnectionInfo::into_connection_info(base)?;
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(redis::ProtocolVersion::RESP3);
        Ok(redis::Client::open(info.set_redis_settings(settings))?
            .get_multiplexed_async_connection_with_config(&self.bare_config()?)
            .await?)
    }

    /// A `ConnectionManager` with lock-redis's settings (its `client.rs`: RESP3, connection and
    /// response timeouts, reconnect retries and delays, a push sender, automatic resubscription).
    async fn manager_as_driver(&self) -> Res<redis::aio::ConnectionManager> {
        let c = RedisLockConfig::from_url(&self.url)?;
        let base = self.url.split('?').next().unwrap_or(&self.url);
        let info = redis::IntoConnectionInfo::into_connection_info(base)?;
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(redis::ProtocolVersion::RESP3);
        let client = redis::Client::open(info.set_redis_settings(settings))?;
        let (pushes, _) = tokio::sync::mpsc::unbounded_channel();
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(c.connect_timeout))
            .set_response_timeout(Some(c.timeout))
            .set_number_of_retries(c.reconnect_retries)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_secs(1))
            .set_push_sender(pushes)
            .set_automatic_resubscription();
        Ok(redis::aio::ConnectionManager::new_with_config(client, config).await?)
    }
}

struct Bare {
    conn: MultiplexedConnection,
    release: redis::Script,
    key: String,
    ttl_ms: u64,
}

#[async_trait]
impl Cycle for Bare {
    fn kind(&self) -> Kind {
        Kind::Bare
    }

    fn label(&self) -> String {
        "SET NX PX + EVALSHA compare-and-delete (redis crate)".into()
    }

    async fn run(&mut self) -> Res<()> {
        let token = OwnershipToken::generate().expose_hex();
        let set: Option<String> = redis::cmd("SET")
            .arg(&self.key)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(self.ttl_ms)
            .query_async(&mut self.conn)
            .await?;
        set.ok_or("the bare key was held")?;
        let deleted: i64 = self
            .release
            .key(&self.key)
            .arg(&token)
            .invoke_async(&mut self.conn)
            .await?;
        if deleted != 1 {
            return Err("the bare compare-and-delete found another token".into());
        }
        Ok(())
    }
}

/// The same guarantee as `RedisLock` (a fence minted atomically with the grant), bare.
struct BareFenced {
    conn: MultiplexedConnection,
    acquire: redis::Script,
    release: redis::Script,
    key: String,
    counter: String,
    ttl_ms: u64,
}

#[async_trait]
impl Cycle for BareFenced {
    fn kind(&self) -> Kind {
        Kind::Bare
    }

    fn label(&self) -> String {
        "same guarantee: EVALSHA SET NX PX + INCR fence, EVALSHA compare-and-delete (redis crate)"
            .into()
    }

    async fn run(&mut self) -> Res<()> {
        let token = OwnershipToken::generate().expose_hex();
        let fence: Option<i64> = self
            .acquire
            .key(&self.key)
            .key(&self.counter)
            .arg(&token)
            .arg(self.ttl_ms)
            .invoke_async(&mut self.conn)
            .await?;
        let fence = fence.ok_or("the bare fenced key was held")?;
        let deleted: i64 = self
            .release
            .key(&self.key)
            .arg(format!("{token}:{fence}"))
            .invoke_async(&mut self.conn)
            .await?;
        if deleted != 1 {
            return Err("the bare compare-and-delete found another token".into());
        }
        Ok(())
    }
}

/// The connection a [`DriverPath`] cycle goes over.
enum BareConn {
    /// A plain `MultiplexedConnection` (RESP2 unless said otherwise).
    Multiplexed(MultiplexedConnection),
    /// A `ConnectionManager` set up as lock-redis sets up its own (RESP3, connection and
    /// response timeouts, reconnect settings, a push sender, automatic resubscription).
    Manager(redis::aio::ConnectionManager),
}

/// The server-side steps of lock-redis's scripts on an uncontended cycle, with the driver's
/// key and argument shapes, sent by the redis crate without the driver: distlock ÷ this is the
/// driver's own cost, this ÷ the same-guarantee bare protocol the cost of the extra steps
/// inside the scripts. Variants differ in the connection and in the per-request budget.
struct DriverPath {
    conn: BareConn,
    what: &'static str,
    acquire: redis::Script,
    release: redis::Script,
    lock: String,
    fence: String,
    holder: String,
    undone: String,
    identity: String,
    ttl_ms: u64,
    /// Each request under `tokio::time::timeout_at` of this budget, as the driver sends it.
    budget: Option<Duration>,
}

impl DriverPath {
    async fn send<T: redis::FromRedisValue>(
        budget: Option<Duration>,
        request: impl Future<Output = redis::RedisResult<T>>,
    ) -> Res<T> {
        Ok(match budget {
            Some(b) => tokio::time::timeout_at(tokio::time::Instant::now() + b, request)
                .await
                .map_err(|_| "no reply within the budget")??,
            None => request.await?,
        })
    }

    async fn cycle<C: redis::aio::ConnectionLike + Send>(&self, conn: &mut C) -> Res<()> {
        let prefix = format!("{}:", OwnershipToken::generate().expose_hex());
        let undone = format!("{}{prefix}", self.undone);
        let mut acquire = self.acquire.key(&self.lock);
        acquire
            .key(&self.fence)
            .key(undone)
            .key(&self.holder)
            .arg(&prefix)
            .arg(self.ttl_ms)
            .arg(&self.identity);
        let fence: Option<String> = Self::send(self.budget, acquire.invoke_async(conn)).await?;
        fence.ok_or("the driver-path key was held")?;
        let mut release = self.release.key(&self.lock);
        release.key(&self.holder).arg(&prefix);
        let deleted: i64 = Self::send(self.budget, release.invoke_async(conn)).await?;
        if deleted != 1 {
            return Err("the driver-path compare-and-delete found another token".into());
        }
        Ok(())
    }
}

#[async_trait]
impl Cycle for DriverPath {
    fn kind(&self) -> Kind {
        Kind::Bare
    }

    fn label(&self) -> String {
        format!(
            "same guarantee + lock-redis's other uncontended steps (undo-marker check, fence read back, holder key), {}",
            self.what
        )
    }

    async fn run(&mut self) -> Res<()> {
        match &self.conn {
            BareConn::Multiplexed(c) => self.cycle(&mut c.clone()).await,
            BareConn::Manager(c) => self.cycle(&mut c.clone()).await,
        }
    }
}

/// `RedisLock` called through its driver interface (`lock_core::raw::Driver`) instead of the
/// `DynLock` of the distlock variant: the difference is lock-core's check layer and the trait
/// object.
struct DriverDirect {
    lock: Arc<RedisLock>,
    key: LockKey,
    ttl: Duration,
}

#[async_trait]
impl Cycle for DriverDirect {
    fn kind(&self) -> Kind {
        Kind::Bare
    }

    fn label(&self) -> String {
        "RedisLock try_acquire + release through lock_core::raw::Driver (no check layer, no DynLock)"
            .into()
    }

    async fn run(&mut self) -> Res<()> {
        use lock_core::raw::Driver;
        let lease = Driver::try_acquire(self.lock.as_ref(), &self.key, self.ttl)
            .await?
            .ok_or("the driver-direct key was held")?;
        if !Driver::release(self.lock.as_ref(), &lease).await? {
            return Err("release reported the lease already lost".into());
        }
        Ok(())
    }
}

struct Peer {
    manager: rslock::LockManager,
    key: String,
    ttl: Duration,
}

#[async_trait]
impl Cycle for Peer {
    fn kind(&self) -> Kind {
        Kind::Peer
    }

    fn label(&self) -> String {
        "rslock 0.10 LockManager lock + unlock (one server)".into()
    }

    async fn run(&mut self) -> Res<()> {
        let lock = self.manager.lock(self.key.as_str(), self.ttl).await?;
        self.manager.unlock(&lock).await;
        Ok(())
    }
}

struct Ping {
    conn: MultiplexedConnection,
}

#[async_trait]
impl Cycle for Ping {
    fn kind(&self) -> Kind {
        Kind::Rtt
    }

    fn label(&self) -> String {
        "PING".into()
    }

    async fn run(&mut self) -> Res<()> {
        redis::cmd("PING").query_async::<()>(&mut self.conn).await?;
        Ok(())
    }
}

/// One plain write: `SET key value PX ttl`.
struct Write {
    conn: MultiplexedConnection,
    key: String,
    ttl_ms: u64,
}

#[async_trait]
impl Cycle for Write {
    fn kind(&self) -> Kind {
        Kind::Write
    }

    fn label(&self) -> String {
        "SET PX".into()
    }

    async fn run(&mut self) -> Res<()> {
        redis::cmd("SET")
            .arg(&self.key)
            .arg("1")
            .arg("PX")
            .arg(self.ttl_ms)
            .query_async::<()>(&mut self.conn)
            .await?;
        Ok(())
    }
}

/// `EVAL`, `EVALSHA` and their read-only variants.
fn is_script_call(command: &str) -> bool {
    matches!(command, "eval" | "evalsha" | "eval_ro" | "evalsha_ro")
}

/// `INFO commandstats`: script calls on the whole server.
struct CommandStats {
    conn: MultiplexedConnection,
}

#[async_trait]
impl RequestCounter for CommandStats {
    fn source(&self) -> String {
        "INFO commandstats: EVAL/EVALSHA calls, i.e. RedisLock requests (whole server, background subtracted)".into()
    }

    fn exclusive(&self) -> bool {
        false
    }

    async fn read(&self) -> Res<Counts> {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut self.conn.clone())
            .await?;
        let parts: Vec<(String, u64)> = info.lines().filter_map(info_calls).collect();
        // Every RedisLock operation is one script call. Commands run inside scripts are counted
        // by commandstats (and total_commands_processed) too, so they are no round trips.
        let total = parts
            .iter()
            .filter(|(name, _)| is_script_call(name))
            .map(|(_, n)| n)
            .sum();
        Ok(Counts { total, parts })
    }
}

#[async_trait]
impl Backend for Redis {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn server(&self) -> String {
        RedisLockConfig::from_url(&self.url)
            .map(|c| format!("{}:{}", c.host, c.port))
            .unwrap_or_default()
    }

    async fn client(&self) -> Res<DynLock> {
        Ok(Arc::new(RedisLock::connect_url(&self.url).await?))
    }

    async fn cycles(&self, run: &str, ttl: Duration) -> Res<Vec<Box<dyn Cycle>>> {
        let ttl_ms = u64::try_from(ttl.as_millis())?;
        let manager =
            rslock::LockManager::new(vec![self.url.split('?').next().unwrap_or(&self.url)]);
        // Keys shaped as the driver names them (lock-redis's keys.rs), in one slot.
        let lock = format!("distlock:bench/{run}/driver-path");
        let derived = |name: &str| format!("{{{lock}}}\x1f{name}");
        let identity = HolderIdentity::process(None)?.as_str().to_owned();
        let path = |conn, what, suffix: &str, budget| DriverPath {
            conn,
            what,
            acquire: redis::Script::new(DRIVER_PATH_ACQUIRE),
            release: redis::Script::new(DRIVER_PATH_RELEASE),
            fence: derived(&format!("fence{suffix}")),
            holder: derived(&format!("holder{suffix}")),
            undone: derived(&format!("undone{suffix}:")),
            lock: format!("{lock}{suffix}"),
            identity: identity.clone(),
            ttl_ms,
            budget,
        };
        // About the driver's per-request budget (connection attempts plus the response timeout).
        let c = RedisLockConfig::from_url(&self.url)?;
        let attempts = u32::try_from(c.reconnect_retries.saturating_add(1)).unwrap_or(u32::MAX);
        let budget = c
            .connect_timeout
            .saturating_mul(attempts)
            .saturating_add(c.timeout);
        Ok(vec![
            Box::new(DistlockCycle {
                lock: self.client().await?,
                key: LockKey::new(format!("bench/{run}/cycle"))?,
                ttl,
                label: "RedisLock try_acquire + release (EVALSHA + EVALSHA)".into(),
            }),
            Box::new(Bare {
                conn: self.connection().await?,
                release: redis::Script::new(COMPARE_DELETE),
                key: format!("distlock-bench:{run}:bare"),
                ttl_ms,
            }),
            Box::new(BareFenced {
                conn: self.connection().await?,
                acquire: redis::Script::new(FENCED_ACQUIRE),
                release: redis::Script::new(COMPARE_DELETE),
                // One hash slot, like the driver's keys.
                key: format!("distlock-bench:{{{run}}}:fenced"),
                counter: format!("distlock-bench:{{{run}}}:fenced:fence"),
                ttl_ms,
            }),
            Box::new(path(
                BareConn::Multiplexed(self.connection().await?),
                "redis crate MultiplexedConnection (RESP2)",
                "",
                None,
            )),
            Box::new(path(
                BareConn::Multiplexed(self.resp3().await?),
                "redis crate MultiplexedConnection, RESP3",
                "-resp3",
                None,
            )),
            Box::new(path(
                BareConn::Manager(self.manager_as_driver().await?),
                "redis crate ConnectionManager set up as lock-redis's (RESP3, timeouts, push sender) + its request budget (timeout_at)",
                "-manager",
                Some(budget),
            )),
            Box::new(DriverDirect {
                lock: Arc::new(RedisLock::connect_url(&self.url).await?),
                key: LockKey::new(format!("bench/{run}/driver-direct"))?,
                ttl,
            }),
            Box::new(Peer {
                manager,
                key: format!("distlock-bench:{run}:rslock"),
                ttl,
            }),
            Box::new(Ping {
                conn: self.connection().await?,
            }),
            Box::new(AfterIdle(Box::new(Ping {
                conn: self.connection().await?,
            }))),
            Box::new(Write {
                conn: self.connection().await?,
                key: format!("distlock-bench:{run}:write"),
                ttl_ms,
            }),
        ])
    }

    async fn watchdog_client(&self) -> Res<(DynLock, Box<dyn RequestCounter>)> {
        Ok((
            self.client().await?,
            Box::new(CommandStats {
                conn: self.connection().await?,
            }),
        ))
    }
}
