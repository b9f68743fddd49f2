//! The node's session table: a bound on open sessions and what each one holds, behind one lock
//! with short critical sections. A session's slot is released when its stream task ends, however
//! it ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tandem_proto::{Error, Result};

#[derive(Debug, Default)]
struct Table {
    /// Session key → KV-cache bytes it holds.
    open: HashMap<u64, usize>,
}

/// Open sessions, bounded by `max_sessions`.
#[derive(Debug)]
pub struct SessionTable {
    max_sessions: usize,
    next_key: AtomicU64,
    table: Arc<Mutex<Table>>,
}

impl SessionTable {
    pub fn new(max_sessions: usize) -> Self {
        Self {
            max_sessions,
            next_key: AtomicU64::new(0),
            table: Arc::default(),
        }
    }

    /// Reserves a slot, or refuses when `max_sessions` are open.
    pub fn acquire(&self) -> Result<SessionSlot> {
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if t.open.len() >= self.max_sessions {
            return Err(Error::TooManySessions {
                limit: self.max_sessions,
            });
        }
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        t.open.insert(key, 0);
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
        self.lock().open.values().sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One open session's place in the table; dropping it frees the place.
#[derive(Debug)]
pub struct SessionSlot {
    key: u64,
    table: Arc<Mutex<Table>>,
}

impl SessionSlot {
    pub fn set_kv_bytes(&self, bytes: usize) {
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        t.open.insert(self.key, bytes);
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
        let table = SessionTable::new(2);
        let a = table.acquire().expect("first");
        let b = table.acquire().expect("second");
        let err = table.acquire().expect_err("third is over the limit");
        assert!(err.to_string().contains("--max-sessions"), "{err}");
        a.set_kv_bytes(100);
        b.set_kv_bytes(20);
        assert_eq!((table.active(), table.kv_bytes()), (2, 120));
        drop(a);
        assert_eq!((table.active(), table.kv_bytes()), (1, 20));
        drop(b);
        assert_eq!(table.active(), 0);
        table.acquire().expect("a freed slot is reusable");
    }
}
