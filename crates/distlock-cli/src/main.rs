//! `distlock`: run a command under a distributed lock or while leader of an election, inspect a
//! lock or an election's leader, force-release a lock, check a coordinator. See `distlock --help`
//! and the crate README.
#![forbid(unsafe_code)]

/// Like `eprintln!`, but never panics and never blocks: stderr may be a closed pipe, a
/// hung-up terminal (a job whose SSH session went) or a pipe nobody reads, and distlock must
/// go on supervising, releasing and, in the guard, signalling the command's group whatever
/// happens to its messages. The line is queued for a writer thread ([`diag`]).
macro_rules! say {
    ($($arg:tt)*) => {{
        $crate::diag::line(format!($($arg)*));
    }};
}

mod check;
mod clock;
mod commands;
mod conformance;
mod connect_error;
mod diag;
mod duration;
mod elect;
mod exit;
mod guard;
mod procfs;
mod run;

use std::{ffi::OsString, process::ExitCode, time::Duration};

use clap::{Args, Parser, Subcommand};

use crate::duration::parse_duration;

/// Distributed locks with fencing tokens, from the shell.
#[derive(Debug, Parser)]
#[command(name = "distlock", version, after_long_help = exit::HELP, after_help = exit::HELP)]
struct Cli {
    /// Coordinator URL, e.g. redis://127.0.0.1:6379, etcd://127.0.0.1:2379, zk://127.0.0.1:2181,
    /// postgres://user@host/db; driver options in the query string. Default: the URL file
    /// named by DISTLOCK_URL_FILE, else DISTLOCK_URL. A URL with a password shows in `ps`: use
    /// --url-file or DISTLOCK_URL for those.
    #[arg(long, global = true, conflicts_with = "url_file")]
    url: Option<String>,

    /// Read the coordinator URL from this file (its first line), which keeps a password out of
    /// `ps` and of the environment.
    #[arg(long, global = true, value_name = "PATH")]
    url_file: Option<std::path::PathBuf>,

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
    /// its environment (and without DISTLOCK_URL); pass the fencing token to the resource you
    /// protect. The lease is renewed while it runs. The command's process group never outlives
    /// the lease: if the lease is lost, cannot be renewed in time, or distlock is killed or
    /// frozen, a guard process sends the group SIGTERM and then SIGKILL, at the latest at the
    /// lease's local deadline (before the coordinator can grant the lock to anyone else); then
    /// distlock exits with 76. SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to distlock are forwarded
    /// to the group. On a terminal the command gets the terminal's foreground, so it can read
    /// from it. The lock is released when the command exits (with --wait-group: when its whole
    /// process group is gone), and distlock exits with the command's status.
    Run(RunArgs),
    /// Campaign in election NAME and run a command while leader.
    ///
    /// The election is the lock on the key election/NAME; its holder is the leader. The leader's
    /// value (--value, or the URL's `label=` option) is exactly what peers read — `etcdctl elect
    /// -l`, Go's Election.Observe, Curator's participant id — and what `distlock leader` shows
    /// first; our holder identity (host, pid, start time) is kept beside it, where peers need
    /// not parse it. Without a value, peers read that identity. The command runs with
    /// DISTLOCK_ELECTION=NAME and DISTLOCK_TERM=TERM in its environment (and without
    /// DISTLOCK_URL): TERM is the leadership's fencing token, greater than every earlier
    /// leader's; pass it to the resources the leader writes to, so that a deposed leader's late
    /// writes are refused. As with `run`, the command's process group never outlives the
    /// leadership: if it is lost, cannot be renewed in time, or distlock is killed or frozen, a
    /// guard process sends the group SIGTERM and then SIGKILL, at the latest at the lease's local
    /// deadline; then distlock exits with 76. When the command exits, distlock resigns (the next
    /// campaigner is elected promptly) and exits with the command's status. A backend without
    /// fencing tokens (no terms) is refused with 78.
    Elect(ElectArgs),
    /// Show the current leader of election NAME (term, holder identity, remaining TTL), or
    /// follow it with --watch. Exit 0 when someone leads, 1 when nobody does.
    Leader(LeaderArgs),
    /// Show who holds a lock: token digest, fencing token, remaining TTL.
    Inspect(InspectArgs),
    /// The runbook's manual delete: remove whoever holds the lock.
    Release(ReleaseArgs),
    /// Audit the coordinator: grade the settings the fence and the lease depend on PASS / WARN /
    /// FAIL (with what to change), print the backend's capabilities and run a quick
    /// acquire/renew/release self-test with its round trips. Exit 0 unless something FAILs
    /// (with --strict: or WARNs) or the self-test fails.
    Check(CheckArgs),
    /// Run the conformance properties that need no server control against the coordinator of
    /// --url, on fresh keys under a namespace of this run's own (removed, and checked empty,
    /// afterwards): a progress line per property, a summary, optionally JUnit XML. Fault drills
    /// (kill, restart, partitions) need control of the servers and are refused.
    ///
    /// The audit of `distlock check` runs first: a setting it grades FAIL refuses the run with
    /// 1 unless --accept-audit-failures is given. A coordinator that becomes unreachable
    /// during the run ends it with 69, naming the property it was running, instead of counting
    /// the outage as property failures.
    Conformance(ConformanceArgs),
    /// Internal: the guard process of `run`.
    #[command(name = "__guard", hide = true)]
    Guard(guard::GuardArgs),
}

