//! Private Redis topologies on loopback, every process a [`PrivateServer`] (started, restarted
//! and killed on drop by `scripts/backends.sh`; a test's kill, pause and resume are signals to
//! the pid `backends.sh` recorded, sent at once): a Sentinel set (1 master, 2 replicas, 3
//! sentinels), a 3-master + 3-replica Cluster, and three independent masters (for Redlock, or
//! one of them as a plain server).
//!
//! Shared by lock-redis's tests and `distlock-bench --redis-topologies`. The nodes of a
//! topology are started together (one thread each) and are `backends.sh` instances like any
//! other: a replica is a `redis` instance with `--replicaof`, a Cluster node one with
//! `--cluster-enabled yes`, a sentinel a `sentinel` instance (whose config file `backends.sh`
//! writes). Forming the Cluster (`redis-cli --cluster create`) is done here once the six nodes
//! answer: it is a one-time act on running servers, like the failovers the tests trigger, not a
//! process to start or fault. Everything is killed when the topology is dropped, or by the
//! reaper (see [`super`]) once the process has exited (the `static` sets shared by a test binary
//! are never dropped).
//!
//! The constructors panic on a failed start (a missing `redis-server`, a cluster that does not
//! form): their callers are harnesses whose run cannot go on without the servers.

use std::{
    net::TcpListener,
    process::Command,
    sync::Mutex,
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use super::{PrivateServer, ServerKind};

/// One Redis process of a topology (a data node or a sentinel): a [`PrivateServer`] that
/// remembers whether the test has killed it, and is killed (SIGKILL ends a paused process too)
/// when dropped.
#[derive(Debug)]
pub struct Server {
    /// Its port on 127.0.0.1.
    pub port: u16,
    server: PrivateServer,
    running: bool,
}

impl Server {
    fn new(mut server: PrivateServer) -> Self {
        server.on_drop = Some("kill");
        Self {
            port: server.port,
            server,
            running: true,
        }
    }

    /// A `redis-server` with extra flags (`--replicaof ...`, `--cluster-enabled yes ...`).
    fn redis(port: u16, args: &[&str]) -> Self {
        Self::new(PrivateServer::start_blocking_with(
            ServerKind::Redis,
            port,
            args,
        ))
    }

    /// A sentinel monitoring `name` on `master_port`.
    fn sentinel(port: u16, name: &str, master_port: u16, quorum: u32, args: &[&str]) -> Self {
        Self::new(PrivateServer::start_sentinel_blocking(
            port,
            name,
            master_port,
            quorum,
            args,
        ))
    }

    /// Starts (again) with the same flags and its own directory (no persistence: an empty
    /// data set; a Cluster node keeps its `nodes.conf`, a sentinel its config), and waits until
    /// it answers.
    ///
    /// # Panics
    /// If it is running, or does not start.
    pub fn start(&mut self) {
        assert!(!self.running, "already running");
        self.server.on_drop = Some("kill");
        self.server.ctl_blocking("start");
        self.running = true;
    }

    /// The pid `backends.sh` recorded for it, if that process is alive and is this server
    /// (its title names `127.0.0.1:PORT`, as `backends.sh` checks before signalling).
    pub fn pid(&self) -> Option<i32> {
        let name = self.server.kind.name();
        let file = self.server.dir().join(name).join(format!("{name}.pid"));
        let pid: i32 = std::fs::read_to_string(file).ok()?.trim().parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let state = stat.rsplit_once(") ")?.1.chars().next()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        (!matches!(state, 'Z' | 'X')
            && String::from_utf8_lossy(&cmdline).contains(&format!("127.0.0.1:{}", self.port)))
        .then_some(pid)
    }

    /// Sends `sig` to it, by the pid `backends.sh` recorded (checked first: [`Server::pid`]).
    /// At once, unlike a `backends.sh` call (~0.1-0.3 s of shell): the drills' faults keep their
    /// timing (replicas paused for milliseconds, not for a sentinel's down-after period).
    ///
    /// # Panics
    /// If it is not running.
    pub fn signal(&self, sig: Signal) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("redis on {} is not running", self.port));
        kill(Pid::from_raw(pid), sig).unwrap_or_else(|e| panic!("kill -{sig} {pid}: {e}"));
    }

    /// SIGKILL, and waits (up to 10 s) until the process is gone.
    ///
    /// # Panics
    /// If it survives.
    pub fn kill(&mut self) {
        if !self.running {
            return;
        }
        if let Some(pid) = self.pid() {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            wait_until("a killed redis to be gone", Duration::from_secs(10), || {
                self.pid().is_none()
            });
        }
        self.running = false;
        // Nothing left to end when dropped (the reaper would still find a survivor).
        self.server.on_drop = None;
    }

    /// SIGSTOP.
    ///
    /// # Panics
    /// If it is not running.
    pub fn pause(&self) {
        self.signal(Signal::SIGSTOP);
    }

    /// SIGCONT.
    ///
    /// # Panics
    /// If it is not running.
    pub fn resume(&self) {
        self.signal(Signal::SIGCONT);
    }

    /// Not killed by the test (it may be paused).
    pub fn is_running(&self) -> bool {
        self.running
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// One command through `redis-cli`, its output trimmed.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }

    /// The instance (its directory holds the log).
    pub fn instance(&self) -> &PrivateServer {
        &self.server
    }
}

