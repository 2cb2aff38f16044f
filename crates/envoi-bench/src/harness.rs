//! How every end-to-end and apalis scenario runs its two sides, written
//! once: N messages a run (`ENVOI_BENCH_N`), one untimed warm-up run of
//! each side (`ENVOI_BENCH_WARMUP` messages), then an odd number of timed
//! rounds (`ENVOI_BENCH_ROUNDS`) whose order alternates, ABBA (envoi then
//! baseline, baseline then envoi, …), so that neither side always runs
//! first on a broker or heap the other just warmed; each side's median is
//! reported.

use crate::report;

/// Messages per run unless `ENVOI_BENCH_N` says otherwise.
const DEFAULT_N: u64 = 100_000;
/// Timed rounds unless `ENVOI_BENCH_ROUNDS` says otherwise.
const DEFAULT_ROUNDS: u32 = 3;
/// Warm-up messages unless `ENVOI_BENCH_WARMUP` says otherwise.
const DEFAULT_WARMUP: u64 = 5_000;

/// One side of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Envoi,
    Baseline,
}

/// How a comparison runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Messages per timed run.
    pub(crate) n: u64,
    /// Timed runs of each side (odd, so each side has one median run).
    pub(crate) rounds: u32,
    /// Messages of each side's untimed warm-up run (at most `n`; 0 for
    /// none).
    pub(crate) warmup: u64,
}

impl Plan {
    /// The plan `ENVOI_BENCH_N`, `ENVOI_BENCH_ROUNDS` and
    /// `ENVOI_BENCH_WARMUP` describe; a value that is not a number, a zero
    /// N or an even number of rounds is refused.
    pub(crate) fn from_env() -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok();
        Self::parse(
            var("ENVOI_BENCH_N").as_deref(),
            var("ENVOI_BENCH_ROUNDS").as_deref(),
            var("ENVOI_BENCH_WARMUP").as_deref(),
        )
    }

    /// The plan the three variables' values describe (`None`: unset).
    pub(crate) fn parse(
        n: Option<&str>,
        rounds: Option<&str>,
        warmup: Option<&str>,
    ) -> Result<Self, String> {
        fn number<T: std::str::FromStr>(name: &str, value: &str) -> Result<T, String> {
            value
                .trim()
                .parse()
                .map_err(|_| format!("{name} must be a whole number, not `{value}`"))
        }
        let n: u64 = n.map_or(Ok(DEFAULT_N), |v| number("ENVOI_BENCH_N", v))?;
        if n == 0 {
            return Err("ENVOI_BENCH_N must be at least 1".into());
        }
        let rounds: u32 = rounds.map_or(Ok(DEFAULT_ROUNDS), |v| number("ENVOI_BENCH_ROUNDS", v))?;
        if rounds.is_multiple_of(2) {
            return Err(format!(
                "ENVOI_BENCH_ROUNDS must be odd (each side reports its median round), not {rounds}"
            ));
        }
        let warmup: u64 = warmup.map_or(Ok(DEFAULT_WARMUP), |v| number("ENVOI_BENCH_WARMUP", v))?;
        Ok(Self {
            n,
            rounds,
            warmup: warmup.min(n),
        })
    }

    /// The timed runs in order: round `r` (from 0) runs envoi first when
    /// `r` is even and the baseline first when it is odd, so the sequence
    /// reads envoi, baseline, baseline, envoi, envoi, baseline, …
    pub(crate) fn order(&self) -> Vec<Side> {
        (0..self.rounds)
            .flat_map(|r| {
                if r % 2 == 0 {
                    [Side::Envoi, Side::Baseline]
                } else {
                    [Side::Baseline, Side::Envoi]
                }
            })
            .collect()
    }
}

/// The median of `values` (the middle one of an odd count, the mean of
/// the two middle ones of an even count); NaN for none.
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        len if len % 2 == 1 => sorted[len / 2],
        len => (sorted[len / 2 - 1] + sorted[len / 2]) / 2.0,
    }
}

/// What the timed runs of a comparison measured.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Outcome {
    /// envoi's rate in each timed round, in the order they ran.
    pub(crate) envoi: Vec<f64>,
    /// The baseline's rate in each timed round, in the order they ran.
    pub(crate) baseline: Vec<f64>,
    /// This process's peak resident set size, in MiB, right after envoi's
    /// first timed run (the first run of all, after the warm-ups).
    pub(crate) peak_rss_mb: f64,
}

impl Outcome {
    pub(crate) fn envoi_median(&self) -> f64 {
        median(&self.envoi)
    }

    pub(crate) fn baseline_median(&self) -> f64 {
        median(&self.baseline)
    }
}

