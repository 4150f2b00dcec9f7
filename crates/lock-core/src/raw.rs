//! The driver interface: what a coordinator driver implements and builds on, and a user does not
//! need (the way OpenDAL's `raw` module sits under its `Operator`).
//!
//! A driver implements [`Driver`]. Every type that does gets [`DistributedLock`] — the user
//! trait — from one blanket implementation, the **check layer**: it refuses bad input and
//! missing capabilities before the driver is called, so no driver checks a TTL, a renew without
//! `renew`, or a `force_release` without `force_release` itself.
//!
//! | the layer refuses, before any I/O | with |
//! |---|---|
//! | a TTL `try_acquire` / `acquire` ask for that [`Capabilities::check_ttl`] refuses | [`Error::InvalidTtl`] |
//! | a renew TTL outside the generic bounds, or below `min_ttl` and below the lease's own TTL (a lease can be shorter than `min_ttl` when the server lowered it, e.g. ZooKeeper's negotiated session timeout) | [`Error::InvalidTtl`] |
//! | `renew` without [`Capabilities::renew`] | [`Error::Unsupported`] |
//! | `force_release` / `force_release_grant` without [`Capabilities::force_release`] | [`Error::Unsupported`] |
//!
//! A wait never stops an attempt: an `acquire` whose deadline is nearer than
//! [`ONE_ATTEMPT_WINDOW`] (zero or already past included) makes one complete `try_acquire`
//! before the driver's own wait, so a free key is taken whatever the deadline.
//!
//! The rest of this module is the toolbox drivers share: [`failure`] (one request's failure
//! classified by what it may have applied — [`Failure::NotSent`], [`Failure::Unknown`],
//! [`Failure::Refused`] — mapped to the one error enum, and [`within`], the request budget),
//! [`AcquireWait`] and [`Backoff`] (a wait's deadline and its jittered retries), [`poll_acquire`] (the default queue-less
//! `acquire`), [`Batcher`] (requests that arrive together sent as one), [`handoff`] (a direct
//! grant's age), [`cleanup`] (background clean-up the tests can wait for), [`no_answer`] (a
//! connect or a read that timed out), [`MIN_NETWORK_TTL`] (the shortest TTL worth granting over
//! a network), [`server_expired_lease`] (the claims of a coordinator that expires leases by its
//! own clock), the config and URL helpers [`check_durations`],
//! [`parse_duration_option`] and [`decode_url_credential`], and the user types a driver's
//! signatures name, re-exported so that a driver's `use` lines reach core through this module
//! alone.

use std::{fmt, time::Duration};

use futures::{future::BoxFuture, stream::BoxStream};
use tokio::time::Instant;

#[path = "batch.rs"]
pub mod batch;
#[path = "cleanup.rs"]
pub mod cleanup;
#[path = "failure.rs"]
pub mod failure;
#[path = "group.rs"]
pub mod group;
#[path = "handoff.rs"]
pub mod handoff;

pub use crate::renewer::{LostSink, PushedLosses};
pub use batch::Batcher;
pub use failure::{Effect, Failure, RequestFailure, within};
pub use group::{GroupRenewError, RenewalGroup, SharedGroup};

pub use crate::{
    AuditReport, BoxError, Capabilities, Error, FencingGuarantee, FencingToken, Finding,
    HolderIdentity, HolderInfo, Lease, LockKey, LossReason, OwnershipToken, Result, Secret,
    StaleFencingToken, TokenDigest, Verdict, audit,
    backoff::{AcquireWait, Backoff},
    drift_margin,
    lock::{DistributedLock, DynLock, poll_acquire},
    options::{decode_url_credential, parse_duration, parse_duration_option},
};
/// Re-exported so drivers implement [`Driver`] with the same macro version.
pub use async_trait::async_trait;

