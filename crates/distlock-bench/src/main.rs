#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod backends;
mod contention;
mod election;
mod held;
mod pools;
mod report;
mod scenario;
mod stats;
mod system;
mod topologies;

use std::{path::PathBuf, sync::Arc, time::Duration};

use clap::Parser;
use lock_core::DynLock;

use crate::{
    backends::{Backend, Res},
    report::{BackendReport, Meta, Report, WatchdogCost},
};

/// Measures distlock against the bare protocols and peer libraries on the local servers.
#[derive(Debug, Parser)]
#[command(name = "distlock-bench", version)]
struct Args {
    /// Comma-separated backends to run, in order (redis, etcd, zk, pg).
    #[arg(long, value_delimiter = ',', default_value = "redis,etcd,zk,pg")]
    backends: Vec<String>,
    /// A short run (< 1 min): fewer cycles and handoffs, shorter windows, 1,000 held locks only.
    #[arg(long)]
    quick: bool,
    /// Measured uncontended rounds per variant (default 1000, or 150 with --quick).
    #[arg(long)]
    cycles: Option<usize>,
    /// Measure only the uncontended acquire + release (section 1–2) of `--backends`: no
    /// hand-off, throughput or watchdog phases (a few seconds per backend).
    #[arg(long)]
    uncontended_only: bool,
    /// Clients taking turns on one key in the hand-off measurement (2 to 16; default 8).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u8).range(2..=16))]
    waiters: u8,
    /// Numbers of held locks for the watchdog measurement (default 1000,10000,100000, or 1000 with
    /// --quick; 100000 with --held-locks).
    #[arg(long, value_delimiter = ',')]
    held: Option<Vec<usize>>,
    /// Lease TTL in seconds of the watchdog measurement, renewed every third of it (default 6,
    /// 3 with --quick; 30 with --held-locks, so that 100,000 renewals fit in an interval).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3600))]
    watchdog_ttl: Option<u64>,
    /// Use a tokio current-thread runtime instead of a multi-thread one with one worker per CPU.
    #[arg(long)]
    current_thread: bool,
    /// Where results.md, results.json and results.svg go (default: the workspace's target/bench).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Run only the pool comparison on PostgreSQL (lock-pg's own pool against sqlx's `PgPool`
    /// with and without `test_before_acquire`); writes pools.md and pools.json.
    #[arg(long)]
    pools: bool,
    /// Run only the leader-election and job-mode measurement (hand-over on resign, takeover
    /// after the leader dies, `run_exclusive` with and without `at_least`), on the in-memory
    /// backend and `--backends`; writes election.md and election.json.
    #[arg(long)]
    election: bool,
    /// Run only the Redis topology comparison: starts a private single server, Sentinel set
    /// (1+2, 3 sentinels), 3+3 Cluster and three Redlock masters on loopback and measures the
    /// uncontended cycle and the hand-off on each (with `replicas=1`), medians, p99s and ratios
    /// to the single server; writes topologies.md and topologies.json.
    #[arg(long)]
    redis_topologies: bool,
    /// Run only the held-locks measurement at scale: `--held` locks (default 100,000) held by
    /// one client per backend, each size in a child process; writes held.md and held.json.
    #[arg(long)]
    held_locks: bool,
    /// Run only the etcd contention probe: `--contenders` clients on one key, requests per
    /// acquisition by kind and the serial path's timings, printed.
    #[arg(long)]
    contention: bool,
    /// Clients in the contention probe (default 16).
    #[arg(long, default_value_t = 16)]
    contenders: usize,
    /// Clients in the contention probe that only watch the lock's queue (deletions only, one
    /// watch each, as a waiter does) during its distlock windows: what a release's fan-out to
    /// that many more watches costs the contended path (default 0).
    #[arg(long, default_value_t = 0)]
    idle_watchers: usize,
    /// Concurrent tasks sharing one client in the pool comparison (default 8,32).
    #[arg(long, value_delimiter = ',', default_value = "8,32")]
    pool_tasks: Vec<usize>,
    /// Internal: run only the watchdog measurement of one backend and one size, print it as
    /// JSON. The main run starts one such child per measurement so that its memory and CPU
    /// figures are not blurred by earlier phases.
    #[arg(long, hide = true)]
    watchdog_child: bool,
    /// Internal: the run id (key prefix) a watchdog child uses.
    #[arg(long, hide = true)]
    run: Option<String>,
    /// Internal: campaign in this election on the one backend of `--backends`, print the term
    /// once leading, then lead until killed (the takeover measurement SIGKILLs it).
    #[arg(long, hide = true)]
    election_child: Option<String>,
    /// Internal: the election child's TTL, in ms.
    #[arg(long, hide = true, default_value_t = 2000)]
    election_ttl_ms: u64,
}

