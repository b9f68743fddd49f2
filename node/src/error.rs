//! The errors a node answers a session with, and their one mapping to gRPC status codes.

use tonic::{Code, Status};

/// What a node refuses or fails, answered in-band on the session stream or as a call's
/// status. Messages are lowercase and name the offending field and its limit.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The runtime's, or a wire message's that does not convert.
    #[error(transparent)]
    Shared(#[from] tandem_proto::Error),
    #[error("no session is open on this stream: send `open` first")]
    NoSession,
    #[error("a session is already open on this stream")]
    SessionAlreadyOpen,
    #[error("too many sessions: {limit} are open, the limit (--max-sessions) is {limit}")]
    TooManySessions { limit: usize },
    #[error(
        "kv cache budget exhausted: this session may need {need} bytes, {free} of {budget} are free (--kv-cache-bytes); retry when sessions end"
    )]
    KvCacheFull {
        need: usize,
        free: usize,
        budget: usize,
    },
    #[error("session idle for more than {secs} s (--idle-timeout-secs): closed")]
    IdleTimeout { secs: u64 },
    /// The node's own fault (its model thread gone, a batch answered short).
    #[error("internal error: {0}")]
    Internal(String),
}

/// Result alias of the node.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<tandem_runtime::Error> for Error {
    fn from(e: tandem_runtime::Error) -> Self {
        Self::Shared(e.into())
    }
}

impl Error {
    /// The gRPC code of this error: the only place on a node that decides it.
    pub fn code(&self) -> Code {
        match self {
            Self::Shared(e) => e.code(),
            Self::NoSession => Code::NotFound,
            Self::SessionAlreadyOpen => Code::FailedPrecondition,
            Self::TooManySessions { .. } | Self::KvCacheFull { .. } => Code::ResourceExhausted,
            Self::IdleTimeout { .. } => Code::DeadlineExceeded,
            Self::Internal(_) => Code::Internal,
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        Status::new(e.code(), e.to_string())
    }
}
