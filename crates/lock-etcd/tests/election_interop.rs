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
        assert_eq!(leader.value.as_deref(), Some(proposal.as_str()));
        assert_eq!(leader.holder, None);
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
        // Our entry's value: our value alone.
        assert_eq!(value, "ours");

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
        assert_eq!(leader.value.as_deref(), Some(proposal.as_str()));
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
        assert_eq!(value, "a", "not a's value");

        let shown = lead.proclaim("scheduler-2").await.unwrap();
        assert!(shown.as_str().ends_with(" label=scheduler-2"), "{shown}");
        let leader = eb.leader().await.unwrap().expect("a leads");
        assert_eq!(leader.term, Some(lead.term()));
        assert_eq!(leader.holder.as_ref(), Some(&shown));
        let (_, value) = next_leader(&mut out).await;
        assert_eq!(value, "scheduler-2", "etcdctl shows the old value");

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
        let next_key =
            String::from_utf8(EtcdLock::entry_key(next.granted_lease()).unwrap()).unwrap();
        assert_eq!(next_leader(&mut out).await, (next_key, "b".to_owned()));
        assert!(next.resign().await.unwrap());
        // No entry of a's came back to lead next, and no sidecar of a's or b's is left.
        assert_eq!(eb.leader().await.unwrap(), None);
        let sidecars = env
            .admin
            .kv_client()
            .get(
                format!("distlock/\0holder/election/{name}/"),
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_count_only(),
                ),
            )
            .await
            .unwrap();
        assert_eq!(sidecars.count(), 0, "a sidecar outlived its entry");
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
        assert_eq!(seen.value.as_deref(), Some("v2"));
        assert!(seen.holder.unwrap().as_str().ends_with(" label=v2"));
        assert!(lead.resign().await.unwrap());
        assert_eq!(next().await.0, None);
    });
}

/// `etcdctl get <key> --print-value-only`: the value of the etcd key `key`.
async fn etcdctl_get(endpoint: &str, key: &str) -> String {
    let out = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints=http://{endpoint}"))
        .args(["get", key, "--print-value-only"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "etcdctl get {key}: {out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .trim_end_matches('\n')
        .to_owned()
}

/// Issue 44, item 11: while our candidate leads, a Go observer (`etcdctl elect -l`, which is
/// `Election.Observe`) and `etcdctl get` read exactly its value — the label it campaigned with,
/// then what it proclaimed, with the same create revision — and never its token or identity;
/// our `leader()` reads exactly the value `etcdctl elect NAME V` proclaims, and no identity.
#[test]
fn peers_read_exactly_our_value_and_we_read_exactly_theirs() {
    rt().block_on(async {
        let Some(env) = env().await else { return };
        let name = fresh("value");
        let path = format!("distlock/election/{name}");
        let value = format!("10.0.0.7:8080/{}", fresh("api"));
        let ours = env.election(&name, &value).await;
        let lead = ours.campaign(SLACK).await.unwrap();
        let token = lead.granted_lease().token().expose_hex();
        let our_key =
            String::from_utf8(EtcdLock::entry_key(lead.granted_lease()).unwrap()).unwrap();
        let (rev, _) = env.rev_and_lease(&our_key).await;

        let (_listener, mut observed) = env.etcdctl_elect(&["-l", &path]);
        assert_eq!(
            next_leader(&mut observed).await,
            (our_key.clone(), value.clone())
        );
        assert_eq!(etcdctl_get(&env.endpoint, &our_key).await, value);
        let leader = ours.leader().await.unwrap().expect("we lead");
        assert_eq!(leader.value.as_deref(), Some(value.as_str()));
        let who = leader.holder.expect("our identity, read beside the value");
        assert!(
            who.as_str()
                .contains(&format!(" pid={} ", std::process::id())),
            "{who}"
        );
        assert!(!who.as_str().contains(&token));

        let proclaimed = format!("10.0.0.8:8080/{}", fresh("api"));
        lead.proclaim(&proclaimed).await.unwrap();
        assert_eq!(
            next_leader(&mut observed).await,
            (our_key.clone(), proclaimed.clone())
        );
        assert_eq!(etcdctl_get(&env.endpoint, &our_key).await, proclaimed);
        assert_eq!(
            env.rev_and_lease(&our_key).await.0,
            rev,
            "a proclaim changed the term"
        );
        let leader = ours.leader().await.unwrap().expect("we lead");
        assert_eq!(leader.value.as_deref(), Some(proclaimed.as_str()));
        assert_eq!(leader.term, Some(lead.term()));
        assert!(
            leader
                .holder
                .unwrap()
                .as_str()
                .ends_with(&format!(" label={proclaimed}"))
        );
        assert!(lead.resign().await.unwrap());

        let theirs = format!("http://10.0.0.9:80/{}", fresh("go"));
        let (mut child, mut out) = env.etcdctl_elect(&[&path, &theirs]);
        let (key, shown) = next_leader(&mut out).await;
        assert_eq!(shown, theirs);
        let leader = ours.leader().await.unwrap().expect("etcdctl leads");
        assert_eq!(leader.value.as_deref(), Some(theirs.as_str()));
        assert_eq!(
            leader.holder, None,
            "a Go leader records no identity of ours"
        );
        let (rev, _) = env.rev_and_lease(&key).await;
        assert_eq!(leader.term, Some(FencingToken(u64::try_from(rev).unwrap())));
        signal(&child, Signal::SIGTERM);
        assert!(child.wait().await.unwrap().success());
    });
}
