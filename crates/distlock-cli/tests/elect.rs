//! `distlock elect` and `distlock leader`: in one process on the memory backend and bad input
//! (always), across processes on Redis (`DISTLOCK_TEST_REDIS_URL`; skipped when unset, a failure
//! with `DISTLOCK_REQUIRE_BACKENDS=1`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use distlock::Backend;
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use support::{fresh_key, temp_dir, wait_for_file};

fn distlock() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command
        .env_remove("DISTLOCK_URL")
        .env_remove("DISTLOCK_URL_FILE")
        .stdin(Stdio::null());
    command
}

fn on(url: &str) -> Command {
    let mut command = distlock();
    command.env("DISTLOCK_URL", url);
    command
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn redis() -> Option<String> {
    if !Backend::Redis.is_enabled() {
        return None;
    }
    conformance::backend_url("DISTLOCK_TEST_REDIS_URL")
}

/// Waits for `child` to exit; kills it on timeout.
fn finish(mut child: Child, within: Duration) -> Output {
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("distlock did not exit within {within:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// What a failed test leaves behind, cleaned up when it panics: processes to SIGKILL (a killed
/// `elect`'s guard then terminates its command) and files that end a command waiting for them.
#[derive(Default)]
struct Reaper {
    pids: Vec<u32>,
    files: Vec<PathBuf>,
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if !thread::panicking() {
            return;
        }
        for file in &self.files {
            let _ = std::fs::write(file, "");
        }
        for &pid in &self.pids {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
    }
}

/// A shell loop that waits for `file` (an event, polled at 20 ms: `sh` cannot block on it).
fn until(file: &Path) -> String {
    format!("while [ ! -e {} ]; do sleep 0.02; done", file.display())
}

#[test]
fn elect_runs_the_command_with_the_election_and_its_term_and_passes_its_status() {
    let out = distlock()
        .args(["--url", "memory://e", "elect", "scheduler", "--json", "--"])
        .args([
            "sh",
            "-c",
            "echo \"$DISTLOCK_ELECTION $DISTLOCK_TERM ${DISTLOCK_KEY-unset} ${DISTLOCK_FENCING_TOKEN-unset}\"; exit 7",
        ])
        // A `distlock run` around it: its variables are not this leadership's.
        .env("DISTLOCK_KEY", "outer")
        .env("DISTLOCK_FENCING_TOKEN", "99")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    assert_eq!(stdout(&out), "scheduler 1 unset unset\n");
    let events: Vec<serde_json::Value> = stderr(&out)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0]["event"], "elected");
    assert_eq!(events[0]["election"], "scheduler");
    assert_eq!(events[0]["key"], "election/scheduler");
    assert_eq!(events[0]["term"], 1);
    assert_eq!(events[1]["event"], "exit");
    assert_eq!(events[1]["status"], 7);
}

#[test]
fn leader_without_one_says_so_with_exit_1_in_text_and_json() {
    // memory:// lives in the process: nobody leads in a fresh one.
    let out = distlock()
        .args(["--url", "memory://", "leader", "scheduler"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(stdout(&out), "scheduler: no leader\n");
    let out = distlock()
        .args(["--url", "memory://", "leader", "scheduler", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let value: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(value["election"], "scheduler");
    assert_eq!(value["leader"], false);
    assert!(
        value["term"].is_null() && value["holder"].is_null(),
        "{value}"
    );
}

#[test]
fn bad_input_exits_2_before_any_io() {
    // Nothing listens on port 1: any I/O would end in 69, not 2.
    let url = "redis://127.0.0.1:1";
    let cases: [&[&str]; 11] = [
        &["elect", "", "--", "true"],
        &["elect", "x", "--ttl", "soon", "--", "true"],
        &["elect", "x", "--ttl", "500ms", "--", "true"],
        &["elect", "x", "--wait", "-1s", "--", "true"],
        &[
            "elect",
            "x",
            "--ttl",
            "3s",
            "--kill-after",
            "2s",
            "--",
            "true",
        ],
        &["elect", "x", "--label", "has space", "--", "true"],
        &["elect", "x", "--value", "has space", "--", "true"],
        &["elect", "x"],
        &["leader", ""],
        &["leader", "x", "--watch", "--every", "0s"],
        &["leader", "x", "--every", "1s"],
    ];
    for args in cases {
        let started = Instant::now();
        let out = on(url).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(!stderr(&out).is_empty(), "{args:?} says why");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{args:?} took {:?}",
            started.elapsed()
        );
    }
    let out = on(url).args(["elect", "", "--", "true"]).output().unwrap();
    assert!(
        stderr(&out).contains("invalid election name"),
        "{}",
        stderr(&out)
    );
}

/// Lines of a child's stdout, as they come.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn next_json(lines: &mpsc::Receiver<String>) -> serde_json::Value {
    let line = lines
        .recv_timeout(Duration::from_secs(10))
        .expect("leader --watch printed no line within 10 s");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"))
}

/// Two campaigners on Redis: the second waits until the first resigns and gets a larger term;
/// one with a short --wait gives up with 75 meanwhile; `leader` shows the leader (text and
/// JSON) and then nobody; `leader --watch --json` follows every term in order.
#[test]
fn a_second_elect_waits_for_the_first_to_resign_and_leader_follows() {
    let Some(url) = redis() else { return };
    let name = fresh_key("turns");
    let dir = temp_dir("turns");
    let log = dir.join("log");

    let mut watch = on(&url)
        .args(["leader", &name, "--watch", "--json", "--every", "50ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reaper = Reaper::default();
    reaper.pids.push(watch.id());
    let watched = lines_of(&mut watch);
    let first = next_json(&watched);
    assert_eq!(first["leader"], false, "{first}");

    let (a_ready, a_go) = (dir.join("a-ready"), dir.join("a-go"));
    let a_script = format!(
        "echo \"a $DISTLOCK_TERM\" >> {log}; touch {ready}; {wait}; echo a-end >> {log}",
        log = log.display(),
        ready = a_ready.display(),
        wait = until(&a_go),
    );
    let mut a = on(&url)
        .args(["elect", &name, "--ttl", "3s", "--label", "elect-a", "--"])
        .args(["sh", "-c", &a_script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    reaper.pids.push(a.id());
    reaper.files.push(a_go.clone());
    wait_for_file(&a_ready, &mut a, Duration::from_secs(10));

    let out = on(&url).args(["leader", &name]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.starts_with(&format!("{name}: elect-a, term ")),
        "{text}"
    );
    assert!(text.contains("label=elect-a"), "{text}");
    let out = on(&url).args(["leader", &name, "--json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let shown: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(shown["leader"], true, "{shown}");
    assert_eq!(shown["value"], "elect-a", "{shown}");
    let a_term = shown["term"].as_u64().unwrap();
    assert!(
        shown["holder"].as_str().unwrap().ends_with("label=elect-a"),
        "{shown}"
    );
    let ttl_ms = shown["ttl_remaining_ms"].as_u64().unwrap();
    assert!(ttl_ms > 0 && ttl_ms <= 3000, "{shown}");
    let seen = next_json(&watched);
    assert_eq!(seen["term"].as_u64(), Some(a_term), "{seen}");

    let b_script = format!("echo \"b $DISTLOCK_TERM\" >> {}", log.display());
    let b = on(&url)
        .args([
            "elect", &name, "--ttl", "3s", "--wait", "20s", "--value", "elect-b", "--",
        ])
        .args(["sh", "-c", &b_script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    reaper.pids.push(b.id());
    // While A leads, a campaign with a short wait gives up with run's "not acquired" status.
    let out = on(&url)
        .args(["elect", &name, "--wait", "300ms", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("label=elect-a"),
        "names the leader: {}",
        stderr(&out)
    );
    // One that waits without limit and is interrupted leaves the queue (and never runs).
    let d_script = format!("echo d >> {}", log.display());
    let d = on(&url)
        .args(["elect", &name, "--"])
        .args(["sh", "-c", &d_script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    reaper.pids.push(d.id());
    let waiters = || -> u64 {
        let out = on(&url)
            .args(["inspect", &format!("election/{name}"), "--json"])
            .output()
            .unwrap();
        let value: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
        value["waiters"].as_u64().unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while waiters() < 2 {
        assert!(Instant::now() < deadline, "B and D never both queued");
        thread::sleep(Duration::from_millis(20));
    }
    kill(
        Pid::from_raw(i32::try_from(d.id()).unwrap()),
        Signal::SIGTERM,
    )
    .unwrap();
    let d = finish(d, Duration::from_secs(10));
    assert_eq!(d.status.code(), Some(128 + 15), "{}", stderr(&d));
    assert_eq!(waiters(), 1, "D left the queue");

    std::fs::write(&a_go, "").unwrap();
    let a = finish(a, Duration::from_secs(10));
    assert_eq!(a.status.code(), Some(0), "{}", stderr(&a));
    let b = finish(b, Duration::from_secs(10));
    assert_eq!(b.status.code(), Some(0), "{}", stderr(&b));

    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert_eq!(lines[0], format!("a {a_term}"), "{text}");
    assert_eq!(
        lines[1], "a-end",
        "B ran only after A's command ended: {text}"
    );
    let b_term: u64 = lines[2].strip_prefix("b ").unwrap().parse().unwrap();
    assert!(b_term > a_term, "{text}");

    let out = on(&url).args(["leader", &name]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{name}: no leader\n"));

    // The watch: B's term (if a poll caught it: it led for a few ms), then nobody; terms only
    // ever grow.
    let mut last_term = a_term;
    loop {
        let seen = next_json(&watched);
        if seen["leader"] == false {
            break;
        }
        let term = seen["term"].as_u64().unwrap();
        assert!(term > last_term, "{seen} after term {last_term}");
        assert_eq!(term, b_term, "{seen}");
        last_term = term;
    }
    kill(
        Pid::from_raw(i32::try_from(watch.id()).unwrap()),
        Signal::SIGTERM,
    )
    .unwrap();
    let watch = finish(watch, Duration::from_secs(10));
    assert_eq!(watch.status.code(), Some(128 + 15), "{}", stderr(&watch));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A leader whose leadership is taken away (the runbook's force release) has its command
/// terminated (SIGTERM, which it logs) and exits 76; the next campaigner gets a larger term.
#[test]
fn elect_terminates_the_command_when_leadership_is_lost() {
    let Some(url) = redis() else { return };
    let name = fresh_key("lost");
    let dir = temp_dir("lost");
    let (ready, log) = (dir.join("ready"), dir.join("log"));
    let script = format!(
        "trap 'echo TERM >> {log}; exit 0' TERM; echo \"$DISTLOCK_TERM $$\" > {ready}.tmp; mv {ready}.tmp {ready}; while true; do sleep 0.02; done",
        log = log.display(),
        ready = ready.display(),
    );
    let mut leader = on(&url)
        .args(["elect", &name, "--ttl", "2s", "--json", "--"])
        .args(["sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reaper = Reaper::default();
    reaper.pids.push(leader.id());
    wait_for_file(&ready, &mut leader, Duration::from_secs(10));
    let shown = std::fs::read_to_string(&ready).unwrap();
    let (term, command) = shown.trim().split_once(' ').unwrap();
    let term: u64 = term.parse().unwrap();
    // Should it outlive the leadership (the failure this test is for), it is killed.
    reaper.pids.push(command.parse().unwrap());
    let released = on(&url)
        .args(["release", "--force", "--yes", &format!("election/{name}")])
        .output()
        .unwrap();
    assert_eq!(released.status.code(), Some(0), "{}", stderr(&released));
    let out = finish(leader, Duration::from_secs(10));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(76), "{err}");
    assert!(err.contains("\"event\":\"lost\""), "{err}");
    assert_eq!(
        std::fs::read_to_string(&log).unwrap_or_default(),
        "TERM\n",
        "the command was sent SIGTERM: {err}"
    );
    let out = on(&url)
        .args(["elect", &name, "--ttl", "2s", "--wait", "5s", "--"])
        .args(["sh", "-c", "echo $DISTLOCK_TERM"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let next: u64 = stdout(&out).trim().parse().unwrap();
    assert!(next > term, "{next} after {term}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `etcdctl --endpoints=… <args>` for the etcd of `url`.
fn etcdctl(url: &str, args: &[&str]) -> Command {
    let endpoint = url
        .strip_prefix("etcd://")
        .expect("a plain etcd:// URL")
        .split(['/', '?'])
        .next()
        .unwrap();
    let mut command = Command::new("etcdctl");
    command
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints=http://{endpoint}"))
        .args(args)
        .stdin(Stdio::null());
    command
}

/// Issue 44, item 11, through the CLI on etcd: while `distlock elect NAME --value V` leads,
/// `etcdctl elect -l` (Go's `Election.Observe`) reads exactly V; while `etcdctl elect NAME W`
/// leads, `distlock leader NAME` shows exactly W first (text and JSON), with no identity.
#[test]
fn peers_read_exactly_the_elect_value_and_leader_shows_theirs_first() {
    if !Backend::Etcd.is_enabled() {
        return;
    }
    let Some(url) = conformance::backend_url("DISTLOCK_TEST_ETCD_URL") else {
        return;
    };
    let mut reaper = Reaper::default();
    let dir = temp_dir("elect-value");
    // No `/` in the name: etcd escapes it (`%2F`) in the election's range.
    let name = format!("value-{:016x}", rand::random::<u64>());
    let path = format!("distlock/election/{name}");
    let value = format!("10.0.0.7:8080/{name}");
    let ready = dir.join("ready");
    let go = dir.join("go");
    let script = format!("touch {}; {}", ready.display(), until(&go));
    let mut ours = on(&url)
        .args(["elect", &name, "--ttl", "5s", "--value", &value, "--"])
        .args(["sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    reaper.pids.push(ours.id());
    reaper.files.push(go.clone());
    wait_for_file(&ready, &mut ours, Duration::from_secs(10));
    let mut observer = etcdctl(&url, &["elect", "-l", &path])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    reaper.pids.push(observer.id());
    let seen = lines_of(&mut observer);
    let next = || {
        seen.recv_timeout(Duration::from_secs(10))
            .expect("etcdctl prints the leader")
    };
    assert!(next().starts_with(&format!("{path}/")));
    assert_eq!(next(), value, "etcdctl elect -l reads our value");
    let out = on(&url).args(["leader", &name]).output().unwrap();
    let text = stdout(&out);
    assert!(
        text.starts_with(&format!("{name}: {value}, term ")),
        "{text}"
    );
    assert!(text.contains(&format!(" label={value}")), "{text}");
    std::fs::write(&go, "").unwrap();
    assert_eq!(finish(ours, Duration::from_secs(10)).status.code(), Some(0));

    let theirs = format!("http://10.0.0.9:80/{name}");
    let mut go_leader = etcdctl(&url, &["elect", &path, &theirs])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    reaper.pids.push(go_leader.id());
    let elected = lines_of(&mut go_leader);
    elected
        .recv_timeout(Duration::from_secs(10))
        .expect("etcdctl is elected");
    let out = on(&url).args(["leader", &name]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.starts_with(&format!("{name}: {theirs}, term ")),
        "{text}"
    );
    assert!(
        !text.contains("host="),
        "a Go leader has no identity of ours: {text}"
    );
    let out = on(&url).args(["leader", &name, "--json"]).output().unwrap();
    let shown: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(shown["value"], theirs.as_str(), "{shown}");
    assert!(shown["holder"].is_null(), "{shown}");
    kill(Pid::from_raw(go_leader.id() as i32), Signal::SIGTERM).unwrap();
    let _ = go_leader.wait();
    let _ = observer.kill();
    let _ = observer.wait();
}
