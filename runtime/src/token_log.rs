//! A sequence's canonical token log with the hash of every prefix (docs/architecture.md invariant 4): the
//! coordinator's truth, and what each node believes it holds. Rolling back to any earlier prefix
//! is a truncation, and naming a prefix costs O(1).

use crate::tokenizer::Fnv;
use crate::{Error, Result};

/// A committed length and the hash of the tokens up to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    pub len: usize,
    pub hash: u64,
}

impl std::fmt::Display for Prefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} tokens (hash {:016x})", self.len, self.hash)
    }
}

/// Tokens plus `hashes[i]` = FNV-1a of `tokens[..i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenLog {
    tokens: Vec<u32>,
    hashes: Vec<u64>,
}

impl Default for TokenLog {
    fn default() -> Self {
        Self {
            tokens: Vec::new(),
            hashes: vec![Fnv::default().0],
        }
    }
}

impl TokenLog {
    pub fn new(tokens: &[u32]) -> Self {
        let mut log = Self::default();
        log.extend(tokens);
        log
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The whole log as a prefix.
    pub fn prefix(&self) -> Prefix {
        Prefix {
            len: self.len(),
            hash: self.hashes[self.len()],
        }
    }

    /// The first `len` tokens as a prefix, if the log is that long.
    pub fn prefix_at(&self, len: usize) -> Option<Prefix> {
        self.hashes.get(len).map(|&hash| Prefix { len, hash })
    }

    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            let mut h = Fnv(self.hashes[self.tokens.len()]);
            h.write(&t.to_le_bytes());
            self.tokens.push(t);
            self.hashes.push(h.0);
        }
    }

    /// Rolls back to `prefix` if this log holds it; otherwise changes nothing and says what it
    /// holds. Rolling back to the whole log is a no-op.
    pub fn rollback_to(&mut self, prefix: Prefix) -> Result<()> {
        if self.prefix_at(prefix.len) != Some(prefix) {
            return Err(Error::PrefixMismatch {
                expected: prefix,
                held: self.prefix(),
            });
        }
        self.tokens.truncate(prefix.len);
        self.hashes.truncate(prefix.len + 1);
        Ok(())
    }
}

/// How many tokens `a` and `b` start with in common.
pub fn common_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_name_their_tokens_and_rollback_checks_them() {
        let mut log = TokenLog::new(&[1, 2, 3]);
        let p2 = log.prefix_at(2).expect("prefix");
        assert_eq!(p2, TokenLog::new(&[1, 2]).prefix());
        assert_ne!(p2.hash, TokenLog::new(&[2, 1]).prefix().hash);
        assert!(log.prefix_at(4).is_none());

        let wrong = Prefix { len: 2, hash: 7 };
        assert!(matches!(
            log.rollback_to(wrong),
            Err(Error::PrefixMismatch { held, .. }) if held.len == 3
        ));
        assert_eq!(log.len(), 3, "a refused rollback changes nothing");
        log.rollback_to(p2).expect("rollback");
        assert_eq!(log.tokens(), &[1, 2]);
        log.extend(&[9]);
        assert_eq!(log.prefix(), TokenLog::new(&[1, 2, 9]).prefix());
    }
}
