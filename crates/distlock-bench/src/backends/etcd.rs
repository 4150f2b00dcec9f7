//! etcd: `EtcdLock` vs the same requests made bare vs the server's Lock RPC.

use std::{sync::Arc, time::Duration};

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, LockOptions, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp,
};
use lock_core::raw::async_trait;
use lock_core::{DynLock, LockKey};
use lock_etcd::{EtcdLock, EtcdLockConfig};

use super::{AfterIdle, Backend, Counts, Cycle, DistlockCycle, RequestCounter, Res};
use crate::report::Kind;

/// The etcd backend at a URL.
pub struct Etcd {
    config: EtcdLockConfig,
}

/// The driver's endpoints as `etcd-client` takes them.
pub fn endpoints(config: &EtcdLockConfig) -> Vec<String> {
    config
        .endpoints
        .iter()
        .map(|e| format!("http://{e}"))
        .collect()
}

impl Etcd {
    /// Parses the URL (no I/O).
    ///
    /// # Errors
    /// When the URL is not a valid distlock etcd URL.
    pub fn new(url: &str) -> Res<Self> {
        Ok(Self {
            config: EtcdLockConfig::from_url(url)?,
        })
    }

    async fn bare_client(&self) -> Res<Client> {
        Ok(Client::connect(endpoints(&self.config), None).await?)
    }

    fn whole_seconds(ttl: Duration) -> i64 {
        i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX)
    }
}

/// The mutex's requests made bare: grant, put-if-absent + owner read, then either a
/// create-revision-guarded delete and a revoke (what distlock does), or just the revoke (which
/// deletes the key with its lease: the minimal cycle).
struct Bare {
    client: Client,
    name: String,
    ttl: i64,
    guarded_delete: bool,
}

#[async_trait]
impl Cycle for Bare {
    fn kind(&self) -> Kind {
        Kind::Bare
    }

    fn label(&self) -> String {
        if self.guarded_delete {
            "grant + txn put + guarded delete txn + revoke (4 requests)".into()
        } else {
            "minimal: grant + txn put + revoke (3 requests)".into()
        }
    }

    async fn run(&mut self) -> Res<()> {
        let lease = self.client.lease_grant(self.ttl, None).await?.id();
        let key = format!("{}{lease:x}", self.name);
        let owner = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(key.clone(), "t", Some(PutOptions::new().with_lease(lease))),
                TxnOp::get(self.name.clone(), Some(owner)),
            ])
            .or_else([TxnOp::get(key.clone(), None)]);
        let resp = self.client.txn(txn).await?;
        if !resp.succeeded() {
            return Err("the bare key existed".into());
        }
        let rev = resp.header().map_or(0, |h| h.revision());
        if self.guarded_delete {
            let del = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, rev)])
                .and_then([TxnOp::delete(key, None)]);
            self.client.txn(del).await?;
        }
        self.client.lease_revoke(lease).await?;
        Ok(())
    }
}

/// The server-side Lock RPC (`v3lockpb`), with a lease per cycle or one lease for all cycles.
struct Peer {
    client: Client,
    name: String,
    ttl: i64,
    reused_lease: Option<i64>,
}

#[async_trait]
impl Cycle for Peer {
    fn kind(&self) -> Kind {
        Kind::Peer
    }

    fn label(&self) -> String {
        if self.reused_lease.is_some() {
            "etcd-client Lock + Unlock RPC, one reused lease (2 requests)".into()
        } else {
            "etcd-client lease grant + Lock + Unlock RPC + revoke (4 requests)".into()
        }
    }

    async fn run(&mut self) -> Res<()> {
        let lease = match self.reused_lease {
            Some(id) => id,
            None => self.client.lease_grant(self.ttl, None).await?.id(),
        };
        let resp = self
            .client
            .lock(
                self.name.clone(),
                Some(LockOptions::new().with_lease(lease)),
            )
            .await?;
        self.client.unlock(resp.key().to_vec()).await?;
        if self.reused_lease.is_none() {
            self.client.lease_revoke(lease).await?;
        }
        Ok(())
    }
}

struct Get {
    client: Client,
    key: String,
}

#[async_trait]
impl Cycle for Get {
    fn kind(&self) -> Kind {
        Kind::Rtt
    }

