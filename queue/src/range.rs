//! Feed-range arithmetic: effective partition keys (EPKs, hex) and the ranges leases cover.
//! Pure functions, shared by leases (creation, splits, finer leases), the sweep (owned ranges)
//! and estimates.

use azure_data_cosmos::feed::FeedRange;
use base64::Engine as _;
use serde_json::{json, Value};

/// Hex bounds of a feed range.
pub fn range_bounds(range: &FeedRange) -> (String, String) {
    (
        range.min_inclusive().to_hex(),
        range.max_exclusive().to_hex(),
    )
}

/// A range for people: the first 8 hex digits of each bound, `00` for the open lower one
/// (`00..20000000`).
pub fn label(min: &str, max: &str) -> String {
    let short = |hex: &str| -> String {
        if hex.is_empty() {
            "00".into()
        } else {
            hex.chars().take(8).collect()
        }
    };
    format!("{}..{}", short(min), short(max))
}

/// Compares hex EPKs in key order ("" is the minimum, "FF" the maximum).
pub fn epk_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    a.to_ascii_uppercase().cmp(&b.to_ascii_uppercase())
}

/// The effective partition key (hex, as lease bounds are) of a message key in a container
/// partitioned by `definition`.
pub fn key_epk(
    key: &crate::message::MessageKey,
    definition: &azure_data_cosmos::models::PartitionKeyDefinition,
) -> String {
    FeedRange::for_partition(key.to_partition_key(), definition)
        .min_inclusive()
        .to_hex()
}

/// Whether `epk` falls in the range `[min, max)`.
pub fn epk_in(epk: &str, min: &str, max: &str) -> bool {
    epk_cmp(epk, min).is_ge() && epk_cmp(epk, max).is_lt()
}

/// How many of the physical `partitions` (EPK bounds) hold part of `[min, max)`: the pages a
/// read of that range must see before an empty one is the end of its feed. Pure.
pub fn partitions_spanned(partitions: &[(String, String)], min: &str, max: &str) -> usize {
    partitions
        .iter()
        .filter(|(lo, hi)| epk_cmp(lo, max).is_lt() && epk_cmp(min, hi).is_lt())
        .count()
}

/// Narrows a continuation token of a parent range to one of its sub-ranges (a split child),
/// keeping the parent's position: the child partition continues the parent's LSNs, as the
/// change feed processor's child leases do. `None` if the token's format is not understood
/// (the child then starts from the parent's token as is: at-least-once, nothing skipped).
pub fn narrow_continuation(token: &str, min_epk: &str, max_epk: &str) -> Option<String> {
    let mut state = decode_continuation(token)?;
    let active = state
        .get_mut("root")?
        .get_mut("active_tokens")?
        .as_array_mut()?;
    let mut narrowed = Vec::new();
    for t in active.iter() {
        let (lo, hi) = token_bounds(t)?;
        // Keep the parts overlapping [min_epk, max_epk), clipped to it.
        let new_lo = if epk_cmp(lo, min_epk).is_lt() {
            min_epk
        } else {
            lo
        };
        let new_hi = if epk_cmp(hi, max_epk).is_gt() {
            max_epk
        } else {
            hi
        };
        if epk_cmp(new_lo, new_hi).is_lt() {
            let mut t = t.clone();
            t["min_epk"] = json!(new_lo);
            t["max_epk"] = json!(new_hi);
            narrowed.push(t);
        }
    }
    if narrowed.is_empty() {
        return None;
    }
    *active = narrowed;
    Some(format!(
        "c1.{}",
        TOKEN_ENGINE.encode(serde_json::to_vec(&state).ok()?)
    ))
}

/// The EPK sub-ranges a continuation token keeps a position for: one, until its range spans
/// several partitions (a split), then one per part, each read and resumed on its own (also
/// after a merge). `None` if the token's format is not understood.
pub fn continuation_ranges(token: &str) -> Option<Vec<(String, String)>> {
    let state = decode_continuation(token)?;
    state
        .get("root")?
        .get("active_tokens")?
        .as_array()?
        .iter()
        .map(|t| token_bounds(t).map(|(lo, hi)| (lo.to_owned(), hi.to_owned())))
        .collect()
}

