//! The node's prefix cache (issue 30): what finished sessions computed, kept so that a new
//! session whose prompt starts with the same tokens (a chat's next turn, an agent's system
//! prompt and tools again, a replayed session) starts with their keys and values, shared
//! read-only ([`KvPrefix`]), and prefills only the rest.
//!
//! Entries are found by chained hashes of their tokens' whole blocks of [`BLOCK`] (vLLM's
//! scheme: a prompt's k-th block hash names its first k blocks), the match confirmed token by
//! token; a session's prefill then cuts the prefix at the first token its prompt differs in.
//! Each entry belongs to a tenant, named by the salt its session was opened with
//! (`OpenSession.cache_salt`): the chain of hashes starts from the salt and the match is proved
//! by the salt as well as the tokens, so a session finds only the entries of its own tenant.
//! A session that ends leaves its cache as an entry, without a copy. The memory the entries
//! hold (each segment once, however many entries and sessions share it) stays under the
//! cache's budget: the least recently used entries go first. Nothing here is ever written after
//! it is made, so no session's rollback can touch what another reads.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};

use tandem_runtime::KvPrefix;

/// Tokens per hashed block.
pub const BLOCK: usize = 16;

#[derive(Debug)]
struct Entry {
    prefix: KvPrefix,
    /// The tenant it belongs to.
    salt: Vec<u8>,
    tokens: Vec<u32>,
    /// Its whole blocks' chained hashes, under which it is found.
    hashes: Vec<u64>,
    /// When it was last used (a counter).
    used: u64,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<u64, Entry>,
    /// Block hash → the entry found under it (the last one inserted that has it).
    by_hash: HashMap<u64, u64>,
    next: u64,
    clock: u64,
    /// Bytes the entries hold, each segment once.
    bytes: usize,
}

impl Inner {
    /// Bytes of the segments the entries hold that no open session reads (in `read`): the
    /// memory the cache alone keeps; each segment once.
    fn held(&self, read: &HashSet<usize>) -> usize {
        let mut seen = read.clone();
        self.entries
            .values()
            .flat_map(|e| e.prefix.held())
            .filter(|(id, _)| seen.insert(*id))
            .map(|(_, bytes)| bytes)
            .sum()
    }

    /// Drops an entry; its block hashes then name another entry that has them, if one does.
    fn remove(&mut self, key: u64) -> Option<Entry> {
        let entry = self.entries.remove(&key)?;
        for h in &entry.hashes {
            if self.by_hash.get(h) == Some(&key) {
                self.by_hash.remove(h);
                let other = self.entries.iter().find(|(_, e)| e.hashes.contains(h));
                if let Some((&other, _)) = other {
                    self.by_hash.insert(*h, other);
                }
            }
        }
        Some(entry)
    }
}

/// Cached prefixes under a budget in bytes (0: the cache is off).
#[derive(Debug)]
pub struct PrefixCache {
    budget: usize,
    inner: Mutex<Inner>,
    evicted: std::sync::atomic::AtomicU64,
}

/// The chained hashes of `tokens`' whole blocks, the chain started from the tenant's `salt`.
pub fn block_hashes(salt: &[u8], tokens: &[u32]) -> Vec<u64> {
    use std::hash::{Hash, Hasher};
    let mut out = Vec::with_capacity(tokens.len() / BLOCK);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    salt.hash(&mut h);
    let mut last = h.finish();
    for block in tokens.chunks_exact(BLOCK) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (last, block).hash(&mut h);
        last = h.finish();
        out.push(last);
    }
    out
}