/// What a coordinator driver implements. Its methods are [`DistributedLock`]'s, called by the
/// check layer (see the [module docs](self)) with input it has already checked; their
/// contracts are the ones documented on [`DistributedLock`].
#[async_trait]
pub trait Driver: Send + Sync + fmt::Debug + 'static {
    /// See [`DistributedLock::backend_name`].
    fn backend_name(&self) -> &'static str;

    /// See [`DistributedLock::capabilities`].
    fn capabilities(&self) -> Capabilities;

    /// See [`DistributedLock::try_acquire`]; `ttl` passed [`Capabilities::check_ttl`].
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>>;

    /// See [`DistributedLock::acquire`]; `ttl` passed [`Capabilities::check_ttl`]. The default
    /// is [`poll_acquire`].
    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        poll_acquire(self, key, ttl, deadline).await
    }

    /// Whether [`Driver::acquire`] makes one complete attempt itself whatever its deadline —
    /// a wrapper whose `acquire` is another [`DistributedLock`]'s, which does — so that the
    /// check layer adds none of its own (see [`ONE_ATTEMPT_WINDOW`]); a wrapper that records
    /// operations (metrics, tracing) then sees that attempt as part of the `acquire`. Default
    /// `false`: the layer makes the attempt.
    fn acquire_tries_first(&self) -> bool {
        false
    }

    /// See [`DistributedLock::renew`]; only called with `renew` claimed and a `ttl` the layer
    /// accepted.
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()>;

    /// See [`DistributedLock::release`].
    async fn release(&self, lease: &Lease) -> Result<bool>;

    /// See [`DistributedLock::inspect`].
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>>;

    /// See [`DistributedLock::force_release`]; only called with `force_release` claimed.
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let _ = key;
        Err(Error::unsupported(self.backend_name(), "force_release"))
    }

    /// See [`DistributedLock::force_release_grant`]; only called with `force_release` claimed.
    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        let _ = (key, holder);
        Err(Error::unsupported(self.backend_name(), "force_release"))
    }

    /// See [`DistributedLock::watch_lost`]. The default never completes.
    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        let _ = lease;
        Box::pin(std::future::pending())
    }

    /// See [`DistributedLock::renewal_group`]; only called with `renew` claimed. The default
    /// (`None`) renews every lease on its own.
    fn renewal_group(&self, lease: &Lease) -> Option<SharedGroup> {
        let _ = lease;
        None
    }

    /// See [`DistributedLock::hold_at_least`]; only called with `keep_until` claimed. The
    /// default sends nothing: the grant was asked for with a TTL of at least `at_least`, and a
    /// driver whose lease expires by the coordinator's clock holds it that long already.
    async fn hold_at_least(&self, lease: &Lease, at_least: Duration) -> Result<()> {
        let _ = (lease, at_least);
        Ok(())
    }

    /// See [`DistributedLock::keep`]; only called with `keep_until` claimed. The default is a
    /// renew to `left` (at least `min_ttl`): nobody renews the lease after it, so the
    /// coordinator expires it then by its own clock.
    async fn keep(&self, lease: &mut Lease, left: Duration) -> Result<bool> {
        let caps = Driver::capabilities(self);
        let ttl = left.max(caps.min_ttl);
        check_renew_ttl(&caps, lease, ttl)?;
        match Driver::renew(self, lease, ttl).await {
            Ok(()) => Ok(true),
            Err(Error::NotHeld { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Replaces the holder identity recorded beside `lease`'s grant with `holder`, only while
    /// that grant still holds the lock — a compare on the grant (ownership token, create
    /// revision, node), never a blind write — keeping the grant, its fencing token and its
    /// lease: what [`crate::Leadership::proclaim`] does. Call it through [`relabel`] (the check
    /// layer's half: the value checked, [`Capabilities::relabel`] required, before any I/O).
    /// The default answers [`Error::Unsupported`].
    ///
    /// # Errors
    /// [`Error::NotHeld`] when the grant no longer holds the lock (nothing was changed);
    /// [`Error::Indeterminate`] when the request was sent and its reply was lost; `Unavailable`
    /// when it was not sent.
    async fn relabel(&self, lease: &Lease, holder: &HolderIdentity) -> Result<()> {
        let _ = (lease, holder);
        Err(Error::unsupported(self.backend_name(), "relabel"))
    }

    /// Pushes from the coordinator that the holder of `key` may have changed (granted,
    /// released, expired, relabelled): one item per push, possibly spurious, possibly several
    /// per change. `None` (the default) when the backend cannot watch: the caller polls. The
    /// watch is armed by the time the stream's first poll returns `Pending`, so a caller that
    /// polls it once, then reads, misses no change made after its read. The stream ends when
    /// the watch breaks (a lost connection or session); the caller reads again and re-arms.
    /// [`crate::Election::observe`] re-reads the leader on every item and still polls as a
    /// safety net.
    fn watch_holder(&self, key: &LockKey) -> Option<BoxStream<'static, ()>> {
        let _ = key;
        None
    }
}

/// The check layer's half of [`Driver::relabel`]: `label` checked as a holder label
/// ([`HolderIdentity::check_label`]) and [`Capabilities::relabel`] required, before any I/O; then
/// the grant of `lease` is relabelled to this process's identity with that label (what a
/// connection with `label=<label>` records). Returns the identity now recorded.
///
/// # Errors
/// [`Error::Config`] for a bad label and [`Error::Unsupported`] without `relabel`, both before
/// any I/O; then [`Driver::relabel`]'s.
pub async fn relabel<D: DistributedLock + ?Sized>(
    driver: &D,
    lease: &Lease,
    label: &str,
) -> Result<HolderIdentity> {
    let holder = HolderIdentity::process(Some(label))?;
    DistributedLock::relabel(driver, lease, &holder).await?;
    Ok(holder)
}

/// The check layer's rule for a renew's TTL: what [`Capabilities::check_ttl`] accepts, or —
/// within its generic bounds — at least the lease's own TTL (which the driver granted, and may
/// be below `min_ttl` when the server lowered it).
pub(crate) fn check_renew_ttl(caps: &Capabilities, lease: &Lease, ttl: Duration) -> Result<()> {
    match caps.check_ttl(ttl) {
        Err(_) if ttl >= lease.ttl() && within_generic_bounds(caps, ttl) => Ok(()),
        other => other,
    }
}

fn within_generic_bounds(caps: &Capabilities, ttl: Duration) -> bool {
    ttl >= Duration::from_millis(1)
        && ttl <= Capabilities::MAX_TTL
        && (caps.max_ttl.is_zero() || ttl <= caps.max_ttl)
}

/// The check layer: every [`Driver`] is a [`DistributedLock`], with its input checked first.
#[async_trait]
impl<T: Driver + ?Sized> DistributedLock for T {
    fn backend_name(&self) -> &'static str {
        Driver::backend_name(self)
    }

    fn capabilities(&self) -> Capabilities {
        Driver::capabilities(self)
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        Driver::capabilities(self).check_ttl(ttl)?;
        Driver::try_acquire(self, key, ttl).await
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        Driver::capabilities(self).check_ttl(ttl)?;
        let started = Instant::now();
        if !Driver::acquire_tries_first(self)
            && deadline.saturating_duration_since(started) < ONE_ATTEMPT_WINDOW
        {
            // `flock -w 0`: a deadline decides whether to wait, never whether to try. A wait
            // this short might end before the driver's first request is answered (or, past
            // already, before it is sent), so one complete attempt goes first, given up to
            // the window when the deadline is shorter (a frozen coordinator: `Timeout` then;
            // the dropped attempt leaves nothing behind, as any dropped `try_acquire`).
            let timed_out = || Error::Timeout {
                key: key.as_str().to_owned(),
                waited: started.elapsed(),
            };
            let bound = deadline.max(started + ONE_ATTEMPT_WINDOW);
            match tokio::time::timeout_at(bound, Driver::try_acquire(self, key, ttl)).await {
                Ok(Ok(Some(lease))) => return Ok(lease),
                Ok(Ok(None)) => {}
                Ok(Err(e)) if !e.is_temporary() => return Err(e),
                Ok(Err(e)) if Instant::now() >= deadline => return Err(e),
                Ok(Err(_)) => {}
                Err(_elapsed) => return Err(timed_out()),
            }
            if Instant::now() >= deadline {
                return Err(timed_out());
            }
        }
        Driver::acquire(self, key, ttl, deadline).await
    }

    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        let caps = Driver::capabilities(self);
        if !caps.renew {
            return Err(Error::unsupported(Driver::backend_name(self), "renew"));
        }
        check_renew_ttl(&caps, lease, ttl)?;
        Driver::renew(self, lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        Driver::release(self, lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        Driver::inspect(self, key).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        if !Driver::capabilities(self).force_release {
            return Err(Error::unsupported(
                Driver::backend_name(self),
                "force_release",
            ));
        }
        Driver::force_release(self, key).await
    }

    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        if !Driver::capabilities(self).force_release {
            return Err(Error::unsupported(
                Driver::backend_name(self),
                "force_release",
            ));
        }
        Driver::force_release_grant(self, key, holder).await
    }

    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        Driver::watch_lost(self, lease)
    }

    fn renewal_group(&self, lease: &Lease) -> Option<SharedGroup> {
        if !Driver::capabilities(self).renew {
            return None;
        }
        Driver::renewal_group(self, lease)
    }

    async fn hold_at_least(&self, lease: &Lease, at_least: Duration) -> Result<()> {
        let caps = Driver::capabilities(self);
        if !(caps.keep_until && caps.renew) {
            return Err(Error::unsupported(Driver::backend_name(self), "keep_until"));
        }
        Driver::hold_at_least(self, lease, at_least).await
    }

    async fn keep(&self, lease: &mut Lease, left: Duration) -> Result<bool> {
        let caps = Driver::capabilities(self);
        if !(caps.keep_until && caps.renew) {
            return Err(Error::unsupported(Driver::backend_name(self), "keep_until"));
        }
        Driver::keep(self, lease, left).await
    }

    async fn relabel(&self, lease: &Lease, holder: &HolderIdentity) -> Result<()> {
        if !Driver::capabilities(self).relabel {
            return Err(Error::unsupported(Driver::backend_name(self), "relabel"));
        }
        Driver::relabel(self, lease, holder).await
    }

    fn watch_holder(&self, key: &LockKey) -> Option<BoxStream<'static, ()>> {
        Driver::watch_holder(self, key)
    }
}

