//! The output side of a generation, shared by the in-process generator and the coordinator:
//! committed tokens, stop tokens and stop strings, and the text released to a streaming client
//! (never a partial stop string, never half a UTF-8 character).

use crate::Result;
use crate::tokenizer::{StreamDecoder, Tokenizer};
use serde::Serialize;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// A stop token or stop string.
    Stop,
}

impl FinishReason {
    /// The name OpenAI's API and the wire use: `length` or `stop`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::Stop => "stop",
        }
    }
}

/// What one round's commit produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// The round's tokens up to (not including) a stop token.
    pub tokens: Vec<u32>,
    /// Text that may be shown now.
    pub text: String,
    /// Set when the generation is over.
    pub finish: Option<FinishReason>,
}

/// Generated tokens and text of one request.
#[derive(Debug)]
pub struct Transcript<'a> {
    tokenizer: &'a Tokenizer,
    stop_token_ids: &'a [u32],
    stop_strings: &'a [String],
    max_new_tokens: usize,
    tokens: Vec<u32>,
    decoder: StreamDecoder,
    text: String,
    released: usize,
    finish: Option<FinishReason>,
}

impl<'a> Transcript<'a> {
    pub fn new(
        tokenizer: &'a Tokenizer,
        stop_token_ids: &'a [u32],
        stop_strings: &'a [String],
        max_new_tokens: usize,
    ) -> Self {
        Self {
            tokenizer,
            stop_token_ids,
            stop_strings,
            max_new_tokens,
            tokens: Vec::new(),
            decoder: StreamDecoder::default(),
            text: String::new(),
            released: 0,
            finish: (max_new_tokens == 0).then_some(FinishReason::Length),
        }
    }

    /// Tokens that may still be generated.
    pub fn remaining(&self) -> usize {
        self.max_new_tokens - self.tokens.len()
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Appends a round's tokens (at most [`Self::remaining`]), applying the stop conditions.
    pub fn commit(&mut self, round: &[u32]) -> Result<Commit> {
        let mut tokens = round[..round.len().min(self.remaining())].to_vec();
        if let Some(i) = tokens.iter().position(|t| self.stop_token_ids.contains(t)) {
            tokens.truncate(i);
            self.finish = Some(FinishReason::Stop);
        }
        self.tokens.extend_from_slice(&tokens);
        let before = self.text.len();
        self.text += &self.decoder.next(self.tokenizer, &self.tokens)?;
        let longest = self.stop_strings.iter().map(String::len).max().unwrap_or(0);
        // A stop string ending in the new text starts at most `longest` bytes before it.
        let mut from = before.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(cut) = self
            .stop_strings
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min()
        {
            self.text.truncate(cut);
            self.finish = Some(FinishReason::Stop);
        }
        if self.finish.is_none() && self.remaining() == 0 {
            self.finish = Some(FinishReason::Length);
        }
        if self.finish.is_some() {
            self.flush()?;
        }
        let hold = if self.finish.is_some() {
            0
        } else {
            self.partial_stop_len()
        };
        let end = self.text.len() - hold;
        // The final decode may differ from the streamed one inside invalid UTF-8: never re-send.
        let mut start = self.released.min(end);
        while !self.text.is_char_boundary(start) {
            start += 1;
        }
        let text = self.text[start..end].to_string();
        self.released = self.released.max(end);
        Ok(Commit {
            tokens,
            text,
            finish: self.finish,
        })
    }

    /// At the end, decodes what the streaming decoder was still holding back.
    fn flush(&mut self) -> Result<()> {
        let mut text = self.tokenizer.decode(&self.tokens)?;
        if let Some(cut) = self
            .stop_strings
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min()
        {
            text.truncate(cut);
        }
        self.text = text;
        Ok(())
    }

    /// Length of the longest suffix of the text that begins a stop string.
    fn partial_stop_len(&self) -> usize {
        self.stop_strings
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(move |&n| s.is_char_boundary(n))
                    .map(move |n| &s[..n])
            })
            .filter(|p| self.text.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0)
    }

    /// The whole text and token ids.
    pub fn into_output(self) -> (String, Vec<u32>) {
        (self.text, self.tokens)
    }
}
