//! Forward-pass anchors: the reference story, cache truncation, block forwards, GGUF parity.

mod common;

use common::*;
use tandem_runtime::quantize::QuantType;
use tandem_runtime::{
    GenerateRequest, Logits, SamplingParams, SpeculativeGenerator, default_stop_tokens,
};

fn greedy_story(model: &tandem_runtime::Model, max_new_tokens: usize) -> String {
    let tok = tokenizer();
    let generator = SpeculativeGenerator::new(model, None, &tok).expect("generator");
    let request = GenerateRequest {
        prompt: tok.encode("Once upon a time").expect("encode"),
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        draft_tokens: 0,
        stop_token_ids: default_stop_tokens(model, &tok),
        stop_strings: vec![],
    };
    let out = generator.generate(&request, |_| {}).expect("generate");
    format!("Once upon a time{}", out.text)
}

#[test]
fn stories260k_reproduces_reference_greedy_story() {
    let model = load(&stories_dir());
    let story = greedy_story(&model, 80);
    assert!(
        story.starts_with(REFERENCE_STORY),
        "got:      {story:?}\nexpected: {REFERENCE_STORY:?}"
    );
}

#[test]
fn truncate_then_reforward_equals_fresh_forward_safetensors() {
    assert_truncate_then_reforward(&load(&stories_dir()));
}

#[test]
fn truncate_then_reforward_equals_fresh_forward_gguf() {
    assert_truncate_then_reforward(&load(&stories_gguf(QuantType::Q8_0)));
}

#[test]
fn block_forward_equals_single_token_forwards() {
    for path in [stories_dir(), stories_gguf(QuantType::Q8_0), tiny_random(3)] {
        let model = load(&path);
        let tokens = story_tokens();
        assert_block_equals_singles(&model, &path.display().to_string());
        // Logits::Last is the last row of Logits::All.
        let last = model
            .forward(&tokens[..12], &mut model.new_cache(), Logits::Last)
            .expect("last");
        let all = fresh_logits(&model, &tokens[..12]);
        assert!(max_diff(&last[0], &all[11]) < TOL);
    }
}

/// A dense checkpoint loaded in f16 or bf16 on the CPU runs candle's attention, which needs the
/// causal mask the f32 kernel does not: a block's rows must track single-token forwards (close,
/// not bit-identical: candle's half-precision matmuls are not batch-invariant), not attend to the
/// positions after them.
#[test]
fn a_half_precision_cpu_model_attends_causally() {
    for dtype in [candle_core::DType::F16, candle_core::DType::BF16] {
        let options = tandem_runtime::LoadOptions {
            dtype: Some(dtype),
            ..Default::default()
        };
        let model = tandem_runtime::Model::load(&stories_dir(), &options).expect("load");
        for (i, (rows, single)) in block_and_single_rows(&model).iter().enumerate() {
            let diff = max_diff(single, rows);
            assert!(
                diff < 0.25,
                "{dtype:?} block position {i}: max |Δlogit| = {diff}"
            );
        }
    }
}

/// An f32 GGUF holds the same numbers with q/k rows permuted for interleaved rope: logits must
/// match the safetensors model, which checks the permutation and the rope variant together.
#[test]
fn f32_gguf_matches_safetensors() {
    let tokens = story_tokens();
    let dense = fresh_logits(&load(&stories_dir()), &tokens);
    let gguf = fresh_logits(&load(&stories_gguf(QuantType::F32)), &tokens);
    for (i, (a, b)) in dense.iter().zip(&gguf).enumerate() {
        let d = max_diff(a, b);
        assert!(d < TOL, "position {i}: max |Δlogit| = {d}");
    }
}

/// Fraction of positions where two models pick the same top token.
fn top1_agreement(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let same = a
        .iter()
        .zip(b)
        .filter(|(x, y)| tandem_runtime::sampling::argmax(x) == tandem_runtime::sampling::argmax(y))
        .count();
    same as f64 / a.len() as f64
}

