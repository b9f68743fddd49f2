//! What a node serves from: its model and tokenizer, resolved limits and the session table, with
//! the checks every incoming request passes before it touches a cache.

use crate::error::{Error, Result};
use tandem_proto::v1;
use tandem_runtime::sampling::MAX_TOP_LOGPROBS;
use tandem_runtime::{
    Constraint, LazyGrammars, LoadOptions, Model, SamplingParams, Tokenizer, default_stop_tokens,
    model::free_memory, model::hub, model::parse_device, model::parse_dtype,
};

use crate::config::{LimitsArgs, ModelSource};
use crate::sessions::SessionTable;

/// Which side of speculation a node serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Draft,
    Target,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Draft => "draft",
            Self::Target => "target",
        }
    }
}

/// Limits resolved against the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_sessions: usize,
    pub max_session_tokens: usize,
    pub max_draft_tokens: usize,
    pub idle_timeout: std::time::Duration,
    /// Prompt tokens prefilled in one forward pass.
    pub prefill_chunk: usize,
}

/// A loaded node.
#[derive(Debug)]
pub struct NodeState {
    pub role: Role,
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub limits: Limits,
    pub sessions: SessionTable,
    /// What finished sessions computed, for new ones to start with.
    pub prefixes: crate::prefix_cache::PrefixCache,
    pub device: String,
    pub metrics: crate::metrics::NodeMetrics,
    /// Where every forward pass runs.
    pub worker: crate::worker::ModelThread,
    /// Set when SIGTERM starts draining: `/ready` and gRPC health report not serving.
    pub draining: std::sync::atomic::AtomicBool,
    vocab_hash: u64,
    stop_token_ids: Vec<u32>,
    /// An empty cache of the model (no memory): what a session of so many positions needs
    /// ([`tandem_runtime::KvCache::bytes_for`]: sliding-window layers hold their window only).
    kv_sizing: tandem_runtime::KvCache,
    /// Compiles sessions' grammars: built at the first constrained session (a token trie of the
    /// vocabulary, a fraction of a second for 150k tokens).
    grammars: LazyGrammars,
}

/// The draft's vocabulary where one applies ([`ModelSource::draft_vocab`]): the byte-level BPEs
/// built on cl100k (Qwen 2/2.5/3, Llama 3) hold English and code below it, other scripts above.
/// At 65,536 the real Qwen draft's step cost 13 % less and its greedy drafts of tool calls lost
/// their `}}}` (id 75,542): 4 tokens a round at K = 3 fell to 3.3-3.4.
const DRAFT_VOCAB: usize = 100_000;

/// The token ids whose logits a node's model computes ([`ModelSource::draft_vocab`]): the ids
/// below the draft's vocabulary and every added token; None for every token. (Public for the
/// prompts bench, which loads the draft as a draft-node would.)
pub fn logit_ids(
    role: Role,
    draft_vocab: Option<usize>,
    tokenizer: &Tokenizer,
) -> Result<Option<Vec<u32>>> {
    let below = match (role, draft_vocab) {
        (Role::Target, None) => return Ok(None),
        (Role::Target, Some(n)) => {
            return Err(tandem_runtime::Error::invalid(
                "draft_vocab",
                n,
                "a draft-node's: a target computes every token's logits",
            )
            .into());
        }
        (Role::Draft, Some(n)) => n,
        (Role::Draft, None) if tokenizer.is_byte_level() => DRAFT_VOCAB,
        (Role::Draft, None) => 0,
    };
    if below == 0 || below >= tokenizer.vocab_size() {
        return Ok(None);
    }
    let mut ids: Vec<u32> = (0..below as u32).chain(tokenizer.added_ids()).collect();
    ids.sort_unstable();
    ids.dedup();
    Ok(Some(ids))
}

