//! Private server instances for tests and drills, all started, faulted and stopped through the
//! one mechanism the shared servers use: `scripts/backends.sh` (`$DISTLOCK_BACKENDS_SH`, else the
//! workspace's), pointed at a data directory and port of the instance's own.
//!
//! A test that crashes, restarts, pauses or reconfigures a server uses one of these, never a
//! shared server (other test binaries run against those at the same time). Every action is
//! `backends.sh ACTION <instance>`: `start`, `stop` (graceful, escalating), `kill` (SIGKILL: a
//! crash), `pause` / `resume` (SIGSTOP / SIGCONT); the instance is stopped and its directory
//! deleted when the handle is dropped. A handle never dropped (a `static` shared by a test
//! binary) or a test process that is killed leaves nothing behind either: a reaper process,
//! started with the first instance, `kill`s every instance whose directory still exists once
//! this process has exited, and deletes the directories.
//!
//! The Redis topologies (a Sentinel set, a Redis Cluster, independent masters) are built from
//! these instances in [`redis`].
//!
//! ```no_run
//! use conformance::servers::{PrivateServer, ServerKind};
//!
//! let pg = PrivateServer::start_blocking(ServerKind::Pg, conformance::servers::free_port());
//! let url = pg.url(); // postgres://postgres@127.0.0.1:<port>/distlock
//! pg.ctl_blocking("kill"); // crash it
//! pg.ctl_blocking("start"); // and bring it back with its data
//! # let _ = url;
//! ```

pub mod redis;

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::{Mutex, OnceLock},
    time::Duration,
};

/// Which server a [`PrivateServer`] runs (one `backends.sh` instance name each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServerKind {
    /// `redis-server`.
    Redis,
    /// `etcd` (its peer port is another free port).
    Etcd,
    /// ZooKeeper standalone.
    Zk,
    /// PostgreSQL, with the database `distlock` and trust authentication for `postgres`.
    Pg,
    /// A Redis Sentinel (`redis-server --sentinel`), started with
    /// [`PrivateServer::start_sentinel_blocking`]: `backends.sh` writes the config file it needs.
    Sentinel,
}

impl ServerKind {
    /// The `backends.sh` instance name.
    pub fn name(self) -> &'static str {
        match self {
            ServerKind::Redis => "redis",
            ServerKind::Etcd => "etcd",
            ServerKind::Zk => "zk",
            ServerKind::Pg => "pg",
            ServerKind::Sentinel => "sentinel",
        }
    }

    /// The instance's URL on `port`, without options (a Sentinel's own address, as
    /// `redis://`: clients of the set it monitors use `redis+sentinel://HOST:PORT/NAME`).
    pub fn url(self, port: u16) -> String {
        match self {
            ServerKind::Redis | ServerKind::Sentinel => format!("redis://127.0.0.1:{port}"),
            ServerKind::Etcd => format!("etcd://127.0.0.1:{port}"),
            ServerKind::Zk => format!("zk://127.0.0.1:{port}"),
            ServerKind::Pg => format!("postgres://postgres@127.0.0.1:{port}/distlock"),
        }
    }

    /// The environment that gives `backends.sh` this instance's ports.
    fn port_envs(self, port: u16) -> Vec<(String, String)> {
        let p = port.to_string();
        match self {
            ServerKind::Redis => vec![("DISTLOCK_REDIS_PORT".into(), p)],
            ServerKind::Etcd => vec![
                ("DISTLOCK_ETCD_PORT".into(), p),
                // Not `port + 1`: two private servers started at once may be given neighbouring
                // client ports, and one's peer port would be the other's client port.
                (
                    "DISTLOCK_ETCD_PEER_PORT".into(),
                    free_port_except(port).to_string(),
                ),
            ],
            ServerKind::Zk => vec![("DISTLOCK_ZK_PORT".into(), p)],
            ServerKind::Pg => vec![("DISTLOCK_PG_PORT".into(), p)],
            ServerKind::Sentinel => vec![("DISTLOCK_SENTINEL_PORT".into(), p)],
        }
    }
}

