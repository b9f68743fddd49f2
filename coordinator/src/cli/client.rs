//! A client of the public gRPC API: `coordinator generate --endpoint URL`, and the local mode
//! once its in-process coordinator is up. Prints the text as it streams, then the statistics
//! (or one JSON object with `--json`), then the speedup where it is measured
//! ([`GenerateArgs::compares`]).

use std::io::Write;

use serde_json::json;
use tandem_proto::v1;
use tandem_proto::v1::coordinator_client::CoordinatorClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;

use crate::api::auth::Secret;
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
        draft_branches: None,
        draft_min_confidence: args.draft_min_confidence,
        drafter: args.drafter.clone(),
        pipeline: args.no_pipeline.then_some(false),
        stop: args.stop.clone(),
        stop_token_ids: Vec::new(),
        top_logprobs: None,
        ignore_eos: args.ignore_eos,
        constraint: args.constraint.to_wire(),
        cache_salt: args.cache_salt.clone().unwrap_or_default(),
    }
}

/// The `authorization` metadata that presents `--api-key`, marked sensitive (no `Debug`
/// shows it).
fn authorization(key: Option<&Secret>) -> anyhow::Result<Option<MetadataValue<Ascii>>> {
    let Some(key) = key else { return Ok(None) };
    let mut value: MetadataValue<Ascii> = format!("Bearer {}", key.0.trim())
        .parse()
        .map_err(|_| anyhow::anyhow!("--api-key (TANDEM_API_KEY): a key is printable ASCII"))?;
    value.set_sensitive(true);
    Ok(Some(value))
}

/// `request` with the `authorization` metadata, if any.
fn keyed(
    request: v1::GenerateRequest,
    authorization: Option<&MetadataValue<Ascii>>,
) -> tonic::Request<v1::GenerateRequest> {
    let mut request = tonic::Request::new(request);
    if let Some(value) = authorization {
        request
            .metadata_mut()
            .insert("authorization", value.clone());
    }
    request
}