const TOKEN_ENGINE: base64::engine::GeneralPurpose =
    base64::engine::general_purpose::URL_SAFE_NO_PAD;

fn decode_continuation(token: &str) -> Option<Value> {
    let body = token.strip_prefix("c1.")?;
    serde_json::from_slice(&TOKEN_ENGINE.decode(body).ok()?).ok()
}

fn token_bounds(t: &Value) -> Option<(&str, &str)> {
    Some((t.get("min_epk")?.as_str()?, t.get("max_epk")?.as_str()?))
}

/// Hash v2 effective partition keys have their two top bits cleared: every key is below this.
const HASH_V2_END: u128 = 0x40 << 120;

/// Splits `[min, max)` into `parts` EPK sub-ranges holding equal shares of the keys (hex
/// bounds, 16 bytes; `"FF"` ends the key space, which hash v2 fills only up to `40…`).
pub fn subdivide(min: &str, max: &str, parts: u32) -> Vec<(String, String)> {
    let value = |hex: &str| -> Option<u128> {
        if hex.eq_ignore_ascii_case("FF") {
            return Some(HASH_V2_END);
        }
        let padded = format!("{hex:0<32}");
        u128::from_str_radix(padded.get(..32)?, 16).ok()
    };
    let (Some(lo), Some(hi)) = (value(min), value(max)) else {
        return vec![(min.to_owned(), max.to_owned())];
    };
    if parts <= 1 || hi <= lo {
        return vec![(min.to_owned(), max.to_owned())];
    }
    let step = (hi - lo) / u128::from(parts);
    let mut bounds: Vec<String> = vec![min.to_owned()];
    for i in 1..parts {
        bounds.push(format!("{:032X}", lo + step * u128::from(i)));
    }
    bounds.push(max.to_owned());
    bounds
        .windows(2)
        .map(|w| (w[0].clone(), w[1].clone()))
        .collect()
}

/// The leases to create so that every physical range is read: the parts no lease covers. A
/// part is cut along the same grid as a new group's finer leases (`per_partition`), so hosts
/// that see different stages of one creation write the same leases, never overlapping ones.
pub fn missing_leases(
    physical: &[(String, String)],
    leases: &[(String, String)],
    per_partition: u32,
) -> Vec<(String, String)> {
    // Same point, same key: pad to 16 bytes ("FF" is the end of the key space).
    let key = |hex: &str| {
        if hex.eq_ignore_ascii_case("FF") {
            "FF".to_owned()
        } else {
            format!("{:0<32}", hex.to_ascii_uppercase())
        }
    };
    let mut covered: Vec<&(String, String)> = leases.iter().collect();
    covered.sort_by_key(|(min, _)| key(min));
    let mut missing = Vec::new();
    for (pmin, pmax) in physical {
        let mut gaps = Vec::new();
        let mut cursor = pmin.as_str();
        for (lmin, lmax) in &covered {
            if key(lmax) <= key(cursor) || key(lmin) >= key(pmax) {
                continue;
            }
            if key(lmin) > key(cursor) {
                gaps.push((cursor.to_owned(), lmin.clone()));
            }
            cursor = lmax;
        }
        if key(cursor) < key(pmax) {
            gaps.push((cursor.to_owned(), pmax.clone()));
        }
        let grid = subdivide(pmin, pmax, per_partition);
        for (gmin, gmax) in gaps {
            let pieces: Vec<(String, String)> = grid
                .iter()
                .filter(|(lo, hi)| key(lo) >= key(&gmin) && key(hi) <= key(&gmax))
                .cloned()
                .collect();
            let tiles = pieces.first().is_some_and(|(lo, _)| key(lo) == key(&gmin))
                && pieces.last().is_some_and(|(_, hi)| key(hi) == key(&gmax))
                && pieces.windows(2).all(|w| key(&w[0].1) == key(&w[1].0));
            if tiles {
                missing.extend(pieces);
            } else {
                missing.push((gmin, gmax));
            }
        }
    }
    missing
}

