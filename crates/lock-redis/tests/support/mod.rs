//! Private Redis topologies for the tests that need them (see `servers.rs`, which
//! `distlock-bench --redis-topologies` shares), and the sets kept for a whole test binary.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod sentinel_harness;
mod servers;

use std::sync::OnceLock;

use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
pub use servers::*;

/// Signals to a server the test started (SIGSTOP / SIGCONT), by its pid.
pub trait SignalServer {
    fn signal(&self, sig: Signal);
}

impl SignalServer for Server {
    fn signal(&self, sig: Signal) {
        if let Some(pid) = self.pid() {
            let raw = Pid::from_raw(i32::try_from(pid).unwrap());
            kill(raw, sig).unwrap_or_else(|e| panic!("kill -{sig} {pid}: {e}"));
        }
    }
}

/// One Sentinel set for the whole test binary (never failed over by the tests using it).
pub fn shared_sentinel() -> &'static SentinelSet {
    static SET: OnceLock<SentinelSet> = OnceLock::new();
    SET.get_or_init(|| SentinelSet::start(false))
}

/// One Cluster for the whole test binary (never broken by the tests using it).
pub fn shared_cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(Cluster::start)
}

/// Three masters for the whole test binary.
pub fn shared_masters() -> &'static Masters {
    static MASTERS: OnceLock<Masters> = OnceLock::new();
    MASTERS.get_or_init(Masters::start)
}