    fn label(&self) -> String {
        "linearizable Range (get one key)".into()
    }

    async fn run(&mut self) -> Res<()> {
        self.client.get(self.key.clone(), None).await?;
        Ok(())
    }
}

/// One plain put (a raft write, like every lock step).
struct Put {
    client: Client,
    key: String,
}

#[async_trait]
impl Cycle for Put {
    fn kind(&self) -> Kind {
        Kind::Write
    }

    fn label(&self) -> String {
        "Put (one key)".into()
    }

    async fn run(&mut self) -> Res<()> {
        self.client.put(self.key.clone(), "1", None).await?;
        Ok(())
    }
}

/// The driver's own count of the requests it sent (exactly this client's).
struct DriverCounts {
    lock: Arc<EtcdLock>,
}

#[async_trait]
impl RequestCounter for DriverCounts {
    fn source(&self) -> String {
        "EtcdLock::request_counts (this client only)".into()
    }

    fn exclusive(&self) -> bool {
        true
    }

    fn details(&self) -> Option<String> {
        Some(format!(
            "{} etcd lease(s) in use",
            self.lock.session_count()
        ))
    }

    async fn read(&self) -> Res<Counts> {
        let c = self.lock.request_counts();
        Ok(Counts {
            total: c.total(),
            parts: vec![
                ("lease_grant".into(), c.lease_grant),
                ("lease_keepalive".into(), c.lease_keepalive),
                ("lease_revoke".into(), c.lease_revoke),
                ("txn".into(), c.txn),
                ("range".into(), c.range),
                ("watch".into(), c.watch),
            ],
        })
    }
}

#[async_trait]
impl Backend for Etcd {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn server(&self) -> String {
        self.config.endpoints.join(",")
    }

    async fn client(&self) -> Res<DynLock> {
        Ok(Arc::new(EtcdLock::connect(self.config.clone()).await?))
    }

    async fn cycles(&self, run: &str, ttl: Duration) -> Res<Vec<Box<dyn Cycle>>> {
        let ttl_s = Self::whole_seconds(ttl);
        let client = self.bare_client().await?;
        // The reused lease outlives every cycle of the run; it expires by itself afterwards.
        let reused = client.clone().lease_grant(600, None).await?.id();
        let prefix = format!("{}distlock-bench-{run}", self.config.prefix);
        Ok(vec![
            Box::new(DistlockCycle {
                lock: self.client().await?,
                key: LockKey::new(format!("bench-{run}-cycle"))?,
                ttl,
                label: "EtcdLock try_acquire + release".into(),
            }),
            Box::new(Bare {
                client: client.clone(),
                name: format!("{prefix}-bare/"),
                ttl: ttl_s,
                guarded_delete: true,
            }),
            Box::new(Bare {
                client: client.clone(),
                name: format!("{prefix}-minimal/"),
                ttl: ttl_s,
                guarded_delete: false,
            }),
            Box::new(Peer {
                client: client.clone(),
                name: format!("{prefix}-rpc"),
                ttl: ttl_s,
                reused_lease: None,
            }),
            Box::new(Peer {
                client: client.clone(),
                name: format!("{prefix}-rpc-reused"),
                ttl: ttl_s,
                reused_lease: Some(reused),
            }),
            Box::new(Get {
                client: client.clone(),
                key: format!("{prefix}-rtt"),
            }),
            Box::new(AfterIdle(Box::new(Get {
                client: client.clone(),
                key: format!("{prefix}-rtt"),
            }))),
            Box::new(Put {
                client,
                key: format!("{prefix}-write"),
            }),
        ])
    }

    async fn watchdog_client(&self) -> Res<(DynLock, Box<dyn RequestCounter>)> {
        let lock = Arc::new(EtcdLock::connect(self.config.clone()).await?);
        Ok((lock.clone(), Box::new(DriverCounts { lock })))
    }

    async fn bare_one_key(&self, clients: usize, window: Duration) -> Option<Res<f64>> {
        Some(crate::contention::bare_window(&self.config, clients, 0, window).await)
    }

    fn notes(&self) -> Vec<String> {
        vec!["etcd 3.4's server Lock RPC lacks the post-wait ownership check (etcd#11456); it is measured as the peer, not used by distlock.".into()]
    }
}
