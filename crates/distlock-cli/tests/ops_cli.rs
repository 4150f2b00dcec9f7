//! What an operator meets around the edges, driven through the real binary on private servers
//! (an evicting Redis, a Redis that goes away, an etcd that is frozen) and the shared ones:
//! `conformance` gated on the audit and telling an outage from a failure, a frozen etcd that
//! must not hold distlock's exit back, a stalled stderr, a closed stdout under `leader
//! --watch`, and the small messages. `DISTLOCK_TEST_BIN` runs them against another build of
//! `distlock` (how they were seen red before the fixes).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use support::{output_within, wait_output};

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use conformance::servers::{PrivateServer, ServerKind, free_port};
use distlock::Backend;

/// The binary under test: this build's, or `DISTLOCK_TEST_BIN`.
fn bin() -> String {
    std::env::var("DISTLOCK_TEST_BIN")
        .ok()
        .filter(|b| !b.is_empty())
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_distlock").to_owned())
}

/// `distlock --url URL ARGS..` with no URL from the environment.
fn distlock(url: &str, args: &[&str]) -> Command {
    let mut command = Command::new(bin());
    command
        .env_remove("DISTLOCK_URL")
        .env_remove("DISTLOCK_URL_FILE")
        .arg("--url")
        .arg(url)
        .args(args)
        .stdin(Stdio::null());
    command
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Whether `program` runs here; under `DISTLOCK_REQUIRE_BACKENDS=1` it must.
fn have(program: &str) -> bool {
    let found = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(
        found || !conformance::backends_required(),
        "{program} is needed (DISTLOCK_REQUIRE_BACKENDS=1)"
    );
    found
}

/// A private Redis started with `args`, or `None` where Redis cannot run here (allowed only
/// without `DISTLOCK_REQUIRE_BACKENDS=1`).
fn private_redis(args: &[&str]) -> Option<PrivateServer> {
    if !Backend::Redis.is_enabled() {
        assert!(
            !conformance::backends_required(),
            "redis is not compiled in: build with --all-features"
        );
        return None;
    }
    if !have("redis-server") {
        return None;
    }
    Some(PrivateServer::start_blocking_with(
        ServerKind::Redis,
        free_port(),
        args,
    ))
}

/// Item 5: `conformance` against an `allkeys-lru` Redis (which `check` grades FAIL) is
/// refused with 1 and a line naming the failing setting before any property runs; with
/// `--accept-audit-failures` it runs and says the FAIL was accepted.
#[test]
fn conformance_refuses_a_deployment_that_fails_the_audit() {
    let Some(server) = private_redis(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])
    else {
        return;
    };
    let url = server.url();
    let dir = support::temp_dir("conformance-audit");
    let junit = dir.join("junit.xml");
    let out = output_within(
        distlock(
            &url,
            &[
                "conformance",
                "--only",
                "fencing_tokens_strictly_increase",
                "--junit",
                junit.to_str().unwrap(),
            ],
        ),
        Duration::from_secs(60),
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("distlock: conformance refused: the audit grades")
            && first.contains("maxmemory-policy")
            && first.contains("--accept-audit-failures"),
        "{stderr}"
    );
    assert!(
        !stdout.contains("fencing_tokens_strictly_increase"),
        "a property ran: {stdout}"
    );
    let xml = std::fs::read_to_string(&junit).unwrap();
    assert!(
        xml.contains("name=\"audit\"") && xml.contains("<failure"),
        "{xml}"
    );

    let out = output_within(
        distlock(
            &url,
            &[
                "conformance",
                "--accept-audit-failures",
                "--only",
                "fencing_tokens_strictly_increase",
            ],
        ),
        Duration::from_secs(60),
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("fencing_tokens_strictly_increase ... ok"),
        "{stdout}"
    );
    assert!(
        stdout.contains("1 FAIL accepted (--accept-audit-failures)"),
        "{stdout}"
    );
}