/// Arguments of `distlock run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The lock key.
    pub key: String,
    /// Lease TTL; the lease is renewed every quarter of it while the command runs.
    #[arg(long, default_value = "30s", value_parser = parse_duration, allow_hyphen_values = true)]
    pub ttl: Duration,
    /// Wait up to this long for the lock (default: give up at once if it is held).
    #[arg(short, long, visible_alias = "timeout", value_parser = parse_duration, allow_hyphen_values = true, value_name = "DURATION")]
    pub wait: Option<Duration>,
    /// How long before SIGKILL the command's group gets SIGTERM when the lease is lost or about
    /// to run out (default: 5s or a quarter of --ttl, whichever is less; at most a third of
    /// --ttl, so that SIGKILL lands before the lease's local deadline).
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, value_name = "DURATION")]
    pub kill_after: Option<Duration>,
    /// Keep the lock until every process of the command's group has exited, not only the
    /// command itself (for commands that leave background processes working).
    #[arg(long)]
    pub wait_group: bool,
    /// Job mode, for cron lines: keep the lock until at least this long after it was granted,
    /// even if the command ends sooner or distlock dies right after — another instance whose
    /// timer fires a little later in the same period then skips (ShedLock's lockAtLeastFor).
    /// Kept by the coordinator's own expiry on every backend (etcd: the entry moves onto a
    /// lease of its own for what is left; ZooKeeper: a keep marker acquirers wait out), so the
    /// key is free again at max(at-least, the command's end); a backend that could not keep a
    /// lease alone would be refused before anything runs. memory:// keeps it in this process.
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, value_name = "DURATION")]
    pub at_least: Option<Duration>,
    /// Job mode: never hold the lock longer than this after it was granted; the command is then
    /// terminated as on a lost lease (SIGTERM, SIGKILL after --kill-after; exit 76).
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, value_name = "DURATION")]
    pub at_most: Option<Duration>,
    /// Exit status when the lock is not acquired (like flock -E).
    #[arg(short = 'E', long, default_value_t = exit::NOT_ACQUIRED, value_name = "CODE")]
    pub conflict_exit_code: u8,
    /// Say nothing when the lock is not acquired (only the exit status tells), e.g. for cron.
    #[arg(short, long, conflicts_with = "verbose")]
    pub quiet: bool,
    /// Also say when the lock is acquired (with its fencing token) and released.
    #[arg(short, long)]
    pub verbose: bool,
    /// Report what happens as JSON lines on stderr (acquired, not_acquired, lost, exit).
    #[arg(long)]
    pub json: bool,
    /// A label recorded with the grant next to this host, pid and start time, which `distlock
    /// inspect` shows as the holder (1-64 ASCII letters, digits and -_.:/@; not a secret).
    #[arg(long, value_name = "LABEL")]
    pub label: Option<String>,
    /// Run this shell command (`sh -c`), like flock -c, instead of a command after `--`.
    #[arg(
        short = 'c',
        long = "command",
        value_name = "SHELL_COMMAND",
        conflicts_with = "command"
    )]
    pub shell_command: Option<OsString>,
    /// The command and its arguments, after `--`.
    #[arg(
        required_unless_present = "shell_command",
        last = true,
        value_name = "COMMAND"
    )]
    pub command: Vec<OsString>,
}

impl RunArgs {
    /// The program and its arguments to run.
    pub fn program(&self) -> Vec<OsString> {
        match &self.shell_command {
            Some(line) => vec!["sh".into(), "-c".into(), line.clone()],
            None => self.command.clone(),
        }
    }
}

