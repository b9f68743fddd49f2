//! A request off the wire checked into a [`Job`]: both public APIs come through here (gRPC's
//! `GenerateRequest` as it came, the HTTP API's read into one), so the engine below sees only
//! the job: the prompt tokenized, K fixed or adaptive, the stop tokens, the grammar compiled,
//! the tenant's salt.

use tandem_proto::v1;
use tandem_runtime::generator::MAX_DRAFT_TOKENS;
use tandem_runtime::{GenerateRequest, RequestLimits, SamplingParams};

use crate::drafting::DrafterChoice;
use crate::drafting::policy::ADAPTIVE_MAX_K;
use crate::engine::job::cache_salt;
use crate::engine::{DEFAULT_MAX_TOKENS, Engine, Job, MAX_STOP_TOKEN_IDS};
use crate::error::Result;
use crate::nodes::replicas::Replicas;

impl Engine {
    /// Checks a request against the nodes' limits, naming the field and the limit: a request of
    /// the tenant of all that name none ([`Self::prepare_for`]).
    pub fn prepare(&self, request: &v1::GenerateRequest) -> Result<Job> {
        self.prepare_for(request, &[])
    }

    /// [`Self::prepare`] for a request of the tenant whose salt is `tenant` (its API key's,
    /// [`crate::engine::job::tenant_salt`]; empty: the tenant of all): its generation finds only
    /// its tenant's entries of the nodes' prefix caches, or those of the request's `cache_salt`
    /// where it gives one.
    pub fn prepare_for(&self, request: &v1::GenerateRequest, tenant: &[u8]) -> Result<Job> {
        self.check(request, tenant)
            .inspect_err(|e| self.count_error(e))
    }

    /// A request checked against the nodes' limits (naming the field and the limit) and turned
    /// into a job: the prompt tokenized, K fixed or adaptive, the stop tokens, the grammar
    /// compiled, the salt of its tenant (`tenant`'s unless it names one).
    fn check(&self, request: &v1::GenerateRequest, tenant: &[u8]) -> Result<Job> {
        if request.prompt_tokens.is_empty() && request.prompt.is_empty() {
            return Err(tandem_runtime::Error::EmptyPrompt.into());
        }
        if request.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            let n = request.stop_token_ids.len();
            let limit = format!("at most {MAX_STOP_TOKEN_IDS} ids");
            return Err(tandem_runtime::Error::invalid("stop_token_ids", n, limit).into());
        }
        let prompt = if request.prompt_tokens.is_empty() {
            self.tokenizer.encode(&request.prompt)?
        } else {
            request.prompt_tokens.clone()
        };
        let mut limits = RequestLimits {
            vocab_size: self.target().info.vocab_size as usize,
            context: self.target().limits().max_session_tokens as usize,
            max_draft_tokens: (self.target().limits().max_draft_tokens as usize)
                .min(MAX_DRAFT_TOKENS),
            draft_limit_source: " (the nodes' --max-draft-tokens)",
        };
        if let Some(d) = self.draft.get().map(Replicas::primary) {
            limits.context = limits.context.min(d.limits().max_session_tokens as usize);
            limits.max_draft_tokens = limits
                .max_draft_tokens
                .min(d.limits().max_draft_tokens as usize);
        }
        let fixed_k = request
            .draft_tokens
            .map(|k| k as usize)
            .or(self.default_draft_tokens);
        let adaptive = fixed_k.is_none();
        let request_job = GenerateRequest {
            prompt,
            max_new_tokens: match request.max_tokens {
                0 => DEFAULT_MAX_TOKENS,
                n => n as usize,
            },
            sampling: request.sampling.as_ref().map_or(
                Ok(SamplingParams::default()),
                v1::SamplingParams::to_runtime,
            )?,
            draft_tokens: fixed_k.unwrap_or_else(|| ADAPTIVE_MAX_K.min(limits.max_draft_tokens)),
            stop_token_ids: if request.ignore_eos {
                request.stop_token_ids.clone()
            } else {
                let model = &self.target().info.stop_token_ids;
                [model.as_slice(), &request.stop_token_ids].concat()
            },
            stop_strings: request.stop.clone(),
        };
        request_job.check(&limits)?;
        let constraint = self.grammars.check(
            &self.tokenizer,
            &self.target().info,
            request.constraint.as_ref(),
            request_job.prompt.len(),
        )?;
        let branches = request.draft_branches.map(|b| b as usize);
        if let Some(b) = branches {
            let k = request_job.draft_tokens;
            if b > k || k + b > limits.max_draft_tokens {
                let limit = format!(
                    "at most draft_tokens ({k}), with them at most {}{}",
                    limits.max_draft_tokens, limits.draft_limit_source
                );
                return Err(tandem_runtime::Error::invalid("draft_branches", b, limit).into());
            }
        }
        if let Some(c) = request
            .draft_min_confidence
            .filter(|c| !(0.0..=1.0).contains(c))
        {
            let error = tandem_runtime::Error::invalid("draft_min_confidence", c, "in [0, 1]");
            return Err(error.into());
        }
        Ok(Job {
            min_confidence: request.draft_min_confidence,
            request: request_job,
            adaptive,
            branches: branches.or(if adaptive { None } else { Some(0) }),
            drafter: DrafterChoice::parse(&request.drafter)?,
            pipeline: request.pipeline.unwrap_or(true),
            top_logprobs: request.top_logprobs,
            constraint,
            cache_salt: cache_salt(&request.cache_salt, tenant)?,
        })
    }
}
