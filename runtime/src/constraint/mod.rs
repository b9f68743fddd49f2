//! Constrained decoding: the output restricted to a JSON schema, a Lark grammar or a regex, with
//! llguidance (the engine vLLM, SGLang and llama.cpp use) over the model's own vocabulary
//! ([`vocab`]). A [`Constraint`] is one sequence's grammar state: it follows the sequence's
//! committed tokens from where generation began (rolled back with them, as the KV cache is) and
//! masks a position's logits to the tokens the grammar allows after the tokens before it, so that
//! p is the model's distribution restricted to the grammar and renormalised (docs/architecture.md
//! invariant 1). It is derived state: rebuilt from the log, it gives the same masks.

mod vocab;

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::SimpleVob;

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// What the output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// A JSON value valid against this schema.
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// A regular expression the whole output matches.
    Regex(String),
}

/// Whitespace a JSON output may put between its tokens, as llama.cpp's JSON grammars allow it:
/// none, one space, or a newline and up to 20 spaces or tabs of indentation. Unbounded
/// whitespace (llguidance's default) lets a model that likes it emit nothing else until its
/// token budget runs out. A schema's own `x-guidance` options take precedence.
const JSON_WHITESPACE: &str = r"[ ]|\n[ \t]{0,20}";

fn bounded_whitespace(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_pattern": JSON_WHITESPACE}));
    }
    schema
}

fn json_grammar(schema: serde_json::Value) -> TopLevelGrammar {
    TopLevelGrammar::from_json_schema(bounded_whitespace(schema))
}

impl Grammar {
    /// `schema` as an item of a Lark grammar (`%json {…}`), its whitespace bounded as
    /// [`Grammar::JsonSchema`]'s is.
    pub fn lark_json(schema: &serde_json::Value) -> String {
        format!("%json {}", bounded_whitespace(schema.clone()))
    }

    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Self::JsonObject => json_grammar(serde_json::json!({"type": "object"})),
            Self::JsonSchema(schema) => json_grammar(schema.clone()),
            Self::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Self::Regex(rx) => TopLevelGrammar::from_regex(rx),
        }
    }
}

/// Compiles grammars for one vocabulary: built once per model (the token trie of its
/// vocabulary), shared by its sessions.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    vocab_size: usize,
    /// The tokens that end a complete output (the first is llguidance's end of sequence).
    stops: Arc<[u32]>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl GrammarCompiler {
    /// For `tokenizer`'s vocabulary over a model's `vocab_size` logits (ids past the tokenizer's
    /// are never allowed), ending the output with any of `stops` (the model's stop tokens: a
    /// chat model ends its turn with its own, Qwen's `<|im_end|>`, not its end of text) where
    /// the grammar is complete.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, stops: &[u32]) -> Result<Self> {
        let &eos = stops.first().ok_or_else(|| {
            Error::Grammar("the model names no end-of-sequence token to end a grammar with".into())
        })?;
        let env = vocab::token_env(tokenizer, vocab_size, eos)?;
        let mut factory = ParserFactory::new_simple(&env).map_err(grammar_error)?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
            vocab_size,
            stops: stops.into(),
        })
    }

    /// The logits it masks.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// A fresh state of `grammar` for a sequence whose generated tokens start at position
    /// `start` of its log; an error names what does not compile.
    pub fn compile(&self, grammar: &Grammar, start: usize) -> Result<Constraint> {
        let parser = self
            .factory
            .create_parser(grammar.top_level())
            .map_err(grammar_error)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::Grammar(e));
        }
        Ok(Constraint {
            matcher,
            start,
            consumed: Vec::new(),
            in_matcher: 0,
            vocab_size: self.vocab_size,
            stops: Arc::clone(&self.stops),
        })
    }
}

/// A [`GrammarCompiler`] built at its first use (a node or a coordinator that never sees a
/// grammar never builds the token trie).
#[derive(Debug, Default)]
pub struct LazyGrammars(std::sync::OnceLock<GrammarCompiler>);

impl LazyGrammars {
    /// The compiler for `tokenizer` over `vocab_size` logits, ending outputs with the model's
    /// `stop_tokens`.
    pub fn get(
        &self,
        tokenizer: &Tokenizer,
        vocab_size: usize,
        stop_tokens: &[u32],
    ) -> Result<&GrammarCompiler> {
        if let Some(c) = self.0.get() {
            return Ok(c);
        }
        let built = GrammarCompiler::new(tokenizer, vocab_size, stop_tokens)?;
        Ok(self.0.get_or_init(|| built))
    }

