//! The round loop ([`rounds`]): one generation's rounds of drafting, verifying and committing,
//! with the requests it runs ([`job`]), what a token tree's verdict commits ([`tree`]), their
//! statistics ([`stats`]), what sessions learnt for the next to start from (`learnt`) and the
//! coordinator's metrics ([`metrics`]); an engine that may still be connecting ([`late`]), and
//! the engine of the in-process cluster ([`local`]).
//!
//! Uses [`crate::drafting`] and [`crate::nodes`]; the APIs above it use it.

pub mod job;
pub mod late;
mod learnt;
pub mod local;
pub mod metrics;
pub mod rounds;
pub mod stats;
pub mod tree;

pub use job::{CommitSink, Discard, Job, MAX_STOP_TOKEN_IDS, Outcome};
pub use late::LateEngine;
pub use rounds::{DEFAULT_MAX_TOKENS, Engine, MAX_REFUSED_BLOCKS};
pub use stats::Stats;
