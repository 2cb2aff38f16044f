//! Reading DSNs: schemes, durations, query options, and masking passwords.

use std::time::Duration;

use crate::error::TransportError;

/// Whether `dsn` starts with `scheme` (`"redis://"`, `"sqlite:"`), in any
/// case: how a [`TransportFactory`](crate::transport::TransportFactory) recognises its DSNs. Never panics,
/// whatever characters the DSN holds.
///
/// ```
/// use envoi_core::transport::dsn_has_scheme;
///
/// assert!(dsn_has_scheme("REDIS://127.0.0.1:6379", "redis://"));
/// assert!(!dsn_has_scheme("nats:/é", "nats://"));
/// assert!(!dsn_has_scheme("", "nats://"));
/// ```
pub fn dsn_has_scheme(dsn: &str, scheme: &str) -> bool {
    dsn.get(..scheme.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(scheme))
}

/// What follows `scheme` in `dsn`, when [`dsn_has_scheme`] says it has it.
pub(crate) fn strip_scheme<'a>(dsn: &'a str, scheme: &str) -> Option<&'a str> {
    dsn_has_scheme(dsn, scheme).then(|| &dsn[scheme.len()..])
}

/// Reads a duration as DSN options and the command line write it: one or
/// more numbers, each with a unit (`ms`, `s`, `m`, `h` or `d`; `sec`,
/// `secs`, `min` and `mins` too), such as `250ms`, `30s`, `1.5m` or
/// `1h30m`, or a bare number of seconds (`2`, `0.5`). Surrounding spaces
/// are ignored. `None` for anything else: no number, an unknown unit, a
/// negative, infinite or not-a-number value, or one too large for a
/// [`Duration`]. Every transport's DSN parser uses it, so one spelling
/// works everywhere; each checks its own range afterwards.
///
/// ```
/// use envoi_core::transport::parse_duration;
/// use std::time::Duration;
///
/// assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
/// assert_eq!(parse_duration("1h30m"), Some(Duration::from_secs(5400)));
/// assert_eq!(parse_duration("1.5"), Some(Duration::from_millis(1500)));
/// assert_eq!(parse_duration("-1s"), None);
/// assert_eq!(parse_duration("soon"), None);
/// ```
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let is_number = |c: char| c.is_ascii_digit() || c == '.';
    if text.chars().all(is_number) {
        // Only digits and a point: `+5`, `-0` or `1e3` are not durations.
        return seconds(text.parse().ok()?);
    }
    let mut total = 0.0f64;
    let mut rest = text;
    while !rest.is_empty() {
        let number_len = rest.find(|c| !is_number(c)).unwrap_or(rest.len());
        if number_len == 0 {
            return None;
        }
        let number: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest.find(is_number).unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ms" => 0.001,
            "s" | "sec" | "secs" => 1.0,
            "m" | "min" | "mins" => 60.0,
            "h" => 3600.0,
            "d" => 86_400.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += number * scale;
    }
    seconds(total)
}

/// `secs` as a [`Duration`] when it is a finite, non-negative number small
/// enough for one.
fn seconds(secs: f64) -> Option<Duration> {
    if secs.is_finite() && secs >= 0.0 {
        Duration::try_from_secs_f64(secs).ok()
    } else {
        None
    }
}

/// Masks the password in a DSN (`scheme://user:secret@host` →
/// `scheme://user:***@host`, and `?password=secret` → `?password=***`,
/// likewise `token`, the name in any case) for error messages and listings.
pub fn mask_dsn(dsn: &str) -> String {
    mask_query_password(mask_user_password(dsn))
}

/// Masks the value of every `password` or `token` option in the query of
/// `dsn`.
fn mask_query_password(dsn: String) -> String {
    let Some(start) = dsn.find('?') else {
        return dsn;
    };
    let end = dsn[start..].find('#').map_or(dsn.len(), |i| start + i);
    let query = &dsn[start + 1..end];
    fn password_key(pair: &str) -> Option<&str> {
        pair.split_once('=')
            .map(|(key, _)| key)
            .filter(|key| key.eq_ignore_ascii_case("password") || key.eq_ignore_ascii_case("token"))
    }
    if !query.split('&').any(|pair| password_key(pair).is_some()) {
        return dsn;
    }
    let mut out = String::with_capacity(dsn.len());
    out.push_str(&dsn[..=start]);
    for (i, pair) in query.split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        match password_key(pair) {
            Some(key) => {
                out.push_str(key);
                out.push_str("=***");
            }
            None => out.push_str(pair),
        }
    }
    out.push_str(&dsn[end..]);
    out
}

