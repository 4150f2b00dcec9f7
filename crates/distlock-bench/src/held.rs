//! `--held-locks`: many locks held at once by one client in one process, per backend — the
//! scale of a service that locks per entity (`lock:order:{id}`).
//!
//! Per backend and size (`--held N`, default 100,000), a fresh child process of this binary
//! (the watchdog child of the full run, so memory and CPU are this measurement's alone) takes
//! N locks with `LockGuard` watchdogs (64 acquisitions in flight), waits until the renewals
//! run, and measures over whole renewal ticks: the time to take them all, resident memory per
//! held lock, process CPU per tick (and per lock per tick), server requests per tick, renewals
//! per tick and locks lost. The TTL (6 s, renewal every 2 s; 3 s / 1 s with `--quick`) is short
//! enough that the measurement window holds several ticks and long enough that the watchdogs
//! of the first locks renew while the last are still being taken. A backend that does not
//! finish within the child's time limit is reported as not measured at that size; run it again
//! with a smaller `--held` to find the largest size that is.

use serde::Serialize;

use crate::{Args, report::WatchdogCost};

/// The memory target per held lock.
const RSS_TARGET: f64 = 1024.0;
/// The CPU target per lock per tick where renewals are per lock (Redis, PostgreSQL), µs.
const CPU_TARGET_US: f64 = 5.0;

/// One backend at one size.
#[derive(Clone, Debug, Serialize)]
pub struct HeldResult {
    /// `redis`, `etcd`, `zk` or `pg`.
    pub backend: String,
    /// Locks asked for.
    pub held: usize,
    /// The measurement, or why there is none.
    pub result: Result<WatchdogCost, String>,
}

/// The whole `--held-locks` run.
#[derive(Clone, Debug, Serialize)]
pub struct HeldRun {
    /// The command line.
    pub command: String,
    /// The machine (and its load at the start).
    pub machine: crate::system::Machine,
    /// Runtime flavour.
    pub runtime: String,
    /// Per backend and size.
    pub results: Vec<HeldResult>,
    /// Seconds the run took.
    pub duration_s: f64,
}

/// Runs every backend of `args` at every size (`--held`, default 100,000), each in a child.
pub async fn run(args: &Args, runtime: String, machine: crate::system::Machine) -> HeldRun {
    let sizes = args.held.clone().unwrap_or_else(|| vec![100_000]);
    let run = format!("{:08x}", rand::random::<u32>());
    let t0 = std::time::Instant::now();
    let mut results = Vec::new();
    for name in &args.backends {
        let name = name.trim();
        for &n in &sizes {
            crate::progress(format!("{name}: {n} held locks (child process)"));
            let result = crate::watchdog_in_child(args, name, n, &run)
                .await
                .map_err(|e| e.to_string());
            if let Err(e) = &result {
                crate::progress(format!("{name}: {n} held locks failed: {e}"));
            }
            results.push(HeldResult {
                backend: name.to_owned(),
                held: n,
                result,
            });
        }
    }
    HeldRun {
        command: crate::command_line(),
        machine,
        runtime,
        results,
        duration_s: t0.elapsed().as_secs_f64(),
    }
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.digits$}"))
}

/// Bytes as B or KiB.
fn bytes(v: Option<f64>) -> String {
    match v {
        Some(b) if b.abs() >= 10.0 * 1024.0 => format!("{:.1} KiB", b / 1024.0),
        Some(b) => format!("{b:.0} B"),
        None => "–".to_owned(),
    }
}

/// Process CPU per lock per tick, in µs.
fn cpu_us_per_lock(w: &WatchdogCost) -> Option<f64> {
    let ms = w.cpu_ms_per_tick?;
    (w.held > 0).then(|| ms * 1e3 / w.held as f64)
}

/// Where a result stands against the targets.
fn verdict(backend: &str, w: &WatchdogCost) -> String {
    let mut out = Vec::new();
    if let Some(rss) = w.rss_bytes_per_lock {
        out.push(if rss <= RSS_TARGET {
            "RSS ≤ 1 KiB: met".to_owned()
        } else {
            format!("RSS ≤ 1 KiB: not met ({:.1}×)", rss / RSS_TARGET)
        });
    }
    match backend {
        "redis" | "pg" => {
            if let Some(us) = cpu_us_per_lock(w) {
                out.push(if us <= CPU_TARGET_US {
                    "CPU ≤ 5 µs/lock: met".to_owned()
                } else {
                    format!("CPU ≤ 5 µs/lock: not met ({:.1}×)", us / CPU_TARGET_US)
                });
            }
        }
        _ => out.push("CPU O(1) in locks: compare sizes".to_owned()),
    }
    if w.lost > 0 {
        out.push(format!("{} lost", w.lost));
    }
    out.join("; ")
}

