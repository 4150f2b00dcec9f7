#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod audit;
mod client;
mod config;
mod fenced;
mod lock;
mod message;
mod sql;
mod wake;

pub use audit::{audit, namespace_size, purge_namespace};
pub use config::{PgLockConfig, TableName};
pub use fenced::{FenceError, FencedTable};
pub use lock::PgLock;

/// Re-exported so callers can name the pool, connections and transactions of
/// [`PgLock::pool`] and [`FencedTable::fence`] with the same `sqlx` version.
pub use sqlx;