/// `redis-cli -p PORT args…`, trimmed output (empty if it cannot run).
pub fn cli(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// Polls `check` every 20 ms until it holds, for at most `within`.
///
/// # Panics
/// If it does not hold in time.
pub fn wait_until(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let until = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `n` consecutive free loopback ports below the kernel's ephemeral range, whose cluster bus
/// ports (+10000) are free too.
fn free_ports(n: u16) -> u16 {
    static NEXT: Mutex<u16> = Mutex::new(0);
    let mut next = NEXT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if *next == 0 {
        // Spread test binaries (which run one after another) and helpers a little.
        *next = 27100 + u16::try_from(std::process::id() % 50).unwrap_or(0) * 20;
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

/// Drops `servers` on one thread each (each drop is a `backends.sh kill` that waits until the
/// process is gone).
fn drop_all(servers: Vec<Server>) {
    std::thread::scope(|scope| {
        for server in servers {
            scope.spawn(move || drop(server));
        }
    });
}

/// Runs `start(i)` for `0..n` on one thread each (each `backends.sh start` waits for its own
/// instance), in index order in the result. A start that panics panics here, after the others
/// finished (the started ones are dropped, i.e. killed).
fn start_all(n: u16, start: impl Fn(u16) -> Server + Sync) -> Vec<Server> {
    let start = &start;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n).map(|i| scope.spawn(move || start(i))).collect();
        let joined: Vec<std::thread::Result<Server>> =
            handles.into_iter().map(|h| h.join()).collect();
        let mut started = Vec::with_capacity(joined.len());
        let mut failure = None;
        for result in joined {
            match result {
                Ok(server) => started.push(server),
                Err(e) => failure = Some(e),
            }
        }
        if let Some(e) = failure {
            drop_all(started);
            std::panic::resume_unwind(e);
        }
        started
    })
}

/// Waits until `master` has `n` replicas online.
fn wait_replicas_online(master: &Server, n: usize) {
    wait_until("the replicas to sync", Duration::from_secs(20), || {
        master
            .cli(&["INFO", "replication"])
            .lines()
            .filter(|l| l.starts_with("slave") && l.contains("state=online"))
            .count()
            >= n
    });
}

/// A Sentinel set: one master, two replicas, three sentinels (quorum 2), all on loopback.
#[derive(Debug)]
pub struct SentinelSet {
    /// The monitored master's name.
    pub name: String,
    /// The data nodes; the first is the master at start.
    pub nodes: Vec<Server>,
    /// The sentinels.
    pub sentinels: Vec<Server>,
}

impl SentinelSet {
    /// Starts the set and waits until the replicas are in sync and (with `discovered`) every
    /// sentinel knows both replicas and the other two sentinels (needed for a failover).
    ///
    /// # Panics
    /// If the set does not come up.
    pub fn start(discovered: bool) -> Self {
        let base = free_ports(6);
        let name = "distlock-test".to_owned();
        let master = base.to_string();
        let nodes = start_all(3, |i| {
            if i == 0 {
                Server::redis(base, &[])
            } else {
                Server::redis(base + i, &["--replicaof", "127.0.0.1", &master])
            }
        });
        // Both replicas attached before the sentinels start: a sentinel learns the replicas
        // from the master's INFO, which it asks for again only every 10 s.
        wait_replicas_online(&nodes[0], 2);
        let settings = [
            ("down-after-milliseconds", "1000"),
            ("failover-timeout", "3000"),
            ("parallel-syncs", "2"),
        ];
        let args: Vec<&str> = settings
            .iter()
            .flat_map(|&(k, v)| ["--sentinel", k, name.as_str(), v])
            .collect();
        let sentinels = start_all(3, |i| Server::sentinel(base + 3 + i, &name, base, 2, &args));
        let set = Self {
            name,
            nodes,
            sentinels,
        };
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
                                .map(|v| (*v).to_owned())
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

    /// The data node on `port`.
    ///
    /// # Panics
    /// If there is none.
    pub fn node(&mut self, port: u16) -> &mut Server {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no data node on {port}"))
    }

    /// Waits until `master` has `n` replicas online.
    ///
    /// # Panics
    /// If it takes more than 20 s.
    pub fn wait_replicas_online(&self, master: &Server, n: usize) {
        wait_replicas_online(master, n);
    }

    /// Waits until every sentinel names a master other than `old` and that node says it is one.
    ///
    /// # Panics
    /// If that takes longer than `within`.
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
        // The sentinels first: none of them fails a master over while the nodes go.
        drop_all(std::mem::take(&mut self.sentinels));
        drop_all(std::mem::take(&mut self.nodes));
    }
}

/// A Redis Cluster of 3 masters and 3 replicas.
#[derive(Debug)]
pub struct Cluster {
    /// The six nodes (the first three are the masters at start).
    pub nodes: Vec<Server>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        drop_all(std::mem::take(&mut self.nodes));
    }
}