/// A random model with rows of 256 and 512 (stories260K's 64 and 172 do not split into 256-wide
/// K-quant blocks), written under `dir`.
fn wide_model(dir: &std::path::Path, num_layers: usize, embed_std: f32) -> std::path::PathBuf {
    let spec = tandem_runtime::synthetic::SyntheticSpec {
        hidden_size: 256,
        intermediate_size: 512,
        num_layers,
        num_heads: 4,
        num_kv_heads: 2,
        embed_std,
        ..tandem_runtime::synthetic::SyntheticSpec::tiny(5)
    };
    let model_dir = dir.join("wide");
    tandem_runtime::synthetic::write_random_llama(&model_dir, &spec, &stories_dir())
        .expect("write");
    model_dir
}

#[test]
fn quantized_ggufs_load_and_track_the_f32_model() {
    let tokens = story_tokens();
    let dense = fresh_logits(&load(&stories_dir()), &tokens);
    for (quant, min_agreement) in [(QuantType::Q8_0, 0.95), (QuantType::Q4_0, 0.6)] {
        let q = fresh_logits(&load(&stories_gguf(quant)), &tokens);
        let agreement = top1_agreement(&dense, &q);
        assert!(
            agreement >= min_agreement,
            "{quant:?}: top-1 agreement {agreement}"
        );
    }
    // A wider random model exercises Q4_K / Q6_K.
    let dir = tempfile::tempdir().expect("tmp");
    let model_dir = wide_model(dir.path(), 1, 0.5);
    let gguf = dir.path().join("wide-q4km.gguf");
    let report = tandem_runtime::quantize::quantize_to_gguf(&model_dir, &gguf, QuantType::Q4KM)
        .expect("quantize");
    assert!(
        report.kept_f32.is_empty(),
        "kept f32: {:?}",
        report.kept_f32
    );
    let dense = fresh_logits(&load(&model_dir), &tokens);
    let q = fresh_logits(&load(&gguf), &tokens);
    let agreement = top1_agreement(&dense, &q);
    assert!(agreement >= 0.6, "Q4_K_M top-1 agreement {agreement}");
}

/// Every GGUF type users ship loads and runs: a model quantized to each (rows of 256 and 512, so
/// that the K-quants apply) gives bit-identical logits in a block and one token at a time, and
/// its greedy choices track the f32 model's as closely as its bits allow.
#[test]
fn every_gguf_type_loads_runs_batch_invariant_and_tracks_f32() {
    let dir = tempfile::tempdir().expect("tmp");
    let model_dir = wide_model(dir.path(), 2, 2.0);
    let tokens = story_tokens();
    let dense = fresh_logits(&load(&model_dir), &tokens);
    let mut report = Vec::new();
    for quant in QuantType::all() {
        let gguf = dir.path().join(format!("wide-{quant:?}.gguf"));
        let written =
            tandem_runtime::quantize::quantize_to_gguf(&model_dir, &gguf, quant).expect("quantize");
        assert!(
            written.kept_f32.is_empty(),
            "{quant:?}: {:?}",
            written.kept_f32
        );
        let model = load(&gguf);
        let block = fresh_logits(&model, &tokens);
        let mut cache = model.new_cache();
        for (i, &t) in tokens.iter().enumerate() {
            let single = model
                .forward(&[t], &mut cache, Logits::Last)
                .expect("single");
            assert_eq!(single[0], block[i], "{quant:?}: position {i}");
        }
        let agreement = top1_agreement(&dense, &block);
        report.push(format!("{quant:?} {agreement:.2}"));
        // Low-bit types lose more of a random model's fine distinctions.
        let floor = match quant {
            QuantType::Q2K | QuantType::Q3K => 0.5,
            QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q4K | QuantType::Q4KM => 0.7,
            _ => 0.9,
        };
        assert!(
            agreement >= floor,
            "{quant:?}: top-1 agreement {agreement} < {floor}"
        );
    }
    eprintln!("top-1 agreement with f32: {}", report.join(", "));
}