/// Runs one request to completion; `on_delta` sees each streamed delta.
pub async fn run(
    client: &mut CoordinatorClient<Channel>,
    request: impl tonic::IntoRequest<v1::GenerateRequest>,
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

/// Connects to the coordinator at `url` and waits, up to `wait`, until it is reachable and
/// says it is ready (gRPC health SERVING: its nodes answer), as a client library retrying an
/// UNAVAILABLE service would. Past `wait` it goes on with what it has: a coordinator that is
/// up but not ready refuses the request, naming what it waits for. A connection that fails in a
/// way no wait mends (TLS toward a plaintext port or the reverse, a certificate refused) fails
/// at once.
async fn connect_when_ready(
    endpoint: tonic::transport::Endpoint,
    url: &str,
    wait: std::time::Duration,
) -> anyhow::Result<Channel> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let deadline = tokio::time::Instant::now() + wait;
    // The interval between tries: short at first, at most a second.
    let mut pause = std::time::Duration::from_millis(50);
    let channel = loop {
        match endpoint.connect().await {
            Ok(channel) => break channel,
            Err(e) => {
                let error = crate::nodes::connect_error(&e, url);
                if lasting(url, &error) {
                    anyhow::bail!("cannot connect to the coordinator at {url}: {error}");
                }
                if tokio::time::Instant::now() >= deadline {
                    anyhow::bail!(
                        "cannot connect to the coordinator at {url}{}: {error}",
                        waited(wait)
                    );
                }
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_secs(1));
    };
    let mut health = HealthClient::new(channel.clone());
    let check = HealthCheckRequest {
        service: "tandem.v1.Coordinator".into(),
    };
    while tokio::time::Instant::now() < deadline {
        match health.check(check.clone()).await {
            Ok(r) if r.get_ref().status == ServingStatus::Serving as i32 => break,
            Ok(_) => {}
            // A coordinator registers its health before it serves: this server is another.
            Err(status) if status.code() == tonic::Code::NotFound => anyhow::bail!(
                "{url} is not a Tandem coordinator (it has no health of tandem.v1.Coordinator): \
                 --endpoint takes the coordinator's gRPC address"
            ),
            Err(status) => {
                let error = crate::nodes::connect_error(&status, url);
                if lasting(url, &error) {
                    anyhow::bail!("the coordinator at {url}: {error}");
                }
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_secs(1));
    }
    Ok(channel)
}

/// Whether a connection failed in a way no wait mends: TLS toward a plaintext port or the
/// reverse (what [`tandem_proto::tls::mismatch_hint`] explains), or a certificate refused.
fn lasting(url: &str, error: &str) -> bool {
    error.contains("certificate") || !tandem_proto::tls::mismatch_hint(url, error).is_empty()
}

/// How long a client waited for the coordinator, for an error that says so.
fn waited(wait: std::time::Duration) -> String {
    match wait.as_secs() {
        0 => String::new(),
        s => format!(" (waited {s} s for it, --wait-ready)"),
    }
}

/// `coordinator generate` against the coordinator at `url`, presenting `--api-key`.
pub async fn generate(url: &str, args: &GenerateArgs) -> anyhow::Result<()> {
    let authorization = authorization(args.api_key.as_ref())?;
    let endpoint = args
        .tls
        .load()?
        .endpoint(url, std::time::Duration::from_secs(10))
        .map_err(|e| anyhow::anyhow!("--endpoint: {e}"))?;
    let wait = std::time::Duration::from_secs(args.wait_ready);
    let channel = connect_when_ready(endpoint, url, wait).await?;
    let mut client = CoordinatorClient::new(channel);
    let request = request_from_args(args);
    if !args.json {
        emit(&args.prompt);
    }
    let first = keyed(request.clone(), authorization.as_ref());
    let done = run(&mut client, first, |delta| {
        if !args.json {
            emit(&delta.text);
        }
    })
    .await
    .map_err(|status| {
        let (waited, hint) = match (status.code(), &args.api_key) {
            (tonic::Code::Unavailable, _) => (waited(wait), ""),
            (tonic::Code::Unauthenticated, None) => (
                String::new(),
                " (pass the key with --api-key KEY or TANDEM_API_KEY)",
            ),
            (tonic::Code::Unauthenticated, Some(_)) => (
                String::new(),
                " (the key given with --api-key or TANDEM_API_KEY is not one of its keys)",
            ),
            _ => (String::new(), ""),
        };
        anyhow::anyhow!(
            "the coordinator at {url}{waited}: {}{hint}",
            crate::nodes::connect_error(&status, url)
        )
    })?;
    let comparison = if args.compares() {
        let runs = usize::from(args.baseline_runs);
        let key = authorization.as_ref();
        Some(compare(&mut client, request, key, &done, runs).await?)
    } else {
        None
    };
    report(args, &done, comparison.as_ref());
    Ok(())
}

/// Target-only against speculative decoding of the same request, run alternately (this
/// machine's noise falls on both alike): each pair's speedup, and whether every output was the
/// first run's.
#[derive(Debug)]
struct Comparison {
    /// (target-only tokens/s, speculative tokens/s) of each pair, in the order run: the even
    /// pairs ran target-only first, the odd ones speculative first.
    pairs: Vec<(f64, f64)>,
    identical: bool,
}

impl Comparison {
    fn median(mut values: Vec<f64>) -> f64 {
        values.sort_by(f64::total_cmp);
        let n = values.len();
        match n {
            0 => f64::NAN,
            _ if n % 2 == 1 => values[n / 2],
            _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
        }
    }

    fn speedups(&self) -> Vec<f64> {
        self.pairs.iter().map(|(t, s)| s / t).collect()
    }

    /// The pairs' speedups by which ran first: target-only, then speculative.
    fn by_order(&self) -> [Vec<f64>; 2] {
        let mut orders = [Vec::new(), Vec::new()];
        for (i, s) in self.speedups().into_iter().enumerate() {
            orders[i % 2].push(s);
        }
        orders
    }

    /// The geometric mean of the median speedup of each order. The second run of a pair is
    /// often a few per cent faster (the first warmed the caches): the pairs' speedups then fall
    /// in two heaps, above and below the truth, and the median of them all lands anywhere
    /// between (0.96 to 1.04 for the same build); the medians of the two orders are off by as
    /// much each way, and their geometric mean cancels it.
    fn speedup(&self) -> f64 {
        let [a, b] = self.by_order();
        if b.is_empty() {
            return Self::median(a);
        }
        (Self::median(a) * Self::median(b)).sqrt()
    }

    fn spread(&self) -> (f64, f64) {
        let s = self.speedups();
        let min = s.iter().copied().fold(f64::INFINITY, f64::min);
        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (min, max)
    }

    /// A 95 % confidence interval of the median of `speedups`, from their order statistics (no
    /// assumption on how the machine's noise is distributed); `None` with too few for one.
    fn median_interval(mut s: Vec<f64>) -> Option<(f64, f64)> {
        s.sort_by(f64::total_cmp);
        let n = s.len() as f64;
        let half = 1.96 * n.sqrt() / 2.0;
        let lo = (n / 2.0 - half).floor();
        let hi = (n / 2.0 + half).ceil();
        (lo >= 0.0 && hi < n).then(|| (s[lo as usize], s[hi as usize]))
    }

    /// About a 95 % confidence interval of [`Self::speedup`]: the geometric means of the two
    /// orders' intervals' bounds; `None` while either order has too few pairs for one.
    fn interval(&self) -> Option<(f64, f64)> {
        let [a, b] = self.by_order();
        let ((lo_a, hi_a), (lo_b, hi_b)) = (Self::median_interval(a)?, Self::median_interval(b)?);
        Some(((lo_a * lo_b).sqrt(), (hi_a * hi_b).sqrt()))
    }

    fn target_only(&self) -> f64 {
        Self::median(self.pairs.iter().map(|p| p.0).collect())
    }

    fn speculative(&self) -> f64 {
        Self::median(self.pairs.iter().map(|p| p.1).collect())
    }
}

/// The speedup is measured until its 95 % confidence interval is at most this wide on each
/// side (a run of a tiny model lasts milliseconds, and on a shared machine one run in four is
/// slowed by a quarter or more: a dozen pairs put the median anywhere from 0.95 to 1.05)...
const PRECISION: f64 = 0.02;
/// ...but for no less than this (a few pairs that happen to agree are not a measurement)...
const COMPARE_MIN: std::time::Duration = std::time::Duration::from_secs(1);
/// ...and no more than this, or this many pairs (a real pair's runs last seconds: there the
/// pairs asked for are all that is run).
const COMPARE_MAX: std::time::Duration = std::time::Duration::from_secs(10);
const MAX_PAIRS: usize = 400;

/// Runs `request` target-only and as asked, alternating which goes first, after the run the
/// user watched (`first`, which paid for warming up and is not counted): `runs` pairs, and more
/// while the speedup is not known to [`PRECISION`] (within [`COMPARE_MIN`]..[`COMPARE_MAX`]).
async fn compare(
    client: &mut CoordinatorClient<Channel>,
    request: v1::GenerateRequest,
    authorization: Option<&MetadataValue<Ascii>>,
    first: &v1::GenerateDone,
    runs: usize,
) -> anyhow::Result<Comparison> {
    // The same draws as the first run: the seed it was given or chose.
    let mut speculative = request;
    if let Some(s) = speculative.sampling.as_mut() {
        s.seed = first.stats.as_ref().map(|st| st.seed);
    }
    let target_only = v1::GenerateRequest {
        draft_tokens: Some(0),
        ..speculative.clone()
    };
    let rate = |done: &v1::GenerateDone| done.stats.as_ref().map_or(0.0, |s| s.tokens_per_second);
    // Each measured run a tenant of its own: none drafts from an earlier run's output (the
    // coordinator keeps each tenant's, `--history-tokens`), which would measure a repeat.
    let salt = format!("tandem generate {:?}", std::time::SystemTime::now());
    let mut runs_made = 0;
    let mut measured = |request: &v1::GenerateRequest| {
        runs_made += 1;
        v1::GenerateRequest {
            cache_salt: format!("{salt} run {runs_made}"),
            ..request.clone()
        }
    };
    let mut comparison = Comparison {
        pairs: Vec::new(),
        identical: true,
    };
    let start = std::time::Instant::now();
    loop {
        let elapsed = start.elapsed();
        let n = comparison.pairs.len();
        let known = comparison
            .interval()
            .is_some_and(|(lo, hi)| hi - lo <= 2.0 * PRECISION * comparison.speedup());
        if n >= runs
            && (elapsed >= COMPARE_MAX || n >= MAX_PAIRS || (known && elapsed >= COMPARE_MIN))
        {
            break;
        }
        // Whichever runs second may find the machine warmer or busier: each goes first in
        // every other pair.
        let alone = keyed(measured(&target_only), authorization);
        let drafted = keyed(measured(&speculative), authorization);
        let (alone, drafted) = if n.is_multiple_of(2) {
            let alone = run(client, alone, |_| {}).await?;
            (alone, run(client, drafted, |_| {}).await?)
        } else {
            let drafted = run(client, drafted, |_| {}).await?;
            (run(client, alone, |_| {}).await?, drafted)
        };
        comparison.identical &=
            alone.token_ids == first.token_ids && drafted.token_ids == first.token_ids;
        comparison.pairs.push((rate(&alone), rate(&drafted)));
    }
    Ok(comparison)
}

fn report(args: &GenerateArgs, done: &v1::GenerateDone, comparison: Option<&Comparison>) {
    let st = done.stats.clone().unwrap_or_default();
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
                "draft_waited_seconds": st.draft_waited_seconds,
                "target_seconds": st.target_seconds,
                "repairs": st.repairs,
                "draft_lost": st.draft_lost,
                "draft_lost_reason": st.draft_lost_reason,
                "draft_blocks_refused": st.draft_blocks_refused,
                "seed": st.seed,
                "model_rounds": st.model_rounds,
                "ngram_rounds": st.ngram_rounds,
                "history_rounds": st.history_rounds,
                "target_only_rounds": st.target_only_rounds,
                "draft_reattached": st.draft_reattached,
                "draft_stalls": st.draft_stalls,
                "pipeline_rounds": st.pipeline_rounds,
                "pipeline_hits": st.pipeline_hits,
                "bytes_sent": st.bytes_sent,
                "bytes_received": st.bytes_received,
            },
            "comparison": comparison.map(|c| {
                let (min, max) = c.spread();
                let interval = c.interval();
                json!({
                    "runs": c.pairs.len(),
                    "target_only_tokens_per_second": c.target_only(),
                    "speculative_tokens_per_second": c.speculative(),
                    "speedup": c.speedup(),
                    "speedup_min": min,
                    "speedup_max": max,
                    "speedup_ci95": interval.map(|(lo, hi)| [lo, hi]),
                    "identical_output": c.identical,
                })
            }),
        });
        emit(&format!("{out}\n"));
        return;
    }
    emit("\n\n");
    let rounds = f64::from(st.rounds.max(1));
    // The draft's compute that ran during a verify is not on the rounds' path: what is left
    // of the decode time besides what the rounds waited for is the network and the overhead.
    let overhead = st.overhead_seconds();
    let during_verify = st.draft_seconds - st.draft_waited_seconds;
    eprintln!(
        "{} tokens in {} rounds (K = {}): acceptance {:.1}%, {:.2} tokens/round, {:.0} tokens/s \
         (draft {:.1} ms, {:.1} ms of it during the target's verify; target {:.1} ms; network and \
         overhead {:.0} µs/round; {:.0} bytes/round)",
        st.generated_tokens,
        st.rounds,
        args.draft_tokens,
        100.0 * st.acceptance_rate,
        st.mean_accepted_length,
        st.tokens_per_second,
        1e3 * st.draft_seconds,
        1e3 * during_verify,
        1e3 * st.target_seconds,
        1e6 * overhead / rounds,
        (st.bytes_sent + st.bytes_received) as f64 / rounds,
    );
    eprintln!(
        "rounds drafted by the model {}, by n-gram lookup {} ({} of them continuing earlier outputs), target only {}; drafted ahead {}, used {}",
        st.model_rounds,
        st.ngram_rounds,
        st.history_rounds,
        st.target_only_rounds,
        st.pipeline_rounds,
        st.pipeline_hits
    );
    if let Some(c) = comparison {
        let (min, max) = c.spread();
        let interval = c.interval().map_or(String::new(), |(lo, hi)| {
            format!("95% CI {lo:.2}-{hi:.2}x, ")
        });
        eprintln!(
            "target-only {:.0} tokens/s, speculative {:.0} tokens/s (medians of {} runs each, \
             alternated): speedup {:.2}x ({interval}pairs {min:.2}-{max:.2}x){}",
            c.target_only(),
            c.speculative(),
            c.pairs.len(),
            c.speedup(),
            if c.identical {
                ", identical output"
            } else {
                ", outputs differ"
            }
        );
        if args.endpoint.is_none() && args.models.is_default() {
            eprintln!("{TINY_PAIR}");
        }
    }
}

