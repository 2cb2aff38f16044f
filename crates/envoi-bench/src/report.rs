//! The one summary line each scenario ends with.

/// Prints `<scenario>: envoi=<v><unit> baseline=<v><unit> ratio=<r>` plus
/// extra `key=value` figures.
pub(crate) fn line(
    scenario: &str,
    envoi: f64,
    baseline: f64,
    unit: &str,
    extra: &[(&str, String)],
) {
    let ratio = if baseline == 0.0 {
        f64::NAN
    } else {
        envoi / baseline
    };
    let mut s = format!(
        "{scenario}: envoi={}{unit} baseline={}{unit} ratio={ratio:.3}",
        fmt(envoi),
        fmt(baseline)
    );
    for (k, v) in extra {
        s.push_str(&format!(" {k}={v}"));
    }
    println!("{s}");
}

fn fmt(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}
