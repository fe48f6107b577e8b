//! Events, published as kube's and client-go's recorders do: the same reason and action on
//! the same object again within six minutes patches the first Event's `series` (its count
//! and last time) instead of creating another Event. What differs is the memory: kube's
//! `Recorder` keeps every Event of the last six minutes whole, with its key (≈ 2 KB each, in
//! a map that never shrinks), and at 5,000 groups the scale-ups and scale-downs of six
//! minutes held 27 MB of the operator's heap. Here a series is its key's hash, the first
//! Event's name, its count and when it was last seen.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::Client;

/// How long a repeat joins the first Event's series (kube's and client-go's figure).
const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);

/// Publishes Events for the operator's objects.
pub struct Recorder {
    client: Client,
    reporter: Reporter,
    series: Mutex<Series>,
}

/// The series of the last [`SERIES_WINDOW`], by key.
#[derive(Default)]
struct Series {
    by_key: HashMap<u64, Seen>,
    /// When series past the window were last dropped.
    swept: Option<Timestamp>,
}

/// What patching a series needs.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    /// The first Event's name (in the regarded object's namespace: part of the key).
    name: String,
    /// How many times it happened (1: no series yet).
    count: i32,
    /// When it last happened.
    last: Timestamp,
}

impl Series {
    /// The live series of `key` at `now`, if any; series past the window are dropped (all of
    /// them at most once a minute: a sweep is a pass over the map).
    fn live(&mut self, key: u64, now: Timestamp) -> Option<Seen> {
        if self
            .swept
            .is_none_or(|at| at + SignedDuration::from_mins(1) <= now)
        {
            self.by_key
                .retain(|_, seen| seen.last + SERIES_WINDOW > now);
            // A burst's map is given back once it is mostly empty.
            if self.by_key.capacity() > 4 * self.by_key.len() + 64 {
                self.by_key.shrink_to_fit();
            }
            self.swept = Some(now);
        }
        self.by_key
            .get(&key)
            .filter(|seen| seen.last + SERIES_WINDOW > now)
            .cloned()
    }
}

/// What makes two Events one series (pure): client-go's key — type, reason, action,
/// reporter, the regarded and related objects; not the note.
fn series_key(reporter: &Reporter, event: &Event, regarding: &ObjectReference) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let object = |o: &ObjectReference, hasher: &mut std::collections::hash_map::DefaultHasher| {
        (&o.api_version, &o.kind, &o.namespace, &o.name, &o.uid).hash(hasher);
    };
    matches!(event.type_, EventType::Warning).hash(&mut hasher);
    (&event.reason, &event.action).hash(&mut hasher);
    (&reporter.controller, &reporter.instance).hash(&mut hasher);
    object(regarding, &mut hasher);
    if let Some(related) = &event.secondary {
        object(related, &mut hasher);
    }
    hasher.finish()
}

impl Recorder {
    /// Publishes as `reporter`.
    pub fn new(client: Client, reporter: Reporter) -> Self {
        Self {
            client,
            reporter,
            series: Mutex::default(),
        }
    }

    /// Publishes `event` about `regarding`: a new Event, or the next count of its series.
    pub async fn publish(
        &self,
        event: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        self.publish_at(event, regarding, Timestamp::now()).await
    }

