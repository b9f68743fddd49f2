//! The runtime's typed errors. Messages are lowercase and name the offending value and the limit.

use std::path::PathBuf;

/// Errors of model loading, inference, sampling and verification.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("missing file {path}: {what}")]
    MissingFile { path: PathBuf, what: &'static str },
    #[error("invalid {path}: {reason}")]
    InvalidFile { path: PathBuf, reason: String },
    #[error("unsupported architecture `{found}` in {path}; supported: {supported}")]
    UnsupportedArchitecture {
        path: PathBuf,
        found: String,
        supported: &'static str,
    },
    #[error("unsupported tensor type {dtype} for `{tensor}` in {path}; supported: {supported}")]
    UnsupportedTensorType {
        path: PathBuf,
        tensor: String,
        dtype: String,
        supported: &'static str,
    },
    #[error("missing tensor `{name}` in {path}")]
    MissingTensor { path: PathBuf, name: String },
    #[error("empty prompt: at least one token is required")]
    EmptyPrompt,
    #[error("prompt of {len} tokens plus {max_new} new tokens exceeds the context of {limit}")]
    PromptTooLong {
        len: usize,
        max_new: usize,
        limit: usize,
    },
    #[error("sequence of {len} tokens exceeds the context of {limit}")]
    ContextFull { len: usize, limit: usize },
    #[error("token id {token} is out of range: the vocabulary has {vocab_size} tokens")]
    TokenOutOfRange { token: u32, vocab_size: usize },
    #[error("invalid `{field}` = {value}: {limit}")]
    InvalidParameter {
        field: &'static str,
        value: String,
        limit: String,
    },
    #[error(
        "the model produced a logit of {value} at position {position}: no token follows from it"
    )]
    NonFiniteLogits { position: usize, value: f32 },
    #[error("draft and target vocabularies differ: {0}")]
    VocabularyMismatch(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("invalid `constraint`: {0}")]
    Grammar(String),
    #[error("hugging face hub `{reference}`: {detail}")]
    Hub { reference: String, detail: String },
    #[error("shared kv prefix: {0}")]
    SharedPrefix(String),
    #[error("cannot truncate the kv cache to {requested}: it holds {len} entries")]
    TruncateBeyondLength { requested: usize, len: usize },
    #[error(
        "cannot truncate the kv cache to {requested}: its sliding-window layers keep positions \
         from {held_from} on, and a row at {requested} sees {window} before it"
    )]
    TruncateBeyondWindow {
        requested: usize,
        held_from: usize,
        window: usize,
    },
    #[error(
        "committed prefix mismatch: the request assumes {expected}, this sequence holds {held}"
    )]
    PrefixMismatch {
        expected: crate::token_log::Prefix,
        held: crate::token_log::Prefix,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The runtime's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn invalid(field: &'static str, value: impl ToString, limit: impl ToString) -> Self {
        Self::InvalidParameter {
            field,
            value: value.to_string(),
            limit: limit.to_string(),
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}
