//! The node's session table: a bound on open sessions and on the KV-cache memory they may grow
//! to, and what each one holds, behind one lock with short critical sections. A session's slot
//! (and its reservation) is released when its stream task ends, however it ends.
//!
//! Admission counts a session by what it may grow to, not by what it holds: its cache is capped
//! at the positions it was admitted for (prompt, new tokens, one block), so the sessions a node
//! admits can never together exceed its budget, and a session is refused at once, with the need
//! and what is free, rather than failing mid-generation (no paging, no preemption: a refused
//! client retries; a running one is never evicted).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::{Error, Result};
use tandem_runtime::KvPrefix;

/// One open session's memory, whether it has a message the node works on, and how many it has
/// answered.
#[derive(Debug, Default)]
struct Open {
    /// The session's id (as its open named it).
    id: String,
    working: bool,
    answered: u32,
    /// KV-cache bytes of its own storage, and what is reserved for it to grow to.
    held: usize,
    reserved: usize,
    /// The shared prefix it reads (segments counted once for all the sessions reading them).
    prefix: Option<KvPrefix>,
}

#[derive(Debug, Default)]
struct Table {
    open: HashMap<u64, Open>,
}

impl Table {
    /// The segments the sessions read, each once, with their bytes.
    fn segments(&self) -> HashMap<usize, usize> {
        let read = self.open.values().filter_map(|o| o.prefix.as_ref());
        read.flat_map(KvPrefix::held).collect()
    }

    /// What the sessions may grow to: their own storage's reservations and the segments they
    /// read.
    fn reserved(&self) -> usize {
        let own: usize = self.open.values().map(|o| o.reserved).sum();
        own + self.segments().values().sum::<usize>()
    }
}

/// Open sessions, bounded by `max_sessions` and by a KV-cache budget in bytes.
#[derive(Debug)]
pub struct SessionTable {
    max_sessions: usize,
    kv_budget: usize,
    next_key: AtomicU64,
    table: Arc<Mutex<Table>>,
}

impl SessionTable {
    pub fn new(max_sessions: usize, kv_budget: usize) -> Self {
        Self {
            max_sessions,
            kv_budget,
            next_key: AtomicU64::new(0),
            table: Arc::default(),
        }
    }

    /// Reserves a slot and `kv_bytes` of the budget for a session's own storage, and the
    /// segments of the shared `prefix` it starts with that no open session reads yet; or
    /// refuses when `max_sessions` are open or the budget has less free.
    pub fn acquire(
        &self,
        id: &str,
        kv_bytes: usize,
        prefix: Option<KvPrefix>,
    ) -> Result<SessionSlot> {
        let mut t = self.lock();
        if t.open.len() >= self.max_sessions {
            return Err(Error::TooManySessions {
                limit: self.max_sessions,
            });
        }
        let read = t.segments();
        let new_segments: usize = prefix.as_ref().map_or(0, |p| {
            let held = p.held().into_iter();
            held.filter(|(id, _)| !read.contains_key(id))
                .map(|(_, bytes)| bytes)
                .sum()
        });
        let kv_bytes = kv_bytes + new_segments;
        let free = self.kv_budget.saturating_sub(t.reserved());
        if kv_bytes > free {
            return Err(Error::KvCacheFull {
                need: kv_bytes,
                free,
                budget: self.kv_budget,
            });
        }
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        t.open.insert(
            key,
            Open {
                id: id.to_string(),
                // Admitted on its open, which the node works on now.
                working: true,
                answered: 0,
                held: 0,
                reserved: kv_bytes - new_segments,
                prefix,
            },
        );
        Ok(SessionSlot {
            key,
            table: Arc::clone(&self.table),
        })
    }

    /// Sessions open now.
    pub fn active(&self) -> usize {
        self.lock().open.len()
    }

    /// KV-cache bytes held by all open sessions: their own storage and the segments they
    /// read, each once.
    pub fn kv_bytes(&self) -> usize {
        let t = self.lock();
        let own: usize = t.open.values().map(|o| o.held).sum();
        own + t.segments().values().sum::<usize>()
    }

    /// KV-cache bytes reserved by all open sessions, and the budget.
    pub fn kv_reserved(&self) -> (usize, usize) {
        (self.lock().reserved(), self.kv_budget)
    }

    /// Whether the open session `id` has a message the node has taken and not yet answered;
    /// and the messages answered on its latest stream (the one opened last with that id: a
    /// replay's, where the stream it replaced is still closing).
    pub fn report(&self, id: &str) -> (bool, u32) {
        let t = self.lock();
        let of_id = || t.open.iter().filter(|(_, o)| o.id == id);
        let working = of_id().any(|(_, o)| o.working);
        let latest = of_id().max_by_key(|&(key, _)| *key);
        (working, latest.map_or(0, |(_, o)| o.answered))
    }

