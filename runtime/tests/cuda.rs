//! The CUDA path is batch-invariant (issue 26): a position's logits are bit-identical whether
//! it ran alone (a decode step), in a verify block, in a tree, past a 64-row tile or beside other
//! sessions' rows, in f32, bf16 and f16 and from a GGUF file; so greedy speculative decoding with
//! a CUDA target equals target-only decoding token for token. Needs the `cuda` feature and a GPU:
//!   cargo test -p tandem-runtime --features cuda --test cuda   (scripts/build-cuda.sh builds it)
#![cfg(feature = "cuda")]

mod common;

use std::path::Path;

use candle_core::{DType, Device};
use common::*;
use tandem_runtime::model::Architecture;
use tandem_runtime::quantize::QuantType;
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};
use tandem_runtime::{
    GenerateRequest, KvCache, LoadOptions, Logits, Model, SamplingParams, SpeculativeGenerator,
};

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device (run on a machine with a GPU)")
}

fn on_gpu(path: &Path, dtype: Option<DType>) -> Model {
    let options = LoadOptions {
        device: gpu(),
        dtype,
        ..Default::default()
    };
    Model::load(path, &options).expect("load on the GPU")
}

/// A random model of a real model's attention shape (Qwen2: 128-wide heads, six query heads to a
/// key head, q/k/v biases), or Gemma 3's (windowed layers), small enough for a test.
fn shaped(architecture: Architecture, seed: u64) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-cuda-{architecture:?}-{seed}"));
    if !dir.exists() {
        let spec = SyntheticSpec {
            hidden_size: 768,
            intermediate_size: 1024,
            num_layers: 3,
            num_heads: 6,
            num_kv_heads: 1,
            head_dim: Some(128),
            architecture,
            sliding_window: 8,
            ..SyntheticSpec::tiny(seed)
        };
        write_random_llama(&dir, &spec, &stories_dir()).expect("write a random model");
    }
    dir
}

/// Every model the checks run on: the story model in f32, bf16 and f16, its Q8_0 GGUF file, and
/// random models of Qwen2's and Gemma 3's shapes in bf16.
fn models() -> Vec<(String, Model)> {
    let mut models = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        models.push((
            format!("stories {dtype:?}"),
            on_gpu(&stories_dir(), Some(dtype)),
        ));
    }
    models.push((
        "stories Q8_0 GGUF".into(),
        on_gpu(&stories_gguf(QuantType::Q8_0), None),
    ));
    for architecture in [Architecture::Qwen2, Architecture::Gemma3] {
        models.push((
            format!("{architecture:?} shape"),
            on_gpu(&shaped(architecture, 3), None),
        ));
    }
    models
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Logits of each of `tokens` fed one at a time after `prefix`.
fn singles(model: &Model, prefix: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    model
        .forward(prefix, &mut cache, Logits::Last)
        .expect("prefix");
    steps(model, &mut cache, tokens)
}

/// Logits of each of `tokens` fed one at a time after what `cache` holds.
fn steps(model: &Model, cache: &mut KvCache, tokens: &[u32]) -> Vec<Vec<f32>> {
    tokens
        .iter()
        .map(|&t| {
            model
                .forward(&[t], cache, Logits::Last)
                .expect("step")
                .remove(0)
        })
        .collect()
}

#[test]
fn a_block_row_equals_the_decode_step_bit_for_bit() {
    let story = story_tokens();
    for (what, model) in models() {
        assert_block_equals_singles(&model, &what);
        // 100 positions in one block cross a 64-row tile; each equals its decode step.
        let long: Vec<u32> = story.iter().copied().cycle().take(101).collect();
        let block = fresh_logits(&model, &long);
        let steps = singles(&model, &long[..1], &long[1..]);
        for (i, (row, step)) in block[1..].iter().zip(&steps).enumerate() {
            assert!(
                same_bits(row, step),
                "{what}: position {}: max |Δlogit| = {}",
                i + 1,
                max_diff(row, step)
            );
        }
    }
}

