//! The shared shape of a deployment audit: what each driver's `audit()` reports about the
//! coordinator settings its fence and its lease depend on (`distlock check` prints it).
//!
//! A driver reads its coordinator's settings (read-only, no lock taken) and grades each one:
//! [`Verdict::Pass`] when the setting keeps the driver's guarantees, [`Verdict::Warn`] when it
//! weakens them in a way some deployments accept (or the setting could not be read), and
//! [`Verdict::Fail`] when a fence can repeat or two holders can overlap.

use std::{fmt, time::Duration};

/// How a setting affects the lock's guarantees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Verdict {
    /// The setting keeps the guarantees the driver documents.
    Pass,
    /// The guarantees are weaker than documented in some failure (or the setting could not be
    /// read, so nothing is known).
    Warn,
    /// Fencing tokens can repeat or two holders can overlap with this setting.
    Fail,
}

impl Verdict {
    /// `PASS`, `WARN` or `FAIL`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Warn => "WARN",
            Verdict::Fail => "FAIL",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One graded setting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// A short stable name of the check, e.g. `maxmemory-policy` (used as an id in JSON).
    pub check: String,
    /// The grade.
    pub verdict: Verdict,
    /// What was observed, e.g. `allkeys-lru` (never a secret).
    pub observed: String,
    /// One line: why this grade.
    pub why: String,
    /// What to change, when the verdict is not [`Verdict::Pass`].
    pub fix: Option<String>,
}

/// Everything one audit found, in the order the checks ran.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuditReport {
    /// The backend's name, as [`crate::DistributedLock::backend_name`].
    pub backend: String,
    /// The findings.
    pub findings: Vec<Finding>,
    /// The round trip of the audit's cheapest request, when measured.
    pub round_trip: Option<Duration>,
}

impl AuditReport {
    /// An empty report for `backend`.
    pub fn new(backend: impl Into<String>) -> Self {
        Self {
            backend: backend.into(),
            ..Self::default()
        }
    }

    /// Adds a finding.
    pub fn push(
        &mut self,
        check: impl Into<String>,
        verdict: Verdict,
        observed: impl Into<String>,
        why: impl Into<String>,
        fix: Option<String>,
    ) -> &mut Self {
        self.findings.push(Finding {
            check: check.into(),
            verdict,
            observed: observed.into(),
            why: why.into(),
            fix,
        });
        self
    }

    /// Adds a [`Verdict::Pass`].
    pub fn pass(
        &mut self,
        check: impl Into<String>,
        observed: impl Into<String>,
        why: impl Into<String>,
    ) -> &mut Self {
        self.push(check, Verdict::Pass, observed, why, None)
    }

    /// Adds a [`Verdict::Warn`] with what to change.
    pub fn warn(
        &mut self,
        check: impl Into<String>,
        observed: impl Into<String>,
        why: impl Into<String>,
        fix: impl Into<String>,
    ) -> &mut Self {
        self.push(check, Verdict::Warn, observed, why, Some(fix.into()))
    }

    /// Adds a [`Verdict::Fail`] with what to change.
    pub fn fail(
        &mut self,
        check: impl Into<String>,
        observed: impl Into<String>,
        why: impl Into<String>,
        fix: impl Into<String>,
    ) -> &mut Self {
        self.push(check, Verdict::Fail, observed, why, Some(fix.into()))
    }

    /// The worst verdict (`Pass` for an empty report).
    pub fn worst(&self) -> Verdict {
        self.findings
            .iter()
            .map(|f| f.verdict)
            .max()
            .unwrap_or(Verdict::Pass)
    }

    /// The finding named `check`, if any.
    pub fn finding(&self, check: &str) -> Option<&Finding> {
        self.findings.iter().find(|f| f.check == check)
    }

    /// `true` when nothing failed (and, with `strict`, nothing warned either).
    pub fn is_ok(&self, strict: bool) -> bool {
        match self.worst() {
            Verdict::Pass => true,
            Verdict::Warn => !strict,
            Verdict::Fail => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_and_strictness() {
        let mut report = AuditReport::new("x");
        assert!(report.is_ok(true));
        report.pass("a", "1", "fine");
        assert_eq!(report.worst(), Verdict::Pass);
        report.warn("b", "2", "weak", "change b");
        assert!(report.is_ok(false));
        assert!(!report.is_ok(true));
        report.fail("c", "3", "broken", "change c");
        assert_eq!(report.worst(), Verdict::Fail);
        assert!(!report.is_ok(false));
        assert_eq!(
            report.finding("b").map(|f| f.fix.as_deref()),
            Some(Some("change b"))
        );
        assert_eq!(
            report.finding("a"),
            Some(&Finding {
                check: "a".into(),
                verdict: Verdict::Pass,
                observed: "1".into(),
                why: "fine".into(),
                fix: None,
            })
        );
        let checks: Vec<_> = report.findings.iter().map(|f| f.check.as_str()).collect();
        assert_eq!(checks, ["a", "b", "c"]);
    }

    /// Each adder returns the same report, so a driver's checks chain into one.
    #[test]
    fn findings_chain_in_the_order_they_ran() {
        let mut report = AuditReport::new("x");
        report
            .pass("a", "1", "fine")
            .warn("b", "2", "weak", "change b")
            .pass("c", "3", "fine");
        let verdicts: Vec<_> = report.findings.iter().map(|f| f.verdict).collect();
        assert_eq!(verdicts, [Verdict::Pass, Verdict::Warn, Verdict::Pass]);
        assert_eq!(report.backend, "x");
    }

    /// What `distlock check` prints in its verdict column and JSON.
    #[test]
    fn verdicts_read_as_their_words() {
        for (verdict, word) in [
            (Verdict::Pass, "PASS"),
            (Verdict::Warn, "WARN"),
            (Verdict::Fail, "FAIL"),
        ] {
            assert_eq!(verdict.as_str(), word);
            assert_eq!(verdict.to_string(), word);
        }
    }
}