    async fn publish_at(
        &self,
        event: &Event,
        regarding: &ObjectReference,
        now: Timestamp,
    ) -> Result<(), kube::Error> {
        let key = series_key(&self.reporter, event, regarding);
        let live = self.series.lock().expect("not poisoned").live(key, now);
        let events: Api<K8sEvent> = Api::namespaced(
            self.client.clone(),
            regarding.namespace.as_deref().unwrap_or("default"),
        );
        let seen = match live {
            Some(seen) => {
                let count = seen.count + 1;
                let patch = serde_json::json!({
                    "series": {"count": count, "lastObservedTime": MicroTime(now)},
                });
                match events
                    .patch(&seen.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => Some(Seen {
                        name: seen.name,
                        count,
                        last: now,
                    }),
                    // Deleted meanwhile (Events live an hour by default, less if an admin
                    // says so): a new one.
                    Err(kube::Error::Api(e)) if e.code == 404 => None,
                    Err(e) => return Err(e),
                }
            }
            None => None,
        };
        let seen = match seen {
            Some(seen) => seen,
            None => {
                let created = self.event(event, regarding, now);
                let name = created.metadata.name.clone().unwrap_or_default();
                events.create(&PostParams::default(), &created).await?;
                Seen {
                    name,
                    count: 1,
                    last: now,
                }
            }
        };
        self.series
            .lock()
            .expect("not poisoned")
            .by_key
            .insert(key, seen);
        Ok(())
    }

