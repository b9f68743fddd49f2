//! Where a request's grammar is checked: compiled against the target's vocabulary before
//! anything runs (one that does not compile is an invalid argument naming why), and turned into
//! what the nodes are opened with (the grammar and where generation begins in the log). The
//! nodes mask with it; the coordinator's own state of it cuts the n-gram drafter's proposals at
//! their first forbidden token (a forbidden draft would be rejected anyway: this only saves the
//! verify positions).

use crate::error::Result;
use tandem_proto::v1;
use tandem_runtime::{Constraint, LazyGrammars, Tokenizer};

/// The coordinator's grammar compiler, built at the first constrained request.
#[derive(Debug, Default)]
pub struct Grammars(LazyGrammars);

impl Grammars {
    /// `constraint` checked for the target `info` describes (its vocabulary and stop tokens),
    /// with `start` the prompt's length; `None` when the request names no grammar.
    pub fn check(
        &self,
        tokenizer: &Tokenizer,
        info: &v1::NodeInfo,
        constraint: Option<&v1::Constraint>,
        start: usize,
    ) -> Result<Option<v1::Constraint>> {
        let Some(grammar) = constraint
            .map(v1::Constraint::grammar)
            .transpose()?
            .flatten()
        else {
            return Ok(None);
        };
        let compiler = self
            .0
            .get(tokenizer, info.vocab_size as usize, &info.stop_token_ids)?;
        compiler.compile(&grammar, start)?;
        Ok(constraint.map(|c| v1::Constraint {
            start: start as u32,
            ..c.clone()
        }))
    }

    /// A generation's grammar state, for a constraint [`Self::check`] passed.
    pub fn state(&self, constraint: Option<&v1::Constraint>) -> Result<Option<Constraint>> {
        let (Some(wire), Some(compiler)) = (constraint, self.0.built()) else {
            return Ok(None);
        };
        let Some(grammar) = wire.grammar()? else {
            return Ok(None);
        };
        Ok(Some(compiler.compile(&grammar, wire.start as usize)?))
    }
}

/// `drafts` continuing `log`, cut before the first one `constraint` forbids.
pub fn cut(constraint: Option<&mut Constraint>, log: &[u32], drafts: &[u32]) -> Result<usize> {
    let Some(c) = constraint else {
        return Ok(drafts.len());
    };
    c.sync(log)?;
    for (i, &t) in drafts.iter().enumerate() {
        if !c.push(t)? {
            return Ok(i);
        }
    }
    Ok(drafts.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_runtime::{Grammar, GrammarCompiler};

    #[test]
    fn drafts_are_cut_before_the_first_the_grammar_forbids() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama2-tokenizer");
        let t = Tokenizer::for_model(&dir).expect("tokenizer");
        let piece = |s: &str| {
            (0..t.vocab_size() as u32)
                .find(|&i| t.token(i).as_deref() == Some(s))
                .expect("a piece")
        };
        let (a, b, c) = (piece("a"), piece("b"), piece("c"));
        let compiler = GrammarCompiler::new(&t, t.vocab_size(), &[t.eos_id().expect("eos")])
            .expect("compiler");
        let mut state = compiler
            .compile(&Grammar::Regex("(ab)+c".into()), 1)
            .expect("compile");
        let log = [1, a];
        assert_eq!(cut(Some(&mut state), &log, &[b, a, b, c]).expect("cut"), 4);
        assert_eq!(cut(Some(&mut state), &log, &[b, c, a]).expect("cut"), 2);
        assert_eq!(cut(Some(&mut state), &log, &[a, b]).expect("cut"), 0);
        assert_eq!(cut(None, &log, &[a, a, a]).expect("cut"), 3);
    }
}
