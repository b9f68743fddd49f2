//! The model families beside Llama (issue 28): each from a Hugging Face folder and from a GGUF
//! file written by `coordinator quantize`, on the batch-invariant kernels, exact under greedy
//! speculation with a draft of the same family.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use tandem_runtime::model::{Architecture, RopeScaling};
use tandem_runtime::quantize::{QuantType, quantize_to_gguf};
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};
use tandem_runtime::{GenerateRequest, Logits, Model, SamplingParams, SpeculativeGenerator};

/// Greedy speculation with `draft` equals `target` alone, 64 tokens at K = 1, 4 and 8, and the
/// draft is used.
fn assert_speculation_is_exact(target: &Model, draft: &Model) {
    let tok = tokenizer();
    let request = |k: usize| GenerateRequest {
        prompt: tok.encode("Once upon a time").expect("encode"),
        max_new_tokens: 64,
        sampling: SamplingParams::greedy(),
        draft_tokens: k,
        stop_token_ids: vec![],
        stop_strings: vec![],
    };
    let alone = SpeculativeGenerator::new(target, None, &tok)
        .expect("generator")
        .generate(&request(0), |_| {})
        .expect("target alone");
    let drafted = SpeculativeGenerator::new(target, Some(draft), &tok).expect("generator");
    for k in [1, 4, 8] {
        let out = drafted.generate(&request(k), |_| {}).expect("speculative");
        assert_eq!(out.token_ids, alone.token_ids, "K = {k}");
        assert!(out.stats.accepted > 0, "K = {k}: the draft is used");
    }
}

/// A tiny Qwen3: heads 32 wide (q is 128 wide over a hidden size of 64, as Qwen3's heads are
/// wider than hidden / heads), an RMSNorm over each head of q and k.
fn qwen3(dir: &Path, seed: u64) -> PathBuf {
    let spec = SyntheticSpec {
        head_dim: Some(32),
        architecture: Architecture::Qwen3,
        ..SyntheticSpec::tiny(seed)
    };
    let model_dir = dir.join(format!("qwen3-{seed}"));
    write_random_llama(&model_dir, &spec, &stories_dir()).expect("write");
    model_dir
}

fn gguf(dir: &Path, quant: QuantType) -> PathBuf {
    let out = dir.with_extension(format!("{quant:?}.gguf"));
    quantize_to_gguf(dir, &out, quant).expect("quantize");
    out
}

#[test]
fn qwen3_loads_from_both_forms_with_its_head_norms() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = qwen3(tmp.path(), 11);
    let dense = load(&dir);
    let c = dense.config();
    assert_eq!(c.architecture, Architecture::Qwen3);
    assert!(c.qk_norm && !c.qkv_bias && !c.o_bias);
    assert_eq!((c.head_dim, c.num_heads, c.hidden_size), (32, 4, 64));
    let file = load(&gguf(&dir, QuantType::F32));
    let g = file.config();
    assert_eq!(g.architecture, Architecture::Qwen3);
    assert!(g.qk_norm && !g.rope_interleaved, "{g:?}");
    assert_eq!(g.head_dim, 32, "the key length in the metadata");
    let tokens = story_tokens();
    let (a, b) = (fresh_logits(&dense, &tokens), fresh_logits(&file, &tokens));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(max_diff(x, y) < TOL, "position {i}: {}", max_diff(x, y));
    }
    // The head norms matter: read as a Llama (which has none), the logits change.
    set_config(&dir, "model_type", "llama".into());
    let plain = fresh_logits(&load(&dir), &tokens);
    assert!(max_diff(&plain[3], &a[3]) > 1e-3);
}

#[test]
fn qwen3_block_forwards_equal_single_token_forwards() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = qwen3(tmp.path(), 12);
    for path in [dir.clone(), gguf(&dir, QuantType::Q8_0)] {
        assert_block_equals_singles(&load(&path), &path.display().to_string());
    }
}

