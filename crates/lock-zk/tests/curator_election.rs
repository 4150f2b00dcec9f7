//! Our election and Apache Curator's `LeaderSelector` (Debian's `libcurator-recipes-java`) in one
//! election, both orders, on the local server (`DISTLOCK_TEST_ZK_URL`): the election `NAME` of a
//! client with the root `R` is `new LeaderSelector(client, "R/election/NAME", listener)`.
//!
//! The Curator side is `tests/curator/CuratorElection.java`, compiled with `javac` into a
//! temporary directory and run once (one JVM for both orders), driven line by line.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    sync::Arc,
    time::Duration,
};

use lock_core::{Election, FencingToken};
use lock_zk::{ZkLock, ZkLockConfig};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines},
    process::{Child, ChildStdin, ChildStdout, Command},
    time::{sleep, timeout},
};
use zookeeper_client as zk;

const ROOT: &str = "/distlock-test";
const SLACK: Duration = Duration::from_secs(5);
/// A JVM's start and its first session on a loaded 2-core machine.
const JVM_START: Duration = Duration::from_secs(30);
const JARS: &str = "/usr/share/java";
/// What `LeaderSelector` needs at run time (slf4j-nop keeps slf4j quiet).
const CLASSPATH: [&str; 8] = [
    "curator-recipes.jar",
    "curator-framework.jar",
    "curator-client.jar",
    "zookeeper.jar",
    "zookeeper-jute.jar",
    "guava.jar",
    "slf4j-api.jar",
    "slf4j-nop.jar",
];

/// `None` (a skip) when the server is not configured or Java/Curator are missing, unless
/// `DISTLOCK_REQUIRE_BACKENDS=1`: then either is a failure.
fn classpath() -> Option<String> {
    let javac = std::process::Command::new("javac")
        .arg("-version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let missing: Vec<_> = CLASSPATH
        .iter()
        .filter(|jar| !Path::new(JARS).join(jar).is_file())
        .collect();
    if !javac || !missing.is_empty() {
        let what = format!(
            "javac present: {javac}; jars missing from {JARS}: {missing:?} (apt-get install \
             openjdk-17-jdk-headless libcurator-recipes-java)"
        );
        assert!(
            !conformance::backends_required(),
            "{what}, but DISTLOCK_REQUIRE_BACKENDS=1"
        );
        eprintln!("skipping: {what}");
        return None;
    }
    let jars: Vec<_> = CLASSPATH.iter().map(|j| format!("{JARS}/{j}")).collect();
    Some(jars.join(":"))
}

/// The Curator client, one JVM, and what it prints.
struct Curator {
    child: Child,
    stdin: ChildStdin,
    out: Lines<BufReader<ChildStdout>>,
    dir: PathBuf,
}

impl Curator {
    async fn start(hosts: &str, classpath: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("distlock-curator-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let source =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/curator/CuratorElection.java");
        // C1 only: these JVMs live seconds, and start faster without the optimising compiler.
        let javac = Command::new("javac")
            .arg("-J-XX:TieredStopAtLevel=1")
            .arg("-d")
            .arg(&dir)
            .args(["-cp", classpath])
            .arg(&source)
            .output()
            .await
            .unwrap();
        assert!(
            javac.status.success(),
            "javac failed: {}",
            String::from_utf8_lossy(&javac.stderr)
        );
        let stderr = std::fs::File::create(dir.join("stderr.txt")).unwrap();
        let mut child = Command::new("java")
            .arg("-XX:TieredStopAtLevel=1")
            .arg("-cp")
            .arg(format!("{}:{classpath}", dir.display()))
            .arg("CuratorElection")
            .arg(hosts)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut curator = Self {
            child,
            stdin,
            out,
            dir,
        };
        curator.expect("ready", JVM_START).await;
        curator
    }

    async fn send(&mut self, command: &str) {
        self.stdin
            .write_all(format!("{command}\n").as_bytes())
            .await
            .unwrap();
        self.stdin.flush().await.unwrap();
    }

    /// The next line, which must be `want`.
    async fn expect(&mut self, want: &str, within: Duration) {
        let line = self.next_line(within).await;
        assert_eq!(line.as_deref(), Some(want), "{}", self.stderr());
    }

    async fn next_line(&mut self, within: Duration) -> Option<String> {
        match timeout(within, self.out.next_line()).await {
            Ok(line) => line.unwrap(),
            Err(_) => panic!("Curator printed nothing in {within:?}; {}", self.stderr()),
        }
    }

    /// `LeaderSelector.getLeader()` on `path`: whether there is a leader, and its id.
    async fn leader(&mut self, path: &str) -> (bool, String) {
        self.send(&format!("leader {path}")).await;
        let line = self.next_line(SLACK).await.unwrap_or_default();
        let rest = line
            .strip_prefix(&format!("leader {path} "))
            .unwrap_or_else(|| panic!("{line:?}; {}", self.stderr()));
        let (is_leader, id) = rest.split_once(' ').unwrap();
        (is_leader == "true", id.to_owned())
    }

    fn stderr(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("stderr.txt")).unwrap_or_default();
        let tail: Vec<_> = text.lines().rev().take(20).collect();
        format!(
            "Curator's stderr ends: {:?}",
            tail.into_iter().rev().collect::<Vec<_>>()
        )
    }

    async fn quit(mut self) {
        self.send("quit").await;
        let exited = timeout(SLACK, self.child.wait()).await;
        let _ = std::fs::remove_dir_all(&self.dir);
        assert!(
            exited.is_ok_and(|s| s.is_ok_and(|s| s.success())),
            "Curator did not quit"
        );
    }
}

