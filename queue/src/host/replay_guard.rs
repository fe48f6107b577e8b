//! The messages a range already read, by identity: a feed that serves documents again (the
//! emulator renumbers a merged range's feed) does not deliver them twice.

use std::sync::Arc;

use tracing::warn;

/// Identities read lately, in read order, at most [`SEEN_CAP`]. Each is stored once, shared
/// by the set and the order.
#[derive(Debug, Default)]
pub(super) struct Seen {
    pub(super) ids: std::collections::HashSet<Arc<str>>,
    pub(super) order: std::collections::VecDeque<Arc<str>>,
}

/// How many identities a range remembers having read (about 70 bytes each, with the set's
/// slot).
pub(super) const SEEN_CAP: usize = 20_000;

impl Seen {
    /// Drops the documents read before (keeping the first of repeats within the page), and
    /// remembers the rest. Documents are known by identity (id and key): the same id under
    /// another key is another message.
    pub(super) fn first_reads(
        &mut self,
        docs: Vec<serde_json::Value>,
        key_field: &str,
    ) -> Vec<serde_json::Value> {
        let before = docs.len();
        let fresh: Vec<serde_json::Value> = docs
            .into_iter()
            .filter(|doc| match crate::identity::of_document(doc, key_field) {
                Some(identity) if self.ids.contains(identity.as_str()) => false,
                Some(identity) => {
                    let identity: Arc<str> = Arc::from(identity);
                    self.ids.insert(Arc::clone(&identity));
                    self.order.push_back(identity);
                    true
                }
                None => true,
            })
            .collect();
        while self.order.len() > SEEN_CAP {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
        if fresh.len() < before {
            warn!(
                again = before - fresh.len(),
                "the feed served documents this range already read; skipped them"
            );
        }
        fresh
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn page(ids: &[&str]) -> Vec<serde_json::Value> {
        ids.iter()
            .map(|id| serde_json::json!({ "id": id, "pk": "k" }))
            .collect()
    }

    pub(super) fn ids(docs: &[serde_json::Value]) -> Vec<&str> {
        docs.iter()
            .map(|d| d["id"].as_str().unwrap_or("-"))
            .collect()
    }

    #[test]
    pub(super) fn a_range_delivers_each_message_it_read_once_and_forgets_the_oldest_past_the_cap() {
        let mut seen = Seen::default();
        assert_eq!(
            ids(&seen.first_reads(page(&["a", "b", "a"]), "pk")),
            ["a", "b"]
        );
        // Served again after a merge renumbered the feed: skipped; documents without an id
        // are left for the malformed-document path; the same id under another key is another
        // message.
        let again = seen.first_reads(
            vec![
                serde_json::json!({"id": "b", "pk": "k"}),
                serde_json::json!({"no": "id"}),
                serde_json::json!({"id": "c", "pk": "k"}),
                serde_json::json!({"id": "b", "pk": "other"}),
            ],
            "pk",
        );
        assert_eq!(ids(&again), ["-", "c", "b"]);
        let many: Vec<String> = (0..SEEN_CAP).map(|i| format!("m{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(seen.first_reads(page(&many), "pk").len(), SEEN_CAP);
        assert_eq!((seen.ids.len(), seen.order.len()), (SEEN_CAP, SEEN_CAP));
        // "a", "b" and "c" were the oldest: forgotten, so read as new; "m0" is still known.
        assert_eq!(
            ids(&seen.first_reads(page(&["a", "m0", "c"]), "pk")),
            ["a", "c"]
        );
    }
}
