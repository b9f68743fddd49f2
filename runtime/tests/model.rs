//! Forward-pass anchors: the reference story, cache truncation, block forwards, GGUF parity.

mod common;

use common::*;
use tandem_runtime::quantize::QuantType;
use tandem_runtime::{GenerateRequest, Logits, SamplingParams, SpeculativeGenerator, default_stop_tokens};

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