/// Item 5: a Redis that goes away in the middle of `conformance` is an outage: 69, and a line
/// naming the property during which it went — not a pile of property failures with 1.
#[test]
fn an_outage_during_conformance_is_69_naming_the_property() {
    let Some(server) = private_redis(&[]) else {
        return;
    };
    let mut child = distlock(&server.url(), &["conformance"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (lines, seen) = mpsc::channel();
    let reader = thread::spawn(move || {
        let mut all = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let line = line.unwrap();
            let _ = lines.send(line.clone());
            all.push(line);
        }
        all
    });
    // Some properties have passed: the server is killed while the suite runs.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut passed = 0;
    while passed < 3 {
        let line = seen
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("three properties pass within 60 s");
        if line.starts_with('[') && line.contains(" ... ok") {
            passed += 1;
        }
    }
    server.ctl_blocking("kill");
    let out = wait_output(child, Duration::from_secs(120));
    let stdout = reader.join().unwrap().join("\n");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stdout}\n{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("became unreachable during "))
        .unwrap_or_else(|| panic!("no outage line: {stderr}"));
    let named = line
        .split("became unreachable during ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap();
    assert!(
        conformance::suite::properties()
            .iter()
            .any(|p| p.name == named),
        "not a property's name: {named:?} in {line}"
    );
    assert!(line.contains("not a property failure"), "{line}");
    assert!(!stdout.contains("FAILED"), "counted as failures: {stdout}");
}

/// Whether process `pid` is gone (or a zombie).
fn is_dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| matches!(state, "Z" | "X")),
    }
}

/// Waits for `path` to hold a pid and returns it.
fn read_pid(path: &std::path::Path, child: &mut Child) -> i32 {
    support::wait_for_file(path, child, Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(pid) = std::fs::read_to_string(path).unwrap().trim().parse() {
            return pid;
        }
        assert!(Instant::now() < deadline, "no pid in {}", path.display());
        thread::sleep(Duration::from_millis(10));
    }
}

/// Item 6: an etcd frozen (SIGSTOP) under `run`: the guard kills the command before the
/// lease's deadline, and then distlock exits 76 within one --kill-after + 1 s of the command's
/// death, whatever the server does (it stays frozen) — it used to wait ~15 s more for the
/// release and the background clean-ups.
#[test]
fn a_frozen_etcd_does_not_hold_back_the_exit_after_the_kill() {
    if !Backend::Etcd.is_enabled() {
        assert!(!conformance::backends_required(), "etcd is not compiled in");
        return;
    }
    if !have("etcd") {
        return;
    }
    let server = PrivateServer::start_blocking(ServerKind::Etcd, free_port());
    let dir = support::temp_dir("frozen-etcd");
    let pid_file = dir.join("pid");
    let kill_after = Duration::from_secs(1);
    let mut child = distlock(
        &server.url(),
        &[
            "run",
            "--ttl",
            "6s",
            "--kill-after",
            "1s",
            &support::fresh_key("frozen-etcd"),
            "--",
            "sh",
            "-c",
        ],
    )
    .arg(format!("echo $$ > {}; exec sleep 600", pid_file.display()))
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let command = read_pid(&pid_file, &mut child);
    server.ctl_blocking("pause");
    let frozen = Instant::now();
    while !is_dead(command) {
        assert!(
            frozen.elapsed() < Duration::from_secs(20),
            "the command outlived the lease (6 s) by far"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("distlock exited ({status}) before its command died");
        }
        thread::sleep(Duration::from_millis(5));
    }
    let died = Instant::now();
    let out = wait_output(child, Duration::from_secs(60));
    let after = died.elapsed();
    server.ctl_blocking("resume");
    let stderr = text(&out.stderr);
    eprintln!(
        "command killed {:?} after the freeze; distlock exited {after:?} after that",
        died - frozen
    );
    assert_eq!(out.status.code(), Some(76), "{stderr}");
    assert!(
        after <= kill_after + Duration::from_secs(1),
        "distlock exited {after:?} after its command died (at most --kill-after + 1 s): {stderr}"
    );
}

/// The shared Redis, or `None` where it is not configured (allowed only without
/// `DISTLOCK_REQUIRE_BACKENDS=1`).
fn shared_redis() -> Option<String> {
    if !Backend::Redis.is_enabled() {
        assert!(
            !conformance::backends_required(),
            "redis is not compiled in: build with --all-features"
        );
        return None;
    }
    conformance::backend_url("DISTLOCK_TEST_REDIS_URL")
}

/// Field `n` (1-based, after the command name) of /proc/PID/stat: 1 the state, 3 the group.
fn stat_field(pid: i32, n: usize) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(n - 1).map(str::to_owned)
}

