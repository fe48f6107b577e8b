//! The cosmosq operator. So far: the objects a QueueConsumerGroup owns (`build`, pure), the
//! apply step that writes them by server-side apply with one field manager (`apply`, tested
//! against kube's mock service), and the scaling decision (`scaling`, pure). The controller
//! loop (watch, finalizers, status, Events, the scaling loop, HPA metrics) builds on these.
#![forbid(unsafe_code)]

pub mod apply;
pub mod build;
pub mod scaling;
