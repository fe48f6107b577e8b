//! The checks, on the full ledger of a history once its hosts have stopped: every promise of
//! the queue contract that a user of the group could observe.

use std::collections::BTreeMap;

use cosmosq_queue::{MessageKey, MessageState, Queue, StateDoc};

use super::plan::{AnswerKind, Event, Fault};
use super::world::{group_config, AppDelivery, Shared};

/// A key as a failure names it: long ones cut.
pub fn short_key(key: &serde_json::Value) -> String {
    let text = key.to_string();
    match text.chars().count() {
        n if n > 24 => format!("{}…({n} chars)", text.chars().take(16).collect::<String>()),
        _ => text,
    }
}

/// Whether the app has given every stored message of every group a final answer: completed,
/// dropped, failed as often as allowed, or expired.
pub fn app_done(shared: &Shared) -> bool {
    let plan = &shared.plan;
    let now = shared.now();
    let ledger = shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
    let mut by: BTreeMap<(usize, usize), Vec<&AppDelivery>> = BTreeMap::new();
    for d in &ledger.deliveries {
        by.entry((d.group, d.msg)).or_default().push(d);
    }
    ledger.stored.values().all(|&m| {
        (0..plan.groups.len()).all(|g| {
            let seen = by.get(&(g, m)).map(Vec::as_slice).unwrap_or_default();
            let finals = seen.iter().any(|d| {
                matches!(
                    d.answered,
                    Some((_, AnswerKind::Complete | AnswerKind::Drop))
                )
            });
            finals
                || seen.len() as u32 >= plan.groups[g].max_attempts
                || expiry(shared, ledger.stored_at.get(&m).copied(), m).is_some_and(|at| at <= now)
        })
    })
}

/// When message `m` leaves the container by TTL (simulated ms).
fn expires_at(shared: &Shared, m: usize) -> Option<u64> {
    let stored = {
        let ledger = shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
        ledger.stored_at.get(&m).copied()
    };
    expiry(shared, stored, m)
}

fn expiry(shared: &Shared, stored_at: Option<u64>, m: usize) -> Option<u64> {
    let spec = &shared.plan.messages[m];
    let secs = spec.ttl_secs.unwrap_or(shared.plan.retention_secs);
    Some(stored_at? + u64::from(secs) * 1000)
}

/// Each group's state of every stored message.
async fn states(
    shared: &Shared,
    producer: &Queue,
) -> Result<BTreeMap<(usize, usize), Option<StateDoc>>, String> {
    let stored: Vec<usize> = {
        let ledger = shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
        ledger.stored.values().copied().collect()
    };
    let mut out = BTreeMap::new();
    for g in 0..shared.plan.groups.len() {
        let group = producer
            .group(group_config(&shared.plan, g))
            .map_err(|e| e.to_string())?;
        for &m in &stored {
            let spec = &shared.plan.messages[m];
            let key = MessageKey::from_json(spec.key.clone()).expect("key");
            let state = group
                .read_state(&key, &spec.id)
                .await
                .map_err(|e| format!("reading g{g} m{m}: {e}"))?;
            out.insert((g, m), state);
        }
    }
    Ok(out)
}

/// Whether every stored message is settled in every group as far as the database says.
pub async fn recorded(shared: &Shared, producer: &Queue) -> Result<(), String> {
    let states = states(shared, producer).await?;
    settled(shared, &states, &recorded_settles(shared))
}

fn deliveries_of(shared: &Shared) -> BTreeMap<(usize, usize), Vec<AppDelivery>> {
    let ledger = shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
    let mut by: BTreeMap<(usize, usize), Vec<AppDelivery>> = BTreeMap::new();
    for d in &ledger.deliveries {
        by.entry((d.group, d.msg)).or_default().push(d.clone());
    }
    by
}