/// A GGUF with no tokenizer.json beside it gets its tokenizer from the metadata, which must
/// encode and decode exactly as the original tokenizer.json.
#[test]
fn tokenizer_rebuilt_from_gguf_metadata_matches_tokenizer_json() {
    let texts = [
        "Once upon a time, there was a little girl named Lily.",
        "The café served crème brûlée — and 3.14 apples! 日本",
        "\"Hello,\" said Tom. He ran\nto the tree.",
    ];
    let dir = tempfile::tempdir().expect("tmp");
    for (name, tokenizer_dir) in [
        ("stories", stories_dir()),
        ("llama2", fixtures().join("llama2-tokenizer")),
    ] {
        let model_dir = dir.path().join(name);
        let spec = tandem_runtime::synthetic::SyntheticSpec {
            num_layers: 1,
            ..tandem_runtime::synthetic::SyntheticSpec::tiny(1)
        };
        tandem_runtime::synthetic::write_random_llama(&model_dir, &spec, &tokenizer_dir)
            .expect("write");
        let gguf_dir = dir.path().join(format!("{name}-gguf"));
        std::fs::create_dir(&gguf_dir).expect("mkdir");
        let gguf = gguf_dir.join("model.gguf");
        let report = tandem_runtime::quantize::quantize_to_gguf(&model_dir, &gguf, QuantType::F16)
            .expect("quantize");
        assert!(report.tokenizer_in_metadata);
        let original = tandem_runtime::Tokenizer::for_model(&model_dir).expect("tokenizer.json");
        let rebuilt = tandem_runtime::Tokenizer::for_model(&gguf).expect("from metadata");
        assert_eq!(original.vocab_size(), rebuilt.vocab_size(), "{name}");
        assert_eq!(original.vocab_hash(), rebuilt.vocab_hash(), "{name}");
        for text in texts {
            let ids = original.encode(text).expect("encode");
            assert_eq!(
                rebuilt.encode(text).expect("encode"),
                ids,
                "{name}: {text:?}"
            );
            assert_eq!(
                rebuilt.decode(&ids).expect("decode"),
                original.decode(&ids).expect("decode")
            );
        }
        tandem_runtime::Tokenizer::check_compatible(&rebuilt, &original).expect("compatible");
    }
}

#[test]
fn kv_cache_reports_length_and_bytes_and_grows_by_doubling() {
    let model = load(&stories_dir());
    let mut cache = model.new_cache();
    assert_eq!((cache.len(), cache.bytes()), (0, 0));
    model
        .forward(&story_tokens()[..5], &mut cache, Logits::Last)
        .expect("forward");
    let cfg = model.config();
    let per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4;
    assert_eq!(cache.len(), 5);
    assert_eq!(
        cache.bytes(),
        64 * per_position,
        "first allocation holds 64 positions"
    );
    let tokens: Vec<u32> = std::iter::repeat_n(story_tokens(), 3)
        .flatten()
        .take(70)
        .collect();
    model
        .forward(&tokens, &mut cache, Logits::Last)
        .expect("forward");
    assert_eq!(cache.len(), 75);
    assert_eq!(cache.bytes(), 128 * per_position, "capacity doubles");
    cache.truncate(3).expect("truncate");
    assert_eq!((cache.len(), cache.bytes()), (3, 128 * per_position));
}

/// Qwen2 (q/k/v biases, rope in halves layout, no permutation in GGUF) through both formats.
#[test]
fn qwen2_biases_load_and_gguf_matches_safetensors() {
    let dir = tempfile::tempdir().expect("tmp");
    let model_dir = dir.path().join("qwen2");
    let spec = tandem_runtime::synthetic::SyntheticSpec {
        architecture: tandem_runtime::model::Architecture::Qwen2,
        ..tandem_runtime::synthetic::SyntheticSpec::tiny(9)
    };
    tandem_runtime::synthetic::write_random_llama(&model_dir, &spec, &stories_dir())
        .expect("write");
    let dense_model = load(&model_dir);
    assert_eq!(
        dense_model.config().architecture,
        tandem_runtime::model::Architecture::Qwen2
    );
    assert!(dense_model.config().qkv_bias && !dense_model.config().o_bias);
    let gguf = dir.path().join("qwen2.gguf");
    tandem_runtime::quantize::quantize_to_gguf(&model_dir, &gguf, QuantType::F32)
        .expect("quantize");
    let gguf_model = load(&gguf);
    assert!(!gguf_model.config().rope_interleaved && gguf_model.config().qkv_bias);
    let tokens = story_tokens();
    let (a, b) = (
        fresh_logits(&dense_model, &tokens),
        fresh_logits(&gguf_model, &tokens),
    );
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(max_diff(x, y) < TOL, "position {i}");
    }
    // The biases matter: dropping them changes the logits.
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model_dir.join("config.json")).expect("read"),
    )
    .expect("json");
    config["model_type"] = "llama".into();
    std::fs::write(model_dir.join("config.json"), config.to_string()).expect("write");
    let no_bias = fresh_logits(&load(&model_dir), &tokens);
    assert!(max_diff(&no_bias[3], &a[3]) > 1e-3);
}

