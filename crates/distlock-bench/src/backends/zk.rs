//! ZooKeeper: `ZkLock` vs create ephemeral-sequential + getChildren + delete vs
//! zookeeper-client's own `Client::lock` (Curator layout).

use std::{sync::Arc, time::Duration};

use lock_core::raw::async_trait;
use lock_core::{DynLock, LockKey};
use lock_zk::{ZkLock, ZkLockConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zookeeper_client as zk;

use super::{AfterIdle, Backend, Counts, Cycle, DistlockCycle, RequestCounter, Res};
use crate::report::Kind;

/// The ZooKeeper backend at a URL.
pub struct Zk {
    config: ZkLockConfig,
}

impl Zk {
    /// Parses the URL (no I/O). The session timeout is set to `session_timeout` (it is the
    /// driver's smallest TTL, and the watchdog measurement uses short TTLs).
    ///
    /// # Errors
    /// When the URL is not a valid distlock ZooKeeper URL.
    pub fn new(url: &str, session_timeout: Duration) -> Res<Self> {
        let mut config = ZkLockConfig::from_url(url)?;
        config.session_timeout = session_timeout;
        Ok(Self { config })
    }

    async fn raw(&self) -> Res<zk::Client> {
        Ok(zk::Client::connector()
            .with_session_timeout(self.config.session_timeout)
            .connect(&self.config.connect_string())
            .await?)
    }

    fn first_host(&self) -> String {
        self.config
            .hosts
            .split(',')
            .next()
            .unwrap_or_default()
            .to_owned()
    }
}

fn open_acls() -> zk::Acls<'static> {
    zk::Acls::anyone_all()
}

struct Bare {
    client: zk::Client,
    dir: String,
    prefix: String,
}

#[async_trait]
impl Cycle for Bare {
    fn kind(&self) -> Kind {
        Kind::Bare
    }

    fn label(&self) -> String {
        "create ephemeral-sequential + getChildren + delete (zookeeper-client)".into()
    }

    async fn run(&mut self) -> Res<()> {
        let mode = zk::CreateMode::EphemeralSequential.with_acls(open_acls());
        let (_stat, seq) = match self.client.create(&self.prefix, &[], &mode).await {
            // The server reaps an empty container (as it does distlock's): make it again.
            Err(zk::Error::NoNode) => {
                let container = zk::CreateMode::Container.with_acls(open_acls());
                self.client.mkdir(&self.dir, &container).await?;
                self.client.create(&self.prefix, &[], &mode).await?
            }
            created => created?,
        };
        let children = self.client.list_children(&self.dir).await?;
        if children.len() != 1 {
            return Err("the bare directory had other contenders".into());
        }
        self.client
            .delete(&format!("{}{seq}", self.prefix), None)
            .await?;
        Ok(())
    }
}

/// zookeeper-client's lock recipe. Its guard deletes the node in the background on drop; the
/// bench deletes it in the foreground instead, so the release is timed like everyone else's.
struct Peer {
    client: zk::Client,
    dir: String,
}

#[async_trait]
impl Cycle for Peer {
    fn kind(&self) -> Kind {
        Kind::Peer
    }

    fn label(&self) -> String {
        "zookeeper-client Client::lock (LockPrefix::new_curator) + delete".into()
    }

    async fn run(&mut self) -> Res<()> {
        let prefix = zk::LockPrefix::new_curator(&self.dir, "lock-")?;
        let options = zk::LockOptions::new(open_acls())
            .with_ancestor_options(zk::CreateMode::Container.with_acls(open_acls()))?;
        let guard = self.client.lock(prefix, b"", options).await?;
        let path = guard.lock_path().to_owned();
        let deleted = self.client.delete(&path, None).await;
        // Its drop would delete the (already deleted) node once more in the background.
        std::mem::forget(guard);
        deleted?;
        Ok(())
    }
}

struct Exists {
    client: zk::Client,
}

#[async_trait]
impl Cycle for Exists {
    fn kind(&self) -> Kind {
        Kind::Rtt
    }

    fn label(&self) -> String {
        "exists (check_stat of /)".into()
    }

    async fn run(&mut self) -> Res<()> {
        self.client.check_stat("/").await?;
        Ok(())
    }
}

/// One plain write: setData on an ephemeral node of the bench's session.
struct SetData {
    client: zk::Client,
    path: String,
}

#[async_trait]
impl Cycle for SetData {
    fn kind(&self) -> Kind {
        Kind::Write
    }

