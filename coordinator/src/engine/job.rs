//! What a generation is asked and what it gives back: a checked request ([`Job`]), where its
//! commits go as they happen ([`CommitSink`]), and the finished generation ([`Outcome`]).

use std::future::Future;

use crate::error::Result;
use tandem_proto::v1;
use tandem_runtime::sampling::TokenLogprobs;
use tandem_runtime::{Commit, FinishReason, GenerateRequest};

use crate::drafting::DrafterChoice;
use crate::drafting::policy::KPolicy;
use crate::engine::stats::Stats;

/// Where a generation's commits go as they happen.
pub trait CommitSink: Send {
    /// Delivers one round's commit (with its tokens' log-probabilities when the request asked
    /// for them); false when the receiver has gone.
    fn send(
        &mut self,
        commit: &Commit,
        logprobs: &[TokenLogprobs],
    ) -> impl Future<Output = bool> + Send;
}

/// Keeps nothing: for callers that only want the outcome.
#[derive(Debug, Clone, Copy, Default)]
pub struct Discard;

impl CommitSink for Discard {
    async fn send(&mut self, _: &Commit, _: &[TokenLogprobs]) -> bool {
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
    /// Sibling leaves beside the model's drafts (a token tree): fixed, or (`None`) chosen each
    /// round by the policy where K is adaptive.
    pub branches: Option<usize>,
    /// Where the draft's chain stops: fixed, or (`None`) learned by the policy.
    pub min_confidence: Option<f32>,
    /// The salt of the generation's tenant in the nodes' prefix caches
    /// (`OpenSession.cache_salt`): its request's `cache_salt`'s, else its API key's; empty for
    /// the tenant of all.
    pub cache_salt: Vec<u8>,
}

impl Job {
    /// Whether the output may not depend on where blocks end, nor on what was drafted: greedy
    /// (the target's argmax whatever the drafts), or K adaptive (blocks chosen by what earlier
    /// generations measured). A sampled request at a fixed K is reproducible from its seed only
    /// while its drafts are the same every run: nothing learnt elsewhere may change them.
    pub fn blocks_may_vary(&self) -> bool {
        self.adaptive || self.sampling.is_greedy()
    }

    /// Where the draft's chain of `k` stops this round: the request's, else the policy's where
    /// the output cannot depend on where blocks end (greedy, or K already adaptive), else never.
    pub fn stop_below(&self, policy: &KPolicy, k: usize) -> f32 {
        self.min_confidence.unwrap_or_else(|| {
            if self.blocks_may_vary() {
                policy.min_confidence(k)
            } else {
                0.0
            }
        })
    }
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
    pub logprobs: Vec<TokenLogprobs>,
}

/// Most `stop_token_ids` a request may give (each committed token is checked against them).
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// Longest `cache_salt` a request may give, in bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 1024;

/// The salt of a tenant's entries in the nodes' prefix caches: SHA-256 of what names the tenant
/// under a domain of its `kind` (`api-key`, `cache_salt`), so that no request's `cache_salt`
/// names a key's tenant, and no node sees a key.
pub fn tenant_salt(kind: &str, name: &str) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for part in ["tandem prefix-cache tenant", kind, name] {
        hash.update(part.as_bytes());
        hash.update([0]);
    }
    hash.finalize().to_vec()
}

/// A generation's salt ([`Job::cache_salt`]): `requested`'s (a request's `cache_salt`) where it
/// is given, else `tenant`.
pub(crate) fn cache_salt(requested: &str, tenant: &[u8]) -> Result<Vec<u8>> {
    match requested.len() {
        0 => Ok(tenant.to_vec()),
        n if n > MAX_CACHE_SALT_BYTES => {
            let limit = format!("at most {MAX_CACHE_SALT_BYTES} bytes");
            Err(tandem_runtime::Error::invalid("cache_salt", format!("{n} bytes"), limit).into())
        }
        _ => Ok(tenant_salt("cache_salt", requested)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requested_salt_names_its_own_tenant_never_a_keys() {
        let key = tenant_salt("api-key", "k1");
        assert_eq!(key.len(), 32);
        assert_ne!(tenant_salt("cache_salt", "k1"), key);
        assert_eq!(
            tenant_salt("api-key", "k1"),
            key,
            "the same key, the same tenant"
        );
        assert_ne!(tenant_salt("api-key", "k2"), key);
        assert_eq!(cache_salt("", &key).expect("none requested"), key);
        assert_eq!(
            cache_salt("", &[]).expect("the tenant of all"),
            Vec::<u8>::new()
        );
        let shared = cache_salt("team-x", &key).expect("requested");
        assert_eq!(cache_salt("team-x", &[]).expect("requested"), shared);
        let long = "x".repeat(MAX_CACHE_SALT_BYTES + 1);
        let text = cache_salt(&long, &key).expect_err("too long").to_string();
        assert!(
            text.contains("cache_salt") && text.contains("at most 1024"),
            "{text}"
        );
    }
}