/// Arguments of `distlock elect`.
#[derive(Debug, Args)]
pub struct ElectArgs {
    /// The election's name (its lock key is election/NAME).
    pub name: String,
    /// Lease TTL of the leadership, renewed every quarter of it while the command runs; a leader
    /// that dies is replaced after about this long (default: 10s).
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, value_name = "DURATION")]
    pub ttl: Option<Duration>,
    /// Wait up to this long to become leader (default: until elected); then exit with 75.
    #[arg(short, long, value_parser = parse_duration, allow_hyphen_values = true, value_name = "DURATION")]
    pub wait: Option<Duration>,
    /// How long before SIGKILL the command's group gets SIGTERM when leadership is lost or about
    /// to run out (as for `run`: default 5s or a quarter of --ttl, at most a third of --ttl).
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, value_name = "DURATION")]
    pub kill_after: Option<Duration>,
    /// Stay leader until every process of the command's group has exited, not only the command.
    #[arg(long)]
    pub wait_group: bool,
    /// Say nothing when not elected within --wait (only the exit status tells).
    #[arg(short, long, conflicts_with = "verbose")]
    pub quiet: bool,
    /// Also say when elected (with the term) and when resigned.
    #[arg(short, long)]
    pub verbose: bool,
    /// Report what happens as JSON lines on stderr (elected, not_elected, lost, exit).
    #[arg(long)]
    pub json: bool,
    /// The leader's value, exactly the bytes peers read (`etcdctl elect -l`, Curator's
    /// participant id) and what `leader` shows first (as the URL's `label=` option; 1-64 ASCII
    /// letters, digits and -_.:/@; not a secret). `--label` is the same option.
    #[arg(long, visible_alias = "value", value_name = "LABEL")]
    pub label: Option<String>,
    /// The command and its arguments, after `--`.
    #[arg(required = true, last = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

impl ElectArgs {
    /// The leadership's TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl.unwrap_or(distlock::Election::DEFAULT_TTL)
    }
}

/// Arguments of `distlock leader`.
#[derive(Debug, Args)]
pub struct LeaderArgs {
    /// The election's name.
    pub name: String,
    /// Follow the leader: a line now, then one each time a new term begins, the leader
    /// proclaims a new value, or nobody leads any more, until interrupted.
    #[arg(long)]
    pub watch: bool,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
    /// With --watch: how often to ask the coordinator. etcd and ZooKeeper also push changes (this
    /// is then a safety net); elsewhere a leadership that begins and ends between two looks is
    /// not seen.
    #[arg(long, default_value = "1s", value_parser = parse_duration, allow_hyphen_values = true, value_name = "DURATION", requires = "watch")]
    pub every: Duration,
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
    /// The coordinator URL (instead of --url / --url-file / DISTLOCK_URL; `check --url URL`
    /// works as for every other command).
    #[arg(value_name = "URL", conflicts_with_all = ["url", "url_file"])]
    pub target: Option<String>,
    /// Print one JSON object (findings, self-test steps) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Fail (exit 1) on any WARN too, e.g. in CI.
    #[arg(long)]
    pub strict: bool,
    /// TTL of the self-test's lease (default: 5s, or the backend's minimum if larger).
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, value_name = "DURATION")]
    pub ttl: Option<Duration>,
}

/// Arguments of `distlock conformance`.
#[derive(Debug, Args)]
pub struct ConformanceArgs {
    /// Write the results as JUnit XML to this file (for CI systems).
    #[arg(long, value_name = "FILE")]
    pub junit: Option<std::path::PathBuf>,
    /// Run only the properties whose name contains this text (repeatable).
    #[arg(long, value_name = "TEXT")]
    pub only: Vec<String>,
    /// List the properties (after --only) instead of running them.
    #[arg(long)]
    pub list: bool,
    /// The TTL of the properties that wait for an expiry (default: 500ms, or the backend's
    /// minimum if larger); raise it for a coordinator far away or under load.
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, value_name = "DURATION")]
    pub short_ttl: Option<Duration>,
    /// Refused: fault drills need control of the servers (kill, restart, partition).
    #[arg(long)]
    pub drills: bool,
    /// Run the suite even though the audit (`distlock check`) grades a setting FAIL; without
    /// it, a deployment that FAILs the audit is refused with 1 before any property runs (the
    /// properties passing there would not make it safe).
    #[arg(long)]
    pub accept_audit_failures: bool,
}

