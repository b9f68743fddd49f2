//! tandem-coordinator, by concern, each folder using only those listed before it:
//!
//! - [`constraints`]: a request's grammar checked before anything runs;
//! - [`nodes`]: the nodes as the coordinator sees them (handles, session streams, replicas);
//! - [`drafting`]: who drafts each round and how much (the K policy, the drafters);
//! - [`engine`]: the round loop over gRPC with the canonical logs, and its statistics;
//! - [`api`]: the public gRPC and HTTP APIs, keys and limits;
//! - [`cli`]: the binary's arguments, its client and the local all-in-one mode;
//!
//! and [`error`], the errors of all of them with their one mapping to gRPC status codes.

pub mod api;
pub mod cli;
pub mod constraints;
pub mod drafting;
pub mod engine;
pub mod error;
pub mod nodes;

pub use api::{auth, http, limits, serve, service};
pub use cli::{client, local};
pub use engine::{
    CommitSink, Discard, Engine, Job, MAX_REFUSED_BLOCKS, Outcome, Stats, late_engine,
};
pub use error::{Error, Result};
pub use nodes::LocalCluster;
pub use tandem_proto::error_chain;
