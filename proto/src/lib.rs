//! tandem-proto: the wire contract of Tandem (package `tandem.v1`), the conversions between
//! wire and runtime types that every service shares, and what every service may fail with
//! ([`Error`], with its gRPC codes).

mod convert;
mod error;
pub mod tls;
pub mod trace;

/// Generated messages, clients and servers of `tandem.v1`.
#[allow(missing_debug_implementations, clippy::all, reason = "generated code")]
pub mod v1 {
    tonic::include_proto!("tandem.v1");
}

pub use convert::{
    MAX_CACHE_SALT_BYTES, MAX_SESSION_ID_BYTES, check_cache_salt, check_session_id,
    distribution_from_wire, distribution_to_wire, logprobs_from_wire, logprobs_to_wire,
    prefix_from_wire, prefix_to_wire, random_seed,
};
pub use error::{Error, Result};

/// Largest gRPC message either side accepts: a tokenizer.json, or K dense distributions.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// HTTP/2 keepalive on every channel and server: a ping this often, and a peer that does not
/// answer one within [`KEEPALIVE_TIMEOUT`] is gone (its calls fail, its sessions are lost and
/// rebuilt) — a silent peer is found within seconds, not at the TCP timeout's minutes.
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);
pub const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// An error and its causes, joined by ": " (a tonic transport error alone says only "transport
/// error"; its source says "Connection refused").
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    // A Status prints its source's Debug form in its own text: its message, then the chain.
    let mut text = match e.downcast_ref::<tonic::Status>() {
        Some(status) => status.message().to_string(),
        None => e.to_string(),
    };
    let mut cause = e.source();
    while let Some(c) = cause {
        let next = c.to_string();
        if !text.ends_with(&next) {
            text = format!("{text}: {next}");
        }
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_error_chain_names_every_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        #[derive(Debug)]
        struct Transport(std::io::Error);
        impl std::fmt::Display for Transport {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("transport error")
            }
        }
        impl std::error::Error for Transport {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        assert_eq!(
            super::error_chain(&Transport(io)),
            "transport error: Connection refused"
        );
    }
}