/// The sizes of one run.
#[derive(Clone, Copy, Debug)]
struct Plan {
    warmup: usize,
    cycles: usize,
    handoffs: usize,
    waiters: usize,
    clients: usize,
    window: Duration,
    watchdog_ttl: Duration,
    ticks: u32,
}

impl Plan {
    fn new(args: &Args) -> Self {
        let quick = args.quick;
        Self {
            warmup: if quick { 50 } else { 200 },
            cycles: args.cycles.unwrap_or(if quick { 150 } else { 1000 }),
            handoffs: if quick { 40 } else { 200 },
            waiters: usize::from(args.waiters),
            clients: 16,
            window: Duration::from_millis(if quick { 1500 } else { 5000 }),
            watchdog_ttl: Duration::from_secs(args.watchdog_ttl.unwrap_or(if args.held_locks {
                30
            } else if quick {
                3
            } else {
                6
            })),
            ticks: if quick || args.held_locks { 2 } else { 3 },
        }
    }
}

/// The watchdog measurement's TTL for `args` (what its children are told).
fn plan_ttl(args: &Args) -> Duration {
    Plan::new(args).watchdog_ttl
}

/// The lease TTL of every measurement except the watchdog's (long: nothing expires mid-run).
const TTL: Duration = Duration::from_secs(30);

fn env_url(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|v| !v.is_empty())
}

fn backend(name: &str, plan: &Plan) -> Result<Box<dyn Backend>, String> {
    let need = |var: &str| {
        env_url(var).ok_or_else(|| {
            format!("{var} is not set (run `scripts/backends.sh up` and `eval \"$(scripts/backends.sh env)\"`)")
        })
    };
    let built: Res<Box<dyn Backend>> =
        match name {
            "redis" => backends::redis::Redis::new(&need("DISTLOCK_TEST_REDIS_URL")?)
                .map(|b| Box::new(b) as _),
            "etcd" => backends::etcd::Etcd::new(&need("DISTLOCK_TEST_ETCD_URL")?)
                .map(|b| Box::new(b) as _),
            "zk" => backends::zk::Zk::new(&need("DISTLOCK_TEST_ZK_URL")?, plan.watchdog_ttl)
                .map(|b| Box::new(b) as _),
            "pg" => backends::pg::Pg::new(&need("DISTLOCK_TEST_PG_URL")?).map(|b| Box::new(b) as _),
            other => return Err(format!("unknown backend {other:?} (redis, etcd, zk, pg)")),
        };
    built.map_err(|e| e.to_string())
}

fn progress(msg: impl AsRef<str>) {
    eprintln!("[distlock-bench] {}", msg.as_ref());
}

