//! Who drafts each round, and how much. Every drafter is one file behind one trait,
//! [`Propose`], as vLLM's proposers: the draft-node's model with its background steps and
//! re-attachment ([`model`]) and n-gram lookup ([`ngram`], over the session's text and the
//! tenant's earlier outputs, [`suffix`]), each giving a [`block::DraftBlock`]
//! shaped by an [`block::Ask`] (a chain, or a token tree where the ask has branches). The
//! adaptive K policy and its cost model ([`policy`]) choose the drafter and K of each round;
//! background steps measure the idle draft ([`shadow`]). Adding a drafter is its file, a
//! [`DrafterKind`], and its line in [`Drafters::get`] (and its costs in the policy).
//!
//! Uses [`crate::nodes`] (the draft-node's session stream) and nothing above it.

pub mod block;
pub mod model;
pub mod ngram;
pub mod policy;
pub mod shadow;
pub mod suffix;

use std::future::Future;
use std::pin::Pin;

use crate::error::Result;
use tandem_runtime::TokenLog;

use block::{Ask, DraftBlock, StepFailure};
use model::ModelDrafter;
use ngram::NgramDrafter;

/// Who drafts a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrafterKind {
    /// The draft-node's model.
    Model,
    /// Prompt lookup over the session's own tokens.
    Ngram,
}

/// A drafter's block, on its way.
pub type Proposing<'a> =
    Pin<Box<dyn Future<Output = std::result::Result<DraftBlock, StepFailure>> + Send + 'a>>;

/// One round's drafts, from whichever drafter the policy chose.
pub trait Propose: Send {
    /// Up to `ask.k` drafts continuing `log` (and `ask.branches` more nodes: a token tree),
    /// expected to take `expected` seconds where the drafter has been timed (a drafter across
    /// a link gives up after a multiple of it).
    fn propose<'a>(
        &'a mut self,
        log: &'a TokenLog,
        ask: Ask,
        expected: Option<f64>,
    ) -> Proposing<'a>;
}

/// One generation's drafters: the draft-node's model while it is attached, and n-gram lookup.
#[derive(Debug, Default)]
pub struct Drafters {
    pub model: Option<ModelDrafter>,
    pub ngram: NgramDrafter,
}

impl Drafters {
    /// The drafter of `kind`, where the generation has it.
    pub fn get(&mut self, kind: DrafterKind) -> Option<&mut dyn Propose> {
        match kind {
            DrafterKind::Model => self.model.as_mut().map(|m| m as &mut dyn Propose),
            DrafterKind::Ngram => Some(&mut self.ngram),
        }
    }

    /// Whether the draft-node's session is attached (and idle): the model can draft.
    pub fn model_attached(&self) -> bool {
        self.model.as_ref().is_some_and(ModelDrafter::attached)
    }
}

/// Who may draft, per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DrafterChoice {
    /// The draft-node, and n-gram lookup where it pays more (or when the draft-node is lost).
    #[default]
    Auto,
    /// The draft-node only.
    Model,
    /// N-gram lookup only: no draft-node session is opened.
    Ngram,
}

impl DrafterChoice {
    /// Parses the request's `drafter` field, naming the accepted values when it is unknown.
    pub fn parse(value: &str) -> Result<Self> {
        match value {
            "" | "auto" => Ok(Self::Auto),
            "model" => Ok(Self::Model),
            "ngram" => Ok(Self::Ngram),
            other => Err(tandem_runtime::Error::invalid(
                "drafter",
                format!("{other:?}"),
                "expected \"auto\", \"model\" or \"ngram\"",
            )
            .into()),
        }
    }

    pub fn uses_model(self) -> bool {
        self != Self::Ngram
    }

    pub fn uses_ngram(self) -> bool {
        self != Self::Model
    }

    /// Which drafter a fixed-K round uses, whether the draft-node is attached or not.
    pub fn fixed(self, model_attached: bool) -> DrafterKind {
        match self {
            Self::Ngram => DrafterKind::Ngram,
            Self::Model | Self::Auto if model_attached => DrafterKind::Model,
            // The draft-node is lost (or never came): n-gram lookup stands in.
            _ => DrafterKind::Ngram,
        }
    }
}
