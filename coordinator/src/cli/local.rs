//! The local all-in-one mode: a target-node, a draft-node and a coordinator in this process,
//! talking gRPC over loopback; `quantize` and `fetch`.

use std::sync::Arc;

use anyhow::Context;
use tandem_node::{LimitsArgs, ModelSource, NodeState, Role};
use tandem_runtime::Tokenizer;
use tandem_runtime::quantize::{QuantType, quantize_to_gguf};

use crate::cli::{FetchArgs, GenerateArgs, ModelArgs, QuantizeArgs};
use crate::nodes::cluster::LocalCluster;

/// Loads one model with its tokenizer as a node does (warmed up by a first forward).
fn load_node(role: Role, model: &str, device: &str) -> anyhow::Result<NodeState> {
    let source = ModelSource {
        model: model.to_string(),
        device: device.to_string(),
        max_context: None,
    };
    NodeState::load(role, &source, &LimitsArgs::default())
        .with_context(|| format!("loading the {} model", role.as_str()))
}

/// Starts a target-node, a draft-node and a coordinator in this process on loopback gRPC.
/// Returns the cluster (serving while it lives) and the coordinator's URL.
pub async fn start_local(
    models: &ModelArgs,
    with_draft: bool,
    draft_tokens: Option<usize>,
) -> anyhow::Result<(LocalCluster, String)> {
    let m = models.clone();
    let (target, draft) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let target = load_node(Role::Target, &m.target_model, &m.device)?;
        let draft = if with_draft {
            Some(load_node(Role::Draft, &m.draft_model, &m.device)?)
        } else {
            None
        };
        if let Some(draft) = &draft {
            Tokenizer::check_compatible(&draft.tokenizer, &target.tokenizer)?;
        }
        Ok((target, draft))
    })
    .await??;
    let cluster = LocalCluster::start(target, draft).await?;
    let engine = cluster.engine(draft_tokens).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(crate::api::serve(
        listener,
        crate::engine::late::LateEngine::ready(Arc::new(engine)),
        Default::default(),
        Default::default(),
        std::future::pending(),
    ));
    Ok((cluster, url))
}

/// `coordinator generate` without `--endpoint`: the three services in this process.
pub async fn generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let (_cluster, url) = start_local(
        &args.models,
        !args.draft_tokens.target_only() && args.drafter != "ngram",
        args.draft_tokens.0,
    )
    .await?;
    tracing::info!(%url, "local cluster ready");
    crate::cli::client::generate(&url, args).await
}

/// `coordinator fetch`: each model made local, its path on stdout.
pub fn fetch(args: &FetchArgs) -> anyhow::Result<()> {
    for model in &args.models {
        let path = tandem_runtime::model::hub::resolve(model)?;
        println!("{}", path.display());
    }
    Ok(())
}

pub fn quantize(args: &QuantizeArgs) -> anyhow::Result<()> {
    let quant: QuantType = args.quant_type.parse()?;
    let model = tandem_runtime::model::hub::resolve(&args.model)?;
    let report = quantize_to_gguf(&model, &args.out, quant)?;
    eprintln!(
        "wrote {} ({} tensors, {:.1} MiB){}{}",
        args.out.display(),
        report.tensors,
        report.bytes as f64 / (1 << 20) as f64,
        if report.kept_f32.is_empty() {
            String::new()
        } else {
            format!(
                "; kept in f32 (rows not a multiple of the block): {}",
                report.kept_f32.join(", ")
            )
        },
        if report.tokenizer_in_metadata {
            "; tokenizer in metadata"
        } else {
            "; copy tokenizer.json beside it"
        },
    );
    Ok(())
}
