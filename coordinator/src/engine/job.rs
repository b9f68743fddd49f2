//! What a generation is asked and what it gives back: a checked request ([`Job`]), where its
//! commits go as they happen ([`CommitSink`]), and the finished generation ([`Outcome`]).

use std::future::Future;

use tandem_proto::v1;
use tandem_runtime::{Commit, FinishReason, GenerateRequest};

use crate::drafting::drafters::DrafterChoice;
use crate::engine::stats::Stats;

/// Where a generation's commits go as they happen.
pub trait CommitSink: Send {
    /// Delivers one round's commit (with its tokens' log-probabilities when the request asked
    /// for them); false when the receiver has gone.
    fn send(
        &mut self,
        commit: &Commit,
        logprobs: &[v1::TokenLogprobs],
    ) -> impl Future<Output = bool> + Send;
}

/// Keeps nothing: for callers that only want the outcome.
#[derive(Debug, Clone, Copy, Default)]
pub struct Discard;

impl CommitSink for Discard {
    async fn send(&mut self, _: &Commit, _: &[v1::TokenLogprobs]) -> bool {
        true
    }
}

/// A request checked against the nodes' limits, ready to run.
#[derive(Debug, Clone)]
pub struct Job {
    /// What to generate; with `adaptive`, `draft_tokens` is the largest K tried.
    pub request: GenerateRequest,
    /// K chosen each round by the cost model ([`crate::drafting::policy::KPolicy`]) rather than fixed.
    pub adaptive: bool,
    pub drafter: DrafterChoice,
    /// The draft-node drafts the next block while the target verifies (docs/architecture.md "Pipelined").
    pub pipeline: bool,
    /// Log-probabilities of each token and this many alternatives, from the target.
    pub top_logprobs: Option<u32>,
    /// The grammar the output follows (compiled once by the coordinator to check it), with
    /// `start` the prompt's length.
    pub constraint: Option<v1::Constraint>,
}

impl std::ops::Deref for Job {
    type Target = GenerateRequest;

    fn deref(&self) -> &GenerateRequest {
        &self.request
    }
}

/// A finished generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub stats: Stats,
    /// Each token's log-probabilities, when the request asked for them.
    pub logprobs: Vec<v1::TokenLogprobs>,
}

/// Most `stop_token_ids` a request may give (each committed token is checked against them).
pub const MAX_STOP_TOKEN_IDS: usize = 64;
