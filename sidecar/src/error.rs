//! The sidecar's errors.

/// What stops the sidecar.
#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    /// Settings that cannot work; the text names the setting.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The engine failed.
    #[error(transparent)]
    Queue(#[from] cosmosq_queue::QueueError),
    /// A Kubernetes API call failed (the deletion cost).
    #[error("Kubernetes API: {0}")]
    Kubernetes(String),
}