async fn run_backend(
    b: &dyn Backend,
    args: &Args,
    plan: &Plan,
    held: &[usize],
    run: &str,
) -> BackendReport {
    let mut report = BackendReport::empty(b.name().to_owned(), b.server(), b.notes());
    let name = b.name();
    if let Err(e) = b.prepare().await {
        report.notes.push(format!("setup failed: {e}"));
        return report;
    }

    progress(format!(
        "{name}: uncontended cycles ({} + {} warm-up rounds)",
        plan.cycles, plan.warmup
    ));
    match b.cycles(run, TTL).await {
        Ok(mut variants) => {
            report.uncontended =
                scenario::uncontended(&mut variants, plan.warmup, plan.cycles).await;
        }
        Err(e) => {
            report
                .notes
                .push(format!("uncontended variants could not be set up: {e}"));
        }
    }
    if args.uncontended_only {
        return report;
    }

    progress(format!("{name}: connecting {} clients", plan.clients));
    let clients: Res<Vec<DynLock>> =
        futures::future::try_join_all((0..plan.clients).map(|_| b.client())).await;
    match clients {
        Ok(clients) => {
            report.wait_notify = clients
                .first()
                .is_some_and(|c| c.capabilities().wait_notify);
            progress(format!("{name}: handoff, {} waiters", plan.waiters));
            let (rtt, idle_rtt, write_rtt) = (
                report.rtt().copied(),
                report.idle_rtt().copied(),
                report.write_rtt().copied(),
            );
            match lock_core::LockKey::new(format!("bench/{run}/handoff")) {
                Ok(key) => match scenario::handoff(
                    &clients[..plan.waiters],
                    &key,
                    TTL,
                    plan.handoffs,
                    scenario::HandoffFloors {
                        rtt: rtt.as_ref(),
                        idle_rtt: idle_rtt.as_ref(),
                        write_rtt: write_rtt.as_ref(),
                    },
                )
                .await
                {
                    Ok(h) => report.handoff = Some(h),
                    Err(e) => report.notes.push(format!("handoff failed: {e}")),
                },
                Err(e) => report.notes.push(format!("handoff failed: {e}")),
            }
            for keys in [1, plan.clients] {
                progress(format!(
                    "{name}: throughput, {} clients on {keys} key(s)",
                    plan.clients
                ));
                match scenario::throughput(&clients, run, keys, TTL, plan.window).await {
                    Ok(t) => report.throughput.push(t),
                    Err(e) => report
                        .notes
                        .push(format!("throughput on {keys} key(s) failed: {e}")),
                }
                if keys == 1
                    && let Some(bare) = b.bare_one_key(plan.clients, plan.window).await
                {
                    progress(format!(
                        "{name}: throughput of the bare protocol, {} clients on 1 key",
                        plan.clients
                    ));
                    match bare {
                        Ok(rate) => report.bare_one_key = Some(rate),
                        Err(e) => report.notes.push(format!(
                            "the bare protocol's throughput on 1 key failed: {e}"
                        )),
                    }
                }
            }
        }
        Err(e) => report.notes.push(format!("clients could not connect: {e}")),
    }

    for &n in held {
        progress(format!(
            "{name}: watchdog cost with {n} held locks (child process)"
        ));
        match watchdog_in_child(args, name, n, run).await {
            Ok(w) => {
                if w.renewals_per_tick < 0.95 * n as f64 {
                    report.notes.push(format!(
                        "with {n} held locks only {:.0} renewals completed per tick: the watchdogs fall behind their interval here",
                        w.renewals_per_tick
                    ));
                }
                if w.lost > 0 {
                    report.notes.push(format!(
                        "{} of {n} held locks were lost during the watchdog window: this backend does not keep up with {n} renewals per interval here",
                        w.lost
                    ));
                }
                report.watchdog.push(w);
            }
            Err(e) => report
                .notes
                .push(format!("watchdog with {n} held locks failed: {e}")),
        }
    }
    report
}

/// Runs the watchdog measurement in a fresh process of this binary (see `--watchdog-child`).
async fn watchdog_in_child(
    args: &Args,
    backend: &str,
    held: usize,
    run: &str,
) -> Res<WatchdogCost> {
    let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
    cmd.args(["--watchdog-child", "--backends", backend, "--run", run])
        .arg(format!("--held={held}"))
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true);
    if args.quick {
        cmd.arg("--quick");
    }
    if args.current_thread {
        cmd.arg("--current-thread");
    }
    cmd.arg(format!("--watchdog-ttl={}", plan_ttl(args).as_secs()));
    if args.held_locks {
        // The child measures as the held-locks mode plans (its TTL and ticks).
        cmd.arg("--held-locks");
    }
    // A backend that cannot keep up is reported as such, not waited for indefinitely.
    // Taking and releasing 100,000 locks alone takes minutes on the slower backends.
    let secs = if args.quick { 40 } else { 150 };
    let limit = Duration::from_secs(secs.max(u64::try_from(held / 250).unwrap_or(u64::MAX)));
    let out = tokio::time::timeout(limit, cmd.output())
        .await
        .map_err(|_| {
            format!("not measured: did not finish within {limit:?} (the child was killed)")
        })??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .last()
        .ok_or_else(|| format!("the watchdog child printed nothing ({})", out.status))?;
    let result: Result<WatchdogCost, String> = serde_json::from_str(line)?;
    Ok(result?)
}

