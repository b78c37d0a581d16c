//! OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the status codes
//! the OpenAI SDKs map to their exception types (400 BadRequestError, 401 AuthenticationError,
//! 404 NotFoundError, 413, 503 with Retry-After, which the SDKs retry).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<String>,
    /// Seconds, sent as `Retry-After`.
    pub retry_after: Option<u64>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 `invalid_request_error`.
    pub fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 about one request field.
    pub fn param(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_string()),
            code: Some("invalid_value".into()),
            ..Self::bad(message)
        }
    }

    pub fn param_name(mut self, p: &str) -> Self {
        self.param = Some(p.to_string());
        self
    }

    pub fn with_code(mut self, code: &str) -> Self {
        self.code = Some(code.to_string());
        self
    }

    pub fn unauthorized() -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", "Incorrect or missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")
            .with_code("invalid_api_key")
    }

    pub fn not_found(what: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", what).with_code("not_found")
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method not allowed on this route",
        )
        .with_code("method_not_allowed")
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body is larger than the limit of {limit} bytes"),
        )
        .with_code("request_too_large")
    }

    /// 503: the queue is full or the server is stopping; clients retry after `secs`.
    pub fn unavailable(message: impl Into<String>, secs: u64) -> Self {
        Self {
            retry_after: Some(secs),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
                .with_code("server_overloaded")
        }
    }

    /// 500: the engine failed on this request.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
            .with_code("internal_error")
    }

    /// The JSON body (also sent as an SSE event when streaming already began).
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl ApiError {
    /// Anthropic's error type for this status.
    pub fn anthropic_type(&self) -> &'static str {
        match self.status.as_u16() {
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        }
    }

    /// Anthropic's shape: `{"type": "error", "error": {"type", "message"}}` (also the data of an
    /// `error` event when streaming already began).
    pub fn anthropic_body(&self) -> Value {
        json!({"type": "error", "error": {"type": self.anthropic_type(), "message": self.message}})
    }

    pub fn anthropic_response(&self) -> Response {
        let mut r = (self.status, axum::Json(self.anthropic_body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}