impl NodeState {
    /// Loads the model and tokenizer `source` names (blocking: call before serving).
    pub fn load(role: Role, source: &ModelSource, limits: &LimitsArgs) -> Result<Self> {
        let device = parse_device(&source.device)?;
        let dtype = source.dtype.as_deref().map(parse_dtype).transpose()?;
        if let Some(spec) = source
            .dtype
            .as_deref()
            .filter(|d| device.is_cpu() && *d != "f32")
        {
            return Err(tandem_runtime::Error::invalid("dtype", spec, "the CPU runs f32").into());
        }
        let path = hub::resolve(&source.model)?;
        let tokenizer = Tokenizer::for_model(&path)?;
        let options = LoadOptions {
            device,
            dtype,
            max_context: source.max_context,
            logit_ids: logit_ids(role, source.draft_vocab, &tokenizer)?,
        };
        let model = Model::load(&path, &options)?;
        // A real one-token forward before the node serves (so before it is ready): a device
        // that cannot run the model fails here, naming why, not at the first request; and the
        // first forward's start-up costs (thread pools, page faults, kernels loaded) are not a
        // session's.
        model.forward(&[0], &mut model.new_cache(), tandem_runtime::Logits::Last)?;
        Ok(Self::new(role, model, tokenizer, &source.device, limits))
    }