    /// The compiler, if [`Self::get`] has built it.
    pub fn built(&self) -> Option<&GrammarCompiler> {
        self.0.get()
    }
}

fn grammar_error(e: impl std::fmt::Display) -> Error {
    Error::Grammar(e.to_string())
}

/// One sequence's grammar state, after the tokens it has consumed.
pub struct Constraint {
    matcher: Matcher,
    /// Where generation begins in the sequence's log.
    start: usize,
    /// The generated tokens the state is after.
    consumed: Vec<u32>,
    /// How many of them the matcher took (the rest: ends of sequence after it stopped).
    in_matcher: usize,
    vocab_size: usize,
    /// Tokens that end the output (the first is the one llguidance knows).
    stops: Arc<[u32]>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("start", &self.start)
            .field("consumed", &self.consumed.len())
            .finish()
    }
}

/// The tokens a grammar allows at one position.
#[derive(Debug, Clone)]
pub struct Mask(SimpleVob);

impl Mask {
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// Sets every forbidden token's logit to −∞, 32 tokens per word of the mask (a mask mostly
    /// forbids or mostly allows whole words: a JSON string's body allows most of a vocabulary,
    /// a key or a number few of it).
    pub fn apply(&self, logits: &mut [f32]) {
        let words = self.0.as_slice();
        for (i, chunk) in logits.chunks_mut(32).enumerate() {
            match words.get(i).copied().unwrap_or(0) {
                u32::MAX if chunk.len() == 32 => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                word => {
                    for (bit, l) in chunk.iter_mut().enumerate() {
                        if word & (1 << bit) == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
    }
}

impl Constraint {
    /// Brings the state to `log` (the sequence's committed tokens, and drafts past them): rolls
    /// back what it consumed beyond their common prefix and consumes the rest. A token of the log
    /// the grammar forbids is an error (a committed token always came from a masked p).
    pub fn sync(&mut self, log: &[u32]) -> Result<()> {
        let generated = log.get(self.start..).unwrap_or_default();
        let common = crate::token_log::common_len(&self.consumed, generated);
        self.rollback_to(common)?;
        for &t in &generated[common..] {
            if !self.push(t)? {
                return Err(Error::Grammar(format!(
                    "token {t} at position {} is not allowed by the grammar",
                    self.position()
                )));
            }
        }
        Ok(())
    }

    /// The tokens allowed next (only the stop tokens once the grammar is complete).
    pub fn mask(&mut self) -> Result<Mask> {
        let mut vob = self.matcher.compute_mask_or_eos().map_err(grammar_error)?;
        if vob.len() < self.vocab_size {
            vob.resize(self.vocab_size);
        }
        if vob.is_allowed(self.stops[0]) {
            for &stop in &self.stops[1..] {
                if (stop as usize) < vob.len() {
                    vob.allow_token(stop);
                }
            }
        }
        Ok(Mask(vob))
    }

    /// Consumes `token` if the grammar allows it next; false (the state unchanged) if not.
    pub fn push(&mut self, token: u32) -> Result<bool> {
        let eos = self.stops[0];
        let stop = self.stops.contains(&token);
        if stop && self.matcher.is_stopped() {
            // Past the end (a draft block may run on after it): only an end again, which the
            // matcher, stopped, does not take.
            self.consumed.push(token);
            return Ok(true);
        }
        let allowed = if stop {
            // A stop token ends a complete output (llguidance validates text tokens).
            self.mask()?.allows(eos)
        } else {
            (token as usize) < self.vocab_size
                && self
                    .matcher
                    .validate_tokens(&[token])
                    .map_err(grammar_error)?
                    == 1
        };
        if !allowed {
            return Ok(false);
        }
        // llguidance knows one end of sequence: any stop token is that one to it.
        let consumed = if stop { eos } else { token };
        self.matcher
            .consume_token(consumed)
            .map_err(grammar_error)?;
        self.consumed.push(token);
        self.in_matcher = self.consumed.len();
        Ok(true)
    }

    /// Rolls back to the first `len` generated tokens.
    pub fn rollback_to(&mut self, len: usize) -> Result<()> {
        let keep = self.in_matcher.min(len);
        self.matcher
            .rollback(self.in_matcher - keep)
            .map_err(grammar_error)?;
        self.in_matcher = keep;
        self.consumed.truncate(len);
        Ok(())
    }

    /// Generated tokens the state is after, counted from the log's start.
    pub fn position(&self) -> usize {
        self.start + self.consumed.len()
    }
}

#[cfg(test)]
mod tests;
