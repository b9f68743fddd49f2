//! What sessions learnt of the nodes' costs and the draft's acceptance, for the next session to
//! start from ([`KPolicy::continued`]), kept per load: a round's costs depend on how many
//! generations share the nodes' batches. After waves of 8 sessions in one process (the draft's
//! and the target's passes taking turns on 2 cores), a lone session that started from the last
//! crowded session's costs found the draft unable to pay and decoded at 35-55 tokens/s, under
//! the target alone; it starts from the last lone session's instead.
//!
//! With `--policy-file`, what was learnt is saved as sessions end (at most every
//! [`SAVE_EVERY`]) and a restarted coordinator of the same pair starts from it, not from priors.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::drafting::policy::KPolicy;

/// Load classes: 1, 2, 3-4, 5-8, 9-16, 17-32 and more generations at once.
const CLASSES: usize = 7;
/// The format of a policy file ([`Saved`]).
const SAVED_VERSION: u32 = 1;
/// How often a policy file is written at most (a session that ends sooner after the last write
/// is saved with the next).
const SAVE_EVERY: Duration = Duration::from_secs(5);

/// The class of a load of `generations` at once.
fn class(generations: usize) -> usize {
    let above = generations.saturating_sub(1);
    ((usize::BITS - above.leading_zeros()) as usize).min(CLASSES - 1)
}

/// Each load class's last policy.
type Loads = [Option<KPolicy>; CLASSES];

/// The last session's policy at each load class, and the file it is saved in.
#[derive(Debug, Default)]
pub(crate) struct Learnt {
    loads: Mutex<Loads>,
    file: Option<PolicyFile>,
}

/// Where what was learnt is saved, for which models and machines, and when it last was.
#[derive(Debug)]
struct PolicyFile {
    path: PathBuf,
    pair: String,
    saved: Mutex<Option<Instant>>,
}

/// What a policy file holds: the pair and machines it was learnt on, and each load class's
/// policy.
#[derive(Debug, Serialize, Deserialize)]
struct Saved {
    version: u32,
    pair: String,
    loads: Vec<Option<KPolicy>>,
}

impl Learnt {
    /// What `path` holds for `pair` (the models and machines), saved there from now on. Where
    /// the file is unreadable or of another pair, priors, and the reason (the file is replaced
    /// at the first save); where there is none yet, priors.
    pub(crate) fn open(path: &Path, pair: &str) -> (Self, Option<String>) {
        let (loads, why) = match read(path, pair) {
            Ok(loads) => (loads, None),
            Err(why) => (Loads::default(), Some(why)),
        };
        let file = PolicyFile {
            path: path.to_path_buf(),
            pair: pair.to_string(),
            saved: Mutex::new(None),
        };
        let learnt = Self {
            loads: Mutex::new(loads),
            file: Some(file),
        };
        (learnt, why)
    }

    /// The policy of a session that starts while `generations` run (itself included): what the
    /// last session at that load learnt, or priors where none has run at it.
    pub(crate) fn start(&self, generations: usize, max_k: usize) -> KPolicy {
        let class = class(generations);
        self.loads
            .lock()
            .ok()
            .and_then(|learnt| learnt[class].as_ref().map(|p| p.continued(max_k)))
            .unwrap_or_else(|| KPolicy::new(max_k))
    }

    /// Keeps what a session learnt while `generations` ran on average (and saves it, where
    /// there is a file and the last save is [`SAVE_EVERY`] old).
    pub(crate) fn keep(&self, generations: f64, policy: KPolicy) {
        let Ok(mut loads) = self.loads.lock() else {
            return;
        };
        loads[class(generations.round() as usize)] = Some(policy);
        let Some(file) = &self.file else { return };
        let Ok(mut saved) = file.saved.lock() else {
            return;
        };
        if saved.is_some_and(|at| at.elapsed() < SAVE_EVERY) {
            return;
        }
        *saved = Some(Instant::now());
        if let Err(e) = file.write(&loads) {
            tracing::warn!(path = %file.path.display(), error = %e, "the policy file was not saved");
        }
    }
}

impl PolicyFile {
    /// Writes `loads` through a file beside the path, renamed over it: a reader (or a
    /// coordinator killed mid-write) never sees half of one.
    fn write(&self, loads: &Loads) -> std::io::Result<()> {
        let saved = Saved {
            version: SAVED_VERSION,
            pair: self.pair.clone(),
            loads: loads.to_vec(),
        };
        let json = serde_json::to_vec(&saved).map_err(std::io::Error::other)?;
        let mut partial = self.path.as_os_str().to_owned();
        partial.push(".partial");
        std::fs::write(&partial, json)?;
        std::fs::rename(&partial, &self.path)
    }
}

