//! The results of one run and their renderings: a markdown table, JSON and an SVG chart.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::{
    stats::{Summary, ratio},
    system::Machine,
};

/// Everything one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// How the run was configured and what it ran on.
    pub meta: Meta,
    /// One entry per backend, in the order run.
    pub backends: Vec<BackendReport>,
}

/// The run's configuration and environment.
#[derive(Clone, Debug, Serialize)]
pub struct Meta {
    /// The command that reproduces the run.
    pub command: String,
    /// `release` or `debug`.
    pub profile: &'static str,
    /// The tokio runtime flavour, e.g. `tokio multi-thread, 2 workers`.
    pub runtime: String,
    /// The machine.
    pub machine: Machine,
    /// `true` for `--quick`.
    pub quick: bool,
    /// Seconds since the Unix epoch when the run started.
    pub started_unix: u64,
    /// Wall time of the whole run in seconds.
    pub duration_s: f64,
    /// Measured rounds per uncontended variant (after warm-up).
    pub cycles: usize,
    /// Warm-up rounds per uncontended variant.
    pub warmup: usize,
}

/// What a variant of the uncontended cycle is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// This project's driver.
    Distlock,
    /// The bare minimal protocol with the same client crate.
    Bare,
    /// Another library's lock.
    Peer,
    /// One bare request: the round-trip floor.
    Rtt,
    /// The bare request after the hand-off's idle time (the hold): a hand-off wakes parties
    /// that were idle, which on a virtual machine costs more than a back-to-back round trip.
    IdleRtt,
    /// One bare write as durable as the backend's acquire (Redis `SET`, etcd put, ZooKeeper
    /// setData, a committed PostgreSQL `UPDATE`): the floor of any step that changes the lock.
    Write,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Distlock => "distlock",
            Kind::Bare => "bare",
            Kind::Peer => "peer",
            Kind::Rtt => "1 round trip",
            Kind::IdleRtt => "1 round trip after idle",
            Kind::Write => "1 write round trip",
        }
    }
}

/// One variant's latency.
#[derive(Clone, Debug, Serialize)]
pub struct Variant {
    /// What kind of variant.
    pub kind: Kind,
    /// What it does.
    pub label: String,
    /// Its latency (`None` when it failed; see `error`).
    pub latency: Option<Summary>,
    /// Why it has no numbers.
    pub error: Option<String>,
}

/// Handoff latency: from the holder starting `release` to the next waiter holding.
#[derive(Clone, Debug, Serialize)]
pub struct Handoff {
    /// Clients contending (each its own connection/session).
    pub waiters: usize,
    /// Latency of each handoff.
    pub latency: Summary,
    /// Handoff median in units of the backend's bare round trip median.
    pub median_in_rtts: Option<f64>,
    /// Handoff median in units of the backend's bare write round trip median (a hand-off
    /// needs at least the releasing write and a notification).
    pub median_in_write_rtts: Option<f64>,
    /// Handoff median in units of the bare round trip after the same idle time as the
    /// hand-off's hold.
    pub median_in_idle_rtts: Option<f64>,
}

/// Contended throughput.
#[derive(Clone, Debug, Serialize)]
pub struct Throughput {
    /// Clients (each its own connection/session).
    pub clients: usize,
    /// Distinct keys they cycle on (client `i` uses key `i % keys`).
    pub keys: usize,
    /// Measurement window in seconds.
    pub seconds: f64,
    /// Completed acquire+release cycles per second.
    pub acquisitions_per_s: f64,
}

/// The cost of keeping `held` locks alive with guard watchdogs in one process.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WatchdogCost {
    /// Locks held.
    pub held: usize,
    /// Lease TTL in seconds.
    pub ttl_s: f64,
    /// Watchdog interval in seconds.
    pub interval_s: f64,
    /// Seconds it took to take all the locks (64 acquisitions in flight).
    pub acquire_s: f64,
    /// Watchdog ticks observed (window / interval).
    pub ticks: f64,
    /// Requests per tick counted by `counter` (net of the background rate when the counter is
    /// shared with other clients).
    pub requests_per_tick: Option<f64>,
    /// Where the request count comes from.
    pub counter: String,
    /// The request kinds that grew most, per tick (not net of background).
    pub request_mix: Vec<(String, f64)>,
    /// Client state once the locks were held, where the backend tells (e.g. sessions in use).
    pub details: Option<String>,
    /// Successful renewals per tick, summed over the guards.
    pub renewals_per_tick: f64,
    /// Process CPU time per tick in milliseconds.
    pub cpu_ms_per_tick: Option<f64>,
    /// Resident memory added per held lock, in bytes.
    pub rss_bytes_per_lock: Option<f64>,
    /// Guards that reported their lock lost during the window.
    pub lost: usize,
}

