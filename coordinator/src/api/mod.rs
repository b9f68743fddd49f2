//! The public APIs over the engine: gRPC ([`service`]) and OpenAI-compatible HTTP with the
//! health, readiness and metrics endpoints ([`http`]), the API keys and TLS they check
//! ([`auth`]), each client's limits ([`limits`]), and a request checked into a job
//! ([`request`]).
//!
//! Uses [`crate::engine`] (and what it exposes); nothing below uses it.

pub mod auth;
pub mod http;
pub mod limits;
pub mod request;
pub mod service;

pub use service::serve;
