//! Reading the messages container's change feed.

use std::num::NonZeroU32;
use std::sync::Arc;

use azure_data_cosmos::feed::{ChangeFeedPageIterator, ContinuationToken};
use azure_data_cosmos::models::ChangeFeedItem;
use azure_data_cosmos::options::{ChangeFeedOptions, ChangeFeedStartFrom, MaxItemCountHint};
use azure_data_cosmos::{ContainerClient, FeedScope};
use futures::StreamExt;
use serde_json::Value;

use crate::config::StartFrom;
use crate::cosmos::charge::RequestCharges;
use crate::error::{QueueError, Result};

pub(crate) type Pages = ChangeFeedPageIterator<ChangeFeedItem<Value>>;

/// One page of [`Pages`].
pub(crate) type PageOf = azure_data_cosmos::feed::FeedPage<ChangeFeedItem<Value>>;

/// Opens the feed of `scope` at `position` (a continuation token), or at `start` without one.
pub(crate) async fn open(
    container: &ContainerClient,
    scope: FeedScope,
    start: StartFrom,
    position: Option<&str>,
    page_size: u32,
    operation: &'static str,
) -> Result<Pages> {
    let start = match start {
        StartFrom::Beginning => ChangeFeedStartFrom::Beginning,
        StartFrom::Now => ChangeFeedStartFrom::Now,
    };
    let hint = NonZeroU32::new(page_size)
        .map(MaxItemCountHint::Limit)
        .unwrap_or(MaxItemCountHint::ServerDecides);
    let mut options = ChangeFeedOptions::default().with_max_item_count(hint);
    if let Some(token) = position {
        options = options.with_continuation_token(ContinuationToken::from_string(token.to_owned()));
    }
    container
        .query_change_feed::<Value>(scope, start, Some(options))
        .await
        .map_err(QueueError::cosmos(operation))
}

/// One page of a range's feed.
#[derive(Debug, Default)]
pub(crate) struct Page {
    pub(crate) docs: Vec<Value>,
    /// The position after it.
    pub(crate) token: Option<String>,
    /// The physical partition that served it: a change says the range split or merged.
    pub(crate) partition: Option<String>,
}

/// Reads one scope page by page, remembering the position so that a failed read resumes
/// where it was instead of starting over.
pub(crate) struct FeedReader {
    container: ContainerClient,
    scope: FeedScope,
    start: StartFrom,
    page_size: u32,
    position: Option<String>,
    pages: Option<Pages>,
    charges: Arc<RequestCharges>,
}

impl FeedReader {
    pub(crate) fn new(
        container: ContainerClient,
        scope: FeedScope,
        start: StartFrom,
        position: Option<String>,
        page_size: u32,
        charges: Arc<RequestCharges>,
    ) -> Self {
        Self {
            container,
            scope,
            start,
            page_size,
            position,
            pages: None,
            charges,
        }
    }

    /// The next page, of at most `max` items (a new page size reopens the feed at the
    /// position: no request is made for that).
    pub(crate) async fn next_page_of(&mut self, max: u32) -> Result<Page> {
        if max != self.page_size && max > 0 {
            self.page_size = max;
            self.pages = None;
        }
        self.next_page().await
    }

    /// The next page.
    pub(crate) async fn next_page(&mut self) -> Result<Page> {
        let pages = match &mut self.pages {
            Some(pages) => pages,
            empty => {
                let opened = open(
                    &self.container,
                    self.scope.clone(),
                    self.start,
                    self.position.as_deref(),
                    self.page_size,
                    "read change feed",
                )
                .await?;
                empty.insert(opened)
            }
        };
        match pages.next().await {
            Some(Ok(page)) => {
                self.charges
                    .record_diagnostics("read change feed", &page.diagnostics());
                let token = pages
                    .to_continuation_token()
                    .ok()
                    .map(|t| t.as_str().to_owned());
                if token.is_some() {
                    self.position = token.clone();
                }
                let partition = page.headers().partition_key_range_id().map(str::to_owned);
                let docs = page
                    .into_items()
                    .into_iter()
                    .filter_map(|i| i.current().cloned())
                    .collect();
                Ok(Page {
                    docs,
                    token,
                    partition,
                })
            }
            Some(Err(e)) => {
                self.pages = None;
                Err(QueueError::cosmos("read change feed")(e))
            }
            None => {
                self.pages = None;
                Ok(Page::default())
            }
        }
    }
}
