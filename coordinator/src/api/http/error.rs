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

impl From<crate::error::Error> for ApiError {
    fn from(e: crate::error::Error) -> Self {
        Self::from(&e)
    }
}

impl From<&crate::error::Error> for ApiError {
    fn from(e: &crate::error::Error) -> Self {
        let status = match e.code() {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                StatusCode::BAD_REQUEST
            }
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unavailable | Code::DeadlineExceeded => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        use tandem_runtime::Error as R;
        let param = match e {
            crate::error::Error::Shared(tandem_proto::Error::Runtime(r)) => match r {
                R::InvalidParameter { field, .. } => Some((*field).to_string()),
                R::PromptTooLong { .. } | R::EmptyPrompt => Some("prompt".into()),
                R::Grammar(_) => Some("response_format".into()),
                _ => None,
            },
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