#[test]
fn rows_batched_with_other_sessions_equal_their_lone_forward() {
    let story = story_tokens();
    for (what, model) in models() {
        // Three sessions at different lengths, feeding 1, 5 and 9 positions in one forward.
        let starts = [(12, 1), (30, 5), (7, 9)];
        let mut caches: Vec<KvCache> = starts
            .iter()
            .map(|&(len, _)| {
                let mut cache = model.new_cache();
                model
                    .forward(&story[..len], &mut cache, Logits::Last)
                    .expect("prefix");
                cache
            })
            .collect();
        let mut items: Vec<(&[u32], &mut KvCache, Logits)> = starts
            .iter()
            .zip(caches.iter_mut())
            .map(|(&(len, n), cache)| (&story[len..len + n], cache, Logits::All))
            .collect();
        let batched = model.forward_batch(&mut items).expect("batch");
        for (&(len, n), rows) in starts.iter().zip(&batched) {
            let alone = singles(&model, &story[..len], &story[len..len + n]);
            for (i, (row, want)) in rows.iter().zip(&alone).enumerate() {
                assert!(same_bits(row, want), "{what}: session at {len}, row {i}");
            }
        }
    }
}

/// A tree fed in two passes (as a draft grows one, the second pass's rows under rows the first
/// fed): each row gets its path's logits, and keeping the story's path leaves the cache as if that
/// path had been decoded step by step.
#[test]
fn each_row_of_a_tree_gets_its_paths_logits_and_one_path_is_kept() {
    let story = story_tokens();
    let (prefix, next) = (&story[..20], &story[20..30]);
    for (what, model) in models() {
        if what.starts_with("Gemma3") {
            continue; // windowed models verify chains only
        }
        let tokens = [next[0], next[1], 77, next[2], 91, 120, next[3]];
        let parents = [None, Some(0), Some(0), Some(1), Some(1), Some(2), Some(3)];
        let mut cache = model.new_cache();
        model
            .forward(prefix, &mut cache, Logits::Last)
            .expect("prefix");
        let mut tree = model
            .forward_tree(&tokens[..3], &parents[..3], &mut cache)
            .expect("pass one");
        tree.extend(
            model
                .forward_tree(&tokens[3..], &parents, &mut cache)
                .expect("pass two"),
        );
        for (i, row) in tree.iter().enumerate() {
            let mut path = vec![i];
            while let Some(p) = parents[*path.last().expect("a row")] {
                path.push(p);
            }
            let fed: Vec<u32> = path.iter().rev().map(|&r| tokens[r]).collect();
            let want = singles(&model, prefix, &fed);
            let want = want.last().expect("a step");
            assert!(same_bits(row, want), "{what}: tree row {i}: {fed:?}");
        }
        cache.keep_rows(20, &[0, 1, 3, 6]).expect("keep the path");
        let on = steps(&model, &mut cache, &next[4..]);
        let want = singles(&model, &story[..24], &next[4..]);
        for (i, (got, want)) in on.iter().zip(&want).enumerate() {
            assert!(
                same_bits(got, want),
                "{what}: step {i} after keeping the path"
            );
        }
    }
}

#[test]
fn greedy_speculation_with_a_cuda_target_equals_target_only() {
    let tok = tokenizer();
    let draft = load(&stories_gguf(QuantType::Q8_0)); // on the CPU, as a draft-node's
    let random_draft = load(&tiny_random(12));
    for (what, target) in models() {
        if what.contains("shape") {
            continue; // random models of their own vocabulary order: no draft to pair
        }
        for prompt in ["Once upon a time", "Tom and Sue went"] {
            let run = |draft: Option<&Model>, k: usize| {
                let req = GenerateRequest {
                    prompt: tok.encode(prompt).expect("encode"),
                    max_new_tokens: 80,
                    sampling: SamplingParams::greedy(),
                    draft_tokens: k,
                    stop_token_ids: vec![],
                    stop_strings: vec![],
                };
                SpeculativeGenerator::new(&target, draft, &tok)
                    .expect("generator")
                    .generate(&req, |_| {})
                    .expect("generate")
            };
            let alone = run(None, 0);
            for (draft, k) in [(&draft, 1), (&draft, 4), (&draft, 8), (&random_draft, 4)] {
                let spec = run(Some(draft), k);
                assert_eq!(
                    spec.token_ids, alone.token_ids,
                    "{what}, K = {k}, {prompt:?}"
                );
                assert_eq!(spec.stats.accepted + spec.stats.rounds, 80);
            }
        }
    }
}
