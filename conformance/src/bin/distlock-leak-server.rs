//! A fixture of `conformance/tests/servers.rs`: starts a private Redis
//! ([`conformance::servers::PrivateServer`]), writes its pid, port and directory (one per line)
//! to the file named by its one argument, and exits without dropping it — as a test process that
//! is killed would — so the test can see the reaper kill it and delete its directory.

use conformance::servers::{PrivateServer, ServerKind, free_port};

fn main() {
    let Some(report) = std::env::args_os().nth(1) else {
        eprintln!("usage: distlock-leak-server REPORT_FILE");
        std::process::exit(2);
    };
    let server = PrivateServer::start_blocking(ServerKind::Redis, free_port());
    let pidfile = server.dir().join("redis").join("redis.pid");
    let written = std::fs::read_to_string(&pidfile).and_then(|pid| {
        std::fs::write(
            &report,
            format!(
                "{}\n{}\n{}\n",
                pid.trim(),
                server.port,
                server.dir().display()
            ),
        )
    });
    if let Err(e) = written {
        eprintln!("distlock-leak-server: {e}");
        std::process::exit(1);
    }
    // Nothing is dropped: the reaper is what stops it.
    std::process::exit(0);
}
