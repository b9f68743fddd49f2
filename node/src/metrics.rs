//! Prometheus metrics on the `prometheus-client` crate: the node's own ([`NodeMetrics`]), and the
//! pieces the coordinator builds its set from (a counter per value of one label, latency
//! histograms, the text page). Counters are registered without their `_total`, which the
//! encoder appends.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Prometheus' text content type (version 0.0.4).
pub const PROMETHEUS_TEXT: &str = prometheus_text::CONTENT_TYPE;

/// A gauge of a fraction or a size too large for an integer.
pub type FloatGauge = Gauge<f64, AtomicU64>;

/// Latency buckets in seconds, 100 µs to 10 s.
pub const LATENCY_BUCKETS: [f64; 14] = [
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 10.0,
];

/// A histogram over [`LATENCY_BUCKETS`].
pub fn latency() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// Registers each `(name, help, metric)`: a table of metrics of one kind.
pub fn register_all<M>(registry: &mut Registry, metrics: &[(&str, &str, &M)])
where
    M: prometheus_client::registry::Metric + Clone,
{
    for (name, help, metric) in metrics {
        registry.register(*name, *help, (*metric).clone());
    }
}

/// The registry's metrics in the Prometheus text format.
pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    // Writing to a String does not fail.
    let _ = prometheus_text::encode(&mut text, registry);
    text
}

/// A counter per value of one label (`kind`, `reason`, `position`).
#[derive(Debug, Clone)]
pub struct LabeledCounter {
    label: &'static str,
    family: Family<[(&'static str, String); 1], Counter>,
}

impl LabeledCounter {
    pub fn new(label: &'static str) -> Self {
        Self {
            label,
            family: Family::default(),
        }
    }

    /// With a series of 0 for each of `values` from the start (Prometheus' advice for label
    /// values known in advance: a query over them sees 0, not nothing).
    pub fn with_values<'a>(label: &'static str, values: impl IntoIterator<Item = &'a str>) -> Self {
        let counter = Self::new(label);
        for value in values {
            counter.add(value, 0);
        }
        counter
    }

    /// Drafted blocks refused, by reason: every reason listed from the start.
    pub fn refusals() -> Self {
        Self::with_values(
            "reason",
            tandem_runtime::RefusalReason::ALL.map(tandem_runtime::RefusalReason::as_str),
        )
    }

    /// Failures by gRPC code (`kind`): every code but OK listed from the start.
    pub fn errors() -> Self {
        let codes: Vec<String> = (1..=16)
            .map(|c| format!("{:?}", tonic::Code::from_i32(c)))
            .collect();
        Self::with_values("kind", codes.iter().map(String::as_str))
    }

    pub fn add(&self, value: &str, n: u64) {
        self.family
            .get_or_create(&[(self.label, value.to_string())])
            .inc_by(n);
    }

    /// The count of one label value.
    pub fn get(&self, value: &str) -> u64 {
        self.family
            .get(&[(self.label, value.to_string())])
            .map_or(0, |c| c.get())
    }

    /// Counts one at each of the positions 1..=n (the label is a position in a block).
    pub fn add_first(&self, n: usize) {
        for position in 1..=n {
            self.add(&position.to_string(), 1);
        }
    }

    pub fn register(&self, registry: &mut Registry, name: &str, help: &str) {
        registry.register(name, help, self.family.clone());
    }
}

/// What a node counts, and the registry that writes it.
#[derive(Debug)]
pub struct NodeMetrics {
    pub sessions_opened: Counter,
    /// Chunks of prompts prefilled (a prompt longer than --prefill-chunk takes several).
    pub prefill_chunks: Counter,
    /// Prompt tokens looked up in the prefix cache, and those found there (vLLM's
    /// prefix_cache_queries / prefix_cache_hits).
    pub prefix_cache_queries: Counter,
    pub prefix_cache_hits: Counter,
    /// Bytes the prefix cache dropped to stay within its budget (set when the page is
    /// written), and the bytes it holds.
    pub prefix_cache_evicted_bytes: Gauge,
    pub prefix_cache_bytes: Gauge,
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
    /// The session table as it stands, set when the page is written.
    pub sessions_active: Gauge,
    pub kv_cache_bytes: Gauge,
    pub kv_cache_reserved_bytes: Gauge,
    pub kv_cache_budget_bytes: Gauge,
    pub kv_cache_usage_perc: FloatGauge,
    registry: Registry,
}

impl Default for NodeMetrics {
    fn default() -> Self {
        let mut m = Self {
            sessions_opened: Counter::default(),
            prefill_chunks: Counter::default(),
            prefix_cache_queries: Counter::default(),
            prefix_cache_hits: Counter::default(),
            prefix_cache_evicted_bytes: Gauge::default(),
            prefix_cache_bytes: Gauge::default(),
            requests: Counter::default(),
            tokens: Counter::default(),
            compute: latency(),
            errors: LabeledCounter::errors(),
            draft_blocks_refused: LabeledCounter::refusals(),
            repeated_blocks: Counter::default(),
            batches: Counter::default(),
            batched_requests: Counter::default(),
            sessions_active: Gauge::default(),
            kv_cache_bytes: Gauge::default(),
            kv_cache_reserved_bytes: Gauge::default(),
            kv_cache_budget_bytes: Gauge::default(),
            kv_cache_usage_perc: FloatGauge::default(),
            registry: Registry::default(),
        };
        let mut registry = Registry::default();
        m.register_gauges(&mut registry);
        m.register_counters(&mut registry);
        m.registry = registry;
        m
    }
}

impl NodeMetrics {
    /// The gauges.
    fn register_gauges(&self, r: &mut Registry) {
        let m = self;
        let gauges = [
            (
                "tandem_node_sessions_active",
                "Sessions open on this node",
                &m.sessions_active,
            ),
            (
                "tandem_node_kv_cache_bytes",
                "KV-cache bytes held by open sessions",
                &m.kv_cache_bytes,
            ),
            (
                "tandem_node_kv_cache_reserved_bytes",
                "KV-cache bytes open sessions may grow to (what admission counts)",
                &m.kv_cache_reserved_bytes,
            ),
            (
                "tandem_node_kv_cache_budget_bytes",
                "KV-cache bytes all sessions together may grow to (--kv-cache-bytes)",
                &m.kv_cache_budget_bytes,
            ),
            (
                "tandem_node_prefix_cache_bytes",
                "KV-cache bytes the prefix cache holds for sessions to start with",
                &m.prefix_cache_bytes,
            ),
            (
                "tandem_node_prefix_cache_evicted_bytes",
                "KV-cache bytes the prefix cache dropped to stay within --prefix-cache-bytes",
                &m.prefix_cache_evicted_bytes,
            ),
        ];
        register_all(r, &gauges);
        r.register(
            "tandem_node_kv_cache_usage_perc",
            "Fraction of the KV-cache budget that open sessions may grow to (1 = full)",
            m.kv_cache_usage_perc.clone(),
        );
    }

