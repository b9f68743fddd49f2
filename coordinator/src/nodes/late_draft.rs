//! A draft-node that may come late: its replicas, attached in the background once one answers.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::error::Result;
use tandem_proto::tls::ClientTls;

use super::handle::NodeHandle;
use super::replicas::Replicas;

/// The draft-node's replicas. Reached at start, they must share the target's vocabulary (else
/// the coordinator refuses to start, naming both). Unreachable then, the coordinator serves with
/// the target alone and attaches them in the background once one answers (backoff 250 ms to
/// 10 s, vocabulary checked; a mismatch then is logged and the draft left out).
#[derive(Debug, Clone, Default)]
pub struct LateDraft(Arc<OnceLock<Replicas>>);

impl LateDraft {
    pub async fn connect(urls: &[String], target: &NodeHandle, tls: &ClientTls) -> Result<Self> {
        let late = Self::default();
        match Replicas::connect("draft-node", urls, tls).await {
            Ok(drafts) => {
                same_vocabulary(target, drafts.primary())?;
                let _ = late.0.set(drafts);
            }
            Err(e) => {
                tracing::warn!(error = %tandem_proto::error_chain(&e),
                    "draft-node not reachable: serving with the target alone until it answers");
                let (cell, urls, target, tls) = (
                    Arc::clone(&late.0),
                    urls.to_vec(),
                    target.clone(),
                    tls.clone(),
                );
                tokio::spawn(async move {
                    let mut wait = Duration::from_millis(250);
                    loop {
                        tokio::time::sleep(wait).await;
                        let Ok(drafts) = Replicas::connect("draft-node", &urls, &tls).await else {
                            wait = (wait * 2).min(Duration::from_secs(10));
                            continue;
                        };
                        match same_vocabulary(&target, drafts.primary()) {
                            Ok(()) => {
                                tracing::info!(model = %drafts.primary().info.model_name,
                                    replicas = %drafts.endpoints(), "draft-node attached");
                                let _ = cell.set(drafts);
                            }
                            Err(e) => tracing::error!(error = %e, "draft-node left out"),
                        }
                        return;
                    }
                });
            }
        }
        Ok(late)
    }

    /// The draft-node's replicas, once one has answered.
    pub fn get(&self) -> Option<&Replicas> {
        self.0.get()
    }
}

/// Refuses a draft whose vocabulary differs from the target's, naming both.
fn same_vocabulary(target: &NodeHandle, draft: &NodeHandle) -> Result<()> {
    let (t, d) = (&target.info, &draft.info);
    if t.vocab_size == d.vocab_size && t.vocab_hash == d.vocab_hash {
        return Ok(());
    }
    Err(tandem_runtime::Error::VocabularyMismatch(format!(
        "draft-node {} serves {} ({} tokens, vocabulary hash {:016x}), target-node {} serves {} \
         ({} tokens, vocabulary hash {:016x})",
        draft.endpoint,
        d.model_name,
        d.vocab_size,
        d.vocab_hash,
        target.endpoint,
        t.model_name,
        t.vocab_size,
        t.vocab_hash
    ))
    .into())
}