/// Masks the password of the user information of `dsn`.
fn mask_user_password(dsn: &str) -> String {
    let Some(scheme_end) = dsn.find("://") else {
        return dsn.to_string();
    };
    let rest = &dsn[scheme_end + 3..];
    // The user information ends at the last `@` before the query: a
    // password may hold a `/` (or an `@`) that was not percent-encoded.
    let before_query = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    // No `@` before the query: no user information (an `@` in the query
    // is an option's).
    let Some(at) = before_query.rfind('@') else {
        return dsn.to_string();
    };
    let authority = &rest[..=at];
    // User information comes before any `/` of a path: in
    // `sqlite:///var/a:b@c.db` the `:` and `@` are the file's.
    let path = rest.find('/').unwrap_or(rest.len());
    match (authority.rfind('@'), authority.find(':')) {
        (Some(at), Some(colon)) if colon < at && colon < path => format!(
            "{}{}:***{}",
            &dsn[..scheme_end + 3],
            &authority[..colon],
            &rest[at..]
        ),
        _ => dsn.to_string(),
    }
}

/// The query options of a DSN (`?table=jobs&lease=30s`), read once by a
/// transport's DSN parser, with one set of rules for every transport:
///
/// * names are case-sensitive; an option given twice is an error;
/// * values are percent-decoded (`+` is a space, as in a form);
/// * a boolean is `true`, `false`, `1`, `0`, `yes`, `no`, `on` or `off`;
/// * a duration is what [`parse_duration`] reads;
/// * an option nobody asked for is an error naming every option the
///   transport asked for ([`finish`](Self::finish)).
///
/// Every error is a [`TransportError::InvalidDsn`] with the password
/// masked.
///
/// ```
/// use envoi_core::transport::support::DsnQuery;
/// use std::time::Duration;
///
/// let mut q = DsnQuery::parse("postgres://u:secret@h/db?lease=30s&listen=off").unwrap();
/// assert_eq!(q.duration("lease").unwrap(), Some(Duration::from_secs(30)));
/// assert_eq!(q.bool("listen").unwrap(), Some(false));
/// assert_eq!(q.string("table"), None);
/// q.finish().unwrap();
///
/// let mut q = DsnQuery::parse("postgres://u:secret@h/db?tabel=jobs").unwrap();
/// assert_eq!(q.string("table"), None);
/// let error = q.finish().unwrap_err().to_string();
/// assert!(error.contains("unknown option `tabel` (known: table)"), "{error}");
/// assert!(error.contains("u:***@h"), "{error}");
/// ```
#[derive(Debug, Clone)]
pub struct DsnQuery {
    /// The DSN with its password masked, for errors.
    masked: String,
    /// The options not taken yet, in the order given.
    options: Vec<(String, String)>,
    /// Every name asked for, in the order asked.
    known: Vec<&'static str>,
}

