//! What a verifier checks of a drafted block before it lets the block near the acceptance rule
//! (docs/architecture.md invariant 1: the output is the target's, whatever the draft sends). A block that
//! fails is not an error: the round runs as a plain target step and the refusal says which draft
//! position was wrong and how, so that a buggy or hostile draft costs speed, never output and
//! never a request.
//!
//! The checks: no more drafts than the block may hold, one q per draft, token ids inside the
//! vocabulary, every probability finite and non-negative, each q summing to 1 within
//! [`SUM_TOLERANCE`], mass on the drafted token, and for a greedy session a q that is one-hot on
//! it. What they cannot catch, and what a draft can therefore still change, is written in the
//! README ("What a draft can and cannot change").

use crate::sampling::Distribution;

/// How far a q's sum may be from 1.
pub const SUM_TOLERANCE: f64 = 1e-3;

/// What was wrong with a refused block; its name is the `reason` label of the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalReason {
    /// More drafts than asked for or than the session has room for.
    TooManyDrafts,
    /// Not exactly one q per draft.
    QCount,
    /// A drafted token id outside the vocabulary.
    UnknownToken,
    /// A q that does not decode: wrong size, ids out of range, no kind.
    MalformedQ,
    /// A NaN or infinite probability.
    NonFiniteQ,
    NegativeQ,
    /// A q whose probabilities do not sum to 1.
    QSum,
    /// q puts no mass on the token drafted from it.
    NoMassOnDraft,
    /// A greedy session's q must be one-hot on the drafted token.
    NotOneHot,
    /// A token tree whose parents do not make one (a parent after its child, too deep, twin
    /// siblings).
    MalformedTree,
}

impl RefusalReason {
    /// Every reason, as a metric's label values are listed before any is counted.
    pub const ALL: [Self; 10] = [
        Self::TooManyDrafts,
        Self::QCount,
        Self::UnknownToken,
        Self::MalformedQ,
        Self::NonFiniteQ,
        Self::NegativeQ,
        Self::QSum,
        Self::NoMassOnDraft,
        Self::NotOneHot,
        Self::MalformedTree,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::TooManyDrafts => "too_many_drafts",
            Self::QCount => "q_count",
            Self::UnknownToken => "unknown_token",
            Self::MalformedQ => "malformed_q",
            Self::NonFiniteQ => "non_finite_q",
            Self::NegativeQ => "negative_q",
            Self::QSum => "q_sum",
            Self::NoMassOnDraft => "no_mass_on_draft",
            Self::NotOneHot => "not_one_hot",
            Self::MalformedTree => "malformed_tree",
        }
    }
}

/// A refused block: the draft position (0-based) at fault, why, and the offending values.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("draft {} refused ({}): {detail}", .position + 1, .reason.as_str())]
pub struct DraftRefusal {
    pub position: usize,
    pub reason: RefusalReason,
    pub detail: String,
}

impl DraftRefusal {
    pub fn new(position: usize, reason: RefusalReason, detail: impl Into<String>) -> Self {
        Self {
            position,
            reason,
            detail: detail.into(),
        }
    }
}

/// What a block is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRules {
    pub vocab_size: usize,
    /// Most drafts the block may hold (K asked for, room left in the session).
    pub max_drafts: usize,
    /// A greedy session: every q must be one-hot on its draft.
    pub greedy: bool,
}

/// Checks the sizes of a block: no more than `max_drafts` drafts and one q per draft. Cheap, so
/// a node runs it before decoding any q (each costs a vocabulary of floats).
pub fn check_counts(drafts: usize, q: usize, max_drafts: usize) -> Result<(), DraftRefusal> {
    if drafts > max_drafts {
        return Err(DraftRefusal::new(
            max_drafts,
            RefusalReason::TooManyDrafts,
            format!("{drafts} drafts, at most {max_drafts} fit this block"),
        ));
    }
    if q != drafts {
        return Err(DraftRefusal::new(
            q.min(drafts),
            RefusalReason::QCount,
            format!("{q} distributions for {drafts} drafts"),
        ));
    }
    Ok(())
}

/// Checks a drafted block, naming the first position at fault.
pub fn check_block(
    drafts: &[u32],
    q: &[Distribution],
    rules: &BlockRules,
) -> Result<(), DraftRefusal> {
    check_counts(drafts.len(), q.len(), rules.max_drafts)?;
    for (i, (&x, q)) in drafts.iter().zip(q).enumerate() {
        check_one(x, q, rules).map_err(|(reason, detail)| DraftRefusal::new(i, reason, detail))?;
    }
    Ok(())
}

