//! TLS on every gRPC connection (rustls, through tonic), and the transport settings every
//! server and client shares (no Nagle delay, HTTP/2 keepalive).
//!
//! A server given `--tls-cert`/`--tls-key` serves TLS only; with `--tls-client-ca` a client must
//! also present a certificate that CA signed (mutual TLS), and one of the names that server
//! admits ([`clients`]: `--allow-client`; a node admits the coordinator's role by default). A
//! client uses TLS for `https://` URLs: it trusts `--tls-ca` (or, unset, the Web PKI roots) and
//! presents `--tls-cert`/`--tls-key` when given; a URL given with `--tls-ca` must be `https://`.
//! Certificates and keys are read from files; their content is never logged or put in an error
//! (errors name the file).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};
use tower::layer::util::{Identity as NoLayer, Stack};

pub mod clients;

use clients::{AdmitLayer, AllowedClients};

/// This process's own certificate: the one it serves with, and presents as a client.
#[derive(Debug, Clone, Default, Args)]
pub struct TlsIdentity {
    /// PEM certificate (chain) this process presents: a server serves TLS only with it, a client
    /// presents it to a server that asks for one (mutual TLS). Needs `--tls-key`.
    #[arg(long, env = "TANDEM_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `--tls-cert`.
    #[arg(long, env = "TANDEM_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

/// A gRPC server's TLS: its certificate, and the CA its clients' certificates must chain to.
#[derive(Debug, Clone, Default, Args)]
pub struct ServerTls {
    #[command(flatten)]
    pub identity: TlsIdentity,
    /// Mutual TLS: refuse a client that does not present a certificate signed by this CA (PEM).
    /// Needs `--tls-cert`.
    #[arg(long, env = "TANDEM_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Under mutual TLS, a client admitted by name (repeatable, or comma-separated): one of its
    /// certificate's DNS names or URIs, or its subject's common name where it has neither (DNS
    /// names and common names ignoring case). Other clients are refused PERMISSION_DENIED on
    /// every call but gRPC health. Unset: a node admits `coordinator` only; the coordinator
    /// any certificate the client CA signed. Needs `--tls-client-ca`.
    #[arg(
        long = "allow-client",
        env = "TANDEM_ALLOW_CLIENTS",
        value_delimiter = ',',
        requires = "tls_client_ca"
    )]
    pub allow_clients: Vec<String>,
}

/// Whom a server serving mutual TLS admits where `--allow-client` is not given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultClients {
    /// Any certificate the client CA signed: the coordinator's public API, whose clients
    /// present API keys.
    Any,
    /// The coordinator's role ([`clients::COORDINATOR`]): a node, which only the coordinator
    /// has reason to call.
    Coordinators,
}

/// A gRPC client's TLS, for `https://` URLs.
#[derive(Debug, Clone, Default, Args)]
pub struct ClientTlsArgs {
    #[command(flatten)]
    pub identity: TlsIdentity,
    /// CA (PEM) that servers' certificates must chain to; unset: the Web PKI roots.
    #[arg(long, env = "TANDEM_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

/// A certificate or key that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the {what} {} is not PEM (no `-----BEGIN` line)", path.display())]
    NotPem { what: &'static str, path: PathBuf },
    #[error("the TLS certificate and key cannot be used: {0}")]
    Config(String),
    #[error("--allow-client is empty: name a client certificate's DNS name, URI or common name")]
    EmptyClient,
    #[error(
        "{flag} {url} is plaintext, but --tls-ca is given for it: use {https} (the server \
         serving TLS), or leave --tls-ca out to talk plaintext"
    )]
    Plaintext {
        flag: &'static str,
        url: String,
        https: String,
    },
}

fn read_pem(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    if !bytes.windows(10).any(|w| w == b"-----BEGIN") {
        return Err(TlsError::NotPem {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(bytes)
}

impl TlsIdentity {
    fn load(&self) -> Result<Option<Identity>, TlsError> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(Identity::from_pem(
                read_pem("certificate (--tls-cert)", cert)?,
                read_pem("private key (--tls-key)", key)?,
            ))),
            _ => Ok(None),
        }
    }
}

