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
        /// The service's message.
        message: String,
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

/// The HTTP status of an SDK error (the codes below are the ones the engine acts on).
pub fn status_of(e: &CosmosError) -> u16 {
    u16::from(e.status().status_code())
}

pub(crate) const CONFLICT: u16 = 409;
/// Not found: a document, container or database that does not exist.
pub const NOT_FOUND: u16 = 404;
pub(crate) const PRECONDITION_FAILED: u16 = 412;
pub(crate) const TOO_LARGE: u16 = 413;
