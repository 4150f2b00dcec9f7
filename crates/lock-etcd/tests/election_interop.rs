//! Our election and Go's `concurrency.Election` (`etcdctl elect`, v3.4) in one election, both
//! orders, on a real etcd (`DISTLOCK_TEST_ETCD_URL`): the election `NAME` of a client with the
//! prefix `distlock/` is `etcdctl elect distlock/election/NAME`. Also `Leadership::proclaim`
//! (the value `etcdctl elect -l` prints) and a pushed `Election::observe`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use std::{process::Stdio, sync::Arc, time::Duration};

use futures::StreamExt;
use lock_core::{DistributedLock, Election, Error, FencingToken};
use lock_etcd::{EtcdLock, EtcdLockConfig};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use tokio::{
    io::{AsyncBufReadExt, BufReader, Lines},
    process::{Child, ChildStdout, Command},
    time::{Instant, sleep, timeout},
};

const LONG: Duration = Duration::from_secs(30);
const SLACK: Duration = Duration::from_secs(5);

struct Env {
    url: String,
    endpoint: String,
    admin: etcd_client::Client,
}

async fn env() -> Option<Env> {
    let url = conformance::backend_url("DISTLOCK_TEST_ETCD_URL")?;
    if !etcdctl_installed() {
        assert!(
            !conformance::backends_required(),
            "etcdctl is not installed but DISTLOCK_REQUIRE_BACKENDS=1"
        );
        eprintln!("skipping: etcdctl is not installed");
        return None;
    }
    let cfg = EtcdLockConfig::from_url(&url).unwrap();
    let endpoint = cfg.endpoints[0].clone();
    let admin = etcd_client::Client::connect([format!("http://{endpoint}")], None)
        .await
        .unwrap();
    Some(Env {
        url,
        endpoint,
        admin,
    })
}

impl Env {
    /// A client of its own with the default prefix and `label`.
    async fn client(&self, label: &str) -> Arc<EtcdLock> {
        let mut cfg = EtcdLockConfig::from_url(&self.url).unwrap();
        assert_eq!(cfg.prefix, "distlock/");
        cfg.label = Some(label.to_owned());
        Arc::new(EtcdLock::connect(cfg).await.unwrap())
    }

    /// An election on a client of its own with the default prefix and `label`.
    async fn election(&self, name: &str, label: &str) -> Election {
        Election::new(self.client(label).await, name).unwrap()
    }

    /// `etcdctl elect <args>`, its stdout as lines.
    fn etcdctl_elect(&self, args: &[&str]) -> (Child, Lines<BufReader<ChildStdout>>) {
        let mut child = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints=http://{}", self.endpoint))
            .arg("elect")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        (child, lines)
    }

    /// The create revision and lease of the etcd key `key`.
    async fn rev_and_lease(&self, key: &str) -> (i64, i64) {
        let resp = self.admin.kv_client().get(key, None).await.unwrap();
        let kv = resp.kvs().first().expect("the key exists");
        (kv.create_revision(), kv.lease())
    }
}