/// All results of one backend.
#[derive(Clone, Debug, Serialize)]
pub struct BackendReport {
    /// `redis`, `etcd`, `zk` or `pg`.
    pub name: String,
    /// The server (credentials removed).
    pub server: String,
    /// `wait_notify` as claimed by the driver.
    pub wait_notify: bool,
    /// Uncontended acquire+release variants; the first is distlock.
    pub uncontended: Vec<Variant>,
    /// Handoff with several waiters on one key.
    pub handoff: Option<Handoff>,
    /// Contended throughput, one key and one key per client.
    pub throughput: Vec<Throughput>,
    /// The bare protocol's acquisitions per second on one key with as many clients, in the
    /// window after distlock's (only where it can be written bare with the same guarantee:
    /// etcd's fair queue).
    pub bare_one_key: Option<f64>,
    /// Watchdog cost per number of held locks.
    pub watchdog: Vec<WatchdogCost>,
    /// What went wrong or what to know about these numbers.
    pub notes: Vec<String>,
}

impl BackendReport {
    /// A report with no measurements yet.
    pub fn empty(name: String, server: String, notes: Vec<String>) -> Self {
        Self {
            name,
            server,
            wait_notify: false,
            uncontended: Vec::new(),
            handoff: None,
            throughput: Vec::new(),
            bare_one_key: None,
            watchdog: Vec::new(),
            notes,
        }
    }

    /// The distlock variant's latency.
    pub fn distlock(&self) -> Option<&Summary> {
        self.uncontended
            .iter()
            .find(|v| v.kind == Kind::Distlock)?
            .latency
            .as_ref()
    }

    /// The bare round trip's latency.
    pub fn rtt(&self) -> Option<&Summary> {
        self.latency_of(Kind::Rtt)
    }

    /// The bare write round trip's latency.
    pub fn write_rtt(&self) -> Option<&Summary> {
        self.latency_of(Kind::Write)
    }

    /// The bare round trip's latency after idling.
    pub fn idle_rtt(&self) -> Option<&Summary> {
        self.latency_of(Kind::IdleRtt)
    }

    fn latency_of(&self, kind: Kind) -> Option<&Summary> {
        self.uncontended
            .iter()
            .find(|v| v.kind == kind)?
            .latency
            .as_ref()
    }
}

pub(crate) fn fmt_us(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.digits$}"))
}

fn fmt_bytes(v: Option<f64>) -> String {
    match v {
        None => "–".to_owned(),
        Some(b) if b.abs() >= 10_240.0 => format!("{:.1} KiB", b / 1024.0),
        Some(b) => format!("{b:.0} B"),
    }
}

