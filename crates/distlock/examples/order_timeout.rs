//! The article's scenario: an order service runs on three instances, and every instance tries,
//! on every tick, to close the orders whose payment window has timed out — under one lock, with
//! `run_exclusive`. The order store is the protected resource: it accepts a close only from
//! status `pending` and only with a fencing token newer than any it has seen for that order,
//! in one atomic step, like
//!
//! ```sql
//! UPDATE orders SET status = 'closed', last_fencing_token = $token
//!  WHERE id = $id AND status = 'pending' AND last_fencing_token < $token;
//! ```
//!
//! In the middle of its first job one instance is frozen (a stop-the-world pause: a long GC, a
//! frozen VM): its thread blocks, so its whole runtime — the lock's watchdog included — stops.
//! Its lease expires, another instance takes the lock with a newer fencing token and closes the
//! orders; the frozen instance then wakes up and, before it can notice anything, sends the write
//! it was about to send. The store rejects that stale write. The run ends with a check that every
//! order was closed exactly once (exit status 1 if not).
//!
//! ```sh
//! cargo run -p distlock --example order_timeout                   # in-memory coordinator
//! cargo run -p distlock --features redis --example order_timeout -- --url redis://127.0.0.1:6379
//! ```
//!
//! Each instance runs on its own thread with its own single-threaded tokio runtime and its own
//! client (`distlock::connect(url)`), as separate processes would.
//!
//! # `--periodic`: the scan once per period
//!
//! The article's other half: the three instances each fire the scan from their own timer every
//! period, and the timers are skewed (0, 0.3 and 0.6 periods late, a different instance first
//! each period: clock skew, jitter, a late cron). With skip-if-held alone, the first instance's 100 ms scan is over — and the lock
//! released — before the others' timers fire, so the scan runs three times per period. With
//! job mode (`LockOptions::at_least(0.8 × period)`, ShedLock's `lockAtLeastFor`) the lease is
//! kept until 0.8 periods after the scan started, on the coordinator, even though the job has
//! ended, so the late timers find the lock held: one run per period. The run table accepts a
//! run only with a fencing token newer than the last one it saw, like the order store.
//!
//! ```sh
//! cargo run -p distlock --example order_timeout -- --periodic                # at_least on
//! cargo run -p distlock --example order_timeout -- --periodic --no-at-least  # the duplicates
//! ```
//!
//! Every backend keeps the lock until `at_least` (`Capabilities::keep_until`); ZooKeeper through
//! a keep marker beside the lock (see the lock-zk README).

use std::{
    collections::hash_map::RandomState,
    fmt,
    hash::BuildHasher,
    process::ExitCode,
    sync::{
        Arc, Condvar, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use distlock::{DistributedLockExt, Error, FencingToken, JobContext, LockOptions};

const INSTANCES: [&str; 3] = ["instance-a", "instance-b", "instance-c"];
/// Orders #1..=#4 have timed out when the service starts; #5, #6, #7 time out ½, 1 and 1½ TTLs later.
const ORDERS: u32 = 7;
const DUE_AT_START: u32 = 4;

fn main() -> ExitCode {
    let (url, metrics, periodic) = match parse_args() {
        Ok(Some(args)) => args,
        Ok(None) => return ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("order_timeout: {message}");
            return ExitCode::from(2);
        }
    };
    let metrics = match metrics
        .then(|| metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder())
        .transpose()
    {
        Ok(handle) => handle,
        Err(e) => {
            eprintln!("order_timeout: cannot install the metrics recorder: {e}");
            return ExitCode::from(2);
        }
    };
    let code = match periodic {
        Some(at_least) => match run_periodic(&url, Periodic::demo(at_least), Output::Print) {
            Ok(report) if !at_least || report.once_per_period() => ExitCode::SUCCESS,
            Ok(_) => ExitCode::FAILURE,
            Err(message) => {
                eprintln!("order_timeout: {message}");
                ExitCode::from(2)
            }
        },
        None => match run(&url, Output::Print) {
            Ok(report) if report.every_order_closed_once() => ExitCode::SUCCESS,
            Ok(_) => ExitCode::FAILURE,
            Err(message) => {
                eprintln!("order_timeout: {message}");
                ExitCode::from(2)
            }
        },
    };
    if let Some(metrics) = metrics {
        println!(
            "\n# distlock metrics (Prometheus text format)\n{}",
            metrics.render()
        );
    }
    code
}

/// The URL, `--metrics`, and `Some(at_least)` for `--periodic`.
type Args = (String, bool, Option<bool>);

fn parse_args() -> Result<Option<Args>, String> {
    let mut url = std::env::var("DISTLOCK_URL").ok();
    let mut metrics = false;
    let (mut periodic, mut at_least) = (false, true);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => {
                println!(
                    "usage: order_timeout [--url URL] [--metrics] [--periodic [--no-at-least]]\n\n\
                     Runs the order-timeout scenario against the coordinator at URL\n\
                     (default: $DISTLOCK_URL, else memory://order-timeout);\n\
                     --metrics prints distlock's metrics (Prometheus text) at the end;\n\
                     --periodic runs the scan once per period from three skewed timers\n\
                     (with job mode's at_least; --no-at-least shows the duplicates)."
                );
                return Ok(None);
            }
            "--url" => url = Some(args.next().ok_or("--url needs a value")?),
            "--metrics" => metrics = true,
            "--periodic" => periodic = true,
            "--no-at-least" => at_least = false,
            other => match other.strip_prefix("--url=") {
                Some(value) => url = Some(value.to_owned()),
                None => return Err(format!("unexpected argument `{other}` (try --help)")),
            },
        }
    }
    if !at_least && !periodic {
        return Err("--no-at-least goes with --periodic (try --help)".to_owned());
    }
    Ok(Some((
        url.unwrap_or_else(|| "memory://order-timeout".to_owned()),
        metrics,
        periodic.then_some(at_least),
    )))
}

