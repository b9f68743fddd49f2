//! The nodes as the coordinator sees them: a node's handle and what losing it means
//! ([`handle`]), whether a replica answers ([`health`]), the gRPC session streams to a
//! target-node or a draft-node ([`links`]) and what their steps ask and answer ([`steps`]: the
//! wire's messages end there), a node's replicas and the choice between them
//! ([`replicas`]), a draft-node that may come late ([`late_draft`]), where the nodes run
//! ([`machine`]), and the in-process cluster of the all-in-one mode ([`cluster`]).
//!
//! The lowest folder: it uses nothing else of this crate.

pub mod cluster;
pub mod handle;
pub mod health;
pub mod late_draft;
pub mod links;
pub mod machine;
pub mod replicas;
pub mod steps;

pub use cluster::LocalCluster;
pub use handle::{
    CALL_FLOOR, NodeHandle, TARGET_BACKOFF, TARGET_BACKOFF_MAX, call_deadline, connect_error,
    jittered, session_lost,
};
pub use health::{Health, Reachable};
pub use late_draft::LateDraft;
pub use machine::{same_machine, shares_cores};
pub use replicas::Replicas;