/// A server's TLS, loaded and checked.
#[derive(Debug, Clone, Default)]
pub struct ServerTlsSetup {
    config: Option<ServerTlsConfig>,
    mutual: bool,
    /// The clients admitted by name; unset: any the handshake let in.
    clients: AdmitLayer,
}

/// The layers of a server of [`ServerTlsSetup::server`].
pub type ServerLayers = Stack<AdmitLayer, NoLayer>;

impl ServerTls {
    /// Reads the files and checks that rustls accepts them (at start, not at the first client);
    /// under mutual TLS, admits the `--allow-client` names, or `default` where none is given.
    pub fn load(&self, default: DefaultClients) -> Result<ServerTlsSetup, TlsError> {
        let Some(identity) = self.identity.load()? else {
            return Ok(ServerTlsSetup::default());
        };
        if self.allow_clients.iter().any(|c| c.trim().is_empty()) {
            return Err(TlsError::EmptyClient);
        }
        let mut config = ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.tls_client_ca {
            config = config.client_ca_root(Certificate::from_pem(read_pem(
                "client CA (--tls-client-ca)",
                ca,
            )?));
        }
        Server::builder()
            .tls_config(config.clone())
            .map_err(|e| TlsError::Config(crate::error_chain(&e)))?;
        let mutual = self.tls_client_ca.is_some();
        let admitted = match (mutual, &self.allow_clients[..], default) {
            (false, _, _) | (true, [], DefaultClients::Any) => None,
            (true, [], DefaultClients::Coordinators) => Some(vec![clients::COORDINATOR.into()]),
            (true, names, _) => Some(names.iter().map(|n| n.trim().to_string()).collect()),
        };
        Ok(ServerTlsSetup {
            config: Some(config),
            mutual,
            clients: AdmitLayer(admitted.map(|names| Arc::new(AllowedClients::new(names)))),
        })
    }
}

impl ServerTlsSetup {
    /// How connections are secured, for the startup log: `plaintext`, `tls` or `mutual tls`.
    pub fn mode(&self) -> &'static str {
        match (&self.config, self.mutual) {
            (None, _) => "plaintext",
            (Some(_), false) => "tls",
            (Some(_), true) => "mutual tls",
        }
    }

    /// The clients admitted, for the startup log: their names, or `any` (every client the TLS
    /// handshake lets in).
    pub fn admits(&self) -> String {
        match &self.clients.0 {
            Some(allowed) => allowed.names().join(","),
            None => "any".to_string(),
        }
    }

    /// A server builder with Tandem's transport settings, this TLS, and the check of the
    /// clients admitted.
    pub fn server(&self) -> Result<Server<ServerLayers>, tonic::transport::Error> {
        let builder = Server::builder()
            .http2_keepalive_interval(Some(crate::KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(crate::KEEPALIVE_TIMEOUT));
        let builder = match &self.config {
            Some(config) => builder.tls_config(config.clone())?,
            None => builder,
        };
        Ok(builder.layer(self.clients.clone()))
    }
}

/// The connections `listener` accepts, for a server of [`ServerTlsSetup::server`], with
/// TCP_NODELAY set (tonic's own setting reaches only the listeners it binds itself): without
/// it, a small message written after another still unacknowledged waits for the peer's delayed
/// ACK, measured as 40 ms stalls in one run of the local mode in four.
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// A client's TLS, loaded: applied to `https://` URLs.
#[derive(Debug, Clone, Default)]
pub struct ClientTls(ClientTlsConfig);

impl ClientTlsArgs {
    /// Refuses a URL of `urls` (given with `flag`) that is not `https://` where `--tls-ca` is
    /// given: a CA given for a server means its connection is meant to be TLS, and an `http://`
    /// URL would talk plaintext without a word.
    pub fn refuse_plaintext(&self, flag: &'static str, urls: &[String]) -> Result<(), TlsError> {
        if self.tls_ca.is_none() {
            return Ok(());
        }
        match urls.iter().find(|u| !u.starts_with("https://")) {
            Some(url) => Err(TlsError::Plaintext {
                flag,
                https: format!(
                    "https://{}",
                    url.split_once("://").map_or(&url[..], |s| s.1)
                ),
                url: url.clone(),
            }),
            None => Ok(()),
        }
    }

