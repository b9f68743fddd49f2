//! What a distributed generation counts: rounds and their drafters, the draft-node's failures
//! and re-attachments, the pipeline's hits, and the bytes on the links.

use tandem_runtime::GenerationStats;

use crate::nodes::links::{NodeSession, Traffic, Wire};

/// Statistics of a distributed generation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Rounds, drafted, accepted, and times: draft and target seconds are the nodes' compute.
    pub base: GenerationStats,
    pub repairs: u32,
    pub draft_lost: bool,
    /// Why the draft was detached, when it was.
    pub draft_lost_reason: String,
    /// Drafted blocks refused (each ran as a plain target step).
    pub draft_blocks_refused: u32,
    /// The seed every draw was keyed by.
    pub seed: u64,
    pub traffic: Traffic,
    /// Rounds drafted by the draft-node's model, by n-gram lookup, and target-only rounds.
    pub model_rounds: u32,
    pub ngram_rounds: u32,
    pub target_only_rounds: u32,
    /// Of `ngram_rounds`, those that continued an earlier output of the tenant.
    pub history_rounds: u32,
    /// Times a lost or stalled draft-node was attached again.
    pub draft_reattached: u32,
    /// Draft steps abandoned at their deadline.
    pub draft_stalls: u32,
    /// Rounds whose next block the draft-node drafted during the verify, and rounds that used
    /// such a block (the pipeline's hits).
    pub pipeline_rounds: u32,
    pub pipeline_hits: u32,
    /// Tokens the draft-node drafted (its steps and the blocks it drafted ahead).
    pub draft_node_tokens: u32,
    /// Of `base.draft_seconds`, what the rounds waited for: the draft steps, and of a block
    /// drafted during the verify only what ran past the verdict (drafting ahead counted once).
    pub draft_waited_seconds: f64,
    /// Prompt tokens the target-node took from its prefix cache.
    pub cached_tokens: u32,
    /// Rounds verified as token trees, and rounds whose path left the chain for a branch.
    pub tree_rounds: u32,
    pub sibling_hits: u32,
    /// Per round that drafted: the drafts proposed and those accepted (the responses'
    /// per-request speculation metrics).
    pub steps: Vec<[u32; 2]>,
}

impl Stats {
    pub(crate) fn lose_draft(&mut self, reason: String) {
        self.draft_lost = true;
        self.draft_lost_reason = reason;
    }

    /// Adds what a node session counted (repairs, bytes) as it ends.
    pub(crate) fn settle<W: Wire>(&mut self, session: &NodeSession<W>) {
        self.repairs += session.repairs;
        self.traffic += session.traffic();
    }
}
