//! Certificates for TLS tests (rcgen): a CA and leaf certificates it signs, written as PEM
//! files, each good for `localhost` and 127.0.0.1 as a server and as a client.

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

    /// A certificate for `name` (its files `name.crt`, `name.key`), signed by this CA.
    pub fn leaf(&self, name: &str) -> Leaf {
        let key = KeyPair::generate().expect("leaf key");
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
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

/// The lines of a PEM file's body (base64), to look for in logs.
pub fn pem_body_lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .expect("read PEM")
        .lines()
        .filter(|l| !l.starts_with("-----") && l.len() > 16)
        .map(str::to_string)
        .collect()
}
