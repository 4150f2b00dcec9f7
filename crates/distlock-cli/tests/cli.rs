//! The `distlock` binary against the in-memory backend (one process) and bad input.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::{BufRead, BufReader},
    process::{Command, Output, Stdio},
};

use distlock::Backend;

fn distlock() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command.env_remove("DISTLOCK_URL");
    command
}

fn output(command: &mut Command) -> Output {
    command.stdin(Stdio::null()).output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Exactly one line on stderr, starting with `distlock:`, and the given exit status.
fn assert_one_line_error(out: &Output, code: i32, needle: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(code), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "expected one line, got: {err}");
    assert!(err.starts_with("distlock: "), "{err}");
    assert!(err.contains(needle), "{err:?} should contain {needle:?}");
}

#[test]
fn bad_urls_unknown_schemes_and_missing_features_give_one_clear_line() {
    let out = output(distlock().args(["--url", "foo://x", "inspect", "k"]));
    assert_one_line_error(&out, 78, "unknown lock URL scheme `foo://`");
    let out = output(distlock().args(["--url", "not a url", "check"]));
    assert_one_line_error(&out, 78, "SCHEME://");
    let out = output(distlock().args(["--url", "memory://x?bogus=1", "check"]));
    assert_one_line_error(&out, 78, "unknown memory:// option `bogus`");
    let out = output(distlock().args(["inspect", "k"]));
    assert_one_line_error(&out, 2, "no coordinator URL");
    let out = output(
        distlock()
            .env("DISTLOCK_URL", "bar://y")
            .args(["inspect", "k"]),
    );
    assert_one_line_error(&out, 78, "unknown lock URL scheme `bar://`");

    for (backend, url) in [
        (Backend::Redis, "redis://127.0.0.1:1"),
        (Backend::Etcd, "etcd://127.0.0.1:1"),
        (Backend::ZooKeeper, "zk://127.0.0.1:1"),
        (Backend::Postgres, "postgres://u:secret@127.0.0.1:1/db"),
    ] {
        let feature = backend.feature().unwrap();
        // What a build without this feature answers (run in every build, `--all-features`
        // included): a configuration error — which the binary prints as one line and exits 78
        // with, as the unknown schemes above show — naming the feature, without the password.
        match Backend::for_url_without(url, backend) {
            Err(distlock::Error::Config(msg)) => {
                assert!(msg.contains(&format!("the `{feature}` feature")), "{msg}");
                assert_eq!(msg.lines().count(), 1, "{msg}");
                assert!(!msg.contains("secret"), "{msg}");
            }
            other => panic!("{url} without `{feature}`: {other:?}, not a configuration error"),
        }
        if backend.is_enabled() {
            continue;
        }
        // This build really lacks it: the binary says so.
        let out = output(distlock().args(["--url", url, "inspect", "k"]));
        assert_one_line_error(&out, 78, &format!("the `{feature}` feature"));
        assert!(!stderr(&out).contains("secret"));
    }
}

#[test]
fn usage_errors_exit_2() {
    let out = output(distlock().args([
        "--url",
        "memory://",
        "run",
        "k",
        "--ttl",
        "soon",
        "--",
        "true",
    ]));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("invalid duration"),
        "{}",
        stderr(&out)
    );
    let out = output(distlock().args(["--url", "memory://", "run", "k"]));
    assert_eq!(out.status.code(), Some(2));
    let out = output(distlock().args(["--url", "memory://", "release", "k"]));
    assert_eq!(out.status.code(), Some(2), "release without --force");
    let out = output(distlock().args(["--url", "memory://", "inspect", ""]));
    assert_one_line_error(&out, 2, "invalid lock key");
    let out = output(distlock().args([
        "--url",
        "memory://",
        "run",
        "k",
        "--ttl",
        "0s",
        "--",
        "true",
    ]));
    assert_one_line_error(&out, 2, "invalid ttl");
    // A lease shorter than a second is lost before it can be renewed: refused before any I/O,
    // for `check` as for `run` (it used to end in 69, 1 or 2 depending on timing).
    for args in [
        &["check", "--ttl", "1ms"][..],
        &["run", "k", "--ttl", "500ms", "--", "true"][..],
    ] {
        let out = output(distlock().args(["--url", "redis://127.0.0.1:1"]).args(args));
        assert_one_line_error(&out, 2, "distlock needs at least 1.0s");
    }
}

