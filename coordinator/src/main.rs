//! `coordinator`: Tandem's front door. `generate` runs a speculative generation (locally, with
//! both nodes in this process on loopback gRPC, or against `--endpoint`); `serve` runs the
//! public gRPC API over remote nodes; `quantize` writes a GGUF draft; `fetch` fills the Hub
//! cache.

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use tandem_coordinator::api::auth::{Access, ApiKeys};
use tandem_coordinator::api::http::{self, HttpState};
use tandem_coordinator::api::limits::{ClientLimits, TrustedProxies};
use tandem_coordinator::cli::{Cli, Command, ServeArgs, client, local};
use tandem_coordinator::engine::Engine;
use tandem_coordinator::engine::history::History;
use tandem_coordinator::engine::late_engine::{LateEngine, connect_until_ready};
use tandem_coordinator::nodes::LocalCluster;
use tandem_proto::tls::{ClientTls, ClientTlsArgs, DefaultClients};

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Command::Generate(args) = &cli.command
        && args.endpoint.is_none()
        && local::fits_one_core(&args.models)
    {
        // Before any thread exists: every thread inherits it.
        if let Err(e) = tandem_runtime::confine_to_current_cpu() {
            eprintln!("warning: cannot keep the local mode's tiny models on one core: {e}");
        }
    }
    tandem_runtime::init_cpu_threads();
    let default_level = match cli.command {
        Command::Serve(_) => "info",
        _ => "warn",
    };
    // The local all-in-one mode runs one generation: its gRPC plumbing (coordinator and both
    // nodes) shares one thread, leaving the cores to the models (measured: the time outside the
    // models per round falls from ~900 to ~300 µs on 2 cores). `serve` handles many requests.
    let runtime = match &cli.command {
        Command::Serve(_) => tokio::runtime::Builder::new_multi_thread(),
        _ => tokio::runtime::Builder::new_current_thread(),
    }
    .enable_all()
    .build()?;
    runtime.block_on(async {
        let _telemetry = tandem_node::init_telemetry("tandem-coordinator", default_level);
        match cli.command {
            Command::Generate(args) => match &args.endpoint {
                Some(url) => {
                    args.tls
                        .refuse_plaintext("--endpoint", std::slice::from_ref(url))?;
                    client::generate(url, &args).await
                }
                None => local::generate(&args).await,
            },
            Command::Serve(args) => serve(&args).await,
            Command::Quantize(args) => local::quantize(&args),
            Command::Fetch(args) => local::fetch(&args),
        }
    })
}

async fn serve(args: &ServeArgs) -> anyhow::Result<()> {
    // Certificates are checked first, then models served in this process load before anything
    // listens, as a node's do.
    let tls = args.tls.load(DefaultClients::Any)?;
    let node_tls = ClientTlsArgs {
        identity: args.tls.identity.clone(),
        tls_ca: args.tls_ca.clone(),
    };
    node_tls.refuse_plaintext("--target", &args.targets)?;
    node_tls.refuse_plaintext("--draft", &args.drafts)?;
    let node_tls = node_tls.load()?;
    let here = match &args.here.target_model {
        Some(target) => Some(
            local::start_nodes(
                target,
                args.here.draft_model.as_deref(),
                &args.here.device,
                &args.here.limits,
            )
            .await?,
        ),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let http = tandem_node::bind_http(args.http_listen).await?;
    let metrics_listener = match args.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} (--metrics-listen)"))?,
        ),
        None => None,
    };
    let engine = start_engine(args, here.as_ref(), node_tls).await?;
    tracing::info!(
        listen = %listener.local_addr()?,
        grpc = tls.mode(),
        grpc_clients = %tls.admits(),
        http_listen = ?http.as_ref().and_then(|l| l.local_addr().ok()),
        "coordinator listening"
    );
    tandem_node::announce_listening(
        &listener,
        &[
            ("http", http.as_ref()),
            ("metrics", metrics_listener.as_ref()),
        ],
    )?;
    let access = Access {
        keys: ApiKeys::new(args.api_keys.iter().map(|k| k.0.clone())),
        per_client: ClientLimits::new(args.max_requests_per_client),
        proxies: TrustedProxies::new(args.trusted_proxies.iter().copied()),
        shared_prefix_cache: args.shared_prefix_cache,
    };
    let state = HttpState::new(
        engine.clone(),
        access.clone(),
        args.served_model_names.clone(),
        args.per_request_spec_decode_metrics,
    );
    let metrics_on = match metrics_listener {
        Some(l) => {
            tracing::info!(metrics_listen = %l.local_addr()?, "metrics on their own listener");
            tokio::spawn(http::serve_metrics(l, Arc::clone(&state)));
            http::MetricsOn::Elsewhere
        }
        None => http::MetricsOn::Api,
    };
    tandem_node::serve_until_signal(
        || {
            tracing::info!(
                in_flight = engine.get().map_or(0, |e| e.active()),
                "shutting down: draining in-flight generations"
            );
            state
                .ready
                .store(false, std::sync::atomic::Ordering::Relaxed);
        },
        |stop| {
            tandem_coordinator::api::serve(
                listener,
                engine.clone(),
                access.clone(),
                tls.clone(),
                stop,
            )
        },
        |stop| async {
            match http {
                Some(l) => http::serve(l, Arc::clone(&state), metrics_on, stop).await,
                None => Ok(()),
            }
        },
    )
    .await?;
    tracing::info!("coordinator stopped");
    Ok(())
}

