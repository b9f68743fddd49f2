//! The service errors of every Tandem process and their one mapping to gRPC status codes.

use tonic::{Code, Status};

/// Errors a node or the coordinator answers with. Messages are lowercase and name the offending
/// field and its limit.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Runtime(#[from] tandem_runtime::Error),
    #[error("missing field `{0}`")]
    MissingField(&'static str),
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
    #[error("{node} is unavailable at {endpoint}: {reason}")]
    Unavailable {
        node: &'static str,
        endpoint: String,
        reason: String,
    },
    #[error("{node} answered out of protocol: {what}")]
    Protocol { node: &'static str, what: String },
    #[error("{node} closed the session stream (the node stopped or restarted)")]
    StreamClosed { node: &'static str },
    #[error(
        "{node} still held another committed prefix after {attempts} repairs in a row (a node or \
         link that corrupts messages): its session is rebuilt"
    )]
    Desynchronised { node: &'static str, attempts: usize },
    #[error("{node} did not answer within {secs:.1} s")]
    TimedOut { node: &'static str, secs: f64 },
    #[error("{node}: {status}", status = .status.message())]
    Remote { node: &'static str, status: Status },
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("not ready: {0}")]
    NotReady(String),
    #[error("the client cancelled the request")]
    Cancelled,
    #[error(
        "too many generations in flight from this client: the limit \
         (--max-requests-per-client) is {limit}; retry when one has ended"
    )]
    TooManyRequests { limit: usize },
}

/// Result alias of the services.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The gRPC code of this error: the only place that decides it.
    pub fn code(&self) -> Code {
        use tandem_runtime::Error as R;
        match self {
            Self::Runtime(e) => match e {
                R::EmptyPrompt
                | R::PromptTooLong { .. }
                | R::TokenOutOfRange { .. }
                | R::InvalidParameter { .. }
                | R::Grammar(_) => Code::InvalidArgument,
                R::ContextFull { .. } => Code::OutOfRange,
                R::PrefixMismatch { .. } | R::VocabularyMismatch(_) => Code::FailedPrecondition,
                _ => Code::Internal,
            },
            Self::MissingField(_) => Code::InvalidArgument,
            Self::NoSession => Code::NotFound,
            Self::SessionAlreadyOpen => Code::FailedPrecondition,
            Self::TooManySessions { .. }
            | Self::KvCacheFull { .. }
            | Self::TooManyRequests { .. } => Code::ResourceExhausted,
            Self::IdleTimeout { .. } => Code::DeadlineExceeded,
            Self::Unavailable { .. }
            | Self::ShuttingDown
            | Self::StreamClosed { .. }
            | Self::NotReady(_) => Code::Unavailable,
            Self::TimedOut { .. } => Code::DeadlineExceeded,
            Self::Protocol { .. } => Code::Internal,
            // A session out of step past repair: the caller replays it (as for a lost one).
            Self::Desynchronised { .. } => Code::Aborted,
            Self::Cancelled => Code::Cancelled,
            Self::Remote { status, .. } => status.code(),
        }
    }

    /// Whether the session survives this error (the node answers in-band and keeps it open).
    pub fn is_recoverable(&self) -> bool {
        matches!(
            self,
            Self::Runtime(tandem_runtime::Error::PrefixMismatch { .. })
        )
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        match e {
            Error::Remote { status, .. } => status,
            e => Status::new(e.code(), e.to_string()),
        }
    }
}
