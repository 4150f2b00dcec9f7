//! Redis: `RedisLock` vs `SET NX PX` + an `EVALSHA` compare-and-delete (no fence), vs the same
//! guarantee as ours made bare (one `EVALSHA` granting with `SET NX PX` and minting the fence
//! with `INCR`, one compare-and-delete `EVALSHA`), vs `rslock`.

use std::{sync::Arc, time::Duration};

use lock_core::raw::async_trait;
use lock_core::{DynLock, LockKey, OwnershipToken};
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
            .get_multiplexed_async_connection()
            .await?)
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
