//! CPU kernels of a forward pass whose result for one row never depends on how many rows run
//! with it (batch invariance). Greedy speculative decoding equals target-only decoding token for
//! token only if a position's logits are bit-identical whether it was computed alone (a decode
//! step), in a verify block of K + 1, or in a replayed prefill: a real model has near-ties that
//! the different summation orders of a one-row and a many-row kernel flip (measured on the
//! Qwen2.5-Coder 1.5B Q4_K_M target with candle's own kernels: logits 0.5 apart and a different
//! greedy text after 20 tokens).
//!
//! - `Matmul`: each output is the weight row's product with the activation row (quantized once
//!   per row to 8 bits for the quantized types, as llama.cpp does), by the same operations for
//!   one row and for many; the weights are read once per call. Which code runs is chosen per
//!   weight when the model loads, and nothing outside this module knows: `panels` (x86-64 with
//!   AVX2: weights repacked into panels of outputs, an outer-product tile of panels × rows in
//!   registers, so a verify block costs the decode step's memory traffic plus its arithmetic;
//!   f32 and the blocks of 32, in `x86_panels`), the K-quants (Q4_K, Q5_K, Q6_K; `kquants`'
//!   layouts) in panels too (`kpanels`, `x86_kpanels`) — on AVX-512 CPUs as well, where the
//!   panels ran a decode step two to three times as fast as the AVX-512 kernels that decoded
//!   each block once per output row (removed),
//!   on AVX-512 the dense panels' tiles in 16-lane registers (`x86_dense512`), the blocks of
//!   32 in panels of 16 outputs multiplied by VNNI's `vpdpbusd` (`x86_vnni`) and the K-quants'
//!   panels' products by `vpdpbusd` too (`x86_kvnni`), each the AVX2 panels' bits,
//!   candle's repacked kernel for Q8_0 (with AVX-VNNI only) and Q4_K (without AVX2) where
//!   candle repacks the shape,
//!   portable code (`rows`) elsewhere, candle's row-by-row product for the other types.
//!   `TANDEM_MAX_CPU_ISA` ([`MAX_CPU_ISA`]) holds the choice to a path a CPU with less would
//!   take (candle's VNNI kernel too), to reproduce here what runs there.
//! - `activation`: the MLP's gated activation (SiLU, GELU-tanh) vectorized, one pass.
//! - `attention`: causal attention row by row over exactly the keys the row sees, in a fixed
//!   order, read in place from the KV cache, a row's query heads that share a kv head together
//!   (`x86_attention` on AVX2 + FMA: each key and value read from memory once for the group).
//! - `rows::on_pool`: every kernel splits its work on candle's CPU pool, the one candle's own
//!   operations use.
//!
//! On CUDA (`cuda`, the `cuda` feature) the same holds by other means: every product by a
//! weight runs in tiles of a fixed number of rows (`Matmul::Tiled`, candle's cuBLAS product,
//! quantized weights dequantized when the model loads), and attention is a kernel of our own
//! that reads each row's keys in a fixed order.

mod activation;
mod attention;
#[cfg(feature = "cuda")]
mod cuda;
mod kpanels;
mod kquants;
mod matmul;
mod panels;
mod rows;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_attention;
#[cfg(target_arch = "x86_64")]
mod x86_dense512;
#[cfg(target_arch = "x86_64")]
mod x86_kpanels;
#[cfg(target_arch = "x86_64")]
mod x86_kvnni;
#[cfg(target_arch = "x86_64")]
mod x86_panels;
#[cfg(target_arch = "x86_64")]
mod x86_vnni;

pub(crate) use activation::{Gate, exp_sum, gated};
pub(crate) use attention::{MAX_PIECES, MAX_TREE_DEPTH, Span, TreePaths, attention_cpu};
#[cfg(feature = "cuda")]
pub(crate) use cuda::{KeyTables, attention_cuda};
pub(crate) use matmul::{Matmul, tile_padding};
pub use rows::MAX_CPU_ISA;

/// The path the CPU kernels run in this process (`portable`, `avx2`, `avx512`, `avx512_vnni`;
/// at most the one [`MAX_CPU_ISA`] names), for figures and logs to say what ran.
pub fn cpu_path() -> &'static str {
    rows::Path::detect().name()
}