#[test]
fn greedy_speculation_with_a_qwen3_draft_equals_the_qwen3_target_alone() {
    let tmp = tempfile::tempdir().expect("tmp");
    let target = load(&qwen3(tmp.path(), 13));
    // A draft of the same family that mostly agrees: the target's own weights, quantized.
    let draft = load(&gguf(&tmp.path().join("qwen3-13"), QuantType::Q8_0));
    assert_speculation_is_exact(&target, &draft);
}

/// Rewrites one field of a written checkpoint's config.json.
fn set_config(dir: &Path, key: &str, value: serde_json::Value) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    config[key] = value;
    std::fs::write(&path, config.to_string()).expect("write");
}

/// YaRN (Qwen2.5 and Qwen3 long context) from config.json, carried into a GGUF file in
/// llama.cpp's keys: both forms agree, and the scaling changes the logits.
#[test]
fn yarn_scaling_loads_from_both_forms() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = qwen3(tmp.path(), 14);
    let tokens = story_tokens();
    let plain = fresh_logits(&load(&dir), &tokens);
    // An original context of 64 positions, 4× longer: the story's positions are past it.
    set_config(
        &dir,
        "rope_scaling",
        serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    );
    set_config(&dir, "max_position_embeddings", 64.into());
    let dense = load(&dir);
    assert_eq!(dense.config().max_context, 256);
    let file = load(&gguf(&dir, QuantType::F32));
    assert_eq!(file.config().rope_scaling, dense.config().rope_scaling);
    let (a, b) = (fresh_logits(&dense, &tokens), fresh_logits(&file, &tokens));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(max_diff(x, y) < TOL, "position {i}: {}", max_diff(x, y));
    }
    assert!(
        max_diff(&plain[30], &a[30]) > 1e-3,
        "YaRN changes the logits"
    );
}

/// A tiny Gemma 3: six layers, five local ones attending to the last 8 positions and a global
/// one, heads 32 wide, one kv head.
fn gemma3(dir: &Path, seed: u64) -> PathBuf {
    let model_dir = dir.join(format!("gemma3-{seed}"));
    write_random_llama(&model_dir, &gemma3_spec(seed, 512), &stories_dir()).expect("write");
    model_dir
}

/// The tiny Gemma 3's shape, for sessions of up to `max_context` positions.
fn gemma3_spec(seed: u64, max_context: usize) -> SyntheticSpec {
    SyntheticSpec {
        num_layers: 6,
        num_kv_heads: 1,
        head_dim: Some(32),
        max_context,
        architecture: Architecture::Gemma3,
        ..SyntheticSpec::tiny(seed)
    }
}

#[test]
fn gemma3_loads_from_both_forms_with_its_local_layers() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = gemma3(tmp.path(), 21);
    let dense = load(&dir);
    let c = dense.config();
    assert_eq!(c.architecture, Architecture::Gemma3);
    assert_eq!(
        c.local_layers,
        [true, true, true, true, true, false],
        "five local layers, then a global one"
    );
    assert_eq!((c.sliding_window, c.head_dim), (8, 32));
    assert!(c.qk_norm);
    // llama.cpp's form: norms stored as 1 + w, the local layers and window in its keys.
    let file = load(&gguf(&dir, QuantType::F32));
    let g = file.config();
    assert_eq!(
        (&g.local_layers, g.sliding_window, g.attention_scale),
        (&c.local_layers, 8, c.attention_scale)
    );
    let tokens = story_tokens();
    assert!(tokens.len() > 40, "the story is longer than the window");
    let (a, b) = (fresh_logits(&dense, &tokens), fresh_logits(&file, &tokens));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(max_diff(x, y) < TOL, "position {i}: {}", max_diff(x, y));
    }
    // The window matters: past it, attending to every position changes the logits; before
    // it, nothing changes.
    set_config(&dir, "sliding_window", 4096.into());
    let wide = fresh_logits(&load(&dir), &tokens);
    assert!(max_diff(&wide[5], &a[5]) < TOL);
    assert!(max_diff(&wide[30], &a[30]) > 1e-3);
}