fn settled(
    shared: &Shared,
    states: &BTreeMap<(usize, usize), Option<StateDoc>>,
    settles: &BTreeMap<(usize, usize), Vec<(u64, String)>>,
) -> Result<(), String> {
    let plan = &shared.plan;
    let by = deliveries_of(shared);
    let now = shared.now();
    for (&(g, m), state) in states {
        let seen = by.get(&(g, m)).map(Vec::as_slice).unwrap_or_default();
        let completed_by_app = seen
            .iter()
            .any(|d| matches!(d.answered, Some((_, AnswerKind::Complete))));
        let expired = expires_at(shared, m).is_some_and(|at| at <= now);
        let what = || {
            format!(
                "g{g} m{m} ({:?} under {}): state {:?}, the app saw {:?}",
                plan.messages[m].id,
                short_key(&plan.messages[m].key),
                state.as_ref().map(|s| (s.state, s.reason.clone())),
                seen.iter()
                    .map(|d| (d.count, d.answered.map(|a| a.1)))
                    .collect::<Vec<_>>()
            )
        };
        // A completion recorded with the lease leaves no state document: once its message
        // expires, only the engine's record of it says so.
        let completion_recorded = settles
            .get(&(g, m))
            .is_some_and(|s| s.iter().any(|(_, event)| event == "completed"));
        let state_now = match state.as_ref().map(|s| s.state) {
            None if completion_recorded => Some(MessageState::Completed),
            other => other,
        };
        match state_now {
            Some(MessageState::Completed) if !completed_by_app => {
                return Err(format!("completed without the app: {}", what()))
            }
            Some(MessageState::Completed) => {}
            Some(MessageState::DeadLettered) => {
                let reason = state.as_ref().and_then(|s| s.reason.clone());
                dead_letter_has_cause(shared, g, m, reason.as_deref(), seen)
                    .map_err(|e| format!("dead letter without its cause: {e}: {}", what()))?;
            }
            _ if plan.groups[g].stream && completed_by_app => {}
            // Retention removed it before anybody delivered it: nothing was promised.
            None if expired && seen.is_empty() => {}
            _ if expired && !seen.is_empty() => {
                return Err(format!("expired silently: after deliveries, {}", what()))
            }
            _ => {
                return Err(format!(
                    "lost: neither completed nor dead-lettered, {}",
                    what()
                ))
            }
        }
    }
    Ok(())
}

/// A dead letter names a cause that happened: the app dropped it, it failed as often as
/// allowed (real deliveries the app saw), it expired, or a permanent refusal was injected.
fn dead_letter_has_cause(
    shared: &Shared,
    g: usize,
    m: usize,
    reason: Option<&str>,
    seen: &[AppDelivery],
) -> Result<(), String> {
    let plan = &shared.plan;
    match reason {
        Some("DroppedByApp") => seen
            .iter()
            .any(|d| matches!(d.answered, Some((_, AnswerKind::Drop))))
            .then_some(())
            .ok_or_else(|| "dead-lettered as dropped, but the app never dropped it".into()),
        Some("MaxDeliveryAttemptsExceeded") => {
            let real = seen.len() as u32;
            // Pull workers: an attempt counts when the sidecar locks the message for them (as
            // Service Bus counts a prefetched lock), whether or not a worker received it yet.
            if real >= plan.groups[g].max_attempts || plan.groups[g].pull {
                Ok(())
            } else {
                Err(format!(
                    "dead-lettered after {real} deliveries the app saw, of {} allowed",
                    plan.groups[g].max_attempts
                ))
            }
        }
        Some("MessageExpired") => {
            if expires_at(shared, m).is_some_and(|at| at <= shared.now()) {
                Ok(())
            } else {
                Err("dead-lettered as expired before its expiry".into())
            }
        }
        Some("PermanentError") => plan
            .events
            .iter()
            .any(|e| {
                matches!(
                    e.event,
                    Event::Fault {
                        fault: Fault::Refused,
                        ..
                    }
                )
            })
            .then_some(())
            .ok_or_else(|| "dead-lettered for a permanent error nobody injected".into()),
        other => Err(format!("dead-lettered with reason {other:?}")),
    }
}

/// What the engine recorded as settled, per (group, message): (time, `completed` or
/// `dead-lettered`), in order.
fn recorded_settles(shared: &Shared) -> BTreeMap<(usize, usize), Vec<(u64, String)>> {
    let stored = {
        let ledger = shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
        ledger.stored.clone()
    };
    let mut out: BTreeMap<(usize, usize), Vec<(u64, String)>> = BTreeMap::new();
    for r in shared
        .recorded
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
    {
        let Some(g) = r
            .group
            .strip_prefix('g')
            .and_then(|g| g.parse::<usize>().ok())
        else {
            continue;
        };
        if let Some(&m) = stored.get(&(r.id.clone(), r.key.clone())) {
            out.entry((g, m)).or_default().push((r.at, r.event.clone()));
        }
    }
    out
}

