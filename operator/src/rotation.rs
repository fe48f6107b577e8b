//! Rotated Secrets (account keys, API tokens), noticed once per Secret rather than by a
//! reconcile of every group every few minutes.
//!
//! A group's periodic reconcile is an hour apart ([`crate::context::GROUP_RESYNC`]): between
//! changes, which the watches deliver, it only repairs drift. A rotated Secret is a change no
//! watch delivers (the operator may `get` Secrets, never list or watch them), and it must
//! still roll the workers within [`SECRET_CHECK`]. So the scaling loop reads each Secret the
//! workers read every `SECRET_CHECK` — once, however many queues and groups name it — and when
//! one changed (its uid or resource version: the operator never looks at the content here)
//! asks for a reconcile of every group whose workers read it. That reconcile works out the
//! digests and rolls the workers only if what they read changed.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup};
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};
use tokio::time::Instant;

use crate::build;

/// How often each Secret the workers read is read: the longest a rotated key or a team's new
/// API tokens wait before the groups that read them are reconciled.
pub const SECRET_CHECK: Duration = Duration::from_secs(300);

/// A Secret by namespace and name.
pub type SecretRef = (String, String);

/// What a read found: the Secret's uid and resource version, `None` while it is missing.
pub type Version = Option<String>;

/// The Secrets last read and when.
#[derive(Default)]
pub struct SecretWatch {
    seen: BTreeMap<SecretRef, (Version, Instant)>,
}

/// Whether a Secret is due a read (pure): never read, or read `SECRET_CHECK` ago.
fn due(seen: Option<&(Version, Instant)>, now: Instant) -> bool {
    seen.is_none_or(|(_, at)| now.duration_since(*at) >= SECRET_CHECK)
}

/// When a Secret's first read counts as made (pure): up to [`SECRET_CHECK`] before it, by a
/// hash of its name. The Secrets the operator finds at start are all read in one round; counted
/// as read at once, they would stay due together and every `SECRET_CHECK` one round would read
/// them all (1,000 reads in a row at 1,000 queues), so their second reads, and all after, fall
/// across the interval instead. A rotation is still noticed within `SECRET_CHECK`.
fn first_read_at(secret: &SecretRef, now: Instant) -> Instant {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    secret.hash(&mut hasher);
    let spread = Duration::from_millis(hasher.finish() % SECRET_CHECK.as_millis() as u64);
    now.checked_sub(spread).unwrap_or(now)
}

/// Whether a read means a rotation (pure): a Secret seen before that is now another version
/// (or gone, or back). The first read only records: the groups' reconciles at start read it.
fn rotated(seen: Option<&(Version, Instant)>, now: &Version) -> bool {
    seen.is_some_and(|(before, _)| before != now)
}

/// The Secrets a group's workers read (pure): the account keys of its queue and of the queues
/// it publishes to (those the cache holds), and its API tokens.
pub fn secrets_of(qcg: &QueueConsumerGroup, queues: &Store<CosmosQueue>) -> Vec<SecretRef> {
    let namespace = qcg.namespace().unwrap_or_default();
    let queue_names = std::iter::once(&qcg.spec.queue_ref.name)
        .chain(qcg.spec.publish_to.iter().map(|t| &t.queue_ref.name));
    queue_names
        .filter_map(|name| queues.get(&ObjectRef::new(name).within(&namespace)))
        .filter_map(|cq| {
            cq.spec
                .credentials
                .secret_key_ref
                .as_ref()
                .map(|k| k.name.clone())
        })
        .chain(build::api_token_secret(qcg))
        .map(|name| (namespace.clone(), name))
        .collect()
}

impl SecretWatch {
    /// Reads the Secrets of `wanted` that are due (Kubernetes) and returns those that changed
    /// since they were last read. A failed read is tried again at the next call.
    pub async fn check(
        &mut self,
        client: &Client,
        wanted: &BTreeSet<SecretRef>,
        now: Instant,
    ) -> Vec<SecretRef> {
        self.seen.retain(|secret, _| wanted.contains(secret));
        let mut changed = Vec::new();
        for secret in wanted {
            if !self.is_due(secret, now) {
                continue;
            }
            let (namespace, name) = secret;
            let read = Api::<Secret>::namespaced(client.clone(), namespace)
                .get_opt(name)
                .await;
            let version = match read {
                Ok(found) => found.map(|s| {
                    let meta = s.metadata;
                    format!(
                        "{}/{}",
                        meta.uid.unwrap_or_default(),
                        meta.resource_version.unwrap_or_default()
                    )
                }),
                Err(e) => {
                    tracing::warn!(%namespace, secret = %name, error = %e, "could not read a Secret the workers read");
                    continue;
                }
            };
            if self.record(secret, version, now) {
                tracing::info!(%namespace, secret = %name, "a Secret the workers read changed: reconciling their groups");
                changed.push(secret.clone());
            }
        }
        changed
    }

    /// Records a read of `secret` made `now` (a first read as spread by [`first_read_at`]);
    /// whether it means a rotation.
    fn record(&mut self, secret: &SecretRef, version: Version, now: Instant) -> bool {
        let before = self.seen.get(secret);
        let rotated = rotated(before, &version);
        let at = match before {
            Some(_) => now,
            None => first_read_at(secret, now),
        };
        self.seen.insert(secret.clone(), (version, at));
        rotated
    }

    /// Whether `secret` is due a read at `now`.
    fn is_due(&self, secret: &SecretRef, now: Instant) -> bool {
        due(self.seen.get(secret), now)
    }
}

