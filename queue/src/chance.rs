//! Where the engine draws chance (back-off jitter, lock tokens): the machine's randomness, or,
//! in builds with the `simulation` feature, a generator the simulation seeds for its thread,
//! so that a seed is a history and a failure replays exactly.

#[cfg(feature = "simulation")]
thread_local! {
    static SEEDED: std::cell::RefCell<Option<rand::rngs::StdRng>> = const { std::cell::RefCell::new(None) };
}

/// A uniform sample from `[0, 1)`.
pub fn unit() -> f64 {
    #[cfg(feature = "simulation")]
    if let Some(x) = SEEDED.with(|rng| rng.borrow_mut().as_mut().map(rand::Rng::random::<f64>)) {
        return x;
    }
    rand::random::<f64>()
}

/// 128 random bits.
pub fn bits() -> u128 {
    #[cfg(feature = "simulation")]
    if let Some(x) = SEEDED.with(|rng| rng.borrow_mut().as_mut().map(rand::Rng::random::<u128>)) {
        return x;
    }
    rand::random::<u128>()
}

/// Draws this thread's chance from `seed` from now on; `false` in builds without the
/// `simulation` feature.
pub fn seed_thread(seed: u64) -> bool {
    #[cfg(feature = "simulation")]
    {
        use rand::SeedableRng as _;
        SEEDED.with(|rng| *rng.borrow_mut() = Some(rand::rngs::StdRng::seed_from_u64(seed)));
        true
    }
    #[cfg(not(feature = "simulation"))]
    {
        let _ = seed;
        false
    }
}

#[cfg(all(test, feature = "simulation"))]
mod tests {
    use super::*;

    #[test]
    fn a_seeded_thread_draws_the_same_chance_again() {
        let draw = |seed| {
            std::thread::spawn(move || {
                seed_thread(seed);
                (unit(), bits())
            })
            .join()
            .unwrap()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }
}