    /// The counters and the compute histogram.
    fn register_counters(&self, r: &mut Registry) {
        let m = self;
        let counters = [
            (
                "tandem_node_sessions_opened",
                "Sessions opened",
                &m.sessions_opened,
            ),
            (
                "tandem_node_prefill_chunks",
                "Chunks of prompts prefilled (other sessions' work runs between two chunks)",
                &m.prefill_chunks,
            ),
            (
                "tandem_node_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                &m.prefix_cache_queries,
            ),
            (
                "tandem_node_prefix_cache_hits",
                "Prompt tokens whose keys and values came from the prefix cache",
                &m.prefix_cache_hits,
            ),
            (
                "tandem_node_requests",
                "Draft steps or verify blocks answered",
                &m.requests,
            ),
            (
                "tandem_node_tokens",
                "Tokens proposed (draft-node) or committed (target-node)",
                &m.tokens,
            ),
            (
                "tandem_node_repeated_blocks",
                "Verify blocks that repeated the last one, answered without a forward pass",
                &m.repeated_blocks,
            ),
            (
                "tandem_node_batches",
                "Batches of sessions' work run as one forward pass (continuous batching)",
                &m.batches,
            ),
            (
                "tandem_node_batched_requests",
                "Requests run in those batches (over batches: the mean batch size)",
                &m.batched_requests,
            ),
        ];
        register_all(r, &counters);
        r.register(
            "tandem_node_compute_seconds",
            "Model time per draft step or verify block",
            m.compute.clone(),
        );
        m.errors.register(
            r,
            "tandem_node_errors",
            "Refused or failed requests by gRPC code",
        );
        m.draft_blocks_refused.register(
            r,
            "tandem_node_draft_blocks_refused",
            "Drafted blocks the target-node refused (run as plain target steps), by reason",
        );
    }

    /// The page, in the Prometheus text format.
    pub fn encode(&self) -> String {
        encode(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_labels_escaped() {
        let mut registry = Registry::default();
        let h = latency();
        for s in [0.0002, 0.003, 0.003, 20.0] {
            h.observe(s);
        }
        registry.register("t_seconds", "help", h);
        let errors = LabeledCounter::new("kind");
        errors.add("invalid \"k\"", 2);
        errors.register(&mut registry, "t_errors", "help");
        let at = LabeledCounter::new("position");
        at.add_first(2);
        at.add_first(1);
        at.register(&mut registry, "t_at", "help");
        assert_eq!((at.get("1"), at.get("2"), at.get("3")), (2, 1, 0));
        let text = encode(&registry);
        for line in [
            "t_seconds_bucket{le=\"0.00025\"} 1\n",
            "t_seconds_bucket{le=\"0.005\"} 3\n",
            "t_seconds_bucket{le=\"+Inf\"} 4\n",
            "t_seconds_count 4\n",
            "t_at_total{position=\"1\"} 2\n",
            "t_at_total{position=\"2\"} 1\n",
            "t_errors_total{kind=\"invalid \\\"k\\\"\"} 2\n",
        ] {
            assert!(text.contains(line), "{line:?} in {text}");
        }
    }
}