/// The engine of `serve`, configured from `args`: over the nodes served in this process
/// (`here`), ready at once; else one that answers at once, refusing requests (not ready) until
/// a target-node at `--target` answers.
async fn start_engine(
    args: &ServeArgs,
    here: Option<&LocalCluster>,
    node_tls: ClientTls,
) -> anyhow::Result<LateEngine> {
    let max_speculating = args.max_speculating_sessions;
    let target_retry = std::time::Duration::from_secs(args.target_retry_secs);
    let draft_step_slack = std::time::Duration::from_millis(args.draft_step_slack_ms);
    let draft_open_grace = std::time::Duration::from_millis(args.draft_open_grace_ms);
    let history_tokens = args.history_tokens;
    let policy_file = args.policy_file.clone();
    let configure = move |engine: &mut Engine| {
        engine.history = History::new(history_tokens);
        if let Some(path) = &policy_file
            && let Some(why) = engine.learn_in(path)
        {
            tracing::warn!(%why, "the policy file is not used: starting from priors");
        }
        if let Some(n) = max_speculating {
            engine.max_speculating = (n > 0).then_some(n);
        }
        engine.target_retry = target_retry;
        engine.draft_step_slack = draft_step_slack;
        engine.draft_open_grace = draft_open_grace;
    };
    let k = args.draft_tokens.0;
    Ok(match here {
        Some(cluster) => {
            let mut engine = cluster.engine(k).await?;
            configure(&mut engine);
            engine.warm_up_logged().await;
            tracing::info!(
                target_model = %engine.target().info.model_name,
                draft_model = ?engine.draft.get().map(|d| d.primary().info.model_name.clone()),
                draft_tokens = ?k,
                "coordinator ready, its nodes in this process"
            );
            LateEngine::ready(Arc::new(engine))
        }
        None => {
            // The APIs answer at once; requests are refused (not ready) until a target-node
            // answers.
            let engine = LateEngine::waiting(format!(
                "connecting to the target-node at {}",
                args.targets.join(", ")
            ));
            let connecting = engine.clone();
            let (targets, drafts) = (args.targets.clone(), args.drafts.clone());
            tokio::spawn(async move {
                connect_until_ready(&connecting, || async {
                    let mut engine = Engine::connect(&targets, &drafts, k, &node_tls).await?;
                    configure(&mut engine);
                    engine.warm_up_logged().await;
                    tracing::info!(
                        target_nodes = %targets.join(", "),
                        target_model = %engine.target().info.model_name,
                        draft_nodes = %drafts.join(", "),
                        draft_model = ?engine.draft.get().map(|d| d.primary().info.model_name.clone()),
                        draft_tokens = ?k,
                        "coordinator ready"
                    );
                    Ok(engine)
                })
                .await;
            });
            engine
        }
    })
}