/// `scripts/backends.sh` (from `$DISTLOCK_BACKENDS_SH`, else the workspace's).
pub fn backends_sh() -> PathBuf {
    std::env::var_os("DISTLOCK_BACKENDS_SH")
        .filter(|p| !p.is_empty())
        .map_or_else(
            || Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/backends.sh"),
            PathBuf::from,
        )
}

/// A port nothing listens on now (the kernel's pick; bound and released at once).
///
/// # Panics
/// If no loopback port can be bound.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

/// A free port other than `taken`.
fn free_port_except(taken: u16) -> u16 {
    loop {
        let port = free_port();
        if port != taken {
            return port;
        }
    }
}

/// Runs `backends.sh ARGS` with `envs` and returns its output (a failure is the caller's to
/// judge). `backends.sh` bounds each of its own waits (`DISTLOCK_BACKENDS_TIMEOUT`, 30 s).
///
/// # Panics
/// If `backends.sh` cannot be run at all.
pub fn backends_output(envs: &[(String, String)], args: &[&str]) -> Output {
    Command::new(backends_sh())
        .args(args)
        .envs(envs.iter().cloned())
        .output()
        .expect("run backends.sh")
}

/// Runs `backends.sh ARGS` with `envs`; panics with its output unless it succeeds.
///
/// # Panics
/// If it fails.
pub fn backends_blocking(envs: &[(String, String)], args: &[&str]) {
    let out = backends_output(envs, args);
    assert!(
        out.status.success(),
        "backends.sh {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// [`backends_blocking`] from async code (off the runtime's worker), bounded at 90 s.
///
/// # Panics
/// If it fails or takes longer.
pub async fn backends(envs: &[(String, String)], args: &[&str]) {
    let envs = envs.to_vec();
    let owned: Vec<String> = args.iter().map(|&a| a.to_owned()).collect();
    let run = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = owned.iter().map(String::as_str).collect();
        backends_blocking(&envs, &args);
    });
    match tokio::time::timeout(Duration::from_secs(90), run).await {
        Ok(joined) => joined.expect("backends.sh failed (see the panic above)"),
        Err(_) => panic!("backends.sh {args:?} took more than 90 s"),
    }
}

/// A server instance of our own (never a shared one): `backends.sh` with a private data
/// directory and the given port. Stopped and deleted when dropped.
#[derive(Debug)]
pub struct PrivateServer {
    /// What it runs.
    pub kind: ServerKind,
    /// Its client port.
    pub port: u16,
    dir: PathBuf,
    envs: Vec<(String, String)>,
    /// What dropping it does before deleting its directory: `backends.sh stop` unless the
    /// owner knows better (a topology's node: `kill`, or nothing once the test has killed it).
    on_drop: Option<&'static str>,
}

impl PrivateServer {
    fn new(kind: ServerKind, port: u16, args: &[&str]) -> Self {
        Self::new_with_envs(kind, port, args, Vec::new())
    }

    fn new_with_envs(
        kind: ServerKind,
        port: u16,
        args: &[&str],
        more_envs: Vec<(String, String)>,
    ) -> Self {
        assert!(
            args.is_empty() || kind != ServerKind::Pg,
            "extra flags are for Redis, Sentinel, etcd and ZooKeeper"
        );
        let (dir, mut envs) = private_dir(kind.name(), port);
        envs.extend(kind.port_envs(port));
        envs.extend(more_envs);
        if !args.is_empty() {
            assert!(
                args.iter()
                    .all(|a| !a.is_empty() && !a.contains(char::is_whitespace)),
                "server flags are passed space-separated: {args:?}"
            );
            envs.push(("DISTLOCK_SERVER_ARGS".to_owned(), args.join(" ")));
        }
        reaper().watch(&dir, &envs, &[kind.name()]);
        Self {
            kind,
            port,
            dir,
            envs,
            on_drop: Some("stop"),
        }
    }

