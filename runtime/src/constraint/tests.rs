use super::*;

fn tokenizer() -> Tokenizer {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama2-tokenizer");
    Tokenizer::for_model(&dir).expect("tokenizer")
}

/// A "model" that prefers tokens by a fixed pseudo-random order: the grammar decides what is
/// allowed, these logits which allowed token is taken.
fn logits(vocab: usize, step: usize) -> Vec<f32> {
    (0..vocab)
        .map(|i| ((i * 2_654_435_761 + step * 40_503) % 1_000_003) as f32 / 1e6)
        .collect()
}

fn compiler(t: &Tokenizer) -> GrammarCompiler {
    let eos = t.eos_id().expect("eos");
    GrammarCompiler::new(t, t.vocab_size() + 3, &[eos]).expect("compiler")
}

/// Greedy decoding under the constraint until the end of sequence; the generated ids.
fn generate(t: &Tokenizer, c: &mut Constraint, max: usize) -> Vec<u32> {
    let eos = t.eos_id().expect("eos");
    let mut log = vec![1u32];
    for step in 0..max {
        c.sync(&log).expect("sync");
        let mut l = logits(t.vocab_size() + 3, step);
        c.mask().expect("mask").apply(&mut l);
        let next = crate::sampling::argmax(&l);
        if next == eos {
            return log[1..].to_vec();
        }
        log.push(next);
    }
    panic!("no end of sequence in {max} tokens: {:?}", t.decode(&log));
}

#[test]
fn a_json_schema_constrains_the_output_to_a_valid_document() {
    let t = tokenizer();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    });
    let mut c = compiler(&t)
        .compile(&Grammar::JsonSchema(schema), 1)
        .expect("compile");
    let ids = generate(&t, &mut c, 400);
    let text = t.decode(&ids).expect("decode");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    assert!(
        doc["name"].as_str().is_some_and(|n| n.chars().count() <= 8),
        "{text}"
    );
    assert!(
        doc["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)),
        "{text}"
    );
    let tags = doc["tags"].as_array().expect("tags");
    assert!(
        tags.len() <= 3 && tags.iter().all(|x| x == "a" || x == "b"),
        "{text}"
    );
    assert_eq!(doc.as_object().map(|o| o.len()), Some(3), "{text}");
}

#[test]
fn a_regex_and_a_lark_grammar_constrain_the_output() {
    let t = tokenizer();
    let mut c = compiler(&t)
        .compile(&Grammar::Regex("[0-9]{3}-[a-z]{2}".into()), 1)
        .expect("regex");
    let text = t.decode(&generate(&t, &mut c, 50)).expect("decode");
    assert!(
        text.len() == 6 && text.as_bytes()[3] == b'-',
        "regex output {text:?}"
    );
    let lark = r#"start: "yes" | "no""#;
    let mut c = compiler(&t)
        .compile(&Grammar::Lark(lark.into()), 1)
        .expect("lark");
    let text = t.decode(&generate(&t, &mut c, 50)).expect("decode");
    assert!(text == "yes" || text == "no", "lark output {text:?}");
}

#[test]
fn a_schema_that_does_not_compile_is_an_error_naming_it() {
    let t = tokenizer();
    let bad = serde_json::json!({"type": "object", "properties": {"x": {"type": "nonsense"}}});
    let err = compiler(&t)
        .compile(&Grammar::JsonSchema(bad), 0)
        .expect_err("a bad schema");
    assert!(matches!(err, Error::Grammar(_)), "{err}");
    assert!(err.to_string().contains("nonsense"), "{err}");
    let err = compiler(&t)
        .compile(&Grammar::Lark("start: (".into()), 0)
        .expect_err("a bad grammar");
    assert!(matches!(err, Error::Grammar(_)), "{err}");
}

#[test]
fn the_state_follows_the_log_through_rollbacks_and_refuses_a_forbidden_token() {
    let t = tokenizer();
    let g = Grammar::Regex("(ab|ac)d".into());
    let mut c = compiler(&t).compile(&g, 2).expect("compile");
    let id = |s: &str| {
        (0..t.vocab_size() as u32)
            .find(|&i| t.token(i).as_deref() == Some(s))
            .expect("a piece")
    };
    let (a, b, cc) = (id("a"), id("b"), id("c"));
    // The prompt (two tokens, anything) is not the grammar's.
    let prompt = [5u32, 6];
    c.sync(&[&prompt[..], &[a, b]].concat()).expect("ab");
    assert_eq!(c.position(), 4);
    // Rolled back to "a" and on to "ac": the state after "ac" allows "d", not "b".
    c.sync(&[&prompt[..], &[a, cc]].concat()).expect("ac");
    let mask = c.mask().expect("mask");
    assert!(!mask.allows(b));
    assert!(!c.push(b).expect("push"), "b after ac is forbidden");
    assert_eq!(c.position(), 4, "a refused token leaves the state");
    let err = c
        .sync(&[&prompt[..], &[a, cc, b]].concat())
        .expect_err("a forbidden token in the log");
    assert!(err.to_string().contains("not allowed"), "{err}");
}

#[test]
fn applying_a_mask_forbids_exactly_the_tokens_it_does_not_allow() {
    let t = tokenizer();
    let compiler = compiler(&t);
    for grammar in [
        Grammar::Regex("[a-z ]+".into()),
        Grammar::JsonObject,
        Grammar::Regex("7".into()),
    ] {
        let mut c = compiler.compile(&grammar, 0).expect("compile");
        let mask = c.mask().expect("mask");
        let mut logits = vec![0.5f32; compiler.vocab_size()];
        mask.apply(&mut logits);
        let mut allowed = 0;
        for (id, l) in logits.iter().enumerate() {
            assert_eq!(
                *l == 0.5,
                mask.allows(id as u32),
                "{grammar:?}: token {id} {l}"
            );
            allowed += usize::from(*l == 0.5);
        }
        assert!(
            allowed > 0 && allowed < logits.len(),
            "{grammar:?}: {allowed}"
        );
    }
}

/// Every stop token ends a complete output, not only the first (a chat model ends its turn with
/// its own token: Qwen's `<|im_end|>`, not its end of text), and none ends an incomplete one.
#[test]
fn any_stop_token_ends_a_complete_output() {
    let t = tokenizer();
    let piece = |s: &str| {
        (0..t.vocab_size() as u32)
            .find(|&i| t.token(i).as_deref() == Some(s))
            .expect("a piece")
    };
    let (a, b) = (piece("a"), piece("b"));
    let eos = t.eos_id().expect("eos");
    let other = t.bos_id().expect("bos");
    let c = GrammarCompiler::new(&t, t.vocab_size(), &[eos, other]).expect("compiler");
    let mut state = c
        .compile(&Grammar::Lark(r#"start: "a" ("b")?"#.into()), 0)
        .expect("compile");
    let mask = state.mask().expect("mask");
    assert!(!mask.allows(eos) && !mask.allows(other), "not complete yet");
    assert!(!state.push(other).expect("push"));
    assert!(state.push(a).expect("push"));
    let mask = state.mask().expect("mask");
    assert!(
        mask.allows(eos) && mask.allows(other),
        "complete: either ends it"
    );
    assert!(state.push(other).expect("push"));
    // Ended: only ends follow (a draft block may run past its end).
    assert!(state.push(eos).expect("push"));
    assert!(!state.push(b).expect("push"));
    // Rolled back before the end, the grammar goes on.
    state.rollback_to(1).expect("rollback");
    assert!(state.push(b).expect("push"));
    assert!(state.push(other).expect("push"));
}