/// The fencing token of the first contender under `dir` (its czxid), read directly.
async fn first_czxid(raw: &zk::Client, dir: &str) -> FencingToken {
    let mut nodes = raw.list_children(dir).await.unwrap();
    nodes.sort_by(|a, b| a[a.len() - 10..].cmp(&b[b.len() - 10..]));
    let (_, stat) = raw.get_data(&format!("{dir}/{}", nodes[0])).await.unwrap();
    FencingToken(u64::try_from(stat.czxid).unwrap())
}

fn fresh(label: &str) -> String {
    format!("{label}-{:016x}", rand::random::<u64>())
}

/// Both orders on one JVM. Curator leads: our `leader()` reports its participant id and its
/// node's czxid as the term, we do not lead, and our waiting campaign is elected once Curator
/// resigns. We lead: `getLeader()` reports our value, Curator's campaign waits behind us and
/// is elected promptly once we resign; we then see it lead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_leader_selector_and_our_election_take_turns() {
    let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
        return;
    };
    let Some(classpath) = classpath() else { return };
    let mut config = ZkLockConfig::from_url(&url).unwrap();
    config.root = ROOT.into();
    config.label = Some("ours".into());
    let hosts = config.hosts.clone();
    let raw = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(5))
        .connect(&hosts)
        .await
        .unwrap();
    let lock = Arc::new(ZkLock::connect(config).await.unwrap());
    let mut curator = Curator::start(&hosts, &classpath).await;

    // Curator first.
    let name = fresh("curator-first");
    let path = format!("{ROOT}/election/{name}");
    let ours = Election::new(lock.clone(), &name).unwrap();
    let id = fresh("curator-a");
    curator.send(&format!("campaign {path} {id}")).await;
    curator.expect(&format!("elected {path}"), SLACK).await;
    let leader = ours.leader().await.unwrap().expect("Curator leads");
    assert_eq!(
        (leader.value.as_deref(), leader.holder),
        (Some(id.as_str()), None)
    );
    let curator_term = first_czxid(&raw, &path).await;
    assert_eq!(leader.term, Some(curator_term));
    assert!(ours.try_campaign().await.unwrap().is_none());
    let waiting = {
        let ours = ours.clone();
        tokio::spawn(async move { ours.campaign(SLACK * 2).await })
    };
    sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "elected while Curator leads");
    curator.send(&format!("resign {path}")).await;
    let lead = timeout(SLACK, waiting)
        .await
        .expect("elected promptly once Curator resigned")
        .unwrap()
        .unwrap();
    curator.expect(&format!("resigned {path}"), SLACK).await;
    assert!(lead.term() > curator_term);
    let (is_leader, who) = curator.leader(&path).await;
    assert!(is_leader && who == "ours", "{who}");
    assert!(lead.resign().await.unwrap());
    assert_eq!(curator.leader(&path).await, (false, String::new()));

    // Ours first.
    let name = fresh("ours-first");
    let path = format!("{ROOT}/election/{name}");
    let ours = Election::new(lock.clone(), &name).unwrap();
    let lead = ours.campaign(SLACK).await.unwrap();
    let (is_leader, who) = curator.leader(&path).await;
    assert!(is_leader && who == "ours", "{who}");
    let id = fresh("curator-b");
    curator.send(&format!("campaign {path} {id}")).await;
    assert!(
        timeout(Duration::from_millis(1000), curator.out.next_line())
            .await
            .is_err(),
        "Curator elected while we lead"
    );
    assert_eq!(
        ours.leader().await.unwrap().unwrap().term,
        Some(lead.term())
    );
    let our_term = lead.term();
    assert!(lead.resign().await.unwrap());
    curator.expect(&format!("elected {path}"), SLACK).await;
    let leader = ours.leader().await.unwrap().expect("Curator leads");
    assert_eq!(
        (leader.value.as_deref(), leader.holder),
        (Some(id.as_str()), None)
    );
    assert!(leader.term > Some(our_term));
    assert!(ours.try_campaign().await.unwrap().is_none());
    curator.send(&format!("resign {path}")).await;
    curator.expect(&format!("resigned {path}"), SLACK).await;
    let again = ours
        .campaign(SLACK)
        .await
        .expect("elected once Curator resigned");
    assert!(again.term() > leader.term.unwrap());
    assert!(again.resign().await.unwrap());

    curator.quit().await;
}

