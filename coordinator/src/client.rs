//! A client of the public gRPC API: `coordinator generate --endpoint URL`, and the local mode
//! once its in-process coordinator is up. Prints the text as it streams, then the statistics
//! (or one JSON object with `--json`).

use std::io::Write;

use serde_json::json;
use tandem_proto::v1;
use tandem_proto::v1::coordinator_client::CoordinatorClient;
use tonic::transport::Channel;

use crate::cli::GenerateArgs;

/// The request the command line describes.
pub fn request_from_args(args: &GenerateArgs) -> v1::GenerateRequest {
    let s = &args.sampling;
    v1::GenerateRequest {
        prompt: args.prompt.clone(),
        prompt_tokens: Vec::new(),
        max_tokens: args.max_tokens as u32,
        sampling: Some(v1::SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k as u32,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            repeat_last_n: 0,
            seed: s.seed,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
        }),
        draft_tokens: args.draft_tokens.0.map(|k| k as u32),
        drafter: args.drafter.clone(),
        pipeline: args.no_pipeline.then_some(false),
        stop: args.stop.clone(),
        stop_token_ids: Vec::new(),
        top_logprobs: None,
        ignore_eos: args.ignore_eos,
    }
}

/// Runs one request to completion; `on_delta` sees each streamed delta.
pub async fn run(
    client: &mut CoordinatorClient<Channel>,
    request: v1::GenerateRequest,
    mut on_delta: impl FnMut(&v1::TokenDelta),
) -> Result<v1::GenerateDone, tonic::Status> {
    let mut stream = client.generate(request).await?.into_inner();
    while let Some(message) = stream.message().await? {
        match message.kind {
            Some(v1::generate_response::Kind::Delta(d)) => on_delta(&d),
            Some(v1::generate_response::Kind::Done(done)) => return Ok(done),
            None => {}
        }
    }
    Err(tonic::Status::unavailable(
        "the coordinator ended the stream before the final statistics",
    ))
}

/// Writes to stdout now; a closed stdout (`| head`) is not an error worth a panic.
fn emit(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush());
}

/// `coordinator generate` against the coordinator at `url`.
pub async fn generate(url: &str, args: &GenerateArgs) -> anyhow::Result<()> {
    let channel = args
        .tls
        .load()?
        .endpoint(url, std::time::Duration::from_secs(10))
        .map_err(|e| anyhow::anyhow!("--endpoint: {e}"))?
        .connect()
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot connect to the coordinator at {url}: {}",
                crate::nodes::connect_error(&e, url)
            )
        })?;
    let mut client = CoordinatorClient::new(channel);
    let request = request_from_args(args);
    if !args.json {
        emit(&args.prompt);
    }
    let done = run(&mut client, request.clone(), |delta| {
        if !args.json {
            emit(&delta.text);
        }
    })
    .await
    .map_err(|status| {
        anyhow::anyhow!(
            "the coordinator at {url}: {}",
            crate::nodes::connect_error(&status, url)
        )
    })?;
    let baseline = if args.no_baseline || args.draft_tokens.target_only() {
        None
    } else {
        // The same draws as the speculative run: the seed it was given or chose.
        let mut target_only = v1::GenerateRequest {
            draft_tokens: Some(0),
            ..request
        };
        if let Some(s) = target_only.sampling.as_mut() {
            s.seed = done.stats.as_ref().map(|st| st.seed);
        }
        Some(run(&mut client, target_only, |_| {}).await?)
    };
    report(args, &done, baseline.as_ref());
    Ok(())
}

fn report(args: &GenerateArgs, done: &v1::GenerateDone, baseline: Option<&v1::GenerateDone>) {
    let st = done.stats.clone().unwrap_or_default();
    let base_tps = baseline
        .and_then(|b| b.stats.as_ref())
        .map(|s| s.tokens_per_second);
    let speedup = base_tps.map(|b| st.tokens_per_second / b);
    if args.json {
        let out = json!({
            "text": done.text,
            "token_ids": done.token_ids,
            "finish_reason": done.finish_reason,
            "stats": {
                "generated_tokens": st.generated_tokens,
                "rounds": st.rounds,
                "drafted": st.drafted,
                "accepted": st.accepted,
                "acceptance_rate": st.acceptance_rate,
                "mean_accepted_length": st.mean_accepted_length,
                "tokens_per_second": st.tokens_per_second,
                "prefill_seconds": st.prefill_seconds,
                "decode_seconds": st.decode_seconds,
                "draft_seconds": st.draft_seconds,
                "target_seconds": st.target_seconds,
                "repairs": st.repairs,
                "draft_lost": st.draft_lost,
                "draft_lost_reason": st.draft_lost_reason,
                "draft_blocks_refused": st.draft_blocks_refused,
                "seed": st.seed,
                "model_rounds": st.model_rounds,
                "ngram_rounds": st.ngram_rounds,
                "target_only_rounds": st.target_only_rounds,
                "draft_reattached": st.draft_reattached,
                "draft_stalls": st.draft_stalls,
                "pipeline_rounds": st.pipeline_rounds,
                "pipeline_hits": st.pipeline_hits,
                "bytes_sent": st.bytes_sent,
                "bytes_received": st.bytes_received,
            },
            "baseline_tokens_per_second": base_tps,
            "speedup": speedup,
        });
        emit(&format!("{out}\n"));
        return;
    }
    emit("\n\n");
    let rounds = f64::from(st.rounds.max(1));
    let overhead = st.decode_seconds - st.draft_seconds - st.target_seconds;
    eprintln!(
        "{} tokens in {} rounds (K = {}): acceptance {:.1}%, {:.2} tokens/round, {:.0} tokens/s \
         (draft {:.1} ms, target {:.1} ms, network and overhead {:.0} µs/round, {:.0} bytes/round)",
        st.generated_tokens,
        st.rounds,
        args.draft_tokens,
        100.0 * st.acceptance_rate,
        st.mean_accepted_length,
        st.tokens_per_second,
        1e3 * st.draft_seconds,
        1e3 * st.target_seconds,
        1e6 * overhead / rounds,
        (st.bytes_sent + st.bytes_received) as f64 / rounds,
    );
    eprintln!(
        "rounds drafted by the model {}, by n-gram lookup {}, target only {}; drafted ahead {}, used {}",
        st.model_rounds,
        st.ngram_rounds,
        st.target_only_rounds,
        st.pipeline_rounds,
        st.pipeline_hits
    );
    if let (Some(b), Some(x)) = (baseline, speedup) {
        let same = if b.token_ids == done.token_ids {
            ", identical output"
        } else {
            ""
        };
        eprintln!(
            "target-only: {:.0} tokens/s; speedup {x:.2}x{same}",
            base_tps.unwrap_or_default()
        );
    }
}
