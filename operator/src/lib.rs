//! The cosmosq operator. So far: the objects a QueueConsumerGroup owns (`build`, pure), the
//! apply step that writes them by server-side apply with one field manager (`apply`), one
//! reconcile pass over a group with its status conditions (`reconcile`) — both tested against
//! kube's mock service — and the scaling decision (`scaling`, pure). Still to come: the
//! controller binary (watches, leader election, metrics), CosmosQueue provisioning with its
//! finalizer, Events, the scaling loop and HPA-mode metrics.
#![forbid(unsafe_code)]

pub mod apply;
pub mod build;
pub mod reconcile;
pub mod scaling;
