//! tandem-runtime: Llama-family models over candle with a truncatable KV cache, one-pass block
//! verification, sampling and the lossless speculative acceptance rule. Model code here knows
//! nothing of gRPC.

pub mod constraint;
mod error;
pub mod generator;
pub mod kernels;
pub mod kv_cache;
pub mod model;
pub mod quantize;
pub mod sampling;
pub mod speculative;
pub mod synthetic;
pub mod token_log;
pub mod tokenizer;
pub mod transcript;

pub use constraint::{Constraint, Grammar, GrammarCompiler, LazyGrammars};
pub use error::{Error, Result};
pub use generator::{
    FinishReason, GenerateRequest, Generation, GenerationStats, RequestLimits,
    SpeculativeGenerator, default_stop_tokens,
};
pub use kv_cache::{KvCache, KvPrefix};
pub use model::{LoadOptions, Logits, Model, ModelConfig};
pub use sampling::rng::{Draws, Rng};
pub use sampling::{Distribution, SamplingParams};
pub use speculative::acceptance::{Verdict, verify};
pub use speculative::draft_check::{self, DraftRefusal, RefusalReason};
pub use speculative::{Drafter, Proposal, SequenceState, Verified, Verifier};
pub use token_log::{Prefix, TokenLog};
pub use tokenizer::Tokenizer;
pub use transcript::{Commit, Transcript};

/// Sets the CPU thread pools to the core count unless the user chose. Unset, candle re-reads
/// /proc/cpuinfo on every matmul, a 5× slowdown on small models (see docs/architecture.md). Also keeps
/// glibc's malloc to one arena (unless `MALLOC_ARENA_MAX` is set): with an arena per thread,
/// model work on threads other than `main` (the nodes' model threads) trims and page-faults its buffers
/// anew, measured at 7 % of decode speed on a 110M model. Call it first thing in `main`, before
/// any other thread exists.
pub fn init_cpu_threads() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        single_malloc_arena();
    }
    let cores = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .to_string();
    for var in ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"] {
        if std::env::var_os(var).is_none() {
            set_env(var, &cores);
        }
    }
}

/// Confines this process to the CPU it is running on, and returns it. Threads inherit it: call
/// before [`init_cpu_threads`] (which then sizes the pools to one core) and before any other
/// thread exists.
#[cfg(target_os = "linux")]
#[allow(
    unsafe_code,
    reason = "sched_getcpu and sched_setaffinity are C functions"
)]
pub fn confine_to_current_cpu() -> std::io::Result<usize> {
    // SAFETY: sched_getcpu has no arguments; a negative value is an error, read from errno.
    let cpu = usize::try_from(unsafe { libc::sched_getcpu() })
        .map_err(|_| std::io::Error::last_os_error())?;
    // SAFETY: an all-zero cpu_set_t is the empty set; CPU_SET writes inside it for any cpu
    // below CPU_SETSIZE (sched_getcpu's answer is); sched_setaffinity reads `set` for its size.
    let done = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    match done {
        0 => Ok(cpu),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// [`confine_to_current_cpu`] where there is no affinity to set.
#[cfg(not(target_os = "linux"))]
pub fn confine_to_current_cpu() -> std::io::Result<usize> {
    Err(std::io::ErrorKind::Unsupported.into())
}

#[allow(unsafe_code, reason = "std::env::set_var is unsafe in edition 2024")]
fn set_env(var: &str, value: &str) {
    // SAFETY: called at start-up before threads that read the environment exist.
    unsafe { std::env::set_var(var, value) };
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code, reason = "mallopt is a C function")]
fn single_malloc_arena() {
    // SAFETY: mallopt only changes allocator tuning; called before other threads exist.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    /// On a thread of its own (affinity is a thread's, inherited by the threads it starts).
    #[test]
    fn a_confined_thread_and_those_it_starts_see_one_cpu() {
        std::thread::spawn(|| {
            let cpu = super::confine_to_current_cpu().expect("confine");
            let seen = || {
                (
                    std::thread::available_parallelism().map(|n| n.get()).ok(),
                    // SAFETY: sched_getcpu has no arguments.
                    #[allow(unsafe_code, reason = "sched_getcpu is a C function")]
                    unsafe {
                        libc::sched_getcpu()
                    },
                )
            };
            assert_eq!(seen(), (Some(1), cpu as i32));
            let child = std::thread::spawn(seen).join().expect("child");
            assert_eq!(child, (Some(1), cpu as i32));
        })
        .join()
        .expect("confined thread");
    }
}
