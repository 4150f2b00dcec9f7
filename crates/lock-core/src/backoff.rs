//! Bounded, jittered retry delays and the wait loop shared by every `acquire`.

use std::{future::Future, time::Duration};

use tokio::time::{Instant, sleep_until};

use crate::{Error, LockKey, Result};

/// Exponential backoff with "equal jitter": the n-th delay is drawn uniformly from
/// `[cap/2, cap]` where `cap = min(max, base * 2^n)`. Never zero, so a retry loop never spins.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    /// A backoff starting around `base` and never exceeding `max` (both clamped to at least 1 ms).
    pub fn new(base: Duration, max: Duration) -> Self {
        let base = base.max(Duration::from_millis(1));
        Self {
            base,
            max: max.max(base),
            attempt: 0,
        }
    }

    /// The next delay.
    pub fn next_delay(&mut self) -> Duration {
        let factor = 1u32 << self.attempt.min(16);
        self.attempt = self.attempt.saturating_add(1);
        let cap = self.base.saturating_mul(factor).min(self.max);
        let half = cap / 2;
        let jitter_nanos = u64::try_from((cap - half).as_nanos()).unwrap_or(u64::MAX);
        (half + Duration::from_nanos(rand::random_range(0..=jitter_nanos)))
            .max(Duration::from_millis(1))
    }

    /// Starts over from `base` (after a success).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

impl Default for Backoff {
    /// 10 ms growing to 500 ms.
    fn default() -> Self {
        Self::new(Duration::from_millis(10), Duration::from_millis(500))
    }
}

/// The waiting half of an `acquire` loop: between attempts, sleep until woken by the
/// coordinator, the next backoff delay, or the deadline, whichever comes first.
///
/// ```
/// # use lock_core::{LockKey, raw::{AcquireWait, Backoff}};
/// # use tokio::time::{Duration, Instant};
/// # async fn demo() -> lock_core::Result<()> {
/// let key = LockKey::new("jobs")?;
/// let mut wait = AcquireWait::new(&key, Instant::now() + Duration::from_secs(1), Backoff::default())?;
/// loop {
///     // let woken = subscribe(&key); if let Some(lease) = try_acquire(..).await? { break }
///     wait.wait(std::future::pending::<()>()).await?; // Err(Timeout) at the deadline
/// #   break;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct AcquireWait {
    key: LockKey,
    started: Instant,
    deadline: Instant,
    backoff: Backoff,
}

impl AcquireWait {
    /// Starts waiting for `key` until `deadline`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the deadline has already passed (before any I/O).
    pub fn new(key: &LockKey, deadline: Instant, backoff: Backoff) -> Result<Self> {
        let started = Instant::now();
        let this = Self {
            key: key.clone(),
            started,
            deadline,
            backoff,
        };
        if deadline <= started {
            return Err(this.timeout());
        }
        Ok(this)
    }

    /// The deadline.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Replaces the backoff for the delays from now on (e.g. a waiter that no longer needs
    /// quick polls because the coordinator will wake it).
    pub fn set_backoff(&mut self, backoff: Backoff) {
        self.backoff = backoff;
    }

    /// Sleeps until `woken` completes, the next backoff delay passes, or the deadline.
    ///
    /// # Errors
    /// [`Error::Timeout`] once the deadline has passed.
    ///
    /// # Cancellation safety
    /// Safe to drop: it only sleeps.
    pub async fn wait(&mut self, woken: impl Future<Output = ()>) -> Result<()> {
        let until = (Instant::now() + self.backoff.next_delay()).min(self.deadline);
        tokio::select! {
            () = woken => {}
            () = sleep_until(until) => {}
        }
        if Instant::now() >= self.deadline {
            return Err(self.timeout());
        }
        Ok(())
    }

    /// Records a temporary error of an attempt: retried after a backoff delay while the
    /// deadline allows, returned once it has passed.
    ///
    /// # Errors
    /// `err` itself when it is permanent or the deadline has passed.
    pub async fn retry_after(&mut self, err: Error) -> Result<()> {
        if !err.is_temporary() {
            return Err(err);
        }
        tracing::debug!(key = %self.key, error = %err, "acquire attempt failed; retrying");
        crate::observe::record_retry(&err);
        let until = (Instant::now() + self.backoff.next_delay()).min(self.deadline);
        sleep_until(until).await;
        if Instant::now() >= self.deadline {
            return Err(err);
        }
        Ok(())
    }

    /// The error returned at the deadline.
    pub fn timeout(&self) -> Error {
        Error::Timeout {
            key: self.key.as_str().to_owned(),
            waited: self.started.elapsed(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_are_bounded_jittered_and_never_zero() {
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(80));
        let delays: Vec<_> = (0..50).map(|_| b.next_delay()).collect();
        assert!(delays.iter().all(|d| *d >= Duration::from_millis(5)));
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(80)));
        assert!(delays[10..].iter().all(|d| *d >= Duration::from_millis(40)));
        assert!(
            delays[10..].windows(2).any(|w| w[0] != w[1]),
            "no jitter: {delays:?}"
        );
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(10));
        let mut tiny = Backoff::new(Duration::ZERO, Duration::ZERO);
        assert!(tiny.next_delay() >= Duration::from_micros(500));
    }

    #[tokio::test(start_paused = true)]
    async fn wait_honours_the_deadline() {
        let key = LockKey::new("k").unwrap();
        let start = Instant::now();
        let mut w =
            AcquireWait::new(&key, start + Duration::from_secs(2), Backoff::default()).unwrap();
        let mut rounds = 0;
        let err = loop {
            match w.wait(std::future::pending()).await {
                Ok(()) => rounds += 1,
                Err(e) => break e,
            }
        };
        assert!(matches!(err, Error::Timeout { .. }));
        assert_eq!(Instant::now(), start + Duration::from_secs(2));
        assert!((4..100).contains(&rounds), "{rounds} rounds");
        assert!(AcquireWait::new(&key, Instant::now(), Backoff::default()).is_err());
    }
}
