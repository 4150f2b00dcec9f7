//! `distlock`: run a command under a distributed lock, inspect a lock, force-release it, check
//! a coordinator. See `distlock --help` and the crate README.
#![forbid(unsafe_code)]

mod commands;
mod duration;
mod exit;
mod run;

use std::{ffi::OsString, process::ExitCode, time::Duration};

use clap::{Args, Parser, Subcommand};

use crate::duration::parse_duration;

/// Distributed locks with fencing tokens, from the shell.
#[derive(Debug, Parser)]
#[command(name = "distlock", version, after_long_help = exit::HELP, after_help = exit::HELP)]
struct Cli {
    /// Coordinator URL, e.g. redis://127.0.0.1:6379, etcd://127.0.0.1:2379, zk://127.0.0.1:2181,
    /// postgres://user@host/db; driver options in the query string.
    #[arg(long, env = "DISTLOCK_URL", global = true, hide_env_values = true)]
    url: Option<String>,

    /// Print a Prometheus text snapshot of distlock's metrics to stderr on exit.
    #[arg(long, global = true)]
    metrics: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a command while holding the lock (like flock(1), across machines).
    ///
    /// The command runs in its own process group with DISTLOCK_KEY and DISTLOCK_FENCING_TOKEN in
    /// its environment; pass the fencing token to the resource you protect. The lease is renewed
    /// while it runs. If the lease is lost, the process group gets SIGTERM, then SIGKILL after
    /// --kill-after, and distlock exits with 76. SIGINT and SIGTERM sent to distlock are
    /// forwarded to the command. The lock is released when the command exits, and distlock
    /// exits with the command's status. Commands that read from the terminal are not supported
    /// (the command is not the terminal's foreground process group).
    Run(RunArgs),
    /// Show who holds a lock: token digest, fencing token, remaining TTL.
    Inspect(InspectArgs),
    /// The runbook's manual delete: remove whoever holds the lock.
    Release(ReleaseArgs),
    /// Connect, print the backend's capabilities and run a quick acquire/renew/release self-test.
    Check(CheckArgs),
}

/// Arguments of `distlock run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The lock key.
    pub key: String,
    /// Lease TTL; the lease is renewed every third of it while the command runs.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub ttl: Duration,
    /// Wait up to this long for the lock (default: give up at once if it is held).
    #[arg(short, long, value_parser = parse_duration, value_name = "DURATION")]
    pub wait: Option<Duration>,
    /// After the lease is lost: how long after SIGTERM to send SIGKILL to the command's group.
    #[arg(long, default_value = "5s", value_parser = parse_duration, value_name = "DURATION")]
    pub kill_after: Duration,
    /// Exit status when the lock is not acquired (like flock -E).
    #[arg(short = 'E', long, default_value_t = exit::NOT_ACQUIRED, value_name = "CODE")]
    pub conflict_exit_code: u8,
    /// The command and its arguments, after `--`.
    #[arg(required = true, last = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Arguments of `distlock inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The lock key.
    pub key: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `distlock release`.
#[derive(Debug, Args)]
pub struct ReleaseArgs {
    /// The lock key.
    pub key: String,
    /// Required: this removes another process's lease (only its holder may release it normally).
    #[arg(long, required = true)]
    pub force: bool,
    /// Do not ask for confirmation.
    #[arg(short, long)]
    pub yes: bool,
}

/// Arguments of `distlock check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// TTL of the self-test's lease (default: 5s, or the backend's minimum if larger).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub ttl: Option<Duration>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Some(url) = cli.url.filter(|u| !u.trim().is_empty()) else {
        eprintln!("distlock: no coordinator URL: pass --url URL or set DISTLOCK_URL");
        return ExitCode::from(exit::USAGE);
    };
    let metrics = if cli.metrics {
        match metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder() {
            Ok(handle) => Some(handle),
            Err(e) => {
                eprintln!("distlock: cannot install the metrics recorder: {e}");
                return ExitCode::from(exit::UNAVAILABLE);
            }
        }
    } else {
        None
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("distlock: cannot start the async runtime: {e}");
            return ExitCode::from(exit::UNAVAILABLE);
        }
    };
    let code = runtime.block_on(async {
        let lock = match distlock::connect(&url).await {
            Ok(lock) => lock,
            Err(e) => {
                eprintln!("distlock: {e}");
                return exit::code_for(&e);
            }
        };
        let code = match cli.command {
            Command::Run(args) => run::run(lock.clone(), args).await,
            Command::Inspect(args) => commands::inspect(lock.clone(), args).await,
            Command::Release(args) => commands::release(lock.clone(), args).await,
            Command::Check(args) => commands::check(lock.clone(), args).await,
        };
        // Clean-ups the drivers started in the background (a waiter leaving its queue, a
        // guard's release) get done before the process goes; they need the client alive.
        distlock::cleanup::finish(Duration::from_secs(5)).await;
        drop(lock);
        code
    });
    // Do not wait for the drivers' background tasks (reconnects, keepalives) to wind down.
    runtime.shutdown_background();
    if let Some(metrics) = metrics {
        eprint!("{}", metrics.render());
    }
    ExitCode::from(code)
}
