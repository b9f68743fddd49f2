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
fn load_node(
    role: Role,
    model: &str,
    device: &str,
    limits: &LimitsArgs,
) -> anyhow::Result<NodeState> {
    let source = ModelSource {
        model: model.to_string(),
        device: device.to_string(),
        dtype: None,
        max_context: None,
        draft_vocab: None,
    };
    NodeState::load(role, &source, limits)
        .with_context(|| format!("loading the {} model", role.as_str()))
}

/// Loads the target and, if named, the draft (sharing its vocabulary) off the async threads, and
/// serves them on loopback in this process.
pub async fn start_nodes(
    target: &str,
    draft: Option<&str>,
    device: &str,
    limits: &LimitsArgs,
) -> anyhow::Result<LocalCluster> {
    let (target, draft, device, limits) = (
        target.to_string(),
        draft.map(str::to_string),
        device.to_string(),
        limits.clone(),
    );
    let (target, draft) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let target = load_node(Role::Target, &target, &device, &limits)?;
        let draft = draft
            .map(|d| load_node(Role::Draft, &d, &device, &limits))
            .transpose()?;
        if let Some(draft) = &draft {
            Tokenizer::check_compatible(&draft.tokenizer, &target.tokenizer)?;
        }
        Ok((target, draft))
    })
    .await??;
    Ok(LocalCluster::start(target, draft).await?)
}

/// Starts a target-node, a draft-node and a coordinator in this process on loopback gRPC.
/// Returns the cluster (serving while it lives) and the coordinator's URL.
pub async fn start_local(
    models: &ModelArgs,
    with_draft: bool,
    draft_tokens: Option<usize>,
) -> anyhow::Result<(LocalCluster, String)> {
    let cluster = start_nodes(
        &models.target_model,
        with_draft.then_some(models.draft_model.as_str()),
        &models.device,
        &LimitsArgs::default(),
    )
    .await?;
    let engine = cluster.engine(draft_tokens).await?;
    engine.warm_up_logged().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(crate::api::serve(
        listener,
        crate::engine::late_engine::LateEngine::ready(Arc::new(engine)),
        Default::default(),
        Default::default(),
        std::future::pending(),
    ));
    Ok((cluster, url))
}

/// Models whose weights are smaller than this decode faster on one core than on several: a
/// forward takes ~0.2 ms on one core, and the local mode's chain of hand-offs (client,
/// coordinator, node, model thread, and back) costs ~70 µs each time it crosses between cores.
/// Measured with stories260K on 2 cores of a VM: ~3,000 tokens/s on both against ~5,200 on one,
/// and the speedup's pairs (target-only against speculative) within 0.6-2.0x against 0.9-1.4x:
/// whether a run's threads met on one core or not decided its speed.
const ONE_CORE_BELOW: u64 = 4 << 20;

/// Whether the local mode should run on one core: both models are on disk already and smaller
/// than [`ONE_CORE_BELOW`]. Reads only file sizes (a model still to fetch, or missing, is left
/// for loading to fetch or report).
pub fn fits_one_core(models: &ModelArgs) -> bool {
    // A path that is not there (a Hub reference still to fetch) has no size: not small.
    let small = |spec: &str| {
        tandem_runtime::model::weight_bytes(std::path::Path::new(spec))
            .is_ok_and(|bytes| bytes < ONE_CORE_BELOW)
    };
    models.device == "cpu" && small(&models.target_model) && small(&models.draft_model)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_tiny_models_on_disk_for_the_cpu_run_on_one_core() {
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
        let path = |name: &str| fixtures.join(name).display().to_string();
        let dir = tempfile::tempdir().expect("tmp");
        let big = dir.path().join("big.gguf");
        std::fs::File::create(&big)
            .and_then(|f| f.set_len(ONE_CORE_BELOW))
            .expect("a file as large as the bound");
        let models = |target: String, device: &str| ModelArgs {
            target_model: target,
            draft_model: path("stories260K-q8_0.gguf"),
            device: device.into(),
        };
        assert!(fits_one_core(&models(path("stories260K"), "cpu")));
        assert!(!fits_one_core(&models(path("stories260K"), "cuda:0")));
        assert!(!fits_one_core(&models(big.display().to_string(), "cpu")));
        assert!(!fits_one_core(&models("org/not-fetched-yet".into(), "cpu")));
    }
}
