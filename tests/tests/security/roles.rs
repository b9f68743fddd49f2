//! Machines have roles: a node serving mutual TLS admits the coordinator's certificate, not
//! another the same CA signed (a draft-node's: the least trusted machine of a deployment), unless
//! `--allow-client` names it; a refused client gets PERMISSION_DENIED naming its certificate and
//! the flag that would admit it. Plaintext toward a server given a CA is refused at start.

use tandem_proto::v1;
use tandem_proto::v1::node_service_client::NodeServiceClient;
use tandem_proto::v1::target_service_client::TargetServiceClient;
use tandem_tests::pki::{Ca, health_answers, tls_endpoint, tls_node};
use tandem_tests::processes::binary;
use tandem_tests::{stories, stories_q8, within};
use tonic::transport::Endpoint;

/// The node's info over `endpoint`.
async fn info(endpoint: Endpoint) -> Result<v1::NodeInfo, tonic::Status> {
    let channel = within("a TLS connection", endpoint.connect())
        .await
        .expect("the TLS handshake (the CA signed the certificate)");
    within(
        "the node's info",
        NodeServiceClient::new(channel).info(v1::InfoRequest::default()),
    )
    .await
    .map(tonic::Response::into_inner)
}

/// Opens a session on the target-node at `endpoint`, as the coordinator does (the stream's
/// headers: the call was let in).
async fn open_target_session(endpoint: Endpoint) -> Result<(), tonic::Status> {
    let channel = within("a TLS connection", endpoint.connect())
        .await
        .expect("the TLS handshake");
    within(
        "a target session",
        TargetServiceClient::new(channel).session(tokio_stream::empty()),
    )
    .await
    .map(|_| ())
}

/// `status` refuses the certificate named `name`, and says how to admit it.
fn assert_refused(status: &tonic::Status, name: &str) {
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    let message = status.message();
    assert!(
        message.contains(&format!("the client certificate of `{name}` (DNS:{name},")),
        "{message}"
    );
    assert!(
        message.contains(&format!("--allow-client {name} (TANDEM_ALLOW_CLIENTS)")),
        "{message}"
    );
}

#[tokio::test]
async fn a_draft_node_certificate_is_refused_by_the_target_and_the_coordinators_is_served() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = Ca::new(dir.path(), "tandem-ca");
    let [target_leaf, draft_leaf, coordinator] =
        ["target-node", "draft-node", "coordinator"].map(|n| ca.leaf(n));
    let target_log = dir.path().join("target.log");
    let target = tls_node(
        "target-node",
        &stories(),
        &target_leaf,
        &ca,
        &[],
        &target_log,
    );
    let draft = tls_node(
        "draft-node",
        &stories_q8(),
        &draft_leaf,
        &ca,
        &[],
        &dir.path().join("draft.log"),
    );
    let at = |addr, leaf| tls_endpoint(addr, &ca.cert, Some(leaf));

    // The coordinator's certificate is served by both nodes.
    let served = info(at(target.addr, &coordinator)).await.expect("info");
    assert!(!served.model_name.is_empty());
    open_target_session(at(target.addr, &coordinator))
        .await
        .expect("the coordinator opens a target session");
    info(at(draft.addr, &coordinator))
        .await
        .expect("the draft-node serves the coordinator");

    // The draft-node's certificate, signed by the same CA, opens no session on the target and
    // reads nothing there; nor does the target's own certificate on the draft-node.
    for _ in 0..2 {
        let status = open_target_session(at(target.addr, &draft_leaf))
            .await
            .expect_err("a draft-node's certificate opens a target session");
        assert_refused(&status, "draft-node");
    }
    let status = info(at(target.addr, &draft_leaf))
        .await
        .expect_err("a draft-node's certificate reads the target's info");
    assert_refused(&status, "draft-node");
    let status = info(at(draft.addr, &target_leaf))
        .await
        .expect_err("the target's certificate calls the draft-node");
    assert_refused(&status, "target-node");
    // gRPC health stays open to a certificate of the CA: it tells only whether the node serves.
    health_answers(at(target.addr, &draft_leaf))
        .await
        .expect("health");

    // Three refusals of one certificate: one warning, naming it.
    drop((target, draft));
    let log = std::fs::read_to_string(&target_log).expect("the target's log");
    let warnings: Vec<_> = log
        .lines()
        .filter(|l| l.contains("refused a client not in --allow-client"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(warnings[0].contains("DNS:draft-node"), "{}", warnings[0]);
}

#[tokio::test]
async fn a_node_given_allow_client_admits_those_names_and_refuses_others() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = Ca::new(dir.path(), "tandem-ca");
    let [node_leaf, gateway, coordinator, stranger] =
        ["target-node", "edge-gateway", "coordinator", "stranger"].map(|n| ca.leaf(n));
    // --allow-client replaces the default: the coordinator is refused unless named too.
    let target = tls_node(
        "target-node",
        &stories(),
        &node_leaf,
        &ca,
        &["--allow-client", "edge-gateway"],
        &dir.path().join("target.log"),
    );
    let at = |addr, leaf| tls_endpoint(addr, &ca.cert, Some(leaf));
    info(at(target.addr, &gateway))
        .await
        .expect("the name --allow-client gives");
    for (leaf, name) in [(&coordinator, "coordinator"), (&stranger, "stranger")] {
        let status = info(at(target.addr, leaf)).await.expect_err(name);
        assert_refused(&status, name);
    }

    // The same from the environment, two names comma-separated (here in another case).
    let (model, client_ca) = (
        stories_q8().display().to_string(),
        ca.cert.display().to_string(),
    );
    let mut args = vec!["--model", &model, "--listen", "127.0.0.1:0"];
    let identity = node_leaf.args();
    args.extend(identity.iter().map(String::as_str));
    args.extend(["--tls-client-ca", &client_ca]);
    let draft = tandem_tests::processes::Proc::start_with_env(
        "draft-node",
        &args,
        &[("TANDEM_ALLOW_CLIENTS", "Edge-Gateway,coordinator")],
    );
    for leaf in [&gateway, &coordinator] {
        info(at(draft.addr, leaf))
            .await
            .expect("a name TANDEM_ALLOW_CLIENTS gives");
    }
    let status = info(at(draft.addr, &stranger))
        .await
        .expect_err("a name it does not give");
    assert_refused(&status, "stranger");
}

