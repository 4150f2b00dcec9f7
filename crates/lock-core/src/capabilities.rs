//! Honest, checked capability flags.

use std::time::Duration;

use crate::{Error, Result};

/// How far a backend's fencing tokens can be trusted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum FencingGuarantee {
    /// No fencing tokens.
    #[default]
    None,
    /// Strictly increasing unless the single coordinator loses acknowledged writes (restart
    /// without fsync, failover to an asynchronous replica, eviction, FLUSH).
    SingleNode,
    /// Consensus-backed: survives losing a minority of the coordinator's members.
    Quorum,
}

/// What a backend promises. A flat `Copy` struct; drivers fill it with `..Default::default()`,
/// and anything left unset is unsupported. Core checks these before calling a driver, so a
/// backend can never quietly weaken a guarantee.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// The coordinator expires a lease by itself after its TTL.
    pub lease_ttl: bool,
    /// [`crate::DistributedLock::renew`] extends a held lease.
    pub renew: bool,
    /// The lock is released when the client's session dies (ZooKeeper).
    pub session_bound: bool,
    /// Fencing token strength.
    pub fencing: FencingGuarantee,
    /// Waiters are woken by the coordinator when the lock is released (no blind polling).
    pub wait_notify: bool,
    /// Waiters are granted the lock in arrival order.
    pub fair_queue: bool,
    /// A held lock's loss is reported to its guard ([`crate::LockGuard::lost`]).
    pub lost_notify: bool,
    /// [`crate::DistributedLock::force_release`] (operator override) is available.
    pub force_release: bool,
    /// `renew` sets any TTL up to `max_ttl` — shorter or longer than the lease's — and the
    /// coordinator then keeps that one lease for that long with nobody renewing it, even if the
    /// client dies (server-side expiry of the lease alone). What job mode's
    /// [`crate::LockOptions::at_least`] needs; without it `at_least` is `Unsupported`.
    pub keep_until: bool,
    /// The holder identity recorded beside a held grant can be replaced while the grant keeps
    /// holding (compare on the grant, never a blind write): what
    /// [`crate::Leadership::proclaim`] needs ([`crate::raw::relabel`]); without it, proclaim is
    /// refused with `Unsupported` before any I/O.
    pub relabel: bool,
    /// The smallest TTL the backend can honour (zero: no minimum).
    pub min_ttl: Duration,
    /// The largest TTL the backend can honour (zero: no maximum).
    pub max_ttl: Duration,
    /// TTLs are rounded up to a multiple of this (zero: exact to the millisecond).
    pub ttl_granularity: Duration,
}

impl Capabilities {
    /// The longest TTL any backend accepts (365 days): longer leases are a configuration mistake,
    /// and bounding them keeps every deadline computation in range.
    pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

    /// Checks a TTL against the backend's limits, before any I/O.
    ///
    /// # Errors
    /// [`Error::InvalidTtl`] when `ttl` is zero, below [`Capabilities::min_ttl`], above
    /// [`Capabilities::max_ttl`] or above [`Capabilities::MAX_TTL`].
    pub fn check_ttl(&self, ttl: Duration) -> Result<()> {
        let reason = if ttl.is_zero() {
            "the ttl must be positive".to_owned()
        } else if ttl < self.min_ttl {
            format!("this backend's minimum ttl is {:?}", self.min_ttl)
        } else if !self.max_ttl.is_zero() && ttl > self.max_ttl {
            format!("this backend's maximum ttl is {:?}", self.max_ttl)
        } else if ttl > Self::MAX_TTL {
            format!("the maximum ttl is {:?}", Self::MAX_TTL)
        } else if ttl < Duration::from_millis(1) {
            "the ttl must be at least 1 ms".to_owned()
        } else {
            return Ok(());
        };
        Err(Error::InvalidTtl { ttl, reason })
    }

    /// Checks that the backend's fencing is at least `needed`, before any I/O.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when it is weaker.
    pub fn require_fencing(&self, backend: &'static str, needed: FencingGuarantee) -> Result<()> {
        if self.fencing >= needed {
            Ok(())
        } else {
            Err(Error::unsupported(
                backend,
                format!("fencing {needed:?} (it offers {:?})", self.fencing),
            ))
        }
    }

    /// The TTL the coordinator will actually apply for a requested `ttl` (rounded up to the
    /// granularity).
    pub fn effective_ttl(&self, ttl: Duration) -> Duration {
        let g = self.ttl_granularity.as_nanos();
        if g == 0 {
            return ttl;
        }
        let n = ttl.as_nanos().div_ceil(g) * g;
        Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_limits_are_checked() {
        let caps = Capabilities {
            min_ttl: Duration::from_secs(1),
            max_ttl: Duration::from_secs(60),
            ..Default::default()
        };
        assert!(caps.check_ttl(Duration::ZERO).is_err());
        assert!(caps.check_ttl(Duration::from_millis(999)).is_err());
        assert!(caps.check_ttl(Duration::from_secs(61)).is_err());
        assert!(caps.check_ttl(Duration::from_secs(1)).is_ok());
        // Both limits are inclusive.
        assert!(caps.check_ttl(Duration::from_secs(60)).is_ok());
        assert!(
            caps.check_ttl(Duration::from_secs(60) + Duration::from_nanos(1))
                .is_err()
        );
        assert!(
            Capabilities::default()
                .check_ttl(Duration::from_micros(10))
                .is_err()
        );
    }

    #[test]
    fn the_longest_ttl_is_365_days_inclusive() {
        let days = Duration::from_secs(365 * 86_400);
        assert_eq!(Capabilities::MAX_TTL, days);
        for caps in [
            Capabilities::default(),
            crate::raw::server_expired_lease(FencingGuarantee::SingleNode),
        ] {
            assert!(caps.check_ttl(days).is_ok(), "{caps:?}");
            assert!(
                matches!(
                    caps.check_ttl(days + Duration::from_millis(1)),
                    Err(Error::InvalidTtl { .. })
                ),
                "{caps:?}"
            );
        }
    }

    #[test]
    fn fencing_is_ordered_and_checked() {
        let caps = Capabilities {
            fencing: FencingGuarantee::SingleNode,
            ..Default::default()
        };
        assert!(
            caps.require_fencing("x", FencingGuarantee::SingleNode)
                .is_ok()
        );
        assert!(matches!(
            caps.require_fencing("x", FencingGuarantee::Quorum),
            Err(Error::Unsupported { .. })
        ));
    }

    #[test]
    fn effective_ttl_rounds_up() {
        let caps = Capabilities {
            ttl_granularity: Duration::from_secs(1),
            ..Default::default()
        };
        assert_eq!(
            caps.effective_ttl(Duration::from_millis(1500)),
            Duration::from_secs(2)
        );
        assert_eq!(
            caps.effective_ttl(Duration::from_secs(3)),
            Duration::from_secs(3)
        );
    }
}