/// Every check, after the hosts stopped; the first broken promise.
pub async fn all(shared: &Shared, producer: &Queue) -> Result<(), String> {
    {
        let ledger = shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(stray) = ledger.strays.first() {
            return Err(format!("stray: {stray}"));
        }
    }
    let states = states(shared, producer).await?;
    let settles = recorded_settles(shared);
    settled(shared, &states, &settles)?;
    let by = deliveries_of(shared);
    for (&(g, m), seen) in &by {
        if shared.plan.groups[g].stream {
            continue;
        }
        let recorded = settles.get(&(g, m)).map(Vec::as_slice).unwrap_or_default();
        if !shared.plan.groups[g].pull {
            counts_exact(shared, g, m, seen)
                .map_err(|e| format!("counts not exact: g{g} m{m}: {e}"))?;
        }
        not_before_visible(shared, m, seen)
            .map_err(|e| format!("delivered before its time: g{g} m{m}: {e}"))?;
        never_twice_at_once(shared, seen)
            .map_err(|e| format!("in the app twice at once: g{g} m{m}: {e}"))?;
        started_locked(shared, seen)
            .map_err(|e| format!("started without a lock: g{g} m{m}: {e}"))?;
        never_after_success(seen, recorded)
            .map_err(|e| format!("delivered after its success: g{g} m{m}: {e}"))?;
    }
    fifo_per_key(shared, &by, &settles)?;
    backlog_seen(shared, &by, &settles)?;
    recovered_within_the_lock(shared, &by)?;
    leases_let_go(shared)
}

/// How long after a dead holder's lock runs out its message is delivered again at most: the
/// next holder sees the lease or lock change within a watch interval (1 s for a lease
/// advertising a short lock), judges it run out after the lock, and reads the page or sweeps
/// (1 s); plus the pods' clock skew (±300 ms each) for claims judged by wall clock.
const RECOVERED_WITHIN: u64 = 2_600;

/// "A pod that dies loses its locks, and its work is picked up again within lock duration
/// plus one sweep": checked where nothing else could hold the recovery up — an exclusive,
/// unordered push group with permits for all its work around the kill, nothing else happening around it, and
/// another host of the group up (or the sidecar back at once).
fn recovered_within_the_lock(
    shared: &Shared,
    by: &BTreeMap<(usize, usize), Vec<AppDelivery>>,
) -> Result<(), String> {
    let plan = &shared.plan;
    let kills = shared
        .ledger
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .kills
        .clone();
    for (at, pod, incarnation) in kills {
        let g = plan.pods[pod].group;
        let spec = &plan.groups[g];
        if spec.stream || spec.pull || spec.ordered || spec.concurrency < 8 {
            continue;
        }
        let bound = at + spec.lock_ms + RECOVERED_WITHIN;
        let calm = plan.events.iter().all(|e| match e.event {
            Event::Kill { pod: p, .. } if p == pod && e.at_ms == at => true,
            _ => e.at_ms + 2_000 < at || e.at_ms > bound,
        });
        let restarted_at_once = plan.events.iter().any(|e| {
            matches!(e.event, Event::Kill { pod: p, restart_after_ms } if p == pod && e.at_ms == at && restart_after_ms <= 200)
        });
        let another_up = plan
            .pods
            .iter()
            .enumerate()
            .any(|(p, other)| p != pod && other.group == g && other.start_ms < at);
        if !calm || !(restarted_at_once || another_up) {
            continue;
        }
        let in_app_at_kill = |d: &AppDelivery| {
            d.begin <= at && d.answered.is_none_or(|(t, _)| t > at) && d.cut.is_none_or(|c| c >= at)
        };
        // Enough permits: the messages in the app at the kill or started before the bound
        // (first deliveries waiting behind it too) fit in one host's permits; more wait for
        // one in feed order, and the bound says nothing of them.
        let competing = by
            .iter()
            .filter(|((dg, _), seen)| {
                *dg == g
                    && seen
                        .iter()
                        .any(|d| in_app_at_kill(d) || (d.begin > at && d.begin <= bound))
            })
            .count();
        if competing > spec.concurrency {
            continue;
        }
        for ((dg, m), seen) in by {
            if *dg != g {
                continue;
            }
            let Some(cut) = seen
                .iter()
                .find(|d| d.pod == pod && d.incarnation == incarnation && in_app_at_kill(d))
            else {
                continue;
            };
            if cut.count >= spec.max_attempts {
                continue; // its recovery dead-letters it
            }
            let Some(next) = seen.iter().filter(|d| d.begin > at).min_by_key(|d| d.begin) else {
                continue; // never again: `settled` names what became of it
            };
            if next.begin > bound {
                return Err(format!(
                    "recovered late: g{g} m{m} was in the app when p{pod}#{incarnation} died at {at} ms; \
                     delivered again at {} ms, past its lock ({} ms) plus {RECOVERED_WITHIN} ms",
                    next.begin, spec.lock_ms
                ));
            }
        }
    }
    Ok(())
}