fn check_one(x: u32, q: &Distribution, rules: &BlockRules) -> Result<(), (RefusalReason, String)> {
    let vocab = rules.vocab_size;
    if x as usize >= vocab {
        return Err((
            RefusalReason::UnknownToken,
            format!("token {x}: ids must be below the vocabulary size {vocab}"),
        ));
    }
    match q {
        Distribution::OneHot(t) if *t == x => Ok(()),
        Distribution::OneHot(t) => Err((
            RefusalReason::NoMassOnDraft,
            format!("q is one-hot on token {t}, the draft is token {x}"),
        )),
        Distribution::Dense(p) => {
            if p.len() != vocab {
                return Err((
                    RefusalReason::MalformedQ,
                    format!("q has {} entries for a vocabulary of {vocab}", p.len()),
                ));
            }
            let mut sum = 0.0f64;
            let mut nonzero = 0usize;
            for (id, &v) in p.iter().enumerate() {
                if !v.is_finite() {
                    return Err((
                        RefusalReason::NonFiniteQ,
                        format!("q({id}) = {v}: probabilities must be finite"),
                    ));
                }
                if v < 0.0 {
                    return Err((
                        RefusalReason::NegativeQ,
                        format!("q({id}) = {v}: probabilities must be non-negative"),
                    ));
                }
                sum += f64::from(v);
                nonzero += usize::from(v > 0.0);
            }
            if (sum - 1.0).abs() > SUM_TOLERANCE {
                return Err((
                    RefusalReason::QSum,
                    format!("q sums to {sum}: must be 1 within {SUM_TOLERANCE}"),
                ));
            }
            let qx = p[x as usize];
            if qx <= 0.0 {
                return Err((
                    RefusalReason::NoMassOnDraft,
                    format!("q({x}) = {qx}: the drafted token must have mass"),
                ));
            }
            if rules.greedy && nonzero != 1 {
                return Err((
                    RefusalReason::NotOneHot,
                    format!(
                        "a greedy session's q must be one-hot on the draft; this one has {nonzero} \
                         non-zero entries"
                    ),
                ));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: BlockRules = BlockRules {
        vocab_size: 4,
        max_drafts: 3,
        greedy: false,
    };

    fn reason(drafts: &[u32], q: &[Distribution], rules: &BlockRules) -> Option<RefusalReason> {
        check_block(drafts, q, rules).err().map(|r| r.reason)
    }

    #[test]
    fn every_lie_is_named_with_its_position() {
        use Distribution::{Dense, OneHot};
        use RefusalReason::*;
        let good = Dense(vec![0.25; 4]);
        assert_eq!(reason(&[1, 2], &[good.clone(), OneHot(2)], &RULES), None);
        let cases: Vec<(Vec<u32>, Vec<Distribution>, RefusalReason)> = vec![
            (vec![1; 4], vec![good.clone(); 4], TooManyDrafts),
            (vec![1, 2], vec![good.clone()], QCount),
            (vec![1, 7], vec![good.clone(), OneHot(7)], UnknownToken),
            (vec![1, 2], vec![good.clone(), OneHot(3)], NoMassOnDraft),
            (
                vec![1, 2],
                vec![good.clone(), Dense(vec![0.5; 3])],
                MalformedQ,
            ),
            (
                vec![1, 2],
                vec![good.clone(), Dense(vec![0.5, f32::NAN, 0.5, 0.0])],
                NonFiniteQ,
            ),
            (
                vec![1, 2],
                vec![good.clone(), Dense(vec![1.5, -0.5, 0.0, 0.0])],
                NegativeQ,
            ),
            (vec![1, 2], vec![good.clone(), Dense(vec![0.5; 4])], QSum),
            (
                vec![1, 2],
                vec![good.clone(), Dense(vec![0.5, 0.5, 0.0, 0.0])],
                NoMassOnDraft,
            ),
        ];
        for (drafts, q, expected) in cases {
            let refusal = check_block(&drafts, &q, &RULES).expect_err("a lie");
            assert_eq!(refusal.reason, expected, "{refusal}");
            let position = if expected == TooManyDrafts { 3 } else { 1 };
            assert_eq!(refusal.position, position, "{refusal}");
            assert!(refusal.to_string().contains(expected.as_str()), "{refusal}");
        }
    }

    #[test]
    fn a_greedy_session_takes_only_one_hot_q_on_the_draft() {
        let greedy = BlockRules {
            greedy: true,
            ..RULES
        };
        let one_hot_dense = Distribution::Dense(vec![0.0, 1.0, 0.0, 0.0]);
        assert_eq!(reason(&[1], &[Distribution::OneHot(1)], &greedy), None);
        assert_eq!(reason(&[1], &[one_hot_dense], &greedy), None);
        assert_eq!(
            reason(&[1], &[Distribution::Dense(vec![0.25; 4])], &greedy),
            Some(RefusalReason::NotOneHot)
        );
        assert_eq!(
            reason(&[1], &[Distribution::OneHot(2)], &greedy),
            Some(RefusalReason::NoMassOnDraft)
        );
    }
}