/// Where the timeline goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Print it as it happens.
    Print,
    /// Keep it in the report only.
    Quiet,
}

/// What a run did.
#[derive(Debug)]
pub struct Report {
    /// How many closes the store accepted, per order (index 0 is order #1).
    pub closes: Vec<u32>,
    /// Writes the store rejected because their fencing token was stale.
    pub stale_rejected: u64,
    /// Distinct fencing tokens that closed at least one order, in the order they did.
    pub tokens_that_wrote: Vec<u64>,
    /// The timeline, one line per event.
    pub timeline: Vec<String>,
}

impl Report {
    /// The final check: every order was closed, and none twice.
    pub fn every_order_closed_once(&self) -> bool {
        self.closes.len() == ORDERS as usize && self.closes.iter().all(|&n| n == 1)
    }
}

// ---------------------------------------------------------------------------------------------
// The protected resource: the order table.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Pending,
    Closed,
}

#[derive(Debug)]
struct Order {
    id: u32,
    due_at: Instant,
    status: Status,
    last_fencing_token: u64,
    closes: u32,
}

#[derive(Debug)]
enum Refused {
    /// `last_fencing_token >= $token`: a newer holder has already written this order.
    StaleToken { seen: u64 },
    /// `status <> 'pending'`.
    NotPending,
}

#[derive(Debug, Default)]
struct OrderStore {
    orders: Mutex<Vec<Order>>,
    changed: Condvar,
    stale_rejected: AtomicU64,
    tokens_that_wrote: Mutex<Vec<u64>>,
}

impl OrderStore {
    fn new(start: Instant, ttl: Duration) -> Self {
        let orders = (1..=ORDERS)
            .map(|id| Order {
                id,
                due_at: start + ttl * id.saturating_sub(DUE_AT_START) / 2,
                status: Status::Pending,
                last_fencing_token: 0,
                closes: 0,
            })
            .collect();
        Self {
            orders: Mutex::new(orders),
            ..Self::default()
        }
    }

    fn orders(&self) -> MutexGuard<'_, Vec<Order>> {
        self.orders.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `SELECT id FROM orders WHERE status = 'pending' AND due_at <= now() ORDER BY id`
    fn timed_out_pending(&self) -> Vec<u32> {
        let now = Instant::now();
        self.orders()
            .iter()
            .filter(|o| o.status == Status::Pending && o.due_at <= now)
            .map(|o| o.id)
            .collect()
    }

    /// The conditional update, one atomic step of the resource.
    fn close(&self, id: u32, token: FencingToken) -> Result<(), Refused> {
        let mut orders = self.orders();
        let Some(order) = orders.iter_mut().find(|o| o.id == id) else {
            return Err(Refused::NotPending);
        };
        if order.last_fencing_token >= token.get() {
            self.stale_rejected.fetch_add(1, Ordering::SeqCst);
            distlock::record_fencing_rejection("order_store");
            return Err(Refused::StaleToken {
                seen: order.last_fencing_token,
            });
        }
        if order.status != Status::Pending {
            return Err(Refused::NotPending);
        }
        order.status = Status::Closed;
        order.last_fencing_token = token.get();
        order.closes += 1;
        drop(orders);
        let mut tokens = self
            .tokens_that_wrote
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if tokens.last() != Some(&token.get()) {
            tokens.push(token.get());
        }
        self.changed.notify_all();
        Ok(())
    }

