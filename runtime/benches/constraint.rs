//! What a grammar costs per token (issue 29): on a real model's vocabulary, the time to build the
//! token trie (once per model), to compile a JSON schema (once per request), and per generated
//! token to compute the mask and apply it to the logits, during a greedy walk that the mask
//! steers (the logits a fixed pseudo-random order, so no model runs). Medians over the walk.
//!
//! `BENCH_MODEL=model.gguf cargo bench -p tandem-runtime --bench constraint` (a GGUF file or a
//! model folder; its tokenizer is what matters).

use std::time::Instant;

use tandem_runtime::{Grammar, GrammarCompiler, Tokenizer};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let Some(model) = std::env::var_os("BENCH_MODEL") else {
        println!("set BENCH_MODEL to a GGUF file or a model folder");
        return Ok(());
    };
    let tokenizer = Tokenizer::for_model(std::path::Path::new(&model))?;
    let vocab = tokenizer.vocab_size();
    let eos = tokenizer.eos_id().unwrap_or(0);
    let start = Instant::now();
    let compiler = GrammarCompiler::new(&tokenizer, vocab, &[eos])?;
    println!(
        "vocabulary: {vocab} tokens; token trie built in {:.1} ms",
        ms(start)
    );
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
            }, "required": ["city", "zip"], "additionalProperties": false}
        },
        "required": ["name", "age", "email", "tags", "address"],
        "additionalProperties": false
    });
    let grammars = [
        (
            "JSON schema (5 fields, nested)",
            Grammar::JsonSchema(schema),
        ),
        ("JSON object", Grammar::JsonObject),
        (
            "regex",
            Grammar::Regex("[a-z]{3,12}( [a-z]{3,12}){2,8}\\.".into()),
        ),
    ];
    println!(
        "| grammar | compile ms | tokens | mask µs/token (median) | apply µs/token (median) |"
    );
    println!("|---|---|---|---|---|");
    for (name, grammar) in grammars {
        let start = Instant::now();
        let mut c = compiler.compile(&grammar, 0)?;
        let compile = ms(start);
        let (mut masks, mut applies) = (Vec::new(), Vec::new());
        let mut log = Vec::new();
        for step in 0..400 {
            c.sync(&log)?;
            let mut logits: Vec<f32> = (0..vocab)
                .map(|i| ((i * 2_654_435_761 + step * 40_503) % 1_000_003) as f32 / 1e6)
                .collect();
            let t = Instant::now();
            let mask = c.mask()?;
            masks.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            mask.apply(&mut logits);
            applies.push(t.elapsed().as_secs_f64() * 1e6);
            let next = tandem_runtime::sampling::argmax(&logits);
            if next == eos {
                break;
            }
            log.push(next);
        }
        println!(
            "| {name} | {compile:.1} | {} | {:.0} | {:.0} |",
            log.len(),
            median(masks),
            median(applies)
        );
    }
    Ok(())
}

fn ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}