/// How soon a range must be let go of once its owner stops or is asked for it: a renewal or a
/// page's write notices, then what is under way stops holding the range (long work keeps its
/// own lock), and the lease is written and released. Long work never holds it.
const LET_GO_WITHIN: u64 = 5_000;

/// A range is released promptly when its owner drains (SIGTERM) or another host asks for it,
/// unless its owner was cut off from Cosmos DB or faults were on meanwhile.
fn leases_let_go(shared: &Shared) -> Result<(), String> {
    let recorded = shared
        .recorded
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let plan = &shared.plan;
    let troubled = |pod: usize, from: u64, to: u64| {
        plan.events.iter().any(|e| {
            let (start, end) = match e.event {
                Event::Partition { pod: p, for_ms } if p == pod => (e.at_ms, e.at_ms + for_ms),
                Event::Fault { for_ms, .. } => (e.at_ms, e.at_ms + for_ms),
                Event::Split { .. } => (e.at_ms, e.at_ms + 10_000),
                _ => return false,
            };
            start < to && end > from
        })
    };
    let pod_of = |holder: &str| -> Option<usize> {
        let name = holder.split('#').next()?;
        name.split("-p").nth(1)?.parse().ok()
    };
    let kills = shared
        .ledger
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .kills
        .clone();
    // A holder (an incarnation) killed before it had to let go never does: its lease expires.
    let killed_by = |holder: &str, pod: usize, due: u64| {
        let incarnation: Option<u32> = holder.split('#').nth(1).and_then(|i| i.parse().ok());
        kills
            .iter()
            .any(|&(at, p, i)| p == pod && Some(i) == incarnation && at <= due)
    };
    // Released by its owner, or taken by another host: one takes a lease without a hand-over
    // only once its owner stopped writing it for the expiry, so the owner's range had stopped
    // (its release refused, say, before the ask came).
    let released = |lease: &str, owner: &str, after: u64| {
        recorded
            .iter()
            .filter(|r| {
                r.lease == lease
                    && r.at >= after
                    && match r.event.as_str() {
                        "released" => r.owner == owner,
                        "acquired" => r.owner != owner,
                        _ => false,
                    }
            })
            .map(|r| r.at)
            .min()
    };
    for ask in recorded.iter().filter(|r| r.event == "asked") {
        let Some(pod) = pod_of(&ask.owner) else {
            continue;
        };
        // Stream groups finish the page under way before they hand a range over (its first
        // deliveries have no lock to go on under): at-least-once, by design.
        if plan.groups[plan.pods[pod].group].stream {
            continue;
        }
        let due = ask.at + LET_GO_WITHIN;
        if troubled(pod, ask.at, due) || killed_by(&ask.owner, pod, due) || shared.now() < due {
            continue;
        }
        match released(&ask.lease, &ask.owner, ask.at) {
            Some(at) if at <= due => {}
            other => {
                // Released later, or never: the owner still held it at `due`, unless it let go
                // for another reason (it stopped) — judged below.
                if plan.events.iter().any(|e| {
                    matches!(e.event, Event::Stop { pod: p, .. } if p == pod) && e.at_ms <= due
                }) {
                    continue;
                }
                return Err(format!(
                    "range held: {} asked {} for {} at {} ms; released {:?}",
                    ask.by, ask.owner, ask.lease, ask.at, other
                ));
            }
        }
    }
    Ok(())
}

