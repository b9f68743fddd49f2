//! The `coordinator` binary's side of the crate: its arguments ([`args`]), the client of
//! `coordinator generate` ([`client`]), and the local all-in-one mode with `quantize` and
//! `fetch` ([`local`]).
//!
//! The top: it may use every folder below it.

pub mod args;
pub mod client;
pub mod local;

pub use args::*;