/// The markdown report: machine, then one table per measurement.
pub fn markdown(r: &Report) -> String {
    let m = &r.meta;
    let mut out = String::new();
    let _ = writeln!(out, "## distlock benchmark results\n");
    let _ = writeln!(out, "`{}`\n", m.command);
    let _ = writeln!(
        out,
        "- machine: {} × {} ({} logical CPUs), {} GiB RAM, Linux {}; load average at start {}",
        m.machine.nproc,
        m.machine.cpu_model,
        m.machine.nproc,
        m.machine.mem_gib,
        m.machine.kernel,
        m.machine.loadavg_at_start
    );
    let _ = writeln!(
        out,
        "- build: {} profile; runtime: {}; {} the whole run took {:.0} s",
        m.profile,
        m.runtime,
        if m.quick { "`--quick`;" } else { "full run;" },
        m.duration_s
    );
    let _ = writeln!(
        out,
        "- uncontended: {} measured rounds after {} warm-up rounds; every round runs each variant once, in a fresh random order, in one process, so drift hits all alike. Latencies in µs; percentiles are nearest-rank.",
        m.cycles, m.warmup
    );
    let _ = writeln!(
        out,
        "- servers: the shared single-node instances of `scripts/backends.sh` (other clients may be using them).\n"
    );

    let _ = writeln!(out, "### 1–2. Uncontended acquire + release\n");
    let _ = writeln!(
        out,
        "| backend | variant | what | median µs | p99 µs | distlock ÷ this (median) | distlock ÷ this (p99) |"
    );
    let _ = writeln!(out, "|---|---|---|---:|---:|---:|---:|");
    for b in &r.backends {
        let ours = b.distlock().copied();
        for v in &b.uncontended {
            match &v.latency {
                Some(s) => {
                    let (rm, rp) = match (ours, v.kind) {
                        (Some(o), k) if k != Kind::Distlock => (
                            fmt_opt(ratio(o.median_us, s.median_us), 2),
                            fmt_opt(ratio(o.p99_us, s.p99_us), 2),
                        ),
                        _ => ("–".to_owned(), "–".to_owned()),
                    };
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {} | {} | {rm} | {rp} |",
                        b.name,
                        v.kind.as_str(),
                        v.label,
                        fmt_us(s.median_us),
                        fmt_us(s.p99_us)
                    );
                }
                None => {
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | failed: {} | | | |",
                        b.name,
                        v.kind.as_str(),
                        v.label,
                        v.error.as_deref().unwrap_or("no samples")
                    );
                }
            }
        }
    }

    let _ = writeln!(out, "\n### 3. Handoff and contended throughput\n");
    let _ = writeln!(
        out,
        "| backend | wait_notify | handoff median µs | handoff p99 µs | median in round trips | in round trips after idle | in write round trips | handoffs (waiters) | 16 clients, 1 key: acq/s | 16 clients, 16 keys: acq/s |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for b in &r.backends {
        let tp = |keys: usize| {
            b.throughput.iter().find(|t| t.keys == keys).map_or_else(
                || "–".to_owned(),
                |t| format!("{:.0}", t.acquisitions_per_s),
            )
        };
        let (hm, hp, hr, hi, hw, hn) = match &b.handoff {
            Some(h) => (
                fmt_us(h.latency.median_us),
                fmt_us(h.latency.p99_us),
                fmt_opt(h.median_in_rtts, 1),
                fmt_opt(h.median_in_idle_rtts, 1),
                fmt_opt(h.median_in_write_rtts, 1),
                format!("{} ({})", h.latency.n, h.waiters),
            ),
            None => Default::default(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {hm} | {hp} | {hr} | {hi} | {hw} | {hn} | {} | {} |",
            b.name,
            if b.wait_notify { "yes" } else { "no" },
            tp(1),
            tp(16)
        );
    }
    for b in &r.backends {
        let (Some(bare), Some(one)) = (b.bare_one_key, b.throughput.iter().find(|t| t.keys == 1))
        else {
            continue;
        };
        // Acquisitions per hand-off time: what "≥ 0.8 × 1 / (hand-off p50)" compares.
        let per_handoff = |rate: f64| {
            fmt_opt(
                b.handoff.as_ref().map(|h| rate * h.latency.median_us / 1e6),
                2,
            )
        };
        let _ = writeln!(
            out,
            "\n- {}, {} clients on 1 key: distlock {:.0} acq/s; the bare protocol (the same requests per acquisition, hand-written on the server's client crate) {bare:.0} acq/s in the window after it. × hand-off median: distlock {}, bare {}.",
            b.name,
            one.clients,
            one.acquisitions_per_s,
            per_handoff(one.acquisitions_per_s),
            per_handoff(bare),
        );
    }

    let _ = writeln!(
        out,
        "\n### 4. Watchdog cost of held locks (one process, one client)\n"
    );
    let _ = writeln!(
        out,
        "| backend | held locks | ttl / interval | acquire all (s) | server requests per tick | renewals per tick | CPU ms per tick | RSS per held lock | lost | request mix per tick | request counter |"
    );
    let _ = writeln!(out, "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|");
    for b in &r.backends {
        for w in &b.watchdog {
            let _ = writeln!(
                out,
                "| {} | {} | {:.0} s / {:.0} s | {:.1} | {} | {:.0} | {} | {} | {} | {} | {} |",
                b.name,
                w.held,
                w.ttl_s,
                w.interval_s,
                w.acquire_s,
                fmt_opt(w.requests_per_tick, 1),
                w.renewals_per_tick,
                fmt_opt(w.cpu_ms_per_tick, 1),
                fmt_bytes(w.rss_bytes_per_lock),
                w.lost,
                {
                    let mut mix: Vec<String> = w
                        .request_mix
                        .iter()
                        .map(|(k, n)| format!("{k} {n:.0}"))
                        .collect();
                    mix.extend(w.details.iter().map(|d| format!("({d})")));
                    if mix.is_empty() {
                        "–".to_owned()
                    } else {
                        mix.join(", ")
                    }
                },
                w.counter
            );
        }
    }

    let notes: Vec<_> = r
        .backends
        .iter()
        .flat_map(|b| b.notes.iter().map(move |n| (b.name.as_str(), n)))
        .collect();
    if !notes.is_empty() {
        let _ = writeln!(out, "\n### Notes\n");
        for (name, n) in notes {
            let _ = writeln!(out, "- {name}: {n}");
        }
    }
    out
}

