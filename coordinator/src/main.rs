//! `coordinator`: Tandem's front door. `generate` runs a local all-in-one speculative
//! generation; `quantize` writes a GGUF draft from a Hugging Face checkpoint.

mod cli;
mod local;

use clap::Parser;

fn main() -> anyhow::Result<()> {
    tandem_runtime::init_cpu_threads();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli::Cli::parse().command {
        cli::Command::Generate(args) => local::generate(&args),
        cli::Command::Quantize(args) => local::quantize(&args),
    }
}
