//! The cosmosq operator. So far: the scaling decision, a pure function of what the estimator
//! reports; the controller that applies it (reconcile, Deployments, HPA mode) builds on it.
#![forbid(unsafe_code)]

pub mod scaling;
