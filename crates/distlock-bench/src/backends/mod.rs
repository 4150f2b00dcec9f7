//! What differs per coordinator: building clients, the bare protocol, the peer library and the
//! server-side request counter.

use std::time::Duration;

use lock_core::raw::async_trait;
use lock_core::{BoxError, DynLock, LockKey};

use crate::report::Kind;

pub mod etcd;
pub mod pg;
pub mod redis;
pub mod zk;

/// Results of fallible bench steps.
pub type Res<T> = Result<T, BoxError>;

/// One way to do an uncontended acquire+release cycle (or one bare round trip).
#[async_trait]
pub trait Cycle: Send {
    /// What kind of variant this is.
    fn kind(&self) -> Kind;
    /// What it does, for the table.
    fn label(&self) -> String;
    /// One cycle. Fails if the lock was not free or the server answered an error.
    async fn run(&mut self) -> Res<()>;
    /// Idle time before each (untimed) cycle.
    fn idle_before(&self) -> Duration {
        Duration::ZERO
    }
}

/// A bare round trip measured after the hand-off's idle time ([`crate::scenario::HANDOFF_HOLD`]).
pub struct AfterIdle(pub Box<dyn Cycle>);

#[async_trait]
impl Cycle for AfterIdle {
    fn kind(&self) -> Kind {
        Kind::IdleRtt
    }

    fn label(&self) -> String {
        format!(
            "{} after {:?} idle",
            self.0.label(),
            crate::scenario::HANDOFF_HOLD
        )
    }

    async fn run(&mut self) -> Res<()> {
        self.0.run().await
    }

    fn idle_before(&self) -> Duration {
        crate::scenario::HANDOFF_HOLD
    }
}

/// A request count, in total and by kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// All requests.
    pub total: u64,
    /// By kind (command, RPC, …), where the source tells.
    pub parts: Vec<(String, u64)>,
}

impl Counts {
    /// The kinds that grew most from `before` to `self`, largest first (at most `n`).
    pub fn top_growth(&self, before: &Counts, n: usize) -> Vec<(String, u64)> {
        let mut grown: Vec<(String, u64)> = self
            .parts
            .iter()
            .filter_map(|(k, v)| {
                let was = before
                    .parts
                    .iter()
                    .find(|(bk, _)| bk == k)
                    .map_or(0, |(_, b)| *b);
                let d = v.saturating_sub(was);
                (d > 0).then(|| (k.clone(), d))
            })
            .collect();
        grown.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        grown.truncate(n);
        grown
    }
}

/// Counts requests a lock client sends to the coordinator.
#[async_trait]
pub trait RequestCounter: Send + Sync {
    /// Where the number comes from.
    fn source(&self) -> String;
    /// `true` when only our client's requests are counted; otherwise the count is the whole
    /// server's and a background rate is subtracted.
    fn exclusive(&self) -> bool;
    /// The current count.
    async fn read(&self) -> Res<Counts>;
    /// Client state worth reporting once the locks are held (e.g. sessions in use).
    fn details(&self) -> Option<String> {
        None
    }
}

/// One coordinator under test.
#[async_trait]
pub trait Backend: Send + Sync {
    /// `redis`, `etcd`, `zk` or `pg`.
    fn name(&self) -> &'static str;
    /// The server, without credentials.
    fn server(&self) -> String;
    /// One-time setup before any measurement.
    async fn prepare(&self) -> Res<()> {
        Ok(())
    }
    /// A new, independent distlock client (its own connection or session).
    async fn client(&self) -> Res<DynLock>;
    /// The uncontended variants, distlock first, on fresh keys derived from `run`.
    async fn cycles(&self, run: &str, ttl: Duration) -> Res<Vec<Box<dyn Cycle>>>;
    /// A fresh client for the watchdog measurement and a counter of its requests.
    async fn watchdog_client(&self) -> Res<(DynLock, Box<dyn RequestCounter>)>;
    /// Anything the reader must know about this backend's numbers.
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
    /// The bare protocol's acquisitions per second with `clients` clients taking turns on one
    /// key for `window`, beside distlock's "16 clients, 1 key" — for a backend whose contended
    /// protocol can be written bare with the same guarantee (etcd's fair queue); `None` where
    /// it cannot.
    async fn bare_one_key(&self, clients: usize, window: Duration) -> Option<Res<f64>> {
        let _ = (clients, window);
        None
    }
}

/// The distlock variant, the same for every backend: `try_acquire` + `release` through the
/// type-erased client, as applications use it.
pub struct DistlockCycle {
    /// The client.
    pub lock: DynLock,
    /// The key cycled on.
    pub key: LockKey,
    /// The lease TTL.
    pub ttl: Duration,
    /// The label.
    pub label: String,
}

#[async_trait]
impl Cycle for DistlockCycle {
    fn kind(&self) -> Kind {
        Kind::Distlock
    }

    fn label(&self) -> String {
        self.label.clone()
    }

    async fn run(&mut self) -> Res<()> {
        let lease = self
            .lock
            .try_acquire(&self.key, self.ttl)
            .await?
            .ok_or("the uncontended key was held")?;
        if !self.lock.release(&lease).await? {
            return Err("release reported the lease already lost".into());
        }
        Ok(())
    }
}

/// The command name and `calls` of a Redis `INFO commandstats` line such as
/// `cmdstat_get:calls=5,usec=1,...`.
pub fn info_calls(line: &str) -> Option<(String, u64)> {
    let (name, fields) = line.split_once(':')?;
    let name = name.strip_prefix("cmdstat_")?;
    let calls = fields
        .split(',')
        .find_map(|f| f.strip_prefix("calls="))?
        .parse()
        .ok()?;
    Some((name.to_owned(), calls))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_calls_reads_the_calls_field() {
        assert_eq!(
            info_calls("cmdstat_evalsha:calls=1234,usec=99,usec_per_call=0.08"),
            Some(("evalsha".to_owned(), 1234))
        );
        assert_eq!(info_calls("# Commandstats"), None);
    }

    #[test]
    fn top_growth_orders_by_delta() {
        let before = Counts {
            total: 10,
            parts: vec![("a".into(), 5), ("b".into(), 5)],
        };
        let after = Counts {
            total: 40,
            parts: vec![("a".into(), 6), ("b".into(), 25), ("c".into(), 9)],
        };
        assert_eq!(
            after.top_growth(&before, 2),
            vec![("b".to_owned(), 20), ("c".to_owned(), 9)]
        );
    }
}