/// The standard error of `coordinator ARGS` (with `env`), which must exit at start, failing:
/// it fails the test if it says it listens instead.
fn refused_at_start(args: &[&str], env: &[(&str, &str)]) -> String {
    use std::io::{BufRead, Read};
    let mut child = std::process::Command::new(binary("coordinator"))
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run coordinator");
    // Its first line on stdout: `listening ...` once it serves, nothing if it exits first.
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut first)
        .expect("read stdout");
    if first.starts_with("listening") {
        let _ = child.kill();
        panic!("coordinator {args:?} started: {first}");
    }
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("read stderr");
    let status = child.wait().expect("exit status");
    assert!(!status.success(), "{stderr}");
    stderr
}

#[test]
fn plaintext_toward_a_server_given_a_ca_is_refused_at_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = Ca::new(dir.path(), "tandem-ca");
    let ca_path = ca.cert.display().to_string();
    let with_ca = [("TANDEM_TLS_CA", ca_path.as_str())];
    let serve = |target, draft| {
        let args = ["serve", "--target", target, "--draft", draft];
        refused_at_start(
            &[&args[..], &["--listen", "127.0.0.1:0"]].concat(),
            &with_ca,
        )
    };
    let cases = [
        (
            serve("https://127.0.0.1:1", "http://127.0.0.1:2"),
            "--draft http://127.0.0.1:2 is plaintext, but --tls-ca is given for it: use \
             https://127.0.0.1:2",
        ),
        (
            serve("http://target-node:50051", "https://127.0.0.1:2"),
            "--target http://target-node:50051 is plaintext, but --tls-ca is given for it: use \
             https://target-node:50051",
        ),
        (
            refused_at_start(
                &[
                    "generate",
                    "--max-tokens",
                    "4",
                    "--endpoint",
                    "http://127.0.0.1:3",
                ],
                &with_ca,
            ),
            "--endpoint http://127.0.0.1:3 is plaintext, but --tls-ca is given for it",
        ),
    ];
    for (stderr, want) in cases {
        assert!(stderr.contains(want), "{stderr}");
    }
    // The control: without a CA, plaintext is what was asked for, and it starts.
    let plain = tandem_tests::processes::Proc::start(
        "coordinator",
        &[
            "serve",
            "--target",
            "http://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
        ],
    );
    assert!(plain.addr.port() > 0);
}