impl PrefixCache {
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            inner: Mutex::default(),
            evicted: Default::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached prefix of the tenant `salt` sharing most whole blocks with `prompt`, if one
    /// shares any, and the tokens of it the session keeps: a session starts with it, and its
    /// prefill cuts it where `prompt` differs (and before its last token, which the first step
    /// feeds).
    pub fn lookup(&self, salt: &[u8], prompt: &[u32]) -> Option<(KvPrefix, usize)> {
        if self.budget == 0 {
            return None;
        }
        let hashes = block_hashes(salt, prompt);
        let mut inner = self.lock();
        let (blocks, key) = hashes
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, h)| inner.by_hash.get(h).map(|&key| (i + 1, key)))?;
        inner.clock += 1;
        let now = inner.clock;
        let entry = inner.entries.get_mut(&key)?;
        // A hash names its tenant and blocks, but only the salt and the tokens prove them.
        let n = blocks * BLOCK;
        if entry.salt != salt || entry.tokens.get(..n) != prompt.get(..n) {
            return None;
        }
        entry.used = now;
        let common =
            tandem_runtime::token_log::common_len(&entry.tokens, prompt).min(prompt.len() - 1);
        Some((entry.prefix.clone(), common))
    }

    /// Keeps `prefix` (a session's positions: its prompt as it starts, all as it ends) for the
    /// tenant `salt`, then drops the least recently used entries while they hold more than the
    /// budget or `room` beyond the segments open sessions read (`read`). One shorter than a
    /// block is not kept, nor one an entry of the tenant already holds.
    pub fn insert(&self, salt: &[u8], prefix: KvPrefix, room: usize, read: &HashSet<usize>) {
        if self.budget == 0 || prefix.len() < BLOCK {
            return;
        }
        let tokens = prefix.tokens();
        let hashes = block_hashes(salt, &tokens);
        let mut inner = self.lock();
        let known = hashes
            .last()
            .and_then(|h| inner.by_hash.get(h))
            .and_then(|k| inner.entries.get(k))
            .is_some_and(|e| e.salt == salt && e.tokens.starts_with(&tokens));
        if known {
            return;
        }
        inner.clock += 1;
        inner.next += 1;
        let (key, used) = (inner.next, inner.clock);
        for &h in &hashes {
            inner.by_hash.insert(h, key);
        }
        inner.entries.insert(
            key,
            Entry {
                prefix,
                salt: salt.to_vec(),
                tokens,
                hashes,
                used,
            },
        );
        self.evict(&mut inner, self.budget.min(room), read);
    }

    /// Drops the least recently used entries while they hold more than `room` beyond the
    /// segments open sessions read (`read`).
    pub fn shrink(&self, room: usize, read: &HashSet<usize>) {
        let mut inner = self.lock();
        self.evict(&mut inner, self.budget.min(room), read);
    }

    fn evict(&self, inner: &mut Inner, room: usize, read: &HashSet<usize>) {
        let mut held = inner.held(read);
        while held > room {
            // An entry all of whose segments sessions read frees nothing: kept.
            let Some(oldest) = inner
                .entries
                .iter()
                .filter(|(_, e)| e.prefix.held().iter().any(|(id, _)| !read.contains(id)))
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| *k)
            else {
                break;
            };
            inner.remove(oldest);
            let after = inner.held(read);
            self.evicted.fetch_add(
                held.saturating_sub(after) as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            held = after;
        }
        inner.bytes = held;
    }

    /// Whether a sequence's positions past its shared prefix are worth keeping: at least a
    /// block of them, with the cache on.
    pub fn worth_keeping(&self, seq: &tandem_runtime::SequenceState) -> bool {
        self.budget > 0 && seq.cached_tokens() >= seq.shared_tokens() + BLOCK
    }

    /// Bytes the entries hold beyond what open sessions read (as of the last insertion or
    /// shrink).
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Bytes freed by eviction so far.
    pub fn evicted_bytes(&self) -> u64 {
        self.evicted.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Entries held.
    pub fn entries(&self) -> usize {
        self.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_runtime::{Logits, Model};

    fn model() -> Model {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/stories260K");
        Model::load(&dir, &Default::default()).expect("model")
    }

    /// `tokens` computed and left as a prefix, as a session leaves its cache.
    fn prefix(model: &Model, tokens: &[u32]) -> KvPrefix {
        let mut cache = model.new_cache();
        model
            .forward(tokens, &mut cache, Logits::Last)
            .expect("forward");
        cache.into_prefix(tokens).expect("a prefix")
    }

    fn tokens(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32)
            .map(|i| (seed * 31 + i * 7) % 500 + 3)
            .collect()
    }

    #[test]
    fn the_longest_match_of_whole_blocks_is_found_and_proved_by_its_tokens() {
        let (m, none) = (model(), HashSet::new());
        let cache = PrefixCache::new(usize::MAX);
        let a = tokens(1, 3 * BLOCK + 5);
        cache.insert(&[], prefix(&m, &a), usize::MAX, &none);
        // Shares 2 blocks and 3 tokens more with `a`: the prefix, and 2 · 16 + 3 tokens kept.
        let mut b = a[..2 * BLOCK + 3].to_vec();
        b.extend(tokens(9, 40));
        let (found, kept) = cache.lookup(&[], &b).expect("a hit");
        assert_eq!((found.len(), kept), (a.len(), 2 * BLOCK + 3));
        // A prompt inside the prefix keeps all but its last token.
        let (_, kept) = cache.lookup(&[], &a[..BLOCK + 2]).expect("a hit");
        assert_eq!(kept, BLOCK + 1);
        // Not one whole block in common: nothing.
        let mut c = a[..BLOCK - 1].to_vec();
        c.extend(tokens(5, 40));
        assert!(cache.lookup(&[], &c).is_none());
        assert!(cache.lookup(&[], &a[..BLOCK - 1]).is_none());
        // Shorter than a block, or held already: not kept.
        cache.insert(&[], prefix(&m, &a[..BLOCK - 1]), usize::MAX, &none);
        cache.insert(&[], prefix(&m, &a[..2 * BLOCK]), usize::MAX, &none);
        assert_eq!(cache.entries(), 1);
        assert!(PrefixCache::new(0).lookup(&[], &a).is_none(), "off");
    }

    /// An entry belongs to the tenant whose salt its session was opened with: the same tokens
    /// under another salt (or none) find nothing, even where every hash collides (the salt is
    /// proved as the tokens are), and each tenant keeps and finds its own entry of them.
    #[test]
    fn a_tenant_finds_only_its_own_entries() {
        let (m, none) = (model(), HashSet::new());
        let cache = PrefixCache::new(usize::MAX);
        let a = tokens(1, 3 * BLOCK + 5);
        let (alice, bob) = (b"alice".as_slice(), b"bob".as_slice());
        cache.insert(alice, prefix(&m, &a), usize::MAX, &none);
        let found = |salt: &[u8]| cache.lookup(salt, &a).map(|(p, kept)| (p.len(), kept));
        assert_eq!(found(alice), Some((a.len(), a.len() - 1)));
        assert_eq!((found(bob), found(&[])), (None, None));
        // The chains part from the first block on.
        let (of_alice, of_bob) = (block_hashes(alice, &a), block_hashes(bob, &a));
        assert!(of_alice.iter().zip(&of_bob).all(|(x, y)| x != y));
        // Bob's hashes made to name Alice's entry: still nothing for him.
        {
            let mut inner = cache.lock();
            let key = inner.by_hash[&of_alice[0]];
            for h in &of_bob {
                inner.by_hash.insert(*h, key);
            }
        }
        assert_eq!(found(bob), None);
        // His own entry of the same tokens is kept beside hers.
        cache.insert(bob, prefix(&m, &a), usize::MAX, &none);
        assert_eq!(cache.entries(), 2);
        assert_eq!(found(bob), Some((a.len(), a.len() - 1)));
        assert_eq!(found(alice), Some((a.len(), a.len() - 1)));
        assert_eq!(found(&[]), None);
    }

    #[test]
    fn the_least_recently_used_go_first_and_shared_segments_count_once() {
        let (m, none) = (model(), HashSet::new());
        let (a, b, c) = (tokens(1, 40), tokens(2, 40), tokens(3, 40));
        let one = prefix(&m, &a).segment_bytes();
        let cache = PrefixCache::new(2 * one);
        cache.insert(&[], prefix(&m, &a), usize::MAX, &none);
        cache.insert(&[], prefix(&m, &b), usize::MAX, &none);
        assert_eq!(cache.bytes(), 2 * one);
        // `a` used since: `b` goes when `c` comes.
        assert!(cache.lookup(&[], &a).is_some());
        cache.insert(&[], prefix(&m, &c), usize::MAX, &none);
        assert!(cache.lookup(&[], &b).is_none() && cache.lookup(&[], &a).is_some());
        assert!(cache.lookup(&[], &c).is_some());
        assert_eq!(cache.evicted_bytes(), one as u64);
        // Less room (a session admitted): down to what fits.
        cache.shrink(one, &none);
        assert_eq!((cache.entries(), cache.bytes()), (1, one));
        // A turn that extends an entry shares its segment: counted once.
        let (extended, _) = cache.lookup(&[], &c).expect("c");
        let mut session = m.new_cache();
        session.attach(&extended).expect("attach");
        let more = tokens(4, 20);
        m.forward(&more, &mut session, Logits::Last)
            .expect("forward");
        let turn = session.into_prefix(&more).expect("a prefix");
        let own = turn.segment_bytes();
        cache.insert(&[], turn, usize::MAX, &none);
        // Both entries kept in a room of two: c's segment counted once, not in each.
        assert_eq!(cache.entries(), 2);
        assert_eq!(cache.bytes(), one + own);
        assert!(cache.lookup(&[], &[c, more].concat()).is_some());
    }

    #[test]
    fn what_open_sessions_read_is_neither_counted_nor_dropped() {
        let (m, none) = (model(), HashSet::new());
        let (a, b) = (tokens(1, 40), tokens(2, 40));
        let read_a = prefix(&m, &a);
        let one = read_a.segment_bytes();
        let cache = PrefixCache::new(usize::MAX);
        cache.insert(&[], read_a.clone(), usize::MAX, &none);
        cache.insert(&[], prefix(&m, &b), usize::MAX, &none);
        // A session reads a's segment: the cache counts only b's, and with no room drops b
        // (though a is older) and keeps a, whose dropping would free nothing.
        let read: HashSet<usize> = read_a.held().into_iter().map(|(id, _)| id).collect();
        cache.shrink(one, &read);
        assert_eq!((cache.entries(), cache.bytes()), (2, one));
        cache.shrink(0, &read);
        assert_eq!((cache.entries(), cache.bytes()), (1, 0));
        assert!(cache.lookup(&[], &a).is_some() && cache.lookup(&[], &b).is_none());
        // An entry that extends a is found under a's blocks; dropped, a is found under them
        // again.
        let longer = [a.clone(), tokens(3, 30)].concat();
        cache.insert(&[], prefix(&m, &longer), usize::MAX, &read);
        assert_eq!(
            cache.lookup(&[], &a).map(|(p, _)| p.len()),
            Some(longer.len())
        );
        cache.shrink(0, &read);
        assert_eq!(cache.lookup(&[], &a).map(|(p, _)| p.len()), Some(a.len()));
    }
}
