//! `draft-node --model PATH --listen ADDR`: serves a draft model to coordinators.

use clap::Parser;
use tandem_node::{NodeArgs, Role};

/// Tandem draft-node: proposes K tokens per step for a coordinator.
#[derive(Debug, Parser)]
#[command(name = "draft-node", version)]
struct Cli {
    #[command(flatten)]
    node: NodeArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tandem_runtime::init_cpu_threads();
    let _telemetry = tandem_node::init_telemetry("tandem-draft-node", "info");
    tandem_node::run(Role::Draft, Cli::parse().node, tandem_draft_node::serve).await
}