/// An estimate never reports no backlog while a message waits: one stored and due (no
/// final answer from the app, nothing recorded as settled, not expired) when it was taken.
fn backlog_seen(
    shared: &Shared,
    by: &BTreeMap<(usize, usize), Vec<AppDelivery>>,
    settles: &BTreeMap<(usize, usize), Vec<(u64, String)>>,
) -> Result<(), String> {
    let (estimates, stored) = {
        let ledger = shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
        (ledger.estimates.clone(), ledger.stored_at.clone())
    };
    for (at, g, backlog) in estimates {
        if backlog > 0 {
            continue;
        }
        for (&m, &stored_at) in &stored {
            if stored_at + 100 > at || expires_at(shared, m).is_some_and(|e| e <= at) {
                continue;
            }
            let answered = by.get(&(g, m)).is_some_and(|seen| {
                seen.iter().any(|d| {
                    matches!(d.answered, Some((t, AnswerKind::Complete | AnswerKind::Drop)) if t <= at)
                })
            });
            let recorded = settles
                .get(&(g, m))
                .is_some_and(|s| s.iter().any(|(t, _)| *t <= at));
            if !answered && !recorded {
                return Err(format!(
                    "backlog unseen: the estimate of g{g} at {at} ms said 0 while m{m} (stored at {stored_at} ms) was not settled"
                ));
            }
        }
    }
    Ok(())
}

/// How far hosts' clocks may be off the producer's: skews, then jumps.
fn clock_tolerance(shared: &Shared) -> u64 {
    let skew = shared
        .plan
        .pods
        .iter()
        .map(|p| p.skew_ms.unsigned_abs())
        .max()
        .unwrap_or(0);
    let jumps: u64 = shared
        .plan
        .events
        .iter()
        .filter_map(|e| match e.event {
            Event::ClockJump { by_ms, .. } => Some(by_ms.unsigned_abs()),
            _ => None,
        })
        .sum();
    skew * 2 + jumps + 50
}

/// A scheduled message is not delivered before its time (by the clocks' agreement).
fn not_before_visible(shared: &Shared, m: usize, seen: &[AppDelivery]) -> Result<(), String> {
    let stored = {
        let ledger = shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
        ledger.stored_at.get(&m).copied()
    };
    let Some(stored) = stored else { return Ok(()) };
    let visible = stored + shared.plan.messages[m].delay_ms;
    let early = visible.saturating_sub(clock_tolerance(shared));
    match seen.iter().find(|d| d.begin < early) {
        Some(d) => Err(format!(
            "delivered at {} ms, before its time {visible} ms",
            d.begin
        )),
        None => Ok(()),
    }
}

/// The delivery counts the app saw are 1, 2, 3, …: none skipped, none repeated — except that
/// a count may come again when its holder was disrupted (killed, cut off, its call cut, or
/// its success never recorded: its writes failed until it let the range go) before any lease
/// write listed that start (starts are listed with the range's next write:
/// `Window::starts_lag`). A start a landed write listed counts, whatever happened after.
fn counts_exact(shared: &Shared, g: usize, m: usize, seen: &[AppDelivery]) -> Result<(), String> {
    let settles = recorded_settles(shared);
    let recorded = settles.get(&(g, m)).map(Vec::as_slice).unwrap_or_default();
    let mut expected = 1;
    for (i, d) in seen.iter().enumerate() {
        let again = i > 0 && d.count + 1 == expected && {
            let before = &seen[i - 1];
            let success_lost = matches!(before.answered, Some((_, AnswerKind::Complete)))
                && !recorded.iter().any(|(at, event)| {
                    event == "completed" && (before.begin..d.begin).contains(at)
                });
            (disrupted(shared, before).is_some() || success_lost)
                && !start_listed(shared, g, m, before, d.begin)
        };
        if d.count != expected && !again {
            return Err(format!(
                "delivery counts {:?}: delivery {} said {}",
                seen.iter().map(|d| d.count).collect::<Vec<_>>(),
                i + 1,
                d.count
            ));
        }
        expected = d.count + 1;
    }
    Ok(())
}

