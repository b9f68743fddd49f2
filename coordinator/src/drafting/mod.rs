//! Who drafts each round, and how much: the adaptive K policy and its cost model ([`policy`]),
//! the draft-node's model drafter with its background steps and re-attachment, and n-gram
//! lookup ([`drafters`], [`ngram`]), and background steps that measure the idle draft
//! ([`shadow`]).
//!
//! Uses [`crate::nodes`] (the draft-node's session stream) and nothing above it.

pub mod drafters;
pub mod ngram;
pub mod policy;
pub mod shadow;