impl DsnQuery {
    /// Reads the query of `dsn` (between the first `?` and any `#`).
    /// Fails for an option given twice, or a name or value that is not
    /// valid percent-encoded UTF-8.
    pub fn parse(dsn: &str) -> Result<Self, TransportError> {
        let mut query = Self {
            masked: mask_dsn(dsn),
            options: Vec::new(),
            known: Vec::new(),
        };
        let Some(start) = dsn.find('?') else {
            return Ok(query);
        };
        let rest = &dsn[start + 1..];
        let rest = &rest[..rest.find('#').unwrap_or(rest.len())];
        for pair in rest.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let name = percent_decode(name).ok_or_else(|| {
                query.invalid("an option name is not valid percent-encoded UTF-8".into())
            })?;
            let value = percent_decode(value).ok_or_else(|| {
                query.invalid(format!(
                    "the value of `{name}` is not valid percent-encoded UTF-8"
                ))
            })?;
            if query.options.iter().any(|(n, _)| *n == name) {
                return Err(query.invalid(format!("option `{name}` is given twice")));
            }
            query.options.push((name, value));
        }
        Ok(query)
    }

    /// An [`InvalidDsn`](TransportError::InvalidDsn) error for this DSN,
    /// saying `reason`.
    pub fn invalid(&self, reason: String) -> TransportError {
        TransportError::InvalidDsn {
            dsn: self.masked.clone(),
            reason,
        }
    }

    /// Takes option `name` as text, if given.
    pub fn string(&mut self, name: &'static str) -> Option<String> {
        if !self.known.contains(&name) {
            self.known.push(name);
        }
        let at = self.options.iter().position(|(n, _)| n == name)?;
        Some(self.options.remove(at).1)
    }

    /// Takes option `name` as a boolean, if given.
    pub fn bool(&mut self, name: &'static str) -> Result<Option<bool>, TransportError> {
        let Some(value) = self.string(name) else {
            return Ok(None);
        };
        match value.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(Some(true)),
            "false" | "0" | "no" | "off" => Ok(Some(false)),
            _ => Err(self.invalid(format!(
                "`{name}` must be true or false (or 1/0, yes/no, on/off), not `{value}`"
            ))),
        }
    }

    /// Takes option `name` as a duration (see [`parse_duration`]), if
    /// given.
    pub fn duration(&mut self, name: &'static str) -> Result<Option<Duration>, TransportError> {
        let Some(value) = self.string(name) else {
            return Ok(None);
        };
        match parse_duration(&value) {
            Some(d) => Ok(Some(d)),
            None => Err(self.invalid(format!(
                "`{name}` must be a duration such as `500ms`, `30s` or `1m`, not `{value}`"
            ))),
        }
    }

    /// Takes option `name` as a number (anything [`FromStr`](std::str::FromStr)
    /// reads), if given.
    pub fn number<T: std::str::FromStr>(
        &mut self,
        name: &'static str,
    ) -> Result<Option<T>, TransportError> {
        let Some(value) = self.string(name) else {
            return Ok(None);
        };
        match value.trim().parse() {
            Ok(n) => Ok(Some(n)),
            Err(_) => Err(self.invalid(format!("`{name}` must be a whole number, not `{value}`"))),
        }
    }

    /// Takes every option whose name `matches` (options a transport hands
    /// on to its driver, say), in the order given.
    pub fn take_matching(
        &mut self,
        mut matches: impl FnMut(&str) -> bool,
    ) -> Vec<(String, String)> {
        let (taken, kept) = std::mem::take(&mut self.options)
            .into_iter()
            .partition(|(name, _)| matches(name));
        self.options = kept;
        taken
    }

    /// Fails when an option was given that no method above took, naming
    /// the options that were asked for.
    pub fn finish(self) -> Result<(), TransportError> {
        let Some((name, _)) = self.options.first() else {
            return Ok(());
        };
        let known = if self.known.is_empty() {
            "it takes none".to_string()
        } else {
            format!("known: {}", self.known.join(", "))
        };
        Err(self.invalid(format!("unknown option `{name}` ({known})")))
    }
}