/// The pid of the guard process of the `distlock run` whose pid is `supervisor`.
fn guard_of(supervisor: u32) -> i32 {
    let want = format!("distlock\0__guard\0--parent\0{supervisor}\0");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            if std::fs::read(entry.path().join("cmdline"))
                .is_ok_and(|c| c.starts_with(want.as_bytes()))
            {
                return pid;
            }
        }
        assert!(Instant::now() < deadline, "no guard for {supervisor}");
        thread::sleep(Duration::from_millis(10));
    }
}

/// A command that first fills its stderr — the same pipe as distlock's and its guard's, which
/// the test never reads — from a background process that stays blocked on it, then writes its
/// pid to `pid_file` and works; it ignores SIGTERM when `stubborn`.
fn stderr_filling_command(pid_file: &std::path::Path, stubborn: bool) -> String {
    format!(
        "{}(head -c 1000000 /dev/zero >&2 &); sleep 0.5; echo $$ > {}; while :; do sleep 0.05; done",
        if stubborn { "trap '' TERM; " } else { "" },
        pid_file.display()
    )
}

/// Item 8: distlock's stderr is a pipe nobody reads (filled up): after a force-release the
/// supervisor still terminates the command and exits 76 — its messages must not block it (it
/// used to hang in the write of "lost the lock", before telling the guard).
#[test]
fn a_stalled_stderr_does_not_block_the_supervisor_after_a_loss() {
    let Some(url) = shared_redis() else {
        return;
    };
    let dir = support::temp_dir("stalled-stderr");
    let pid_file = dir.join("pid");
    let key = support::fresh_key("stalled-stderr");
    let mut child = distlock(&url, &["run", "--ttl", "4s", &key, "--", "sh", "-c"])
        .arg(stderr_filling_command(&pid_file, false))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Held, never read.
    let _stderr = child.stderr.take().unwrap();
    let command = read_pid(&pid_file, &mut child);
    let out = output_within(
        distlock(&url, &["release", "--force", "--yes", &key]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let released = Instant::now();
    let within = Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if released.elapsed() > within {
            let alive = !is_dead(command);
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "distlock still running {within:?} after the force-release (its command alive: \
                 {alive}): blocked on its stderr"
            );
        }
        thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(76));
    assert!(is_dead(command), "the command survived");
}

/// Item 8: stderr stalled and distlock frozen (SIGSTOP), its command ignoring SIGTERM: the
/// guard still SIGKILLs the command's group before the lease's local deadline — its own
/// message ("the lease was not renewed in time") must not block it between the SIGTERM and
/// the SIGKILL.
#[test]
fn a_stalled_stderr_does_not_block_the_guard() {
    let Some(url) = shared_redis() else {
        return;
    };
    let dir = support::temp_dir("stalled-guard");
    let pid_file = dir.join("pid");
    let ttl = Duration::from_secs(3);
    let mut child = distlock(
        &url,
        &[
            "run",
            "--ttl",
            "3s",
            &support::fresh_key("stalled-guard"),
            "--",
            "sh",
            "-c",
        ],
    )
    .arg(stderr_filling_command(&pid_file, true))
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let _stderr = child.stderr.take().unwrap();
    let command = read_pid(&pid_file, &mut child);
    let supervisor = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(supervisor, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let frozen = Instant::now();
    // The lease's local deadline is at most a TTL after the freeze (the last renewal came
    // before it); the guard SIGKILLs a margin before that.
    let by = ttl + Duration::from_millis(500);
    while !is_dead(command) && frozen.elapsed() < by {
        thread::sleep(Duration::from_millis(5));
    }
    let dead = is_dead(command);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        dead,
        "the command (ignoring SIGTERM) was still alive {by:?} after distlock froze: the guard \
         did not SIGKILL it"
    );
}