fn etcdctl_installed() -> bool {
    std::process::Command::new("etcdctl")
        .arg("version")
        .env("ETCDCTL_API", "3")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn fresh(label: &str) -> String {
    format!("{label}-{:016x}", rand::random::<u64>())
}

/// The next two lines etcdctl prints (simple format): a leader's key and its value.
async fn next_leader(out: &mut Lines<BufReader<ChildStdout>>) -> (String, String) {
    let key = next_line(out).await;
    let value = next_line(out).await;
    (key, value)
}

async fn next_line(out: &mut Lines<BufReader<ChildStdout>>) -> String {
    timeout(SLACK, out.next_line())
        .await
        .expect("etcdctl prints the leader")
        .unwrap()
        .expect("etcdctl is still running")
}

fn signal(child: &Child, sig: Signal) {
    let pid = Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap());
    kill(pid, sig).unwrap();
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// `etcdctl elect` leads: our `leader()` reports its proclaimed value and its key's create
/// revision as the term; we do not lead while it does — not even after its process died, while
/// its lease lives — and our waiting campaign is granted once that lease is revoked.
#[test]
fn etcdctl_elect_leads_and_we_follow() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let name = fresh("ctl-first");
        let ours = env.election(&name, "ours").await;
        let proposal = fresh("go-leader");
        let (mut child, mut out) =
            env.etcdctl_elect(&[&format!("distlock/election/{name}"), &proposal]);
        let (key, value) = next_leader(&mut out).await;
        assert!(
            key.starts_with(&format!("distlock/election/{name}/")),
            "{key}"
        );
        assert_eq!(value, proposal);
        let (rev, lease) = env.rev_and_lease(&key).await;

        let leader = ours.leader().await.unwrap().expect("etcdctl leads");
        assert_eq!(leader.holder.unwrap().as_str(), proposal);
        assert_eq!(leader.term, Some(FencingToken(u64::try_from(rev).unwrap())));
        assert!(ours.try_campaign().await.unwrap().is_none());

        let waiting = {
            let ours = ours.clone();
            tokio::spawn(async move { ours.campaign(LONG).await })
        };
        sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "elected while etcdctl leads");
        // A crash: its key stays as long as its session's lease (60 s in etcdctl).
        signal(&child, Signal::SIGKILL);
        let _ = child.wait().await;
        sleep(Duration::from_millis(300)).await;
        assert!(
            !waiting.is_finished(),
            "elected while the dead etcdctl's lease lives"
        );
        env.admin.lease_client().revoke(lease).await.unwrap();
        let lead = timeout(SLACK, waiting)
            .await
            .expect("elected promptly once the lease is revoked")
            .unwrap()
            .unwrap();
        assert!(lead.term() > FencingToken(u64::try_from(rev).unwrap()));
        let leader = ours.leader().await.unwrap().expect("we lead");
        assert_eq!(leader.term, Some(lead.term()));
        assert!(leader.holder.unwrap().as_str().ends_with(" label=ours"));
        assert!(lead.resign().await.unwrap());
    });
}

/// We lead: `etcdctl elect -l` prints our leader's key and value, and then the next leader;
/// `etcdctl elect NAME V` waits behind us and is elected promptly when we resign; we then see it
/// as the leader, and lead again once it resigns (SIGTERM).
#[test]
fn we_lead_and_etcdctl_elect_follows() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let name = fresh("ours-first");
        let path = format!("distlock/election/{name}");
        let ours = env.election(&name, "ours").await;
        let lead = ours.campaign(SLACK).await.unwrap();
        let our_key = EtcdLock::entry_key(lead.granted_lease()).unwrap();
        let our_key = String::from_utf8(our_key).unwrap();

        let (_listener, mut observed) = env.etcdctl_elect(&["-l", &path]);
        let (key, value) = next_leader(&mut observed).await;
        assert_eq!(key, our_key);
        // Our entry's value: `<token hex> <identity>` (never printed here: it holds the token).
        assert!(value.ends_with(" label=ours"), "not our identity");

        let proposal = fresh("go-follower");
        let (mut child, mut out) = env.etcdctl_elect(&[&path, &proposal]);
        assert!(
            timeout(Duration::from_millis(1000), out.next_line())
                .await
                .is_err(),
            "etcdctl elected while we lead"
        );
        assert!(!lead.is_lost());
        assert_eq!(
            ours.leader().await.unwrap().unwrap().term,
            Some(lead.term())
        );

        let old_term = lead.term();
        assert!(lead.resign().await.unwrap());
        let (key, value) = next_leader(&mut out).await;
        assert!(key.starts_with(&format!("{path}/")), "{key}");
        assert_eq!(value, proposal);
        assert_eq!(
            next_leader(&mut observed).await,
            (key.clone(), proposal.clone())
        );

        let (rev, _) = env.rev_and_lease(&key).await;
        let leader = ours.leader().await.unwrap().expect("etcdctl leads");
        assert_eq!(leader.holder.unwrap().as_str(), proposal);
        assert_eq!(leader.term, Some(FencingToken(u64::try_from(rev).unwrap())));
        assert!(leader.term > Some(old_term));
        assert!(ours.try_campaign().await.unwrap().is_none());

        // SIGTERM: etcdctl resigns (deletes its key) before it exits.
        signal(&child, Signal::SIGTERM);
        let again = ours
            .campaign(SLACK)
            .await
            .expect("elected once etcdctl resigned");
        assert!(again.term() > leader.term.unwrap());
        assert!(child.wait().await.unwrap().success());
        assert!(again.resign().await.unwrap());
    });
}

