//! target-node: serves `tandem.v1.TargetService`. Each session holds a [`Verifier`] and the
//! committed log; a verify block rolls back to the named committed prefix, appends the newly
//! committed tokens, scores [last committed token, d1..dK] in one forward pass and applies the
//! lossless acceptance rule. The verdict's accepted drafts and next token join the log.
//!
//! The node trusts nothing the draft wrote (docs/architecture.md invariant 1): a block whose drafts or q
//! fail the checks of [`tandem_runtime::draft_check`] is not verified; the round is one plain
//! target step and the verdict carries the refusal. A block that repeats the last one answered
//! gets the same verdict again without a forward pass.

use tandem_node::{Error, Result};
use tandem_node::{Incoming, NodeState, Session};
use tandem_proto::v1::target_response::Kind as Reply;
use tandem_proto::v1::target_service_server::{TargetService, TargetServiceServer};
use tandem_proto::v1::{self, target_request::Kind};
use tandem_proto::{distribution_from_wire, prefix_from_wire, prefix_to_wire};
use tandem_runtime::draft_check::check_counts;
use tandem_runtime::speculative::tree::{DraftTree, MAX_TREE_DEPTH, TreeLimits};
use tandem_runtime::speculative::{BlockVerified, VerifyJob};
use tandem_runtime::{
    Distribution, DraftRefusal, KvPrefix, Prefix, RefusalReason, SequenceState, TokenLog, Verified,
    Verifier,
};

/// One target session.
#[derive(Debug)]
pub struct TargetSession {
    verifier: Verifier,
    log: TokenLog,
    /// The last block verified, to answer a duplicate without a second forward.
    last: Option<Answered>,
}

/// A verified block, its reply, and the prefix the session held after it.
#[derive(Debug)]
struct Answered {
    block: v1::VerifyBlock,
    reply: v1::TargetResponse,
    held: Prefix,
}

impl Session for TargetSession {
    type Request = v1::TargetRequest;
    type Response = v1::TargetResponse;
    type Work = v1::VerifyBlock;

    fn classify(request: v1::TargetRequest) -> Result<Incoming<v1::VerifyBlock>> {
        match request
            .kind
            .ok_or(tandem_proto::Error::MissingField("kind"))?
        {
            Kind::Open(open) => Ok(Incoming::Open(open)),
            Kind::Verify(block) => Ok(Incoming::Work(block)),
            Kind::Close(_) => Ok(Incoming::Close),
        }
    }

    fn opened(opened: v1::Opened) -> v1::TargetResponse {
        reply(Reply::Opened(opened))
    }

    fn closed() -> v1::TargetResponse {
        reply(Reply::Closed(v1::Closed {}))
    }

    fn rejected(rejection: v1::Rejection) -> v1::TargetResponse {
        reply(Reply::Rejected(rejection))
    }

    fn open(state: &NodeState, open: v1::OpenSession, prefix: Option<KvPrefix>) -> Result<Self> {
        let sampling = state.check_open(&open)?;
        let mut verifier = Verifier::new(&state.model, sampling);
        if let Some(constraint) = state.constraint(&open)? {
            verifier.constrain(constraint);
        }
        verifier.report_logprobs(open.top_logprobs.map(|n| n as usize));
        if let Some(prefix) = &prefix {
            verifier.start_with(prefix)?;
        }
        // Never past what admission reserved for it.
        verifier.limit_cache(state.session_room(&open));
        Ok(Self {
            verifier,
            log: TokenLog::new(&open.prompt),
            last: None,
        })
    }

    fn prefilling(&mut self) -> (&mut tandem_runtime::SequenceState, &[u32]) {
        (&mut self.verifier, self.log.tokens())
    }