    fn label(&self) -> String {
        "setData (one node)".into()
    }

    async fn run(&mut self) -> Res<()> {
        self.client.set_data(&self.path, b"1", None).await?;
        Ok(())
    }
}

/// The `cons` four-letter word: packets received on our session's connection.
struct SessionPackets {
    host: String,
    session: String,
}

/// `recved=` of the `cons` line that carries `sid=<session>`.
pub fn cons_received(cons: &str, session: &str) -> Option<u64> {
    let needle = format!("sid={session},");
    let needle_end = format!("sid={session})");
    let line = cons
        .lines()
        .find(|l| l.contains(&needle) || l.contains(&needle_end))?;
    let start = line.find("recved=")? + "recved=".len();
    let digits: String = line[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

#[async_trait]
impl RequestCounter for SessionPackets {
    fn source(&self) -> String {
        "4lw cons: packets received on this session (incl. pings)".into()
    }

    fn exclusive(&self) -> bool {
        true
    }

    async fn read(&self) -> Res<Counts> {
        let mut stream = tokio::net::TcpStream::connect(&self.host).await?;
        stream.write_all(b"cons").await?;
        let mut out = String::new();
        stream.read_to_string(&mut out).await?;
        let total = cons_received(&out, &self.session)
            .ok_or_else(|| format!("session {} not in `cons`", self.session))?;
        Ok(Counts {
            total,
            parts: Vec::new(),
        })
    }
}

#[async_trait]
impl Backend for Zk {
    fn name(&self) -> &'static str {
        "zk"
    }

    fn server(&self) -> String {
        self.config.hosts.clone()
    }

    async fn client(&self) -> Res<DynLock> {
        Ok(Arc::new(ZkLock::connect(self.config.clone()).await?))
    }

    async fn cycles(&self, run: &str, ttl: Duration) -> Res<Vec<Box<dyn Cycle>>> {
        let raw = self.raw().await?;
        let container = zk::CreateMode::Container.with_acls(open_acls());
        let bare_dir = format!("/distlock-bench/{run}-bare");
        let peer_dir = format!("/distlock-bench/{run}-peer");
        raw.mkdir(&bare_dir, &container).await?;
        raw.mkdir(&peer_dir, &container).await?;
        let write_path = format!("/distlock-bench/{run}-write");
        raw.create(
            &write_path,
            b"",
            &zk::CreateMode::Ephemeral.with_acls(open_acls()),
        )
        .await?;
        Ok(vec![
            Box::new(DistlockCycle {
                lock: self.client().await?,
                key: LockKey::new(format!("bench-{run}-cycle"))?,
                ttl: ttl.max(self.config.session_timeout),
                label: "ZkLock try_acquire + release".into(),
            }),
            Box::new(Bare {
                client: raw.clone(),
                prefix: format!("{bare_dir}/_c_00000000-0000-0000-0000-000000000000-lock-"),
                dir: bare_dir,
            }),
            Box::new(Peer {
                client: raw.clone(),
                dir: peer_dir,
            }),
            Box::new(Exists {
                client: raw.clone(),
            }),
            Box::new(AfterIdle(Box::new(Exists {
                client: raw.clone(),
            }))),
            Box::new(SetData {
                client: raw,
                path: write_path,
            }),
        ])
    }

    async fn watchdog_client(&self) -> Res<(DynLock, Box<dyn RequestCounter>)> {
        let lock = ZkLock::connect(self.config.clone()).await?;
        let session = lock.zk_client().await?.session_id().to_string();
        Ok((
            Arc::new(lock),
            Box::new(SessionPackets {
                host: self.first_host(),
                session,
            }),
        ))
    }

    fn notes(&self) -> Vec<String> {
        vec![format!(
            "sessions use a {:?} timeout (the driver's smallest TTL); every ZkLock session also sends a heartbeat read every timeout/5.",
            self.config.session_timeout
        )]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cons_line_of_our_session() {
        let cons = " /127.0.0.1:1[1](queued=0,recved=7,sent=7,sid=0x10000abc,lop=PING)\n \
                    /127.0.0.1:2[1](queued=0,recved=42,sent=41,sid=0x10000abcd,lop=EXIS)\n";
        assert_eq!(cons_received(cons, "0x10000abcd"), Some(42));
        assert_eq!(cons_received(cons, "0x10000abc"), Some(7));
        assert_eq!(cons_received(cons, "0x1"), None);
    }
}
