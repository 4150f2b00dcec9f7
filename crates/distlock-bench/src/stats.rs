//! Latency summaries: nearest-rank percentiles over the raw samples.

use std::time::Duration;

use serde::Serialize;

/// Median, p99 and friends of one set of latency samples, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Nearest-rank 50th percentile.
    pub median_us: f64,
    /// Nearest-rank 99th percentile.
    pub p99_us: f64,
    /// Arithmetic mean.
    pub mean_us: f64,
    /// Smallest sample.
    pub min_us: f64,
    /// Largest sample.
    pub max_us: f64,
}

impl Summary {
    /// Summarises `samples` (sorted in place). `None` when there are none.
    pub fn of(samples: &mut [Duration]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let total: f64 = samples.iter().copied().map(us).sum();
        Some(Self {
            n: samples.len(),
            median_us: us(percentile(samples, 0.5)),
            p99_us: us(percentile(samples, 0.99)),
            mean_us: total / samples.len() as f64,
            min_us: us(samples[0]),
            max_us: us(samples[samples.len() - 1]),
        })
    }
}

/// The nearest-rank percentile `q` (0 < q ≤ 1) of sorted, non-empty `sorted`: the smallest
/// sample such that at least `q` of all samples are less than or equal to it.
pub fn percentile(sorted: &[Duration], q: f64) -> Duration {
    let n = sorted.len();
    // ceil(q * n) as a 1-based rank, clamped to [1, n].
    let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
    sorted[rank - 1]
}

/// `a / b`, or `None` when `b` is zero.
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0).then(|| a / b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&x| Duration::from_micros(x)).collect()
    }

    #[test]
    fn nearest_rank_percentiles() {
        let sorted = us(&(1..=100).collect::<Vec<_>>());
        assert_eq!(percentile(&sorted, 0.5), Duration::from_micros(50));
        assert_eq!(percentile(&sorted, 0.99), Duration::from_micros(99));
        assert_eq!(percentile(&sorted, 1.0), Duration::from_micros(100));
        let one = us(&[7]);
        assert_eq!(percentile(&one, 0.5), Duration::from_micros(7));
        assert_eq!(percentile(&one, 0.99), Duration::from_micros(7));
        // 1,000 samples: p99 is the 990th smallest, so ten outliers sit above it.
        let sorted = us(&(1..=1000).collect::<Vec<_>>());
        assert_eq!(percentile(&sorted, 0.99), Duration::from_micros(990));
    }

    #[test]
    fn summary_sorts_and_summarises() {
        let mut samples = us(&[300, 100, 200, 1000, 400]);
        let s = Summary::of(&mut samples).unwrap();
        assert_eq!(s.n, 5);
        assert_eq!(s.median_us, 300.0);
        assert_eq!(s.p99_us, 1000.0);
        assert_eq!(s.min_us, 100.0);
        assert_eq!(s.max_us, 1000.0);
        assert_eq!(s.mean_us, 400.0);
        assert!(Summary::of(&mut []).is_none());
    }

    #[test]
    fn ratio_guards_zero() {
        assert_eq!(ratio(3.0, 2.0), Some(1.5));
        assert_eq!(ratio(3.0, 0.0), None);
    }
}
