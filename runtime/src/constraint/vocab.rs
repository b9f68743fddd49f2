//! The model's vocabulary as llguidance sees it: each token's bytes in a token trie. Written here
//! rather than with `toktrie_hf_tokenizers`, which pins an older `tokenizers` (0.21) than the
//! runtime's (0.23): a second copy of that crate in every build for one conversion.
//!
//! A byte-level BPE (GPT-2's alphabet: Qwen, Llama 3, Phi-4-mini) maps each of 256 bytes to a
//! printable character; a SentencePiece-style BPE writes a space as `▁` and a byte it has no
//! piece for as `<0xNN>`. Special tokens (control tokens: `<|im_end|>`, `</s>`) get the trie's
//! special marker, so a grammar never produces them from text; ids past the tokenizer's (a
//! padded embedding) are special placeholders, never allowed.

use std::collections::HashMap;
use std::sync::Arc;

use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// GPT-2's byte-level alphabet: the printable bytes stand for themselves, the others for
/// U+0100 onwards in byte order.
fn byte_level_alphabet() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
                next += 1;
                (c, b)
            }
        })
        .collect()
}

/// A token's bytes in a SentencePiece-style vocabulary.
fn sentencepiece_bytes(piece: &str) -> Vec<u8> {
    if piece.len() == 6
        && piece.starts_with("<0x")
        && piece.ends_with('>')
        && let Ok(b) = u8::from_str_radix(&piece[3..5], 16)
    {
        return vec![b];
    }
    piece.replace('\u{2581}', " ").into_bytes()
}

/// The byte form of every id below `vocab_size`.
fn token_bytes(tokenizer: &Tokenizer, vocab_size: usize) -> Vec<Vec<u8>> {
    let alphabet = byte_level_alphabet();
    let byte_level = tokenizer.is_byte_level();
    let special = tokenizer.special_ids();
    (0..vocab_size as u32)
        .map(|id| {
            let marked = |text: &str| {
                let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                bytes.extend_from_slice(text.as_bytes());
                bytes
            };
            match tokenizer.token(id) {
                None => marked(&format!("<[{id}]>")),
                Some(text) if special.contains(&id) => marked(&text),
                Some(text) if byte_level => {
                    // A piece outside the alphabet (an added token kept as text) is its UTF-8.
                    let mapped: Option<Vec<u8>> =
                        text.chars().map(|c| alphabet.get(&c).copied()).collect();
                    mapped.unwrap_or_else(|| text.into_bytes())
                }
                Some(text) => sentencepiece_bytes(&text),
            }
        })
        .collect()
}

/// The trie, which also splits the text llguidance forces into tokens (greedily, by its own
/// pieces: the tokenizer's encoding would put SentencePiece's space before the text).
struct Env(TokTrie);

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.0
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.0.greedy_tokenize(s)
    }
}

/// llguidance's view of `tokenizer` over `vocab_size` logits, `eos` ending a complete output.
pub(super) fn token_env(tokenizer: &Tokenizer, vocab_size: usize, eos: u32) -> Result<TokEnv> {
    if eos as usize >= vocab_size {
        return Err(Error::Grammar(format!(
            "end-of-sequence token {eos} is past the vocabulary of {vocab_size}"
        )));
    }
    let words = token_bytes(tokenizer, vocab_size);
    let mut info = TokRxInfo::new(vocab_size as u32, eos);
    info.tok_bos = tokenizer.bos_id();
    Ok(Arc::new(Env(TokTrie::from(&info, &words))))
}