/// `text` with `+` as a space and `%XX` escapes decoded; `None` when an
/// escape is malformed or the result is not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_units_compounds_fractions_and_bare_seconds() {
        let d = |text| parse_duration(text);
        assert_eq!(d("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(d("2s"), Some(Duration::from_secs(2)));
        assert_eq!(d("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(d("5m"), Some(Duration::from_secs(300)));
        assert_eq!(d("5min"), Some(Duration::from_secs(300)));
        assert_eq!(d("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(d("2d"), Some(Duration::from_secs(172_800)));
        assert_eq!(d("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(d("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(d(" 10s "), Some(Duration::from_secs(10)));
        assert_eq!(d("2"), Some(Duration::from_secs(2)));
        assert_eq!(d("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(d("0"), Some(Duration::ZERO));
    }

    #[test]
    fn durations_without_a_number_or_unit_or_out_of_range_are_none() {
        for bad in [
            "", " ", "s", "10x", "-5s", "-1", "1..2s", "ms10", "1e400", "inf", "NaN", "soon",
            "1 s", "5ms5", "+5", "-0", "1e3", "1e3s", ".", "1.2.3",
        ] {
            assert_eq!(parse_duration(bad), None, "`{bad}`");
        }
    }

    #[test]
    fn mask_dsn_hides_only_the_password() {
        assert_eq!(
            mask_dsn("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(mask_dsn("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(mask_dsn("sqlite://envoi.db"), "sqlite://envoi.db");
        assert_eq!(
            mask_dsn("postgres://postgres@h/db"),
            "postgres://postgres@h/db"
        );
    }

    #[test]
    fn mask_dsn_hides_a_password_holding_a_slash_or_an_at_sign() {
        assert_eq!(
            mask_dsn("redis://user:pa/ss@h:6379"),
            "redis://user:***@h:6379"
        );
        assert_eq!(
            mask_dsn("amqp://guest:p@ss/w@127.0.0.1:5672/%2f?heartbeat=5"),
            "amqp://guest:***@127.0.0.1:5672/%2f?heartbeat=5"
        );
        // An `@` in the query is not the end of a password.
        assert_eq!(
            mask_dsn("postgres://h:5432/db?application_name=a@b"),
            "postgres://h:5432/db?application_name=a@b"
        );
        assert_eq!(mask_dsn("sqlite:///var/a@b.db"), "sqlite:///var/a@b.db");
        assert_eq!(
            mask_dsn("sqlite:///tmp/a:b@c.db?lease=zz"),
            "sqlite:///tmp/a:b@c.db?lease=zz"
        );
        assert_eq!(mask_dsn("sqlite://dir/a:b@c.db"), "sqlite://dir/a:b@c.db");
    }

    #[test]
    fn mask_dsn_hides_a_password_given_as_a_query_option() {
        assert_eq!(
            mask_dsn("postgres://u@h/db?password=hunter2&bogus=1"),
            "postgres://u@h/db?password=***&bogus=1"
        );
        assert_eq!(
            mask_dsn("postgres://u:pw@h/db?sslmode=disable&PassWord=hunter2#x"),
            "postgres://u:***@h/db?sslmode=disable&PassWord=***#x"
        );
        assert_eq!(
            mask_dsn("redis://h?password=hunter2"),
            "redis://h?password=***"
        );
        assert_eq!(
            mask_dsn("nats://h:4222?Token=s3cr3t&consumer=a@b"),
            "nats://h:4222?Token=***&consumer=a@b"
        );
        // Other options, and an option merely ending in `password`, stay.
        assert_eq!(
            mask_dsn("postgres://h/db?password_hint=x&table=password"),
            "postgres://h/db?password_hint=x&table=password"
        );
    }

    #[test]
    fn dsn_options_take_one_rule_for_booleans_and_refuse_twice_given_and_unknown_ones() {
        let mut q = DsnQuery::parse("x://h?a=YES&b=off&c=1&d=0&e=On").unwrap();
        let got: Vec<_> = ["a", "b", "c", "d", "e"]
            .map(|n| q.bool(n).unwrap())
            .to_vec();
        assert_eq!(
            got,
            [Some(true), Some(false), Some(true), Some(false), Some(true)]
        );
        q.finish().unwrap();

        let mut q = DsnQuery::parse("x://h?a=maybe").unwrap();
        let why = q.bool("a").unwrap_err().to_string();
        assert!(why.contains("`a` must be true or false"), "{why}");

        let why = DsnQuery::parse("x://h?a=1&a=2").unwrap_err().to_string();
        assert!(why.contains("option `a` is given twice"), "{why}");

        let mut q = DsnQuery::parse("x://h?b=1").unwrap();
        assert_eq!(q.string("a"), None);
        let why = q.finish().unwrap_err().to_string();
        assert!(why.contains("unknown option `b` (known: a)"), "{why}");

        let why = DsnQuery::parse("x://h?b=1")
            .unwrap()
            .finish()
            .unwrap_err()
            .to_string();
        assert!(why.contains("unknown option `b` (it takes none)"), "{why}");
    }

    #[test]
    fn dsn_option_values_are_percent_decoded_and_malformed_escapes_refused() {
        let mut q = DsnQuery::parse("x://h?table=my%5Fjobs&note=a+b#frag").unwrap();
        assert_eq!(q.string("table").as_deref(), Some("my_jobs"));
        assert_eq!(q.string("note").as_deref(), Some("a b"));
        assert!(DsnQuery::parse("x://h?t=%zz").is_err());
        assert!(DsnQuery::parse("x://h?t=%ff").is_err(), "not UTF-8");
        let mut q = DsnQuery::parse("x://h?n=12&m=x&d=2s&e=later").unwrap();
        assert_eq!(q.number::<u32>("n").unwrap(), Some(12));
        assert!(q.number::<u32>("m").is_err());
        assert_eq!(q.duration("d").unwrap(), Some(Duration::from_secs(2)));
        assert!(q.duration("e").is_err());
    }

    #[test]
    fn options_taken_by_a_predicate_are_not_unknown() {
        let mut q = DsnQuery::parse("x://h?sslmode=disable&options[a]=b&table=t").unwrap();
        let passed = q.take_matching(|n| n == "sslmode" || n.starts_with("options["));
        assert_eq!(passed.len(), 2);
        assert_eq!(q.string("table").as_deref(), Some("t"));
        q.finish().unwrap();
    }
}
