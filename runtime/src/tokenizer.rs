//! Text ↔ token ids, the special ids that end a generation, and the vocabulary check that a
//! draft/target pair must pass.

use std::path::{Path, PathBuf};

use crate::model::gguf_tokenizer;
use crate::{Error, Result};

/// A Hugging Face tokenizer with the ids generation needs.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    /// The Jinja chat template of `tokenizer_config.json` or the GGUF metadata
    /// (`tokenizer.chat_template`), if the model has one.
    chat_template: Option<String>,
    source: PathBuf,
}

fn tokenizer_error(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// The tokenizer of a model: `tokenizer.json` in its folder or beside its `.gguf` file, else
    /// rebuilt from the GGUF metadata.
    pub fn for_model(model_path: &Path) -> Result<Self> {
        let (json, dir) = if model_path.is_dir() {
            (model_path.join("tokenizer.json"), model_path.to_path_buf())
        } else {
            let dir = model_path.parent().unwrap_or(Path::new(".")).to_path_buf();
            (dir.join("tokenizer.json"), dir)
        };
        if json.exists() {
            let inner =
                tokenizers::Tokenizer::from_file(&json).map_err(|e| Error::InvalidFile {
                    path: json.clone(),
                    reason: e.to_string(),
                })?;
            return Ok(Self::with_config(inner, &dir, json));
        }
        if model_path.is_dir() {
            return Err(Error::MissingFile {
                path: json,
                what: "a Hugging Face model folder needs tokenizer.json",
            });
        }
        let mut file = std::fs::File::open(model_path).map_err(Error::io(model_path))?;
        let content = candle_core::quantized::gguf_file::Content::read(&mut file).map_err(|e| {
            Error::InvalidFile {
                path: model_path.to_path_buf(),
                reason: e.to_string(),
            }
        })?;
        let text = gguf_tokenizer::tokenizer_json(model_path, &content.metadata)?;
        let inner = tokenizers::Tokenizer::from_bytes(text.as_bytes()).map_err(tokenizer_error)?;
        let mut tokenizer = Self::with_config(inner, Path::new(""), model_path.to_path_buf());
        let id = |key: &str| match content.metadata.get(key) {
            Some(candle_core::quantized::gguf_file::Value::U32(v)) => Some(*v),
            _ => None,
        };
        tokenizer.bos = id("tokenizer.ggml.bos_token_id").or(tokenizer.bos);
        tokenizer.eos = id("tokenizer.ggml.eos_token_id").or(tokenizer.eos);
        if let Some(candle_core::quantized::gguf_file::Value::String(t)) =
            content.metadata.get("tokenizer.chat_template")
        {
            tokenizer.chat_template = Some(t.clone());
        }
        Ok(tokenizer)
    }

    /// The tokenizer serialised as tokenizer.json text, e.g. to send to a coordinator.
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(tokenizer_error)
    }

    /// A tokenizer received as tokenizer.json text with its special ids; `source` names where it
    /// came from in messages.
    pub fn from_json(
        json: &str,
        bos: Option<u32>,
        eos: Option<u32>,
        chat_template: Option<String>,
        source: &str,
    ) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(json.as_bytes()).map_err(tokenizer_error)?;
        Ok(Self {
            inner,
            bos,
            eos,
            chat_template,
            source: PathBuf::from(source),
        })
    }

    /// The model's chat template (Jinja), from `tokenizer_config.json` or the GGUF metadata.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Reads bos/eos from `tokenizer_config.json` when present, else guesses `<s>`/`</s>`.
    fn with_config(inner: tokenizers::Tokenizer, dir: &Path, source: PathBuf) -> Self {
        let config: Option<serde_json::Value> =
            std::fs::read_to_string(dir.join("tokenizer_config.json"))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok());
        let special = |key: &str, default: &str| {
            let text = config
                .as_ref()
                .and_then(|c| c.get(key))
                .and_then(|v| {
                    v.as_str()
                        .or_else(|| v.get("content").and_then(|c| c.as_str()))
                })
                .unwrap_or(default)
                .to_string();
            inner.token_to_id(&text)
        };
        let bos = special("bos_token", "<s>");
        let eos = special("eos_token", "</s>");
        // A string, or a list of named templates of which "default" is the chat one.
        let chat_template = config.as_ref().and_then(|c| match c.get("chat_template")? {
            serde_json::Value::String(t) => Some(t.clone()),
            serde_json::Value::Array(named) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        });
        Self {
            inner,
            bos,
            eos,
            chat_template,
            source,
        }
    }

    /// Encodes a prompt, adding the special tokens (BOS) the tokenizer is configured with.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, true)
            .map_err(tokenizer_error)?
            .get_ids()
            .to_vec())
    }

    /// Encodes text as it is, adding no special tokens (a rendered chat template names its own).
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(tokenizer_error)?
            .get_ids()
            .to_vec())
    }

    /// Decodes ids to text, skipping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(tokenizer_error)
    }

    /// Size of the vocabulary including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// The text of a token id, if it exists.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether pieces are written in GPT-2's byte-level alphabet (a `ByteLevel` decoder), not
    /// SentencePiece's `▁` and `<0xNN>`.
    pub fn is_byte_level(&self) -> bool {
        self.inner
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok())
            .is_some_and(|d| any_step(&d, &|d| d["type"] == "ByteLevel"))
    }

    /// The ids of the special added tokens (control tokens: a chat template's markup, the end
    /// of a sequence).
    pub fn special_ids(&self) -> std::collections::HashSet<u32> {
        self.inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect()
    }

    /// The ids of every added token, special or not (a chat template's markup, a tool call's).
    pub fn added_ids(&self) -> impl Iterator<Item = u32> {
        self.inner.get_added_tokens_decoder().into_keys()
    }

    /// A 64-bit FNV-1a hash over every token text and the special ids: equal hashes mean
    /// interchangeable vocabularies.
    pub fn vocab_hash(&self) -> u64 {
        let mut h = Fnv::default();
        for id in 0..self.vocab_size() as u32 {
            h.write(self.token(id).unwrap_or_default().as_bytes());
            h.write(&[0xff]);
        }
        for special in [self.bos, self.eos] {
            h.write(&special.map_or(u64::MAX, u64::from).to_le_bytes());
        }
        h.0
    }

    /// Refuses a draft whose vocabulary differs from the target's, saying what differs.
    pub fn check_compatible(draft: &Self, target: &Self) -> Result<()> {
        let mismatch = |what: String| Err(Error::VocabularyMismatch(what));
        let (d, t) = (draft.vocab_size(), target.vocab_size());
        if d != t {
            return mismatch(format!(
                "vocabulary size {d} ({}) vs {t} ({})",
                draft.source.display(),
                target.source.display()
            ));
        }
        if draft.bos != target.bos || draft.eos != target.eos {
            return mismatch(format!(
                "special ids bos/eos {:?}/{:?} (draft) vs {:?}/{:?} (target)",
                draft.bos, draft.eos, target.bos, target.eos
            ));
        }
        for id in 0..d as u32 {
            let (a, b) = (draft.token(id), target.token(id));
            if a != b {
                return mismatch(format!(
                    "token {id} is {:?} in the draft and {:?} in the target",
                    a.unwrap_or_default(),
                    b.unwrap_or_default()
                ));
            }
        }
        Ok(())
    }
}