/// The physical ranges that now cover a lease's range `[min_epk, max_epk)`, when it split into two or more;
/// empty otherwise (including when ranges merged: a lease keeps reading its EPK sub-range).
pub fn split_children(
    min_epk: &str,
    max_epk: &str,
    physical: &[(String, String)],
) -> Vec<(String, String)> {
    let children: Vec<(String, String)> = physical
        .iter()
        .filter(|(min, max)| epk_cmp(min, min_epk).is_ge() && epk_cmp(max, max_epk).is_le())
        .cloned()
        .collect();
    let covers = children.len() >= 2
        && children.first().map(|c| c.0.as_str()) == Some(min_epk)
        && children.last().map(|c| c.1.as_str()) == Some(max_epk);
    if covers {
        children
    } else {
        Vec::new()
    }
}

/// Ranges merged where they touch (the leases of one host are often neighbours), sorted.
pub fn coalesce_ranges(ranges: &[(String, String)]) -> Vec<(String, String)> {
    let mut sorted = ranges.to_vec();
    sorted.sort_by(|a, b| epk_cmp(&a.0, &b.0));
    let mut merged: Vec<(String, String)> = Vec::with_capacity(sorted.len());
    for (min, max) in sorted {
        match merged.last_mut() {
            Some(last) if epk_cmp(&min, &last.1).is_le() => {
                if epk_cmp(&max, &last.1).is_gt() {
                    last.1 = max;
                }
            }
            _ => merged.push((min, max)),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect()
    }

    #[test]
    fn a_range_spans_the_partitions_it_overlaps() {
        let four = pairs(&[("", "10"), ("10", "20"), ("20", "30"), ("30", "FF")]);
        for (min, max, spanned) in [
            ("", "FF", 4),   // a lease made before the split
            ("", "10", 1),   // a child's own
            ("10", "30", 2), // two children
            ("18", "28", 2), // inside two
            ("30", "FF", 1),
            ("FF", "FF", 0), // empty
        ] {
            assert_eq!(
                partitions_spanned(&four, min, max),
                spanned,
                "[{min}, {max})"
            );
        }
    }

    #[test]
    fn missing_leases_fill_exactly_the_gaps_an_interrupted_creation_left() {
        let physical = pairs(&[("", "20"), ("20", "FF")]);
        // A new group: one lease per physical range.
        assert_eq!(missing_leases(&physical, &[], 1), physical);
        // Creation stopped after the first: only the second is missing.
        assert_eq!(
            missing_leases(&physical, &pairs(&[("", "20")]), 1),
            pairs(&[("20", "FF")])
        );
        // Every range covered (a merged partition read by its two old leases): nothing.
        let merged = pairs(&[("", "FF")]);
        assert!(missing_leases(&merged, &physical, 1).is_empty());
        // Same points written differently are the same point.
        assert!(missing_leases(&pairs(&[("", "2")]), &pairs(&[("", "20000000")]), 1).is_empty());
        // Finer leases: the missing ones are cut on the same grid as a new group's, so two
        // hosts seeing different stages of the creation write identical leases.
        let grid = subdivide("", "FF", 4);
        let made = vec![grid[0].clone(), grid[2].clone()];
        assert_eq!(
            missing_leases(&pairs(&[("", "FF")]), &made, 4),
            vec![grid[1].clone(), grid[3].clone()]
        );
    }

    fn token(active: Value) -> String {
        let state = json!({"op": "ChangeFeed", "rid": "r", "root": {"kind": "unordered_merge", "active_tokens": active, "start_from": {"kind": "beginning"}}});
        format!(
            "c1.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode(serde_json::to_vec(&state).unwrap())
        )
    }

    fn decode(token: &str) -> Value {
        let body = token.strip_prefix("c1.").unwrap();
        serde_json::from_slice(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(body)
                .unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn narrowing_keeps_the_parent_position_for_each_child() {
        let parent =
            token(json!([{"min_epk": "", "max_epk": "80", "server_continuation": "lsn-42"}]));
        let left = decode(&narrow_continuation(&parent, "", "40").unwrap());
        assert_eq!(
            left["root"]["active_tokens"],
            json!([{"min_epk": "", "max_epk": "40", "server_continuation": "lsn-42"}])
        );
        let right = decode(&narrow_continuation(&parent, "40", "80").unwrap());
        assert_eq!(
            right["root"]["active_tokens"],
            json!([{"min_epk": "40", "max_epk": "80", "server_continuation": "lsn-42"}])
        );
        assert_eq!(right["root"]["start_from"], json!({"kind": "beginning"}));
    }

    #[test]
    fn narrowing_picks_the_overlapping_parts() {
        let parent = token(json!([
            {"min_epk": "", "max_epk": "40", "server_continuation": "a"},
            {"min_epk": "40", "max_epk": "FF", "server_continuation": "b"}
        ]));
        let child = decode(&narrow_continuation(&parent, "40", "80").unwrap());
        assert_eq!(
            child["root"]["active_tokens"],
            json!([{"min_epk": "40", "max_epk": "80", "server_continuation": "b"}])
        );
        assert!(narrow_continuation("opaque-server-token", "", "40").is_none());
    }

    #[test]
    fn a_token_names_the_sub_ranges_it_keeps_a_position_for() {
        let split = token(json!([
            {"min_epk": "", "max_epk": "40", "server_continuation": "a"},
            {"min_epk": "40", "max_epk": "80", "server_continuation": "b"}
        ]));
        assert_eq!(
            continuation_ranges(&split).unwrap(),
            vec![("".to_owned(), "40".to_owned()), ("40".into(), "80".into())]
        );
        assert!(continuation_ranges("opaque-server-token").is_none());
        assert!(continuation_ranges(&token(json!([{"min_epk": ""}]))).is_none());
    }

    #[test]
    fn split_children_cover_the_parent_exactly() {
        let lease = ("", "80");
        let physical = vec![
            ("".to_string(), "40".to_string()),
            ("40".into(), "80".into()),
            ("80".into(), "FF".into()),
        ];
        assert_eq!(
            split_children(lease.0, lease.1, &physical),
            physical[..2].to_vec()
        );
        let whole = ("", "FF");
        assert_eq!(split_children(whole.0, whole.1, &physical).len(), 3);
        let same = ("80", "FF");
        assert!(
            split_children(same.0, same.1, &physical).is_empty(),
            "not split"
        );
        let merged = vec![("".to_string(), "FF".to_string())];
        assert!(
            split_children(lease.0, lease.1, &merged).is_empty(),
            "a merge keeps the lease"
        );
    }

    #[test]
    fn subdivides_into_contiguous_equal_ranges() {
        let parts = subdivide("", "FF", 4);
        assert_eq!(parts.len(), 4);
        assert_eq!(parts[0].0, "");
        assert_eq!(parts[3].1, "FF");
        assert_eq!(
            parts[1].0, "10000000000000000000000000000000",
            "hash v2 keys end at 40…"
        );
        for w in parts.windows(2) {
            assert_eq!(w[0].1, w[1].0, "contiguous");
        }
        let halves = subdivide(
            "10000000000000000000000000000000",
            "20000000000000000000000000000000",
            2,
        );
        assert_eq!(halves[0].1, "18000000000000000000000000000000");
        assert_eq!(
            subdivide("", "FF", 1),
            vec![("".to_string(), "FF".to_string())]
        );
    }

    #[test]
    fn owned_ranges_are_merged_where_they_touch() {
        let r = |a: &str, b: &str| (a.to_owned(), b.to_owned());
        assert_eq!(
            coalesce_ranges(&[r("80", "FF"), r("", "40"), r("40", "80")]),
            vec![r("", "FF")]
        );
        assert_eq!(
            coalesce_ranges(&[r("C0", "FF"), r("", "40")]),
            vec![r("", "40"), r("C0", "FF")]
        );
        assert!(coalesce_ranges(&[]).is_empty());
    }
}