/// The coordinator URL: --url, --url-file, the file named by DISTLOCK_URL_FILE, DISTLOCK_URL,
/// in that order (a flag given on the command line wins over the environment).
fn coordinator_url(cli: &Cli) -> Result<String, u8> {
    if let Command::Check(CheckArgs {
        target: Some(url), ..
    }) = &cli.command
    {
        return non_empty(url.trim()).ok_or_else(no_url);
    }
    if let Some(url) = &cli.url {
        return non_empty(url.trim()).ok_or_else(no_url);
    }
    let file = cli
        .url_file
        .clone()
        .or_else(|| std::env::var_os("DISTLOCK_URL_FILE").map(Into::into))
        .filter(|path: &std::path::PathBuf| !path.as_os_str().is_empty());
    if let Some(path) = file {
        let text = std::fs::read_to_string(&path).map_err(|e| {
            say!("distlock: cannot read the URL file {}: {e}", path.display());
            exit::CONFIG
        })?;
        let first = text.lines().next().unwrap_or_default().trim();
        return non_empty(first).ok_or_else(|| {
            if text.trim().is_empty() {
                say!("distlock: the URL file {} is empty", path.display());
            } else {
                let at = text.lines().position(|l| !l.trim().is_empty()).unwrap_or(0) + 1;
                say!(
                    "distlock: the URL file {}: line 1 is blank (the URL found on line {at} must be on line 1)",
                    path.display()
                );
            }
            exit::CONFIG
        });
    }
    std::env::var("DISTLOCK_URL")
        .ok()
        .and_then(|url| non_empty(url.trim()))
        .ok_or_else(no_url)
}

fn non_empty(text: &str) -> Option<String> {
    (!text.is_empty()).then(|| text.to_owned())
}

fn no_url() -> u8 {
    say!(
        "distlock: no coordinator URL: pass --url URL or --url-file PATH, or set DISTLOCK_URL_FILE or DISTLOCK_URL"
    );
    exit::USAGE
}

/// The arguments' checks that need no coordinator.
fn check_before_io(command: &Command) -> Result<(), String> {
    let ttl = match command {
        Command::Run(args) => {
            run::Timing::new(args.kill_after, args.ttl, args.ttl)?;
            if let Some(label) = &args.label {
                distlock::HolderIdentity::check_label(label).map_err(|e| e.to_string())?;
            }
            Some(args.ttl)
        }
        Command::Elect(args) => {
            elect::check_name(&args.name)?;
            run::Timing::new(args.kill_after, args.ttl(), args.ttl())?;
            if let Some(label) = &args.label {
                distlock::HolderIdentity::check_label(label).map_err(|e| e.to_string())?;
            }
            Some(args.ttl())
        }
        Command::Leader(args) => {
            elect::check_name(&args.name)?;
            if args.every.is_zero() {
                return Err("invalid --every 0ms: it must be positive".to_owned());
            }
            None
        }
        Command::Check(args) => args.ttl,
        _ => None,
    };
    match ttl {
        Some(ttl) if ttl < MIN_TTL => Err(format!(
            "invalid ttl {}: distlock needs at least {} (a shorter lease is lost before it can be renewed)",
            duration::format_duration(ttl),
            duration::format_duration(MIN_TTL)
        )),
        _ => Ok(()),
    }
}

/// The shortest `--ttl` distlock accepts, whatever the backend's minimum.
const MIN_TTL: Duration = Duration::from_secs(1);

/// Parses the command line; on a mistake, clap's message (and a hint for a `run` whose command
/// was not put after `--`).
fn parse() -> Result<Cli, ExitCode> {
    Cli::try_parse().map_err(|e| {
        let _ = e.print();
        let args: Vec<OsString> = std::env::args_os().collect();
        let is_run = args.iter().any(|a| a == "run" || a == "elect");
        let has_separator = args.iter().any(|a| a == "--");
        if e.kind() == clap::error::ErrorKind::UnknownArgument && is_run && !has_separator {
            say!(
                "hint: the command goes after `--`: distlock run KEY [OPTIONS] -- COMMAND [ARGS..] \
                 (or distlock elect NAME [OPTIONS] -- COMMAND [ARGS..])"
            );
        }
        ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(exit::USAGE))
    })
}

fn main() -> ExitCode {
    // The command's wrapper (`run`): it registers with the guard and becomes the command.
    let argv: Vec<OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == guard::EXEC) {
        let code = guard::exec_main(&argv[2..]);
        diag::flush(diag::AT_EXIT);
        return ExitCode::from(code);
    }
    let code = distlock_main();
    // What is still queued for stderr, unless nobody reads it.
    diag::flush(diag::AT_EXIT);
    code
}