    /// The blocks of every session in the batch verified in one forward pass
    /// ([`Verifier::verify_batch`]); each session's checks, refusals and errors are its own.
    fn handle_batch(
        state: &NodeState,
        mut items: Vec<(&mut Self, v1::VerifyBlock, &tracing::Span)>,
    ) -> Vec<Result<v1::TargetResponse>> {
        let start = std::time::Instant::now();
        let mut results: Vec<Option<Result<v1::TargetResponse>>> = Vec::new();
        let mut plans = Vec::new();
        for (s, block, span) in &mut items {
            let (result, plan) = match span.in_scope(|| s.plan(state, block)) {
                Ok(Planned::Repeat(reply)) => (Some(Ok(reply)), None),
                Ok(Planned::Verify(plan)) => (None, Some(plan)),
                Err(e) => (Some(Err(e)), None),
            };
            results.push(result);
            plans.push(plan);
        }
        let mut jobs = Vec::new();
        let mut verifying = Vec::new();
        for (i, ((s, block, _), plan)) in items.iter_mut().zip(&mut plans).enumerate() {
            if let Some(plan) = plan {
                let TargetSession { verifier, log, .. } = &mut **s;
                jobs.push(VerifyJob {
                    verifier,
                    log: log.tokens(),
                    drafts: &block.drafts,
                    q: &plan.q,
                    max_drafts: plan.max_drafts,
                    refused: plan.refused.take(),
                    tree: plan.tree.as_ref(),
                });
                verifying.push((i, plan.committed));
            }
        }
        let verified = Verifier::verify_batch(&mut jobs);
        drop(jobs);
        let compute_micros = start.elapsed().as_micros() as u64;
        for ((i, committed), verified) in verifying.into_iter().zip(verified) {
            let (s, block, span) = &mut items[i];
            let reply = span
                .in_scope(|| s.answer(state, block.clone(), committed, verified, compute_micros));
            results[i] = Some(reply);
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(Error::Internal(
                        "a block of the batch got no verdict".into(),
                    ))
                })
            })
            .collect()
    }

    fn tokens(reply: &v1::TargetResponse) -> usize {
        match &reply.kind {
            Some(Reply::Verdict(v)) => v.accepted as usize + 1,
            _ => 0,
        }
    }

    fn held(&self) -> Prefix {
        self.log.prefix()
    }

    fn sequence(&self) -> &SequenceState {
        &self.verifier
    }

    fn sequence_mut(&mut self) -> &mut SequenceState {
        &mut self.verifier
    }

    fn into_prefix(self) -> Option<KvPrefix> {
        self.verifier.into_prefix()
    }
}

/// What a block needs before the batch's forward.
enum Planned {
    /// The block repeats the last one answered: the same reply, no forward pass.
    Repeat(v1::TargetResponse),
    Verify(Plan),
}

/// A block ready to verify: the log already holds its newly committed tokens.
#[derive(Debug)]
struct Plan {
    /// The prefix the block named, to roll back to if the verify fails.
    committed: Prefix,
    q: Vec<Distribution>,
    refused: Option<DraftRefusal>,
    max_drafts: usize,
    /// The drafts' tree, when the block names parents.
    tree: Option<DraftTree>,
}

impl TargetSession {
    /// Checks the coordinator's part of the block, brings the log to it and decodes q.
    fn plan(&mut self, state: &NodeState, block: &v1::VerifyBlock) -> Result<Planned> {
        if let Some(last) = &self.last
            && last.block == *block
            && last.held == self.log.prefix()
        {
            state.metrics.repeated_blocks.inc_by(1);
            return Ok(Planned::Repeat(last.reply.clone()));
        }
        let committed = prefix_from_wire(block.committed)?;
        // The coordinator's part of the block: a prefix, newly committed tokens and room for
        // the token this round commits at least. The drafts are the draft's part, checked by
        // the verifier.
        state.check_step(committed.len, &block.new_tokens, 0, 1)?;
        self.log.rollback_to(committed)?;
        self.log.extend(&block.new_tokens);
        let room = state.limits.max_session_tokens - (self.log.len() + 1);
        let max_drafts = state.limits.max_draft_tokens.min(room);
        let (mut q, mut refused) = match decode_q(block, state.vocab_size(), max_drafts) {
            Ok(q) => (q, None),
            Err(refusal) => (Vec::new(), Some(refusal)),
        };
        let limits = TreeLimits {
            max_nodes: max_drafts,
            max_depth: MAX_TREE_DEPTH,
        };
        let tree = match block.parents.is_empty() || refused.is_some() {
            true => None,
            false => match DraftTree::new(&block.drafts, &block.parents, limits) {
                Ok(tree) => Some(tree),
                Err(e) => {
                    q.clear();
                    refused = Some(DraftRefusal::new(
                        0,
                        RefusalReason::MalformedTree,
                        e.to_string(),
                    ));
                    None
                }
            },
        };
        Ok(Planned::Verify(Plan {
            committed,
            q,
            refused,
            max_drafts,
            tree,
        }))
    }

