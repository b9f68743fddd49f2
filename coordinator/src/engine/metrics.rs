//! What the coordinator counts, exposed at `/metrics` on its HTTP port: the request and
//! speculative-decoding metrics named as vLLM names them (`vllm:x` is `tandem_x` here), then
//! Tandem's own (rounds by drafter, where a round's time goes, bytes on the wire, the draft's
//! losses, stalls and re-attachments). docs/metrics.md lists them all.

use std::time::Instant;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tandem_node::metrics::{FloatGauge, LabeledCounter, encode, latency, register_all};

use super::job::Outcome;
use crate::drafting::DrafterKind;

/// Token-latency buckets in seconds: 1 ms to 60 s (a first token waits for a prefill).
const REQUEST_BUCKETS: [f64; 16] = [
    1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0,
];

fn request_latency() -> Histogram {
    Histogram::new(REQUEST_BUCKETS)
}

/// The coordinator's metrics and the registry that writes them.
#[derive(Debug)]
pub struct CoordinatorMetrics {
    /// Generations started, and those that finished, by why.
    pub requests: Counter,
    pub request_success: LabeledCounter,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    /// Generations in flight (set when the page is written), and those among them still
    /// opening their sessions: waiting for a target-node to admit them and prefill.
    pub running: Gauge,
    pub waiting: Gauge,
    pub time_to_first_token: Histogram,
    /// Per token after the first commit: the wait for its commit over the tokens it held.
    pub inter_token_latency: Histogram,
    pub e2e_latency: Histogram,
    /// From the request to both sessions open (the prompt prefilled on the nodes).
    pub prefill_time: Histogram,
    /// How long the target-node's open waited for its model thread before the prefill began.
    pub queue_time: Histogram,
    /// Rounds that verified drafts, the drafts, those accepted, and both by position in the
    /// block (1 = first draft token).
    pub num_drafts: Counter,
    pub num_draft_tokens: Counter,
    pub num_accepted_tokens: Counter,
    pub draft_tokens_per_pos: LabeledCounter,
    pub accepted_tokens_per_pos: LabeledCounter,
    /// Rounds by who drafted them (`model`, `ngram`, `none`: the target alone).
    pub rounds: LabeledCounter,
    pub round_seconds: Histogram,
    /// A round's time by part: the draft-node's compute, the target-node's, and the rest
    /// (network, serialisation, scheduling).
    pub round_part_seconds: Family<[(&'static str, &'static str); 1], Histogram>,
    /// Bytes of node session messages, `sent` and `received`.
    pub wire_bytes: LabeledCounter,
    pub repairs: Counter,
    /// Lost target sessions rebuilt by replaying the log, on the `same` replica (back) or an
    /// `other` one (a failover).
    pub target_replays: LabeledCounter,
    pub drafts_lost: Counter,
    /// Target calls past their deadline on a node that was working on them, or had answered
    /// them (the reply on its way): waited for again.
    pub target_late_calls: Counter,
    pub draft_reattaches: Counter,
    pub draft_stalls: Counter,
    /// Drafted blocks refused (by the target-node, or here for more drafts than asked), by reason.
    pub draft_blocks_refused: LabeledCounter,
    pub errors: LabeledCounter,
    /// The last round trip measured to each node replica (an `Info` call every 5 s), by `node`
    /// and `endpoint`; set when the page is written.
    pub link_rtt: Family<[(&'static str, String); 2], FloatGauge>,
    registry: Registry,
}

impl Default for CoordinatorMetrics {
    fn default() -> Self {
        let mut m = Self {
            requests: Counter::default(),
            request_success: LabeledCounter::with_values("finished_reason", ["length", "stop"]),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            time_to_first_token: request_latency(),
            inter_token_latency: request_latency(),
            e2e_latency: request_latency(),
            prefill_time: request_latency(),
            queue_time: request_latency(),
            num_drafts: Counter::default(),
            num_draft_tokens: Counter::default(),
            num_accepted_tokens: Counter::default(),
            draft_tokens_per_pos: LabeledCounter::new("position"),
            accepted_tokens_per_pos: LabeledCounter::new("position"),
            rounds: LabeledCounter::with_values("drafter", ["model", "ngram", "none"]),
            round_seconds: latency(),
            round_part_seconds: Family::new_with_constructor(latency),
            wire_bytes: LabeledCounter::with_values("direction", ["sent", "received"]),
            repairs: Counter::default(),
            target_replays: LabeledCounter::with_values("replica", ["same", "other"]),
            drafts_lost: Counter::default(),
            target_late_calls: Counter::default(),
            draft_reattaches: Counter::default(),
            draft_stalls: Counter::default(),
            draft_blocks_refused: LabeledCounter::refusals(),
            errors: LabeledCounter::errors(),
            link_rtt: Family::default(),
            registry: Registry::default(),
        };
        m.register();
        m
    }
}

impl CoordinatorMetrics {
    fn register(&mut self) {
        let mut registry = Registry::default();
        self.register_counts(&mut registry);
        self.register_times(&mut registry);
        self.register_labeled(&mut registry);
        self.registry = registry;
    }

    /// The counters and gauges without labels.
    fn register_counts(&self, r: &mut Registry) {
        let counters = [
            ("tandem_requests", "Generations started", &self.requests),
            (
                "tandem_prompt_tokens",
                "Prompt tokens of the generations started",
                &self.prompt_tokens,
            ),
            (
                "tandem_generation_tokens",
                "Tokens generated (streamed to clients)",
                &self.generation_tokens,
            ),
            (
                "tandem_spec_decode_num_drafts",
                "Rounds that verified a drafted block",
                &self.num_drafts,
            ),
            (
                "tandem_spec_decode_num_draft_tokens",
                "Draft tokens proposed",
                &self.num_draft_tokens,
            ),
            (
                "tandem_spec_decode_num_accepted_tokens",
                "Draft tokens accepted by the target",
                &self.num_accepted_tokens,
            ),
            (
                "tandem_prefix_repairs",
                "Node prefix mismatches repaired by rollback or replay",
                &self.repairs,
            ),
            (
                "tandem_drafts_lost",
                "Generations that lost their draft-node and went on target-only",
                &self.drafts_lost,
            ),
            (
                "tandem_target_late_calls",
                "Target calls past their deadline on a node still working on them (queued behind \
                 other sessions' work) or whose reply was on its way: waited for, not replayed",
                &self.target_late_calls,
            ),
            (
                "tandem_draft_reattaches",
                "Draft-node sessions attached again after a loss or a stall",
                &self.draft_reattaches,
            ),
            (
                "tandem_draft_stalls",
                "Draft steps abandoned at their deadline",
                &self.draft_stalls,
            ),
        ];
        register_all(r, &counters);
        let gauges = [
            (
                "tandem_num_requests_running",
                "Generations in flight",
                &self.running,
            ),
            (
                "tandem_num_requests_waiting",
                "Generations in flight still opening their node sessions (admission and prefill \
                 on the nodes): the queue to scale target-nodes on",
                &self.waiting,
            ),
        ];
        register_all(r, &gauges);
    }

    /// The histograms.
    fn register_times(&self, r: &mut Registry) {
        let histograms = [
            (
                "tandem_time_to_first_token_seconds",
                "From the request to its first token streamed",
                &self.time_to_first_token,
            ),
            (
                "tandem_inter_token_latency_seconds",
                "Per token after the first commit: the wait for its commit over the tokens it held",
                &self.inter_token_latency,
            ),
            (
                "tandem_e2e_request_latency_seconds",
                "From the request to its last token",
                &self.e2e_latency,
            ),
            (
                "tandem_request_prefill_time_seconds",
                "From the request to both node sessions open, the prompt prefilled",
                &self.prefill_time,
            ),
            (
                "tandem_request_queue_time_seconds",
                "How long the target-node's open waited for its model thread (other sessions' work) before the prefill began",
                &self.queue_time,
            ),
            (
                "tandem_round_seconds",
                "Wall time of a draft-verify round",
                &self.round_seconds,
            ),
        ];
        register_all(r, &histograms);
        r.register(
            "tandem_link_rtt_seconds",
            "The last round trip measured to each node replica (an Info call every 5 s), by node and endpoint",
            self.link_rtt.clone(),
        );
        r.register(
            "tandem_round_part_seconds",
            "A round's time by part: draft (draft-node compute), verify (target-node compute), \
             network (the rest: network, serialisation, scheduling)",
            self.round_part_seconds.clone(),
        );
    }

    /// The counters by label.
    fn register_labeled(&self, r: &mut Registry) {
        let labeled = [
            (
                "tandem_request_success",
                "Generations finished, by why (length, stop)",
                &self.request_success,
            ),
            (
                "tandem_spec_decode_num_draft_tokens_per_pos",
                "Draft tokens proposed by position in the block",
                &self.draft_tokens_per_pos,
            ),
            (
                "tandem_spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted by position in the block",
                &self.accepted_tokens_per_pos,
            ),
            (
                "tandem_rounds",
                "Draft-verify rounds by who drafted them (model, ngram, none)",
                &self.rounds,
            ),
            (
                "tandem_target_replays",
                "Lost target sessions rebuilt by replaying the log, on the same replica or another (a failover)",
                &self.target_replays,
            ),
            (
                "tandem_wire_bytes",
                "Bytes of node session messages (sent, received)",
                &self.wire_bytes,
            ),
            (
                "tandem_draft_blocks_refused",
                "Drafted blocks refused and run as plain target steps, by reason",
                &self.draft_blocks_refused,
            ),
            (
                "tandem_errors",
                "Failed requests by gRPC code",
                &self.errors,
            ),
        ];
        for (name, help, counter) in labeled {
            counter.register(r, name, help);
        }
    }

    /// Records one round: who drafted it (`None`: the target alone), `drafted` proposed,
    /// `accepted` of them accepted, and its times.
    pub fn round(
        &self,
        drafter: Option<DrafterKind>,
        (drafted, accepted): (usize, usize),
        wall: f64,
        draft: f64,
        verify: f64,
    ) {
        let by = match drafter {
            Some(DrafterKind::Model) => "model",
            Some(DrafterKind::Ngram) => "ngram",
            None => "none",
        };
        self.rounds.add(by, 1);
        if drafted > 0 {
            self.num_drafts.inc();
            self.round_part_seconds
                .get_or_create(&[("part", "draft")])
                .observe(draft);
        }
        self.num_draft_tokens.inc_by(drafted as u64);
        self.num_accepted_tokens.inc_by(accepted as u64);
        self.draft_tokens_per_pos.add_first(drafted);
        self.accepted_tokens_per_pos.add_first(accepted);
        self.round_seconds.observe(wall);
        self.round_part_seconds
            .get_or_create(&[("part", "verify")])
            .observe(verify);
        self.round_part_seconds
            .get_or_create(&[("part", "network")])
            .observe((wall - draft - verify).max(0.0));
    }

    /// Records a generation that ended well.
    pub fn finished(&self, o: &Outcome, seconds: f64) {
        self.request_success.add(o.finish_reason.as_str(), 1);
        self.generation_tokens.inc_by(o.token_ids.len() as u64);
        self.e2e_latency.observe(seconds);
        let s = &o.stats;
        self.repairs.inc_by(u64::from(s.repairs));
        self.drafts_lost.inc_by(u64::from(s.draft_lost));
        self.draft_reattaches.inc_by(u64::from(s.draft_reattached));
        self.draft_stalls.inc_by(u64::from(s.draft_stalls));
        self.wire_bytes.add("sent", s.traffic.sent);
        self.wire_bytes.add("received", s.traffic.received);
    }

    /// A commit of `tokens` streamed: the generation's first token (since `start`), or the
    /// wait since the last commit shared among its tokens.
    pub fn streamed(&self, last: &mut Option<Instant>, start: Instant, tokens: usize) {
        if tokens == 0 {
            return;
        }
        let now = Instant::now();
        match *last {
            None => self
                .time_to_first_token
                .observe((now - start).as_secs_f64()),
            Some(at) => {
                let each = (now - at).as_secs_f64() / tokens as f64;
                for _ in 0..tokens {
                    self.inter_token_latency.observe(each);
                }
            }
        }
        *last = Some(now);
    }

    /// The page in the Prometheus text format, with `active` generations in flight and the
    /// round trips to the node replicas as last measured (`(node, endpoint, seconds)`).
    pub fn exposition(&self, active: usize, round_trips: &[(&'static str, String, f64)]) -> String {
        self.running.set(i64::try_from(active).unwrap_or(i64::MAX));
        // Replicas come and go: only those measured now have a series.
        self.link_rtt.clear();
        for (node, endpoint, seconds) in round_trips {
            self.link_rtt
                .get_or_create(&[
                    ("node", (*node).to_string()),
                    ("endpoint", endpoint.clone()),
                ])
                .set(*seconds);
        }
        encode(&self.registry)
    }
}

/// One more in a gauge while it lives.
#[derive(Debug)]
pub struct Counted(Gauge);

impl Counted {
    pub fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.dec();
    }
}
