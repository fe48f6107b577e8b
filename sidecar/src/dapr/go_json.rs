//! JSON field names matched as daprd's Go decoder matches them: exactly, or else without regard
//! to case. The SDKs lean on it (the JavaScript SDK's bulk publish sends `entryID`, Dapr's
//! documentation `entryId`), so what daprd accepts, the sidecar accepts. Unknown fields are
//! ignored, as Go ignores them.

use serde_json::{Map, Value};

/// Renames each key of `object` that spells one of `fields` in another case to the field's
/// spelling; values are not touched (a message's own data keeps its keys). Where a body has
/// the field under two spellings, the exact one wins (Go would take the last in the document,
/// an order a parsed object no longer has). Pure.
pub fn fold_keys(object: &mut Map<String, Value>, fields: &[&str]) {
    let renames: Vec<(String, &str)> = object
        .keys()
        .filter(|key| !fields.contains(&key.as_str()))
        .filter_map(|key| {
            let field = fields.iter().find(|f| f.eq_ignore_ascii_case(key))?;
            Some((key.clone(), *field))
        })
        .collect();
    for (key, field) in renames {
        if let Some(value) = object.remove(&key) {
            object.entry(field).or_insert(value);
        }
    }
}

/// [`fold_keys`] on `value` if it is an object.
pub fn fold(value: &mut Value, fields: &[&str]) {
    if let Value::Object(object) = value {
        fold_keys(object, fields);
    }
}

/// [`fold`] on each element of `value` if it is a list.
pub fn fold_each(value: &mut Value, fields: &[&str]) {
    if let Value::Array(items) = value {
        for item in items {
            fold(item, fields);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_in_another_case_take_the_fields_spelling_and_nothing_else_changes() {
        let table = [
            (json!({"entryID": "1"}), json!({"entryId": "1"})),
            (json!({"ENTRYID": "1"}), json!({"entryId": "1"})),
            (json!({"entryId": "1"}), json!({"entryId": "1"})),
            // Two spellings of one field: the exact one wins, the other is dropped.
            (
                json!({"entryID": "a", "entryId": "b"}),
                json!({"entryId": "b"}),
            ),
            // Unknown fields stay (the decoder ignores them); values keep their keys.
            (
                json!({"Event": {"EntryID": 1}, "other": 2}),
                json!({"event": {"EntryID": 1}, "other": 2}),
            ),
            (json!("not an object"), json!("not an object")),
        ];
        for (mut given, expected) in table {
            let row = given.to_string();
            fold(&mut given, &["entryId", "event"]);
            assert_eq!(given, expected, "{row}");
        }
    }
}
