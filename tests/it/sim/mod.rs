//! The deterministic simulation (FoundationDB's simulation, TigerBeetle's VOPR): the engine's
//! hosts, the producer, push and pull apps and every fault run in one thread on tokio's paused
//! time against the SDK's in-memory emulator, every choice drawn from one seed, so that a seed
//! is a history and a failure replays exactly. After each history the whole ledger is checked
//! (`check.rs`); a failing history is shrunk and printed with the commands that replay it.
//!
//! - `COSMOSQ_SIM_CASES` histories (200 by default) from `COSMOSQ_SIM_SEED` (0);
//! - `COSMOSQ_SIM_PLAN='<json>'` replays a plan a failure printed;
//! - `COSMOSQ_SIM_LOG=debug` keeps the engine's logs of a failing history at that level;
//! - `COSMOSQ_SIM_BUG=<Bug>` puts a defect back in a replay or a search (and picks one for the
//!   mutation test).
//!
//! The simulation is trusted because it is tested: each defect of `cosmosq_queue::buggify`
//! put back must be found within a few cases (`the_simulation_finds_each_reintroduced_defect`).

mod check;
mod logs;
mod plan;
mod scenarios;
mod ttl;
mod world;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use cosmosq_queue::buggify::Bug;
use plan::Plan;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Histories at once: one per core (each runs on a single thread).
fn parallelism() -> usize {
    std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(2)
        .clamp(1, 8)
}

/// What a batch of histories found.
struct Found {
    seed: u64,
    plan: Plan,
    error: String,
    log: String,
}

struct Totals {
    cases: u64,
    simulated_ms: u64,
}

/// Runs histories `first..first + cases` (side by side) with `bugs`, until one fails.
fn search(first: u64, cases: u64, bugs: &[Bug]) -> (Result<(), Box<Found>>, Totals) {
    let next = AtomicU64::new(first);
    let stop = AtomicBool::new(false);
    let found: Mutex<Option<Found>> = Mutex::new(None);
    let (ran, simulated) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|scope| {
        for _ in 0..parallelism() {
            scope.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::SeqCst);
                if seed >= first + cases || stop.load(Ordering::SeqCst) {
                    return;
                }
                let plan = Plan::generate(seed);
                let started = Instant::now();
                let report = world::run(&plan, bugs);
                if std::env::var_os("COSMOSQ_SIM_VERBOSE").is_some() {
                    println!(
                        "seed {seed}: {} | {:.1} s simulated in {:.2} s | {} trace lines",
                        match &report.verdict {
                            Ok(()) => "ok".to_owned(),
                            Err(e) => e.chars().take(200).collect(),
                        },
                        report.simulated_ms as f64 / 1000.0,
                        started.elapsed().as_secs_f64(),
                        report.trace.len()
                    );
                }
                ran.fetch_add(1, Ordering::SeqCst);
                simulated.fetch_add(report.simulated_ms, Ordering::SeqCst);
                if let Err(error) = report.verdict {
                    if std::env::var_os("COSMOSQ_SIM_SURVEY").is_some() {
                        continue; // every seed's verdict, printed above
                    }
                    stop.store(true, Ordering::SeqCst);
                    let mut found = found.lock().unwrap();
                    // The lowest failing seed, so that a rerun names the same one.
                    if found.as_ref().is_none_or(|f| f.seed > seed) {
                        *found = Some(Found {
                            seed,
                            plan,
                            error,
                            log: report.log,
                        });
                    }
                }
            });
        }
    });
    let totals = Totals {
        cases: ran.load(Ordering::SeqCst),
        simulated_ms: simulated.load(Ordering::SeqCst),
    };
    match found.into_inner().unwrap() {
        Some(found) => (Err(Box::new(found)), totals),
        None => (Ok(()), totals),
    }
}

/// What kind of promise an error says broke (its words before the first colon).
fn kind(error: &str) -> &str {
    error.split(':').next().unwrap_or(error)
}

/// Shrinks a failing plan while it keeps breaking the same kind of promise, at most `budget`
/// runs.
fn shrink(mut plan: Plan, mut error: String, bugs: &[Bug], budget: usize) -> (Plan, String) {
    let mut runs = 0;
    'smaller: loop {
        for candidate in plan.shrinks() {
            if runs >= budget {
                break 'smaller;
            }
            runs += 1;
            if let Err(e) = world::run(&candidate, bugs).verdict {
                if kind(&e) == kind(&error) {
                    (plan, error) = (candidate, e);
                    continue 'smaller;
                }
            }
        }
        break;
    }
    (plan, error)
}

/// Saves a failing plan and its log under `target/sim/`; the path without its extension.
fn save(seed: u64, plan: &Plan, log: &str) -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/sim");
    let _ = std::fs::create_dir_all(&dir);
    let base = dir.join(format!("history-{seed}"));
    let base = base.to_string_lossy().into_owned();
    let _ = std::fs::write(
        format!("{base}.json"),
        serde_json::to_string_pretty(plan).expect("json"),
    );
    let _ = std::fs::write(format!("{base}.log"), log);
    base
}

/// The defects `COSMOSQ_SIM_BUG` names (`Bug`'s names, comma-separated) put back.
fn bugs_from_env() -> Vec<Bug> {
    let names = std::env::var("COSMOSQ_SIM_BUG").unwrap_or_default();
    names
        .split(',')
        .filter(|n| !n.is_empty())
        .map(|name| {
            *Bug::ALL
                .iter()
                .find(|b| format!("{b:?}") == name)
                .unwrap_or_else(|| panic!("COSMOSQ_SIM_BUG: no defect {name:?}"))
        })
        .collect()
}