impl Cluster {
    /// Starts six nodes, forms the Cluster and waits until every node reports it ok and every
    /// replica is in sync.
    ///
    /// # Panics
    /// If it does not form.
    pub fn start() -> Self {
        let base = free_ports(6);
        let nodes = start_all(6, |i| {
            Server::redis(
                base + i,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                ],
            )
        });
        let addrs: Vec<String> = nodes.iter().map(Server::addr).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| panic!("redis-cli --cluster create: {e}"));
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes };
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

    /// The node on `port`.
    ///
    /// # Panics
    /// If there is none.
    pub fn node(&mut self, port: u16) -> &mut Server {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no node on {port}"))
    }
}

/// Three independent masters (for Redlock).
#[derive(Debug)]
pub struct Masters {
    /// The three servers.
    pub nodes: Vec<Server>,
}

impl Drop for Masters {
    fn drop(&mut self) {
        drop_all(std::mem::take(&mut self.nodes));
    }
}

impl Masters {
    /// Starts the three servers.
    ///
    /// # Panics
    /// If one does not start.
    pub fn start() -> Self {
        let base = free_ports(3);
        Self {
            nodes: start_all(3, |i| Server::redis(base + i, &[])),
        }
    }

    /// `redlock://m1,m2,m3?options`.
    pub fn url(&self, options: &str) -> String {
        let hosts: Vec<String> = self.nodes.iter().map(Server::addr).collect();
        let sep = if options.is_empty() { "" } else { "?" };
        format!("redlock://{}{sep}{options}", hosts.join(","))
    }
}
