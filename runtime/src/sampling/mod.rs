//! Logits → the probability distribution that sampling uses. One function,
//! [`distribution`], serves the draft (q) and the target (p), so both see the same transform:
//! repetition, presence and frequency penalties, temperature, top-k, top-p, min-p,
//! normalisation. The draws that pick a token from it are [`rng`]'s, keyed by position.

pub mod rng;

use crate::{Error, Result};

/// How tokens are chosen. A temperature below [`GREEDY_BELOW`] (0 included) is greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p; 1 disables.
    pub top_p: f32,
    /// Drop tokens below min_p × the top probability; 0 disables.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recently seen tokens; 1 disables.
    pub repetition_penalty: f32,
    /// How many of the most recent tokens the penalties look at.
    pub repeat_last_n: usize,
    pub seed: u64,
    /// Subtracted from the logit of each recently seen token (OpenAI's); 0 disables.
    pub presence_penalty: f32,
    /// Subtracted from a recently seen token's logit once per occurrence (OpenAI's); 0 disables.
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// Upper bound on temperature: above it sampling is noise.
pub const MAX_TEMPERATURE: f32 = 100.0;

/// Temperatures below this are greedy: dividing logits by them overflows f32 into infinities
/// whose softmax is undefined, and the distribution they approach is the argmax anyway.
pub const GREEDY_BELOW: f32 = 1e-5;

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Whether tokens are the argmax: temperature 0, or below [`GREEDY_BELOW`].
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW
    }

    /// Checks every field against its range, naming the first that is out of it.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..=MAX_TEMPERATURE).contains(&self.temperature) {
            return Err(Error::invalid(
                "temperature",
                self.temperature,
                format!("must be in [0, {MAX_TEMPERATURE}] (0 is greedy)"),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::invalid("top_p", self.top_p, "must be in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::invalid("min_p", self.min_p, "must be in [0, 1]"));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(Error::invalid(
                "repetition_penalty",
                self.repetition_penalty,
                "must be a positive finite number (1 disables)",
            ));
        }
        for (field, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(Error::invalid(
                    field,
                    value,
                    "must be in [-2, 2] (0 disables)",
                ));
            }
        }
        Ok(())
    }
}

/// A distribution over the vocabulary.
#[derive(Debug, Clone, PartialEq)]
pub enum Distribution {
    /// All mass on one token: what greedy decoding samples from.
    OneHot(u32),
    /// Probabilities indexed by token id, summing to 1.
    Dense(Vec<f32>),
}

impl Distribution {
    /// Probability of `token`.
    pub fn prob(&self, token: u32) -> f32 {
        match self {
            Self::OneHot(t) => f32::from(u8::from(*t == token)),
            Self::Dense(p) => p.get(token as usize).copied().unwrap_or(0.0),
        }
    }

    /// The token that the uniform draw `u` in [0, 1) picks (inverse CDF in id order). A
    /// one-hot distribution ignores `u`.
    pub fn sample(&self, u: f64) -> u32 {
        match self {
            Self::OneHot(t) => *t,
            Self::Dense(p) => sample_weights(p, u),
        }
    }

    /// The most likely token.
    pub fn argmax(&self) -> u32 {
        match self {
            Self::OneHot(t) => *t,
            Self::Dense(p) => argmax(p),
        }
    }
}

/// Index of the largest value; the first one on ties.
pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// The index that the uniform draw `u` picks with probability proportional to `weights` (which
/// need not sum to 1).
pub(crate) fn sample_weights(weights: &[f32], u: f64) -> u32 {
    let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    let mut threshold = u * total;
    let mut last_positive = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            last_positive = i;
            threshold -= f64::from(w);
            if threshold < 0.0 {
                return i as u32;
            }
        }
    }
    // Rounding left a sliver of mass: it belongs to the last token with any.
    last_positive as u32
}

