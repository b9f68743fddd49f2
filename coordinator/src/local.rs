//! The local all-in-one mode: both models in this process, the in-process round loop.

use std::io::Write;

use anyhow::Context;
use serde_json::json;
use tandem_runtime::model::parse_device;
use tandem_runtime::quantize::{QuantType, quantize_to_gguf};
use tandem_runtime::tokenizer::StreamDecoder;
use tandem_runtime::{
    GenerateRequest, Generation, LoadOptions, Logits, Model, SamplingParams, SpeculativeGenerator,
    Tokenizer, default_stop_tokens,
};

use crate::cli::{GenerateArgs, QuantizeArgs};

pub fn generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let options = LoadOptions {
        device: parse_device(&args.models.device)?,
        ..Default::default()
    };
    let m = &args.models;
    let target = Model::load(&m.target_model, &options).context("loading --target-model")?;
    let tokenizer =
        Tokenizer::for_model(&m.target_model).context("loading the target tokenizer")?;
    let draft = if args.draft_tokens > 0 {
        let draft = Model::load(&m.draft_model, &options).context("loading --draft-model")?;
        let draft_tokenizer =
            Tokenizer::for_model(&m.draft_model).context("loading the draft tokenizer")?;
        Tokenizer::check_compatible(&draft_tokenizer, &tokenizer)?;
        Some(draft)
    } else {
        None
    };
    let s = &args.sampling;
    let request = GenerateRequest {
        prompt: tokenizer.encode(&args.prompt)?,
        max_new_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            seed: s.seed,
            ..SamplingParams::default()
        },
        draft_tokens: args.draft_tokens,
        stop_token_ids: default_stop_tokens(&target, &tokenizer),
        stop_strings: args.stop.clone(),
    };
    let generator = SpeculativeGenerator::new(&target, draft.as_ref(), &tokenizer)?;
    generator.validate(&request)?;
    // First forwards pay for thread-pool start-up and page faults: keep them out of the timings
    // that the speedup compares.
    for model in std::iter::once(&target).chain(draft.as_ref()) {
        model.forward(&request.prompt[..1], &mut model.new_cache(), Logits::Last)?;
    }
    tracing::info!(target = %target.name(), draft = ?draft.as_ref().map(Model::name), k = args.draft_tokens, "generating");

    let mut decoder = StreamDecoder::default();
    let mut so_far: Vec<u32> = Vec::new();
    let mut stdout = std::io::stdout();
    if !args.json {
        print!("{}", args.prompt);
    }
    let spec = generator.generate(&request, |tokens| {
        if args.json || !request.stop_strings.is_empty() {
            return;
        }
        so_far.extend_from_slice(tokens);
        if let Ok(delta) = decoder.next(&tokenizer, &so_far) {
            print!("{delta}");
            let _ = stdout.flush();
        }
    })?;
    if !args.json && !request.stop_strings.is_empty() {
        print!("{}", spec.text);
    }
    let baseline = if args.no_baseline || draft.is_none() {
        None
    } else {
        let target_only = SpeculativeGenerator::new(&target, None, &tokenizer)?;
        Some(target_only.generate(
            &GenerateRequest {
                draft_tokens: 0,
                ..request.clone()
            },
            |_| {},
        )?)
    };
    report(args, &spec, baseline.as_ref());
    Ok(())
}

fn report(args: &GenerateArgs, spec: &Generation, baseline: Option<&Generation>) {
    let st = &spec.stats;
    let speedup = baseline.map(|b| st.tokens_per_second() / b.stats.tokens_per_second());
    if args.json {
        let out = json!({
            "text": spec.text,
            "token_ids": spec.token_ids,
            "finish_reason": spec.finish_reason,
            "stats": {
                "generated_tokens": st.generated_tokens,
                "rounds": st.rounds,
                "drafted": st.drafted,
                "accepted": st.accepted,
                "acceptance_rate": st.acceptance_rate(),
                "mean_accepted_length": st.mean_accepted_length(),
                "tokens_per_second": st.tokens_per_second(),
                "draft_seconds": st.draft_seconds,
                "target_seconds": st.target_seconds,
                "prefill_seconds": st.prefill_seconds,
            },
            "baseline_tokens_per_second": baseline.map(|b| b.stats.tokens_per_second()),
            "speedup": speedup,
        });
        println!("{out}");
        return;
    }
    println!("\n");
    eprintln!(
        "{} tokens in {} rounds (K = {}): acceptance {:.1}%, {:.2} tokens/round, {:.0} tokens/s \
         (draft {:.1} ms, target {:.1} ms)",
        st.generated_tokens,
        st.rounds,
        args.draft_tokens,
        100.0 * st.acceptance_rate(),
        st.mean_accepted_length(),
        st.tokens_per_second(),
        1e3 * st.draft_seconds,
        1e3 * st.target_seconds,
    );
    if let (Some(b), Some(x)) = (baseline, speedup) {
        let same = if b.token_ids == spec.token_ids {
            ", identical output"
        } else {
            ""
        };
        eprintln!(
            "target-only: {:.0} tokens/s; speedup {x:.2}x{same}",
            b.stats.tokens_per_second()
        );
    }
}

pub fn quantize(args: &QuantizeArgs) -> anyhow::Result<()> {
    let quant: QuantType = args.quant_type.parse()?;
    let report = quantize_to_gguf(&args.model, &args.out, quant)?;
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
