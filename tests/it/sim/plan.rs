//! A history as data: what a seed draws (the workload, the groups, the pods and every fault
//! with its time), so that a seed *is* a history and a shrunk one can be printed and replayed.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// One history.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Plan {
    pub seed: u64,
    /// Physical partitions of the messages container at the start.
    pub partitions: u32,
    /// Leases per physical partition: above one, a pod's idle ranges of a partition rest on
    /// its probe.
    #[serde(default = "one")]
    pub leases_per_partition: u32,
    pub retention_secs: u32,
    pub groups: Vec<GroupPlan>,
    pub messages: Vec<MessagePlan>,
    /// Pods, each a host of one group (a sidecar).
    pub pods: Vec<PodPlan>,
    /// What happens when, in simulated ms from the start; sorted by time.
    pub events: Vec<Timed>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct GroupPlan {
    pub stream: bool,
    pub ordered: bool,
    /// `exclusiveWrites: Claims` (else the lease write path).
    pub claims: bool,
    /// Workers pull instead of the host pushing.
    pub pull: bool,
    pub max_attempts: u32,
    pub lock_ms: u64,
    pub promote_after_ms: u64,
    /// Deliveries in flight per host at most.
    pub concurrency: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct MessagePlan {
    pub id: String,
    pub key: Value,
    /// When the producer enqueues it, ms.
    pub at_ms: u64,
    /// Enqueued with the messages of the same `at_ms` and key in one batch.
    pub batch: bool,
    pub delay_ms: u64,
    pub ttl_secs: Option<u32>,
    /// What the app answers to its n-th delivery in a group (`Complete` after the list).
    pub answers: Vec<Answer>,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct Answer {
    pub kind: AnswerKind,
    /// How long the app works before answering, ms.
    pub work_ms: u64,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum AnswerKind {
    Complete,
    Retry,
    Drop,
    /// The handler panics (the app crashed mid-request).
    Crash,
    /// The app refused the connection (not listening): never seen by the app.
    Refused,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PodPlan {
    pub group: usize,
    /// Clock skew at the start, ms.
    pub skew_ms: i64,
    /// Started at this time (a pod scaled in later), ms.
    pub start_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Timed {
    pub at_ms: u64,
    pub event: Event,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub enum Event {
    /// The sidecar process dies (OOM, liveness probe); the app keeps working. It starts again
    /// under the same name after `restart_after_ms`.
    Kill { pod: usize, restart_after_ms: u64 },
    /// SIGTERM: drain and stop; started again after `restart_after_ms`.
    Stop { pod: usize, restart_after_ms: u64 },
    /// The pod cannot reach Cosmos DB for `for_ms` (a partition, or a paused process' view).
    Partition { pod: usize, for_ms: u64 },
    /// Requests of one kind fail (or lose their answer) for `for_ms`, on every pod.
    Fault { fault: Fault, op: Op, for_ms: u64 },
    /// The pod's clock jumps by `by_ms`.
    ClockJump { pod: usize, by_ms: i64 },
    /// The messages container's partitions split until there are `partitions` (no fewer:
    /// the SDK's emulator renumbers LSNs when partitions merge, so positions taken before a
    /// merge point elsewhere after it, which the service does not do; merges have targeted
    /// tests of their own).
    Split { partitions: u32 },
    /// Items whose TTL has passed are removed.
    TtlSweep,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum Fault {
    /// 429, retried by the SDK.
    Throttled,
    /// 429 asking for seconds (sustained overload): the SDK's retries hold a request for the
    /// whole fault, and it lands when the fault ends.
    Overloaded,
    /// 503.
    Unavailable,
    /// A timeout before the service saw the request.
    Timeout,
    /// Applied by the service, the answer lost.
    LostAnswer,
    /// Refused for good (400).
    Refused,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum Op {
    Create,
    Replace,
    Read,
    Query,
    Feed,
    Batch,
}

/// The faults a seed draws from: a long throttle only in written histories (see
/// `scenarios.rs`; drawn at random, it lines up with kills in ways that need their own work,
/// see `docs/design.md`).
const DRAWN_FAULTS: [Fault; 5] = [
    Fault::Throttled,
    Fault::Unavailable,
    Fault::Timeout,
    Fault::LostAnswer,
    Fault::Refused,
];

/// Every fault.
pub const FAULTS: [Fault; 6] = [
    Fault::Throttled,
    Fault::Overloaded,
    Fault::Unavailable,
    Fault::Timeout,
    Fault::LostAnswer,
    Fault::Refused,
];

/// Every kind of request, in the order a seed draws them.
pub const OPS: [Op; 6] = [
    Op::Create,
    Op::Replace,
    Op::Read,
    Op::Query,
    Op::Feed,
    Op::Batch,
];

/// Keys of every JSON type, a long one included (a hashed state partition key).
pub fn key_pool() -> Vec<Value> {
    vec![
        json!("tenant-a"),
        json!("tenant-b"),
        json!(7),
        json!(2.5),
        json!(true),
        Value::Null,
        json!(-3),
        json!("k".repeat(1200)),
    ]
}

fn one() -> u32 {
    1
}

/// Half the histories drawn from the whole space run finer leases (2 or 4 a partition), so
/// hosts hold several leases of a partition and idle ranges share its probe. Drawn apart from the rest of the seed's draws, which it leaves as they
/// were.
fn leases_per_partition(seed: u64) -> u32 {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x001E_A5E5);
    [1, 1, 2, 4][rng.random_range(0..4)]
}

impl Plan {
    /// The history `seed` draws: one in five a focused workload (below), the others from the
    /// whole space.
    pub fn generate(seed: u64) -> Plan {
        match seed % 5 {
            4 => Self::focused(seed),
            _ => Self::general(seed),
        }
    }

    /// Workloads aimed at what a whole-space draw rarely lines up (FoundationDB's specific
    /// workloads next to its random ones), their numbers still drawn by the seed: a dead
    /// holder's work, with nothing else going on, that must come back within its lock; long
    /// redeliveries while another host asks for the range; promotions while creates are
    /// refused; a host cut off while its deliveries wait for permits.
    fn focused(seed: u64) -> Plan {
        let mut rng = StdRng::seed_from_u64(seed ^ 0xF0C0_5ED0);
        let keys = key_pool();
        let key = |rng: &mut StdRng| keys[rng.random_range(0..keys.len())].clone();
        let complete = |work_ms: u64| Answer {
            kind: AnswerKind::Complete,
            work_ms,
        };
        let message = |n: usize, key: Value, at_ms: u64, answers: Vec<Answer>| MessagePlan {
            id: format!("m{n}"),
            key,
            at_ms,
            batch: false,
            delay_ms: 0,
            ttl_secs: None,
            answers,
        };
        let pod = |start_ms: u64| PodPlan {
            group: 0,
            skew_ms: 0,
            start_ms,
        };
        let mut group = GroupPlan {
            stream: false,
            ordered: false,
            claims: false,
            pull: false,
            max_attempts: rng.random_range(2..=4),
            lock_ms: 4_000,
            promote_after_ms: 1_500,
            concurrency: [8, 64][rng.random_range(0..2)],
        };
        let mut partitions = None;
        let (messages, pods, events) = match rng.random_range(0..4) {
            0 => {
                group.claims = rng.random_bool(0.3);
                group.lock_ms = [2_000, 4_000][rng.random_range(0..2)];
                group.promote_after_ms = group.lock_ms * 4 / 5;
                let messages = (0..rng.random_range(10..30))
                    .map(|n| {
                        let work = rng.random_range(200..1_400);
                        let at = rng.random_range(0..8_000);
                        message(n, key(&mut rng), at, vec![complete(work)])
                    })
                    .collect();
                let pods = (0..rng.random_range(2..=3)).map(|_| pod(0)).collect();
                let kill = Timed {
                    at_ms: rng.random_range(3_000..8_000),
                    event: Event::Kill {
                        pod: 0,
                        restart_after_ms: 20_000,
                    },
                };
                (messages, pods, vec![kill])
            }
            1 => {
                group.lock_ms = rng.random_range(4_000..8_000);
                group.promote_after_ms = rng.random_range(1_000..2_000);
                let messages = (0..rng.random_range(8..16))
                    .map(|n| {
                        let answers = vec![
                            complete(rng.random_range(1_000..3_000)),
                            complete(rng.random_range(8_000..15_000)),
                        ];
                        let at = rng.random_range(0..1_000);
                        message(n, key(&mut rng), at, answers)
                    })
                    .collect();
                let kill_at = rng.random_range(500..1_500);
                let pods = vec![pod(0), pod(kill_at + rng.random_range(3_000..6_000))];
                let kill = Timed {
                    at_ms: kill_at,
                    event: Event::Kill {
                        pod: 0,
                        restart_after_ms: 0,
                    },
                };
                (messages, pods, vec![kill])
            }
            2 => {
                group.lock_ms = 8_000;
                group.promote_after_ms = rng.random_range(500..1_500);
                let messages = (0..rng.random_range(4..12))
                    .map(|n| {
                        let work = rng.random_range(2_000..6_000);
                        let at = rng.random_range(0..3_000);
                        message(n, key(&mut rng), at, vec![complete(work)])
                    })
                    .collect();
                let pods = (0..rng.random_range(1..=2)).map(|_| pod(0)).collect();
                let refused = Timed {
                    at_ms: rng.random_range(300..3_000),
                    event: Event::Fault {
                        fault: Fault::Refused,
                        op: Op::Create,
                        for_ms: rng.random_range(500..3_000),
                    },
                };
                (messages, pods, vec![refused])
            }
            _ => {
                // A host cut off from Cosmos DB while what it read waits for its permits,
                // held by long work in another range: nothing may start once its lease may
                // have expired. promoteAfter beyond the lease expiry keeps long first
                // deliveries under the lease (a setting a user may choose).
                group.concurrency = rng.random_range(1..=2);
                group.lock_ms = [4_000, 8_000][rng.random_range(0..2)];
                group.promote_after_ms = rng.random_range(12_000..20_000);
                partitions = Some(rng.random_range(2..=3));
                let messages = (0..rng.random_range(3..8))
                    .map(|n| {
                        let work = rng.random_range(7_000..11_000);
                        let at = rng.random_range(0..300);
                        message(n, json!(n), at, vec![complete(work)])
                    })
                    .collect();
                let cut_at = rng.random_range(1_500..3_000);
                let pods = vec![pod(0), pod(cut_at + rng.random_range(0..1_000))];
                let cut = Timed {
                    at_ms: cut_at,
                    event: Event::Partition {
                        pod: 0,
                        for_ms: rng.random_range(15_000..25_000),
                    },
                };
                (messages, pods, vec![cut])
            }
        };
        Plan {
            seed,
            partitions: partitions.unwrap_or_else(|| rng.random_range(1..=3)),
            // One lease a partition: each focused workload lines up one defect, and finer
            // leases change the line-up (with them, history 19 no longer showed a dead
            // holder's work recovered by the lease expiry instead of its lock).
            leases_per_partition: 1,
            retention_secs: 3_600,
            groups: vec![group],
            messages,
            pods,
            events,
        }
    }

    /// A history from the whole space of workloads and faults.
    fn general(seed: u64) -> Plan {
        let mut rng = StdRng::seed_from_u64(seed);
        let keys = key_pool();
        let key_count = rng.random_range(1..=keys.len());
        let offset = rng.random_range(0..keys.len());
        let keys: Vec<Value> = (0..key_count)
            .map(|i| keys[(offset + i) % keys.len()].clone())
            .collect();
        let groups: Vec<GroupPlan> = (0..rng.random_range(1..=2))
            .map(|_| {
                let stream = rng.random_bool(0.25);
                let lock_ms = [2_000, 4_000, 8_000][rng.random_range(0..3)];
                GroupPlan {
                    stream,
                    ordered: rng.random_bool(0.4),
                    claims: !stream && rng.random_bool(0.25),
                    pull: rng.random_bool(0.2),
                    max_attempts: rng.random_range(1..=4),
                    lock_ms,
                    promote_after_ms: rng.random_range(300..lock_ms / 2),
                    concurrency: [2, 8, 64][rng.random_range(0..3)],
                }
            })
            .collect();
        let horizon_ms = rng.random_range(3_000..20_000u64);
        let repeat_ids = rng.random_bool(0.5);
        let messages: Vec<MessagePlan> = (0..rng.random_range(4..=40))
            .map(|n| {
                let key = keys[rng.random_range(0..keys.len())].clone();
                // Per-tenant sequence numbers as ids: the same id under several keys.
                let id = if repeat_ids && rng.random_bool(0.6) {
                    format!("inv-{}", rng.random_range(0..4))
                } else {
                    format!("m{n}")
                };
                MessagePlan {
                    id,
                    key,
                    at_ms: if rng.random_bool(0.3) {
                        0
                    } else {
                        rng.random_range(0..horizon_ms)
                    },
                    batch: rng.random_bool(0.2),
                    delay_ms: if rng.random_bool(0.15) {
                        rng.random_range(0..6_000)
                    } else {
                        0
                    },
                    ttl_secs: rng.random_bool(0.05).then(|| rng.random_range(5..60)),
                    answers: answers(&mut rng),
                }
            })
            .collect();
        let mut pods = Vec::new();
        for g in 0..groups.len() {
            for _ in 0..rng.random_range(1..=3) {
                pods.push(PodPlan {
                    group: g,
                    skew_ms: rng.random_range(-300..=300),
                    start_ms: if rng.random_bool(0.3) {
                        rng.random_range(0..horizon_ms)
                    } else {
                        0
                    },
                });
            }
        }
        // A group scaled from zero (KEDA, or the operator at `minReplicas: 0`): nobody reads
        // until its estimates have seen the backlog, and the operator made its leases. Drawn
        // apart, so that the rest of the history is what the seed drew before.
        // A backlog growing while nobody reads is when a container splits: half of them see
        // one between the first estimate (5 s) and the wake-up.
        let mut zrng = StdRng::seed_from_u64(seed ^ 0x5CA1_E0FF);
        let mut events = Vec::new();
        for g in 0..groups.len() {
            if zrng.random_bool(0.25) {
                let woken_at = zrng.random_range(8_000..16_000);
                for pod in pods.iter_mut().filter(|p| p.group == g) {
                    pod.start_ms = pod.start_ms.max(woken_at);
                }
                if zrng.random_bool(0.5) {
                    events.push(Timed {
                        at_ms: zrng.random_range(5_500..woken_at - 2_000),
                        event: Event::Split {
                            partitions: zrng.random_range(2..=4),
                        },
                    });
                }
            }
        }
        let mut at = || rng.random_range(0..horizon_ms + 5_000);
        let fault_count = {
            let mut r = StdRng::seed_from_u64(seed ^ 0x9E37_79B9);
            r.random_range(0..=5)
        };
        let mut erng = StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(7));
        // Swarm testing (Groce et al.): each history enables a few kinds of fault only, so
        // that some histories are calm but for one kind, where a timing promise can be judged.
        let swarm: Vec<bool> = (0..7).map(|_| erng.random_bool(0.5)).collect();
        let enabled = |kind: usize| swarm[kind] || swarm.iter().all(|on| !on);
        let mut drawn = 0;
        while drawn < fault_count {
            let at_ms = at();
            let pod = erng.random_range(0..pods.len());
            let roll = erng.random_range(0..100);
            let kind = match roll {
                0..30 => 0,
                30..40 => 1,
                40..50 => 2,
                50..75 => 3,
                75..85 => 4,
                85..95 => 5,
                _ => 6,
            };
            if !enabled(kind) {
                continue;
            }
            drawn += 1;
            let event = match kind {
                0 => Event::Kill {
                    pod,
                    restart_after_ms: [0, 200, 3_000][erng.random_range(0..3)],
                },
                1 => Event::Stop {
                    pod,
                    restart_after_ms: erng.random_range(0..4_000),
                },
                2 => Event::Partition {
                    pod,
                    for_ms: erng.random_range(500..30_000),
                },
                3 => {
                    let fault = DRAWN_FAULTS[erng.random_range(0..DRAWN_FAULTS.len())];
                    // Refusals are mostly of creates: the claims, promotions, parks and dead
                    // letters whose refusal must end in a dead letter with its cause.
                    let op = match fault == Fault::Refused && erng.random_bool(0.5) {
                        true => Op::Create,
                        false => OPS[erng.random_range(0..OPS.len())],
                    };
                    Event::Fault {
                        fault,
                        op,
                        for_ms: erng.random_range(100..4_000),
                    }
                }
                4 => Event::ClockJump {
                    pod,
                    by_ms: erng.random_range(-2_000..=2_000),
                },
                5 => {
                    // Half the splits come while a dead sidecar's window still lists what it
                    // started: the children inherit it.
                    if enabled(0) && erng.random_bool(0.5) {
                        events.push(Timed {
                            at_ms: at_ms.saturating_sub(300),
                            event: Event::Kill {
                                pod,
                                restart_after_ms: 3_000,
                            },
                        });
                    }
                    Event::Split {
                        partitions: erng.random_range(2..=4),
                    }
                }
                _ => Event::TtlSweep,
            };
            events.push(Timed { at_ms, event });
        }
        events.sort_by_key(|e| e.at_ms);
        Plan {
            seed,
            partitions: rng.random_range(1..=3),
            leases_per_partition: leases_per_partition(seed),
            retention_secs: [3600, 86_400][rng.random_range(0..2)],
            groups,
            messages,
            pods,
            events,
        }
    }

    /// The answer to the `n`-th delivery (1-based) the app sees of message `m` in a group.
    pub fn answer(&self, m: usize, n: u32) -> Answer {
        let answers = &self.messages[m].answers;
        answers
            .get(n as usize - 1)
            .copied()
            .unwrap_or_else(|| *answers.last().expect("every message ends in Complete"))
    }

    /// Smaller plans that may fail the same way, most promising first.
    pub fn shrinks(&self) -> Vec<Plan> {
        let mut out = Vec::new();
        let with = |change: &dyn Fn(&mut Plan)| {
            let mut p = self.clone();
            change(&mut p);
            p
        };
        for i in 0..self.events.len() {
            out.push(with(&|p| {
                p.events.remove(i);
            }));
        }
        for g in 0..self.groups.len() {
            if self.groups.len() > 1 {
                out.push(with(&|p| p.remove_group(g)));
            }
        }
        for i in 0..self.pods.len() {
            let group = self.pods[i].group;
            if self.pods.iter().filter(|p| p.group == group).count() > 1 {
                out.push(with(&|p| p.remove_pod(i)));
            }
        }
        let n = self.messages.len();
        if n > 1 {
            out.push(with(&|p| p.messages.truncate(n / 2)));
            out.push(with(&|p| {
                p.messages.drain(..n / 2);
            }));
            for i in 0..n {
                out.push(with(&|p| {
                    p.messages.remove(i);
                }));
            }
        }
        for i in 0..n {
            let m = &self.messages[i];
            if m.answers.len() > 1 {
                out.push(with(&|p| {
                    let last = *p.messages[i].answers.last().expect("non-empty");
                    p.messages[i].answers = vec![last];
                }));
            }
            if m.delay_ms > 0 {
                out.push(with(&|p| p.messages[i].delay_ms = 0));
            }
            if m.at_ms > 0 {
                out.push(with(&|p| p.messages[i].at_ms = 0));
            }
            if m.ttl_secs.is_some() {
                out.push(with(&|p| p.messages[i].ttl_secs = None));
            }
        }
        out
    }

    fn remove_group(&mut self, g: usize) {
        self.groups.remove(g);
        let kept: Vec<bool> = self.pods.iter().map(|p| p.group != g).collect();
        let mut index = Vec::new();
        let mut next = 0;
        for keep in &kept {
            index.push(keep.then(|| {
                next += 1;
                next - 1
            }));
        }
        self.pods = self
            .pods
            .iter()
            .filter(|p| p.group != g)
            .cloned()
            .map(|mut p| {
                if p.group > g {
                    p.group -= 1;
                }
                p
            })
            .collect();
        self.remap_pods(&index);
    }

    fn remove_pod(&mut self, i: usize) {
        self.pods.remove(i);
        let index: Vec<Option<usize>> = (0..=self.pods.len())
            .map(|p| match p.cmp(&i) {
                std::cmp::Ordering::Less => Some(p),
                std::cmp::Ordering::Equal => None,
                std::cmp::Ordering::Greater => Some(p - 1),
            })
            .collect();
        self.remap_pods(&index);
    }

    /// Events of pods that are gone go with them; the others follow their pod's new index.
    fn remap_pods(&mut self, index: &[Option<usize>]) {
        self.events.retain_mut(|t| match &mut t.event {
            Event::Kill { pod, .. }
            | Event::Stop { pod, .. }
            | Event::Partition { pod, .. }
            | Event::ClockJump { pod, .. } => match index.get(*pod).copied().flatten() {
                Some(new) => {
                    *pod = new;
                    true
                }
                None => false,
            },
            _ => true,
        });
    }
}

/// What the app answers to each delivery of a message: a few failures, then success.
fn answers(rng: &mut StdRng) -> Vec<Answer> {
    let mut out: Vec<Answer> = Vec::new();
    for _ in 0..rng.random_range(0..=3) {
        let kind = match rng.random_range(0..100) {
            0..45 => AnswerKind::Retry,
            45..55 => AnswerKind::Drop,
            55..65 => AnswerKind::Crash,
            65..80 => AnswerKind::Refused,
            _ => AnswerKind::Complete,
        };
        out.push(Answer {
            kind,
            work_ms: work(rng),
        });
    }
    out.push(Answer {
        kind: AnswerKind::Complete,
        work_ms: work(rng),
    });
    out
}

fn work(rng: &mut StdRng) -> u64 {
    match rng.random_range(0..100) {
        0..65 => rng.random_range(0..50),
        65..85 => rng.random_range(50..1_500),
        // Long work: past `promoteAfter`, sometimes past the lock.
        _ => rng.random_range(1_500..12_000),
    }
}
