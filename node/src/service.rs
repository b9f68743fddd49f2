//! A role's gRPC service: tonic generates one trait and one server type per service, so the
//! draft-node's and the target-node's are declared by [`session_service!`], which writes the
//! server (its one bidirectional `Session` call driven by [`crate::drive_session`]) and the
//! role's `serve`.

/// Declares `$server`, a role's gRPC service over the sessions `$session` (a [`crate::Session`]):
/// tonic's `$service` trait implemented by driving each stream with [`crate::drive_session`],
/// and `pub async fn serve(listener, state, tls, shutdown)`, which serves it as `$name` beside
/// NodeService and health ([`crate::serve`]), messages up to [`tandem_proto::MAX_MESSAGE_BYTES`].
#[macro_export]
macro_rules! session_service {
    ($server:ident: $service:path, $server_type:ident, $session:ty, $name:literal) => {
        /// The gRPC service.
        #[derive(Debug, Clone)]
        pub struct $server(pub std::sync::Arc<$crate::NodeState>);

        #[tonic::async_trait]
        impl $service for $server {
            type SessionStream = tokio_stream::wrappers::ReceiverStream<
                std::result::Result<<$session as $crate::Session>::Response, tonic::Status>,
            >;

            async fn session(
                &self,
                request: tonic::Request<tonic::Streaming<<$session as $crate::Session>::Request>>,
            ) -> std::result::Result<tonic::Response<Self::SessionStream>, tonic::Status> {
                Ok(tonic::Response::new($crate::drive_session::<$session>(
                    std::sync::Arc::clone(&self.0),
                    request,
                )))
            }
        }

        #[doc = concat!("Serves `", $name, "` over a loaded node's `state` on `listener` (with `tls`) until `shutdown` resolves.")]
        pub async fn serve(
            listener: tokio::net::TcpListener,
            state: std::sync::Arc<$crate::NodeState>,
            tls: tandem_proto::tls::ServerTlsSetup,
            shutdown: impl std::future::Future<Output = ()> + Send,
        ) -> std::result::Result<(), tonic::transport::Error> {
            let service = $server_type::new($server(std::sync::Arc::clone(&state)))
                .max_decoding_message_size(tandem_proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(tandem_proto::MAX_MESSAGE_BYTES);
            $crate::serve(
                listener,
                state,
                $name,
                |router| router.add_service(service),
                &tls,
                shutdown,
            )
            .await
        }
    };
}
