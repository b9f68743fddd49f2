//! Logs and traces of every Tandem process: readable (or JSON, `TANDEM_LOG_FORMAT=json`) logs on
//! stderr filtered by `RUST_LOG`, and OpenTelemetry spans exported over OTLP/gRPC when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set (and not at all otherwise); `TANDEM_TRACE_FILTER`
//! (default `info`) chooses the spans, independently of `RUST_LOG`.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Flushes and stops the trace exporter when dropped (at the end of `main`).
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

/// Installs logging and, when configured, trace export for `service` (its `service.name`).
/// Call it inside the tokio runtime: the OTLP exporter needs one.
pub fn init_telemetry(service: &'static str, default_level: &str) -> Telemetry {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| default_level.into());
    let json = std::env::var("TANDEM_LOG_FORMAT").is_ok_and(|f| f == "json");
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if json {
        fmt.json().boxed()
    } else {
        fmt.boxed()
    };
    let (provider, otel) = match otlp_provider(service) {
        Some(p) => {
            // Spans are exported whatever RUST_LOG says about logs; TANDEM_TRACE_FILTER
            // (default `info`) chooses which.
            let spans =
                EnvFilter::try_from_env("TANDEM_TRACE_FILTER").unwrap_or_else(|_| "info".into());
            let layer = tracing_opentelemetry::layer()
                .with_tracer(p.tracer("tandem"))
                .with_filter(spans);
            (Some(p), Some(layer))
        }
        None => (None, None),
    };
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(otel)
        .init();
    if provider.is_some() {
        tracing::info!(service, "exporting traces over OTLP");
    }
    Telemetry { provider }
}

fn otlp_provider(service: &'static str) -> Option<SdkTracerProvider> {
    std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT")?;
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
    {
        Ok(e) => e,
        Err(e) => {
            eprintln!("cannot export traces over OTLP: {e}");
            return None;
        }
    };
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service)
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    opentelemetry::global::set_tracer_provider(provider.clone());
    Some(provider)
}