/// Block forwards equal single-token ones bit for bit, and a rollback into the window (and past
/// it: 6 wrong tokens after 20) leaves the cache as a fresh forward's.
#[test]
fn gemma3_block_forwards_equal_single_forwards_and_roll_back() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = gemma3(tmp.path(), 22);
    for path in [dir.clone(), gguf(&dir, QuantType::Q8_0)] {
        let model = load(&path);
        assert_block_equals_singles(&model, &path.display().to_string());
        assert_truncate_then_reforward(&model);
    }
}

#[test]
fn greedy_speculation_with_a_gemma3_draft_equals_the_gemma3_target_alone() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = gemma3(tmp.path(), 23);
    let target = load(&dir);
    let draft = load(&gguf(&dir, QuantType::Q8_0));
    assert_speculation_is_exact(&target, &draft);
}

/// A tiny Phi-3 in Phi-4-mini's shape: fused qkv and gate/up projections, rope over 12 of
/// each head's 16 dimensions, LongRoPE over a context 4× the original.
fn phi3(dir: &Path, seed: u64) -> PathBuf {
    let spec = SyntheticSpec {
        architecture: Architecture::Phi3,
        ..SyntheticSpec::tiny(seed)
    };
    let model_dir = dir.join(format!("phi3-{seed}"));
    write_random_llama(&model_dir, &spec, &stories_dir()).expect("write");
    model_dir
}

#[test]
fn phi3_loads_from_both_forms_with_fused_layers_partial_rope_and_longrope() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = phi3(tmp.path(), 31);
    let dense = load(&dir);
    let c = dense.config();
    assert_eq!(c.architecture, Architecture::Phi3);
    assert_eq!((c.head_dim, c.rotary_dim), (16, 12));
    let RopeScaling::LongRope {
        long,
        original,
        attention_factor,
        ..
    } = &c.rope_scaling
    else {
        panic!("LongRoPE: {:?}", c.rope_scaling)
    };
    assert_eq!((long.len(), *original), (6, 128));
    assert!((attention_factor - (1.0 + 4f64.ln() / 128f64.ln()).sqrt()).abs() < 1e-12);
    let file = load(&gguf(&dir, QuantType::F32));
    let g = file.config();
    assert_eq!((g.head_dim, g.rotary_dim), (16, 12));
    assert!(
        matches!(&g.rope_scaling, RopeScaling::LongRope { long: l, original: 128, attention_factor: a, .. }
            if l == long && (a - attention_factor).abs() < 1e-6),
        "{:?}",
        g.rope_scaling
    );
    let tokens = story_tokens();
    let (a, b) = (fresh_logits(&dense, &tokens), fresh_logits(&file, &tokens));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(max_diff(x, y) < TOL, "position {i}: {}", max_diff(x, y));
    }
    // Turning every dimension instead changes the logits.
    set_config(&dir, "partial_rotary_factor", 1.0.into());
    set_config(&dir, "rope_scaling", serde_json::Value::Null);
    let whole = fresh_logits(&load(&dir), &tokens);
    assert!(max_diff(&whole[10], &a[10]) > 1e-3);
}

#[test]
fn phi3_block_forwards_equal_single_forwards_and_speculation_is_exact() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = phi3(tmp.path(), 32);
    let target = load(&dir);
    let draft = load(&gguf(&dir, QuantType::Q8_0));
    for model in [&target, &draft] {
        assert_block_equals_singles(model, "phi3");
        assert_truncate_then_reforward(model);
    }
    assert_speculation_is_exact(&target, &draft);
}