/// Whether a lease write of `d`'s holder (group `g`) that landed after `d` began and before
/// `to` listed message `m` as started.
fn start_listed(shared: &Shared, g: usize, m: usize, d: &AppDelivery, to: u64) -> bool {
    let holder = format!("g{g}-p{}#{}", d.pod, d.incarnation);
    let from = d.begin;
    let spec = &shared.plan.messages[m];
    let Ok(key) = MessageKey::from_json(spec.key.clone()) else {
        return false;
    };
    let identity = cosmosq_queue::identity::fingerprint(&spec.id, &key);
    let group = format!("g{g}");
    shared
        .recorded
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|r| {
            r.event == "started"
                && r.group == group
                && r.owner == holder
                && (from..to).contains(&r.at)
        })
        .any(|r| r.id.split(',').any(|listed| listed == identity))
}

/// When the holder of `d` stopped holding it: the call was cut, or its pod was killed or cut
/// off from Cosmos DB while the app worked. `None`: it held on until the app answered.
fn disrupted(shared: &Shared, d: &AppDelivery) -> Option<u64> {
    let end = d.answered.map(|a| a.0).unwrap_or(d.work_end);
    let ledger = shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
    let killed = ledger
        .kills
        .iter()
        .filter(|(at, p, inc)| *p == d.pod && *inc == d.incarnation && *at >= d.begin)
        .map(|k| k.0)
        .min();
    let partitioned = shared
        .plan
        .events
        .iter()
        .filter_map(|e| match e.event {
            Event::Partition { pod, for_ms } if pod == d.pod => {
                let (from, to) = (e.at_ms, e.at_ms + for_ms);
                (from <= end && to >= d.begin).then_some(from.max(d.begin))
            }
            Event::Fault { for_ms, .. } => {
                let (from, to) = (e.at_ms, e.at_ms + for_ms);
                (from <= end && to >= d.begin).then_some(from.max(d.begin))
            }
            _ => None,
        })
        .min();
    [d.cut, killed, partitioned].into_iter().flatten().min()
}

/// The clock offset of pod `p` at the end (its skew and every jump), ms.
fn final_skew(shared: &Shared, p: usize) -> i64 {
    shared.plan.pods[p].skew_ms
        + shared
            .plan
            .events
            .iter()
            .filter_map(|e| match e.event {
                Event::ClockJump { pod, by_ms } if pod == p => Some(by_ms),
                _ => None,
            })
            .sum::<i64>()
}

/// When the lock the engine last gave the app for `d` ran out, in simulated ms.
fn lock_end(shared: &Shared, d: &AppDelivery) -> Option<u64> {
    to_sim(shared, d.pod, d.lock.as_ref()?.get()?)
}

/// A holder's wall-clock ms in simulated ms (by its clock's offset at the end).
fn to_sim(shared: &Shared, pod: usize, wall: i64) -> Option<u64> {
    let sim = wall - super::world::START_MS - final_skew(shared, pod);
    Some(sim.max(0) as u64)
}

/// Exclusive: a delivery starts only under a valid lock (its own, or its range's lease).
fn started_locked(shared: &Shared, seen: &[AppDelivery]) -> Result<(), String> {
    let tolerance = clock_tolerance(shared);
    for d in seen {
        let Some(until) = d.lock_at_begin.and_then(|wall| to_sim(shared, d.pod, wall)) else {
            continue;
        };
        if until + tolerance < d.begin {
            return Err(format!(
                "delivery {} began at {} ms on p{}#{} under a lock that ran out at {until} ms",
                d.count, d.begin, d.pod, d.incarnation
            ));
        }
    }
    Ok(())
}

/// Exclusive: a message is never in the app twice at once while the lock its first holder had
/// is valid (the app may go on past its lock: its holder died or was cut off, and the lock ran
/// out). Locks are compared across hosts' clocks, within their agreement.
fn never_twice_at_once(shared: &Shared, seen: &[AppDelivery]) -> Result<(), String> {
    let tolerance = clock_tolerance(shared);
    for (i, first) in seen.iter().enumerate() {
        for second in &seen[i + 1..] {
            if second.begin >= first.work_end {
                continue;
            }
            let valid_until = match lock_end(shared, first) {
                Some(end) => end,
                // No lock was told (the app's call never got one): judge by disruption.
                None => disrupted(shared, first).map_or(u64::MAX, |at| at + 1),
            };
            if second.begin + tolerance < valid_until.min(first.work_end) {
                return Err(format!(
                    "delivery {} (p{}#{}, {}..{} ms, locked until {valid_until} ms) and delivery {} (p{}#{}, from {} ms)",
                    first.count,
                    first.pod,
                    first.incarnation,
                    first.begin,
                    first.work_end,
                    second.count,
                    second.pod,
                    second.incarnation,
                    second.begin,
                ));
            }
        }
    }
    Ok(())
}

