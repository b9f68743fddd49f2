//! W3C trace context (`traceparent`, `tracestate`) carried in gRPC metadata, so that one trace
//! covers the coordinator and both nodes. Uses the globally installed propagator; without one
//! (no tracing exporter configured) both directions are no-ops.

use opentelemetry::propagation::{Extractor, Injector};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct Inject<'a>(&'a mut MetadataMap);

impl Injector for Inject<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct Extract<'a>(&'a MetadataMap);

impl Extractor for Extract<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct ExtractHeaders<'a>(&'a tonic::codegen::http::HeaderMap);

impl Extractor for ExtractHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Writes the current span's trace context into outgoing request metadata.
pub fn inject_current(metadata: &mut MetadataMap) {
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut Inject(metadata))
    });
}

/// Makes `span` a child of the trace context in incoming request metadata, if there is one.
pub fn continue_trace(metadata: &MetadataMap, span: &tracing::Span) {
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&Extract(metadata)));
    let _ = span.set_parent(cx);
}

/// Makes `span` a child of the trace context in incoming HTTP headers, if there is one.
pub fn continue_http_trace(headers: &tonic::codegen::http::HeaderMap, span: &tracing::Span) {
    let cx =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&ExtractHeaders(headers)));
    let _ = span.set_parent(cx);
}