/// FNV-1a, 64 bit: a stable hash for vocabularies and token prefixes.
#[derive(Debug, Clone, Copy)]
pub struct Fnv(pub u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// Turns a growing list of generated ids into text deltas, emitting text only once it is
/// complete (no half-decoded UTF-8 byte sequences), in the way text-generation-inference does.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    prefix_offset: usize,
    read_offset: usize,
}

impl StreamDecoder {
    /// The new text that `ids` (all generated ids so far) adds to what was already emitted.
    pub fn next(&mut self, tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
        let prefix = tokenizer.decode(&ids[self.prefix_offset..self.read_offset])?;
        let full = tokenizer.decode(&ids[self.prefix_offset..])?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{fffd}')
            && full.is_char_boundary(prefix.len())
        {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }
}

/// Whether `f` holds for a tokenizer.json stage or for any stage nested in it (a `Sequence`'s
/// normalizers, pre-tokenizers, processors or decoders).
pub(crate) fn any_step(step: &serde_json::Value, f: &dyn Fn(&serde_json::Value) -> bool) -> bool {
    f(step)
        || ["normalizers", "pretokenizers", "processors", "decoders"]
            .iter()
            .any(|key| {
                step[*key]
                    .as_array()
                    .is_some_and(|steps| steps.iter().any(|s| any_step(s, f)))
            })
}
