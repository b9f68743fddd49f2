//! The MLP's gated activation on the CPU, `act(gate) · up` in one pass: SiLU (SwiGLU) and GELU's
//! tanh approximation (GeGLU), both as `x / (1 + e^(−z))` with an exponential the compiler
//! vectorizes (AVX2 where the CPU has it). candle's ops call the C library's `expf` / `tanhf`
//! once per element, on one thread while the pool's other threads wait: 10 % of a Gemma 3 decode
//! step on two cores.
//!
//! An element's result depends on its value alone, by the same operations in the vector body
//! and in the tail (no fused multiply-adds that one of them could contract differently), so a
//! row's activations are the same whatever rows run with it (batch invariance).

use candle_core::{DType, Device, Tensor};

use super::rows::Path;
use crate::Result;

/// The gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// x · σ(x).
    Silu,
    /// x · σ(2 · √(2/π) · (x + 0.044715 x³)) = ½ x (1 + tanh(√(2/π) (x + 0.044715 x³))).
    GeluTanh,
}

/// `act(gate) · up`, elementwise: f32 on the CPU here, candle's ops elsewhere.
pub(crate) fn gated(gate: &Tensor, up: &Tensor, act: Gate) -> Result<Tensor> {
    if !matches!(gate.device(), Device::Cpu) || gate.dtype() != DType::F32 {
        let gate = match act {
            Gate::Silu => gate.silu()?,
            // candle's `gelu` is the tanh approximation.
            Gate::GeluTanh => gate.gelu()?,
        };
        return Ok((gate * up)?);
    }
    if gate.shape() != up.shape() {
        let msg = format!("gate {:?} and up {:?} differ", gate.shape(), up.shape());
        return Err(candle_core::Error::Msg(msg).into());
    }
    let mut out = gate.flatten_all()?.to_vec1::<f32>()?;
    let up_values = up.flatten_all()?.to_vec1::<f32>()?;
    apply(&mut out, &up_values, act);
    Ok(Tensor::from_vec(out, gate.dims(), gate.device())?)
}

