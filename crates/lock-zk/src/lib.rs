#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

// One job per file:
// - `config`: `ZkLockConfig` and URL parsing.
// - `client`: connecting, the session (auth, handshake retries, connections, heartbeat) and the
//   classification of zookeeper-client's errors.
// - `lock`: `ZkLock`, the `Driver` impl and the coordinator's algorithm for acquire,
//   try_acquire, release, inspect and force_release.
// - `queue`: the waiter queue — how a contender node queues, waits for its turn and leaves.
// - `renew`: renewal, its batched `sync`, and the session's vouched window (local deadlines).
// - `wake`: the push channel — the deletion watch on our nodes, and `watch_lost` built on it.
// - `path`: keys to ZooKeeper paths and Curator's node layout (the wire module).
// - `audit`: `distlock check`'s reading and grading of the server's settings.
mod audit;
mod client;
mod config;
mod lock;
mod path;
mod queue;
mod renew;
mod wake;

pub use audit::{audit, namespace_size, purge_namespace};
pub use config::{ZkAcl, ZkLockConfig};
pub use lock::ZkLock;

/// The backend name used in errors and metric labels.
pub const BACKEND: &str = "zk";