fn tail(log: &str, lines: usize) -> String {
    let all: Vec<&str> = log.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[test]
fn simulated_histories_keep_every_promise() {
    if let Ok(text) = std::env::var("COSMOSQ_SIM_PLAN") {
        // The plan itself, or `@<file>` where a failure saved it.
        let text = match text.strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path).expect("COSMOSQ_SIM_PLAN: a readable file"),
            None => text,
        };
        let plan: Plan =
            serde_json::from_str(&text).expect("COSMOSQ_SIM_PLAN: a plan a failure printed");
        let report = world::run(&plan, &bugs_from_env());
        let saved = save(
            plan.seed,
            &plan,
            &format!("{}\n--- trace ---\n{}", report.log, report.trace.join("\n")),
        );
        if let Err(error) = report.verdict {
            panic!("the replayed plan breaks a promise: {error}\n(its log: {saved}.log)");
        }
        return;
    }
    let first = env_u64("COSMOSQ_SIM_SEED", 0);
    let cases = env_u64("COSMOSQ_SIM_CASES", 200);
    let started = Instant::now();
    let bugs = bugs_from_env();
    let (result, totals) = search(first, cases, &bugs);
    let wall = started.elapsed().as_secs_f64();
    println!(
        "simulation | {} histories from seed {first} | {:.0} s simulated in {wall:.1} s ({:.0} simulated s per wall s)",
        totals.cases,
        totals.simulated_ms as f64 / 1000.0,
        totals.simulated_ms as f64 / 1000.0 / wall
    );
    if let Err(found) = result {
        let Found {
            seed,
            plan,
            error,
            log,
        } = *found;
        let (small, small_error) = shrink(plan, error.clone(), &bugs, 40);
        let saved = save(seed, &small, &world::run(&small, &bugs).log);
        panic!(
            "history {seed} broke a promise: {error}\n\
             replay it: COSMOSQ_SIM_SEED={seed} COSMOSQ_SIM_CASES=1 cargo test -p cosmosq-tests --test it sim:: -- --nocapture\n\
             shrunk to: {small_error}\n\
             replay that: COSMOSQ_SIM_PLAN=@{saved}.json cargo test -p cosmosq-tests --test it sim::simulated -- --nocapture\n\
             (its log: {saved}.log)\n\
             the engine's last words:\n{}",
            tail(&log, 60)
        );
    }
}

#[test]
fn a_seed_replays_the_same_history() {
    let seeds = match std::env::var("COSMOSQ_SIM_SEED") {
        Ok(seed) => vec![seed.parse().expect("COSMOSQ_SIM_SEED: a number")],
        Err(_) => vec![3, 17],
    };
    for seed in seeds {
        let plan = Plan::generate(seed);
        let (one, two) = (world::run(&plan, &[]), world::run(&plan, &[]));
        assert!(!one.trace.is_empty(), "seed {seed} did nothing");
        if let Some(at) = one.trace.iter().zip(&two.trace).position(|(a, b)| a != b) {
            let from = at.saturating_sub(8);
            panic!(
                "seed {seed} ran two ways from event {at} of {}:\n{}\n---\n{}",
                one.trace.len(),
                one.trace[from..(at + 4).min(one.trace.len())].join("\n"),
                two.trace[from..(at + 4).min(two.trace.len())].join("\n"),
            );
        }
        assert_eq!(
            one.trace.len(),
            two.trace.len(),
            "seed {seed}: traces of different lengths"
        );
    }
}

/// The simulation's power, measured: each searched defect of [`Bug::ALL`] put back must break a
/// promise within the histories the suite runs (`COSMOSQ_SIM_CASES`), and the history that
/// finds it must keep every promise without it — so what was found is the defect. The others
/// ([`Bug::searched`]) are pinned by written histories (`scenarios.rs`).
#[test]
fn the_simulation_finds_each_reintroduced_defect() {
    let first = env_u64("COSMOSQ_SIM_SEED", 0);
    let cases = env_u64("COSMOSQ_SIM_CASES", 200);
    let only = bugs_from_env();
    let mut table = Vec::new();
    let mut missed = Vec::new();
    for bug in Bug::ALL.into_iter().filter(|b| b.searched()) {
        if !only.is_empty() && !only.contains(&bug) {
            continue;
        }
        let started = Instant::now();
        let (result, _) = search(first, cases, &[bug]);
        let wall = started.elapsed().as_secs_f64();
        match result {
            Ok(()) => missed.push(format!("{bug:?}")),
            Err(found) => {
                let clean = world::run(&found.plan, &[]).verdict;
                assert!(
                    clean.is_ok(),
                    "history {} fails without {bug:?} too: {}",
                    found.seed,
                    clean.unwrap_err()
                );
                let row = format!(
                    "{:<30} history {:>4} ({:>3} cases, {wall:>5.1} s): {}",
                    format!("{bug:?}"),
                    found.seed,
                    found.seed - first + 1,
                    kind(&found.error)
                );
                eprintln!("{row}");
                table.push(row);
            }
        }
    }
    println!(
        "defect put back → first history that finds it\n{}",
        table.join("\n")
    );
    assert!(
        missed.is_empty(),
        "{cases} histories from seed {first} did not find: {}",
        missed.join(", ")
    );
}
