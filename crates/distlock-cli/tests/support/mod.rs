//! Shared by the CLI's server tests (`backends.rs`, `elect.rs`, `lifetime.rs`): fresh names, scratch directories, and waiting for a command's marker file.
#![allow(dead_code, clippy::unwrap_used)]

use std::{
    path::{Path, PathBuf},
    process::Child,
    thread,
    time::{Duration, Instant},
};

/// A lock key (or election name) no other test or run uses.
pub fn fresh_key(label: &str) -> String {
    format!("distlock-cli-test/{label}/{:016x}", rand::random::<u64>())
}

/// A new scratch directory under the system's temp dir.
pub fn temp_dir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "distlock-cli-{label}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits until `path` exists, failing if `child` (distlock) exits first or it takes longer
/// than `within`.
pub fn wait_for_file(path: &Path, child: &mut Child, within: Duration) {
    let deadline = Instant::now() + within;
    while !path.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "distlock exited with {status} before {} appeared",
                path.display()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        thread::sleep(Duration::from_millis(20));
    }
}