/// Why the default pair cannot go faster, and where the pairs that do are measured.
const TINY_PAIR: &str = "stories260K decodes a token in ~0.2 ms on one core (where this process \
    keeps models this small): a draft round's fixed costs (a gRPC round trip, the draft's own \
    forward) take as long, and verifying n positions costs about \
    n single steps on a model this small, so K = auto decodes it with the target alone; pairs \
    where drafting pays (1.4-3.8x) are in docs/benchmarks.md";

#[cfg(test)]
mod tests {
    use super::Comparison;

    #[test]
    fn the_speedup_is_the_median_of_each_order_with_their_spread() {
        let c = Comparison {
            // Ratios 0.5, 1.0, 2.0, 1.1 (in that order): medians 1.25 (target-only first) and
            // 1.05 (speculative first).
            pairs: vec![(100.0, 50.0), (100.0, 100.0), (50.0, 100.0), (100.0, 110.0)],
            identical: true,
        };
        assert!(
            (c.speedup() - (1.25f64 * 1.05).sqrt()).abs() < 1e-12,
            "{}",
            c.speedup()
        );
        assert_eq!(c.spread(), (0.5, 2.0));
        assert_eq!(c.target_only(), 100.0);
        assert_eq!(c.speculative(), 100.0);
        let one = Comparison {
            pairs: vec![(10.0, 9.0)],
            identical: true,
        };
        assert!((one.speedup() - 0.9).abs() < 1e-12);
    }