/// An `acquire` whose deadline is nearer than this makes one complete `try_acquire` before it
/// waits (the check layer's rule): a deadline shorter than a round trip — zero, or already past —
/// decides only whether to *wait*, never whether to *try*, so a free key is always taken. That
/// attempt may run past such a deadline, to this long after the call at most: against a
/// coordinator that does not answer, `acquire` returns `Timeout` by then. Longer waits go
/// straight to the driver, whose first attempt has the time it needs within the deadline.
pub const ONE_ATTEMPT_WINDOW: Duration = Duration::from_millis(250);

/// The shortest TTL a driver whose grants cross the network claims by default
/// ([`Capabilities::min_ttl`]): a lease must outlast a round trip and the drift margin, or every
/// grant arrives past its local deadline and is given back (the conformance suite's boundary
/// property's finding).
pub const MIN_NETWORK_TTL: Duration = Duration::from_millis(100);

/// What a driver claims whose coordinator keeps each lease as a key or row that expires by the
/// coordinator's own clock and is renewed to any TTL (Redis, Redlock, PostgreSQL): TTL'd leases,
/// `renew`, `lost_notify`, `force_release`, and `keep_until` — a lease nobody renews expires on
/// its own, so job mode's `at_least` holds without the client — for TTLs from
/// [`MIN_NETWORK_TTL`] to [`Capabilities::MAX_TTL`]. The driver adds its wake-ups.
pub fn server_expired_lease(fencing: FencingGuarantee) -> Capabilities {
    Capabilities {
        lease_ttl: true,
        renew: true,
        fencing,
        lost_notify: true,
        force_release: true,
        keep_until: true,
        min_ttl: MIN_NETWORK_TTL,
        max_ttl: Capabilities::MAX_TTL,
        ..Capabilities::default()
    }
}

