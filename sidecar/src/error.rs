//! The sidecar's errors.

#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Queue(#[from] cosmosq_queue::QueueError),
    #[error("Kubernetes API: {0}")]
    Kubernetes(String),
}
