//! Seeded randomness, the same on every platform and version, which the distributed nodes
//! rely on: a small generator (xoshiro256**, seeded by splitmix64) for streams, and
//! [`Draws`], uniforms keyed by (seed, position, draw index) for sampling and acceptance.
//!
//! Sampling keys its draws by position rather than pulling them from a stream, so that the
//! token chosen at committed position n depends only on the seed, n and the distributions: a
//! replayed session, a repaired prefix, a reconnect or a duplicated request draws the same
//! numbers and reaches the same verdict.

/// Seeded pseudo-random numbers for sampling and acceptance.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut state = seed;
        Self {
            s: std::array::from_fn(|_| splitmix64(&mut state)),
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 bits of precision.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Uniforms keyed by position: `uniform(n, i)` is the i-th draw of committed position n, the same
/// whenever it is asked for. One stream key per role keeps the draft's and the target's draws
/// independent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draws {
    key: u64,
}

/// The draw that decides whether a draft token is accepted.
pub const ACCEPT_DRAW: u64 = 0;
/// The draw that samples a token (a draft, a correction, a bonus or a plain step).
pub const SAMPLE_DRAW: u64 = 1;

impl Draws {
    /// Draws of `seed` in the stream named by `stream`.
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut state = seed ^ stream;
        Self {
            key: splitmix64(&mut state),
        }
    }

    /// The `draw`-th uniform in [0, 1) of position `position`.
    pub fn uniform(&self, position: usize, draw: u64) -> f64 {
        let mut state = self.key ^ (position as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
        let mixed = splitmix64(&mut state);
        let mut state = mixed ^ draw.wrapping_mul(0x8cb9_2ba7_2f3d_8dd7);
        (splitmix64(&mut state) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::{Draws, Rng};

    #[test]
    fn keyed_draws_repeat_and_spread() {
        let (a, b) = (Draws::new(3, 1), Draws::new(3, 2));
        assert_eq!(a.uniform(10, 0), Draws::new(3, 1).uniform(10, 0));
        assert_ne!(a.uniform(10, 0), b.uniform(10, 0), "streams differ");
        assert_ne!(a.uniform(10, 0), a.uniform(11, 0), "positions differ");
        assert_ne!(a.uniform(10, 0), a.uniform(10, 1), "draws differ");
        let n = 20_000;
        let mut sum = 0.0;
        let mut below_tenth = 0;
        for position in 0..n {
            let u = a.uniform(position, 1);
            assert!((0.0..1.0).contains(&u));
            sum += u;
            below_tenth += usize::from(u < 0.1);
        }
        assert!(
            (sum / n as f64 - 0.5).abs() < 0.01,
            "mean {}",
            sum / n as f64
        );
        assert!((1_800..2_200).contains(&below_tenth), "{below_tenth}");
    }

    #[test]
    fn same_seed_same_stream_and_uniform_in_range() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let mut sum = 0.0;
        for _ in 0..10_000 {
            let u = a.uniform();
            assert_eq!(u, b.uniform());
            assert!((0.0..1.0).contains(&u));
            sum += u;
        }
        assert!(
            (sum / 10_000.0 - 0.5).abs() < 0.02,
            "mean {}",
            sum / 10_000.0
        );
        assert_ne!(Rng::new(1).next_u64(), Rng::new(2).next_u64());
    }
}
