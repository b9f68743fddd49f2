//! API keys on the coordinator's public APIs (`coordinator serve --api-key KEY`, repeatable, or
//! `TANDEM_API_KEYS=k1,k2`): HTTP requests to `/v1/*` carry `Authorization: Bearer KEY` (else
//! 401 in OpenAI's error shape), gRPC calls carry the same in their `authorization` metadata
//! (else UNAUTHENTICATED). Health, readiness and metrics stay open to probes. Keys are compared
//! in constant time and never printed: this type's `Debug` shows how many there are.

use std::sync::Arc;

use tonic::{Request, Status};

use crate::api::limits::{Client, ClientLimits, ClientPermit, TrustedProxies};
use crate::engine::job::tenant_salt;

/// The keys a request may present; none: the APIs are open.
#[derive(Clone, Default)]
pub struct ApiKeys(Arc<Vec<String>>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.0.len())
    }
}

impl ApiKeys {
    /// The keys, blank ones dropped.
    pub fn new(keys: impl IntoIterator<Item = String>) -> Self {
        let keys = keys
            .into_iter()
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty());
        Self(Arc::new(keys.collect()))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an `Authorization` value (`Bearer KEY`) names one of the keys; any request does
    /// when there are none.
    pub fn admits(&self, authorization: Option<&str>) -> bool {
        self.is_empty() || self.matched(authorization).is_some()
    }

    /// Which key an `Authorization` value (`Bearer KEY`) names, if any.
    pub fn matched(&self, authorization: Option<&str>) -> Option<usize> {
        let presented = authorization.and_then(|v| v.trim().strip_prefix("Bearer "))?;
        let presented = presented.trim().as_bytes();
        // Every key compared, each in constant time: the answer's timing says nothing of them.
        self.0.iter().enumerate().fold(None, |found, (i, key)| {
            if same(key.as_bytes(), presented) {
                Some(i)
            } else {
                found
            }
        })
    }

    /// The gRPC check: UNAUTHENTICATED unless the call's `authorization` metadata admits it.
    #[allow(clippy::result_large_err)]
    pub fn check<T>(&self, request: Request<T>) -> Result<Request<T>, Status> {
        if self.admits(grpc_authorization(&request)) {
            Ok(request)
        } else {
            Err(Status::unauthenticated(REFUSAL))
        }
    }
}

/// A gRPC call's `authorization` metadata.
pub fn grpc_authorization<T>(request: &Request<T>) -> Option<&str> {
    request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
}

/// An HTTP request's `Authorization` header.
pub fn http_authorization(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
}

/// Who may use the public APIs, and how much of them: the keys, the generations each client
/// may have in flight, and the proxies believed about who the client is
/// ([`crate::api::limits`]).
#[derive(Debug, Clone, Default)]
pub struct Access {
    pub keys: ApiKeys,
    pub per_client: ClientLimits,
    pub proxies: TrustedProxies,
    /// Every key one tenant of the nodes' prefix caches (`--shared-prefix-cache`).
    pub shared_prefix_cache: bool,
}

impl Access {
    /// The salt of the tenant that presented `authorization` in the nodes' prefix caches
    /// ([`Engine::prepare_for`]): its key's; empty (the tenant of all) without keys, or where
    /// every key is one tenant.
    ///
    /// [`Engine::prepare_for`]: crate::engine::Engine::prepare_for
    pub fn tenant(&self, authorization: Option<&str>) -> Vec<u8> {
        let key = self
            .keys
            .matched(authorization)
            .filter(|_| !self.shared_prefix_cache);
        key.map_or_else(Vec::new, |i| tenant_salt("api-key", &self.keys.0[i]))
    }

    /// A permit for one generation of the client that sent `authorization` from `peer` with
    /// `forwarded_for` (its `X-Forwarded-For` values; after its key was checked), or
    /// RESOURCE_EXHAUSTED when it has its limit in flight.
    pub fn admit<'a>(
        &self,
        authorization: Option<&str>,
        peer: Option<std::net::IpAddr>,
        forwarded_for: impl IntoIterator<Item = &'a str>,
    ) -> Result<ClientPermit, crate::error::Error> {
        let key = self.keys.matched(authorization);
        let address = peer.map(|p| self.proxies.client(p, forwarded_for));
        self.per_client.acquire(Client::of(key, address))
    }
}

/// A key as the command line gives it: never printed (`Debug` shows `***`).
#[derive(Clone)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_string()))
    }
}

/// What a request without a valid key is told.
pub const REFUSAL: &str = "a valid API key is required: send `Authorization: Bearer KEY` \
     (gRPC: `authorization` metadata) with a key given to `coordinator serve --api-key`";

/// Equality in time that depends on the lengths only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_admitted_by_one_of_the_keys_only() {
        let keys = ApiKeys::new(["alpha-1".to_string(), " beta-2 ".into(), String::new()]);
        assert!(keys.admits(Some("Bearer alpha-1")));
        assert!(keys.admits(Some("Bearer beta-2")));
        assert!(!keys.admits(Some("Bearer alpha-")));
        assert!(!keys.admits(Some("Bearer alpha-12")));
        assert!(!keys.admits(Some("alpha-1")));
        assert!(!keys.admits(Some("Bearer ")));
        assert!(!keys.admits(None));
        assert!(ApiKeys::default().admits(None));
        assert!(ApiKeys::new([String::new()]).is_empty());
        // Never printed.
        assert_eq!(format!("{keys:?}"), "ApiKeys(2 keys)");
    }

    #[test]
    fn one_key_is_one_client_however_it_is_spaced() {
        let keys = ApiKeys::new(["alpha-1".to_string(), "beta-2".into()]);
        for header in [
            "Bearer alpha-1",
            "Bearer  alpha-1",
            "Bearer \talpha-1 ",
            " Bearer alpha-1",
        ] {
            assert_eq!(keys.matched(Some(header)), Some(0), "{header:?}");
        }
        assert_eq!(keys.matched(Some("Bearer beta-2")), Some(1));
        assert_eq!(keys.matched(Some("Bearer gamma")), None);
    }

    #[test]
    fn each_key_is_a_tenant_of_its_own_unless_the_keys_share() {
        let keys = ApiKeys::new(["alpha-1".to_string(), "beta-2".into()]);
        let access = Access {
            keys: keys.clone(),
            ..Access::default()
        };
        let a = access.tenant(Some("Bearer alpha-1"));
        assert!(!a.is_empty() && a != access.tenant(Some("Bearer beta-2")));
        assert_eq!(
            access.tenant(Some("Bearer  alpha-1 ")),
            a,
            "one key, one tenant"
        );
        assert!(
            !a.windows(7).any(|w| w == b"alpha-1"),
            "never the key itself"
        );
        assert!(
            Access::default().tenant(None).is_empty(),
            "no keys: one tenant"
        );
        let shared = Access {
            keys,
            shared_prefix_cache: true,
            ..Access::default()
        };
        assert!(shared.tenant(Some("Bearer alpha-1")).is_empty());
        assert!(shared.tenant(Some("Bearer beta-2")).is_empty());
    }

    #[test]
    fn a_grpc_call_without_the_key_is_unauthenticated() {
        let keys = ApiKeys::new(["s3cr3t-key".to_string()]);
        let status = keys.check(Request::new(())).expect_err("no key");
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        assert!(!status.message().contains("s3cr3t"), "{}", status.message());
        let mut request = Request::new(());
        request
            .metadata_mut()
            .insert("authorization", "Bearer s3cr3t-key".parse().expect("ascii"));
        assert!(keys.check(request).is_ok());
    }
}