/// The process's CPU cores, held by one thread at a time: a forward pass on the CPU holds them
/// while it runs, so two models in one process (the local mode's draft and target, `coordinator
/// serve --target-model --draft-model`) take turns, each pass on every core through the one pool
/// ([`rows::on_pool`]), and never interleave their kernels call by call on it. Call by call, each
/// kernel of one waited on the pool's lock for a kernel of the other, and the pool's worker spun
/// between them: 8 sessions drafting 4 tokens a round (110M-shape f32 target, its Q8_0 copy as
/// the draft, 2 cores) ran 152-181 tokens/s against 174-190 pass by pass, and 8 target-only
/// sessions beside an idle draft 230-268 against 253-263 (one run, alternated;
/// docs/benchmarks/concurrency.md). A GPU pass does not take them: the draft's CPU pass runs
/// beside it.
///
/// A node's model thread holds them for a whole batch ([`Cores::hold`]), gathering its batch once
/// it has them: the sessions that came while the other model ran join it. Holds are granted in
/// the order they were asked for, and a thread that holds the cores may ask again (its passes
/// inside a batch) without waiting.
#[derive(Debug)]
pub struct Cores {
    /// Whether this hold took the cores (not a hold inside one this thread has).
    taken: bool,
    /// Held by this thread: not to be released from another.
    _thread: std::marker::PhantomData<*const ()>,
}

/// Holds of the cores asked for and granted, and when the last ended.
struct Turns {
    /// The next ticket.
    asked: u64,
    /// The ticket now served: holds that ended.
    granted: u64,
    /// When the last hold ended.
    freed: Option<std::time::Instant>,
}

static TURNS: std::sync::Mutex<Turns> = std::sync::Mutex::new(Turns {
    asked: 0,
    granted: 0,
    freed: None,
});
static TURN: std::sync::Condvar = std::sync::Condvar::new();

thread_local! {
    /// Whether this thread holds the cores.
    static HELD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn turns() -> std::sync::MutexGuard<'static, Turns> {
    TURNS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Cores {
    /// Waits for the cores, in turn, and holds them until the result is dropped; at once where
    /// this thread holds them already.
    pub fn hold() -> Self {
        let taken = !HELD.get();
        if taken {
            let mut turns = turns();
            let ticket = turns.asked;
            turns.asked += 1;
            while turns.granted != ticket {
                turns = TURN
                    .wait(turns)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            HELD.set(true);
        }
        Self {
            taken,
            _thread: std::marker::PhantomData,
        }
    }

    /// Threads that hold the cores or wait for them (for tests).
    pub fn queued() -> u64 {
        let turns = turns();
        turns.asked - turns.granted
    }

    /// Whether a thread holds or waits for the cores, how many holds have ended, and when the
    /// last did (`None`: none has).
    pub fn state() -> (bool, u64, Option<std::time::Instant>) {
        let turns = turns();
        (turns.asked != turns.granted, turns.granted, turns.freed)
    }
}

impl Drop for Cores {
    fn drop(&mut self) {
        if self.taken {
            HELD.set(false);
            let mut turns = turns();
            turns.granted += 1;
            turns.freed = Some(std::time::Instant::now());
            drop(turns);
            TURN.notify_all();
        }
    }
}

/// Gives back the calling thread's kernel scratch past what a verify block needs: called after
/// each forward, so a long prefill does not leave its buffers held for good.
pub(crate) fn trim_scratch() {
    rows::trim_scratch();
    panels::trim_scratch();
    kpanels::trim_scratch();
}

/// Bytes of the calling thread's scratch (for tests).
#[cfg(test)]
fn scratch_bytes() -> usize {
    rows::scratch_bytes() + panels::scratch_bytes()
}

/// A linear layer's weight on the kernels a model uses (for benchmarks and tools that run one
/// matmul alone).
pub struct Linear(Matmul);

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Linear")
    }
}

impl Linear {
    /// A GGUF tensor (any type), on the device it is on.
    pub fn new(weight: std::sync::Arc<candle_core::quantized::QTensor>) -> crate::Result<Self> {
        Ok(Self(Matmul::quantized(weight)?))
    }

    /// `xs` (…, in) → (…, out).
    pub fn forward(&self, xs: &candle_core::Tensor) -> crate::Result<candle_core::Tensor> {
        self.0.forward(xs)
    }
}
