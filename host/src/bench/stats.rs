//! Statistics and units of the benchmarks: [`Quantiles`] (every median, percentile,
//! minimum and maximum of `bench`), the JSON [`Summary`] of a sample, and [`Tsc`]
//! (cycles → ns).

use serde::Serialize;

/// A sample, sorted once, asked for its quantiles (nearest rank). An empty sample has
/// no minimum or maximum and every quantile 0.
#[derive(Clone, Debug, Default)]
pub struct Quantiles {
    sorted: Vec<f64>,
}

impl Quantiles {
    /// The quantiles of `sample`.
    pub fn new(sample: &[f64]) -> Self {
        let mut sorted = sample.to_vec();
        sorted.sort_by(f64::total_cmp);
        Self { sorted }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    /// The `q`-quantile (nearest rank: the smallest value with at least `q` of the
    /// sample at or below it); 0 for an empty sample.
    pub fn quantile(&self, q: f64) -> f64 {
        let n = self.sorted.len();
        if n == 0 {
            return 0.0;
        }
        let i = ((n as f64 * q).ceil() as usize).clamp(1, n) - 1;
        self.sorted[i]
    }

    /// The median (nearest rank: the lower one for an even count); 0 for an empty
    /// sample.
    pub fn median(&self) -> f64 {
        self.quantile(0.5)
    }

    /// The smallest value.
    pub fn min(&self) -> Option<f64> {
        self.sorted.first().copied()
    }

    /// The largest value.
    pub fn max(&self) -> Option<f64> {
        self.sorted.last().copied()
    }

    /// The relative spread (max − min) / median; 0 when the median is not positive.
    pub fn spread(&self) -> f64 {
        let med = self.median();
        match (self.min(), self.max()) {
            (Some(min), Some(max)) if med > 0.0 => (max - min) / med,
            _ => 0.0,
        }
    }
}

/// A sample in the JSON: `{median, min, max, spread, samples}` (min and max 0 for an
/// empty sample; the samples in the order measured).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    /// [`Quantiles::median`].
    pub median: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
    /// [`Quantiles::spread`].
    pub spread: f64,
    /// Every value, in the order measured.
    pub samples: Vec<f64>,
}

impl Summary {
    /// The summary of `sample`.
    pub fn of(sample: &[f64]) -> Self {
        let q = Quantiles::new(sample);
        Self {
            median: q.median(),
            min: q.min().unwrap_or(0.0),
            max: q.max().unwrap_or(0.0),
            spread: q.spread(),
            samples: sample.to_vec(),
        }
    }
}

/// TSC cycles → ns.
#[derive(Clone, Copy, Debug)]
pub struct Tsc {
    /// The TSC frequency.
    pub khz: u64,
}

impl Tsc {
    /// `cycles` in ns.
    pub fn ns(self, cycles: f64) -> f64 {
        cycles * 1e6 / self.khz.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles() {
        let q = Quantiles::new(&[5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!(q.median(), 3.0);
        assert_eq!(q.quantile(0.99), 5.0);
        assert_eq!(q.quantile(0.0), 1.0);
        assert_eq!(q.quantile(0.10), 1.0);
        assert_eq!((q.min(), q.max()), (Some(1.0), Some(5.0)));
        assert_eq!(q.spread(), 4.0 / 3.0);
        assert_eq!(Quantiles::new(&[2.0, 1.0]).median(), 1.0, "lower median");
        let none = Quantiles::new(&[]);
        assert_eq!((none.median(), none.min(), none.spread()), (0.0, None, 0.0));
    }

    /// The JSON summary keeps the samples in measured order; an empty one is all 0.
    #[test]
    fn summary_of_samples() {
        let s = Summary::of(&[4.0, 2.0, 6.0]);
        assert_eq!((s.median, s.min, s.max, s.spread), (4.0, 2.0, 6.0, 1.0));
        assert_eq!(s.samples, [4.0, 2.0, 6.0]);
        let e = Summary::of(&[]);
        assert_eq!((e.median, e.min, e.max, e.spread), (0.0, 0.0, 0.0, 0.0));
    }
}
