//! Private Redis topologies started on free loopback ports: a Sentinel set (1 master, 2
//! replicas, 3 sentinels), a 3-master + 3-replica Cluster, and three independent masters (for
//! Redlock, or one of them as a plain server). Servers are child processes stopped by pid: by
//! `Drop`, and, for sets never dropped (statics), by a small reaper process that kills the
//! pids it was told about once this process has exited.
//!
//! Shared by lock-redis's tests (`tests/support`) and `distlock-bench --redis-topologies`
//! (included there with `#[path]`), so it depends only on `std` and `rand`. It panics on a
//! failed start (a missing `redis-server`, a cluster that does not form): both callers are
//! harnesses whose run cannot go on without the servers.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

/// One `redis-server` child process (a data node or a sentinel).
pub struct Server {
    pub port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl Server {
    fn spawn(port: u16, dir: &Path, args: Vec<String>) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let mut s = Self {
            port,
            dir: dir.to_owned(),
            args,
            child: None,
        };
        s.start();
        s
    }

    /// Starts (again) with the same arguments and an empty data dir (no persistence).
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "already running");
        let child = Command::new("redis-server")
            .args(&self.args)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (scripts/backends.sh install)");
        reaper().watch(child.id());
        self.child = Some(child);
        wait_for_ping(self.port);
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL, by the pid we started (the test waits for the process to be gone).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// One command through `redis-cli`, its output trimmed.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGKILL ends a stopped process too.
        self.kill();
    }
}

/// `redis-cli -p PORT args…`, trimmed output.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli must be installed");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    matches!(s.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
}