/// Issue 44, item 11: while our candidate leads, Curator's observer (`getLeader()`, the
/// participant id: the node's data) reads exactly its value — the label it campaigned with,
/// then what it proclaimed, with the same czxid — never its identity; our `leader()` reads
/// exactly a Curator participant's id as the value, with no identity, and ours beside ours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_reads_exactly_our_value_and_we_read_exactly_its_id() {
    let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
        return;
    };
    let Some(classpath) = classpath() else { return };
    let value = format!("10.0.0.7:8080/{}", fresh("api"));
    let mut config = ZkLockConfig::from_url(&url).unwrap();
    config.root = ROOT.into();
    config.label = Some(value.clone());
    let hosts = config.hosts.clone();
    let raw = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(5))
        .connect(&hosts)
        .await
        .unwrap();
    let lock = Arc::new(ZkLock::connect(config).await.unwrap());
    let mut curator = Curator::start(&hosts, &classpath).await;

    let name = fresh("value");
    let path = format!("{ROOT}/election/{name}");
    let ours = Election::new(lock.clone(), &name).unwrap();
    let lead = ours.campaign(SLACK).await.unwrap();
    assert_eq!(curator.leader(&path).await, (true, value.clone()));
    let leader = ours.leader().await.unwrap().expect("we lead");
    assert_eq!(leader.value.as_deref(), Some(value.as_str()));
    let who = leader.holder.expect("our identity beside the value");
    assert!(
        who.as_str()
            .contains(&format!(" pid={} ", std::process::id()))
            && who.as_str().ends_with(&format!(" label={value}")),
        "{who}"
    );
    let proclaimed = format!("10.0.0.8:8080/{}", fresh("api"));
    lead.proclaim(&proclaimed).await.unwrap();
    assert_eq!(curator.leader(&path).await, (true, proclaimed.clone()));
    assert_eq!(
        first_czxid(&raw, &path).await,
        lead.term(),
        "a proclaim changed the term"
    );
    let leader = ours.leader().await.unwrap().expect("we lead");
    assert_eq!(leader.value.as_deref(), Some(proclaimed.as_str()));
    assert_eq!(leader.term, Some(lead.term()));
    assert!(
        leader
            .holder
            .is_some_and(|w| w.as_str().ends_with(&format!(" label={proclaimed}")))
    );
    assert!(lead.resign().await.unwrap());

    let id = format!("http://10.0.0.9:80/{}", fresh("java"));
    curator.send(&format!("campaign {path} {id}")).await;
    curator.expect(&format!("elected {path}"), SLACK).await;
    let leader = ours.leader().await.unwrap().expect("Curator leads");
    assert_eq!(leader.value.as_deref(), Some(id.as_str()));
    assert_eq!(
        leader.holder, None,
        "a Curator leader records no identity of ours"
    );
    assert_eq!(leader.term, Some(first_czxid(&raw, &path).await));
    curator.send(&format!("resign {path}")).await;
    curator.expect(&format!("resigned {path}"), SLACK).await;
    curator.quit().await;
}
