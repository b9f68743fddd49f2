//! What every service may fail with, whatever its role ([`Error`]: the runtime's errors and a
//! wire message that does not convert), and their gRPC codes: the node's and the coordinator's
//! errors (`tandem_node::Error`, `tandem_coordinator::Error`) carry it as their `Shared` variant.

use tonic::Code;

/// The runtime's error, or a wire message that does not convert (a field it must have is
/// missing). Messages are lowercase and name the offending field and its limit.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Runtime(#[from] tandem_runtime::Error),
    #[error("missing field `{0}`")]
    MissingField(&'static str),
}

/// Result alias of the conversions.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Its gRPC code, wherever it is answered: the only place that decides it.
    pub fn code(&self) -> Code {
        use tandem_runtime::Error as R;
        match self {
            Self::Runtime(
                R::EmptyPrompt
                | R::PromptTooLong { .. }
                | R::TokenOutOfRange { .. }
                | R::InvalidParameter { .. }
                | R::Grammar(_),
            )
            | Self::MissingField(_) => Code::InvalidArgument,
            Self::Runtime(R::ContextFull { .. }) => Code::OutOfRange,
            Self::Runtime(R::PrefixMismatch { .. } | R::VocabularyMismatch(_)) => {
                Code::FailedPrecondition
            }
            Self::Runtime(_) => Code::Internal,
        }
    }
}