    /// A Redis Sentinel on `port` monitoring the master `name` at `127.0.0.1:master_port` with
    /// `quorum` (the `sentinel monitor` line of the config file `backends.sh` writes at its
    /// first start; Sentinel rewrites that file with what it learns, and a restart keeps it).
    /// `args` are more settings as `redis-server` flags, kept for every later `start`: e.g.
    /// `["--sentinel", "down-after-milliseconds", name, "1000"]` (each `--flag` and its values
    /// become one config line). Waits until it answers.
    ///
    /// # Panics
    /// If it does not start, `name` is empty or contains whitespace, or a flag does.
    pub fn start_sentinel_blocking(
        port: u16,
        name: &str,
        master_port: u16,
        quorum: u32,
        args: &[&str],
    ) -> Self {
        assert!(
            !name.is_empty() && !name.contains(char::is_whitespace),
            "a master name without whitespace: {name:?}"
        );
        let monitor = format!("{name} 127.0.0.1 {master_port} {quorum}");
        let server = Self::new_with_envs(
            ServerKind::Sentinel,
            port,
            args,
            vec![("DISTLOCK_SENTINEL_MONITOR".to_owned(), monitor)],
        );
        server.ctl_blocking("start");
        server
    }

    /// Starts `kind` on `port` (etcd's peer port: another free one) and waits until it answers.
    ///
    /// # Panics
    /// If it does not start.
    pub async fn start(kind: ServerKind, port: u16) -> Self {
        Self::start_with(kind, port, &[]).await
    }

    /// [`PrivateServer::start`] with extra command-line flags for Redis or etcd, or `zoo.cfg`
    /// lines for ZooKeeper (`backends.sh`'s `DISTLOCK_SERVER_ARGS`), kept for every later
    /// `start`: a server configured differently, e.g. `["--maxmemory-policy", "allkeys-lru"]`
    /// or `["maxSessionTimeout=2000"]`.
    ///
    /// # Panics
    /// If it does not start, or a flag is empty or contains whitespace.
    pub async fn start_with(kind: ServerKind, port: u16, args: &[&str]) -> Self {
        assert!(
            kind != ServerKind::Sentinel,
            "a Sentinel starts with start_sentinel_blocking"
        );
        let server = Self::new(kind, port, args);
        server.ctl("start").await;
        server
    }

    /// [`PrivateServer::start`] for synchronous tests.
    ///
    /// # Panics
    /// If it does not start.
    pub fn start_blocking(kind: ServerKind, port: u16) -> Self {
        Self::start_blocking_with(kind, port, &[])
    }

    /// [`PrivateServer::start_with`] for synchronous tests.
    ///
    /// # Panics
    /// As [`PrivateServer::start_with`].
    pub fn start_blocking_with(kind: ServerKind, port: u16, args: &[&str]) -> Self {
        assert!(
            kind != ServerKind::Sentinel,
            "a Sentinel starts with start_sentinel_blocking"
        );
        let server = Self::new(kind, port, args);
        server.ctl_blocking("start");
        server
    }

    /// `backends.sh ACTION <instance>` (start, stop, kill, pause, resume).
    ///
    /// # Panics
    /// If the action fails.
    pub async fn ctl(&self, action: &str) {
        backends(&self.envs, &[action, self.kind.name()]).await;
    }

    /// [`PrivateServer::ctl`] for synchronous tests.
    ///
    /// # Panics
    /// If the action fails.
    pub fn ctl_blocking(&self, action: &str) {
        backends_blocking(&self.envs, &[action, self.kind.name()]);
    }

    /// The instance's URL, without options.
    pub fn url(&self) -> String {
        self.kind.url(self.port)
    }