    /// Ratios 1 + e where the speculative run went second, 1 - e where it went first, with a
    /// little noise: all of them pooled, the median is wherever the noise puts it between the
    /// two heaps; the orders' medians cancel the order's advantage.
    #[test]
    fn which_run_goes_first_in_a_pair_does_not_move_the_speedup() {
        let ratios: Vec<f64> = (0..100)
            .map(|i| {
                let noise = 0.001 * f64::from((i * 7) % 11) - 0.005;
                (if i % 2 == 0 { 1.04 } else { 0.96 }) + noise
            })
            .collect();
        let c = Comparison {
            pairs: ratios.iter().map(|r| (100.0, 100.0 * r)).collect(),
            identical: true,
        };
        assert!((c.speedup() - 1.0).abs() < 0.005, "{}", c.speedup());
        let (lo, hi) = c.interval().expect("50 pairs of each order");
        assert!(lo <= c.speedup() && c.speedup() <= hi, "{lo} {hi}");
        assert!(hi - lo < 0.02, "{lo} {hi}");
    }

    #[test]
    fn the_interval_of_the_median_narrows_with_pairs_and_needs_enough_of_them() {
        let interval = |ratios: &[f64]| Comparison::median_interval(ratios.to_vec());
        // Too few pairs for a 95 % interval from order statistics.
        assert_eq!(interval(&[1.0, 1.1, 0.9]), None);
        // 1.96 · √n / 2 ranks either side of the middle.
        let twenty: Vec<f64> = (0..20).map(|i| 0.9 + 0.01 * f64::from(i)).collect();
        let (lo, hi) = interval(&twenty).expect("20 pairs");
        assert!(
            (lo - 0.95).abs() < 1e-9 && (hi - 1.05).abs() < 1e-9,
            "{lo} {hi}"
        );
        let hundred: Vec<f64> = (0..100).map(|i| 0.9 + 0.002 * f64::from(i)).collect();
        let (lo, hi) = interval(&hundred).expect("100 pairs");
        assert!(
            (lo - 0.98).abs() < 1e-9 && (hi - 1.02).abs() < 1e-9,
            "{lo} {hi}"
        );
        // The comparison's interval needs enough pairs of each order.
        let c = |n: usize| Comparison {
            pairs: twenty[..n].iter().map(|r| (100.0, 100.0 * r)).collect(),
            identical: true,
        };
        assert_eq!(c(14).interval(), None);
        assert!(c(16).interval().is_some());
    }
}
