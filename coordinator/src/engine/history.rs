//! Each tenant's earlier outputs, for the n-gram drafter to continue ([`SuffixIndex`]). A
//! tenant is a generation's prefix-cache salt (its request's `cache_salt`, else its API key's):
//! the boundary the nodes' prefix caches keep, so that no tenant's drafts, nor their speed,
//! depend on another's text. Bounded per tenant (the oldest outputs go first) and in tenants
//! (the least recently used goes first).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::drafting::suffix::{SuffixIndex, TenantHistory};

/// Tokens of earlier outputs kept per tenant by default (`--history-tokens`): some 2 MB each.
pub const DEFAULT_HISTORY_TOKENS: usize = 16_384;
/// Tenants whose outputs are kept at once.
const MAX_TENANTS: usize = 64;

/// Each tenant's index and when it was last used (a count of uses), and the uses so far.
type Tenants = (u64, HashMap<Vec<u8>, (u64, TenantHistory)>);

/// The tenants' indexes.
#[derive(Debug)]
pub struct History {
    tenants: Mutex<Tenants>,
    budget: usize,
}

impl Default for History {
    fn default() -> Self {
        Self::new(DEFAULT_HISTORY_TOKENS)
    }
}

impl History {
    /// Keeps up to `budget` tokens of each tenant's outputs; none at 0.
    pub fn new(budget: usize) -> Self {
        Self {
            tenants: Mutex::default(),
            budget,
        }
    }

    /// `tenant`'s index (a new one where it has none); `None` where no history is kept. The
    /// least recently used tenant's is dropped when a new one passes [`MAX_TENANTS`].
    pub fn of(&self, tenant: &[u8]) -> Option<TenantHistory> {
        if self.budget == 0 {
            return None;
        }
        let mut guard = self.tenants.lock().ok()?;
        let (clock, tenants) = &mut *guard;
        *clock += 1;
        if !tenants.contains_key(tenant) && tenants.len() >= MAX_TENANTS {
            let oldest = tenants
                .iter()
                .min_by_key(|(_, (used, _))| *used)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                tenants.remove(&k);
            }
        }
        let (used, index) = tenants
            .entry(tenant.to_vec())
            .or_insert_with(|| (0, Arc::new(Mutex::new(SuffixIndex::new(self.budget)))));
        *used = *clock;
        Some(index.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn continued(history: &History, tenant: &[u8], log: &[u32]) -> Vec<u32> {
        let index = history.of(tenant).expect("kept");
        let index = index.lock().expect("lock");
        index.continuation(index.longest_match(log, 16), 4)
    }

    #[test]
    fn a_tenant_continues_its_own_outputs_never_anothers() {
        let history = History::new(1000);
        history
            .of(b"alpha")
            .expect("kept")
            .lock()
            .expect("lock")
            .add(&[5, 6, 7, 8, 9]);
        assert_eq!(continued(&history, b"alpha", &[1, 6, 7]), vec![8, 9]);
        assert!(continued(&history, b"beta", &[1, 6, 7]).is_empty());
        assert!(continued(&history, b"", &[1, 6, 7]).is_empty());
        assert!(History::new(0).of(b"alpha").is_none(), "none kept at 0");
    }

    #[test]
    fn the_least_recently_used_tenant_goes_first() {
        let history = History::new(100);
        for i in 0..MAX_TENANTS as u32 {
            let index = history.of(&i.to_le_bytes()).expect("kept");
            index.lock().expect("lock").add(&[i, 1000 + i]);
        }
        // Tenant 0 used again: tenant 1 is now the least recently used, and goes.
        assert_eq!(continued(&history, &0u32.to_le_bytes(), &[0]), vec![1000]);
        history.of(b"new").expect("kept");
        assert_eq!(continued(&history, &0u32.to_le_bytes(), &[0]), vec![1000]);
        assert_eq!(continued(&history, &2u32.to_le_bytes(), &[2]), vec![1002]);
        // (Asking for tenant 1 again makes it anew, empty.)
        assert!(continued(&history, &1u32.to_le_bytes(), &[1]).is_empty());
    }
}
