//! The engine of the local all-in-one mode: connected to an in-process cluster's nodes.

use crate::error::Result;
use tandem_proto::tls::ClientTls;

use super::Engine;
use crate::nodes::LocalCluster;

impl LocalCluster {
    /// An engine connected to this cluster's nodes (which share this process's cores).
    /// `default_draft_tokens`: K of requests that name none (`None`: adaptive).
    pub async fn engine(&self, default_draft_tokens: impl Into<Option<usize>>) -> Result<Engine> {
        let draft = self.draft_addr.map(|a| format!("http://{a}"));
        let mut engine = Engine::connect(
            &[format!("http://{}", self.target_addr)],
            draft.as_slice(),
            default_draft_tokens.into(),
            &ClientTls::default(),
        )
        .await?;
        engine.draft_shares_cores = true;
        Ok(engine)
    }
}