/// Exclusive: once a completion is recorded, the message is never delivered again, and never
/// completed a second time. (An answer the engine could not record before its holder died may
/// be delivered again: that is no completion yet.)
fn never_after_success(seen: &[AppDelivery], recorded: &[(u64, String)]) -> Result<(), String> {
    let completions: Vec<u64> = recorded
        .iter()
        .filter(|(_, event)| event == "completed")
        .map(|(at, _)| *at)
        .collect();
    if completions.len() > 1 {
        return Err(format!(
            "its completion was recorded {} times, at {completions:?} ms",
            completions.len()
        ));
    }
    let Some(&done_at) = completions.first() else {
        return Ok(());
    };
    match seen.iter().find(|d| d.begin > done_at) {
        Some(again) => Err(format!(
            "delivery {} began at {} ms on p{}#{} after its completion was recorded at {done_at} ms",
            again.count, again.begin, again.pod, again.incarnation
        )),
        None => Ok(()),
    }
}

/// Ordered groups: a key's next message is delivered only once the previous one is settled.
fn fifo_per_key(
    shared: &Shared,
    by: &BTreeMap<(usize, usize), Vec<AppDelivery>>,
    settles: &BTreeMap<(usize, usize), Vec<(u64, String)>>,
) -> Result<(), String> {
    let plan = &shared.plan;
    let order: Vec<(u64, usize)> = {
        let ledger = shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
        ledger.stored_seq.iter().map(|(&m, &s)| (s, m)).collect()
    };
    let mut order = order;
    order.sort();
    for (g, spec) in plan.groups.iter().enumerate() {
        if !spec.ordered {
            continue;
        }
        // Per key, the messages of the previous write and of this one.
        let mut last_of_key: BTreeMap<String, (u64, Vec<usize>, Vec<usize>)> = BTreeMap::new();
        let mut pairs = Vec::new();
        for &(seq, m) in &order {
            let entry = last_of_key
                .entry(plan.messages[m].key.to_string())
                .or_insert((seq, Vec::new(), Vec::new()));
            if entry.0 != seq {
                entry.1 = std::mem::take(&mut entry.2);
                entry.0 = seq;
            }
            entry.2.push(m);
            for &a in &entry.1 {
                pairs.push((a, m));
            }
        }
        for (a, m) in pairs {
            let key = short_key(&plan.messages[m].key);
            let (Some(da), Some(db)) = (by.get(&(g, a)), by.get(&(g, m))) else {
                continue;
            };
            // The first final answer settled it, or the engine's record when that came first (a
            // later answer came from a delivery whose lock had run out: its holder was cut off
            // or dead, the app went on).
            let recorded = settles
                .get(&(g, a))
                .and_then(|s| s.iter().map(|(at, _)| *at).min());
            let settled_at = da
                .iter()
                .filter_map(|d| match d.answered {
                    Some((at, AnswerKind::Complete | AnswerKind::Drop)) => Some(at),
                    _ => None,
                })
                .chain(recorded)
                .min()
                .or_else(|| {
                    (da.len() as u32 >= spec.max_attempts)
                        .then(|| {
                            da.iter()
                                .map(|d| d.answered.map_or(d.work_end, |a| a.0))
                                .max()
                        })
                        .flatten()
                });
            let Some(settled_at) = settled_at else {
                continue;
            };
            let first_b = db.iter().map(|d| d.begin).min().unwrap_or(u64::MAX);
            if first_b < settled_at {
                return Err(format!(
                    "FIFO broken: g{g} key {key}: m{m} delivered at {first_b} ms before m{a} was settled at {settled_at} ms"
                ));
            }
        }
    }
    Ok(())
}
