//! `coordinator`: Tandem's front door. `generate` runs a speculative generation (locally, with
//! both nodes in this process on loopback gRPC, or against `--endpoint`); `serve` runs the
//! public gRPC API over remote nodes; `quantize` writes a GGUF draft; `fetch` fills the Hub
//! cache.

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use tandem_coordinator::cli::{Cli, Command, ServeArgs};
use tandem_coordinator::http::{self, HttpState};
use tandem_coordinator::{Engine, client, local};

fn main() -> anyhow::Result<()> {
    tandem_runtime::init_cpu_threads();
    let cli = Cli::parse();
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
                Some(url) => client::generate(url, &args).await,
                None => local::generate(&args).await,
            },
            Command::Serve(args) => serve(&args).await,
            Command::Quantize(args) => local::quantize(&args),
            Command::Fetch(args) => local::fetch(&args),
        }
    })
}

async fn serve(args: &ServeArgs) -> anyhow::Result<()> {
    let mut engine = Engine::connect(&args.target, args.draft.as_deref(), args.draft_tokens.0)
        .await
        .context("connecting to the nodes")?;
    if let Some(n) = args.max_speculating_sessions {
        engine.max_speculating = (n > 0).then_some(n);
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let http = tandem_node::bind_http(args.http_listen).await?;
    tracing::info!(
        target_node = %args.target,
        target_model = %engine.target.info.model_name,
        draft_node = ?args.draft,
        draft_model = ?engine.draft.as_ref().map(|d| d.info.model_name.clone()),
        draft_tokens = %args.draft_tokens,
        listen = %listener.local_addr()?,
        http_listen = ?http.as_ref().and_then(|l| l.local_addr().ok()),
        "coordinator ready"
    );
    let engine = Arc::new(engine);
    let state = HttpState::new(Arc::clone(&engine));
    tandem_node::serve_until_signal(
        || {
            tracing::info!(
                in_flight = engine.active(),
                "shutting down: draining in-flight generations"
            );
            state
                .ready
                .store(false, std::sync::atomic::Ordering::Relaxed);
        },
        |stop| tandem_coordinator::serve(listener, Arc::clone(&engine), stop),
        |stop| async {
            match http {
                Some(l) => http::serve(l, Arc::clone(&state), stop).await,
                None => Ok(()),
            }
        },
    )
    .await?;
    tracing::info!("coordinator stopped");
    Ok(())
}
