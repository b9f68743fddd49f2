//! Where a request's grammar is checked: compiled against the target's vocabulary before
//! anything runs (one that does not compile is an invalid argument naming why), and turned into
//! what the nodes are opened with (the grammar and where generation begins in the log). The
//! nodes mask with it; the coordinator keeps no grammar state of its own.

use tandem_proto::Result;
use tandem_proto::v1;
use tandem_runtime::{LazyGrammars, Tokenizer};

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
}
