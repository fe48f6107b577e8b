//! Running queries with request-unit accounting.

use azure_data_cosmos::{ContainerClient, FeedScope, Query};
use futures::StreamExt;
use serde::de::DeserializeOwned;

use crate::cosmos::charge::RequestCharges;
use crate::error::{QueueError, Result};

/// Runs `query` across the container and returns at most `limit` items (all when `None`),
/// page by page so that every page's request charge is counted.
pub(crate) async fn collect<T: DeserializeOwned + Send + 'static>(
    container: &ContainerClient,
    query: Query,
    scope: FeedScope,
    limit: Option<usize>,
    charges: &RequestCharges,
    operation: &'static str,
) -> Result<Vec<T>> {
    let mut pages = container
        .query_items::<T>(query, scope, None)
        .await
        .map_err(QueueError::cosmos(operation))?
        .into_pages();
    let mut items = Vec::new();
    while let Some(page) = pages.next().await {
        let page = page.map_err(QueueError::cosmos(operation))?;
        charges.record_diagnostics(operation, &page.diagnostics());
        items.extend(page.into_items());
        if limit.is_some_and(|n| items.len() >= n) {
            items.truncate(limit.unwrap_or(usize::MAX));
            break;
        }
    }
    Ok(items)
}

/// A parameterised query; parameter values are plain JSON-serialisable values.
pub(crate) fn query(text: &str, params: &[(&str, serde_json::Value)]) -> Result<Query> {
    let mut q = Query::from(text.to_owned());
    for (name, value) in params {
        q = q
            .with_parameter(*name, value)
            .map_err(QueueError::cosmos("build query"))?;
    }
    Ok(q)
}
