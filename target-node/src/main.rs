//! `target-node --model PATH --listen ADDR`: serves a target model to coordinators.

use clap::Parser;
use tandem_node::{NodeArgs, Role};

/// Tandem target-node: verifies drafted blocks in one forward pass for a coordinator.
#[derive(Debug, Parser)]
#[command(name = "target-node", version)]
struct Cli {
    #[command(flatten)]
    node: NodeArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tandem_runtime::init_cpu_threads();
    let _telemetry = tandem_node::init_telemetry("tandem-target-node", "info");
    tandem_node::run(Role::Target, Cli::parse().node, tandem_target_node::serve).await
}