/// Runs both sides as `plan` says: each side's warm-up (envoi's first),
/// then the timed runs in [`Plan::order`]. Each side is called with the
/// messages to move and returns its rate; the first error ends the
/// comparison.
pub(crate) fn compare(
    plan: &Plan,
    mut envoi: impl FnMut(u64) -> Result<f64, String>,
    mut baseline: impl FnMut(u64) -> Result<f64, String>,
) -> Result<Outcome, String> {
    if plan.warmup > 0 {
        eprintln!("  warm-up: {} messages each side, untimed", plan.warmup);
        envoi(plan.warmup).map_err(|e| format!("envoi's warm-up: {e}"))?;
        baseline(plan.warmup).map_err(|e| format!("the baseline's warm-up: {e}"))?;
    }
    let mut outcome = Outcome {
        envoi: Vec::new(),
        baseline: Vec::new(),
        peak_rss_mb: 0.0,
    };
    for (i, side) in plan.order().into_iter().enumerate() {
        let round = i / 2 + 1;
        let rate = match side {
            Side::Envoi => envoi(plan.n).map_err(|e| format!("envoi, round {round}: {e}"))?,
            Side::Baseline => {
                baseline(plan.n).map_err(|e| format!("the baseline, round {round}: {e}"))?
            }
        };
        eprintln!("  round {round}: {side:?} {rate:.0}/s");
        match side {
            Side::Envoi => {
                if outcome.envoi.is_empty() {
                    outcome.peak_rss_mb = peak_rss_mb();
                }
                outcome.envoi.push(rate);
            }
            Side::Baseline => outcome.baseline.push(rate),
        }
    }
    Ok(outcome)
}

/// Prints the summary line of `outcome`: each side's median in `unit`,
/// then `peak_rss_mb`, `n`, `rounds`, `warmup` and `extra`.
pub(crate) fn summary(
    scenario: &str,
    plan: &Plan,
    outcome: &Outcome,
    unit: &str,
    extra: &[(&str, String)],
) {
    let mut figures = vec![
        ("peak_rss_mb", format!("{:.0}", outcome.peak_rss_mb)),
        ("n", plan.n.to_string()),
        ("rounds", plan.rounds.to_string()),
        ("warmup", plan.warmup.to_string()),
    ];
    figures.extend(extra.iter().cloned());
    report::line(
        scenario,
        outcome.envoi_median(),
        outcome.baseline_median(),
        unit,
        &figures,
    );
}

/// Peak resident set size of this process so far, in MiB.
pub(crate) fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_the_middle_value_whatever_the_order() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[10.0, 50.0, 20.0, 40.0, 30.0]), 30.0);
        assert_eq!(median(&[7.0]), 7.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn the_sides_alternate_abba_and_each_runs_once_per_round() {
        let plan = Plan::parse(None, Some("5"), None).unwrap();
        use Side::{Baseline as B, Envoi as E};
        assert_eq!(plan.order(), [E, B, B, E, E, B, B, E, E, B]);
        let one = Plan::parse(None, Some("1"), None).unwrap();
        assert_eq!(one.order(), [E, B]);
    }

    #[test]
    fn the_plan_reads_defaults_and_caps_the_warmup_at_n() {
        let plan = Plan::parse(None, None, None).unwrap();
        assert_eq!(
            plan,
            Plan {
                n: 100_000,
                rounds: 3,
                warmup: 5_000
            }
        );
        let small = Plan::parse(Some("2000"), Some("1"), Some("9000")).unwrap();
        assert_eq!(small.warmup, 2000);
        assert_eq!(Plan::parse(None, None, Some("0")).unwrap().warmup, 0);
    }

    #[test]
    fn an_even_round_count_a_zero_n_or_a_word_is_refused_with_the_variable_named() {
        let even = Plan::parse(None, Some("4"), None).unwrap_err();
        assert!(even.contains("ENVOI_BENCH_ROUNDS must be odd"), "{even}");
        let zero = Plan::parse(Some("0"), None, None).unwrap_err();
        assert!(zero.contains("ENVOI_BENCH_N"), "{zero}");
        let word = Plan::parse(None, None, Some("lots")).unwrap_err();
        assert!(
            word.contains("ENVOI_BENCH_WARMUP") && word.contains("lots"),
            "{word}"
        );
    }

    #[test]
    fn compare_warms_each_side_up_then_runs_them_in_abba_order_and_keeps_medians() {
        use std::cell::RefCell;
        let plan = Plan {
            n: 10,
            rounds: 3,
            warmup: 2,
        };
        let calls = RefCell::new(Vec::new());
        let mut envoi_rates = [0.0, 100.0, 300.0, 200.0].into_iter();
        let mut baseline_rates = [0.0, 50.0, 70.0, 60.0].into_iter();
        let outcome = compare(
            &plan,
            |n| {
                calls.borrow_mut().push(("envoi", n));
                Ok(envoi_rates.next().unwrap())
            },
            |n| {
                calls.borrow_mut().push(("baseline", n));
                Ok(baseline_rates.next().unwrap())
            },
        )
        .unwrap();
        assert_eq!(
            calls.into_inner(),
            [
                ("envoi", 2),
                ("baseline", 2),
                ("envoi", 10),
                ("baseline", 10),
                ("baseline", 10),
                ("envoi", 10),
                ("envoi", 10),
                ("baseline", 10),
            ]
        );
        assert_eq!(outcome.envoi, [100.0, 300.0, 200.0]);
        assert_eq!(outcome.envoi_median(), 200.0);
        assert_eq!(outcome.baseline_median(), 60.0);
    }

    #[test]
    fn compare_stops_at_the_first_failure_and_names_the_side_and_round() {
        let plan = Plan {
            n: 10,
            rounds: 3,
            warmup: 0,
        };
        let err = compare(&plan, |_| Ok(1.0), |_| Err("lost 3 messages".into())).unwrap_err();
        assert_eq!(err, "the baseline, round 1: lost 3 messages");
    }
}
