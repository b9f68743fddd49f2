//! Prometheus metrics without a registry crate: atomic counters, labelled counters and
//! histograms, written in the Prometheus text format (version 0.0.4). The node's own metrics
//! are [`NodeMetrics`]; the coordinator builds its set from the same pieces.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Prometheus' text content type.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Counts by one label value.
#[derive(Debug, Default)]
pub struct LabeledCounter(Mutex<BTreeMap<String, u64>>);

impl LabeledCounter {
    pub fn add(&self, label: &str, n: u64) {
        let mut m = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *m.entry(label.to_string()).or_default() += n;
    }

    /// The count of one label value.
    pub fn get(&self, label: &str) -> u64 {
        self.snapshot().get(label).copied().unwrap_or(0)
    }

    fn snapshot(&self) -> BTreeMap<String, u64> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// Counts by position 1..=N in a block, without allocating on the hot path.
#[derive(Debug)]
pub struct PositionCounter(Vec<Counter>);

impl Default for PositionCounter {
    /// One counter per position of the largest block a round may draft.
    fn default() -> Self {
        let positions = tandem_runtime::generator::MAX_DRAFT_TOKENS;
        Self((0..positions).map(|_| Counter::default()).collect())
    }
}

impl PositionCounter {
    /// Counts one at each of the positions 1..=n.
    pub fn add_first(&self, n: usize) {
        for c in self.0.iter().take(n) {
            c.add(1);
        }
    }
}

/// Latency buckets in seconds, 100 µs to 10 s.
pub const LATENCY_BUCKETS: [f64; 14] = [
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 10.0,
];

/// A histogram over [`LATENCY_BUCKETS`].
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    /// Sum in nanoseconds.
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        let seconds = seconds.max(0.0);
        if let Some(i) = LATENCY_BUCKETS.iter().position(|&b| seconds <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_nanos
            .fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
    }
}

/// Writes metric families in the Prometheus text format.
#[derive(Debug, Default)]
pub struct Exposition(String);

impl Exposition {
    fn head(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    pub fn counter(&mut self, name: &str, help: &str, value: u64) -> &mut Self {
        self.head(name, help, "counter");
        let _ = writeln!(self.0, "{name} {value}");
        self
    }

    pub fn gauge(&mut self, name: &str, help: &str, value: f64) -> &mut Self {
        self.head(name, help, "gauge");
        let _ = writeln!(self.0, "{name} {value}");
        self
    }

    pub fn labeled(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        c: &LabeledCounter,
    ) -> &mut Self {
        self.head(name, help, "counter");
        for (value, n) in c.snapshot() {
            let value = value.replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(self.0, "{name}{{{label}=\"{value}\"}} {n}");
        }
        self
    }

    /// A counter by position; positions never counted are left out.
    pub fn positions(&mut self, name: &str, help: &str, c: &PositionCounter) -> &mut Self {
        self.head(name, help, "counter");
        for (i, n) in c.0.iter().map(Counter::get).enumerate() {
            if n > 0 {
                let _ = writeln!(self.0, "{name}{{position=\"{}\"}} {n}", i + 1);
            }
        }
        self
    }

    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) -> &mut Self {
        self.head(name, help, "histogram");
        let mut cumulative = 0;
        for (bound, n) in LATENCY_BUCKETS.iter().zip(&h.buckets) {
            cumulative += n.load(Ordering::Relaxed);
            let _ = writeln!(self.0, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count = h.count.load(Ordering::Relaxed);
        let sum = h.sum_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
        let _ = writeln!(self.0, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(self.0, "{name}_sum {sum}\n{name}_count {count}");
        self
    }

    pub fn finish(self) -> String {
        self.0
    }
}

/// What a node counts.
#[derive(Debug, Default)]
pub struct NodeMetrics {
    pub sessions_opened: Counter,
    /// Chunks of prompts prefilled (a prompt longer than --prefill-chunk takes several).
    pub prefill_chunks: Counter,
    /// Steps (draft) or verify blocks (target) answered.
    pub requests: Counter,
    /// Tokens proposed (draft) or committed (target).
    pub tokens: Counter,
    pub compute: Histogram,
    pub errors: LabeledCounter,
    /// Drafted blocks a target-node refused, by reason (each ran as a plain target step).
    pub draft_blocks_refused: LabeledCounter,
    /// Verify blocks that repeated the last one and got its verdict without a forward pass.
    pub repeated_blocks: Counter,
    /// Batches of work run as one forward pass, and the requests they held (their ratio is the
    /// mean batch size).
    pub batches: Counter,
    pub batched_requests: Counter,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_labels_escaped() {
        let h = Histogram::default();
        for s in [0.0002, 0.003, 0.003, 20.0] {
            h.observe(s);
        }
        let errors = LabeledCounter::default();
        errors.add("invalid \"k\"", 2);
        let mut e = Exposition::default();
        let at = PositionCounter::default();
        at.add_first(2);
        at.add_first(1);
        e.positions("t_at_total", "help", &at);
        e.histogram("t_seconds", "help", &h)
            .labeled("t_errors_total", "help", "kind", &errors);
        let text = e.finish();
        assert!(
            text.contains("t_seconds_bucket{le=\"0.00025\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("t_seconds_bucket{le=\"0.005\"} 3\n"),
            "{text}"
        );
        assert!(text.contains("t_seconds_bucket{le=\"+Inf\"} 4\n"), "{text}");
        assert!(text.contains("t_seconds_count 4\n"), "{text}");
        assert!(
            text.contains("t_at_total{position=\"1\"} 2\nt_at_total{position=\"2\"} 1\n# HELP"),
            "{text}"
        );
        assert!(
            text.contains("t_errors_total{kind=\"invalid \\\"k\\\"\"} 2\n"),
            "{text}"
        );
    }
}
