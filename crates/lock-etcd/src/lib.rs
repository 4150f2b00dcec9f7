#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

// lib.rs: the crate docs (the README) and the re-exports, nothing else. (A plain comment, not
// `//!`: that would become the first line of the crate docs.)
//
// One job per module:
// - `config`: the config structs and URL parsing.
// - `client`: connecting (TLS, auth), request counting, classifying etcd-client's errors.
// - `lock`: the `Driver` impl and the coordinator's algorithm (acquire, try_acquire, release,
//   inspect, force_release).
// - `queue`: the waiter queue — queueing, waiting for one's turn (with the queue's own
//   watches, which live here rather than in `wake`), leaving.
// - `renew`: the shared session leases, renewal and its batching, local-deadline accounting.
// - `wake`: the push channel — held locks' deletion watches on one shared stream.
// - `keys`: the wire layout (Go `concurrency.Mutex` keys and values).
// - `audit`: `distlock check`'s read-only audit and namespace tools.
mod audit;
mod client;
mod config;
mod keys;
mod lock;
mod queue;
mod renew;
mod wake;

pub use audit::{audit, namespace_size, purge_namespace};
pub use client::EtcdRequestCounts;
pub use config::{EtcdLockConfig, EtcdTlsConfig};
pub use lock::EtcdLock;
