//! What the API answers when a request fails: a status and `{"error": "..."}`.

use axum::extract::{FromRequest, Request, rejection::JsonRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

/// The JSON body of every error answer.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, for a person.
    pub error: String,
}

/// Why a request failed.
#[derive(Debug)]
pub(crate) enum ApiError {
    /// `422`: the request's body is not what the endpoint takes.
    Invalid(String),
    /// `404`: no order with this id.
    NotFound(String),
    /// `409`: the order's state does not allow the change.
    Conflict(String),
    /// `500`: the database failed; the transaction rolled back, nothing was recorded.
    Internal(String),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, error) = match self {
            ApiError::Invalid(why) => (StatusCode::UNPROCESSABLE_ENTITY, why),
            ApiError::NotFound(id) => (StatusCode::NOT_FOUND, format!("no order {id}")),
            ApiError::Conflict(why) => (StatusCode::CONFLICT, why),
            ApiError::Internal(why) => {
                eprintln!("orders-service: {why}");
                (StatusCode::INTERNAL_SERVER_ERROR, "internal error".into())
            }
        };
        (status, axum::Json(ErrorBody { error })).into_response()
    }
}

impl From<sea_orm::DbErr> for ApiError {
    fn from(e: sea_orm::DbErr) -> Self {
        ApiError::Internal(format!("database: {e}"))
    }
}

impl From<seaorm_outbox::Error> for ApiError {
    fn from(e: seaorm_outbox::Error) -> Self {
        ApiError::Internal(format!("recording the event: {e}"))
    }
}

/// A JSON body whose rejection (not JSON, a missing field, a wrong type) is an [`ApiError`]
/// like any other, so every error answer has the same shape.
pub(crate) struct Body<T>(pub T);

impl<S: Send + Sync, T> FromRequest<S> for Body<T>
where
    axum::Json<T>: FromRequest<S, Rejection = JsonRejection>,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        match axum::Json::<T>::from_request(request, state).await {
            Ok(axum::Json(value)) => Ok(Body(value)),
            Err(rejection) => Err(ApiError::Invalid(rejection.body_text())),
        }
    }
}
