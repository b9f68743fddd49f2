//! Errors in OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`) with the
//! HTTP status a client of that API expects.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tonic::Code;

/// An error answered to an HTTP client.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.into(),
            code: None,
        }
    }

    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400..=499 => "invalid_request_error",
            503 => "service_unavailable",
            _ => "server_error",
        }
    }
}

impl From<tandem_proto::Error> for ApiError {
    fn from(e: tandem_proto::Error) -> Self {
        Self::from(&e)
    }
}

impl From<&tandem_proto::Error> for ApiError {
    fn from(e: &tandem_proto::Error) -> Self {
        let status = match e.code() {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                StatusCode::BAD_REQUEST
            }
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unavailable | Code::DeadlineExceeded => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let param = match e {
            tandem_proto::Error::Runtime(tandem_runtime::Error::InvalidParameter {
                field, ..
            }) => Some((*field).to_string()),
            tandem_proto::Error::Runtime(
                tandem_runtime::Error::PromptTooLong { .. } | tandem_runtime::Error::EmptyPrompt,
            ) => Some("prompt".into()),
            tandem_proto::Error::Runtime(tandem_runtime::Error::Grammar(_)) => {
                Some("response_format".into())
            }
            _ => None,
        };
        Self {
            status,
            message: e.to_string(),
            param,
            code: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        });
        let mut response = (self.status, Json(body)).into_response();
        // A full node (sessions or KV-cache budget) frees up as generations end.
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}