fn distlock_main() -> ExitCode {
    let cli = match parse() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    if let Command::Guard(args) = &cli.command {
        return ExitCode::from(guard::main(args));
    }
    // Checked before any I/O.
    if let Err(message) = check_before_io(&cli.command) {
        say!("distlock: {message}");
        return ExitCode::from(exit::USAGE);
    }
    // `run --wait W` gives up within W plus a little, also while the coordinator does not
    // answer (connecting included).
    let started = tokio::time::Instant::now();
    let wait_deadline = match &cli.command {
        Command::Run(RunArgs {
            wait: Some(wait), ..
        })
        | Command::Elect(ElectArgs {
            wait: Some(wait), ..
        }) => started.checked_add(*wait + run::WAIT_SLACK),
        _ => None,
    };
    let url = match coordinator_url(&cli) {
        Ok(url) => match &cli.command {
            // The label travels as the drivers' `label` URL option (checked above: its
            // characters need no escaping in a query).
            Command::Run(RunArgs {
                label: Some(label), ..
            })
            | Command::Elect(ElectArgs {
                label: Some(label), ..
            }) => {
                let separator = if url.contains('?') { '&' } else { '?' };
                format!("{url}{separator}label={label}")
            }
            _ => url,
        },
        Err(code) => return ExitCode::from(code),
    };
    // `run` hands the terminal to the command and takes it back from the background afterwards,
    // and may write to the terminal meanwhile: both need SIGTTOU blocked (the runtime's threads
    // inherit the mask; the command gets a clean one from the spawn).
    let mut ttou = nix::sys::signal::SigSet::empty();
    ttou.add(nix::sys::signal::Signal::SIGTTOU);
    if let Err(e) = ttou.thread_block() {
        say!("distlock: cannot block SIGTTOU: {e}");
        return ExitCode::from(exit::INTERNAL);
    }
    let metrics = if cli.metrics {
        match metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder() {
            Ok(handle) => Some(handle),
            Err(e) => {
                say!("distlock: cannot install the metrics recorder: {e}");
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
            say!("distlock: cannot start the async runtime: {e}");
            return ExitCode::from(exit::UNAVAILABLE);
        }
    };
    let code = runtime.block_on(async {
        let connecting = distlock::connect(&url);
        let connected = match wait_deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, connecting).await,
            None => Ok(connecting.await),
        };
        let lock = match connected {
            Ok(Ok(lock)) => lock,
            Ok(Err(e)) => {
                let why = connect_error::describe(&url, &e).await;
                say!("distlock: {why}");
                if let Command::Check(args) = &cli.command {
                    // The audit may say why (a setting the driver refuses).
                    return check::check_unconnected(&url, args, &why, exit::connect_code(&e))
                        .await;
                }
                return exit::connect_code(&e);
            }
            Err(_elapsed) => {
                say!("distlock: the coordinator did not answer within the wait (connecting to it)");
                return exit::UNAVAILABLE;
            }
        };
        let code = match cli.command {
            Command::Run(args) => run::run(lock.clone(), args, wait_deadline).await,
            Command::Elect(args) => elect::elect(lock.clone(), args, wait_deadline).await,
            Command::Leader(args) => elect::leader(lock.clone(), args).await,
            Command::Inspect(args) => commands::inspect(lock.clone(), args).await,
            Command::Release(args) => commands::release(lock.clone(), args).await,
            Command::Check(args) => check::check(lock.clone(), &url, &args).await,
            Command::Conformance(args) => conformance::conformance(&url, &args).await,
            Command::Guard(_) => exit::USAGE,
        };
        // Clean-ups the drivers started in the background (a waiter leaving its queue, a
        // guard's release) get done before the process goes; they need the client alive. Not
        // for long when the coordinator is unavailable (they would most likely time out), and
        // a signal ends the wait at once.
        let budget = match code {
            exit::UNAVAILABLE => Duration::from_secs(1),
            // The command is dead and the lease gone: exit within --kill-after + 1 s of the
            // command's death, whatever the coordinator does (frozen, unreachable).
            exit::LOST | exit::LOST_UNTERMINATED | exit::INTERNAL => run::AFTER_LOSS,
            _ => Duration::from_secs(5),
        };
        let code = match run::Signals::new() {
            Ok(mut signals) => tokio::select! {
                _ = distlock::finish_background_releases(budget) => code,
                signal = signals.recv() => exit::signalled(signal as i32),
            },
            Err(_) => {
                distlock::finish_background_releases(budget).await;
                code
            }
        };
        drop(lock);
        code
    });
    // Do not wait for the drivers' background tasks (reconnects, keepalives) to wind down.
    runtime.shutdown_background();
    if let Some(metrics) = metrics {
        diag::write(metrics.render());
    }
    ExitCode::from(code)
}
