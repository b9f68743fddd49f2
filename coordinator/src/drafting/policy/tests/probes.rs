//! What probes of the draft cost a session: charged what they lost.

use super::*;

/// Probes are charged what they measurably lost, not their price: where each drafted round
/// also loses a cost far past what calibration can learn (1 s against a 20 ms target step, where
/// a calibration sample counts at most 4×; on one machine, the gap a probe feeds first and the
/// work around it), probing loses at most twice [`PROBE_BUDGET`] of the time (the first probe,
/// unpriced, is paid back from later credit): priced by the cost model alone, 7.8 %.
#[test]
fn probes_that_lose_more_than_their_price_are_spaced_by_what_they_lost() {
    let (t1, slope, t_d, hidden) = (0.02, 0.25, 0.004, 1.0);
    let plans = simulate(
        Pair {
            hidden,
            ..pair(0.05, t_d, 0.0, t1, slope)
        },
        3000,
    );
    let round = |k: usize| {
        if k == 0 {
            t1
        } else {
            k as f64 * t_d + t1 * (1.0 + slope * k as f64) + hidden
        }
    };
    let total: f64 = plans.iter().map(|p| round(p.k)).sum();
    // A drafted round of a draft (nearly) never accepted commits one token.
    let lost: f64 = plans
        .iter()
        .filter(|p| p.k > 0)
        .map(|p| round(p.k) - t1)
        .sum();
    assert!(
        lost / total <= 2.0 * PROBE_BUDGET,
        "probes lost {:.1} % of the time",
        100.0 * lost / total
    );
}