    /// The instance's data directory (its logs are under it).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        if let Some(action) = self.on_drop {
            let _ = backends_output(&self.envs, &[action, self.kind.name()]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh data directory of a private instance or cluster, and the environment that points
/// `backends.sh` at it.
fn private_dir(name: &str, port: u16) -> (PathBuf, Vec<(String, String)>) {
    let dir = std::env::temp_dir().join(format!(
        "distlock-private-{name}-{port}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        panic!("create {}: {e}", dir.display());
    }
    let envs = vec![(
        "DISTLOCK_BACKENDS_DIR".to_owned(),
        dir.display().to_string(),
    )];
    (dir, envs)
}

/// Which 3-member cluster a [`PrivateCluster`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClusterKind {
    /// etcd (`backends.sh`'s `etcd3-1` .. `etcd3-3`).
    Etcd,
    /// A ZooKeeper ensemble (`zk3-1` .. `zk3-3`).
    Zk,
}

impl ClusterKind {
    fn prefix(self) -> &'static str {
        match self {
            ClusterKind::Etcd => "etcd3",
            ClusterKind::Zk => "zk3",
        }
    }

    /// The `backends.sh` port lists: the client ports first.
    fn port_lists(self) -> &'static [&'static str] {
        match self {
            ClusterKind::Etcd => &["DISTLOCK_ETCD3_PORTS", "DISTLOCK_ETCD3_PEER_PORTS"],
            ClusterKind::Zk => &[
                "DISTLOCK_ZK3_PORTS",
                "DISTLOCK_ZK3_QUORUM_PORTS",
                "DISTLOCK_ZK3_ELECTION_PORTS",
            ],
        }
    }
}

/// A 3-member cluster of our own: `backends.sh`'s cluster instances on free ports and a private
/// data directory, started together. Stopped and deleted when dropped.
///
/// ```no_run
/// use conformance::servers::{ClusterKind, PrivateCluster};
///
/// let etcd = PrivateCluster::start_blocking(ClusterKind::Etcd);
/// let url = etcd.url(); // etcd://127.0.0.1:<p1>,127.0.0.1:<p2>,127.0.0.1:<p3>
/// etcd.ctl_blocking("kill", 2); // crash the third member (its name: etcd.member(2))
/// # let _ = url;
/// ```
#[derive(Debug)]
pub struct PrivateCluster {
    /// What it runs.
    pub kind: ClusterKind,
    /// The members' client ports.
    pub ports: [u16; 3],
    /// Each port list after the client ports ([`ClusterKind::port_lists`]).
    other_ports: Vec<[u16; 3]>,
    dir: PathBuf,
    envs: Vec<(String, String)>,
}

impl PrivateCluster {
    /// A cluster whose ports and data directory are chosen but whose members are not started:
    /// for a drill that puts something between the members (proxies on their peer ports, whose
    /// addresses the members then advertise: [`PrivateCluster::set_member_args`]) before
    /// [`PrivateCluster::start_members`]. Stopped and deleted when dropped, as a started one.
    pub fn planned(kind: ClusterKind) -> Self {
        Self::new(kind)
    }

    fn new(kind: ClusterKind) -> Self {
        // Distinct ports (each free one is released before the next is asked for).
        let mut taken = Vec::new();
        let mut lists: Vec<[u16; 3]> = Vec::new();
        for _ in kind.port_lists() {
            lists.push([(); 3].map(|()| {
                let port = std::iter::repeat_with(free_port)
                    .find(|p| !taken.contains(p))
                    .unwrap_or_default();
                taken.push(port);
                port
            }));
        }
        let ports = lists[0];
        let (dir, mut envs) = private_dir(kind.prefix(), ports[0]);
        for (name, list) in kind.port_lists().iter().zip(&lists) {
            let list = list.map(|p| p.to_string()).join(" ");
            envs.push(((*name).to_owned(), list));
        }
        let cluster = Self {
            kind,
            ports,
            other_ports: lists[1..].to_vec(),
            dir,
            envs,
        };
        let members = cluster.members();
        let names: Vec<&str> = members.iter().map(String::as_str).collect();
        reaper().watch(&cluster.dir, &cluster.envs, &names);
        cluster
    }