/// The sampling distribution at one position: `logits` of that position after `history` (the
/// tokens before it, used by the repetition penalty; its length is the position). Logits that
/// are NaN or +∞, or all −∞, are an error naming the position: a model that produced them is
/// broken, and no token follows from them.
pub fn distribution(
    logits: &[f32],
    params: &SamplingParams,
    history: &[u32],
) -> Result<Distribution> {
    check_logits(logits, history.len())?;
    let (presence, frequency) = (params.presence_penalty, params.frequency_penalty);
    let penalized = params.repetition_penalty != 1.0 || presence != 0.0 || frequency != 0.0;
    if params.is_greedy() && !penalized {
        return Ok(Distribution::OneHot(argmax(logits)));
    }
    let mut logits = logits.to_vec();
    if penalized {
        let start = history.len().saturating_sub(params.repeat_last_n);
        let mut seen = std::collections::HashMap::<u32, u32>::new();
        for &t in &history[start..] {
            *seen.entry(t).or_default() += 1;
        }
        for (&t, &count) in &seen {
            if let Some(l) = logits.get_mut(t as usize) {
                if params.repetition_penalty != 1.0 {
                    *l = if *l > 0.0 {
                        *l / params.repetition_penalty
                    } else {
                        *l * params.repetition_penalty
                    };
                }
                *l -= presence + frequency * count as f32;
            }
        }
    }
    if params.is_greedy() {
        return Ok(Distribution::OneHot(argmax(&logits)));
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let inv_t = 1.0 / params.temperature;
    let mut probs: Vec<f32> = logits.iter().map(|&l| ((l - max) * inv_t).exp()).collect();
    normalize(&mut probs);
    let truncating = (params.top_k > 0 && params.top_k < probs.len()) || params.top_p < 1.0;
    if truncating {
        let (order, keep) = truncation(&probs, params.top_k, params.top_p);
        for &id in &order[keep..] {
            probs[id as usize] = 0.0;
        }
        normalize(&mut probs);
    }
    if params.min_p > 0.0 {
        let floor = params.min_p * probs.iter().copied().fold(0.0, f32::max);
        for p in probs.iter_mut().filter(|p| **p < floor) {
            *p = 0.0;
        }
        normalize(&mut probs);
    }
    Ok(Distribution::Dense(probs))
}

/// Most alternatives [`logprobs`] reports per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A committed token's log-probability under the model (the raw log-softmax of its logits,
/// before temperature and penalties, as vLLM reports them) and the `top` most likely tokens'.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// [`TokenLogprobs`] of `token` at the position whose logits are `logits`.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let norm = max + sum.ln() as f32;
    let at = |id: u32| {
        logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |l| l - norm)
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let top = top.min(MAX_TOP_LOGPROBS).min(ids.len());
    if top > 0 {
        let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
        ids.select_nth_unstable_by(top - 1, by_logit);
        ids.truncate(top);
        ids.sort_by(by_logit);
    }
    TokenLogprobs {
        token,
        logprob: at(token),
        top: ids[..top].iter().map(|&id| (id, at(id))).collect(),
    }
}

/// Tokens sorted first when top-p cuts the distribution: most cuts fall within them.
const FIRST_SELECTION: usize = 64;

/// The tokens top-k and top-p keep: `order` holds every id, its first `keep` the kept ones by
/// descending probability (ties by id: a total order, so draft and target agree). Only the
/// prefix the cut needs is sorted: the `top_k` likeliest, or for top-p the likeliest
/// [`FIRST_SELECTION`], then 4 times as many until they hold `top_p` of the mass (a full sort
/// of a 152k vocabulary costs more than the rest of sampling).
fn truncation(probs: &[f32], top_k: usize, top_p: f32) -> (Vec<u32>, usize) {
    let mut order: Vec<u32> = (0..probs.len() as u32).collect();
    let by_prob = |a: &u32, b: &u32| {
        probs[*b as usize]
            .total_cmp(&probs[*a as usize])
            .then(a.cmp(b))
    };
    let limit = if top_k > 0 {
        top_k.min(order.len())
    } else {
        order.len()
    };
    let mut sorted = if top_p < 1.0 {
        limit.min(FIRST_SELECTION)
    } else {
        limit
    };
    loop {
        if sorted < order.len() {
            order.select_nth_unstable_by(sorted - 1, by_prob);
        }
        order[..sorted].sort_unstable_by(by_prob);
        if top_p < 1.0 {
            let mut cumulative = 0.0f32;
            for (rank, &id) in order[..sorted].iter().enumerate() {
                cumulative += probs[id as usize];
                if cumulative >= top_p {
                    return (order, rank + 1);
                }
            }
        }
        if sorted == limit {
            return (order, limit);
        }
        sorted = (sorted * 4).min(limit);
    }
}

