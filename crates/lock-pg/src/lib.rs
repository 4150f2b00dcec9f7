#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

// One job per file:
// - config: `PgLockConfig` and URL parsing.
// - client: connecting (TLS, credentials, the client's own connection pool, the table check on
//   first use), running one statement under its budget, and classifying `sqlx`'s errors.
// - lock: `impl Driver for PgLock`, the coordinator's algorithm (acquire, try_acquire, release,
//   inspect, force_release) and the undo of an acquire of unknown outcome.
// - queue: the waiter queue: how a waiter queues, learns of its grant, and leaves.
// - renew: renewal batching and the renewed lease's local deadline.
// - wake: the push channel: `LISTEN`/`NOTIFY` wake-ups and grants.
// - sql: the wire module: every statement's SQL.
// - fenced: resource-side fenced writes (`FencedTable`).
// - audit: `distlock check` for PostgreSQL.
mod audit;
mod client;
mod config;
mod fenced;
mod lock;
mod queue;
mod renew;
mod sql;
mod wake;

pub use audit::{audit, namespace_size, purge_namespace};
pub use config::{PgLockConfig, TableName};
pub use fenced::{FenceError, FencedTable};
pub use lock::PgLock;

/// Re-exported so callers can name the pool, connections and transactions of
/// [`PgLock::pool`] and [`FencedTable::fence`] with the same `sqlx` version.
pub use sqlx;