/// The leader proclaims: `leader()` and `etcdctl elect -l` show the new value with the same
/// term; a deposed leader's proclaim (its entry deleted, its session lease alive) is refused by
/// the compare and leaves no entry behind.
#[test]
fn proclaim_changes_the_value_etcdctl_sees_and_a_deposed_leader_changes_nothing() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let (a, b) = (env.client("a").await, env.client("b").await);
        let name = fresh("proclaim");
        let ea = Election::new(a.clone(), &name).unwrap();
        let eb = Election::new(b.clone(), &name).unwrap();
        let lead = ea.campaign(SLACK).await.unwrap();
        let (_listener, mut out) = env.etcdctl_elect(&["-l", &format!("distlock/election/{name}")]);
        let (_, value) = next_leader(&mut out).await;
        assert!(value.ends_with(" label=a"), "not a's identity: {value}");

        let shown = lead.proclaim("scheduler-2").await.unwrap();
        assert!(shown.as_str().ends_with(" label=scheduler-2"), "{shown}");
        let leader = eb.leader().await.unwrap().expect("a leads");
        assert_eq!(leader.term, Some(lead.term()));
        assert_eq!(leader.holder.as_ref(), Some(&shown));
        let (_, value) = next_leader(&mut out).await;
        assert!(
            value.ends_with(shown.as_str()),
            "etcdctl shows the old value: {value}"
        );

        // Still the same grant, and not taken for lost: it renews.
        let mut lease = lead.granted_lease().clone();
        let ttl = lease.ttl();
        a.renew(&mut lease, ttl).await.unwrap();
        assert!(!lead.is_lost(), "a proclaim made the leadership lost");

        // Deposed: its entry deleted by an operator while its session lease lives on; b leads.
        assert!(b.force_release(ea.key()).await.unwrap());
        let next = eb.campaign(SLACK).await.unwrap();
        let before = eb.leader().await.unwrap().map(|l| (l.term, l.holder));
        // The driver's compare, whatever the leadership noticed locally.
        let refused = lock_core::raw::relabel(a.as_ref(), lead.granted_lease(), "late").await;
        assert!(matches!(refused, Err(Error::NotHeld { .. })), "{refused:?}");
        let after = eb.leader().await.unwrap().map(|l| (l.term, l.holder));
        assert_eq!(
            after, before,
            "a deposed leader's proclaim changed the leader"
        );
        assert!(next.resign().await.unwrap());
        // No entry of a's came back to lead next.
        assert_eq!(eb.leader().await.unwrap(), None);
    });
}

/// With a 30 s poll interval, a grant, a proclaim and a resign are each observed within a
/// few seconds: etcd pushes them (a watch on the election's range).
#[test]
fn observe_is_pushed_by_a_watch() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let name = fresh("observe");
        let observed = env.election(&name, "watcher").await;
        let ours = env.election(&name, "leader").await;
        let mut changes = Box::pin(observed.observe(Duration::from_secs(30)));
        let mut next = async || {
            let started = Instant::now();
            let item = timeout(SLACK, changes.next())
                .await
                .expect("observed before the 30 s poll: pushed")
                .expect("the stream goes on")
                .unwrap();
            (item, started.elapsed())
        };
        assert_eq!(next().await.0, None);
        let lead = ours.campaign(SLACK).await.unwrap();
        let (seen, _) = next().await;
        assert_eq!(seen.and_then(|l| l.term), Some(lead.term()));
        lead.proclaim("v2").await.unwrap();
        let (seen, _) = next().await;
        let seen = seen.expect("a leader");
        assert_eq!(seen.term, Some(lead.term()));
        assert!(seen.holder.unwrap().as_str().ends_with(" label=v2"));
        assert!(lead.resign().await.unwrap());
        assert_eq!(next().await.0, None);
    });
}