    pub fn new(
        role: Role,
        model: Model,
        tokenizer: Tokenizer,
        device: &str,
        limits: &LimitsArgs,
    ) -> Self {
        let context = model.config().max_context;
        let max_session_tokens = match limits.max_session_tokens {
            0 => context,
            n => n.min(context),
        };
        let kv_cache_bytes = match limits.kv_cache_bytes {
            0 => free_memory(model.device()).map_or(usize::MAX, |m| m / 5 * 4),
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        // Within the sessions' budget: what they do not reserve. Off for a model whose
        // sliding-window layers drop positions (nothing to share).
        let kv_sizing = model.new_cache();
        let prefix_cache_bytes = match limits.prefix_cache_bytes {
            _ if !kv_sizing.can_share() => 0,
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX).min(kv_cache_bytes),
            None if kv_cache_bytes == usize::MAX => 0,
            None => kv_cache_bytes,
        };
        Self {
            role,
            limits: Limits {
                max_sessions: limits.max_sessions,
                max_session_tokens,
                max_draft_tokens: limits.max_draft_tokens,
                idle_timeout: std::time::Duration::from_secs(limits.idle_timeout_secs),
                prefill_chunk: limits.prefill_chunk.max(1),
            },
            sessions: SessionTable::new(limits.max_sessions, kv_cache_bytes),
            prefixes: crate::prefix_cache::PrefixCache::new(prefix_cache_bytes),
            kv_sizing,
            device: device.to_string(),
            metrics: crate::metrics::NodeMetrics::default(),
            draining: std::sync::atomic::AtomicBool::new(false),
            worker: crate::worker::ModelThread::spawn(
                &format!("{}-model", role.as_str()),
                limits.max_batch,
                std::time::Duration::from_micros(limits.batch_wait_us),
                model.device().is_cpu(),
            ),
            vocab_hash: tokenizer.vocab_hash(),
            stop_token_ids: default_stop_tokens(&model, &tokenizer),
            grammars: LazyGrammars::default(),
            model,
            tokenizer,
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    /// What the node is, serves and holds; whether session `session` (if named) has a message
    /// the node is working on, and how many it has answered.
    pub fn info(&self, session: &str) -> v1::NodeInfo {
        let l = &self.limits;
        let (working, answered) = match session {
            "" => (false, 0),
            id => self.sessions.report(id),
        };
        v1::NodeInfo {
            role: self.role.as_str().into(),
            model_name: self.model.name(),
            device: self.device.clone(),
            vocab_size: self.vocab_size() as u32,
            vocab_hash: self.vocab_hash,
            max_context: self.model.config().max_context as u32,
            limits: Some(v1::NodeLimits {
                max_sessions: l.max_sessions as u32,
                max_session_tokens: l.max_session_tokens as u32,
                max_draft_tokens: l.max_draft_tokens as u32,
                idle_timeout_secs: l.idle_timeout.as_secs() as u32,
            }),
            active_sessions: self.sessions.active() as u32,
            kv_cache_bytes: self.sessions.kv_bytes() as u64,
            version: env!("CARGO_PKG_VERSION").into(),
            stop_token_ids: self.stop_token_ids.clone(),
            host_id: crate::host::host_id(),
            cpus: crate::host::cpus(),
            session_working: working,
            session_answered: answered,
        }
    }

    /// Checks an open request: a non-empty prompt of known tokens that, with the tokens it may
    /// generate, fits the session limit; sampling values in range.
    pub fn check_open(&self, open: &v1::OpenSession) -> Result<SamplingParams> {
        if open.prompt.is_empty() {
            return Err(tandem_runtime::Error::EmptyPrompt.into());
        }
        self.check_tokens("prompt", &open.prompt)?;
        let limit = self.limits.max_session_tokens;
        let max_new = open.max_new_tokens as usize;
        if open.prompt.len() + max_new > limit {
            return Err(tandem_runtime::Error::PromptTooLong {
                len: open.prompt.len(),
                max_new,
                limit,
            }
            .into());
        }
        if let Some(n) = open.top_logprobs.filter(|&n| n as usize > MAX_TOP_LOGPROBS) {
            return Err(tandem_runtime::Error::invalid(
                "top_logprobs",
                n,
                format!("at most {MAX_TOP_LOGPROBS}"),
            )
            .into());
        }
        let sampling = open.sampling.as_ref();
        Ok(sampling
            .ok_or(tandem_proto::Error::MissingField("sampling"))?
            .to_runtime()?)
    }

    /// The grammar state of a session opened by `open`, if it names a grammar (compiled for
    /// this node's vocabulary, ending the output with the model's first stop token).
    pub fn constraint(&self, open: &v1::OpenSession) -> Result<Option<Constraint>> {
        let Some(wire) = &open.constraint else {
            return Ok(None);
        };
        let Some(grammar) = wire.grammar()? else {
            return Ok(None);
        };
        let compiler =
            self.grammars
                .get(&self.tokenizer, self.vocab_size(), &self.stop_token_ids)?;
        let mut constraint = compiler.compile(&grammar, wire.start as usize)?;
        // A replayed session's prompt holds generated tokens: the grammar must take them.
        constraint.sync(&open.prompt)?;
        Ok(Some(constraint))
    }

    /// Admits a session opened by `open` ([`SessionTable::acquire`]) with the longest cached
    /// prefix of its prompt, if the cache holds one: admission reserves the positions after it
    /// for the session's own storage, and the prefix's segments no open session reads yet (a
    /// prefix many sessions share is counted once). Then drops cached prefixes (least recently
    /// used first) until they fit in what the sessions do not reserve. Only the entries of the
    /// session's tenant (`open.cache_salt`, checked first) are looked in. Counts the prompt's
    /// tokens looked up, and those found.
    pub fn admit(
        &self,
        open: &v1::OpenSession,
    ) -> Result<(crate::SessionSlot, Option<tandem_runtime::KvPrefix>)> {
        tandem_proto::check_cache_salt(&open.cache_salt)?;
        let prompt = &open.prompt;
        let prefix = self
            .prefixes
            .lookup(&open.cache_salt, prompt)
            .and_then(|(prefix, common)| prefix.first(common));
        let shared = prefix.as_ref().map_or(0, tandem_runtime::KvPrefix::len);
        let own = self.session_room(open).saturating_sub(shared);
        let slot = self.sessions.acquire(
            &open.session_id,
            self.kv_sizing.bytes_for(own),
            prefix.clone(),
        )?;
        let m = &self.metrics;
        m.prefix_cache_queries.inc_by(prompt.len() as u64);
        m.prefix_cache_hits.inc_by(shared as u64);
        self.prefixes
            .shrink(self.unreserved(), &self.sessions.read_segments());
        Ok((slot, prefix))
    }

    /// A session's prompt prefilled and made a shared `prefix` ([`SequenceState::publish`]):
    /// kept in the prefix cache for the sessions of its tenant (`salt`) that start the same way
    /// while it lives, its reservation now the positions after it (of `positions` in all).
    ///
    /// [`SequenceState::publish`]: tandem_runtime::SequenceState::publish
    pub fn publish(
        &self,
        slot: &crate::SessionSlot,
        salt: &[u8],
        prefix: tandem_runtime::KvPrefix,
        positions: usize,
    ) {
        let own = positions.saturating_sub(prefix.len());
        slot.share(prefix.clone(), self.kv_sizing.bytes_for(own));
        self.keep(salt, prefix);
    }

    /// Keeps `prefix` in the prefix cache for the tenant `salt`, within what sessions do not
    /// reserve.
    pub fn keep(&self, salt: &[u8], prefix: tandem_runtime::KvPrefix) {
        let read = self.sessions.read_segments();
        self.prefixes.insert(salt, prefix, self.unreserved(), &read);
    }

    /// KV-cache bytes the sessions do not reserve: the prefix cache's room.
    pub fn unreserved(&self) -> usize {
        let (reserved, budget) = self.sessions.kv_reserved();
        budget.saturating_sub(reserved)
    }

    /// The positions a session opened by `open` may grow to (its prompt, its new tokens and
    /// one block of drafts past them): what admission reserves (those past its shared prefix)
    /// and what its cache is capped at.
    pub fn session_room(&self, open: &v1::OpenSession) -> usize {
        (open.prompt.len() + open.max_new_tokens as usize)
            .saturating_add(self.limits.max_draft_tokens + 1)
            .min(self.limits.max_session_tokens)
    }

    /// Checks a step before it changes anything: K within the limit, known tokens, and room in
    /// the session for the committed prefix, the new tokens and the block (plus `extra`).
    pub fn check_step(
        &self,
        committed: usize,
        new_tokens: &[u32],
        k: usize,
        extra: usize,
    ) -> Result<()> {
        let max_k = self.limits.max_draft_tokens;
        if k > max_k {
            return Err(invalid(
                "k",
                k,
                format!("must be at most {max_k} (--max-draft-tokens)"),
            ));
        }
        self.check_tokens("new_tokens", new_tokens)?;
        let len = committed + new_tokens.len() + k + extra;
        let limit = self.limits.max_session_tokens;
        if len > limit {
            return Err(tandem_runtime::Error::ContextFull { len, limit }.into());
        }
        Ok(())
    }

    /// Refuses token ids outside the vocabulary, naming the field.
    pub fn check_tokens(&self, field: &'static str, tokens: &[u32]) -> Result<()> {
        let vocab = self.vocab_size();
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(t) => Err(invalid(
                field,
                format!("token {t}"),
                format!("ids must be below the vocabulary size {vocab}"),
            )),
            None => Ok(()),
        }
    }
}

fn invalid(field: &'static str, value: impl ToString, limit: impl ToString) -> Error {
    tandem_runtime::Error::invalid(field, value, limit).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(path: &str) -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
        Tokenizer::for_model(&dir.join(path)).expect("tokenizer")
    }

