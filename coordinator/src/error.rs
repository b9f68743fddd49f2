//! The errors of the coordinator, and their one mapping to gRPC status codes (the HTTP API maps
//! those codes to HTTP statuses in `api/http/error.rs`).

use tonic::{Code, Status};

/// What a generation or a node call fails with. Messages are lowercase and name the offending
/// field and its limit, or the node and what it did.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The runtime's, or a wire message's that does not convert.
    #[error(transparent)]
    Shared(#[from] tandem_proto::Error),
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
    /// A node's refusal or failure, as its status said it.
    #[error("{node}: {status}", status = .status.message())]
    Remote { node: &'static str, status: Status },
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

/// Result alias of the coordinator.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<tandem_runtime::Error> for Error {
    fn from(e: tandem_runtime::Error) -> Self {
        Self::Shared(e.into())
    }
}

impl Error {
    /// The gRPC code of this error: the only place in the coordinator that decides it.
    pub fn code(&self) -> Code {
        match self {
            Self::Shared(e) => e.code(),
            Self::TooManyRequests { .. } => Code::ResourceExhausted,
            Self::Unavailable { .. } | Self::StreamClosed { .. } | Self::NotReady(_) => {
                Code::Unavailable
            }
            Self::TimedOut { .. } => Code::DeadlineExceeded,
            Self::Protocol { .. } => Code::Internal,
            // A session out of step past repair: the caller replays it (as for a lost one).
            Self::Desynchronised { .. } => Code::Aborted,
            Self::Cancelled => Code::Cancelled,
            Self::Remote { status, .. } => status.code(),
        }
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