/// The groups whose workers read one of `changed` (pure).
pub fn groups_reading(
    changed: &[SecretRef],
    groups: &[std::sync::Arc<QueueConsumerGroup>],
    queues: &Store<CosmosQueue>,
) -> Vec<ObjectRef<QueueConsumerGroup>> {
    groups
        .iter()
        .filter(|g| secrets_of(g, queues).iter().any(|s| changed.contains(s)))
        .map(|g| ObjectRef::from_obj(&**g))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::reflector::store::Writer;
    use kube::runtime::watcher;
    use serde_json::json;

    #[test]
    fn a_secret_is_read_once_per_check_and_a_change_after_the_first_read_is_a_rotation() {
        let t0 = Instant::now();
        let read = |version: &str, at: Instant| (Some(version.to_owned()), at);
        assert!(due(None, t0), "never read");
        assert!(!due(Some(&read("u/1", t0)), t0 + SECRET_CHECK / 2));
        assert!(due(Some(&read("u/1", t0)), t0 + SECRET_CHECK));

        assert!(
            !rotated(None, &Some("u/1".into())),
            "the first read records"
        );
        assert!(!rotated(Some(&read("u/1", t0)), &Some("u/1".into())));
        assert!(rotated(Some(&read("u/1", t0)), &Some("u/2".into())));
        assert!(rotated(Some(&read("u/1", t0)), &None), "deleted");
        assert!(
            rotated(Some(&(None, t0)), &Some("v/1".into())),
            "made again"
        );
    }

    #[test]
    fn secrets_first_read_together_are_read_again_across_the_interval_not_all_in_one_round() {
        let t0 = Instant::now() + SECRET_CHECK; // an Instant that can go back SECRET_CHECK
        let secrets: Vec<SecretRef> = (0..1000)
            .map(|i| (format!("team-{}", i % 40), format!("queue-{i}-key")))
            .collect();
        let mut watch = SecretWatch::default();
        let version = Some("u/1".to_owned());
        for secret in &secrets {
            assert!(watch.is_due(secret, t0));
            assert!(
                !watch.record(secret, version.clone(), t0),
                "a first read records"
            );
        }
        let round = Duration::from_secs(15);
        let mut last_read: BTreeMap<&SecretRef, Instant> =
            secrets.iter().map(|s| (s, t0)).collect();
        let mut reads = Vec::new();
        let mut now = t0;
        while now < t0 + 2 * SECRET_CHECK {
            now += round;
            let due_now: Vec<_> = secrets.iter().filter(|s| watch.is_due(s, now)).collect();
            for secret in &due_now {
                assert!(
                    now.duration_since(last_read[secret]) <= SECRET_CHECK + round,
                    "read within its interval (and the round that notices)"
                );
                assert!(!watch.record(secret, version.clone(), now));
                last_read.insert(secret, now);
            }
            reads.push(due_now.len());
        }
        // 20 rounds an interval: 50 reads a round on average, never the whole lot.
        let most = *reads.iter().max().unwrap();
        assert!(most <= 100, "{most} reads in one round: {reads:?}");
        assert_eq!(
            reads.iter().sum::<usize>(),
            2000,
            "each read twice in two intervals"
        );
        // A read that finds another version is a rotation.
        assert!(watch.record(&secrets[0], Some("u/2".to_owned()), now));
    }

    #[test]
    fn the_groups_whose_workers_read_a_changed_secret_are_reconciled() {
        let mut writer = Writer::<CosmosQueue>::default();
        for (name, namespace, secret) in [
            ("orders", "shop", Some("orders-key")),
            ("payments", "shop", Some("payments-key")),
            ("events", "shop", None), // workload identity
            ("orders", "other", Some("orders-key")),
        ] {
            let mut queue = crate::testing::queue_json();
            queue["metadata"] = json!({"name": name, "namespace": namespace});
            queue["spec"]["credentials"] = match secret {
                Some(s) => json!({"secretKeyRef": {"name": s}}),
                None => {
                    json!({"workloadIdentity": {"clientId": "00000000-0000-0000-0000-000000000000"}})
                }
            };
            let queue = serde_json::from_value(queue).unwrap();
            writer.apply_watcher_event(&watcher::Event::Apply(queue));
        }
        let queues = writer.as_reader();
        let group = |name: &str, namespace: &str, queue: &str, extra: serde_json::Value| {
            let mut spec = json!({"queueRef": {"name": queue}});
            spec.as_object_mut()
                .unwrap()
                .extend(extra.as_object().cloned().unwrap_or_default());
            let mut group = crate::testing::group_json(spec);
            group["metadata"] = json!({"name": name, "namespace": namespace});
            std::sync::Arc::new(serde_json::from_value::<QueueConsumerGroup>(group).unwrap())
        };
        let groups = [
            group("billing", "shop", "orders", json!({})),
            group(
                "fulfilment",
                "shop",
                "events",
                json!({"publishTo": [{"queueRef": {"name": "orders"}}]}),
            ),
            group("audit", "shop", "payments", json!({})),
            group("billing", "other", "orders", json!({})),
            group(
                "reports",
                "shop",
                "events",
                json!({"app": {"port": 8080, "apiTokenSecret": "reports-tokens"}}),
            ),
        ];
        let reconciled = |changed: &[(&str, &str)]| {
            let changed: Vec<SecretRef> = changed
                .iter()
                .map(|(ns, n)| (ns.to_string(), n.to_string()))
                .collect();
            groups_reading(&changed, &groups, &queues)
                .into_iter()
                .map(|g| format!("{}/{}", g.namespace.unwrap(), g.name))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            reconciled(&[("shop", "orders-key")]),
            ["shop/billing", "shop/fulfilment"],
            "its consumers and its publishers, in its namespace only"
        );
        assert_eq!(reconciled(&[("shop", "reports-tokens")]), ["shop/reports"]);
        assert!(reconciled(&[("shop", "unrelated")]).is_empty());
    }
}