/// The policies `path` holds for `pair` (none where there is no file yet); why not, where it
/// cannot be read or holds another pair's.
fn read(path: &Path, pair: &str) -> Result<Loads, String> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Loads::default()),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let saved: Saved = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{}: not a policy file ({e})", path.display()))?;
    if saved.version != SAVED_VERSION || saved.pair != pair {
        return Err(format!(
            "{}: learnt on {:?} (format {}), not on {pair:?} (format {SAVED_VERSION})",
            path.display(),
            saved.pair,
            saved.version
        ));
    }
    let mut loads = Loads::default();
    for (to, from) in loads.iter_mut().zip(saved.loads) {
        *to = from;
    }
    Ok(loads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drafting::policy::{RoundCosts, RoundPlan};

    /// A policy that has seen target-only steps of `seconds`.
    fn stepped(seconds: f64) -> KPolicy {
        let mut policy = KPolicy::new(8);
        policy.observe(
            RoundPlan::TARGET_ONLY,
            &RoundCosts {
                verify_wall: seconds,
                ..RoundCosts::default()
            },
        );
        policy
    }

    #[test]
    fn loads_fall_in_classes_by_powers_of_two() {
        let classes: Vec<usize> = [0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 500]
            .into_iter()
            .map(class)
            .collect();
        assert_eq!(classes, [0, 0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]);
    }

    #[test]
    fn a_session_starts_from_what_the_last_one_at_its_load_learnt() {
        let learnt = Learnt::default();
        assert_eq!(
            learnt.start(1, 8).verify_seconds(1),
            KPolicy::new(8).verify_seconds(1),
            "priors before any session"
        );
        learnt.keep(1.0, stepped(0.015));
        learnt.keep(7.6, stepped(0.024));
        assert_eq!(learnt.start(1, 8).verify_seconds(1), 0.015);
        assert_eq!(learnt.start(8, 8).verify_seconds(1), 0.024);
        assert_eq!(learnt.start(5, 8).verify_seconds(1), 0.024);
        // A load none has run at starts from priors, not from another load's costs.
        assert_eq!(
            learnt.start(2, 8).verify_seconds(1),
            KPolicy::new(8).verify_seconds(1)
        );
        // The next session at a load replaces the last.
        learnt.keep(1.4, stepped(0.016));
        assert_eq!(learnt.start(1, 8).verify_seconds(1), 0.016);
    }

    #[test]
    fn a_policy_file_carries_what_was_learnt_to_the_next_process_of_its_pair() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("policy.json");
        let (learnt, why) = Learnt::open(&path, "pair A");
        assert_eq!(why, None, "no file yet: priors, nothing wrong");
        assert_eq!(
            learnt.start(1, 8).verify_seconds(1),
            KPolicy::new(8).verify_seconds(1)
        );
        // The first session's end saves at once; the next within SAVE_EVERY waits (the last
        // save set ahead, so that however slow this machine, the wait has not passed).
        learnt.keep(1.0, stepped(0.015));
        let file = learnt.file.as_ref().expect("a file");
        *file.saved.lock().expect("lock") = Some(Instant::now() + SAVE_EVERY);
        learnt.keep(7.6, stepped(0.024));
        let (again, why) = Learnt::open(&path, "pair A");
        assert_eq!(why, None);
        assert_eq!(again.start(1, 8).verify_seconds(1), 0.015);
        assert_eq!(
            again.start(8, 8).verify_seconds(1),
            KPolicy::new(8).verify_seconds(1),
            "kept after the save: not in the file yet"
        );
        // Another pair (or machine) starts from priors and says why.
        let (other, why) = Learnt::open(&path, "pair B");
        let why = why.expect("another pair");
        assert!(why.contains("pair A") && why.contains("pair B"), "{why}");
        assert_eq!(
            other.start(1, 8).verify_seconds(1),
            KPolicy::new(8).verify_seconds(1)
        );
        std::fs::write(&path, "{").expect("write");
        let (_, why) = Learnt::open(&path, "pair A");
        assert!(why.is_some_and(|w| w.contains("not a policy file")));
    }
}
