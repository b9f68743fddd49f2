//! The node's session table: a bound on open sessions and on the KV-cache memory they may grow
//! to, and what each one holds, behind one lock with short critical sections. A session's slot
//! (and its reservation) is released when its stream task ends, however it ends.
//!
//! Admission counts a session by what it may grow to, not by what it holds: its cache is capped
//! at the positions it was admitted for (prompt, new tokens, one block), so the sessions a node
//! admits can never together exceed its budget, and a session is refused at once, with the need
//! and what is free, rather than failing mid-generation (no paging, no preemption: a refused
//! client retries; a running one is never evicted).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tandem_proto::{Error, Result};

#[derive(Debug, Default)]
struct Table {
    /// Session key → (KV-cache bytes it holds, bytes reserved for it).
    open: HashMap<u64, (usize, usize)>,
}

impl Table {
    fn reserved(&self) -> usize {
        self.open.values().map(|&(_, r)| r).sum()
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

    /// Reserves a slot and `kv_bytes` of the budget, or refuses when `max_sessions` are open
    /// or the budget has less free.
    pub fn acquire(&self, kv_bytes: usize) -> Result<SessionSlot> {
        let mut t = self.lock();
        if t.open.len() >= self.max_sessions {
            return Err(Error::TooManySessions {
                limit: self.max_sessions,
            });
        }
        let free = self.kv_budget.saturating_sub(t.reserved());
        if kv_bytes > free {
            return Err(Error::KvCacheFull {
                need: kv_bytes,
                free,
                budget: self.kv_budget,
            });
        }
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        t.open.insert(key, (0, kv_bytes));
        Ok(SessionSlot {
            key,
            table: Arc::clone(&self.table),
        })
    }

    /// Sessions open now.
    pub fn active(&self) -> usize {
        self.lock().open.len()
    }

    /// KV-cache bytes held by all open sessions.
    pub fn kv_bytes(&self) -> usize {
        self.lock().open.values().map(|&(held, _)| held).sum()
    }

    /// KV-cache bytes reserved by all open sessions, and the budget.
    pub fn kv_reserved(&self) -> (usize, usize) {
        (self.lock().reserved(), self.kv_budget)
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
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = t.open.get_mut(&self.key) {
            entry.0 = bytes;
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
        let a = table.acquire(0).expect("first");
        let b = table.acquire(0).expect("second");
        let err = table.acquire(0).expect_err("third is over the limit");
        assert!(err.to_string().contains("--max-sessions"), "{err}");
        a.set_kv_bytes(100);
        b.set_kv_bytes(20);
        assert_eq!((table.active(), table.kv_bytes()), (2, 120));
        drop(a);
        assert_eq!((table.active(), table.kv_bytes()), (1, 20));
        drop(b);
        assert_eq!(table.active(), 0);
        table.acquire(0).expect("a freed slot is reusable");
    }

    #[test]
    fn the_kv_budget_refuses_what_does_not_fit_and_frees_on_drop() {
        let table = SessionTable::new(64, 1000);
        let a = table.acquire(600).expect("fits");
        let err = table.acquire(500).expect_err("600 + 500 > 1000");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        let text = err.to_string();
        assert!(
            text.contains("500") && text.contains("400") && text.contains("1000"),
            "names the need, what is free and the budget: {text}"
        );
        assert!(text.contains("--kv-cache-bytes"), "{text}");
        let b = table.acquire(400).expect("exactly what is free");
        assert_eq!(table.kv_reserved(), (1000, 1000));
        drop((a, b));
        assert_eq!(table.kv_reserved(), (0, 1000));
        table.acquire(1000).expect("everything is free again");
    }
}