/// Item 8: `kill -STOP -PGID` of the command's process group (what a terminal's Ctrl-Z does
/// to the foreground group) stops the command, not its guard; distlock then SIGKILLed, the
/// guard still terminates the (stopped) group within --kill-after.
#[test]
fn stopping_the_commands_group_does_not_stop_its_guard() {
    let Some(url) = shared_redis() else {
        return;
    };
    let dir = support::temp_dir("stop-group");
    let pid_file = dir.join("pid");
    let mut child = distlock(
        &url,
        &[
            "run",
            "--ttl",
            "30s",
            "--kill-after",
            "2s",
            &support::fresh_key("stop-group"),
            "--",
            "sh",
            "-c",
        ],
    )
    .arg(format!(
        "echo $$ > {}; while :; do sleep 0.05; done",
        pid_file.display()
    ))
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let command = read_pid(&pid_file, &mut child);
    let guard = guard_of(child.id());
    let group: i32 = stat_field(command, 3).unwrap().parse().unwrap();
    let pgid = nix::unistd::Pid::from_raw(group);
    nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while stat_field(command, 1).as_deref() != Some("T") {
        assert!(Instant::now() < deadline, "the command was not stopped");
        thread::sleep(Duration::from_millis(10));
    }
    thread::sleep(Duration::from_millis(200));
    let guard_state = stat_field(guard, 1);
    child.kill().unwrap();
    let killed = Instant::now();
    let _ = child.wait();
    while !is_dead(command) && killed.elapsed() < Duration::from_secs(5) {
        thread::sleep(Duration::from_millis(10));
    }
    let dead = is_dead(command);
    if !dead {
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(guard),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert_ne!(
        guard_state.as_deref(),
        Some("T"),
        "the guard (pid {guard}) was stopped with the command's group {group}"
    );
    assert!(
        dead,
        "the stopped command outlived distlock by 5 s (--kill-after 2s)"
    );
}

/// Item 7: `distlock leader --watch NAME | head -1` ends when `head` does — at once, with
/// 141 (as for SIGPIPE) — not at the next change of leader (none comes here: nobody leads),
/// on every coordinator.
#[test]
fn leader_watch_ends_when_its_reader_goes() {
    support::on_every_backend("leader_watch_ends_when_its_reader_goes", |backend, url| {
        let name = support::fresh_key("watch-head").replace('/', "-");
        let mut child = distlock(&url, &["leader", "--watch", &name])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        stdout.read_line(&mut first).unwrap();
        assert!(!first.is_empty(), "{backend}: no first line");
        // `head -1` exits.
        drop(stdout);
        let closed = Instant::now();
        let out = wait_output(child, Duration::from_secs(30));
        let took = closed.elapsed();
        eprintln!("{backend}: leader --watch exited {took:?} after its reader went");
        assert_eq!(
            out.status.code(),
            Some(141),
            "{backend}: {}",
            text(&out.stderr)
        );
        assert!(
            took < Duration::from_secs(3),
            "{backend}: leader --watch noticed its closed stdout only after {took:?}"
        );
        assert_eq!(text(&out.stderr), "", "{backend}: exits quietly");
    });
}

/// Item 10: a negative duration is refused with "duration must be ≥ 0" (it was clap's raw
/// "unexpected argument '-1' found"), for every duration option.
#[test]
fn negative_durations_say_they_must_not_be_negative() {
    let Some(url) = shared_redis() else {
        return;
    };
    for args in [
        &["run", "--ttl", "-1s", "k", "--", "true"][..],
        &["run", "--wait", "-5", "k", "--", "true"],
        &["run", "--kill-after=-1s", "k", "--", "true"],
        &["elect", "--ttl", "-2s", "e", "--", "true"],
        &["leader", "--watch", "--every", "-1s", "e"],
        &["check", "--ttl", "-1s"],
    ] {
        let out = output_within(distlock(&url, args), Duration::from_secs(20));
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("duration must be ≥ 0"), "{args:?}: {err}");
    }
}

/// Item 10: a URL file whose first line is blank names the file and the line (it said the
/// file was "empty"); an empty file is still "empty".
#[test]
fn a_blank_line_in_the_url_file_is_named() {
    let Some(url) = shared_redis() else {
        return;
    };
    let dir = support::temp_dir("url-file");
    let file = dir.join("url");
    std::fs::write(&file, format!("\n{url}\n")).unwrap();
    let mut command = Command::new(bin());
    command
        .env_remove("DISTLOCK_URL")
        .arg("--url-file")
        .arg(&file)
        .args(["inspect", "k"])
        .stdin(Stdio::null());
    let out = output_within(command, Duration::from_secs(20));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{err}");
    assert!(
        err.contains(&file.display().to_string()) && err.contains("line 1 is blank"),
        "{err}"
    );
    assert!(err.contains("line 2"), "{err}");
    assert!(!err.contains(&url), "the URL leaked: {err}");
    std::fs::write(&file, "\n  \n").unwrap();
    let mut command = Command::new(bin());
    command
        .env_remove("DISTLOCK_URL")
        .arg("--url-file")
        .arg(&file)
        .args(["inspect", "k"])
        .stdin(Stdio::null());
    let out = output_within(command, Duration::from_secs(20));
    assert!(
        text(&out.stderr).contains("is empty"),
        "{}",
        text(&out.stderr)
    );
}

