//! draft-node: serves `tandem.v1.DraftService`. Each session holds a [`Drafter`] and the
//! committed log it was told; a step rolls back to the named committed prefix, appends the
//! newly committed tokens and proposes K tokens with the distributions they were sampled from.

use tandem_node::{Error, Result};
use tandem_node::{Incoming, NodeState, Session};
use tandem_proto::v1::draft_response::Kind as Reply;
use tandem_proto::v1::draft_service_server::{DraftService, DraftServiceServer};
use tandem_proto::v1::{self, draft_request::Kind};
use tandem_proto::{distribution_to_wire, prefix_from_wire, prefix_to_wire};
use tandem_runtime::speculative::ProposeJob;
use tandem_runtime::{Drafter, KvPrefix, Prefix, Proposal, SequenceState, TokenLog};

/// One draft session.
#[derive(Debug)]
pub struct DraftSession {
    drafter: Drafter,
    log: TokenLog,
}

impl Session for DraftSession {
    type Request = v1::DraftRequest;
    type Response = v1::DraftResponse;
    type Work = v1::DraftStep;

    fn classify(request: v1::DraftRequest) -> Result<Incoming<v1::DraftStep>> {
        match request
            .kind
            .ok_or(tandem_proto::Error::MissingField("kind"))?
        {
            Kind::Open(open) => Ok(Incoming::Open(open)),
            Kind::Step(step) => Ok(Incoming::Work(step)),
            Kind::Close(_) => Ok(Incoming::Close),
        }
    }

    fn opened(opened: v1::Opened) -> v1::DraftResponse {
        reply(Reply::Opened(opened))
    }

    fn closed() -> v1::DraftResponse {
        reply(Reply::Closed(v1::Closed {}))
    }

    fn rejected(rejection: v1::Rejection) -> v1::DraftResponse {
        reply(Reply::Rejected(rejection))
    }

    fn open(state: &NodeState, open: v1::OpenSession, prefix: Option<KvPrefix>) -> Result<Self> {
        let sampling = state.check_open(&open)?;
        let mut drafter = Drafter::new(&state.model, sampling);
        if let Some(constraint) = state.constraint(&open)? {
            drafter.constrain(constraint);
        }
        if let Some(prefix) = &prefix {
            drafter.start_with(prefix)?;
        }
        // Never past what admission reserved for it.
        drafter.limit_cache(state.session_room(&open));
        Ok(Self {
            drafter,
            log: TokenLog::new(&open.prompt),
        })
    }

    fn prefilling(&mut self) -> (&mut tandem_runtime::SequenceState, &[u32]) {
        (&mut self.drafter, self.log.tokens())
    }

    /// The steps of every session in the batch drafted together: K forward passes for the
    /// batch ([`Drafter::propose_batch`]); each session's checks and errors are its own.
    fn handle_batch(
        state: &NodeState,
        mut items: Vec<(&mut Self, v1::DraftStep, &tracing::Span)>,
    ) -> Vec<Result<v1::DraftResponse>> {
        let start = std::time::Instant::now();
        let planned: Vec<Result<Prefix>> = items
            .iter_mut()
            .map(|(s, step, span)| span.in_scope(|| s.plan(state, step)))
            .collect();
        let mut jobs = Vec::new();
        for ((s, step, _), p) in items.iter_mut().zip(&planned) {
            if p.is_ok() {
                let DraftSession { drafter, log } = &mut **s;
                jobs.push(ProposeJob {
                    drafter,
                    log: log.tokens(),
                    k: step.k as usize,
                    branches: step.branches as usize,
                    min_confidence: step.min_confidence,
                });
            }
        }
        let mut proposals = Drafter::propose_batch(&mut jobs).into_iter();
        drop(jobs);
        let compute_micros = start.elapsed().as_micros() as u64;
        items
            .into_iter()
            .zip(planned)
            .map(|((s, _, _), committed)| {
                let committed = committed?;
                match proposals.next() {
                    Some(proposal) => s.answer(committed, proposal, compute_micros),
                    None => {
                        s.log.rollback_to(committed)?;
                        Err(Error::Internal(
                            "a step of the batch got no proposal".into(),
                        ))
                    }
                }
            })
            .collect()
    }

    fn tokens(reply: &v1::DraftResponse) -> usize {
        match &reply.kind {
            Some(Reply::Proposal(p)) => p.tokens.len(),
            _ => 0,
        }
    }

    fn held(&self) -> Prefix {
        self.log.prefix()
    }

    fn sequence(&self) -> &SequenceState {
        &self.drafter
    }

    fn sequence_mut(&mut self) -> &mut SequenceState {
        &mut self.drafter
    }

    fn into_prefix(self) -> Option<KvPrefix> {
        self.drafter.into_prefix()
    }
}

impl DraftSession {
    /// Checks the step and brings the log to it; returns the prefix the step named.
    fn plan(&mut self, state: &NodeState, step: &v1::DraftStep) -> Result<Prefix> {
        let committed = prefix_from_wire(step.committed)?;
        if step.branches > step.k {
            return Err(tandem_runtime::Error::invalid(
                "branches",
                step.branches,
                format!("at most k ({}): a tree of at most twice its drafts", step.k),
            )
            .into());
        }
        // A tree's drafts and siblings together count against --max-draft-tokens.
        let tokens = step.k as usize + step.branches as usize;
        state.check_step(committed.len, &step.new_tokens, tokens, 0)?;
        self.log.rollback_to(committed)?;
        self.log.extend(&step.new_tokens);
        Ok(committed)
    }

    /// The reply to a drafted step; on error the log goes back to the step's prefix, keeping
    /// the session as it was.
    fn answer(
        &mut self,
        committed: Prefix,
        proposal: tandem_runtime::Result<Proposal>,
        compute_micros: u64,
    ) -> Result<v1::DraftResponse> {
        let proposal = match proposal {
            Ok(p) => p,
            Err(e) => {
                self.log.rollback_to(committed)?;
                return Err(e.into());
            }
        };
        Ok(reply(Reply::Proposal(v1::Proposal {
            committed: Some(prefix_to_wire(self.log.prefix())),
            tokens: proposal.tokens,
            q: proposal.q.iter().map(distribution_to_wire).collect(),
            compute_micros,
            parents: proposal.parents,
            confidence: proposal.confidence,
        })))
    }
}

fn reply(kind: Reply) -> v1::DraftResponse {
    v1::DraftResponse { kind: Some(kind) }
}

tandem_node::session_service!(
    DraftServer: DraftService,
    DraftServiceServer,
    DraftSession,
    "tandem.v1.DraftService"
);