/// The body of a watchdog child: one backend, one size, JSON on stdout.
async fn watchdog_child(args: &Args, plan: &Plan, run: &str) -> Result<WatchdogCost, String> {
    let [name] = args.backends.as_slice() else {
        return Err("a watchdog child takes exactly one backend".into());
    };
    let Some([held]) = args.held.as_deref() else {
        return Err("a watchdog child takes exactly one --held".into());
    };
    let b = backend(name.trim(), plan)?;
    // `--held-locks` runs only children: PostgreSQL's bench database may not exist yet.
    b.prepare().await.map_err(|e| e.to_string())?;
    let (client, counter) = b.watchdog_client().await.map_err(|e| e.to_string())?;
    scenario::watchdog(
        &client,
        counter.as_ref(),
        run,
        *held,
        plan.watchdog_ttl,
        plan.ticks,
    )
    .await
    .map_err(|e| e.to_string())
}

/// `--pools`: the pool comparison alone, printed and written to `pools.md` and `pools.json`.
fn pools_main(
    args: &Args,
    plan: &Plan,
    runtime: &tokio::runtime::Runtime,
    flavour: String,
) -> std::process::ExitCode {
    let Some(url) = env_url("DISTLOCK_TEST_PG_URL") else {
        eprintln!(
            "DISTLOCK_TEST_PG_URL is not set (run `scripts/backends.sh up` and `eval \"$(scripts/backends.sh env)\"`)"
        );
        return std::process::ExitCode::FAILURE;
    };
    let pool_plan = pools::PoolPlan {
        warmup: plan.warmup,
        rounds: plan.cycles,
        tasks: args.pool_tasks.iter().copied().filter(|&t| t > 0).collect(),
        burst_ops: if args.quick { 200 } else { 1000 },
        bursts: if args.quick { 2 } else { 5 },
    };
    let run = format!("{:08x}", rand::random::<u32>());
    let result = runtime.block_on(pools::run(
        &url,
        &pool_plan,
        &run,
        (command_line(), flavour),
    ));
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("the pool comparison failed: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let md = pools::markdown(&report);
    println!("{md}");
    let out = args.out.clone().unwrap_or_else(default_out);
    let written = std::fs::create_dir_all(&out)
        .and_then(|()| std::fs::write(out.join("pools.md"), &md))
        .and_then(|()| {
            let json = serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?;
            std::fs::write(out.join("pools.json"), json)
        });
    match written {
        Ok(()) => {
            progress(format!(
                "wrote pools.md and pools.json to {}",
                out.display()
            ));
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cannot write the results to {}: {e}", out.display());
            std::process::ExitCode::FAILURE
        }
    }
}

/// `--election`: the election and job-mode measurement alone, printed and written to
/// `election.md` and `election.json`.
fn election_main(args: &Args, runtime: &tokio::runtime::Runtime) -> std::process::ExitCode {
    let plan = election::ElectionPlan::new(args.quick);
    let run = format!("{:08x}", rand::random::<u32>());
    let report = runtime.block_on(election::run(&args.backends, &plan, &run, command_line()));
    let md = election::markdown(&report);
    println!("{md}");
    let out = args.out.clone().unwrap_or_else(default_out);
    let written = std::fs::create_dir_all(&out)
        .and_then(|()| std::fs::write(out.join("election.md"), &md))
        .and_then(|()| {
            let json = serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?;
            std::fs::write(out.join("election.json"), json)
        });
    match written {
        Ok(()) => {
            progress(format!(
                "wrote election.md and election.json to {}",
                out.display()
            ));
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cannot write the results to {}: {e}", out.display());
            std::process::ExitCode::FAILURE
        }
    }
}

fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut cmd = "cargo run --release -p distlock-bench".to_owned();
    if !args.is_empty() {
        cmd.push_str(" -- ");
        cmd.push_str(&args.join(" "));
    }
    cmd
}

