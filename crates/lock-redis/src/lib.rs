//! The crate root: the crate docs and the public re-exports, nothing else (the source layout,
//! one job per file, closes these docs).
#![doc = include_str!("../README.md")]
//!
//! ## Source layout
//!
//! | file | job |
//! |---|---|
//! | `config.rs` | [`RedisLockConfig`], [`RedisTopology`] and URL parsing |
//! | `client.rs` | connecting (TLS, auth, Sentinel, Cluster, replica `WAIT`), the request budget, classifying the redis crate's errors |
//! | `lock.rs` | [`RedisLock`]'s `impl Driver`: the coordinator's algorithm for acquire, try_acquire, release, inspect, force_release |
//! | `queue.rs` | the waiter queue: how a waiter queues, waits for its turn and leaves |
//! | `renew.rs` | renewal, its batching and its local-deadline accounting |
//! | `wake.rs` | the coordinator's push channel: grant messages and wake-ups |
//! | `scripts.rs`, `keys.rs` | the wire: the Lua scripts and the values they store; the key names and slots |
//! | `redlock.rs` | [`RedlockLock`]: Redlock over independent masters |
//! | `audit.rs` | [`audit()`], [`namespace_size()`], [`purge_namespace()`] |
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod audit;
mod client;
mod config;
mod keys;
mod lock;
mod queue;
mod redlock;
mod renew;
mod scripts;
mod wake;

pub use audit::{audit, namespace_size, purge_namespace};
pub use config::{RedisLockConfig, RedisTopology};
pub use lock::RedisLock;
pub use redlock::{RedlockConfig, RedlockLock};