    pub fn load(&self) -> Result<ClientTls, TlsError> {
        let mut config = ClientTlsConfig::new();
        config = match &self.tls_ca {
            Some(ca) => config.ca_certificate(Certificate::from_pem(read_pem(
                "CA certificate (--tls-ca)",
                ca,
            )?)),
            None => config.with_webpki_roots(),
        };
        if let Some(identity) = self.identity.load()? {
            config = config.identity(identity);
        }
        // Checks the files now: rustls parses them when the config is applied.
        Endpoint::from_static("https://localhost")
            .tls_config(config.clone())
            .map_err(|e| TlsError::Config(crate::error_chain(&e)))?;
        Ok(ClientTls(config))
    }
}

impl ClientTls {
    /// An endpoint for `url` with Tandem's transport settings (TLS where the URL is `https://`).
    pub fn endpoint(&self, url: &str, connect_timeout: Duration) -> Result<Endpoint, String> {
        self.endpoint_named(url, None, connect_timeout)
    }

    /// [`Self::endpoint`] for a URL whose host is one address of the name `domain`: TLS checks
    /// the server's certificate against `domain`, not the address.
    pub fn endpoint_named(
        &self,
        url: &str,
        domain: Option<&str>,
        connect_timeout: Duration,
    ) -> Result<Endpoint, String> {
        let endpoint = Endpoint::from_shared(url.to_string())
            .map_err(|e| format!("invalid URL `{url}`: {e}"))?
            .tcp_nodelay(true)
            .connect_timeout(connect_timeout)
            .http2_keep_alive_interval(crate::KEEPALIVE_INTERVAL)
            .keep_alive_timeout(crate::KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true);
        if !url.starts_with("https://") {
            return Ok(endpoint);
        }
        let config = match domain {
            Some(domain) => self.0.clone().domain_name(domain),
            None => self.0.clone(),
        };
        endpoint
            .tls_config(config)
            .map_err(|e| crate::error_chain(&e))
    }
}

/// A word on TLS to add to `error` (a failed connection or first call to `url`) where it reads
/// like a TLS mismatch: plaintext to a TLS port fails as an HTTP/2 frame error or a reset, TLS to
/// a plaintext port as a garbled record; neither names TLS. Empty for other errors.
pub fn mismatch_hint(url: &str, error: &str) -> &'static str {
    const SIGNS: [&str; 8] = [
        "frame with invalid size",
        "broken pipe",
        "http2 error",
        "InvalidContentType",
        "corrupt message",
        "tls handshake eof",
        "Connection reset",
        "unexpected EOF",
    ];
    if !SIGNS.iter().any(|s| error.contains(s)) {
        ""
    } else if url.starts_with("https://") {
        " (the URL is https://: does the server serve TLS, and does its certificate chain to \
         --tls-ca and name this host?)"
    } else {
        " (the URL is http://: if the server serves TLS (--tls-cert), use https://)"
    }
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    #[test]
    fn a_url_given_with_a_ca_must_be_https() {
        let args = |ca: Option<&str>| super::ClientTlsArgs {
            tls_ca: ca.map(Into::into),
            ..Default::default()
        };
        let urls = ["https://a:1".to_string(), "http://b:2".to_string()];
        args(None)
            .refuse_plaintext("--target", &urls)
            .expect("no CA: plaintext is asked for");
        args(Some("ca.pem"))
            .refuse_plaintext("--target", &urls[..1])
            .expect("https://");
        let err = args(Some("ca.pem"))
            .refuse_plaintext("--draft", &urls)
            .expect_err("http:// with a CA");
        assert_eq!(
            err.to_string(),
            "--draft http://b:2 is plaintext, but --tls-ca is given for it: use https://b:2 (the \
             server serving TLS), or leave --tls-ca out to talk plaintext"
        );
    }

    #[tokio::test]
    async fn accepted_connections_send_small_messages_at_once() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        let mut incoming = super::incoming(listener);
        let _client = tokio::net::TcpStream::connect(address)
            .await
            .expect("connect");
        let accepted = incoming
            .next()
            .await
            .expect("a connection")
            .expect("accept");
        assert!(accepted.nodelay().expect("nodelay"));
    }
}
