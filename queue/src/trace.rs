//! W3C trace context carried with a message, so one trace spans enqueue → delivery → the app.
//!
//! The producer's `traceparent` and `tracestate` are stored in the message's metadata under
//! those names (where any producer, in any language, can put them too) and handed to the app
//! with the delivery, as headers and in the CloudEvent, the way Dapr's pub/sub does.

/// The metadata key of the W3C `traceparent`.
pub const TRACEPARENT: &str = "traceparent";
/// The metadata key of the W3C `tracestate`.
pub const TRACESTATE: &str = "tracestate";

/// The most `tracestate` a message carries (W3C: 32 list members of at most 256 characters;
/// vendors may drop what is longer, and so do we).
const MAX_TRACESTATE: usize = 32 * 257;

/// A message's trace context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`.
    pub traceparent: String,
    /// Vendor entries, passed on as they came.
    pub tracestate: Option<String>,
}

impl TraceContext {
    /// A context from W3C headers; `None` when `traceparent` is absent or malformed (W3C:
    /// then the `tracestate` is ignored too).
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let traceparent = traceparent.trim().to_ascii_lowercase();
        is_traceparent(&traceparent).then(|| Self {
            traceparent,
            tracestate: tracestate
                .map(str::trim)
                .filter(|s| !s.is_empty() && s.len() <= MAX_TRACESTATE && is_visible_ascii(s))
                .map(str::to_owned),
        })
    }

    /// A new trace (sampled), for a message enqueued without one.
    pub fn new_root() -> Self {
        let trace = uuid::Uuid::new_v4().simple().to_string();
        let span = &uuid::Uuid::new_v4().simple().to_string()[..16];
        Self {
            traceparent: format!("00-{trace}-{span}-01"),
            tracestate: None,
        }
    }

    /// The context stored in a message's metadata, when it holds a valid one.
    pub fn from_metadata(metadata: &std::collections::BTreeMap<String, String>) -> Option<Self> {
        let traceparent = metadata.get(TRACEPARENT)?;
        Self::parse(traceparent, metadata.get(TRACESTATE).map(String::as_str))
    }

    /// Writes this context into a message's metadata, replacing any other.
    pub fn store(&self, metadata: &mut std::collections::BTreeMap<String, String>) {
        metadata.insert(TRACEPARENT.into(), self.traceparent.clone());
        match &self.tracestate {
            Some(state) => metadata.insert(TRACESTATE.into(), state.clone()),
            None => metadata.remove(TRACESTATE),
        };
    }

    /// The 32 hex digits of the trace id.
    pub fn trace_id(&self) -> &str {
        &self.traceparent[3..35]
    }
}

/// `version-traceid-parentid-flags` in lowercase hex, with the all-zero ids W3C forbids refused.
fn is_traceparent(text: &str) -> bool {
    let parts: Vec<&str> = text.split('-').collect();
    let hex = |p: &str| p.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
    parts.len() == 4
        && [2, 32, 16, 2]
            .iter()
            .zip(&parts)
            .all(|(len, p)| p.len() == *len && hex(p))
        && parts[0] != "ff"
        && parts[1].bytes().any(|b| b != b'0')
        && parts[2].bytes().any(|b| b != b'0')
}

fn is_visible_ascii(text: &str) -> bool {
    text.bytes().all(|b| (0x20..0x7f).contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn w3c_examples_parse_and_invalid_ones_do_not() {
        let t = TraceContext::parse(PARENT, Some("congo=t61rcWkgMzE")).unwrap();
        assert_eq!(t.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
        assert_eq!(
            TraceContext::parse(&PARENT.to_uppercase(), None)
                .unwrap()
                .traceparent,
            PARENT,
            "normalised to lowercase"
        );
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceContext::parse(bad, Some("a=b")), None, "{bad:?}");
        }
        assert_eq!(
            TraceContext::parse(PARENT, Some("bad\u{7f}"))
                .unwrap()
                .tracestate,
            None,
            "an unusable tracestate is dropped, the traceparent kept"
        );
    }

    #[test]
    fn a_new_root_is_valid_and_sampled() {
        let root = TraceContext::new_root();
        assert_eq!(
            TraceContext::parse(&root.traceparent, None),
            Some(root.clone())
        );
        assert!(root.traceparent.ends_with("-01"));
        assert_ne!(root.trace_id(), TraceContext::new_root().trace_id());
    }
}
