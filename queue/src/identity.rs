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
