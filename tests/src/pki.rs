//! Certificates for TLS tests (rcgen): a CA and leaf certificates it signs, written as PEM
//! files, each good for `localhost` and 127.0.0.1 as a server and as a client, and named for its
//! role as `deploy/`'s are (its first DNS name and its common name).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A certificate authority whose files live in `dir`.
#[derive(Debug)]
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    dir: PathBuf,
    /// Its certificate (PEM file): what `--tls-ca` / `--tls-client-ca` name.
    pub cert: PathBuf,
}

/// A leaf certificate and its key (PEM files).
#[derive(Debug, Clone)]
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Leaf {
    /// `--tls-cert PATH --tls-key PATH`.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.cert.display().to_string(),
            "--tls-key".into(),
            self.key.display().to_string(),
        ]
    }
}

/// An endpoint for `https://addr` (gRPC) trusting `ca`, presenting `leaf` when given.
pub fn tls_endpoint(
    addr: std::net::SocketAddr,
    ca: &Path,
    leaf: Option<&Leaf>,
) -> tonic::transport::Endpoint {
    tandem_proto::tls::ClientTlsArgs {
        identity: tandem_proto::tls::TlsIdentity {
            tls_cert: leaf.map(|l| l.cert.clone()),
            tls_key: leaf.map(|l| l.key.clone()),
        },
        tls_ca: Some(ca.to_path_buf()),
    }
    .load()
    .expect("client TLS")
    .endpoint(
        &format!("https://{addr}"),
        std::time::Duration::from_secs(5),
    )
    .expect("endpoint")
}

impl Ca {
    /// A new CA named `name`, its files in `dir`.
    pub fn new(dir: &Path, name: &str) -> Self {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).expect("self-signed CA");
        let path = dir.join(format!("{name}.crt"));
        std::fs::write(&path, cert.pem()).expect("write CA");
        Self {
            issuer: Issuer::new(params, key),
            dir: dir.to_path_buf(),
            cert: path,
        }
    }

    /// A certificate for `name` (its files `name.crt`, `name.key`; DNS names `name` and
    /// `localhost`, IP address 127.0.0.1, common name `name`), signed by this CA.
    pub fn leaf(&self, name: &str) -> Leaf {
        let key = KeyPair::generate().expect("leaf key");
        let mut params = CertificateParams::new(vec![
            name.to_string(),
            "localhost".to_string(),
            "127.0.0.1".to_string(),
        ])
        .expect("leaf params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.issuer).expect("sign leaf");
        let leaf = Leaf {
            cert: self.dir.join(format!("{name}.crt")),
            key: self.dir.join(format!("{name}.key")),
        };
        std::fs::write(&leaf.cert, cert.pem()).expect("write cert");
        std::fs::write(&leaf.key, key.serialize_pem()).expect("write key");
        leaf
    }
}

/// Whether gRPC health at `endpoint` answers (any status): the TLS handshake passed.
pub async fn health_answers(endpoint: tonic::transport::Endpoint) -> Result<(), String> {
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| tandem_proto::error_chain(&e))?;
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .map(|_| ())
        .map_err(|s| format!("{s:?}"))
}

/// A node (`target-node` or `draft-node`) serving `model` over mutual TLS with `leaf`, its
/// clients' certificates signed by `ca`, with `extra` arguments; its log (at debug) in `log`.
pub fn tls_node(
    name: &str,
    model: &Path,
    leaf: &Leaf,
    ca: &Ca,
    extra: &[&str],
    log: &Path,
) -> crate::processes::Proc {
    let (model, client_ca) = (model.display().to_string(), ca.cert.display().to_string());
    let mut args = vec!["--model", &model, "--listen", "127.0.0.1:0"];
    let identity = leaf.args();
    args.extend(identity.iter().map(String::as_str));
    args.extend(["--tls-client-ca", &client_ca]);
    args.extend_from_slice(extra);
    crate::processes::Proc::start_logged(name, &args, &[("RUST_LOG", "debug")], log)
}

/// The lines of a PEM file's body (base64), to look for in logs.
pub fn pem_body_lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .expect("read PEM")
        .lines()
        .filter(|l| !l.starts_with("-----") && l.len() > 16)
        .map(str::to_string)
        .collect()
}
