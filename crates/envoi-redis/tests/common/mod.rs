//! Helpers shared by the integration tests: the server URL, unique stream
//! names, a raw connection for inspecting what the transport stored, and
//! removal of what earlier runs left behind.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::sync::Once;

use envoi_redis::{RedisConfig, RedisTransport};
use redis::aio::MultiplexedConnection;

/// Stream keys of every test start with this.
pub const PREFIX: &str = "envoi-test:";

/// `ENVOI_REDIS_URL`, or why there is none: what the server tests need
/// (`needs = common::url` in their `broker_tests!`). The first call of a
/// test binary also deletes what earlier runs left behind.
pub fn url() -> Result<String, String> {
    let url = envoi_transport_tests::harness::env_url("ENVOI_REDIS_URL")?;
    collect_garbage(&url);
    Ok(url)
}

/// A fresh stream name for `tag`.
pub fn unique(tag: &str) -> String {
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{tag}_{}", &suffix[..12])
}

/// The DSN of stream `name` on `url`, with `extra` DSN options.
pub fn dsn(url: &str, name: &str, extra: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    let mut dsn = format!("{url}{separator}stream={PREFIX}{name}");
    if !extra.is_empty() {
        dsn.push('&');
        dsn.push_str(extra);
    }
    dsn
}

/// The configuration of stream `name` on `url`, with `extra` DSN options.
pub fn config(url: &str, name: &str, extra: &str) -> RedisConfig {
    RedisConfig::from_dsn(&dsn(url, name, extra)).unwrap_or_else(|e| panic!("bad test DSN: {e}"))
}

/// A transport handle on stream `name`.
pub async fn transport(url: &str, name: &str, extra: &str) -> RedisTransport {
    RedisTransport::with_config(name, config(url, name, extra))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A plain connection for inspecting the server.
pub async fn raw(url: &str) -> MultiplexedConnection {
    let base = url.split('?').next().unwrap_or(url);
    redis::Client::open(base)
        .unwrap_or_else(|e| panic!("ENVOI_REDIS_URL is not usable: {e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {base}: {e}"))
}

/// Keys of earlier test runs untouched for ten minutes (no test runs that
/// long) are deleted, once per test binary, so repeated runs do not pile up
/// keys (a test that panics cannot delete its stream).
fn collect_garbage(url: &str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let base = url.split('?').next().unwrap_or(url).to_string();
        let Ok(client) = redis::Client::open(base) else {
            return;
        };
        let Ok(mut c) = client.get_connection() else {
            return;
        };
        let Ok(keys) = redis::cmd("KEYS")
            .arg(format!("{PREFIX}*"))
            .query::<Vec<String>>(&mut c)
        else {
            return;
        };
        for key in keys {
            let idle: i64 = redis::cmd("OBJECT")
                .arg("IDLETIME")
                .arg(&key)
                .query(&mut c)
                .unwrap_or(0);
            if idle > 600 {
                let _: Result<i64, _> = redis::cmd("DEL").arg(&key).query(&mut c);
            }
        }
    });
}

/// Waits for `future` at most `limit` (real time); past it, fails naming
/// `what` it waited for, rather than hang the test run.
pub use envoi_core::testing::within;
