//! The same job code, through `distlock::connect(url)` only, against every backend this build
//! has: the in-memory one always, and each real coordinator whose test URL is set
//! (`DISTLOCK_TEST_{REDIS,ETCD,ZK,PG}_URL`; with `DISTLOCK_REQUIRE_BACKENDS=1` a missing URL fails).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)] // the example's `main` is not used here
#[path = "../examples/order_timeout.rs"]
mod order_timeout;

use distlock::Backend;

/// URLs to run against: memory, plus every compiled-in real backend with a server.
fn urls() -> Vec<String> {
    let mut urls = vec![format!("memory://same-job-{}", std::process::id())];
    let vars = [
        (Backend::Redis, "DISTLOCK_TEST_REDIS_URL"),
        (Backend::Etcd, "DISTLOCK_TEST_ETCD_URL"),
        (Backend::ZooKeeper, "DISTLOCK_TEST_ZK_URL"),
        (Backend::Postgres, "DISTLOCK_TEST_PG_URL"),
    ];
    for (backend, var) in vars {
        if backend.is_enabled()
            && let Some(url) = conformance::backend_url(var)
        {
            urls.push(with_short_session(backend, url));
        }
    }
    urls
}

/// Short sessions for ZooKeeper, whose smallest TTL is its session timeout (10 s by default).
fn with_short_session(backend: Backend, url: String) -> String {
    if backend != Backend::ZooKeeper {
        return url;
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}session_timeout=2s")
}

fn check(url: &str) {
    let report = match order_timeout::run(url, order_timeout::Output::Quiet) {
        Ok(report) => report,
        Err(e) => panic!("{url}: {e}"),
    };
    let timeline = report.timeline.join("\n");
    assert!(
        report.every_order_closed_once(),
        "{url}: closes per order {:?}\n{timeline}",
        report.closes
    );
    assert!(
        report.tokens_that_wrote.windows(2).all(|w| w[0] < w[1]),
        "{url}: fencing tokens did not increase: {:?}\n{timeline}",
        report.tokens_that_wrote
    );
    assert!(
        report.tokens_that_wrote.len() >= 2,
        "{url}: the lock never changed hands during the pause\n{timeline}"
    );
    assert!(
        report.stale_rejected >= 1,
        "{url}: the frozen instance's late write was not rejected\n{timeline}"
    );
    assert!(
        timeline.contains("REJECTED: stale"),
        "{url}: no stale write in the timeline\n{timeline}"
    );
}

#[test]
fn order_timeout_job_is_safe_on_every_backend() {
    for url in urls() {
        check(&url);
    }
}

/// `--periodic`: with at_least, one scan per period from three skewed timers on every backend
/// (ZooKeeper with its default 10 s session, on which a lease's `acquired_at` lags the grant by
/// seconds: at_least must count from the grant); without it, on the in-memory coordinator, the
/// late timers scan again. All at once, 3 periods of 2 s: a timer may fire 0.4 s late on a loaded
/// machine before a period could run twice; it runs beside the longer test above, so it adds
/// little wall time.
#[test]
fn periodic_scan_runs_once_per_period_with_at_least_only() {
    let setup = |at_least| order_timeout::Periodic {
        period: std::time::Duration::from_secs(2),
        periods: 3,
        at_least,
    };
    let memory = format!("memory://periodic-{}", std::process::id());
    let without = {
        let url = memory.clone();
        std::thread::spawn(move || {
            order_timeout::run_periodic(&url, setup(false), order_timeout::Output::Quiet)
        })
    };
    let mut urls = vec![memory];
    for (backend, var) in [
        (Backend::Redis, "DISTLOCK_TEST_REDIS_URL"),
        (Backend::Etcd, "DISTLOCK_TEST_ETCD_URL"),
        (Backend::ZooKeeper, "DISTLOCK_TEST_ZK_URL"),
        (Backend::Postgres, "DISTLOCK_TEST_PG_URL"),
    ] {
        if backend.is_enabled()
            && let Some(url) = conformance::backend_url(var)
        {
            urls.push(url);
        }
    }
    let with: Vec<_> = urls
        .into_iter()
        .map(|url| {
            std::thread::spawn(move || {
                let report =
                    order_timeout::run_periodic(&url, setup(true), order_timeout::Output::Quiet);
                (url, report)
            })
        })
        .collect();
    for run in with {
        let (url, report) = run.join().unwrap();
        let with = report.unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(
            with.once_per_period(),
            "{url}: with at_least: runs per period {:?}\n{}",
            with.runs,
            with.timeline.join("\n")
        );
    }
    let without = without.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        without.runs.iter().sum::<u32>() > 3,
        "without at_least the late timers should scan again: runs per period {:?}\n{}",
        without.runs,
        without.timeline.join("\n")
    );
}