/// The run as markdown.
pub fn markdown(run: &HeldRun) -> String {
    let m = &run.machine;
    let mut md = String::new();
    md.push_str("## Held locks at scale\n\n");
    md.push_str(&format!("`{}`\n\n", run.command));
    md.push_str(&format!(
        "- machine: {} × {} ({} logical CPUs), {:.1} GiB RAM, Linux {}; load average at start {}\n- runtime: {}; the run took {:.0} s\n- each size in a fresh child process, one client, 64 acquisitions in flight; CPU is the whole process's (`CLOCK_PROCESS_CPUTIME_ID`) over whole ticks; RSS is `VmRSS` after the locks were taken less before\n\n",
        m.nproc,
        m.cpu_model,
        m.nproc,
        m.mem_gib,
        m.kernel,
        m.loadavg_at_start,
        run.runtime,
        run.duration_s
    ));
    md.push_str("| backend | held locks | ttl / interval | acquire all (s) | acquisitions/s | RSS per held lock | CPU ms per tick | CPU µs per lock per tick | server requests per tick | renewals per tick | lost | against the targets |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for r in &run.results {
        match &r.result {
            Ok(w) => md.push_str(&format!(
                "| {} | {} | {:.0} s / {:.0} s | {:.1} | {:.0} | {} | {} | {} | {} | {:.0} | {} | {} |\n",
                r.backend,
                w.held,
                w.ttl_s,
                w.interval_s,
                w.acquire_s,
                if w.acquire_s > 0.0 {
                    w.held as f64 / w.acquire_s
                } else {
                    0.0
                },
                bytes(w.rss_bytes_per_lock),
                num(w.cpu_ms_per_tick, 1),
                num(cpu_us_per_lock(w), 2),
                num(w.requests_per_tick, 1),
                w.renewals_per_tick,
                w.lost,
                verdict(&r.backend, w),
            )),
            Err(e) => md.push_str(&format!(
                "| {} | {} | – | – | – | – | – | – | – | – | – | not measured: {} |\n",
                r.backend,
                r.held,
                e.replace('|', "\\|")
            )),
        }
    }
    let mixes: Vec<String> = run
        .results
        .iter()
        .filter_map(|r| {
            let w = r.result.as_ref().ok()?;
            let mix: Vec<String> = w
                .request_mix
                .iter()
                .map(|(k, v)| format!("{k} {v:.0}"))
                .collect();
            Some(format!(
                "- {} at {}: {} ({}{})",
                r.backend,
                r.held,
                if mix.is_empty() {
                    "–".to_owned()
                } else {
                    mix.join(", ")
                },
                w.counter,
                w.details
                    .as_ref()
                    .map_or(String::new(), |d| format!("; {d}"))
            ))
        })
        .collect();
    if !mixes.is_empty() {
        md.push_str("\nRequest mix per tick, and where the count comes from:\n\n");
        md.push_str(&mixes.join("\n"));
        md.push('\n');
    }
    md
}

/// The dispatch of `--held-locks`: runs, prints and writes `held.md` and `held.json`.
pub fn main(
    args: &Args,
    runtime: &tokio::runtime::Runtime,
    flavour: String,
    machine: crate::system::Machine,
) -> std::process::ExitCode {
    let report = runtime.block_on(run(args, flavour, machine));
    let md = markdown(&report);
    println!("{md}");
    let out = args.out.clone().unwrap_or_else(crate::default_out);
    let written = std::fs::create_dir_all(&out)
        .and_then(|()| std::fs::write(out.join("held.md"), &md))
        .and_then(|()| {
            let json = serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?;
            std::fs::write(out.join("held.json"), json)
        });
    match written {
        Ok(()) => {
            crate::progress(format!("wrote held.md and held.json to {}", out.display()));
            if report.results.iter().all(|r| r.result.is_ok()) {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("cannot write the results to {}: {e}", out.display());
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(held: usize, cpu_ms: f64, rss: f64, lost: usize) -> WatchdogCost {
        WatchdogCost {
            held,
            ttl_s: 6.0,
            interval_s: 2.0,
            acquire_s: 2.0,
            ticks: 3.0,
            requests_per_tick: Some(25.0),
            counter: "counter".into(),
            request_mix: vec![("evalsha".into(), 25.0)],
            details: None,
            renewals_per_tick: held as f64,
            cpu_ms_per_tick: Some(cpu_ms),
            rss_bytes_per_lock: Some(rss),
            lost,
        }
    }

    #[test]
    fn the_table_judges_each_result_against_the_targets() {
        let run = HeldRun {
            command: "cmd".into(),
            machine: crate::system::Machine::detect(),
            runtime: "rt".into(),
            results: vec![
                HeldResult {
                    backend: "redis".into(),
                    held: 100_000,
                    result: Ok(cost(100_000, 300.0, 900.0, 0)),
                },
                HeldResult {
                    backend: "pg".into(),
                    held: 100_000,
                    result: Ok(cost(100_000, 1000.0, 2048.0, 3)),
                },
                HeldResult {
                    backend: "zk".into(),
                    held: 100_000,
                    result: Err("not measured: a | b".into()),
                },
            ],
            duration_s: 1.0,
        };
        let md = markdown(&run);
        let row = |b: &str| {
            md.lines()
                .find(|l| l.starts_with(&format!("| {b} |")))
                .unwrap_or_default()
                .to_owned()
        };
        // 300 ms over 100,000 locks: 3 µs each; 1 s: 10 µs.
        assert!(row("redis").contains("| 3.00 |"), "{md}");
        assert!(row("redis").contains("RSS ≤ 1 KiB: met; CPU ≤ 5 µs/lock: met"));
        assert!(row("pg").contains("RSS ≤ 1 KiB: not met (2.0×)"), "{md}");
        assert!(row("pg").contains("CPU ≤ 5 µs/lock: not met (2.0×); 3 lost"));
        assert!(row("zk").contains("not measured: a \\| b"), "{md}");
        assert!(
            md.contains("- redis at 100000: evalsha 25 (counter)"),
            "{md}"
        );
    }
}