/// Item 10: a TTL below ZooKeeper's minimum (its session timeout) says how to lower it.
#[test]
fn zookeepers_min_ttl_error_says_how_to_lower_it() {
    if !Backend::ZooKeeper.is_enabled() {
        assert!(!conformance::backends_required(), "zk is not compiled in");
        return;
    }
    let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
        return;
    };
    // The default session timeout (10 s) is the minimum TTL.
    let out = output_within(
        distlock(
            &url,
            &[
                "run",
                "--ttl",
                "2s",
                &support::fresh_key("zk-min"),
                "--",
                "true",
            ],
        ),
        Duration::from_secs(30),
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("minimum ttl") && err.contains("session_timeout=2000ms"),
        "{err}"
    );
}

/// Item 10: `inspect` shows the holder's `since=` as RFC 3339 and an age, not a raw epoch, on
/// every coordinator.
#[test]
fn inspect_shows_since_as_a_date_and_an_age() {
    support::on_every_backend(
        "inspect_shows_since_as_a_date_and_an_age",
        |backend, url| {
            let key = support::fresh_key("since");
            let dir = support::temp_dir("since");
            let started = dir.join("started");
            let mut holder = distlock(&url, &["run", "--ttl", "10s", &key, "--", "sh", "-c"])
                .arg(format!("touch {}; sleep 30", started.display()))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            support::wait_for_file(&started, &mut holder, Duration::from_secs(30));
            let out = output_within(distlock(&url, &["inspect", &key]), Duration::from_secs(20));
            let _ = holder.kill();
            let _ = holder.wait();
            let stdout = text(&out.stdout);
            assert_eq!(out.status.code(), Some(0), "{backend}: {stdout}");
            let since = stdout
                .split("since=")
                .nth(1)
                .unwrap_or_else(|| panic!("{backend}: no since= in {stdout}"));
            let date = &since[..20];
            assert!(
                date.len() == 20
                    && date.as_bytes()[4] == b'-'
                    && date.as_bytes()[10] == b'T'
                    && date.ends_with('Z'),
                "{backend}: not RFC 3339: {stdout}"
            );
            assert!(
                since[20..].starts_with(" (") && since.contains(" s ago)"),
                "{backend}: no age: {stdout}"
            );
        },
    );
}

/// Item 10: a failed conformance property is printed as the property, what it checked and
/// what happened — with the driver's error as a sentence — instead of Rust `Debug` and a
/// panic backtrace. (A Redis whose PEXPIRE is renamed away fails renewals.)
#[test]
fn conformance_failures_are_sentences() {
    let Some(server) = private_redis(&["--rename-command", "PEXPIRE", "pexpire-renamed-away"])
    else {
        return;
    };
    let out = output_within(
        distlock(
            &server.url(),
            &[
                "conformance",
                "--accept-audit-failures",
                "--only",
                "renew_extends_the_lease",
            ],
        ),
        Duration::from_secs(120),
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stdout.contains("property: renew_extends_the_lease (failed at "),
        "{stdout}"
    );
    assert!(
        stdout.contains("happened: redis backend during renew: "),
        "{stdout}"
    );
    assert!(!stdout.contains("Backend {"), "Debug output: {stdout}");
    assert!(!stderr.contains("panicked at"), "a panic message: {stderr}");
}

/// Item 10: `check`'s text output gives the audit's verdict at the end of the audit, and the
/// self-test's under the self-test (the audit's clock finding used to be printed there).
#[test]
fn check_prints_each_verdict_under_its_own_heading() {
    let Some(url) = shared_redis() else {
        return;
    };
    let out = output_within(distlock(&url, &["check"]), Duration::from_secs(60));
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let self_test = stdout.find("self-test on ").expect("a self-test heading");
    let audit_verdict = stdout
        .find("  audit verdict: ok")
        .unwrap_or_else(|| panic!("no audit verdict: {stdout}"));
    assert!(audit_verdict < self_test, "{stdout}");
    let tail = &stdout[self_test..];
    assert!(tail.contains("  self-test verdict: ok"), "{stdout}");
    assert!(
        !tail.contains("clock"),
        "an audit finding under the self-test: {stdout}"
    );
    assert!(stdout.ends_with("result: OK\n"), "{stdout}");
}
