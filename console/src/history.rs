//! What the console remembers of each group between samples: a window of samples (an hour by
//! default), and the rates derived from them. Pure: the sampler pushes, pages read.

use std::collections::{BTreeMap, VecDeque};

/// One sample of a group's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    /// When it was taken (epoch ms).
    pub at_ms: i64,
    /// Messages not yet settled.
    pub backlog: u64,
    /// Held under a lock by a worker now.
    pub locked: u64,
    /// Failed and waiting for their next attempt.
    pub retrying: u64,
    /// Dead letters (counted up to the sampler's limit).
    pub dead_letters: u64,
}

/// A group's samples over the window, oldest first.
#[derive(Clone, Debug)]
pub struct Series {
    samples: VecDeque<Sample>,
    window_ms: i64,
}

/// Rates are averaged over at least this long, so one quick sample does not swing them.
const RATE_SPAN_MS: i64 = 30_000;

impl Series {
    pub fn new(window_ms: i64) -> Self {
        Self {
            samples: VecDeque::new(),
            window_ms,
        }
    }

    /// Adds a sample and forgets those older than the window. A sample older than the last
    /// one (a clock stepped back) replaces nothing and is dropped.
    pub fn push(&mut self, sample: Sample) {
        if self
            .samples
            .back()
            .is_some_and(|last| sample.at_ms <= last.at_ms)
        {
            return;
        }
        self.samples.push_back(sample);
        while self
            .samples
            .front()
            .is_some_and(|first| first.at_ms < sample.at_ms - self.window_ms)
        {
            self.samples.pop_front();
        }
    }

    pub fn samples(&self) -> impl ExactSizeIterator<Item = &Sample> {
        self.samples.iter()
    }

    pub fn latest(&self) -> Option<&Sample> {
        self.samples.back()
    }

    /// How fast the backlog grew (positive) or drained (negative) between consecutive
    /// samples, per second. Not arrivals and completions apart: a range's LSN counts writes,
    /// and a batch of messages is one write, so it cannot say how many arrived.
    pub fn trend(&self) -> Vec<(i64, f64)> {
        self.pairs(|a, b| b.backlog as f64 - a.backlog as f64)
    }

    /// The backlog's change per second over the last [`RATE_SPAN_MS`] or more (over all
    /// samples while there are fewer): the figure beside a group.
    pub fn trend_rate(&self) -> Option<f64> {
        let last = self.samples.back()?;
        let first = self
            .samples
            .iter()
            .rev()
            .find(|s| last.at_ms - s.at_ms >= RATE_SPAN_MS)
            .or_else(|| self.samples.front())?;
        let seconds = (last.at_ms - first.at_ms) as f64 / 1000.0;
        (seconds > 0.0).then(|| (last.backlog as f64 - first.backlog as f64) / seconds)
    }

    /// When the first sample still in the window was taken.
    pub fn since(&self) -> Option<i64> {
        self.samples.front().map(|s| s.at_ms)
    }

    /// `per(a, b)` (a count over the interval) as a rate, stamped at the later sample.
    fn pairs(&self, per: impl Fn(&Sample, &Sample) -> f64) -> Vec<(i64, f64)> {
        self.samples
            .iter()
            .zip(self.samples.iter().skip(1))
            .map(|(a, b)| {
                let seconds = (b.at_ms - a.at_ms) as f64 / 1000.0;
                (b.at_ms, per(a, b) / seconds)
            })
            .collect()
    }
}

/// Every group's series, by (queue, group).
#[derive(Debug)]
pub struct History {
    series: BTreeMap<(String, String), Series>,
    window_ms: i64,
}

impl History {
    pub fn new(window_ms: i64) -> Self {
        Self {
            series: BTreeMap::new(),
            window_ms,
        }
    }

    pub fn push(&mut self, queue: &str, group: &str, sample: Sample) {
        let window_ms = self.window_ms;
        self.series
            .entry((queue.to_owned(), group.to_owned()))
            .or_insert_with(|| Series::new(window_ms))
            .push(sample);
    }

    /// Forgets groups that are gone (no sample in the whole window).
    pub fn forget_older_than(&mut self, now_ms: i64) {
        let window_ms = self.window_ms;
        self.series
            .retain(|_, s| s.latest().is_some_and(|l| l.at_ms >= now_ms - window_ms));
    }

    pub fn get(&self, queue: &str, group: &str) -> Option<&Series> {
        self.series.get(&(queue.to_owned(), group.to_owned()))
    }

    pub fn window_ms(&self) -> i64 {
        self.window_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(at_ms: i64, backlog: u64) -> Sample {
        Sample {
            at_ms,
            backlog,
            ..Sample::default()
        }
    }

    #[test]
    fn the_window_keeps_an_hour_and_drops_what_is_older() {
        let mut s = Series::new(3_600_000);
        for i in 0..=7 {
            s.push(at(i * 600_000, 0)); // every 10 minutes for 70 minutes
        }
        let kept: Vec<i64> = s.samples().map(|x| x.at_ms).collect();
        assert_eq!(
            kept.first(),
            Some(&600_000),
            "the sample 70 min old is gone"
        );
        assert_eq!(s.since(), Some(600_000));
        assert_eq!(kept.len(), 7);
        // A sample from the past (the clock stepped back) is ignored.
        s.push(at(0, 9));
        assert_eq!(s.latest().unwrap().at_ms, 4_200_000);
    }

    #[test]
    fn the_trend_is_the_backlog_s_change_per_second() {
        let mut s = Series::new(3_600_000);
        assert_eq!(s.trend_rate(), None);
        s.push(at(0, 100));
        assert_eq!(s.trend_rate(), None, "one sample is no rate");
        s.push(at(10_000, 70)); // drained 30 in 10 s
        s.push(at(20_000, 75)); // grew 5 in 10 s
        assert_eq!(s.trend(), vec![(10_000, -3.0), (20_000, 0.5)]);
        // Fewer than 30 s of samples: over all of them.
        assert_eq!(s.trend_rate(), Some(-1.25));
        // With more, over the latest 30 s or more: from 20 s to 50 s, +20 in 30 s.
        s.push(at(50_000, 95));
        assert_eq!(s.trend_rate(), Some(20.0 / 30.0));
    }

    #[test]
    fn groups_not_sampled_for_a_window_are_forgotten() {
        let mut h = History::new(60_000);
        h.push("q", "gone", at(0, 0));
        h.push("q", "here", at(100_000, 0));
        h.forget_older_than(100_000);
        assert!(h.get("q", "gone").is_none());
        assert!(h.get("q", "here").is_some());
    }
}
