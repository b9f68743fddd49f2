//! Which clients a server serving mutual TLS admits: machines have roles, and a certificate the
//! CA signed is not enough to call every server.
//!
//! A client certificate's names are its DNS names and URIs (subject alternative names) or,
//! where it has neither, its subject's common names (CN); IP addresses are not names of a role.
//! A client is admitted where one of its names equals an entry of the server's `--allow-client`
//! list: DNS names and CNs ignoring ASCII case, URIs exactly; `*` is an ordinary character (a
//! wildcard certificate is not expanded). A role is a name: `deploy/`'s certificates carry the
//! Service name (`coordinator`, `target-node`, `draft-node`) as their first DNS name and CN.
//!
//! Every call but gRPC health (`grpc.health.v1.Health`, which tells only whether the server
//! serves) from a client not admitted is refused PERMISSION_DENIED, naming the certificate's
//! names and the flag that would admit it; the server logs each such certificate once, at warn.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use x509_parser::extensions::GeneralName;

/// The coordinator's role: the name its certificate carries, and the one client a node admits
/// where it is given a client CA and no `--allow-client`.
pub const COORDINATOR: &str = "coordinator";

/// The path prefix of gRPC health, open to every client the TLS handshake let in.
const HEALTH: &str = "/grpc.health.v1.Health/";

/// One name a client certificate gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Name {
    Dns(String),
    Uri(String),
    CommonName(String),
}

impl Name {
    fn value(&self) -> &str {
        match self {
            Name::Dns(v) | Name::Uri(v) | Name::CommonName(v) => v,
        }
    }

    fn matches(&self, allowed: &str) -> bool {
        match self {
            Name::Dns(v) | Name::CommonName(v) => v.eq_ignore_ascii_case(allowed),
            Name::Uri(v) => v == allowed,
        }
    }
}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Name::Dns(v) => write!(f, "DNS:{v}"),
            Name::Uri(v) => write!(f, "URI:{v}"),
            Name::CommonName(v) => write!(f, "CN={v}"),
        }
    }
}

/// The names of the DER certificate `der`: its DNS and URI subject alternative names, in
/// order, or its subject's common names where it has none of those. An error where it cannot be
/// parsed.
pub fn names(der: &[u8]) -> Result<Vec<Name>, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| e.to_string())?;
    let mut names = Vec::new();
    if let Some(san) = cert.subject_alternative_name().map_err(|e| e.to_string())? {
        for name in &san.value.general_names {
            match name {
                GeneralName::DNSName(v) => names.push(Name::Dns(v.to_string())),
                GeneralName::URI(v) => names.push(Name::Uri(v.to_string())),
                _ => {}
            }
        }
    }
    if names.is_empty() {
        for cn in cert.subject().iter_common_name() {
            let cn = cn
                .as_str()
                .map_err(|e| format!("the subject's common name: {e}"))?;
            names.push(Name::CommonName(cn.to_string()));
        }
    }
    Ok(names)
}

/// The clients a server admits, by name.
#[derive(Debug)]
pub struct AllowedClients {
    names: Vec<String>,
    /// The certificates already refused (by their names), each logged once.
    warned: Mutex<HashSet<String>>,
}

impl AllowedClients {
    pub fn new(names: Vec<String>) -> Self {
        Self {
            names,
            warned: Mutex::new(HashSet::new()),
        }
    }

    /// The names admitted, for the startup log.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Admits a client whose leaf certificate (`certs`' first, as the client sent them) has a
    /// name on the list; refuses any other PERMISSION_DENIED, naming its names.
    pub fn check(&self, certs: Option<&[impl AsRef<[u8]>]>) -> Result<(), Status> {
        let Some(leaf) = certs.and_then(|c| c.first()) else {
            return Err(self.refuse("a client without a certificate", None));
        };
        let names = match names(leaf.as_ref()) {
            Ok(names) => names,
            Err(e) => {
                return Err(self.refuse(
                    &format!("a client certificate that cannot be read ({e})"),
                    None,
                ));
            }
        };
        if names
            .iter()
            .any(|n| self.names.iter().any(|allowed| n.matches(allowed)))
        {
            return Ok(());
        }
        let listed = names.iter().map(Name::to_string).collect::<Vec<_>>();
        let who = match names.first() {
            Some(first) => format!(
                "the client certificate of `{}` ({})",
                first.value(),
                listed.join(", ")
            ),
            None => "a client certificate with no DNS name, URI or common name".to_string(),
        };
        Err(self.refuse(&who, names.first().map(Name::value)))
    }

    /// The refusal of `who`, logged the first time; `name` is the one `--allow-client` would
    /// take to admit it.
    fn refuse(&self, who: &str, name: Option<&str>) -> Status {
        let fix = match name {
            Some(name) => format!(
                "to admit it, start the server with --allow-client {name} (TANDEM_ALLOW_CLIENTS)"
            ),
            None => "--allow-client (TANDEM_ALLOW_CLIENTS) admits clients by a certificate's \
                     DNS name, URI or common name"
                .to_string(),
        };
        let first = self
            .warned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(who.to_string());
        if first {
            tracing::warn!(client = %who, admitted = ?self.names, "refused a client not in --allow-client");
        }
        Status::permission_denied(format!("{who} may not call this server: {fix}"))
    }
}

