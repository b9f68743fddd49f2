//! Command-line and environment configuration, grouped by concern.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "coordinator",
    version,
    about = "Tandem: distributed speculative decoding"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate text with a draft and a target model in this process.
    Generate(GenerateArgs),
    /// Write a Hugging Face Llama/Qwen2 folder as a (quantized) GGUF file, e.g. a draft model.
    Quantize(QuantizeArgs),
}

#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Target model: a Hugging Face folder or a .gguf file.
    #[arg(
        long,
        env = "TANDEM_TARGET_MODEL",
        default_value = "fixtures/stories260K"
    )]
    pub target_model: PathBuf,
    /// Draft model sharing the target's vocabulary.
    #[arg(
        long,
        env = "TANDEM_DRAFT_MODEL",
        default_value = "fixtures/stories260K-q8_0.gguf"
    )]
    pub draft_model: PathBuf,
    /// Device for both models: cpu, or cuda:N (needs the `cuda` feature).
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: String,
}

#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub models: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[arg(long, default_value = "Once upon a time")]
    pub prompt: String,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// K, tokens drafted per round; 0 decodes with the target alone.
    #[arg(long, env = "TANDEM_DRAFT_TOKENS", default_value_t = 4)]
    pub draft_tokens: usize,
    /// Text that ends the generation (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Skip the target-only run that measures the speedup.
    #[arg(long)]
    pub no_baseline: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// Hugging Face model folder.
    #[arg(long)]
    pub model: PathBuf,
    /// Output .gguf path.
    #[arg(long)]
    pub out: PathBuf,
    /// f32, f16, q8_0, q4_0 or q4_k_m.
    #[arg(long = "type", default_value = "q8_0")]
    pub quant_type: String,
}
