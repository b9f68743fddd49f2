//! What the coordinator counts, exposed at `/metrics` on its HTTP port.

use tandem_node::metrics::{Counter, Exposition, Histogram, LabeledCounter, PositionCounter};

/// Counters and round-latency histograms of the coordinator.
#[derive(Debug, Default)]
pub struct CoordinatorMetrics {
    pub requests: Counter,
    pub generated_tokens: Counter,
    pub drafted_tokens: Counter,
    pub accepted_tokens: Counter,
    /// Drafts and acceptances by position in the block (1 = first draft token).
    pub drafted_at: PositionCounter,
    pub accepted_at: PositionCounter,
    pub rounds: Counter,
    pub round_seconds: Histogram,
    pub draft_seconds: Histogram,
    pub verify_seconds: Histogram,
    /// Round time outside the nodes' compute: network, serialisation, scheduling.
    pub network_seconds: Histogram,
    pub repairs: Counter,
    pub drafts_lost: Counter,
    /// Drafted blocks refused (by the target-node, or here for more drafts than asked), by reason.
    pub draft_blocks_refused: LabeledCounter,
    pub errors: LabeledCounter,
}

impl CoordinatorMetrics {
    /// Records one round: `drafted` proposed, `accepted` of them accepted, and its times.
    pub fn round(&self, drafted: usize, accepted: usize, wall: f64, draft: f64, verify: f64) {
        self.rounds.add(1);
        self.drafted_tokens.add(drafted as u64);
        self.accepted_tokens.add(accepted as u64);
        self.drafted_at.add_first(drafted);
        self.accepted_at.add_first(accepted);
        self.round_seconds.observe(wall);
        if drafted > 0 {
            self.draft_seconds.observe(draft);
        }
        self.verify_seconds.observe(verify);
        self.network_seconds.observe(wall - draft - verify);
    }

    /// The Prometheus text, with `active` generations in flight.
    pub fn exposition(&self, active: usize) -> String {
        let mut e = Exposition::default();
        e.counter(
            "tandem_requests_total",
            "Generations started.",
            self.requests.get(),
        )
        .gauge(
            "tandem_active_generations",
            "Generations in flight.",
            active as f64,
        )
        .counter(
            "tandem_generated_tokens_total",
            "Tokens streamed to clients.",
            self.generated_tokens.get(),
        )
        .counter(
            "tandem_drafted_tokens_total",
            "Draft tokens proposed.",
            self.drafted_tokens.get(),
        )
        .counter(
            "tandem_accepted_tokens_total",
            "Draft tokens accepted by the target.",
            self.accepted_tokens.get(),
        )
        .positions(
            "tandem_drafted_at_position_total",
            "Draft tokens proposed by position in the block.",
            &self.drafted_at,
        )
        .positions(
            "tandem_accepted_at_position_total",
            "Draft tokens accepted by position in the block.",
            &self.accepted_at,
        )
        .counter(
            "tandem_rounds_total",
            "Draft-verify rounds.",
            self.rounds.get(),
        )
        .histogram(
            "tandem_round_seconds",
            "Wall time of a round.",
            &self.round_seconds,
        )
        .histogram(
            "tandem_round_draft_seconds",
            "Draft-node compute per round.",
            &self.draft_seconds,
        )
        .histogram(
            "tandem_round_verify_seconds",
            "Target-node compute per round.",
            &self.verify_seconds,
        )
        .histogram(
            "tandem_round_network_seconds",
            "Round time outside the nodes' compute (network, serialisation, scheduling).",
            &self.network_seconds,
        )
        .counter(
            "tandem_prefix_repairs_total",
            "Node prefix mismatches repaired by rollback or replay.",
            self.repairs.get(),
        )
        .counter(
            "tandem_drafts_lost_total",
            "Generations that lost their draft-node and went on target-only.",
            self.drafts_lost.get(),
        )
        .labeled(
            "tandem_draft_blocks_refused_total",
            "Drafted blocks refused and run as plain target steps, by reason.",
            "reason",
            &self.draft_blocks_refused,
        )
        .labeled(
            "tandem_errors_total",
            "Failed requests by gRPC code.",
            "kind",
            &self.errors,
        );
        e.finish()
    }
}
