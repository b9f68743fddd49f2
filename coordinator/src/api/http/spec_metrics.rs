//! Per-request speculation metrics in the OpenAI responses, in vLLM's shape
//! (`--per-request-spec-decode-metrics summary|detailed`): `metrics.speculative_decoding`, in a
//! whole response and in the streamed usage chunk, for a request of one choice (`null` for
//! several: the counts describe one generation). Load testers read a request's acceptance
//! there; `/metrics` has only the server's sums.

use serde_json::{Value, json};

use crate::engine::Outcome;

/// How much a response says of its speculation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecMetrics {
    /// Nothing: responses as OpenAI's.
    #[default]
    None,
    /// Counts, rates and the histogram of accepted drafts per verify.
    Summary,
    /// The summary and, per verify that drafted, the drafts proposed and accepted.
    Detailed,
}

impl SpecMetrics {
    /// The response's `metrics` object, where one is asked for: the speculation of `outcomes`
    /// (one per choice) drafting at most `spec_tokens` a round.
    pub fn metrics(self, spec_tokens: usize, outcomes: &[&Outcome]) -> Option<Value> {
        if self == Self::None {
            return None;
        }
        let [outcome] = outcomes else {
            return Some(json!({ "speculative_decoding": null }));
        };
        Some(json!({ "speculative_decoding": self.speculative_decoding(spec_tokens, outcome) }))
    }

    /// vLLM's fields: a step is a verify that drafted (rounds of the target alone are not
    /// speculation); `mean_acceptance_length` counts the token every step commits past its
    /// accepted drafts; `acceptance_histogram[j]` the steps that accepted exactly j drafts.
    fn speculative_decoding(self, spec_tokens: usize, outcome: &Outcome) -> Value {
        let steps = &outcome.stats.steps;
        let drafted: u32 = steps.iter().map(|s| s[0]).sum();
        let accepted: u32 = steps.iter().map(|s| s[1]).sum();
        let longest = steps.iter().map(|s| s[1] as usize).max().unwrap_or(0);
        let mut histogram = vec![0u32; spec_tokens.max(longest) + 1];
        for s in steps {
            histogram[s[1] as usize] += 1;
        }
        let ratio = |a: u32, b: usize| if b == 0 { 0.0 } else { f64::from(a) / b as f64 };
        let mut v = json!({
            "mean_acceptance_length": 1.0 + ratio(accepted, steps.len()),
            "draft_acceptance_rate": ratio(accepted, drafted as usize),
            "acceptance_histogram": histogram,
            "num_spec_steps": steps.len(),
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": drafted,
            "num_spec_tokens": spec_tokens,
        });
        if self == Self::Detailed {
            v["per_step_accepted"] = steps.iter().map(|s| s[1]).collect();
            v["per_step_drafted"] = steps.iter().map(|s| s[0]).collect();
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Stats;

    fn outcome(steps: &[[u32; 2]]) -> Outcome {
        Outcome {
            text: String::new(),
            token_ids: Vec::new(),
            finish_reason: tandem_runtime::FinishReason::Length,
            stats: Stats {
                steps: steps.to_vec(),
                ..Stats::default()
            },
            logprobs: Vec::new(),
        }
    }

    #[test]
    fn the_fields_are_vllms_and_add_up() {
        let o = outcome(&[[3, 0], [3, 3], [2, 1], [4, 4]]);
        assert_eq!(SpecMetrics::None.metrics(4, &[&o]), None);
        let m = SpecMetrics::Summary.metrics(4, &[&o]).expect("asked for");
        let s = &m["speculative_decoding"];
        assert_eq!(s["num_spec_steps"], 4);
        assert_eq!(s["num_draft_tokens"], 12);
        assert_eq!(s["num_accepted_draft_tokens"], 8);
        assert_eq!(s["num_spec_tokens"], 4);
        assert_eq!(s["acceptance_histogram"], json!([1, 1, 0, 1, 1]));
        assert_eq!(s["mean_acceptance_length"], 3.0);
        assert!(
            (s["draft_acceptance_rate"].as_f64().expect("a number") - 8.0 / 12.0).abs() < 1e-12
        );
        assert!(s.get("per_step_accepted").is_none());
        let d = SpecMetrics::Detailed.metrics(4, &[&o]).expect("asked for");
        let d = &d["speculative_decoding"];
        assert_eq!(d["per_step_accepted"], json!([0, 3, 1, 4]));
        assert_eq!(d["per_step_drafted"], json!([3, 3, 2, 4]));
    }

    #[test]
    fn nothing_drafted_gives_zero_steps_and_several_choices_give_null() {
        let o = outcome(&[]);
        let m = SpecMetrics::Summary.metrics(2, &[&o]).expect("asked for");
        let s = &m["speculative_decoding"];
        assert_eq!(s["acceptance_histogram"], json!([0, 0, 0]));
        assert_eq!(s["mean_acceptance_length"], 1.0);
        assert_eq!(s["draft_acceptance_rate"], 0.0);
        let m = SpecMetrics::Summary
            .metrics(2, &[&o, &o])
            .expect("asked for");
        assert_eq!(m, json!({ "speculative_decoding": null }));
    }
}