/// The report as pretty JSON.
///
/// # Errors
/// Only if serialisation fails (it does not for these types).
pub fn json(r: &Report) -> serde_json::Result<String> {
    serde_json::to_string_pretty(r)
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A horizontal bar chart of the latency medians (bars) and p99s (whiskers) on a log scale:
/// per backend the uncontended variants and the handoff.
pub fn svg(r: &Report) -> String {
    struct Bar {
        label: String,
        kind: &'static str,
        median: f64,
        p99: f64,
    }
    let mut groups: Vec<(String, Vec<Bar>)> = Vec::new();
    for b in &r.backends {
        let mut bars = Vec::new();
        for v in &b.uncontended {
            if let Some(s) = &v.latency {
                bars.push(Bar {
                    label: format!("{}: {}", v.kind.as_str(), v.label),
                    kind: match v.kind {
                        Kind::Distlock => "distlock",
                        Kind::Bare => "bare",
                        Kind::Peer => "peer",
                        Kind::Rtt => "rtt",
                        Kind::IdleRtt => "idle",
                        Kind::Write => "write",
                    },
                    median: s.median_us,
                    p99: s.p99_us,
                });
            }
        }
        if let Some(h) = &b.handoff {
            bars.push(Bar {
                label: format!("handoff, {} waiters (distlock)", h.waiters),
                kind: "handoff",
                median: h.latency.median_us,
                p99: h.latency.p99_us,
            });
        }
        if !bars.is_empty() {
            groups.push((b.name.clone(), bars));
        }
    }

    const W: f64 = 1280.0;
    const LABEL_W: f64 = 610.0;
    const PLOT_W: f64 = 560.0;
    const BAR_H: f64 = 16.0;
    const GAP: f64 = 6.0;
    const GROUP_HEAD: f64 = 26.0;
    const TOP: f64 = 100.0;
    let max = groups
        .iter()
        .flat_map(|(_, b)| b.iter().map(|b| b.p99.max(b.median)))
        .fold(1.0_f64, f64::max);
    let min = groups
        .iter()
        .flat_map(|(_, b)| b.iter().map(|b| b.median))
        .fold(f64::INFINITY, f64::min);
    // Decades spanning every value.
    let lo = if min.is_finite() && min > 0.0 {
        10f64.powf(min.log10().floor())
    } else {
        10.0
    };
    let hi = 10f64.powf(max.log10().ceil()).max(lo * 10.0);
    let x =
        |v: f64| LABEL_W + PLOT_W * ((v.max(lo)).log10() - lo.log10()) / (hi.log10() - lo.log10());
    let rows: usize = groups.iter().map(|(_, b)| b.len()).sum();
    let h = TOP + groups.len() as f64 * GROUP_HEAD + rows as f64 * (BAR_H + GAP) + 60.0;

    let colour = |k: &str| match k {
        "distlock" => "#1f77b4",
        "bare" => "#7f7f7f",
        "peer" => "#ff7f0e",
        "handoff" => "#2ca02c",
        "write" => "#9467bd",
        _ => "#bcbd22",
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h:.0}" viewBox="0 0 {W} {h:.0}" font-family="DejaVu Sans, Arial, sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" font-size="16" font-weight="bold">distlock: latency per operation (µs, log scale) — bar = median, whisker = p99</text>"#,
        10
    );
    let _ = writeln!(
        s,
        r##"<text x="10" y="44" fill="#555">{}; {}; {} profile; {} × {}</text>"##,
        xml_escape(&r.meta.runtime),
        if r.meta.quick { "--quick" } else { "full run" },
        r.meta.profile,
        r.meta.machine.nproc,
        xml_escape(&r.meta.machine.cpu_model)
    );
    // Legend, on its own line under the subtitle.
    let mut lx = 10.0;
    for (kind, text) in [
        ("distlock", "distlock"),
        ("bare", "bare protocol"),
        ("peer", "peer library"),
        ("rtt", "1 round trip"),
        ("write", "1 write"),
        ("handoff", "handoff"),
    ] {
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.0}" y="60" width="12" height="12" fill="{}"/><text x="{:.0}" y="71">{text}</text>"#,
            colour(kind),
            lx + 16.0
        );
        lx += 24.0 + 7.5 * text.len() as f64;
    }
    let _ = writeln!(
        s,
        r##"<text x="{:.0}" y="71" fill="#555">numbers: median / p99 µs</text>"##,
        lx + 10.0
    );
    // Grid: every decade, labelled.
    let grid_bottom = h - 40.0;
    let mut d = lo;
    while d <= hi * 1.0001 {
        let gx = x(d);
        let _ = writeln!(
            s,
            r##"<line x1="{gx:.1}" y1="{:.0}" x2="{gx:.1}" y2="{grid_bottom:.0}" stroke="#ddd"/>"##,
            TOP - 8.0
        );
        let label = if d >= 1000.0 {
            format!("{:.0}k", d / 1000.0)
        } else {
            format!("{d:.0}")
        };
        let _ = writeln!(
            s,
            r##"<text x="{gx:.1}" y="{:.0}" text-anchor="middle" fill="#555">{label}</text>"##,
            grid_bottom + 16.0
        );
        d *= 10.0;
    }
    let _ = writeln!(
        s,
        r##"<text x="{:.0}" y="{:.0}" text-anchor="middle" fill="#555">µs</text>"##,
        LABEL_W + PLOT_W / 2.0,
        grid_bottom + 32.0
    );
    let mut y = TOP;
    for (name, bars) in &groups {
        let _ = writeln!(
            s,
            r#"<text x="10" y="{:.0}" font-size="14" font-weight="bold">{}</text>"#,
            y + 16.0,
            xml_escape(name)
        );
        y += GROUP_HEAD;
        for b in bars {
            let label: String = if b.label.chars().count() > 92 {
                b.label.chars().take(91).chain(['…']).collect()
            } else {
                b.label.clone()
            };
            let _ = writeln!(
                s,
                r#"<text x="{:.0}" y="{:.0}" text-anchor="end">{}</text>"#,
                LABEL_W - 8.0,
                y + BAR_H - 4.0,
                xml_escape(&label)
            );
            let x0 = x(lo);
            let xm = x(b.median);
            let xp = x(b.p99);
            let _ = writeln!(
                s,
                r#"<rect x="{x0:.1}" y="{y:.1}" width="{:.1}" height="{BAR_H}" fill="{}"/>"#,
                (xm - x0).max(1.0),
                colour(b.kind)
            );
            let mid = y + BAR_H / 2.0;
            let _ = writeln!(
                s,
                r##"<line x1="{xm:.1}" y1="{mid:.1}" x2="{xp:.1}" y2="{mid:.1}" stroke="#333"/><line x1="{xp:.1}" y1="{:.1}" x2="{xp:.1}" y2="{:.1}" stroke="#333"/>"##,
                y + 3.0,
                y + BAR_H - 3.0
            );
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{:.1}" fill="#222">{} / {}</text>"##,
                xp.max(xm) + 6.0,
                y + BAR_H - 4.0,
                fmt_us(b.median),
                fmt_us(b.p99)
            );
            y += BAR_H + GAP;
        }
    }
    let _ = writeln!(s, "</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(median: f64, p99: f64) -> Summary {
        Summary {
            n: 100,
            median_us: median,
            p99_us: p99,
            mean_us: median,
            min_us: median / 2.0,
            max_us: p99 * 2.0,
        }
    }

    fn sample() -> Report {
        Report {
            meta: Meta {
                command: "cargo run --release -p distlock-bench -- --quick".into(),
                profile: "release",
                runtime: "tokio multi-thread, 2 workers".into(),
                machine: Machine {
                    nproc: 2,
                    cpu_model: "Test CPU <x>".into(),
                    kernel: "6.0".into(),
                    mem_gib: 4.0,
                    loadavg_at_start: "0.1 0.2 0.3".into(),
                },
                quick: true,
                started_unix: 0,
                duration_s: 12.0,
                cycles: 100,
                warmup: 20,
            },
            backends: vec![BackendReport {
                name: "redis".into(),
                server: "127.0.0.1:26379".into(),
                wait_notify: true,
                uncontended: vec![
                    Variant {
                        kind: Kind::Distlock,
                        label: "RedisLock try_acquire + release".into(),
                        latency: Some(summary(210.0, 400.0)),
                        error: None,
                    },
                    Variant {
                        kind: Kind::Bare,
                        label: "SET NX PX + EVALSHA".into(),
                        latency: Some(summary(200.0, 500.0)),
                        error: None,
                    },
                    Variant {
                        kind: Kind::Peer,
                        label: "rslock".into(),
                        latency: None,
                        error: Some("boom".into()),
                    },
                ],
                handoff: Some(Handoff {
                    waiters: 8,
                    latency: summary(300.0, 900.0),
                    median_in_rtts: Some(3.0),
                    median_in_write_rtts: Some(1.5),
                    median_in_idle_rtts: Some(2.0),
                }),
                throughput: vec![Throughput {
                    clients: 16,
                    keys: 1,
                    seconds: 1.0,
                    acquisitions_per_s: 1234.4,
                }],
                bare_one_key: Some(1000.0),
                watchdog: vec![WatchdogCost {
                    held: 1000,
                    ttl_s: 6.0,
                    interval_s: 2.0,
                    acquire_s: 0.5,
                    ticks: 3.0,
                    requests_per_tick: Some(1000.3),
                    counter: "INFO commandstats".into(),
                    request_mix: vec![("evalsha".into(), 990.0), ("publish".into(), 2.4)],
                    details: None,
                    renewals_per_tick: 1000.0,
                    cpu_ms_per_tick: Some(12.5),
                    rss_bytes_per_lock: Some(2048.0),
                    lost: 0,
                }],
                notes: vec!["a note".into()],
            }],
        }
    }

    #[test]
    fn markdown_has_every_table_and_ratio() {
        let md = markdown(&sample());
        assert!(md.contains("Test CPU <x>"));
        assert!(md.contains("tokio multi-thread, 2 workers"));
        // distlock ÷ bare: 210 / 200 and 400 / 500.
        assert!(
            md.contains("| redis | bare | SET NX PX + EVALSHA | 200 | 500 | 1.05 | 0.80 |"),
            "{md}"
        );
        assert!(md.contains("| redis | peer | rslock | failed: boom |"));
        assert!(md.contains("| redis | yes | 300 | 900 | 3.0 | 2.0 | 1.5 | 100 (8) | 1234 | – |"));
        // 1234.4/s × 300 µs and 1000/s × 300 µs.
        assert!(
            md.contains(
                "acq/s in the window after it. × hand-off median: distlock 0.37, bare 0.30."
            ),
            "{md}"
        );
        assert!(
            md.contains("- redis, 16 clients on 1 key: distlock 1234 acq/s; the bare protocol")
        );
        assert!(md.contains(
            "| redis | 1000 | 6 s / 2 s | 0.5 | 1000.3 | 1000 | 12.5 | 2048 B | 0 | evalsha 990, publish 2 | INFO commandstats |"
        ));
        assert!(md.contains("- redis: a note"));
    }

    #[test]
    fn json_round_trips_the_numbers() {
        let v: serde_json::Value = serde_json::from_str(&json(&sample()).unwrap()).unwrap();
        assert_eq!(v["meta"]["runtime"], "tokio multi-thread, 2 workers");
        assert_eq!(v["backends"][0]["uncontended"][0]["kind"], "distlock");
        assert_eq!(
            v["backends"][0]["uncontended"][1]["latency"]["median_us"],
            200.0
        );
        assert_eq!(v["backends"][0]["uncontended"][2]["error"], "boom");
        assert_eq!(v["backends"][0]["watchdog"][0]["held"], 1000);
    }

    #[test]
    fn svg_is_well_formed_and_escaped() {
        let svg = svg(&sample());
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("Test CPU &lt;x&gt;"));
        // Six legend swatches, then three bars: distlock, bare, handoff (the failed peer has
        // no numbers, so no bar).
        assert_eq!(svg.matches("<rect x=").count(), 6 + 3);
        assert_eq!(svg.matches('<').count(), svg.matches('>').count());
    }
}
