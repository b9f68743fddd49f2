//! What a session's steps ask and answer, in the coordinator's own types: a draft step's
//! [`Ask`] and the [`Drafted`] block it answers, a verify's block and the [`TargetVerdict`].
//! Their wire forms are made and read here, at the edge: the drafters and the engine never
//! see a `v1::` message (docs/architecture.md "Layout").

use crate::error::Result;
use tandem_proto::logprobs_from_wire;
use tandem_proto::v1;
use tandem_runtime::TokenLog;
use tandem_runtime::sampling::TokenLogprobs;

use super::links::{Draft, NodeSession, Target};

/// What a draft step asks for: `k` drafts, `branches` more nodes (a token tree), and where the
/// chain stops early (the draft-node's `min_confidence`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ask {
    pub k: usize,
    pub branches: usize,
    pub min_confidence: f32,
}

impl Ask {
    /// A chain of `k` drafts, never cut short.
    pub fn chain(k: usize) -> Self {
        Self {
            k,
            ..Self::default()
        }
    }
}

/// The distribution one draft was drawn from, as the target's acceptance rule needs it. The
/// coordinator relays a draft-node's as it came, unread (the target-node checks it); a
/// deterministic drafter's is one-hot on its token.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftQ(v1::Distribution);

impl DraftQ {
    /// All the mass on `token`: exact under the acceptance rule, whatever the sampling.
    pub fn one_hot(token: u32) -> Self {
        Self(v1::Distribution {
            kind: Some(v1::distribution::Kind::OneHot(token)),
        })
    }
}

/// A draft step's answer.
#[derive(Debug, Default)]
pub struct Drafted {
    pub tokens: Vec<u32>,
    pub q: Vec<DraftQ>,
    /// A token tree's parents (0: a child of the committed tokens, j + 1: of draft j); empty
    /// for a chain.
    pub parents: Vec<u32>,
    /// A chain's: the draft model's confidence at each draft; empty for a tree.
    pub confidence: Vec<f32>,
    /// The draft-node's compute, as it reports it.
    pub compute_secs: f64,
}

/// Why the target-node refused a block (it then ran the round as a plain target step).
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    /// The reason's name (`tandem_runtime::RefusalReason::as_str`), a metric label.
    pub reason: String,
    pub message: String,
}

/// The target's verdict on a block.
#[derive(Debug, Default, PartialEq)]
pub struct TargetVerdict {
    /// Drafts accepted: a chain's first ones, or a tree's nodes along [`Self::path`].
    pub accepted: usize,
    /// The target's own token after them.
    pub next_token: u32,
    /// A tree's accepted nodes, root first; empty for a chain.
    pub path: Vec<usize>,
    pub refused: Option<Refused>,
    /// One per committed token where the session reports them.
    pub logprobs: Vec<TokenLogprobs>,
    /// The target-node's compute, as it reports it.
    pub compute_secs: f64,
}

fn seconds(micros: u64) -> f64 {
    micros as f64 * 1e-6
}

impl NodeSession<Draft> {
    /// Feeds what `log` adds to the session and asks for the drafts `ask` describes.
    pub async fn draft(&mut self, log: &TokenLog, ask: Ask) -> Result<Drafted> {
        let p = self
            .call(log, |committed, new_tokens| v1::DraftRequest {
                kind: Some(v1::draft_request::Kind::Step(v1::DraftStep {
                    committed: Some(committed),
                    new_tokens,
                    k: ask.k as u32,
                    branches: ask.branches as u32,
                    min_confidence: ask.min_confidence,
                })),
            })
            .await?;
        Ok(Drafted {
            tokens: p.tokens,
            q: p.q.into_iter().map(DraftQ).collect(),
            parents: p.parents,
            confidence: p.confidence,
            compute_secs: seconds(p.compute_micros),
        })
    }
}

impl NodeSession<Target> {
    /// Feeds what `log` adds to the session and asks for the verdict on a block of `drafts`
    /// drawn from `q` (a token tree where `parents` is not empty).
    pub async fn verify(
        &mut self,
        log: &TokenLog,
        (drafts, q, parents): (&[u32], &[DraftQ], &[u32]),
    ) -> Result<TargetVerdict> {
        let v = self
            .call(log, |committed, new_tokens| v1::TargetRequest {
                kind: Some(v1::target_request::Kind::Verify(v1::VerifyBlock {
                    committed: Some(committed),
                    new_tokens,
                    drafts: drafts.to_vec(),
                    q: q.iter().map(|q| q.0.clone()).collect(),
                    parents: parents.to_vec(),
                })),
            })
            .await?;
        Ok(TargetVerdict {
            accepted: v.accepted as usize,
            next_token: v.next_token,
            path: v.path.iter().map(|&i| i as usize).collect(),
            refused: v.draft_refused.map(|r| Refused {
                reason: r.reason,
                message: r.message,
            }),
            logprobs: v.logprobs.iter().map(logprobs_from_wire).collect(),
            compute_secs: seconds(v.compute_micros),
        })
    }
}