/// Checks a config's named durations (timeouts, intervals): each at least 1 ms and at most
/// `max`, a bound that keeps every deadline computed from it from overflowing.
///
/// # Errors
/// A message naming the first one out of bounds, for the driver's own [`Error::Config`].
pub fn check_durations(
    max: Duration,
    durations: &[(&str, Duration)],
) -> std::result::Result<(), String> {
    for &(name, d) in durations {
        if d < Duration::from_millis(1) || d > max {
            return Err(format!(
                "{name}={d:?} is out of bounds: expected 1ms to {max:?}"
            ));
        }
    }
    Ok(())
}

/// [`Error::Unavailable`] for a request `op` that got no answer within `budget`: a connect, a
/// read, or an audit's request, where the caller need not tell a write that may have applied
/// apart (a lock operation's missed reply is [`Failure::Unknown`] instead).
pub fn no_answer(backend: &'static str, op: &'static str, budget: Duration) -> Error {
    Error::Unavailable {
        backend,
        op,
        message: format!("no answer within {budget:?}"),
        source: None,
    }
}

/// Whether `error` — or any error in its `source()` chain, also one wrapped in an
/// `std::io::Error` — is rustls refusing the server's certificate: a misconfiguration that
/// retrying cannot fix, so drivers report it as permanent rather than `Unavailable`.
#[cfg(feature = "rustls")]
pub fn is_rejected_certificate(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(err) = source {
        let tls = err.downcast_ref::<rustls::Error>().or_else(|| {
            err.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if let Some(rustls::Error::InvalidCertificate(_)) = tls {
            return true;
        }
        source = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_from_one_millisecond_to_the_cap_pass_and_the_first_other_is_named() {
        let max = Duration::from_secs(60);
        let ms = Duration::from_millis(1);
        assert_eq!(check_durations(max, &[("a", ms), ("b", max)]), Ok(()));
        for (bad, d) in [
            ("zero", Duration::ZERO),
            ("sub_ms", ms - Duration::from_nanos(1)),
            ("over", max + Duration::from_nanos(1)),
        ] {
            let e = check_durations(max, &[("ok", ms), (bad, d), ("also", Duration::ZERO)]);
            assert!(e.unwrap_err().starts_with(&format!("{bad}=")), "{bad}");
        }
    }

    /// Anywhere in the `source()` chain, also inside an `io::Error`, as the drivers' TLS errors
    /// arrive; any other failure is not a rejected certificate (retrying may fix it).
    #[cfg(feature = "rustls")]
    #[test]
    fn a_rejected_certificate_is_found_anywhere_in_the_chain_and_nothing_else_is() {
        use rustls::{CertificateError, Error as Tls};
        use std::io::{Error as Io, ErrorKind};

        #[derive(Debug)]
        struct Wrapper(Io);
        impl fmt::Display for Wrapper {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("connect failed")
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let rejected = || Tls::InvalidCertificate(CertificateError::UnknownIssuer);
        assert!(is_rejected_certificate(&rejected()));
        assert!(is_rejected_certificate(&Io::new(
            ErrorKind::InvalidData,
            rejected()
        )));
        assert!(is_rejected_certificate(&Wrapper(Io::new(
            ErrorKind::InvalidData,
            rejected()
        ))));
        assert!(!is_rejected_certificate(&Tls::General("handshake".into())));
        assert!(!is_rejected_certificate(&Io::new(
            ErrorKind::ConnectionRefused,
            "refused"
        )));
        assert!(!is_rejected_certificate(&Wrapper(Io::other(Tls::General(
            "closed".into()
        )))));
    }

    /// Redis, Redlock and PostgreSQL claim exactly this; a claim dropped here would silently
    /// turn off renewals, the operator override or job mode on all three.
    #[test]
    fn a_server_expired_lease_claims_what_its_docs_say() {
        for fencing in [FencingGuarantee::SingleNode, FencingGuarantee::Quorum] {
            let caps = server_expired_lease(fencing);
            assert!(caps.lease_ttl && caps.renew && caps.lost_notify, "{caps:?}");
            assert!(caps.force_release && caps.keep_until, "{caps:?}");
            assert_eq!(caps.fencing, fencing);
            assert_eq!(caps.min_ttl, Duration::from_millis(100));
            assert_eq!(caps.max_ttl, Capabilities::MAX_TTL);
            // Nothing more: the driver adds its wake-ups and queue itself.
            assert!(!caps.wait_notify && !caps.fair_queue, "{caps:?}");
            assert!(!caps.session_bound && !caps.relabel, "{caps:?}");
            assert!(caps.ttl_granularity.is_zero());
        }
    }

    #[test]
    fn no_answer_is_unavailable_and_names_the_budget() {
        let e = no_answer("x", "connect", Duration::from_millis(250));
        assert!(e.is_temporary());
        assert!(matches!(
            e,
            Error::Unavailable {
                op: "connect",
                source: None,
                ..
            }
        ));
        assert!(e.to_string().contains("no answer within 250ms"), "{e}");
    }
}
