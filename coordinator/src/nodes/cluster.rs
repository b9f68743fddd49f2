//! An in-process cluster: a target-node and a draft-node served on loopback gRPC
//! (127.0.0.1, ports chosen by the OS); the engine folder builds its engine. The local all-in-one
//! `generate` runs on it, and so do the cross-node tests.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::error::{Error, Result};
use tandem_node::{NodeState, stopped};
use tandem_proto::tls::ServerTlsSetup;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Nodes served by this process; they stop when the cluster is dropped.
#[derive(Debug)]
pub struct LocalCluster {
    pub target_addr: SocketAddr,
    pub draft_addr: Option<SocketAddr>,
    /// The nodes' state (their metrics, sessions), as the services see it.
    pub target: Arc<NodeState>,
    pub draft: Option<Arc<NodeState>>,
    stop: watch::Sender<bool>,
}

async fn bind() -> Result<TcpListener> {
    TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| Error::Unavailable {
            node: "local cluster",
            endpoint: "127.0.0.1:0".into(),
            reason: e.to_string(),
        })
}

fn addr(listener: &TcpListener) -> Result<SocketAddr> {
    listener.local_addr().map_err(|e| Error::Unavailable {
        node: "local cluster",
        endpoint: "127.0.0.1:0".into(),
        reason: e.to_string(),
    })
}

impl LocalCluster {
    /// Serves the nodes on loopback.
    pub async fn start(target: NodeState, draft: Option<NodeState>) -> Result<Self> {
        let (stop, _) = watch::channel(false);
        let listener = bind().await?;
        let target_addr = addr(&listener)?;
        let target = Arc::new(target);
        tokio::spawn(tandem_target_node::serve(
            listener,
            Arc::clone(&target),
            ServerTlsSetup::default(),
            stopped(&stop),
        ));
        let (draft_addr, draft) = match draft {
            Some(d) => {
                let listener = bind().await?;
                let a = addr(&listener)?;
                let d = Arc::new(d);
                tokio::spawn(tandem_draft_node::serve(
                    listener,
                    Arc::clone(&d),
                    ServerTlsSetup::default(),
                    stopped(&stop),
                ));
                (Some(a), Some(d))
            }
            None => (None, None),
        };
        Ok(Self {
            target_addr,
            draft_addr,
            target,
            draft,
            stop,
        })
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}