/// A Gemma 3 session far longer than its window: the local layers keep the window and a slack
/// for rollbacks (their memory stops growing), every row still equals a one-block forward's bit
/// for bit, a rollback within the slack re-runs exactly, and one past it is refused.
#[test]
fn gemma3_local_layers_keep_their_window_and_stay_exact() {
    let tmp = tempfile::tempdir().expect("tmp");
    let spec = gemma3_spec(24, 2048);
    let dir = tmp.path().join("gemma3-long");
    write_random_llama(&dir, &spec, &stories_dir()).expect("write");
    let model = load(&dir);
    let story = story_tokens();
    let tokens: Vec<u32> = story.iter().copied().cycle().take(1200).collect();
    // One block: every position held, the window applied by the attention alone.
    let reference = fresh_logits(&model, &tokens);
    let mut cache = model.new_cache();
    let step = |cache: &mut tandem_runtime::KvCache, t: u32| {
        model
            .forward(&[t], cache, Logits::Last)
            .expect("forward")
            .remove(0)
    };
    for (i, &t) in tokens.iter().enumerate() {
        assert_eq!(step(&mut cache, t), reference[i], "position {i}");
    }
    // Per layer and position; the global layer holds every position (its storage doubled to
    // 2048), each local one at most twice its window and slack.
    let per_layer = model.new_cache().bytes_per_position() / 6;
    let local = 2 * (8 - 1 + tandem_runtime::kv_cache::WINDOW_SLACK);
    assert!(cache.base() > 0, "the local layers dropped old positions");
    assert!(
        cache.bytes() <= per_layer * (2048 + 5 * local),
        "{} bytes held, {} at most",
        cache.bytes(),
        per_layer * (2048 + 5 * local)
    );
    assert_eq!(
        model.new_cache().bytes_for(tokens.len()),
        per_layer * (tokens.len() + 5 * local),
        "admission counts what each layer holds"
    );
    // A rollback of 200 positions (within the slack) and the same tokens again.
    let back = tokens.len() - 200;
    cache.truncate(back).expect("within the slack");
    for (i, &t) in tokens.iter().enumerate().skip(back) {
        assert_eq!(
            step(&mut cache, t),
            reference[i],
            "position {i} after the rollback"
        );
    }
    // Past the slack: the local layers no longer hold what the rows would see.
    let e = cache.truncate(cache.base()).expect_err("past the window");
    assert!(e.to_string().contains("sliding-window layers"), "{e}");
}

/// In half precision the attention runs on candle's ops with a mask (as on a GPU): the local
/// layers' mask must follow the window, also once the cache has dropped old positions (its
/// keys then start at the cache's base). Each row of a long f16 session tracks the f32 one far
/// closer than the f32 model without windows does.
#[test]
fn gemma3_half_precision_masks_follow_the_window() {
    let tmp = tempfile::tempdir().expect("tmp");
    let spec = gemma3_spec(25, 2048);
    let dir = tmp.path().join("gemma3-f16");
    write_random_llama(&dir, &spec, &stories_dir()).expect("write");
    let tokens: Vec<u32> = story_tokens().into_iter().cycle().take(700).collect();
    let steps = |model: &Model| -> Vec<Vec<f32>> {
        let mut cache = model.new_cache();
        let rows = tokens
            .iter()
            .map(|&t| {
                model
                    .forward(&[t], &mut cache, Logits::Last)
                    .expect("forward")
                    .remove(0)
            })
            .collect();
        assert!(cache.base() > 0, "the local layers dropped old positions");
        rows
    };
    let f32_rows = steps(&load(&dir));
    let half = tandem_runtime::LoadOptions {
        dtype: Some(candle_core::DType::F16),
        ..Default::default()
    };
    let f16_rows = steps(&Model::load(&dir, &half).expect("f16"));
    set_config(&dir, "sliding_window", 4096.into());
    let unwindowed = fresh_logits(&load(&dir), &tokens);
    for i in [20, 300, 699] {
        let (noise, window) = (
            max_diff(&f16_rows[i], &f32_rows[i]),
            max_diff(&unwindowed[i], &f32_rows[i]),
        );
        assert!(
            noise * 4.0 < window,
            "position {i}: f16 is {noise} from f32, the unwindowed model {window}"
        );
    }
}