    fn all_closed(&self) -> bool {
        self.orders().iter().all(|o| o.status == Status::Closed)
    }

    /// Blocks the calling thread for at least `min` and until every order in `ids` has been
    /// closed with a token newer than `token` (at most `max`): the frozen instance's pause.
    fn freeze_until_taken_over(
        &self,
        ids: &[u32],
        token: FencingToken,
        min: Duration,
        max: Duration,
    ) {
        let started = Instant::now();
        let mut orders = self.orders();
        loop {
            let elapsed = started.elapsed();
            let taken_over = ids.iter().all(|id| {
                orders
                    .iter()
                    .any(|o| o.id == *id && o.last_fencing_token > token.get())
            });
            if elapsed >= max || (elapsed >= min && taken_over) {
                return;
            }
            let wait = if elapsed < min {
                min - elapsed
            } else {
                max - elapsed
            };
            orders = self
                .changed
                .wait_timeout(orders, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The timeline.

#[derive(Debug)]
struct Timeline {
    start: Instant,
    output: Output,
    lines: Mutex<Vec<String>>,
}

impl Timeline {
    fn log(&self, who: &str, what: impl fmt::Display) {
        let line = format!(
            "{:>6.2}s  {who:<10}  {what}",
            self.start.elapsed().as_secs_f64()
        );
        if self.output == Output::Print {
            println!("{line}");
        }
        self.lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(line);
    }
}

// ---------------------------------------------------------------------------------------------
// The service.

#[derive(Debug)]
struct Service {
    url: String,
    key: String,
    ttl: Duration,
    store: OrderStore,
    timeline: Timeline,
    /// The next job with at least two orders in hand freezes after its first write.
    freeze_armed: AtomicBool,
    freeze_done: AtomicBool,
    stop: AtomicBool,
}

/// The job every instance runs under the lock: close the timed-out orders, presenting the
/// fencing token with every write.
async fn close_timed_out_orders(ctx: JobContext, service: Arc<Service>, me: &'static str) {
    let Some(token) = ctx.fencing_token() else {
        service.timeline.log(
            me,
            "this coordinator mints no fencing tokens: refusing to write",
        );
        return;
    };
    let due = service.store.timed_out_pending();
    if due.is_empty() {
        return;
    }
    let list: Vec<String> = due.iter().map(|id| format!("#{id}")).collect();
    service.timeline.log(
        me,
        format_args!(
            "holds the lock, fencing token {token}; timed-out orders: {}",
            list.join(" ")
        ),
    );
    for (i, &id) in due.iter().enumerate() {
        if ctx.is_lost() {
            service
                .timeline
                .log(me, "notices it lost the lock and stops");
            return;
        }
        if i == 1 && service.freeze_armed.swap(false, Ordering::SeqCst) {
            freeze(&service, me, &due[1..], token);
        }
        match service.store.close(id, token) {
            Ok(()) => service
                .timeline
                .log(me, format_args!("closed order #{id} (token {token})  accepted")),
            Err(Refused::StaleToken { seen }) => service.timeline.log(
                me,
                format_args!(
                    "close order #{id} with token {token}  REJECTED: stale, the store has seen token {seen}"
                ),
            ),
            Err(Refused::NotPending) => service
                .timeline
                .log(me, format_args!("order #{id} is no longer pending; skipped")),
        }
        // The next order: a round trip to the database in real life.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A stop-the-world pause of this instance: the thread — and with it this instance's runtime,
/// its lock client and the lease's watchdog — stops running. Nothing can renew the lease or
/// tell the job it was lost; the job resumes exactly where it was.
fn freeze(service: &Service, me: &str, in_hand: &[u32], token: FencingToken) {
    let min = service.ttl * 3 / 2;
    service.timeline.log(
        me,
        format_args!(
            "FREEZES (stop-the-world pause, e.g. a long GC) for over {:.1}s, longer than its {:.1}s lease",
            min.as_secs_f64(),
            service.ttl.as_secs_f64()
        ),
    );
    let started = Instant::now();
    // Long enough for the lease to expire and another instance to take over; bounded so a
    // coordinator that never expires the lease cannot hang the demo.
    service
        .store
        .freeze_until_taken_over(in_hand, token, min, min + Duration::from_secs(30));
    service.timeline.log(
        me,
        format_args!(
            "wakes up after {:.1}s, still believing it holds token {token}",
            started.elapsed().as_secs_f64()
        ),
    );
    service.freeze_done.store(true, Ordering::SeqCst);
}

async fn instance(service: Arc<Service>, me: &'static str) -> Result<(), String> {
    let lock = distlock::connect(&service.url)
        .await
        .map_err(|e| format!("{me}: {e}"))?;
    let opts = LockOptions::with_ttl(service.ttl);
    let mut tick = tokio::time::interval(service.ttl / 4);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !service.stop.load(Ordering::SeqCst) {
        tick.tick().await;
        let svc = service.clone();
        let outcome = lock
            .run_exclusive(service.key.as_str(), opts, move |ctx| {
                close_timed_out_orders(ctx, svc, me)
            })
            .await;
        match outcome {
            Ok(Some(())) => {}
            Ok(None) => {} // another instance holds the lock this tick
            Err(Error::NotHeld { .. }) => service
                .timeline
                .log(me, "lost the lock: its job was cancelled"),
            Err(e) if e.is_temporary() => service.timeline.log(
                me,
                format_args!("coordinator trouble ({e}); retrying next tick"),
            ),
            Err(e) => return Err(format!("{me}: {e}")),
        }
    }
    Ok(())
}

/// Runs the scenario against the coordinator at `url` and returns what happened.
///
/// # Errors
/// A message when the URL is invalid, the coordinator cannot be reached, or the run did not
/// finish in time.
pub fn run(url: &str, output: Output) -> Result<Report, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let probe = runtime
        .block_on(distlock::connect(url))
        .map_err(|e| e.to_string())?;
    let caps = probe.capabilities();
    let ttl = caps.effective_ttl(Duration::from_secs(1).max(caps.min_ttl));
    drop(probe);
    drop(runtime);

    let key = format!(
        "order-timeout/{:08x}",
        RandomState::new().hash_one(std::process::id()) & 0xffff_ffff
    );
    let start = Instant::now();
    let service = Arc::new(Service {
        url: url.to_owned(),
        key,
        ttl,
        store: OrderStore::new(start, ttl),
        timeline: Timeline {
            start,
            output,
            lines: Mutex::default(),
        },
        freeze_armed: AtomicBool::new(true),
        freeze_done: AtomicBool::new(false),
        stop: AtomicBool::new(false),
    });
    if output == Output::Print {
        println!(
            "{} instances close timed-out orders under lock {:?} on {} (lease {:.1}s, tick {:.2}s)\n",
            INSTANCES.len(),
            service.key,
            caps_name(url),
            ttl.as_secs_f64(),
            (ttl / 4).as_secs_f64()
        );
        println!(
            "the order store closes an order only if it is pending and the write's fencing token is\n\
             newer than the order's last_fencing_token (one atomic conditional update)\n"
        );
    }

    let threads: Vec<_> = INSTANCES
        .into_iter()
        .map(|me| {
            let service = service.clone();
            std::thread::spawn(move || -> Result<(), String> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                runtime.block_on(instance(service, me))
            })
        })
        .collect();

    // Let the instances run until every order is closed and the frozen one has woken up.
    let limit = ttl * (ORDERS + 4) + Duration::from_secs(60);
    let mut finished = false;
    while start.elapsed() < limit && !threads.iter().any(|t| t.is_finished()) {
        if service.store.all_closed() && service.freeze_done.load(Ordering::SeqCst) {
            finished = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if finished {
        // One more tick so the woken instance can notice its loss.
        std::thread::sleep(ttl / 2);
    }
    service.stop.store(true, Ordering::SeqCst);
    join_instances(threads)?;
    if !finished {
        return Err(format!(
            "the orders were not all closed within {:.0}s",
            limit.as_secs_f64()
        ));
    }
    Ok(report(&service))
}

/// Waits for every instance's thread; their errors (and panics) joined into one message.
fn join_instances(threads: Vec<std::thread::JoinHandle<Result<(), String>>>) -> Result<(), String> {
    let mut errors = Vec::new();
    for thread in threads {
        match thread.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push("an instance panicked".to_owned()),
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

fn caps_name(url: &str) -> String {
    match distlock::Backend::for_url(url) {
        Ok(backend) => backend.to_string(),
        Err(_) => "?".to_owned(),
    }
}

fn report(service: &Service) -> Report {
    let closes: Vec<u32> = service.store.orders().iter().map(|o| o.closes).collect();
    let report = Report {
        stale_rejected: service.store.stale_rejected.load(Ordering::SeqCst),
        tokens_that_wrote: service
            .store
            .tokens_that_wrote
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone(),
        timeline: service
            .timeline
            .lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone(),
        closes,
    };
    if service.timeline.output == Output::Print {
        println!();
        let tokens: Vec<String> = report
            .tokens_that_wrote
            .iter()
            .map(u64::to_string)
            .collect();
        println!(
            "fencing tokens that wrote, in order: {}; stale writes rejected: {}",
            tokens.join(", "),
            report.stale_rejected
        );
        if report.stale_rejected == 0 {
            println!(
                "(no stale write happened this run: the frozen instance found nothing left to write)"
            );
        }
        if report.every_order_closed_once() {
            println!("check: OK, all {ORDERS} orders were closed exactly once");
        } else {
            let counts: Vec<String> = report
                .closes
                .iter()
                .enumerate()
                .map(|(i, n)| format!("#{}: {n}", i + 1))
                .collect();
            println!("check: FAILED, closes per order: {}", counts.join(", "));
        }
    }
    report
}

// ---------------------------------------------------------------------------------------------
// `--periodic`: the scan once per period from three skewed timers.

/// How a periodic run is set up.
#[derive(Clone, Copy, Debug)]
pub struct Periodic {
    /// The timers' period.
    pub period: Duration,
    /// How many periods to run.
    pub periods: u32,
    /// Whether the scan runs with job mode's `at_least(0.8 × period)`.
    pub at_least: bool,
}

impl Periodic {
    /// What `--periodic` runs: a 2 s period, 5 periods.
    pub fn demo(at_least: bool) -> Self {
        Self {
            period: Duration::from_secs(2),
            periods: 5,
            at_least,
        }
    }

    /// How late an instance's timer fires in a period: 0, 0.3 or 0.6 periods, rotating, so
    /// that each instance is the earliest in some periods.
    fn skew(self, instance: usize, period: u32) -> Duration {
        let slot = (u32::try_from(instance).unwrap_or(0) + period) % 3;
        self.period * 3 * slot / 10
    }

    /// How long the lease is kept after the scan starts: past the latest timer (0.6 periods),
    /// over well before the next period's first one.
    fn keep(self) -> Duration {
        self.period * 8 / 10
    }
}

/// What a periodic run did.
#[derive(Debug)]
pub struct PeriodicReport {
    /// The runs the run table accepted, per period (index 0 is the first period).
    pub runs: Vec<u32>,
    /// Runs refused because their fencing token was not newer than the last accepted one.
    pub stale_rejected: u64,
    /// The timeline, one line per event.
    pub timeline: Vec<String>,
}

impl PeriodicReport {
    /// The check of the at-least mode: every period ran the scan exactly once.
    pub fn once_per_period(&self) -> bool {
        !self.runs.is_empty() && self.runs.iter().all(|&n| n == 1)
    }
}

/// The run table: one row per scan, accepted only with a fencing token newer than the last.
#[derive(Debug, Default)]
struct RunTable {
    /// (runs per period, the newest accepted token)
    state: Mutex<(Vec<u32>, u64)>,
    stale_rejected: AtomicU64,
}

impl RunTable {
    /// `INSERT INTO scans (period, token) ... WHERE $token > (SELECT max(token) FROM scans)`
    fn record(&self, period: usize, token: FencingToken) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if token.get() <= state.1 {
            self.stale_rejected.fetch_add(1, Ordering::SeqCst);
            return false;
        }
        state.1 = token.get();
        if let Some(runs) = state.0.get_mut(period) {
            *runs += 1;
        }
        true
    }
}

/// Runs the scan from three skewed timers for `setup.periods` periods against the coordinator at
/// `url` and returns the runs per period.
///
/// # Errors
/// A message when the URL is invalid, the coordinator cannot be reached or refuses the job mode
/// (`Unsupported`), or a job failed.
pub fn run_periodic(url: &str, setup: Periodic, output: Output) -> Result<PeriodicReport, String> {
    let key = format!(
        "order-timeout-periodic/{:08x}",
        RandomState::new().hash_one((std::process::id(), setup.at_least)) & 0xffff_ffff
    );
    let periods = usize::try_from(setup.periods).map_err(|e| e.to_string())?;
    let table = Arc::new(RunTable {
        state: Mutex::new((vec![0; periods], 0)),
        stale_rejected: AtomicU64::new(0),
    });
    // Every timer counts from one instant, a little ahead so that each client has connected.
    let start = Instant::now() + Duration::from_millis(500);
    let timeline = Arc::new(Timeline {
        start,
        output,
        lines: Mutex::default(),
    });
    if output == Output::Print {
        println!(
            "{} instances scan every {:.1}s from timers 0/{:.1}/{:.1}s late (rotating), {} periods, {}\n",
            INSTANCES.len(),
            setup.period.as_secs_f64(),
            setup.skew(1, 0).as_secs_f64(),
            setup.skew(2, 0).as_secs_f64(),
            setup.periods,
            if setup.at_least {
                format!(
                    "each scan keeps the lock at least {:.1}s (job mode)",
                    setup.keep().as_secs_f64()
                )
            } else {
                "skip-if-held only (no at_least)".to_owned()
            }
        );
    }
    let threads: Vec<_> = INSTANCES
        .into_iter()
        .enumerate()
        .map(|(i, me)| {
            let (url, key, table, timeline) =
                (url.to_owned(), key.clone(), table.clone(), timeline.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                runtime.block_on(periodic_instance(
                    &url, &key, setup, i, me, &table, &timeline, start,
                ))
            })
        })
        .collect();
    join_instances(threads)?;
    let (runs, _) = table
        .state
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let report = PeriodicReport {
        runs,
        stale_rejected: table.stale_rejected.load(Ordering::SeqCst),
        timeline: timeline
            .lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone(),
    };
    if output == Output::Print {
        let per: Vec<String> = report.runs.iter().map(u32::to_string).collect();
        println!("\nruns per period: {}", per.join(" "));
        if report.once_per_period() {
            println!("check: OK, the scan ran exactly once in each of the {periods} periods");
        } else if setup.at_least {
            println!("check: FAILED, a period ran the scan other than once");
        } else {
            println!("(without at_least the late timers find the lock free and scan again)");
        }
    }
    Ok(report)
}

/// One instance: its timer fires at `start + k × period + skew`, and each firing runs the scan
/// under the lock, skipping when it is held.
#[allow(clippy::too_many_arguments)] // one instance's whole setup, spelled out
async fn periodic_instance(
    url: &str,
    key: &str,
    setup: Periodic,
    index: usize,
    me: &'static str,
    table: &Arc<RunTable>,
    timeline: &Arc<Timeline>,
    start: Instant,
) -> Result<(), String> {
    let lock = distlock::connect(url)
        .await
        .map_err(|e| format!("{me}: {e}"))?;
    let caps = lock.capabilities();
    let ttl = caps.effective_ttl(Duration::from_secs(1).max(caps.min_ttl));
    let mut opts = LockOptions::with_ttl(ttl);
    if setup.at_least {
        opts = opts.at_least(setup.keep());
    }
    for period in 0..setup.periods {
        let fire = start + setup.period * period + setup.skew(index, period);
        tokio::time::sleep_until(fire.into()).await;
        let (job_table, job_timeline) = (table.clone(), timeline.clone());
        let k = usize::try_from(period).unwrap_or(usize::MAX);
        let outcome = lock
            .run_exclusive(key, opts, move |ctx| async move {
                let (table, timeline) = (job_table, job_timeline);
                let Some(token) = ctx.fencing_token() else {
                    timeline.log(
                        me,
                        "this coordinator mints no fencing tokens: refusing to scan",
                    );
                    return;
                };
                // The scan: a query and a few updates.
                tokio::time::sleep(Duration::from_millis(100)).await;
                if table.record(k, token) {
                    timeline.log(me, format_args!("period {k}: scanned (token {token})"));
                } else {
                    timeline.log(
                        me,
                        format_args!("period {k}: scan REJECTED, token {token} is stale"),
                    );
                }
            })
            .await;
        match outcome {
            Ok(Some(())) => {}
            Ok(None) => timeline.log(me, format_args!("period {k}: lock held, skipped")),
            Err(e) if e.is_temporary() => {
                timeline.log(me, format_args!("period {k}: coordinator trouble ({e})"));
            }
            Err(e) => return Err(format!("{me}: {e}")),
        }
    }
    Ok(())
}