/// A checkpoint split into shards listed by model.safetensors.index.json loads like one file.
#[test]
fn sharded_safetensors_load() {
    let dir = tempfile::tempdir().expect("tmp");
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(stories_dir().join(file), dir.path().join(file)).expect("copy");
    }
    let all = candle_core::safetensors::load(
        stories_dir().join("model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .expect("load");
    let (mut first, mut second) = (
        std::collections::HashMap::new(),
        std::collections::HashMap::new(),
    );
    let mut weight_map = serde_json::Map::new();
    for (name, tensor) in all {
        let shard = if name.contains("layers.0.") || name.contains("embed") {
            "model-00001-of-00002.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        weight_map.insert(name.clone(), shard.into());
        if shard.starts_with("model-00001") {
            first.insert(name, tensor)
        } else {
            second.insert(name, tensor)
        };
    }
    candle_core::safetensors::save(&first, dir.path().join("model-00001-of-00002.safetensors"))
        .expect("save");
    candle_core::safetensors::save(&second, dir.path().join("model-00002-of-00002.safetensors"))
        .expect("save");
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .expect("write");
    let tokens = story_tokens();
    let (a, b) = (
        fresh_logits(&load(&stories_dir()), &tokens),
        fresh_logits(&load(dir.path()), &tokens),
    );
    assert_eq!(a, b);
    // The weights on disk are the shards', not the other files'.
    let size = |path: std::path::PathBuf| std::fs::metadata(path).expect("size").len();
    let shards = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    assert_eq!(
        tandem_runtime::model::weight_bytes(dir.path()).expect("bytes"),
        shards.iter().map(|s| size(dir.path().join(s))).sum::<u64>()
    );
    assert_eq!(
        tandem_runtime::model::weight_bytes(&stories_dir()).expect("bytes"),
        size(stories_dir().join("model.safetensors"))
    );
    std::fs::remove_file(dir.path().join(shards[1])).expect("rm");
    assert!(tandem_runtime::model::weight_bytes(dir.path()).is_err());
    let e =
        tandem_runtime::Model::load(dir.path(), &Default::default()).expect_err("missing shard");
    assert!(
        e.to_string().contains("model-00002-of-00002.safetensors"),
        "{e}"
    );
}

#[test]
fn a_model_with_some_tokens_logits_gives_those_tokens_the_whole_models_bits() {
    let kept: Vec<u32> = (0..300).chain([400, 511]).collect();
    let tokens = story_tokens();
    for path in [
        stories_dir(),
        fixtures().join("llama-cpp/stories260K-q8_0.gguf"),
        fixtures().join("llama-cpp/qwen2-q4_k_m.gguf"),
        stories_gguf(QuantType::Q4_0),
    ] {
        let options = tandem_runtime::LoadOptions {
            logit_ids: Some(kept.clone()),
            ..Default::default()
        };
        let some = tandem_runtime::Model::load(&path, &options).expect("load");
        let (full, some) = (
            fresh_logits(&load(&path), &tokens),
            fresh_logits(&some, &tokens),
        );
        for (all, row) in full.iter().zip(&some) {
            for (id, (&a, &s)) in all.iter().zip(row).enumerate() {
                if kept.contains(&(id as u32)) {
                    assert_eq!(a.to_bits(), s.to_bits(), "{}: token {id}", path.display());
                } else {
                    assert_eq!(s, f32::NEG_INFINITY, "{}: token {id}", path.display());
                }
            }
        }
    }
    let options = tandem_runtime::LoadOptions {
        logit_ids: Some(vec![3, 512]),
        ..Default::default()
    };
    let err = tandem_runtime::Model::load(&stories_dir(), &options).expect_err("id 512");
    assert!(
        err.to_string().contains("below the vocabulary size 512"),
        "{err}"
    );
}
