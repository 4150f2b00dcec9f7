//! Server crash and restart mid-hold, on a private PostgreSQL instance this test starts (initdb
//! into a temp dir, a port in 25500-25599) and stops by `pg_ctl` — never the shared server.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{
    net::TcpStream,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use conformance::{backends_required, fresh_key};
use lock_core::{DistributedLock, FencingToken};
use lock_pg::PgLock;

const LONG: Duration = Duration::from_secs(30);

struct OwnPostgres {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_root: bool,
}

fn pg_bindir() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|d| d.join("pg_ctl").exists() && d.join("initdb").exists())
        .collect();
    dirs.sort_by_key(|d| {
        d.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
    });
    dirs.pop()
}

impl OwnPostgres {
    fn run(&self, program: &Path, args: &[&str]) -> bool {
        let mut cmd = if self.as_root {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        };
        cmd.args(args).current_dir(&self.dir);
        match cmd.output() {
            Ok(out) if out.status.success() => true,
            Ok(out) => {
                eprintln!(
                    "{} {args:?} failed: {}{}",
                    program.display(),
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                false
            }
            Err(e) => {
                eprintln!("{}: {e}", program.display());
                false
            }
        }
    }

    fn start_new() -> Option<Self> {
        let Some(bin) = pg_bindir() else {
            assert!(!backends_required(), "PostgreSQL binaries not found");
            eprintln!("skipping: PostgreSQL binaries not found");
            return None;
        };
        let port = (0..50)
            .map(|_| 25500 + rand::random_range(0..100u16))
            .find(|p| TcpStream::connect(("127.0.0.1", *p)).is_err())
            .expect("a free port in 25500-25599");
        let dir = std::env::temp_dir().join(format!(
            "distlock-pg-restart-{:016x}",
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        // initdb refuses to run as root: then run the server as postgres.
        let as_root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
        if as_root {
            assert!(
                Command::new("chown")
                    .args(["postgres:", dir.to_str().unwrap()])
                    .status()
                    .unwrap()
                    .success()
            );
        }
        let pg = Self {
            bin,
            dir,
            port,
            as_root,
        };
        let data = pg.dir.join("data");
        assert!(pg.run(
            &pg.bin.join("initdb"),
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
        ));
        let conf = format!(
            "\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\nfsync = on\n",
            pg.dir.display()
        );
        let conf_path = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf_path).unwrap();
        text.push_str(&conf);
        std::fs::write(&conf_path, text).unwrap();
        assert!(pg.start(), "starting the private PostgreSQL");
        Some(pg)
    }

    fn pg_ctl(&self, args: &[&str]) -> bool {
        let data = self.dir.join("data");
        let log = self.dir.join("server.log");
        let mut all = vec!["-D", data.to_str().unwrap(), "-l", log.to_str().unwrap()];
        all.extend_from_slice(args);
        self.run(&self.bin.join("pg_ctl"), &all)
    }

    fn start(&self) -> bool {
        self.pg_ctl(&["-w", "-t", "60", "start"])
    }

    /// A crash: no checkpoint; the restart replays the WAL.
    fn crash(&self) -> bool {
        self.pg_ctl(&["-w", "-t", "60", "-m", "immediate", "stop"])
    }

    fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?connect_timeout=2&op_timeout=3s",
            self.port
        )
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-w", "-t", "60", "-m", "immediate", "stop"]);
        if self.dir.starts_with(std::env::temp_dir()) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Crashing and restarting the server mid-hold: while it is down every call fails with a
/// temporary error (no panic); afterwards the client reconnects by itself, the held lease is
/// still there (renew and release work), and fencing tokens keep strictly increasing across
/// several crash-right-after-acquire cycles — the counter lives in durably committed rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_across_server_crashes() {
    let Some(pg) = OwnPostgres::start_new() else {
        return;
    };
    let a = PgLock::connect_url(&pg.url()).await.unwrap();
    let key = fresh_key("restart");
    let mut tokens: Vec<FencingToken> = Vec::new();

    let first = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    tokens.extend(first.fencing_token());
    assert!(a.release(&first).await.unwrap());
    let mut held = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    tokens.extend(held.fencing_token());

    assert!(pg.crash(), "crash the private server");
    let down = a.try_acquire(&fresh_key("restart-down"), LONG).await;
    let err = down.expect_err("no grant while the server is down");
    assert!(err.is_temporary(), "{err}");
    let err = a.renew(&mut held, LONG).await.expect_err("server down");
    assert!(err.is_temporary(), "{err}");
    assert!(pg.start(), "restart");

    // The lease survived; the client reconnects on its own.
    a.renew(&mut held, LONG)
        .await
        .expect("the lease survives the restart");
    assert!(a.try_acquire(&key, LONG).await.unwrap().is_none());
    assert!(a.release(&held).await.unwrap());

    for _ in 0..3 {
        let b = PgLock::connect_url(&pg.url()).await.unwrap();
        let lease = b.try_acquire(&key, LONG).await.unwrap().expect("free");
        tokens.extend(lease.fencing_token());
        // Crash right after the grant was acknowledged: it must not be forgotten.
        assert!(pg.crash());
        assert!(pg.start());
        let info = a.inspect(&key).await.unwrap().expect("the grant survived");
        assert_eq!(info.fencing_token, lease.fencing_token());
        assert!(b.release(&lease).await.unwrap());
    }
    // An asynchronously committed release lost in a crash only delays the lock: afterwards the
    // key is either free or still held by the same grant (same digest and fence) until its TTL.
    let short = Duration::from_secs(2);
    let lease = a.try_acquire(&key, short).await.unwrap().unwrap();
    tokens.extend(lease.fencing_token());
    assert!(a.release(&lease).await.unwrap());
    assert!(pg.crash());
    assert!(pg.start());
    if let Some(info) = a.inspect(&key).await.unwrap() {
        assert_eq!(info.token_digest, Some(lease.token().digest()));
        assert_eq!(info.fencing_token, lease.fencing_token());
    }
    let last = a
        .acquire(&key, LONG, tokio::time::Instant::now() + short * 3)
        .await
        .unwrap();
    tokens.extend(last.fencing_token());
    assert_eq!(tokens.len(), 7);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "fencing tokens went back: {tokens:?}"
    );
}