    /// The members' peer ports: etcd's peer ports, ZooKeeper's quorum ports.
    pub fn peer_ports(&self) -> [u16; 3] {
        self.other_ports[0]
    }

    /// ZooKeeper's election ports (`None` for etcd).
    pub fn election_ports(&self) -> Option<[u16; 3]> {
        self.other_ports.get(1).copied()
    }

    /// Member `i`'s own extra flags (etcd) or `zoo.cfg` lines (ZooKeeper), after and over the
    /// ones `backends.sh` gives every member (`DISTLOCK_SERVER_ARGS_<member>`), kept for every
    /// later start: e.g. etcd's `--initial-advertise-peer-urls` of a proxy in front of the
    /// member, or the `server.N=` lines of a ZooKeeper member that reaches the others through
    /// proxies.
    ///
    /// # Panics
    /// If a flag is empty or contains whitespace (they are passed space-separated).
    pub fn set_member_args(&mut self, i: usize, args: &[String]) {
        assert!(
            args.iter()
                .all(|a| !a.is_empty() && !a.contains(char::is_whitespace)),
            "server flags are passed space-separated: {args:?}"
        );
        let name = format!("DISTLOCK_SERVER_ARGS_{}", self.member(i).replace('-', "_"));
        self.envs.retain(|(n, _)| *n != name);
        self.envs.push((name, args.join(" ")));
    }