fn default_out() -> PathBuf {
    // crates/distlock-bench → the workspace root.
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join("target/bench")
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let plan = Plan::new(&args);
    let held = args.held.clone().unwrap_or_else(|| {
        if args.quick {
            vec![1000]
        } else {
            vec![1000, 10_000, 100_000]
        }
    });
    let machine = system::Machine::detect();
    let (runtime, flavour) = if args.current_thread {
        (
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build(),
            "tokio current-thread".to_owned(),
        )
    } else {
        (
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(machine.nproc)
                .enable_all()
                .build(),
            format!("tokio multi-thread, {} workers", machine.nproc),
        )
    };
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the tokio runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    if args.watchdog_child {
        let run = args.run.clone().unwrap_or_else(|| "child".to_owned());
        let result = runtime.block_on(watchdog_child(&args, &plan, &run));
        runtime.shutdown_timeout(Duration::from_secs(2));
        return match serde_json::to_string(&result) {
            Ok(line) => {
                println!("{line}");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("cannot encode the watchdog result: {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    if let Some(name) = &args.election_child {
        let [backend] = args.backends.as_slice() else {
            eprintln!("an election child takes exactly one backend");
            return std::process::ExitCode::FAILURE;
        };
        let ttl = Duration::from_millis(args.election_ttl_ms);
        return match runtime.block_on(election::child(backend.trim(), name, ttl)) {
            Ok(never) => match never {},
            Err(e) => {
                eprintln!("election child: {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    if args.pools {
        return pools_main(&args, &plan, &runtime, flavour);
    }
    if args.election {
        return election_main(&args, &runtime);
    }
    if args.redis_topologies {
        let out = args.out.clone().unwrap_or_else(default_out);
        let waiters = usize::from(args.waiters);
        return topologies::main(args.quick, args.cycles, waiters, out, &runtime, flavour);
    }
    if args.held_locks {
        return held::main(&args, &runtime, flavour, machine);
    }
    if args.contention {
        let Some(url) = env_url("DISTLOCK_TEST_ETCD_URL") else {
            eprintln!("DISTLOCK_TEST_ETCD_URL is not set");
            return std::process::ExitCode::FAILURE;
        };
        let window = Duration::from_secs(if args.quick { 2 } else { 5 });
        return match runtime.block_on(contention::run(
            &url,
            args.contenders.max(2),
            args.idle_watchers,
            window,
        )) {
            Ok(md) => {
                println!("{md}");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("the contention probe failed: {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let started = std::time::SystemTime::now();
    let t0 = std::time::Instant::now();
    let run = format!("{:08x}", rand::random::<u32>());
    let mut reports = Vec::new();
    for name in &args.backends {
        let name = name.trim();
        match backend(name, &plan) {
            Ok(b) => {
                let b: Arc<dyn Backend> = Arc::from(b);
                reports.push(runtime.block_on(run_backend(b.as_ref(), &args, &plan, &held, &run)));
            }
            Err(e) => reports.push(BackendReport::empty(
                name.to_owned(),
                String::new(),
                vec![format!("skipped: {e}")],
            )),
        }
    }
    // Background releases of dropped clients finish or are abandoned here.
    runtime.shutdown_timeout(Duration::from_secs(2));

    let report = Report {
        meta: Meta {
            command: command_line(),
            profile: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            runtime: flavour,
            machine,
            quick: args.quick,
            started_unix: started
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            duration_s: t0.elapsed().as_secs_f64(),
            cycles: plan.cycles,
            warmup: plan.warmup,
        },
        backends: reports,
    };
    let md = report::markdown(&report);
    println!("{md}");
    let out = args.out.clone().unwrap_or_else(default_out);
    let written = std::fs::create_dir_all(&out)
        .and_then(|()| std::fs::write(out.join("results.md"), &md))
        .and_then(|()| {
            let json = report::json(&report).map_err(std::io::Error::other)?;
            std::fs::write(out.join("results.json"), json)
        })
        .and_then(|()| std::fs::write(out.join("results.svg"), report::svg(&report)));
    match written {
        Ok(()) => {
            progress(format!(
                "wrote results.md, results.json and results.svg to {}",
                out.display()
            ));
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cannot write the results to {}: {e}", out.display());
            std::process::ExitCode::FAILURE
        }
    }
}