/// Largest support of a draft's proposal distribution, and the probability mass its tail may
/// leave out: q is sent with every drafted token, and its sparse form costs ~7 bytes a token.
pub const DRAFT_MAX_SUPPORT: usize = 256;
pub const DRAFT_TAIL_MASS: f32 = 1e-3;

/// The distribution a draft samples from and sends: `q` cut to its most likely tokens (at most
/// [`DRAFT_MAX_SUPPORT`], fewer when they hold all but [`DRAFT_TAIL_MASS`] of the mass) and
/// renormalised. Exactness needs only that the draft samples from the q it sends; a compact q
/// keeps a round's bytes small (the full q of a 152k vocabulary is 600 KB), at the cost of the
/// tail's share of acceptance.
pub fn draft_support(q: Distribution) -> Distribution {
    let Distribution::Dense(mut probs) = q else {
        return q;
    };
    let mut order: Vec<u32> = (0..probs.len() as u32)
        .filter(|&i| probs[i as usize] > 0.0)
        .collect();
    let by_prob = |a: &u32, b: &u32| {
        probs[*b as usize]
            .total_cmp(&probs[*a as usize])
            .then(a.cmp(b))
    };
    if order.len() > DRAFT_MAX_SUPPORT {
        order.select_nth_unstable_by(DRAFT_MAX_SUPPORT - 1, by_prob);
        order.truncate(DRAFT_MAX_SUPPORT);
    }
    order.sort_unstable_by(by_prob);
    let mut keep = order.len();
    let mut cumulative = 0.0f64;
    for (rank, &id) in order.iter().enumerate() {
        cumulative += f64::from(probs[id as usize]);
        if cumulative >= 1.0 - f64::from(DRAFT_TAIL_MASS) {
            keep = rank + 1;
            break;
        }
    }
    let mut kept = vec![0.0f32; probs.len()];
    for &id in &order[..keep] {
        kept[id as usize] = probs[id as usize];
    }
    probs = kept;
    normalize(&mut probs);
    Distribution::Dense(probs)
}

/// Refuses logits no distribution follows from, naming the position.
fn check_logits(logits: &[f32], position: usize) -> Result<()> {
    if let Some(&bad) = logits.iter().find(|l| l.is_nan() || **l == f32::INFINITY) {
        return Err(Error::NonFiniteLogits {
            position,
            value: bad,
        });
    }
    if logits.iter().all(|&l| l == f32::NEG_INFINITY) {
        return Err(Error::NonFiniteLogits {
            position,
            value: f32::NEG_INFINITY,
        });
    }
    Ok(())
}

