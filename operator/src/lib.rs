//! The cosmosq operator. So far, its pure parts: the objects a QueueConsumerGroup owns
//! (`build`) and the scaling decision (`scaling`). The controller that fetches, applies them by
//! server-side apply and writes status builds on these (see the open operator issue).
#![forbid(unsafe_code)]

pub mod build;
pub mod scaling;
