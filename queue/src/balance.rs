//! Which leases a host should take: equal distribution, free and expired leases first,
//! stealing only what balance needs (the change feed processor's strategy, made stable).

use std::collections::BTreeMap;

/// A lease as the balancer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseView {
    /// The lease's id.
    pub id: String,
    /// `None` when free.
    pub owner: Option<String>,
    /// The owner stopped renewing (timestamp older than the expiry interval).
    pub expired: bool,
    /// Expired by the lock it advertises: deliveries its owner started may be in the app, and
    /// come back within their lock only if someone takes the lease now (see
    /// [`crate::lease::Lease::lock_ms`]).
    pub recovers: bool,
}

/// One lease to take, and whether that is a steal from a live owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Take {
    /// The lease to take.
    pub lease_id: String,
    /// Its owner now, when it is taken from a live host; `None` for a free or expired one.
    pub steal_from: Option<String>,
}

/// The leases `me` should acquire now.
///
/// Live hosts are the owners of unexpired leases, plus `me`. With `L` leases over `n` hosts
/// every host should hold `floor(L/n)` or `ceil(L/n)`. A host takes free or expired leases up
/// to `ceil(L/n)`, and those expired by their lock ([`LeaseView::recovers`]) whatever it holds.
/// It steals one lease per round from the host with the most when it is below `floor(L/n)` and
/// that host has at least two more, or when that host has more than `ceil(L/n)`; so two hosts
/// never trade a lease back and forth.
pub fn plan(leases: &[LeaseView], me: &str) -> Vec<Take> {
    if leases.is_empty() {
        return Vec::new();
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    counts.insert(me, 0);
    for lease in leases.iter().filter(|l| !l.expired) {
        if let Some(owner) = &lease.owner {
            *counts.entry(owner.as_str()).or_default() += 1;
        }
    }
    let hosts = counts.len();
    let total = leases.len();
    let floor = total / hosts;
    let ceil = total.div_ceil(hosts);
    let mine = counts[me];

    let mut available: Vec<&LeaseView> = leases
        .iter()
        .filter(|l| l.owner.is_none() || l.expired)
        .collect();
    // Leases expired by their lock come first, and are taken whatever this host holds: their
    // owner's other leases may keep it counted as live (they expire later, by the lease
    // expiry), so that no host is below its share before then, and its work would come back
    // after the lease expiry, not its lock. Balance moves leases by hand-over afterwards.
    available.sort_by_key(|l| !l.recovers);
    let recovering = available.iter().filter(|l| l.recovers).count();
    let wanted = ceil.saturating_sub(mine).max(recovering);
    if wanted > 0 && !available.is_empty() {
        return available
            .into_iter()
            .take(wanted)
            .map(|l| Take {
                lease_id: l.id.clone(),
                steal_from: None,
            })
            .collect();
    }
    let Some((&victim, &most)) = counts
        .iter()
        .filter(|(host, _)| **host != me)
        .max_by_key(|(host, count)| (**count, std::cmp::Reverse(**host)))
    else {
        return Vec::new();
    };
    // Steal when below the fair share and the victim is two ahead, or when the victim holds
    // more than anyone should. Either way the victim stays at or above what we end up with.
    let below_floor = mine < floor && most >= mine + 2;
    let victim_over = mine < ceil && most > ceil;
    if !(below_floor || victim_over) {
        return Vec::new();
    }
    leases
        .iter()
        .find(|l| !l.expired && l.owner.as_deref() == Some(victim))
        .map(|l| {
            vec![Take {
                lease_id: l.id.clone(),
                steal_from: Some(victim.to_owned()),
            }]
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(id: usize, owner: Option<&str>, expired: bool) -> LeaseView {
        LeaseView {
            id: format!("l{id}"),
            owner: owner.map(str::to_owned),
            expired,
            recovers: false,
        }
    }

    /// Runs hosts in turn (each round: plan, apply) until nobody changes anything.
    fn settle(mut leases: Vec<LeaseView>, hosts: &[&str]) -> (Vec<LeaseView>, usize) {
        for round in 0..100 {
            let mut changed = false;
            for host in hosts {
                for take in plan(&leases, host) {
                    let l = leases.iter_mut().find(|l| l.id == take.lease_id).unwrap();
                    l.owner = Some(host.to_string());
                    l.expired = false;
                    changed = true;
                }
            }
            if !changed {
                return (leases, round);
            }
        }
        panic!("did not converge");
    }

    fn counts(leases: &[LeaseView], hosts: &[&str]) -> Vec<usize> {
        hosts
            .iter()
            .map(|h| {
                leases
                    .iter()
                    .filter(|l| l.owner.as_deref() == Some(h))
                    .count()
            })
            .collect()
    }

    #[test]
    fn free_leases_spread_evenly_and_converge() {
        let table = [(4, 3), (4, 2), (8, 3), (1, 3), (16, 5), (5, 5), (7, 2)];
        for (total, host_count) in table {
            let hosts: Vec<String> = (0..host_count).map(|h| format!("h{h}")).collect();
            let hosts: Vec<&str> = hosts.iter().map(String::as_str).collect();
            let leases = (0..total).map(|i| lease(i, None, false)).collect();
            let (leases, _) = settle(leases, &hosts);
            let c = counts(&leases, &hosts);
            assert!(
                leases.iter().all(|l| l.owner.is_some()),
                "{total}/{host_count}: all owned"
            );
            let (min, max) = (*c.iter().min().unwrap(), *c.iter().max().unwrap());
            assert!(
                max - min <= 1,
                "{total} leases over {host_count} hosts: {c:?}"
            );
        }
    }

    #[test]
    fn a_new_host_steals_only_what_balance_needs() {
        let leases: Vec<_> = (0..8).map(|i| lease(i, Some("a"), false)).collect();
        let takes = plan(&leases, "b");
        assert_eq!(takes.len(), 1, "one steal per round");
        assert_eq!(takes[0].steal_from.as_deref(), Some("a"));
        let (leases, rounds) = settle(leases, &["a", "b"]);
        assert_eq!(counts(&leases, &["a", "b"]), vec![4, 4]);
        assert!(rounds <= 5);
    }

    #[test]
    fn expired_leases_are_taken_before_stealing() {
        let leases = vec![
            lease(0, Some("a"), false),
            lease(1, Some("a"), false),
            lease(2, Some("dead"), true),
            lease(3, Some("dead"), true),
        ];
        let takes = plan(&leases, "b");
        assert_eq!(
            takes,
            vec![
                Take {
                    lease_id: "l2".into(),
                    steal_from: None
                },
                Take {
                    lease_id: "l3".into(),
                    steal_from: None
                }
            ]
        );
    }

    /// A lease expired by its lock (its owner died with work in the app) is taken by a host at
    /// its share too: the owner's other, idle lease keeps it counted as live until that one
    /// expires by the longer lease expiry, and nobody would be below its share before then.
    #[test]
    fn a_lease_expired_by_its_lock_is_taken_whatever_the_share() {
        let mut leases = vec![
            lease(0, Some("b"), false),
            lease(1, Some("b"), false),
            lease(2, Some("dead"), false),
            lease(3, Some("dead"), true),
        ];
        assert!(plan(&leases, "b").is_empty(), "expired by the lease expiry");
        leases[3].recovers = true;
        assert_eq!(
            plan(&leases, "b"),
            vec![Take {
                lease_id: "l3".into(),
                steal_from: None
            }]
        );
    }

    #[test]
    fn balanced_hosts_do_nothing() {
        let leases = vec![
            lease(0, Some("a"), false),
            lease(1, Some("a"), false),
            lease(2, Some("b"), false),
        ];
        assert!(plan(&leases, "a").is_empty());
        assert!(
            plan(&leases, "b").is_empty(),
            "1 vs 2 is balanced: no ping-pong"
        );
        assert!(plan(&[], "a").is_empty());
    }
}