/// The tower layer a server of [`super::ServerTlsSetup::server`] runs every call through:
/// where it holds an allow-list, each call but health is checked against it.
#[derive(Debug, Clone, Default)]
pub struct AdmitLayer(pub(super) Option<Arc<AllowedClients>>);

impl<S> tower::Layer<S> for AdmitLayer {
    type Service = Admit<S>;

    fn layer(&self, inner: S) -> Admit<S> {
        Admit {
            inner,
            allowed: self.0.clone(),
        }
    }
}

/// A service behind [`AdmitLayer`].
#[derive(Debug, Clone)]
pub struct Admit<S> {
    inner: S,
    allowed: Option<Arc<AllowedClients>>,
}

type Refusable<E> = Pin<Box<dyn Future<Output = Result<http::Response<Body>, E>> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for Admit<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Refusable<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let refused = match &self.allowed {
            Some(allowed) if !request.uri().path().starts_with(HEALTH) => {
                let certs = request
                    .extensions()
                    .get::<TlsConnectInfo<TcpConnectInfo>>()
                    .and_then(TlsConnectInfo::peer_certs);
                allowed.check(certs.as_deref().map(Vec::as_slice)).err()
            }
            _ => None,
        };
        match refused {
            Some(status) => Box::pin(std::future::ready(Ok(status.into_http()))),
            None => Box::pin(self.inner.call(request)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, DnType, KeyPair, SanType};

    /// A self-signed certificate (DER) with `sans` (an `spiffe:` entry as a URI, others as DNS
    /// names) and common name `cn`.
    fn cert(cn: &str, sans: &[&str]) -> Vec<u8> {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, cn);
        params.subject_alt_names = sans
            .iter()
            .map(|s| match s.starts_with("spiffe:") {
                true => SanType::URI(s.to_string().try_into().expect("URI")),
                false => SanType::DnsName(s.to_string().try_into().expect("DNS name")),
            })
            .collect();
        let key = KeyPair::generate().expect("key");
        params.self_signed(&key).expect("sign").der().to_vec()
    }

    fn allow(names: &[&str]) -> AllowedClients {
        AllowedClients::new(names.iter().map(|n| n.to_string()).collect())
    }

    fn admits(allowed: &AllowedClients, der: &[u8]) -> Result<(), Status> {
        allowed.check(Some(&[der][..]))
    }

    #[test]
    fn names_are_the_dns_and_uri_sans_or_else_the_common_name() {
        let der = cert(
            "ignored",
            &["draft-node", "spiffe://tandem/draft", "draft-node.tandem"],
        );
        assert_eq!(
            names(&der).expect("names"),
            [
                Name::Dns("draft-node".into()),
                Name::Uri("spiffe://tandem/draft".into()),
                Name::Dns("draft-node.tandem".into()),
            ]
        );
        assert_eq!(
            names(&cert("coordinator", &[])).expect("names"),
            [Name::CommonName("coordinator".into())]
        );
        assert!(names(b"not a certificate").is_err());
    }

    #[test]
    fn a_client_is_admitted_by_one_of_its_names_and_refused_naming_them() {
        let coordinator = cert("coordinator", &["coordinator", "coordinator.tandem"]);
        let allowed = allow(&["Coordinator.Tandem"]);
        admits(&allowed, &coordinator).expect("a DNS name, any case");
        admits(&allow(&["coordinator"]), &cert("COORDINATOR", &[]))
            .expect("the CN where there is no SAN");
        let uri = cert("x", &["spiffe://tandem/coordinator"]);
        admits(&allow(&["spiffe://tandem/coordinator"]), &uri).expect("a URI");

        // The CN does not count beside SANs; nor does a URI in another case, nor a wildcard.
        let cases = [
            (cert("coordinator", &["draft-node"]), "coordinator"),
            (
                cert("x", &["spiffe://tandem/coordinator"]),
                "spiffe://Tandem/coordinator",
            ),
            (cert("x", &["draft-node"]), "*"),
        ];
        for (der, name) in cases {
            let status = admits(&allow(&[name]), &der).expect_err(name);
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{name}");
        }

        let draft = cert("draft-node", &["draft-node", "draft-node.tandem"]);
        let status = admits(&allowed, &draft).expect_err("another role");
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            status.message(),
            "the client certificate of `draft-node` (DNS:draft-node, DNS:draft-node.tandem) may \
             not call this server: to admit it, start the server with --allow-client draft-node \
             (TANDEM_ALLOW_CLIENTS)"
        );
        let status = allowed
            .check(None::<&[Vec<u8>]>)
            .expect_err("no certificate");
        assert!(
            status
                .message()
                .starts_with("a client without a certificate")
        );
    }
}
