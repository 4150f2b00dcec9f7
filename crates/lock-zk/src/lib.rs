//! The crate root: the crate docs and the public re-exports, nothing else (the source layout,
//! one job per file, closes these docs).
#![doc = include_str!("../README.md")]
//!
//! ## Source layout
//!
//! | file | job |
//! |---|---|
//! | `config.rs` | [`ZkLockConfig`], [`ZkAcl`] and URL parsing |
//! | `client.rs` | connecting: the session (digest auth, the handshake's retries, its connections, its heartbeat), and classifying zookeeper-client's errors |
//! | `lock.rs` | [`ZkLock`]'s `impl Driver`: the coordinator's algorithm for acquire, try_acquire, release, inspect, force_release |
//! | `queue.rs` | the waiter queue: how a contender node queues, waits for its turn (watches on the nodes ahead) and leaves |
//! | `renew.rs` | renewal, its batched `sync`, and the session's vouched window (the leases' local deadlines) |
//! | `members.rs` | one persistent recursive watch on the lock root for a session's many held locks, pushing their losses |
//! | `wake.rs` | the push channel: the deletion watch on our nodes, and the `watch_lost` future built on it |
//! | `path.rs` | the wire layout: keys to ZooKeeper paths, Curator's node names and order |
//! | `audit.rs` | [`audit()`]: reading and grading the server settings the invariant depends on |
#![deny(missing_docs)]

mod audit;
mod client;
mod config;
mod lock;
mod members;
mod path;
mod queue;
mod renew;
mod wake;

pub use audit::{audit, namespace_size, purge_namespace};
pub use config::{ZkAcl, ZkLockConfig};
pub use lock::ZkLock;

/// The backend name used in errors and metric labels.
pub const BACKEND: &str = "zk";
