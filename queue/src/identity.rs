//! A message's identity: its id *and* its partition key, as Cosmos DB knows an item. Ids are
//! unique only within a key (per-tenant sequence numbers are common ids), so everything that
//! names a message — the ids a range read, a lease's window, markers, state — names both.
//!
//! Where many identities are stored together (a lease's window holds up to four times the
//! range's in-flight limit), each is a fingerprint: 96 bits of SHA-256 over the id and the
//! key's canonical JSON, 16 characters of URL-safe base64. A lease stays small and bounded
//! whatever the ids and keys are (a key may be 2 KB), and two messages of one window share a
//! fingerprint with a probability of about n²/2⁹⁷ (10⁻²³ for a full window).

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::message::MessageKey;

/// A message's identity as stored in a lease's window (see the module docs).
pub fn fingerprint(id: &str, key: &MessageKey) -> String {
    if crate::buggify::on(crate::buggify::Bug::IdentityById) {
        return id_only(id);
    }
    let mut hash = Sha256::new();
    // The id's length first: ("ab", "c") and ("a", "bc") never meet.
    hash.update((id.len() as u32).to_be_bytes());
    hash.update(id.as_bytes());
    hash.update(key.canonical().as_bytes());
    let digest = hash.finalize();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&digest[..12])
}

/// What [`fingerprint`] was before identities had keys (the defect it replaced).
fn id_only(id: &str) -> String {
    let digest = Sha256::digest(id.as_bytes());
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&digest[..12])
}

/// The fingerprint of a document of the messages container; `None` without a string id or a
/// valid key (a malformed document, skipped elsewhere with its reason).
pub fn of_document(doc: &Value, key_field: &str) -> Option<String> {
    let id = doc.get("id")?.as_str()?;
    let key = MessageKey::from_json(doc.get(key_field)?.clone()).ok()?;
    Some(fingerprint(id, &key))
}

/// Whether `doc` is the message `id` under `key` (a marker's check).
pub fn is(doc: &Value, key_field: &str, id: &str, key: &Value) -> bool {
    if crate::buggify::on(crate::buggify::Bug::IdentityById) {
        return doc.get("id").and_then(Value::as_str) == Some(id);
    }
    doc.get("id").and_then(Value::as_str) == Some(id) && doc.get(key_field) == Some(key)
}

/// A set of identities that answers "maybe" for about 1 in 120 it does not hold and never "no"
/// for one it holds (a Bloom filter: 10 bits and 7 probes an identity). Where a reader only
/// needs to be careful with what a set may hold (the messages a lease's window handed out
/// unstarted), it costs 1.25 bytes an identity instead of a fingerprint's 19, so a page's lease
/// write does not grow with the page. Its members cannot be listed; filters are kept whole.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityFilter {
    /// Identities added.
    pub n: u32,
    /// The bits, URL-safe base64 (a multiple of 8 bits).
    bits: String,
}

/// Probes an identity sets in an [`IdentityFilter`] (with 10 bits an identity: 0.8 % false
/// "maybe"). Part of the stored format.
const FILTER_PROBES: u64 = 7;
const FILTER_BITS_PER_IDENTITY: usize = 10;

impl IdentityFilter {
    /// A filter holding `identities`.
    pub fn of<'a>(identities: impl ExactSizeIterator<Item = &'a String>) -> Self {
        let n = identities.len();
        let mut bytes = vec![0u8; (n * FILTER_BITS_PER_IDENTITY).div_ceil(8).max(8)];
        let m = bytes.len() as u64 * 8;
        for identity in identities {
            for bit in probes(identity, m) {
                bytes[(bit / 8) as usize] |= 1 << (bit % 8);
            }
        }
        Self {
            n: n as u32,
            bits: base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes),
        }
    }

    /// Whether `identity` may be in the set (a filter that does not decode says yes: a
    /// reader is careful with what it cannot read).
    pub fn may_hold(&self, identity: &str) -> bool {
        let Ok(bytes) = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(&self.bits) else {
            return true;
        };
        if bytes.is_empty() {
            return self.n > 0;
        }
        let m = bytes.len() as u64 * 8;
        probes(identity, m).all(|bit| bytes[(bit / 8) as usize] & (1 << (bit % 8)) != 0)
    }
}

/// The bits an identity sets in a filter of `m` bits: double hashing over SHA-256 of the
/// identity (any string: fingerprints, or ids in older windows).
fn probes(identity: &str, m: u64) -> impl Iterator<Item = u64> {
    let digest = Sha256::digest(identity.as_bytes());
    let word = |at: usize| u64::from_be_bytes(digest[at..at + 8].try_into().expect("8 bytes"));
    let (h1, h2) = (word(0), word(8) | 1);
    (0..FILTER_PROBES).map(move |i| h1.wrapping_add(i.wrapping_mul(h2)) % m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_same_id_under_two_keys_is_two_messages() {
        let key = |v: Value| MessageKey::from_json(v).unwrap();
        let a = fingerprint("inv-1", &key(json!("tenant-a")));
        let b = fingerprint("inv-1", &key(json!("tenant-b")));
        assert_ne!(a, b);
        assert_eq!(a, fingerprint("inv-1", &key(json!("tenant-a"))), "stable");
        assert_eq!(a.len(), 16);
        // Keys keep their JSON type: 5 and "5" are two keys.
        assert_ne!(
            fingerprint("m", &key(json!(5))),
            fingerprint("m", &key(json!("5")))
        );
        // The id's length separates where the id ends and the key begins.
        assert_ne!(
            fingerprint("a\"", &key(json!("b"))),
            fingerprint("a", &key(json!("\"b")))
        );
    }

    #[test]
    fn a_filter_never_forgets_and_rarely_imagines() {
        let key = MessageKey::from_json(json!("k")).unwrap();
        let held: Vec<String> = (0..500)
            .map(|i| fingerprint(&format!("m{i}"), &key))
            .collect();
        let filter = IdentityFilter::of(held.iter());
        assert_eq!(filter.n, 500);
        assert!(held.iter().all(|x| filter.may_hold(x)), "never a false no");
        let imagined = (500..10_500)
            .filter(|i| filter.may_hold(&fingerprint(&format!("m{i}"), &key)))
            .count();
        assert!(
            imagined < 200,
            "{imagined} of 10,000 not held answered maybe"
        );
        // 1.25 bytes an identity, base64: a page of 500 costs about 830 characters.
        assert!(filter.bits.len() < 900, "{}", filter.bits.len());
        let stored = serde_json::to_value(&filter).unwrap();
        let read: IdentityFilter = serde_json::from_value(stored).unwrap();
        assert_eq!(read, filter);
        let empty = IdentityFilter::of(std::iter::empty());
        assert!(!empty.may_hold(&held[0]));
        let unreadable = IdentityFilter {
            n: 1,
            bits: "!".into(),
        };
        assert!(
            unreadable.may_hold(&held[0]),
            "what cannot be read may hold anything"
        );
    }

    #[test]
    fn a_document_is_known_by_its_id_and_key() {
        let doc = json!({"id": "inv-1", "pk": "tenant-a", "body": 1});
        assert_eq!(
            of_document(&doc, "pk"),
            Some(fingerprint(
                "inv-1",
                &MessageKey::from_json(json!("tenant-a")).unwrap()
            ))
        );
        assert_eq!(of_document(&json!({"id": "x"}), "pk"), None, "no key");
        assert!(is(&doc, "pk", "inv-1", &json!("tenant-a")));
        assert!(!is(&doc, "pk", "inv-1", &json!("tenant-b")));
    }
}
