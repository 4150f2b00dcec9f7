//! Shared set-up of the ZooKeeper-specific tests: a client configuration with short sessions
//! under a test root, a raw zookeeper-client session for looking at (and meddling with) the
//! nodes, and keys whose directory is `<root>/<key>` verbatim.

use std::time::Duration;

use conformance::{backend_url, fresh_key};
use lock_core::LockKey;
use lock_zk::ZkLockConfig;
use zookeeper_client as zk;

pub const SESSION: Duration = Duration::from_secs(1);
pub const ROOT: &str = "/distlock-test";

/// The driver's configuration for the local server (`None` when it is not configured).
pub fn config() -> Option<ZkLockConfig> {
    let url = backend_url("DISTLOCK_TEST_ZK_URL")?;
    let mut config = ZkLockConfig::from_url(&url).unwrap();
    config.session_timeout = SESSION;
    config.root = ROOT.into();
    Some(config)
}

/// A session of our own, outside the driver.
pub async fn raw_client(config: &ZkLockConfig) -> zk::Client {
    zk::Client::connector()
        .with_session_timeout(Duration::from_secs(5))
        .connect(&config.hosts)
        .await
        .unwrap()
}

/// A key made of ordinary characters, so its directory is `<root>/<key>` verbatim.
pub fn plain_key() -> LockKey {
    let k = fresh_key("zk");
    LockKey::new(k.as_str().replace('/', "-")).unwrap()
}

/// Children of `dir` in lock order (by sequence).
pub async fn children(raw: &zk::Client, dir: &str) -> Vec<String> {
    let mut c = raw.list_children(dir).await.unwrap_or_default();
    c.sort_by(|a, b| a[a.len() - 10..].cmp(&b[b.len() - 10..]));
    c
}