/// Scales to a sum of 1, summing in f64 so that the result sums to 1 within f32 rounding even
/// over a 150k vocabulary (the target checks q's sum to 1e-3).
fn normalize(probs: &mut [f32]) {
    let sum: f64 = probs.iter().map(|&p| f64::from(p)).sum();
    if sum > 0.0 {
        let inv = 1.0 / sum;
        probs
            .iter_mut()
            .for_each(|p| *p = (f64::from(*p) * inv) as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(d: &Distribution) -> &[f32] {
        match d {
            Distribution::Dense(p) => p,
            Distribution::OneHot(_) => panic!("expected a dense distribution"),
        }
    }

    #[test]
    fn top_k_and_top_p_keep_what_a_full_sort_keeps() {
        // 5,000 tokens of a skewed distribution with ties; cuts inside the first selection, past
        // it, and at the whole vocabulary.
        let mut state = 7u64;
        let probs: Vec<f32> = (0..5000)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                let u = (state >> 40) as f32 / (1u64 << 24) as f32;
                (u * 8.0).floor().exp2() * u.powi(6)
            })
            .collect();
        let total: f32 = probs.iter().sum();
        let probs: Vec<f32> = probs.iter().map(|p| p / total).collect();
        let mut full: Vec<u32> = (0..probs.len() as u32).collect();
        full.sort_unstable_by(|&a, &b| {
            probs[b as usize]
                .total_cmp(&probs[a as usize])
                .then(a.cmp(&b))
        });
        for (top_k, top_p) in [
            (0, 0.3),
            (0, 0.9),
            (0, 0.999),
            (0, 1.0),
            (10, 1.0),
            (300, 0.95),
            (300, 1.0),
            (5000, 0.5),
        ] {
            let mut keep = if top_k > 0 { top_k } else { full.len() };
            let mut cumulative = 0.0f32;
            for (rank, &id) in full.iter().enumerate().take(keep) {
                cumulative += probs[id as usize];
                if top_p < 1.0 && cumulative >= top_p {
                    keep = rank + 1;
                    break;
                }
            }
            let (order, kept) = truncation(&probs, top_k, top_p);
            assert_eq!(kept, keep, "top_k {top_k}, top_p {top_p}");
            assert_eq!(
                &order[..kept],
                &full[..keep],
                "top_k {top_k}, top_p {top_p}"
            );
        }
    }

    #[test]
    fn greedy_is_one_hot_at_argmax() {
        let d = distribution(&[0.1, 2.0, -1.0, 2.0], &SamplingParams::greedy(), &[]).expect("ok");
        assert_eq!(d, Distribution::OneHot(1));
        assert_eq!(d.prob(1), 1.0);
        assert_eq!(d.prob(3), 0.0);
    }

    #[test]
    fn temperature_top_k_top_p_min_p() {
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let params = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let p = distribution(&logits, &params, &[]).expect("ok");
        let expected: Vec<f32> = {
            let e: Vec<f32> = logits.iter().map(|l| (l - 3.0f32).exp()).collect();
            let s: f32 = e.iter().sum();
            e.iter().map(|x| x / s).collect()
        };
        for (a, b) in dense(&p).iter().zip(&expected) {
            assert!((a - b).abs() < 1e-6);
        }
        let top_k = distribution(
            &logits,
            &SamplingParams {
                top_k: 2,
                ..params.clone()
            },
            &[],
        )
        .expect("ok");
        assert_eq!(dense(&top_k)[2], 0.0);
        assert!((dense(&top_k)[0] + dense(&top_k)[1] - 1.0).abs() < 1e-6);
        // p = [0.644, 0.237, 0.087, 0.032]: top_p 0.8 keeps the first two.
        let top_p = distribution(
            &logits,
            &SamplingParams {
                top_p: 0.8,
                ..params.clone()
            },
            &[],
        )
        .expect("ok");
        assert!(dense(&top_p)[1] > 0.0 && dense(&top_p)[2] == 0.0);
        // min_p 0.1 drops tokens below 0.0644: the last one.
        let min_p = distribution(
            &logits,
            &SamplingParams {
                min_p: 0.1,
                ..params.clone()
            },
            &[],
        )
        .expect("ok");
        assert!(dense(&min_p)[2] > 0.0 && dense(&min_p)[3] == 0.0);
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_the_most_likely_tokens() {
        let got = logprobs(&[1.0, 3.0, 2.0, 0.0], 2, 2);
        let norm = (1f32.exp() + 3f32.exp() + 2f32.exp() + 1.0).ln();
        assert!((got.logprob - (2.0 - norm)).abs() < 1e-5, "{got:?}");
        assert_eq!(got.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
        assert!((got.top[0].1 - (3.0 - norm)).abs() < 1e-5);
        assert!(
            logprobs(&[0.0; 3], 1, 50).top.len() == 3,
            "capped at the vocabulary"
        );
        assert!(logprobs(&[0.0; 3], 1, 0).top.is_empty());
    }

    #[test]
    fn presence_and_frequency_penalties_subtract_from_seen_tokens() {
        let params = SamplingParams {
            temperature: 1.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        };
        // Token 0 seen twice: 1.0 - 0.5 - 2 × 0.25 = 0; token 1 once: 0.5 - 0.75 = -0.25.
        let got = distribution(&[1.0, 0.5, 0.0], &params, &[0, 1, 0]).expect("ok");
        let got = dense(&got);
        let want = {
            let e = [0.0f32.exp(), (-0.25f32).exp(), 0.0f32.exp()];
            let sum: f32 = e.iter().sum();
            e.map(|x| x / sum)
        };
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        // Outside the last `repeat_last_n` tokens, a token is not penalised.
        let window = SamplingParams {
            repeat_last_n: 1,
            ..params.clone()
        };
        let far = distribution(&[1.0, 0.5, 0.0], &window, &[0, 2]).expect("ok");
        let far = dense(&far);
        assert!(far[0] > far[1], "{far:?}");
        for bad in [2.5, -3.0, f32::NAN] {
            let e = SamplingParams {
                frequency_penalty: bad,
                ..params.clone()
            }
            .validate()
            .expect_err("out of range");
            assert!(e.to_string().contains("frequency_penalty"), "{e}");
        }
    }

    #[test]
    fn repetition_penalty_lowers_seen_tokens() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        // Token 0 (logit 2) was seen: 2 / 2 = 1 < 1.5, so greedy moves to token 1.
        assert_eq!(
            distribution(&[2.0, 1.5], &params, &[0]).expect("ok"),
            Distribution::OneHot(1)
        );
        assert_eq!(
            distribution(&[2.0, 1.5], &params, &[]).expect("ok"),
            Distribution::OneHot(0)
        );
    }

    #[test]
    fn tiny_temperatures_are_greedy_and_broken_logits_name_their_position() {
        let tiny = SamplingParams {
            temperature: 1e-6,
            ..Default::default()
        };
        assert!(tiny.is_greedy());
        assert_eq!(
            distribution(&[0.0, 3.0, 1.0], &tiny, &[]).expect("ok"),
            Distribution::OneHot(1)
        );
        let sampled = SamplingParams {
            temperature: 0.7,
            ..Default::default()
        };
        for params in [&SamplingParams::greedy(), &sampled] {
            for (logits, value) in [
                (vec![1.0, f32::NAN, 0.0], "NaN"),
                (vec![f32::INFINITY, 0.0, 0.0], "inf"),
                (vec![f32::NEG_INFINITY; 3], "-inf"),
            ] {
                let err = distribution(&logits, params, &[1, 2, 3, 4, 5])
                    .expect_err("no token follows")
                    .to_string();
                assert!(err.contains("position 5") && err.contains(value), "{err}");
            }
        }
        // Masked tokens (−∞) among finite logits are fine.
        let masked = [f32::NEG_INFINITY, 1.0, 0.5];
        assert_eq!(
            dense(&distribution(&masked, &sampled, &[]).expect("ok"))[0],
            0.0
        );
    }

    #[test]
    fn validate_names_the_field() {
        let bad = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(
            bad.validate()
                .expect_err("must be refused")
                .to_string()
                .contains("temperature")
        );
        let bad = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(
            bad.validate()
                .expect_err("must be refused")
                .to_string()
                .contains("top_p")
        );
        let bad = SamplingParams {
            min_p: 2.0,
            ..Default::default()
        };
        assert!(
            bad.validate()
                .expect_err("must be refused")
                .to_string()
                .contains("min_p")
        );
        assert!(SamplingParams::default().validate().is_ok());
    }

    #[test]
    fn a_drafts_support_is_its_likeliest_tokens_up_to_a_cap_or_all_but_the_tail() {
        // Flat over 1000 tokens: the cap keeps 256, equally likely, summing to 1.
        let Distribution::Dense(flat) = draft_support(Distribution::Dense(vec![1e-3; 1000])) else {
            panic!("dense")
        };
        let kept: Vec<f32> = flat.iter().copied().filter(|&p| p > 0.0).collect();
        assert_eq!(kept.len(), DRAFT_MAX_SUPPORT);
        assert!((kept.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        // Ties go to the lower ids, as in top-k.
        assert!(flat[..DRAFT_MAX_SUPPORT].iter().all(|&p| p > 0.0));
        // Peaked: tokens beyond 1 - 1e-3 of the mass are cut.
        let mut peaked = vec![0.0f32; 10];
        peaked[3] = 0.9;
        peaked[7] = 0.0995;
        peaked[1] = 0.0005;
        let Distribution::Dense(cut) = draft_support(Distribution::Dense(peaked)) else {
            panic!("dense")
        };
        assert_eq!(cut[1], 0.0);
        assert!((cut[3] - 0.9 / 0.9995).abs() < 1e-6);
        assert_eq!(
            draft_support(Distribution::OneHot(5)),
            Distribution::OneHot(5)
        );
    }
}