    /// Starts the members `which` (indices 0..3) with one `backends.sh start`, which launches
    /// them all before it waits for each to answer (a member answers without a quorum). `Err`
    /// with `backends.sh`'s output when one does not start (e.g. a port taken meanwhile).
    pub async fn start_members(&self, which: &[usize]) -> Result<(), String> {
        let mut args = vec!["start".to_owned()];
        args.extend(which.iter().map(|&i| self.member(i)));
        let envs = self.envs.clone();
        let out = tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            backends_output(&envs, &args)
        })
        .await
        .map_err(|e| format!("backends.sh start: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Member `i`'s process id while it runs (from `backends.sh`'s pid file).
    pub fn pid(&self, i: usize) -> Option<u32> {
        let name = self.member(i);
        std::fs::read_to_string(self.dir.join(&name).join(format!("{name}.pid")))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// The last `n` lines of member `i`'s log, for a failure message.
    pub fn log_tail(&self, i: usize, n: usize) -> String {
        let name = self.member(i);
        let log = std::fs::read_to_string(self.dir.join(&name).join(format!("{name}.log")))
            .unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// `start` and the three members: one `backends.sh` call launches them together.
    fn start_args(&self) -> Vec<String> {
        std::iter::once("start".to_owned())
            .chain(self.members())
            .collect()
    }

    /// The three instance names.
    pub fn members(&self) -> [String; 3] {
        [1, 2, 3].map(|i| format!("{}-{i}", self.kind.prefix()))
    }

    /// The name of member `i` (0, 1 or 2): the etcd member's name, the ZooKeeper server's.
    pub fn member(&self, i: usize) -> String {
        self.members()[i].clone()
    }

    /// Starts the three members together and waits until each answers.
    ///
    /// # Panics
    /// If they do not start.
    pub async fn start(kind: ClusterKind) -> Self {
        let cluster = Self::new(kind);
        let args = cluster.start_args();
        backends(
            &cluster.envs,
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
        )
        .await;
        cluster
    }

    /// [`PrivateCluster::start`] for synchronous tests.
    ///
    /// # Panics
    /// If they do not start.
    pub fn start_blocking(kind: ClusterKind) -> Self {
        let cluster = Self::new(kind);
        let args = cluster.start_args();
        backends_blocking(
            &cluster.envs,
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        cluster
    }

    /// `backends.sh ACTION <member i>` (start, stop, kill, pause, resume).
    ///
    /// # Panics
    /// If the action fails.
    pub async fn ctl(&self, action: &str, i: usize) {
        backends(&self.envs, &[action, &self.member(i)]).await;
    }

    /// [`PrivateCluster::ctl`] for synchronous tests.
    ///
    /// # Panics
    /// If the action fails.
    pub fn ctl_blocking(&self, action: &str, i: usize) {
        backends_blocking(&self.envs, &[action, &self.member(i)]);
    }

    /// The URL naming the members in `which` (e.g. `0..3`), without options.
    pub fn url_of(&self, which: std::ops::Range<usize>) -> String {
        let scheme = match self.kind {
            ClusterKind::Etcd => "etcd",
            ClusterKind::Zk => "zk",
        };
        let hosts: Vec<String> = self.ports[which]
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("{scheme}://{}", hosts.join(","))
    }

    /// The URL naming all three members, without options.
    pub fn url(&self) -> String {
        self.url_of(0..3)
    }

    /// The cluster's data directory (the members' logs are under it).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        for member in self.members() {
            let _ = backends_output(&self.envs, &["stop", &member]);
        }
        if std::thread::panicking() {
            // A failed test: the end of its members' logs is what explains it.
            for (i, member) in self.members().iter().enumerate() {
                eprintln!("--- {member} (last 40 lines) ---\n{}", self.log_tail(i, 40));
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Kills, once this process has exited, the private instances whose directories still exist
/// (a `static` never dropped, a test binary killed by a timeout), and deletes the directories.
/// One `sh` process per test process, started with the first instance; it runs the lines of
/// its script file (one per instance: `backends.sh kill` with the instance's environment).
struct Reaper {
    script: Mutex<PathBuf>,
}

fn reaper() -> &'static Reaper {
    static REAPER: OnceLock<Reaper> = OnceLock::new();
    REAPER.get_or_init(|| {
        let script = std::env::temp_dir().join(format!(
            "distlock-reaper-{}-{:08x}.sh",
            std::process::id(),
            rand::random::<u32>()
        ));
        if let Err(e) = std::fs::write(&script, "") {
            panic!("create {}: {e}", script.display());
        }
        let watcher = format!(
            "while kill -0 {parent} 2>/dev/null; do sleep 0.5; done; sh {script}; rm -f {script}",
            parent = std::process::id(),
            script = shell_quote(&script.display().to_string()),
        );
        // Never waited for: it outlives this process on purpose (it reaps after our exit). Its
        // own process group, so that a ^C to the test run does not end it before it has reaped.
        #[allow(clippy::zombie_processes)]
        let spawned = {
            use std::os::unix::process::CommandExt;
            Command::new("sh")
                .args(["-c", &watcher])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
        };
        if let Err(e) = spawned {
            panic!("start the reaper of the private servers: {e}");
        }
        Reaper {
            script: Mutex::new(script),
        }
    })
}

impl Reaper {
    /// After this process exits: `backends.sh kill NAME` for each of `names` with `envs`, if
    /// `dir` still exists (a dropped instance has deleted it), then delete `dir`.
    fn watch(&self, dir: &Path, envs: &[(String, String)], names: &[&str]) {
        let dir = shell_quote(&dir.display().to_string());
        let envs: Vec<String> = envs
            .iter()
            .map(|(k, v)| shell_quote(&format!("{k}={v}")))
            .collect();
        let backends = shell_quote(&backends_sh().display().to_string());
        let mut line = format!("if [ -d {dir} ]; then");
        for name in names {
            line.push_str(&format!(
                " env {} {backends} kill {} >/dev/null 2>&1;",
                envs.join(" "),
                shell_quote(name)
            ));
        }
        line.push_str(&format!(" rm -rf {dir}; fi\n"));
        let script = self
            .script
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let appended = std::fs::OpenOptions::new()
            .append(true)
            .open(&*script)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = appended {
            panic!("write {}: {e}", script.display());
        }
    }
}

/// `s` quoted for `sh`.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}
