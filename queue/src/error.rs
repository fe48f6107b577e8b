//! The engine's error type.

use azure_data_cosmos::CosmosError;

use crate::message::MessageError;

/// The engine's result.
pub type Result<T, E = QueueError> = std::result::Result<T, E>;

/// What can go wrong in the engine; each says what was being done.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// A Cosmos DB request failed after the SDK's own retries (429s and transient errors are
    /// retried there first).
    #[error("Cosmos DB {operation} failed with status {status}{}: {message}", sub_status.map(|s| format!("/{s}")).unwrap_or_default())]
    Cosmos {
        /// What was being done (`claim`, `complete`, `read state`, …).
        operation: &'static str,
        /// The HTTP status.
        status: u16,
        /// Cosmos DB's sub-status, when it gave one.
        sub_status: Option<u16>,
        /// The service's message (or, when `answered` is false, the client's).
        message: String,
        /// Whether `message` is what the endpoint answered. Callers that must not echo an
        /// endpoint's answers (the operator's status, Events and logs) use
        /// [`QueueError::without_answer`].
        answered: bool,
        /// The request's id (`x-ms-activity-id`), which Azure support and the account's
        /// diagnostic logs find it by.
        request_id: Option<String>,
    },
    /// A message that cannot be enqueued as it is.
    #[error("invalid message: {0}")]
    InvalidMessage(#[from] MessageError),
    /// Our lock expired and another consumer of the group took the message; our outcome was
    /// not recorded and the other holder's delivery stands.
    #[error("lost the lock on message {message_id} in group {group}: it expired and another consumer holds it")]
    LockLost {
        /// The group.
        group: String,
        /// The message's id.
        message_id: String,
    },
    /// A document of the messages container that is not a message.
    #[error("malformed document {id:?} in {container}: {reason}")]
    Malformed {
        /// The container.
        container: String,
        /// The document's id.
        id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A group's state document that this version cannot read (written by a newer version
    /// during a rolling upgrade, or edited by hand). It is left alone, never overwritten.
    #[error("the state of message {id:?} in group {group} is not one this version understands: {reason}")]
    UnknownState {
        /// The group.
        group: String,
        /// The message's id.
        id: String,
        /// What this version could not read.
        reason: String,
    },
    /// Settings that cannot work; the text names the setting.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A document that did not (de)serialize.
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
}

impl QueueError {
    /// Wraps an SDK error with the operation it came from.
    pub fn cosmos(operation: &'static str) -> impl FnOnce(CosmosError) -> Self {
        move |e| QueueError::Cosmos {
            operation,
            status: status_of(&e),
            sub_status: e.status().sub_status().map(|s| s.value()),
            message: e.to_string(),
            answered: e.is_from_wire(),
            request_id: e
                .response()
                .and_then(|r| r.headers().activity_id.as_ref())
                .map(ToString::to_string),
        }
    }

    /// The error as someone who may not read what the endpoint answered sees it: what was
    /// being done, the status, the sub-status and the request id, with a meaning of the
    /// status in place of the answer's text. The operator dials endpoints a namespace user
    /// writes; copying an answer into a resource's status would let that user read, through
    /// the operator, whatever the endpoint returns.
    pub fn without_answer(&self) -> String {
        match self {
            QueueError::Cosmos {
                operation,
                status,
                sub_status,
                message,
                answered,
                request_id,
            } => {
                let code = match sub_status {
                    Some(sub) => format!("{status}/{sub}"),
                    None => status.to_string(),
                };
                let id = request_id
                    .as_ref()
                    .map(|id| format!(", request id {id}"))
                    .unwrap_or_default();
                let what = if *answered {
                    meaning(*status)
                } else {
                    message.as_str()
                };
                format!("Cosmos DB {operation} failed with status {code}{id}: {what}")
            }
            QueueError::Json(e) => format!(
                "a Cosmos DB answer is not the JSON expected ({:?} error at line {}, column {})",
                e.classify(),
                e.line(),
                e.column()
            ),
            other => other.to_string(),
        }
    }

    /// The HTTP status of a Cosmos error, if this is one.
    pub fn status(&self) -> Option<u16> {
        match self {
            QueueError::Cosmos { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether retrying the same call later may succeed (throttling, unavailability, timeouts).
    pub fn is_transient(&self) -> bool {
        matches!(self.status(), Some(408 | 410 | 429 | 449 | 500 | 503))
    }

    /// Whether the same call can never succeed: the request itself is refused (400 bad
    /// request, 403 forbidden, 413 too large) or the data cannot be read. Retrying such an
    /// error would loop forever; the caller records an outcome instead.
    pub fn is_permanent(&self) -> bool {
        match self {
            QueueError::Cosmos { status, .. } => matches!(status, 400 | 403 | 413),
            QueueError::InvalidMessage(_)
            | QueueError::Malformed { .. }
            | QueueError::UnknownState { .. }
            | QueueError::Config(_)
            | QueueError::Json(_) => true,
            QueueError::LockLost { .. } => false,
        }
    }
}

/// What a status means to whoever configured the queue (pure).
fn meaning(status: u16) -> &'static str {
    match status {
        400 => "the request was refused as malformed",
        401 => "the credentials were refused (a wrong or rotated key, or a token of another tenant)",
        403 => "forbidden (the account's firewall or private-endpoint-only access, or an identity without the data-plane role)",
        404 => "not found",
        408 => "the request timed out",
        409 => "conflict",
        412 => "the document changed since it was read",
        413 => "the request is too large",
        429 => "throttled: the container's request units are spent",
        449 => "a concurrent write; retry",
        500 => "the service failed",
        503 => "the service is unavailable",
        _ => "the answer is not one a Cosmos DB account gives (is the endpoint an account endpoint?)",
    }
}

/// The HTTP status of an SDK error (the codes below are the ones the engine acts on).
pub fn status_of(e: &CosmosError) -> u16 {
    u16::from(e.status().status_code())
}

pub(crate) const CONFLICT: u16 = 409;
/// Not found: a document, container or database that does not exist.
pub const NOT_FOUND: u16 = 404;
pub(crate) const PRECONDITION_FAILED: u16 = 412;
pub(crate) const TOO_LARGE: u16 = 413;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_answer_an_error_keeps_its_status_and_request_id_and_drops_what_was_said() {
        let answered = QueueError::Cosmos {
            operation: "read account",
            status: 500,
            sub_status: Some(1002),
            message: "internal-service-secret".into(),
            answered: true,
            request_id: Some("7f3c".into()),
        };
        let text = answered.without_answer();
        assert!(!text.contains("internal-service-secret"), "{text}");
        assert!(
            text.starts_with(
                "Cosmos DB read account failed with status 500/1002, request id 7f3c: "
            ),
            "{text}"
        );
        // The engine's own logs (the sidecar's, in the user's pod) keep the answer.
        assert!(answered.to_string().contains("internal-service-secret"));
        // What the client said (no answer came) is kept: it says why nothing answered.
        let unreachable = QueueError::Cosmos {
            operation: "read account",
            status: 0,
            sub_status: None,
            message: "dns error: no such host".into(),
            answered: false,
            request_id: None,
        };
        assert!(unreachable
            .without_answer()
            .ends_with("dns error: no such host"));
        // A parser's message would quote the document; only its position is kept.
        let json = QueueError::Json(serde_json::from_str::<bool>("\"quoted-secret\"").unwrap_err());
        assert!(
            !json.without_answer().contains("quoted-secret"),
            "{}",
            json.without_answer()
        );
    }
}
