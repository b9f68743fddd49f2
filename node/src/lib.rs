//! tandem-node: the parts of draft-node and target-node that do not depend on their role: the
//! command line, model loading, the session table with its limits, the driver of one session's
//! bidirectional stream (model work on the node's model thread, idle timeout, in-band rejections),
//! node info, health, and serving (a role's service: [`session_service!`]).

mod config;
mod error;
mod host;
mod http;
pub mod metrics;
pub mod prefix_cache;
mod serve;
mod service;
mod sessions;
mod state;
mod stream;
mod telemetry;
mod worker;

pub use config::{LimitsArgs, ModelSource, NodeArgs};
pub use error::{Error, Result};
pub use serve::{Shutdown, announce_listening, bind_http, run, serve, serve_until_signal, stopped};
pub use sessions::{SessionSlot, SessionTable};
pub use state::{Limits, NodeState, Role, logit_ids};
pub use stream::{Incoming, Session, drive_session};
pub use telemetry::{Telemetry, init_telemetry};
pub use worker::{Batch, ModelThread};
