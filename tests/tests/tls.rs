//! Mutual TLS (issue 13): the three binaries as processes, every gRPC connection over TLS with
//! client certificates from one CA. A peer without a certificate, or with one from another CA,
//! is refused; plaintext to a TLS port fails with an error that says to use https://; and no
//! certificate or key content reaches a log, even at debug level.

use tandem_proto::v1;
use tandem_tests::pki::{Ca, health_answers, pem_body_lines, tls_endpoint, tls_node};
use tandem_tests::processes::{Proc, binary};
use tandem_tests::*;

#[tokio::test]
async fn mutual_tls_everywhere_gives_target_only_text_and_logs_no_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = Ca::new(dir.path(), "tandem-ca");
    let leaves = ["target", "draft", "coordinator", "client"].map(|n| ca.leaf(n));
    let logs = ["target.log", "draft.log", "coordinator.log"].map(|n| dir.path().join(n));
    let target = tls_node("target-node", &stories(), &leaves[0], &ca, &[], &logs[0]);
    let draft = tls_node("draft-node", &stories_q8(), &leaves[1], &ca, &[], &logs[1]);
    let (target_url, draft_url) = (
        format!("https://{}", target.addr),
        format!("https://{}", draft.addr),
    );
    let ca_path = ca.cert.display().to_string();
    let mut args = vec![
        "serve",
        "--target",
        &target_url,
        "--draft",
        &draft_url,
        "--listen",
        "127.0.0.1:0",
    ];
    let identity = leaves[2].args();
    args.extend(identity.iter().map(String::as_str));
    args.extend(["--tls-client-ca", &ca_path, "--tls-ca", &ca_path]);
    let coordinator = Proc::start_logged("coordinator", &args, &[("RUST_LOG", "debug")], &logs[2]);
    let endpoint = tls_endpoint(coordinator.addr, &ca.cert, Some(&leaves[3]));
    coordinator.wait_ready_at(endpoint.clone());

    let channel = endpoint.connect().await.expect("TLS connection");
    let mut client = v1::coordinator_client::CoordinatorClient::new(channel);
    let req = request(
        &tokenizer(&stories())
            .encode("Once upon a time")
            .expect("encode"),
        40,
        4,
        &tandem_runtime::SamplingParams::greedy(),
    );
    let mut stream = client.generate(req).await.expect("generate").into_inner();
    let mut done = None;
    while let Some(message) = stream.message().await.expect("stream") {
        if let Some(v1::generate_response::Kind::Done(d)) = message.kind {
            done = Some(d);
        }
    }
    let done = done.expect("the last message");
    assert!(done.stats.expect("stats").drafted > 0, "the draft was used");
    let want = in_process(
        &stories(),
        None,
        &request(
            &tokenizer(&stories())
                .encode("Once upon a time")
                .expect("encode"),
            40,
            0,
            &tandem_runtime::SamplingParams::greedy(),
        ),
    );
    assert_eq!(done.token_ids, want.token_ids);

    drop((coordinator, draft, target));
    let secrets: Vec<String> = leaves
        .iter()
        .flat_map(|l| [pem_body_lines(&l.key), pem_body_lines(&l.cert)].concat())
        .chain(pem_body_lines(&ca.cert))
        .collect();
    for log in &logs {
        let text = std::fs::read_to_string(log).expect("log");
        assert!(text.contains("mutual tls"), "{}: {text}", log.display());
        for line in &secrets {
            assert!(
                !text.contains(line.as_str()),
                "{} holds PEM content",
                log.display()
            );
        }
    }
}

#[tokio::test]
async fn a_peer_without_a_client_certificate_or_from_another_ca_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = Ca::new(dir.path(), "tandem-ca");
    let stranger_ca = Ca::new(dir.path(), "stranger-ca");
    let (node_leaf, client, stranger) = (
        ca.leaf("target"),
        ca.leaf("client"),
        stranger_ca.leaf("stranger"),
    );
    let target = tls_node(
        "target-node",
        &stories(),
        &node_leaf,
        &ca,
        &[],
        &dir.path().join("target.log"),
    );
    // The control: a certificate from the node's client CA is let in.
    health_answers(tls_endpoint(target.addr, &ca.cert, Some(&client)))
        .await
        .expect("a client with a certificate from the CA");
    let refused = [
        (
            "no client certificate",
            tls_endpoint(target.addr, &ca.cert, None),
        ),
        (
            "a certificate from another CA",
            tls_endpoint(target.addr, &ca.cert, Some(&stranger)),
        ),
    ];
    for (what, endpoint) in refused {
        let err = health_answers(endpoint).await.expect_err(what);
        assert!(!err.is_empty(), "{what}");
    }
    // A client that does not trust the node's CA refuses the node.
    let err = health_answers(tls_endpoint(
        target.addr,
        &stranger_ca.cert,
        Some(&stranger),
    ))
    .await
    .expect_err("a server certificate from an untrusted CA");
    assert!(err.contains("certificate"), "{err}");

    // The coordinator's public API, before it has reached any node, is as strict.
    let ca_path = ca.cert.display().to_string();
    let identity = node_leaf.args();
    let mut args = vec![
        "serve",
        "--target",
        "https://127.0.0.1:1",
        "--listen",
        "127.0.0.1:0",
        "--tls-client-ca",
        &ca_path,
    ];
    args.extend(identity.iter().map(String::as_str));
    let coordinator = Proc::start("coordinator", &args);
    let addr = coordinator.addr;
    health_answers(tls_endpoint(addr, &ca.cert, Some(&client)))
        .await
        .expect("a client with a certificate from the CA");
    health_answers(tls_endpoint(addr, &ca.cert, None))
        .await
        .expect_err("no client certificate");
    health_answers(tls_endpoint(addr, &ca.cert, Some(&stranger)))
        .await
        .expect_err("a certificate from another CA");
}

/// Runs `coordinator generate` with `args`, which must fail saying `says`.
fn generate_fails(args: &[&str], says: &str) {
    let out = std::process::Command::new(binary("coordinator"))
        .args(["generate", "--max-tokens", "4"])
        .args(args)
        .output()
        .expect("run coordinator generate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(says), "{stderr}");
}

#[tokio::test]
async fn plaintext_to_a_tls_port_fails_with_an_error_that_says_so() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = Ca::new(dir.path(), "tandem-ca");
    let leaf = ca.leaf("target");
    let target = tls_node(
        "target-node",
        &stories(),
        &leaf,
        &ca,
        &[],
        &dir.path().join("target.log"),
    );
    let target_http = format!("http://{}", target.addr);
    generate_fails(&["--endpoint", &target_http], "use https://");
    // And TLS to a plaintext port.
    let plain = Proc::node("target-node", &stories(), &[]);
    let (ca_cert, plain_https) = (
        ca.cert.display().to_string(),
        format!("https://{}", plain.addr),
    );
    let args = ["--tls-ca", &ca_cert, "--endpoint", &plain_https];
    generate_fails(&args, "does the server serve TLS");
    // And a node's address where the coordinator's is asked for: no wait mends either.
    let plain_http = format!("http://{}", plain.addr);
    generate_fails(&["--endpoint", &plain_http], "is not a Tandem coordinator");

    // A coordinator given an http:// URL for a TLS node says why it is not ready.
    let coordinator = Proc::start(
        "coordinator",
        &[
            "serve",
            "--target",
            &target_http,
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ],
    );
    let http = coordinator.http();
    let mut body = String::new();
    let ok = eventually(async || {
        body = http_request(http, "GET", "/ready", "").await.1;
        body.contains("use https://")
    })
    .await;
    assert!(ok, "/ready says to use https://: {body}");
}