/// `g[i] = act(g[i]) · up[i]`, on the fastest path this CPU runs.
#[allow(
    unsafe_code,
    reason = "calls the AVX2 build of the loop once the CPU is checked"
)]
fn apply(g: &mut [f32], up: &[f32], act: Gate) {
    #[cfg(target_arch = "x86_64")]
    if Path::detect() >= Path::Avx2 {
        // SAFETY: `Path::detect` found AVX2 and FMA on this CPU.
        unsafe { apply_avx2(g, up, act) };
        return;
    }
    apply_portable(g, up, act);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn apply_avx2(g: &mut [f32], up: &[f32], act: Gate) {
    apply_portable(g, up, act);
}

#[inline(always)]
fn apply_portable(g: &mut [f32], up: &[f32], act: Gate) {
    match act {
        Gate::Silu => {
            for (x, u) in g.iter_mut().zip(up) {
                *x = *x / (1.0 + exp(-*x)) * u;
            }
        }
        Gate::GeluTanh => {
            const K: f32 = 2.0 * 0.797_884_6; // 2 · √(2/π)
            for (x, u) in g.iter_mut().zip(up) {
                let z = K * (*x + 0.044_715 * *x * *x * *x);
                *x = *x / (1.0 + exp(-z)) * u;
            }
        }
    }
}

/// Σ e^(x − max) over `xs` (a softmax's denominator, `max` their largest), on the fastest path
/// this CPU runs: the exponential below in 16 running sums, added in a fixed order (the same
/// total on every path and call). A draft's confidence at each drafted token is one of these
/// over the vocabulary: with the C library's `expf` one at a time, 8 sequences' 32,000 logits
/// took ~1.5 ms between two of the draft's passes.
#[allow(
    unsafe_code,
    reason = "calls the AVX2 build of the loop once the CPU is checked"
)]
pub(crate) fn exp_sum(xs: &[f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if Path::detect() >= Path::Avx2 {
        // SAFETY: `Path::detect` found AVX2 and FMA on this CPU.
        return unsafe { exp_sum_avx2(xs, max) };
    }
    exp_sum_portable(xs, max)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp_sum_avx2(xs: &[f32], max: f32) -> f32 {
    exp_sum_portable(xs, max)
}

#[inline(always)]
fn exp_sum_portable(xs: &[f32], max: f32) -> f32 {
    let mut sums = [0f32; 16];
    let chunks = xs.chunks_exact(16);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (sum, &x) in sums.iter_mut().zip(chunk) {
            *sum += exp(x - max);
        }
    }
    for (sum, &x) in sums.iter_mut().zip(tail) {
        *sum += exp(x - max);
    }
    sums.iter().sum()
}

/// e^x within 2 ulp for x in [−87, 88] (clamped there: a gate's activation is x or 0 beyond),
/// Cephes' `expf`: x = n ln 2 + r with |r| ≤ ln 2 / 2, e^r by a polynomial, 2^n in the exponent
/// bits. Branch-free, so the loops above vectorize.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // 2^n, n ∈ [−126, 127] (a normal number): n + 127 read from the low mantissa bits of
    // 2^23 + 127 + n (a conversion to integers would not vectorize: Rust's `as` saturates).
    let biased = (n + (8_388_608.0 + 127.0))
        .to_bits()
        .wrapping_sub(0x4b00_0000);
    er * f32::from_bits(biased << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exponential_is_within_two_ulp_of_the_c_library() {
        let mut worst = 0f64;
        for i in -870_000..=880_000 {
            let x = i as f32 * 1e-4;
            let (got, want) = (f64::from(exp(x)), f64::from(x).exp());
            worst = worst.max((got - want).abs() / want);
        }
        // An ulp of f32 is 2^-23 ≈ 1.2e-7 of the value at most.
        assert!(worst < 2.4e-7, "relative error {worst}");
    }

    #[test]
    fn the_activations_match_their_definitions_and_every_path_agrees() {
        let xs: Vec<f32> = (-2000..2000).map(|i| i as f32 * 0.01 + 0.003).collect();
        let up: Vec<f32> = xs.iter().map(|x| 1.5 - x * 0.25).collect();
        for act in [Gate::Silu, Gate::GeluTanh] {
            let mut fast = xs.clone();
            apply(&mut fast, &up, act);
            let mut portable = xs.clone();
            apply_portable(&mut portable, &up, act);
            for ((x, u), (a, b)) in xs.iter().zip(&up).zip(fast.iter().zip(&portable)) {
                assert_eq!(a.to_bits(), b.to_bits(), "{act:?} at {x}: {a} against {b}");
                let x = f64::from(*x);
                let want = match act {
                    Gate::Silu => x / (1.0 + (-x).exp()),
                    Gate::GeluTanh => {
                        let z = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3));
                        0.5 * x * (1.0 + z.tanh())
                    }
                } * f64::from(*u);
                assert!(
                    (f64::from(*a) - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "{act:?} at {x}: {a} against {want}"
                );
            }
        }
    }

    #[test]
    fn a_softmax_denominator_matches_the_reference_on_every_path() {
        // A vocabulary's logits (not a multiple of 16: a tail), their largest at 0 after `max`.
        let xs: Vec<f32> = (0..32_003)
            .map(|i| ((i * 7919) % 10_007) as f32 * 2e-3 - 12.0)
            .collect();
        let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let want: f64 = xs.iter().map(|&x| f64::from(x - max).exp()).sum();
        let got = exp_sum(&xs, max);
        assert!(
            ((f64::from(got) - want) / want).abs() < 1e-5,
            "{got} against {want}"
        );
        assert_eq!(got.to_bits(), exp_sum_portable(&xs, max).to_bits());
    }

    #[test]
    fn an_element_is_the_same_in_the_vector_body_and_in_the_tail() {
        // 19 elements: 16 in vectors, 3 in the tail; each value once in each.
        let xs: Vec<f32> = (0..19).map(|i| i as f32 * 0.37 - 3.1).collect();
        let up = vec![1.0; 19];
        for act in [Gate::Silu, Gate::GeluTanh] {
            let mut whole = xs.clone();
            apply(&mut whole, &up, act);
            for (i, x) in xs.iter().enumerate() {
                let mut alone = [*x];
                apply(&mut alone, &[1.0], act);
                assert_eq!(
                    alone[0].to_bits(),
                    whole[i].to_bits(),
                    "{act:?} element {i}"
                );
            }
        }
    }
}
