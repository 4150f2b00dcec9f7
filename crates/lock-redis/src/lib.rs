#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod audit;
mod config;
mod conn;
mod keys;
mod lock;
mod redlock;
mod scripts;
mod wakeups;

pub use audit::{audit, namespace_size, purge_namespace};
pub use config::{RedisLockConfig, RedisTopology};
pub use lock::RedisLock;
pub use redlock::{RedlockConfig, RedlockLock};