fn wait_for_ping(port: u16) {
    let until = Instant::now() + Duration::from_secs(10);
    while !ping(port) {
        assert!(
            Instant::now() < until,
            "redis-server on {port} did not come up"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls `check` every 20 ms until it holds, for at most `within`.
pub fn wait_until(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let until = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `n` consecutive free loopback ports whose cluster bus ports (+10000) are free too.
fn free_ports(n: u16) -> u16 {
    static NEXT: Mutex<u16> = Mutex::new(0);
    let mut next = NEXT.lock().unwrap();
    if *next == 0 {
        // Spread test binaries (which run one after another) and helpers a little.
        *next = 27100 + (std::process::id() % 50) as u16 * 20;
    }
    loop {
        let base = *next;
        *next = if base > 29000 {
            27100
        } else {
            base + n.max(10)
        };
        let free = (base..base + n).all(|p| {
            TcpListener::bind(("127.0.0.1", p)).is_ok()
                && TcpListener::bind(("127.0.0.1", p + 10000)).is_ok()
        });
        if free {
            return base;
        }
    }
}

fn data_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "lock-redis-{what}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    reaper().remove_later(&dir);
    dir
}

fn node_args(port: u16) -> Vec<String> {
    [
        "--bind",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--save",
        "",
        "--appendonly",
        "no",
        "--repl-diskless-sync",
        "yes",
        "--repl-diskless-sync-delay",
        "0",
        "--dir",
        ".",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// Kills the servers of this test process once it has exited (statics are never dropped), and
/// removes their data directories.
struct Reaper {
    pids: PathBuf,
    dirs: PathBuf,
}

fn reaper() -> &'static Reaper {
    static REAPER: OnceLock<Reaper> = OnceLock::new();
    REAPER.get_or_init(|| {
        let base = std::env::temp_dir().join(format!(
            "lock-redis-reaper-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let (pids, dirs) = (base.with_extension("pids"), base.with_extension("dirs"));
        std::fs::write(&pids, "").unwrap();
        std::fs::write(&dirs, "").unwrap();
        let script = format!(
            "while kill -0 {parent} 2>/dev/null; do sleep 0.5; done; \
             for p in $(cat {pids}); do grep -q redis-server /proc/$p/cmdline 2>/dev/null && kill -9 $p; done; \
             sleep 0.2; for d in $(cat {dirs}); do rm -rf \"$d\"; done; rm -f {pids} {dirs}",
            parent = std::process::id(),
            pids = pids.display(),
            dirs = dirs.display()
        );
        // Never waited for: it outlives this process on purpose (it reaps after our exit).
        #[allow(clippy::zombie_processes)]
        Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Reaper { pids, dirs }
    })
}

impl Reaper {
    fn watch(&self, pid: u32) {
        append_line(&self.pids, &pid.to_string());
    }

    fn remove_later(&self, dir: &Path) {
        append_line(&self.dirs, &dir.display().to_string());
    }
}

fn append_line(file: &Path, line: &str) {
    let mut f = std::fs::OpenOptions::new().append(true).open(file).unwrap();
    writeln!(f, "{line}").unwrap();
}

/// A Sentinel set: one master, two replicas, three sentinels (quorum 2), all on loopback.
pub struct SentinelSet {
    pub name: String,
    pub nodes: Vec<Server>,
    pub sentinels: Vec<Server>,
    dir: PathBuf,
}

impl SentinelSet {
    /// Starts the set and waits until the replicas are in sync and (with `discovered`) every
    /// sentinel knows both replicas and the other two sentinels (needed for a failover).
    pub fn start(discovered: bool) -> Self {
        let base = free_ports(6);
        let dir = data_dir("sentinel");
        let name = "distlock-test".to_owned();
        let mut nodes = Vec::new();
        for i in 0..3u16 {
            let port = base + i;
            let mut args = node_args(port);
            if i > 0 {
                args.extend(["--replicaof".into(), "127.0.0.1".into(), base.to_string()]);
            }
            nodes.push(Server::spawn(port, &dir.join(format!("n{i}")), args));
        }
        let mut sentinels = Vec::new();
        for i in 0..3u16 {
            let port = base + 3 + i;
            let d = dir.join(format!("s{i}"));
            std::fs::create_dir_all(&d).unwrap();
            let conf = d.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {d}\n\
                     sentinel monitor {name} 127.0.0.1 {base} 2\n\
                     sentinel down-after-milliseconds {name} 1000\n\
                     sentinel failover-timeout {name} 3000\n\
                     sentinel parallel-syncs {name} 2\n",
                    d = d.display()
                ),
            )
            .unwrap();
            sentinels.push(Server::spawn(
                port,
                &d,
                vec![conf.display().to_string(), "--sentinel".into()],
            ));
        }
        let set = Self {
            name,
            nodes,
            sentinels,
            dir,
        };
        set.wait_replicas_online(&set.nodes[0], 2);
        if discovered {
            for s in &set.sentinels {
                wait_until(
                    "the sentinels to discover the set",
                    Duration::from_secs(30),
                    || {
                        let info = s.cli(&["SENTINEL", "MASTER", &set.name]);
                        let field = |k: &str| {
                            let lines: Vec<&str> = info.lines().collect();
                            lines
                                .iter()
                                .position(|l| *l == k)
                                .and_then(|i| lines.get(i + 1))
                                .map(|v| v.to_string())
                        };
                        field("num-slaves").as_deref() == Some("2")
                            && field("num-other-sentinels").as_deref() == Some("2")
                    },
                );
            }
        }
        set
    }

    /// `redis+sentinel://s1,s2,s3/NAME?options`.
    pub fn url(&self, options: &str) -> String {
        let hosts: Vec<String> = self.sentinels.iter().map(Server::addr).collect();
        let sep = if options.is_empty() { "" } else { "?" };
        format!(
            "redis+sentinel://{}/{}{sep}{options}",
            hosts.join(","),
            self.name
        )
    }

    /// The port the sentinels name as the master now (any sentinel that answers).
    pub fn master_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|s| {
            let out = s.cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", &self.name]);
            out.lines().nth(1)?.trim().parse().ok()
        })
    }

    pub fn node(&mut self, port: u16) -> &mut Server {
        self.nodes.iter_mut().find(|n| n.port == port).unwrap()
    }

    /// Waits until `master` has `n` replicas online.
    pub fn wait_replicas_online(&self, master: &Server, n: usize) {
        wait_until("the replicas to sync", Duration::from_secs(20), || {
            master
                .cli(&["INFO", "replication"])
                .lines()
                .filter(|l| l.starts_with("slave") && l.contains("state=online"))
                .count()
                >= n
        });
    }

    /// Waits until every sentinel names a master other than `old` and that node says it is one.
    pub fn wait_failover_from(&self, old: u16, within: Duration) -> u16 {
        let mut new = 0;
        wait_until("the failover", within, || {
            let named: Vec<Option<u16>> = self
                .sentinels
                .iter()
                .map(|s| {
                    s.cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", &self.name])
                        .lines()
                        .nth(1)?
                        .trim()
                        .parse()
                        .ok()
                })
                .collect();
            match named.first().copied().flatten() {
                Some(p)
                    if p != old
                        && named.iter().all(|n| *n == Some(p))
                        && cli(p, &["ROLE"]).starts_with("master") =>
                {
                    new = p;
                    true
                }
                _ => false,
            }
        });
        new
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        self.sentinels.clear();
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of 3 masters and 3 replicas.
pub struct Cluster {
    pub nodes: Vec<Server>,
    dir: PathBuf,
}

impl Cluster {
    pub fn start() -> Self {
        let base = free_ports(6);
        let dir = data_dir("cluster");
        let mut nodes = Vec::new();
        for i in 0..6u16 {
            let port = base + i;
            let mut args = node_args(port);
            args.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                ]
                .map(str::to_owned),
            );
            nodes.push(Server::spawn(port, &dir.join(format!("c{i}")), args));
        }
        let addrs: Vec<String> = nodes.iter().map(Server::addr).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes, dir };
        for n in &cluster.nodes {
            wait_until("the cluster to be ok", Duration::from_secs(30), || {
                n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
            });
        }
        // Every replica in sync with its master.
        wait_until(
            "the cluster replicas to sync",
            Duration::from_secs(30),
            || {
                cluster
                    .nodes
                    .iter()
                    .filter(|n| n.cli(&["ROLE"]).starts_with("slave"))
                    .all(|n| {
                        n.cli(&["INFO", "replication"])
                            .contains("master_link_status:up")
                    })
            },
        );
        cluster
    }

    /// `redis+cluster://n1,n2,n3?options` (the first three nodes as seeds).
    pub fn url(&self, options: &str) -> String {
        let hosts: Vec<String> = self.nodes.iter().take(3).map(Server::addr).collect();
        let sep = if options.is_empty() { "" } else { "?" };
        format!("redis+cluster://{}{sep}{options}", hosts.join(","))
    }

    /// The port of the master serving `key`'s slot now, as a running node sees it (`None`
    /// while the slot's master has failed and no replica has taken over yet).
    pub fn master_of(&self, key: &[u8]) -> Option<u16> {
        let key = String::from_utf8_lossy(key).into_owned();
        let slot = self
            .nodes
            .iter()
            .filter(|n| n.is_running())
            .map(|n| n.cli(&["CLUSTER", "KEYSLOT", &key]))
            .find(|s| !s.is_empty())?;
        let slot: u16 = slot.parse().ok()?;
        for n in self.nodes.iter().filter(|n| n.is_running()) {
            let nodes = n.cli(&["CLUSTER", "NODES"]);
            for line in nodes.lines() {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
                    continue;
                }
                let port: u16 = f[1]
                    .split('@')
                    .next()
                    .and_then(|a| a.rsplit(':').next())
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(0);
                for range in &f[8..] {
                    let (lo, hi) = match range.split_once('-') {
                        Some((a, b)) => (a.parse().unwrap_or(1), b.parse().unwrap_or(0)),
                        None => (range.parse().unwrap_or(1), range.parse().unwrap_or(0)),
                    };
                    if (lo..=hi).contains(&slot) {
                        return Some(port);
                    }
                }
            }
        }
        None
    }

    pub fn node(&mut self, port: u16) -> &mut Server {
        self.nodes.iter_mut().find(|n| n.port == port).unwrap()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three independent masters (for Redlock).
pub struct Masters {
    pub nodes: Vec<Server>,
    dir: PathBuf,
}

impl Masters {
    pub fn start() -> Self {
        let base = free_ports(3);
        let dir = data_dir("masters");
        let nodes = (0..3u16)
            .map(|i| Server::spawn(base + i, &dir.join(format!("m{i}")), node_args(base + i)))
            .collect();
        Self { nodes, dir }
    }

    /// `redlock://m1,m2,m3?options`.
    pub fn url(&self, options: &str) -> String {
        let hosts: Vec<String> = self.nodes.iter().map(Server::addr).collect();
        let sep = if options.is_empty() { "" } else { "?" };
        format!("redlock://{}{sep}{options}", hosts.join(","))
    }
}

impl Drop for Masters {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