#[test]
fn run_passes_key_and_fencing_token_and_the_exit_status() {
    let out = output(distlock().args([
        "--url",
        "memory://t",
        "run",
        "jobs/nightly",
        "--",
        "sh",
        "-c",
        "echo \"$DISTLOCK_KEY $DISTLOCK_FENCING_TOKEN\"; exit 7",
    ]));
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    assert_eq!(stdout(&out), "jobs/nightly 1\n");
    assert_eq!(stderr(&out), "");

    let out = output(distlock().args(["--url", "memory://t", "run", "k", "--", "true"]));
    assert_eq!(out.status.code(), Some(0));
    let out = output(distlock().args([
        "--url",
        "memory://t",
        "run",
        "k",
        "--",
        "sh",
        "-c",
        "kill -KILL $$",
    ]));
    assert_eq!(out.status.code(), Some(128 + 9));
}

#[test]
fn run_reports_a_missing_command() {
    let out = output(distlock().args(["--url", "memory://", "run", "k", "--", "/nonexistent/cmd"]));
    assert_one_line_error(&out, 127, "cannot run /nonexistent/cmd");
}

#[test]
fn the_command_runs_in_its_own_process_group() {
    // Field 5 of /proc/PID/stat is the process group id. The command leads a group of its own;
    // distlock is in another, and so is distlock's guard process (which signals the command's
    // group from outside it, so that stopping that group never stops the guard).
    let out = output(distlock().args([
        "--url",
        "memory://",
        "run",
        "k",
        "--",
        "sh",
        "-c",
        "g=$(cut -d' ' -f5 /proc/$$/stat); echo $$ $g $(cut -d' ' -f5 /proc/$PPID/stat); \
         for p in /proc/[0-9]*; do c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); case \"$c\" in \
         \"distlock __guard --parent $PPID \"*) echo guard $(cut -d' ' -f5 $p/stat);; esac; done",
    ]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    let mut lines = text.lines();
    let fields: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(fields.len(), 3, "{text}");
    assert_eq!(fields[0], fields[1], "the command leads its group: {text}");
    assert_ne!(fields[1], fields[2], "distlock is in another group: {text}");
    let guard: Vec<&str> = lines
        .next()
        .unwrap_or_else(|| panic!("no guard process found: {text}"))
        .split_whitespace()
        .collect();
    assert_eq!(guard[0], "guard", "{text}");
    assert_ne!(
        guard[1], fields[1],
        "the guard is outside the command's group: {text}"
    );
}

#[test]
fn sigterm_sigint_sighup_and_sigquit_are_forwarded_to_the_command() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    for (name, signal, code) in [
        ("TERM", Signal::SIGTERM, 42),
        ("INT", Signal::SIGINT, 43),
        ("HUP", Signal::SIGHUP, 44),
        ("QUIT", Signal::SIGQUIT, 45),
    ] {
        let mut child = distlock()
            .args([
                "--url",
                "memory://",
                "run",
                "k",
                "--",
                "sh",
                "-c",
                "trap 'echo got TERM; exit 42' TERM; trap 'echo got INT; exit 43' INT; \
                 trap 'echo got HUP; exit 44' HUP; trap 'echo got QUIT; exit 45' QUIT; echo ready; \
                 while :; do sleep 0.1; done",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert_eq!(lines.next().unwrap().unwrap(), "ready");
        let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
        kill(pid, signal).unwrap();
        let out = child.wait_with_output().unwrap();
        assert_eq!(lines.next().unwrap().unwrap(), format!("got {name}"));
        assert_eq!(out.status.code(), Some(code), "{}", stderr(&out));
    }
}

#[test]
fn check_passes_on_the_memory_backend() {
    let out = output(distlock().args(["--url", "memory://", "check"]));
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(text.starts_with("backend: memory\n"), "{text}");
    assert!(
        text.contains("fencing tokens:     in this process only"),
        "{text}"
    );
    assert!(
        text.contains("self-test on distlock-check/self-test"),
        "{text}"
    );
    assert!(text.contains("fencing token 2 > 1"), "{text}");
    assert!(text.ends_with("result: OK\n"), "{text}");
}

#[test]
fn inspect_and_release_of_a_free_key() {
    // Like grep: 0 when held, 1 when free.
    let out = output(distlock().args(["--url", "memory://", "inspect", "k", "--json"]));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(value["key"], "k");
    assert_eq!(value["held"], false);
    assert_eq!(value["backend"], "memory");
    assert!(value["fencing_token"].is_null());

    let out = output(distlock().args(["--url", "memory://", "inspect", "k"]));
    assert_eq!(stdout(&out), "k: free\n");
    assert_eq!(out.status.code(), Some(1));

    // Nothing released is not a success.
    let out = output(distlock().args(["--url", "memory://", "release", "--force", "k"]));
    assert_one_line_error(&out, 1, "not held; nothing released");
}

#[test]
fn help_documents_the_exit_codes() {
    let out = output(distlock().arg("--help"));
    let text = stdout(&out);
    for code in ["75 ", "76 ", "69 ", "78 ", "128+N"] {
        assert!(text.contains(code), "{code} missing from --help:\n{text}");
    }
}

#[test]
fn metrics_flag_prints_a_prometheus_snapshot_without_tokens() {
    let out = output(distlock().args(["--url", "memory://metrics", "--metrics", "check"]));
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("distlock_acquire_total{backend=\"memory\""),
        "{err}"
    );
    assert!(err.contains("distlock_release_total"), "{err}");
    assert!(err.contains("distlock_hold_seconds"), "{err}");
    let quiet = output(distlock().args(["--url", "memory://metrics", "check"]));
    assert!(!stderr(&quiet).contains("distlock_acquire_total"));
}

/// The URL may carry a password: the command does not inherit DISTLOCK_URL, and with
/// --url-file the URL is neither in distlock's command line nor in anyone's environment.
#[test]
fn the_url_stays_out_of_the_commands_environment_and_of_ps() {
    let show = "env; echo; tr '\\0' ' ' < /proc/$PPID/cmdline";
    let out = output(
        distlock()
            .env("DISTLOCK_URL", "memory://s3cret")
            .args(["run", "k", "--", "sh", "-c", show]),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stdout(&out).contains("s3cret"), "{}", stdout(&out));
    assert!(stdout(&out).contains("DISTLOCK_KEY=k"), "{}", stdout(&out));

    let dir = std::env::temp_dir().join(format!("distlock-cli-urlfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("url");
    std::fs::write(&file, "memory://s3cret\n").unwrap();
    let out = output(
        distlock()
            .arg("--url-file")
            .arg(&file)
            .args(["run", "k", "--", "sh", "-c", show]),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(!text.contains("s3cret"), "{text}");
    assert!(
        text.contains("--url-file"),
        "the parent is distlock: {text}"
    );
    let out = output(
        distlock()
            .env("DISTLOCK_URL_FILE", &file)
            .args(["inspect", "k"]),
    );
    assert_eq!(stdout(&out), "k: free\n", "{}", stderr(&out));

    // A flag on the command line wins over the environment, whichever it is.
    let out = output(
        distlock()
            .env("DISTLOCK_URL", "bar://from-env")
            .arg("--url-file")
            .arg(&file)
            .args(["inspect", "k"]),
    );
    assert_eq!(stdout(&out), "k: free\n", "{}", stderr(&out));
    let out = output(
        distlock()
            .env("DISTLOCK_URL_FILE", "/nonexistent/url")
            .args(["--url", "memory://", "inspect", "k"]),
    );
    assert_eq!(stdout(&out), "k: free\n", "{}", stderr(&out));

    // The file is what is used: a bad URL in it is reported as such.
    std::fs::write(&file, "memory://x?bogus=1\n").unwrap();
    let out = output(distlock().arg("--url-file").arg(&file).args(["check"]));
    assert_one_line_error(&out, 78, "unknown memory:// option `bogus`");
    let out = output(distlock().args(["--url-file", "/nonexistent/url", "check"]));
    assert_one_line_error(&out, 78, "cannot read the URL file /nonexistent/url");
    let out = output(
        distlock()
            .arg("--url-file")
            .arg(&file)
            .args(["--url", "memory://", "check"]),
    );
    assert_eq!(out.status.code(), Some(2), "--url and --url-file conflict");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--kill-after` the lease cannot cover is refused before any I/O (the URL is unreachable).
#[test]
fn a_kill_after_the_lease_cannot_cover_is_refused_before_connecting() {
    let out = output(distlock().args([
        "--url",
        "redis://127.0.0.1:1",
        "run",
        "k",
        "--ttl",
        "3s",
        "--kill-after",
        "2s",
        "--",
        "true",
    ]));
    assert_one_line_error(
        &out,
        2,
        "--kill-after 2.0s is more than the lease can cover",
    );
}

/// With --wait-group the lock is held until the command's whole process group is gone, not
/// only its top process; without it, distlock returns when the top process exits.
#[test]
fn wait_group_holds_until_background_processes_are_gone() {
    let dir = std::env::temp_dir().join(format!("distlock-cli-group-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let late = dir.join("late");
    let script = format!("(sleep 1; touch {}) > /dev/null 2>&1 &", late.display());
    let out = output(distlock().args([
        "--url",
        "memory://",
        "run",
        "--wait-group",
        "k",
        "--",
        "sh",
        "-c",
        &script,
    ]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        late.exists(),
        "distlock returned before the background process ended"
    );
    std::fs::remove_file(&late).unwrap();

    let out =
        output(distlock().args(["--url", "memory://", "run", "k", "--", "sh", "-c", &script]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        !late.exists(),
        "without --wait-group only the top process is waited for"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A refused connection is one line with the backend, the address and the cause, and no
/// client library's debug output or credentials.
#[test]
fn a_refused_connection_is_one_line_with_the_address_and_the_cause() {
    for (backend, url) in [
        (Backend::Redis, "redis://127.0.0.1:1"),
        (Backend::Etcd, "etcd://127.0.0.1:1"),
        (Backend::ZooKeeper, "zk://127.0.0.1:1"),
        (Backend::Postgres, "postgres://u:secret@127.0.0.1:1/db"),
    ] {
        if !backend.is_enabled() {
            continue;
        }
        let out = output(distlock().args(["--url", url, "inspect", "k"]));
        assert_one_line_error(&out, 69, "at 127.0.0.1:1");
        let err = stderr(&out);
        assert!(err.to_lowercase().contains("refused"), "{err}");
        for noise in ["source:", "tonic::", "Os {", "secret"] {
            assert!(!err.contains(noise), "{err}");
        }
    }
}

/// `distlock run KEY CMD` (no `--`) says where the command goes.
#[test]
fn a_run_without_the_separator_gets_a_hint() {
    let out = output(distlock().args(["--url", "memory://", "run", "k", "true"]));
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("unexpected argument 'true'"), "{err}");
    assert!(err.contains("hint: the command goes after `--`"), "{err}");
}

/// Flags users reach for: `-c` (like flock), `--timeout` for `--wait`, `-v` with the fencing
/// token, `--json` events, a `d` unit.
#[test]
fn flock_style_flags_verbose_and_json_events() {
    let out = output(distlock().args([
        "--url",
        "memory://",
        "run",
        "k",
        "--timeout",
        "1d",
        "-v",
        "-c",
        "echo \"token $DISTLOCK_FENCING_TOKEN\"; exit 3",
    ]));
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert_eq!(stdout(&out), "token 1\n");
    let err = stderr(&out);
    assert!(
        err.contains("distlock: acquired k (fencing token 1)"),
        "{err}"
    );
    assert!(err.contains("distlock: released k"), "{err}");

    let out = output(distlock().args(["--url", "memory://", "run", "k", "--json", "--", "true"]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let events: Vec<serde_json::Value> = stderr(&out)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0]["event"], "acquired");
    assert_eq!(events[0]["fencing_token"], 1);
    assert_eq!(events[1]["event"], "exit");
    assert_eq!(events[1]["status"], 0);

    let out = output(distlock().args(["--url", "memory://", "run", "k", "-c", "x", "--", "y"]));
    assert_eq!(
        out.status.code(),
        Some(2),
        "-c and a command after -- conflict"
    );
}

/// The guard killed on its own (the command kills it here): nothing would stop the command if
/// distlock died next, so distlock terminates the command and exits 70.
#[test]
fn a_killed_guard_process_gets_the_command_terminated() {
    let started = std::time::Instant::now();
    let out = output(distlock().args([
        "--url",
        "memory://",
        "run",
        "k",
        "--",
        "sh",
        "-c",
        "for p in /proc/[0-9]*; do c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); case \"$c\" in \
         \"distlock __guard --parent $PPID \"*) kill -KILL ${p#/proc/};; esac; done; sleep 20",
    ]));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(70), "{err}");
    assert!(err.contains("guard process"), "{err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "{err}"
    );
}

/// `run` of a file that exists but cannot be executed exits 126, one line naming it (127 is
/// for a command that does not exist, above).
#[test]
fn run_of_a_command_that_cannot_be_executed_exits_126() {
    let path = std::env::temp_dir().join(format!("distlock-not-exec-{}", std::process::id()));
    std::fs::write(&path, "#!/bin/sh\necho ran\n").unwrap();
    // rw-r--r--: present, not executable (not even for root).
    let mut mode = std::fs::metadata(&path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut mode, 0o644);
    std::fs::set_permissions(&path, mode).unwrap();
    let out = output(
        distlock()
            .args(["--url", "memory://", "run", "k", "--"])
            .arg(&path),
    );
    let _ = std::fs::remove_file(&path);
    assert_eq!(out.status.code(), Some(126), "{}", stderr(&out));
    assert!(!stdout(&out).contains("ran"), "{}", stdout(&out));
    assert!(
        stderr(&out).contains(path.to_str().unwrap()),
        "{}",
        stderr(&out)
    );
}

/// The coordinator unreachable for every command that needs it exits 69 (`check`, `inspect`,
/// `release --force`, `run`), one line each.
#[test]
fn an_unreachable_coordinator_exits_69_for_every_command() {
    if !Backend::Redis.is_enabled() {
        return;
    }
    for args in [
        &["check"][..],
        &["inspect", "k"][..],
        &["release", "--force", "--yes", "k"][..],
        &["run", "k", "--", "true"][..],
    ] {
        let out = output(distlock().args(["--url", "redis://127.0.0.1:1"]).args(args));
        assert_one_line_error(&out, 69, "127.0.0.1:1");
    }
}

/// Runs `distlock ARGS` on a terminal (util-linux `script` gives it one) with `answer` typed in.
fn on_a_terminal(args: &[&str], answer: &str) -> Output {
    let quoted: Vec<String> = std::iter::once(env!("CARGO_BIN_EXE_distlock"))
        .chain(args.iter().copied())
        .map(|a| format!("'{}'", a.replace('\'', r"'\''")))
        .collect();
    let mut child = Command::new("script")
        .args(["-q", "-e", "-c", &quoted.join(" "), "/dev/null"])
        .env_remove("DISTLOCK_URL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("util-linux script");
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), answer.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// `release --force` without `--yes` shows the holder and the warning and asks: off a terminal it
/// refuses (2) and releases nothing; on a terminal "n" releases nothing (1) and "y" removes
/// exactly that grant (0).
#[test]
fn release_force_asks_for_confirmation() {
    if !Backend::Redis.is_enabled() {
        return;
    }
    let Some(url) = conformance::backend_url("DISTLOCK_TEST_REDIS_URL") else {
        return;
    };
    let has_script = Command::new("script").arg("--version").output().is_ok();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let holder = runtime.block_on(distlock::connect(&url)).unwrap();
    let key = conformance::fresh_key("cli-confirm");
    let ttl = std::time::Duration::from_secs(60);
    let lease = runtime
        .block_on(holder.try_acquire(&key, ttl))
        .unwrap()
        .expect("a fresh key");
    let held = || {
        runtime
            .block_on(holder.inspect(&key))
            .unwrap()
            .is_some_and(|h| h.fencing_token == lease.fencing_token())
    };
    let args = ["--url", url.as_str(), "release", "--force", key.as_str()];

    let out = output(distlock().args(args));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("{key} is held by")), "{err}");
    assert!(
        err.contains("fencing tokens"),
        "the warning is shown: {err}"
    );
    assert!(
        err.contains("stdin is not a terminal (pass --yes)"),
        "{err}"
    );
    assert!(held(), "refused, yet released");

    if !has_script {
        assert!(
            !conformance::backends_required(),
            "util-linux `script` is needed for the terminal half of this test"
        );
        return;
    }
    let out = on_a_terminal(&args, "n\n");
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!("Force-release {key}? [y/N]")),
        "{text}"
    );
    assert!(text.contains("not released"), "{text}");
    assert!(held(), "answered n, yet released");

    let out = on_a_terminal(&args, "y\n");
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains(&format!("released {key}")), "{text}");
    assert!(!held(), "answered y, yet still held");
    assert!(!runtime.block_on(holder.release(&lease)).unwrap());
}