    /// The reply to a verified block; the log takes what it committed (or, on error, goes back
    /// to the prefix the block named).
    fn answer(
        &mut self,
        state: &NodeState,
        block: v1::VerifyBlock,
        committed: Prefix,
        verified: tandem_runtime::Result<BlockVerified>,
        compute_micros: u64,
    ) -> Result<v1::TargetResponse> {
        let checked = match verified {
            Ok(v) => v,
            Err(e) => {
                self.log.rollback_to(committed)?;
                return Err(e.into());
            }
        };
        let (tokens, path, next, refused, logprobs) = match checked {
            BlockVerified::Chain(Verified {
                verdict,
                refused,
                logprobs,
            }) => {
                let drafts: &[u32] = if refused.is_some() {
                    &[]
                } else {
                    &block.drafts
                };
                let path = (0..verdict.accepted as u32).collect();
                (
                    verdict.committed(drafts),
                    path,
                    verdict.next,
                    refused,
                    logprobs,
                )
            }
            BlockVerified::Tree(t) => {
                let path = t.verdict.path.iter().map(|&n| n as u32).collect();
                (t.committed, path, t.verdict.next, t.refused, t.logprobs)
            }
        };
        if let Some(r) = &refused {
            tracing::info!(position = r.position, reason = r.reason.as_str(), detail = %r.detail, "draft block refused");
            state.metrics.draft_blocks_refused.add(r.reason.as_str(), 1);
        }
        self.log.extend(&tokens);
        let tree = !block.parents.is_empty();
        let response = reply(Reply::Verdict(v1::VerdictReply {
            accepted: (tokens.len() - 1) as u32,
            path: if tree { path } else { Vec::new() },
            next_token: next,
            committed: Some(prefix_to_wire(self.log.prefix())),
            compute_micros,
            draft_refused: refused.map(|r| v1::DraftRefusal {
                position: r.position as u32,
                reason: r.reason.as_str().into(),
                message: r.to_string(),
            }),
            logprobs: logprobs
                .iter()
                .map(tandem_proto::logprobs_to_wire)
                .collect(),
        }));
        self.last = Some(Answered {
            block,
            reply: response.clone(),
            held: self.log.prefix(),
        });
        Ok(response)
    }
}

/// The block's q, decoded after its sizes are checked; what does not decode refuses the block.
fn decode_q(
    block: &v1::VerifyBlock,
    vocab_size: usize,
    max_drafts: usize,
) -> std::result::Result<Vec<Distribution>, DraftRefusal> {
    check_counts(block.drafts.len(), block.q.len(), max_drafts)?;
    block
        .q
        .iter()
        .enumerate()
        .map(|(i, d)| distribution_from_wire(d, vocab_size, i))
        .collect()
}

fn reply(kind: Reply) -> v1::TargetResponse {
    v1::TargetResponse { kind: Some(kind) }
}

tandem_node::session_service!(
    TargetServer: TargetService,
    TargetServiceServer,
    TargetSession,
    "tandem.v1.TargetService"
);