    /// The Event kube's recorder would create (pure).
    fn event(&self, event: &Event, regarding: &ObjectReference, now: Timestamp) -> K8sEvent {
        K8sEvent {
            action: Some(event.action.clone()),
            reason: Some(event.reason.clone()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            note: event.note.clone(),
            metadata: ObjectMeta {
                namespace: regarding.namespace.clone(),
                name: Some(format!(
                    "{}.{:x}",
                    regarding.name.as_ref().unwrap_or(&self.reporter.controller),
                    now.as_nanosecond()
                )),
                ..Default::default()
            },
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| self.reporter.controller.clone()),
            ),
            type_: Some(
                match event.type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .to_owned(),
            ),
            related: event.secondary.clone(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{client, json_response, not_found};
    use http::{Method, StatusCode};

    fn scaled(reason: &str, note: &str) -> Event {
        Event {
            type_: EventType::Normal,
            reason: reason.into(),
            note: Some(note.into()),
            action: "Scale".into(),
            secondary: None,
        }
    }

    fn group(name: &str) -> ObjectReference {
        ObjectReference {
            api_version: Some("cosmosq.io/v1alpha1".into()),
            kind: Some("QueueConsumerGroup".into()),
            namespace: Some("shop".into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            ..Default::default()
        }
    }

    fn recorder(client: Client) -> Recorder {
        Recorder::new(
            client,
            Reporter {
                controller: "cosmosq-operator".into(),
                instance: Some("operator-0".into()),
            },
        )
    }

    #[tokio::test]
    async fn a_repeat_within_six_minutes_counts_in_the_first_events_series() {
        let (client, mut server) = client();
        let recorder = recorder(client);
        let t0 = Timestamp::from_second(1_800_000_000).unwrap();
        let minutes = |m: i64| t0 + SignedDuration::from_mins(m);
        let api = tokio::spawn(async move {
            let mut seen = Vec::new();
            for answer in [true, true, true, true, false, true] {
                let request = server.next().await;
                seen.push((
                    request.method.clone(),
                    request.path.clone(),
                    request.content_type.clone(),
                    request.body.clone(),
                ));
                let response = if answer {
                    json_response(StatusCode::OK, &request.body)
                } else {
                    not_found()
                };
                request.send.send_response(response);
            }
            seen
        });
        let up = scaled("ScaledUp", "0 → 4: 200 messages waiting");
        let first = recorder.event(&up, &group("orders"), t0);
        let first_name = first.metadata.name.clone().unwrap();
        // The first, two repeats (another note: not part of the key), another group's.
        recorder
            .publish_at(&up, &group("orders"), t0)
            .await
            .unwrap();
        let again = scaled("ScaledUp", "4 → 6: 900 messages waiting");
        recorder
            .publish_at(&again, &group("orders"), minutes(2))
            .await
            .unwrap();
        recorder
            .publish_at(&up, &group("orders"), minutes(7))
            .await
            .unwrap();
        recorder
            .publish_at(&up, &group("billing"), minutes(7))
            .await
            .unwrap();
        // Its series' Event is gone (a patch answered 404): a new Event.
        recorder
            .publish_at(&up, &group("orders"), minutes(8))
            .await
            .unwrap();
        let seen = api.await.unwrap();

        let events = "/apis/events.k8s.io/v1/namespaces/shop/events";
        assert_eq!((&seen[0].0, seen[0].1.as_str()), (&Method::POST, events));
        assert_eq!(seen[0].3["metadata"]["name"], first_name);
        assert_eq!(seen[0].3["note"], "0 → 4: 200 messages waiting");
        assert_eq!(seen[0].3["reportingInstance"], "operator-0");
        assert_eq!(seen[0].3["regarding"]["name"], "orders");
        assert!(seen[0].3.get("series").is_none());
        // Within the window (measured from the last one): the series, by merge patch.
        for (i, count) in [(1, 2), (2, 3)] {
            assert_eq!(seen[i].0, Method::PATCH);
            assert_eq!(seen[i].1, format!("{events}/{first_name}"));
            assert_eq!(seen[i].2, "application/merge-patch+json");
            assert_eq!(seen[i].3["series"]["count"], count, "{:?}", seen[i].3);
            assert!(seen[i].3["series"]["lastObservedTime"].is_string());
        }
        assert_eq!(seen[3].0, Method::POST);
        assert_eq!(seen[3].3["regarding"]["name"], "billing");
        assert_eq!(seen[4].0, Method::PATCH);
        assert_eq!(seen[5].0, Method::POST);
        assert_eq!(seen[5].3["regarding"]["name"], "orders");
        assert_ne!(seen[5].3["metadata"]["name"], first_name);
    }

    #[tokio::test]
    async fn past_six_minutes_it_is_a_new_event_and_old_series_are_let_go() {
        let (client, mut server) = client();
        let recorder = recorder(client);
        let t0 = Timestamp::from_second(1_800_000_000).unwrap();
        let api = tokio::spawn(async move {
            let mut methods = Vec::new();
            for _ in 0..3 {
                let request = server.next().await;
                methods.push(request.method.clone());
                request
                    .send
                    .send_response(json_response(StatusCode::OK, &request.body));
            }
            methods
        });
        let down = scaled("ScaledDown", "4 → 0: idle");
        recorder
            .publish_at(&down, &group("orders"), t0)
            .await
            .unwrap();
        recorder
            .publish_at(&down, &group("audit"), t0)
            .await
            .unwrap();
        let later = t0 + SignedDuration::from_mins(6);
        recorder
            .publish_at(&down, &group("orders"), later)
            .await
            .unwrap();
        assert_eq!(
            api.await.unwrap(),
            [Method::POST, Method::POST, Method::POST]
        );
        // The sweep dropped the idle group's series; the new one is the only one kept.
        let series = recorder.series.lock().unwrap();
        assert_eq!(series.by_key.len(), 1);
        assert_eq!(series.by_key.values().next().unwrap().last, later);
    }

    #[test]
    fn a_series_is_told_apart_by_object_reason_action_and_type_not_by_note() {
        let reporter = Reporter {
            controller: "cosmosq-operator".into(),
            instance: None,
        };
        let key = |event: &Event, name: &str| series_key(&reporter, event, &group(name));
        let up = scaled("ScaledUp", "a");
        assert_eq!(key(&up, "orders"), key(&scaled("ScaledUp", "b"), "orders"));
        assert_ne!(key(&up, "orders"), key(&up, "billing"));
        assert_ne!(
            key(&up, "orders"),
            key(&scaled("ScaledDown", "a"), "orders")
        );
        let warning = Event {
            type_: EventType::Warning,
            ..scaled("ScaledUp", "a")
        };
        assert_ne!(key(&up, "orders"), key(&warning, "orders"));
        let other_action = Event {
            action: "Apply".into(),
            ..scaled("ScaledUp", "a")
        };
        assert_ne!(key(&up, "orders"), key(&other_action, "orders"));
    }
}