    /// The segments open sessions read ([`KvPrefix::held`]'s ids).
    pub fn read_segments(&self) -> HashSet<usize> {
        self.lock().segments().into_keys().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One open session's place in the table; dropping it frees the place and the reservation.
#[derive(Debug)]
pub struct SessionSlot {
    key: u64,
    table: Arc<Mutex<Table>>,
}

impl SessionSlot {
    pub fn set_kv_bytes(&self, bytes: usize) {
        self.with(|o| o.held = bytes);
    }

    /// The session has a message the node works on (taken, not yet answered).
    pub fn take(&self) {
        self.with(|o| o.working = true);
    }

    /// The node has answered the session's message: it works on none.
    pub fn answered(&self) {
        self.with(|o| {
            o.working = false;
            o.answered = o.answered.saturating_add(1);
        });
    }

    /// The session now reads `prefix` (its positions published) and reserves `kv_bytes` for
    /// its own storage.
    pub fn share(&self, prefix: KvPrefix, kv_bytes: usize) {
        self.with(|o| {
            o.prefix = Some(prefix);
            o.reserved = kv_bytes;
        });
    }

    fn with(&self, f: impl FnOnce(&mut Open)) {
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(open) = t.open.get_mut(&self.key) {
            f(open);
        }
    }
}

impl Drop for SessionSlot {
    fn drop(&mut self) {
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        t.open.remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_and_freed_on_drop() {
        let table = SessionTable::new(2, usize::MAX);
        let a = table.acquire("a", 0, None).expect("first");
        let b = table.acquire("b", 0, None).expect("second");
        // Taken on its open, which the node works on until it answers.
        assert_eq!(
            (table.report("a"), table.report("b")),
            ((true, 0), (true, 0))
        );
        a.answered();
        assert_eq!(table.report("a"), (false, 1));
        assert_eq!(
            (table.report("b"), table.report("c")),
            ((true, 0), (false, 0))
        );
        a.take();
        assert_eq!(table.report("a"), (true, 1));
        let err = table
            .acquire("s", 0, None)
            .expect_err("third is over the limit");
        assert!(err.to_string().contains("--max-sessions"), "{err}");
        a.set_kv_bytes(100);
        b.set_kv_bytes(20);
        assert_eq!((table.active(), table.kv_bytes()), (2, 120));
        drop(a);
        assert_eq!((table.active(), table.kv_bytes()), (1, 20));
        drop(b);
        assert_eq!(table.active(), 0);
        table
            .acquire("s", 0, None)
            .expect("a freed slot is reusable");
    }

    #[test]
    fn the_kv_budget_refuses_what_does_not_fit_and_frees_on_drop() {
        let table = SessionTable::new(64, 1000);
        let a = table.acquire("s", 600, None).expect("fits");
        let err = table.acquire("s", 500, None).expect_err("600 + 500 > 1000");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        let text = err.to_string();
        assert!(
            text.contains("500") && text.contains("400") && text.contains("1000"),
            "names the need, what is free and the budget: {text}"
        );
        assert!(text.contains("--kv-cache-bytes"), "{text}");
        let b = table.acquire("s", 400, None).expect("exactly what is free");
        assert_eq!(table.kv_reserved(), (1000, 1000));
        drop((a, b));
        assert_eq!(table.kv_reserved(), (0, 1000));
        table
            .acquire("s", 1000, None)
            .expect("everything is free again");
    }

    #[test]
    fn sessions_reading_one_prefix_reserve_its_bytes_once() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/stories260K");
        let model = tandem_runtime::Model::load(&dir, &Default::default()).expect("model");
        let tokens: Vec<u32> = (1..40).collect();
        let mut cache = model.new_cache();
        let logits = tandem_runtime::Logits::Last;
        model.forward(&tokens, &mut cache, logits).expect("forward");
        let prefix = cache.into_prefix(&tokens).expect("a prefix");
        let shared = prefix.segment_bytes();
        let table = SessionTable::new(64, shared + 300);
        let a = table.acquire("s", 100, Some(prefix.clone())).expect("fits");
        let b = table
            .acquire("t", 100, Some(prefix.clone()))
            .expect("the prefix counted once");
        assert_eq!(table.kv_reserved().0, shared + 200);
        let err = table
            .acquire("s", 101, Some(prefix.clone()))
            .expect_err("over");
        assert!(err.to_string().contains("101"), "{err}");
        b.set_kv_bytes(40);
        assert_eq!(
            table.kv_bytes(),
            shared + 40,
            "held: its own and the prefix once"
        );
        assert_eq!(table.read_segments().len(), 1);
        drop((a, b));
        assert!(table.read_segments().is_empty());
        assert_eq!(table.kv_reserved().0, 0);
    }
}