    #[test]
    fn a_draft_computes_the_logits_of_its_vocabulary_and_a_target_of_every_token() {
        let qwen = fixture("qwen2.5-vocab/qwen2.5-vocab.gguf");
        let added: Vec<u32> = qwen.added_ids().collect();
        assert!(added.contains(&151_645), "<|im_end|> is an added token");
        let ids = logit_ids(Role::Draft, None, &qwen)
            .expect("valid")
            .expect("byte-level: a vocabulary");
        assert_eq!(ids.len(), DRAFT_VOCAB + added.len());
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert!(ids.contains(&151_645) && !ids.contains(&(DRAFT_VOCAB as u32)));
        let ids = logit_ids(Role::Draft, Some(1000), &qwen)
            .expect("valid")
            .expect("1000 < vocabulary");
        assert_eq!(ids.len(), 1000 + added.len());
        assert_eq!(logit_ids(Role::Draft, Some(0), &qwen).expect("valid"), None);
        assert_eq!(
            logit_ids(Role::Draft, Some(200_000), &qwen).expect("valid"),
            None
        );
        assert_eq!(logit_ids(Role::Target, None, &qwen).expect("valid"), None);
        let err = logit_ids(Role::Target, Some(1000), &qwen).expect_err("a target's");
        assert!(
            err.to_string().contains("a target computes every token"),
            "{err}"
        );
        // SentencePiece ids do not follow frequency: every token unless asked.
        let llama = fixture("stories260K");
        assert!(!llama.is_byte_level());
        assert_eq!(logit_ids(Role::Draft, None, &llama).expect("valid"), None);
    }
}
