//! `redis_e2e`: the Redis Streams transport against raw `XADD`,
//! `XREADGROUP` and `XACK`.
//!
//! The baseline does what envoi's transport does: [`PRODUCERS`] concurrent
//! `XADD`s of a `body` and a `headers` field (envoi's layout) on one
//! multiplexed connection, each awaiting its reply; then `XREADGROUP COUNT
//! 500` on a second connection (envoi reads on a connection of its own),
//! the next read running while a batch is handled, and one `XACK` per
//! batch on the first connection while the next batch is read
//! ([`pipeline`]). The `XACK`s must acknowledge as many entries as were
//! consumed, and nothing may be left pending.
//!
//! [`PRODUCERS`]: crate::e2e::PRODUCERS

use std::sync::Arc;
use std::time::Instant;

use envoi_core::transport::Setup;
use redis::aio::MultiplexedConnection;

use super::probe::envoi_side;
use super::{
    and_then_clean, body, delete_then_close, log_baseline, run_scenario, send_all, unique,
    with_options, Broker, BATCH,
};
use crate::pipeline;
use crate::tally::{settled, Tally};

/// `redis_e2e`.
pub(crate) fn scenario() -> Result<(), String> {
    run_scenario(Broker {
        scenario: "redis_e2e",
        url_var: "ENVOI_REDIS_URL",
        envoi: |url, n| Box::pin(redis_envoi(url, n)),
        baseline: |url, n| Box::pin(redis_baseline(url, n)),
    })
}

async fn redis_envoi(url: &str, n: u64) -> Result<f64, String> {
    let stream = format!("envoi-bench:{}", unique());
    let dsn = with_options(url, &format!("stream={stream}&group=bench"));
    let transport = Arc::new(
        envoi_redis::RedisTransport::connect("jobs", &dsn)
            .await
            .map_err(|e| e.to_string())?,
    );
    and_then_clean(
        async {
            transport.setup().await.map_err(|e| e.to_string())?;
            envoi_side(transport.clone(), n).await
        },
        delete_then_close(&*transport, transport.close()),
    )
    .await
}

/// The `headers` field of the baseline's entries: [`KIND`](super::KIND)
/// and [`TYPE`](super::TYPE) laid out as envoi's Redis transport lays out
/// headers (netstrings, name then value), written once rather than per
/// message.
const REDIS_HEADERS: &str = "4:kind7:command4:type3:Job";

/// Entries of one `XREADGROUP` reply: `[[stream, [[id, [field, value, …]], …]]]`.
type StreamReply = Option<Vec<(String, Vec<(String, Vec<Vec<u8>>)>)>>;

/// One `XREADGROUP` of up to [`BATCH`] new entries: `(id, body)`.
async fn read_batch(
    mut conn: MultiplexedConnection,
    stream: Arc<str>,
) -> Result<Vec<(String, Vec<u8>)>, String> {
    let reply: StreamReply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("bench")
        .arg("raw")
        .arg("COUNT")
        .arg(BATCH)
        .arg("STREAMS")
        .arg(&*stream)
        .arg(">")
        .query_async(&mut conn)
        .await
        .map_err(|e| format!("XREADGROUP failed: {e}"))?;
    reply
        .into_iter()
        .flatten()
        .flat_map(|(_, entries)| entries)
        .map(|(id, fields)| {
            let body = fields
                .chunks(2)
                .find(|kv| kv.len() == 2 && kv[0] == b"body")
                .map(|kv| kv[1].clone())
                .ok_or_else(|| format!("entry {id} has no body"))?;
            Ok((id, body))
        })
        .collect()
}

/// Reads and acknowledges until all `n` are consumed, pipelined; fails
/// unless every job came once, the `XACK`s acknowledged them all and
/// nothing is left pending.
async fn consume(
    reader: MultiplexedConnection,
    acker: MultiplexedConnection,
    stream: &str,
    n: u64,
) -> Result<(), String> {
    let key: Arc<str> = stream.into();
    let mut tally = Tally::new(n);
    let (read_key, ack_key, mut ack_conn) = (key.clone(), key.clone(), acker.clone());
    let done = pipeline::consume(
        n,
        move || read_batch(reader.clone(), read_key.clone()),
        |(id, body): (String, Vec<u8>)| tally.body(&body).map(|()| id),
        move |ids: Vec<String>| {
            let (key, mut conn) = (ack_key.clone(), acker.clone());
            async move {
                redis::cmd("XACK")
                    .arg(&*key)
                    .arg("bench")
                    .arg(&ids)
                    .query_async::<u64>(&mut conn)
                    .await
                    .map_err(|e| format!("XACK failed: {e}"))
            }
        },
    )
    .await?;
    tally.finish()?;
    settled("XACK acknowledged", done.settled, done.messages)?;
    let (pending, ..): (u64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
        .arg(stream)
        .arg("bench")
        .query_async(&mut ack_conn)
        .await
        .map_err(|e| format!("XPENDING failed: {e}"))?;
    if pending == 0 {
        Ok(())
    } else {
        Err(format!("{pending} entries left pending"))
    }
}

/// The baseline on a stream of its own, deleted at the end.
async fn redis_baseline(url: &str, n: u64) -> Result<f64, String> {
    let stream: &str = &format!("envoi-bench:{}:raw", unique());
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let connect = || async {
        client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| format!("connecting to redis: {e}"))
    };
    let (conn, reader) = (connect().await?, connect().await?);
    let run = async {
        let mut c = conn.clone();
        redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg("bench")
            .arg("0")
            .arg("MKSTREAM")
            .query_async::<()>(&mut c)
            .await
            .map_err(|e| e.to_string())?;

        let start = Instant::now();
        let (key, sender): (Arc<str>, _) = (stream.into(), conn.clone());
        send_all(n, move |id| {
            let (key, mut c) = (key.clone(), sender.clone());
            async move {
                redis::cmd("XADD")
                    .arg(&*key)
                    .arg("*")
                    .arg("body")
                    .arg(body(id)?)
                    .arg("headers")
                    .arg(REDIS_HEADERS)
                    .query_async::<String>(&mut c)
                    .await
                    .map(drop)
                    .map_err(|e| format!("XADD failed: {e}"))
            }
        })
        .await?;
        let sent = start.elapsed();
        consume(reader, conn.clone(), stream, n).await?;
        log_baseline(n, start, sent);
        Ok(n as f64 / start.elapsed().as_secs_f64())
    };
    let mut cleaner = conn.clone();
    let delete = async move {
        redis::cmd("DEL")
            .arg(stream)
            .query_async::<()>(&mut cleaner)
            .await
            .map_err(|e| format!("deleting stream {stream}: {e}"))
    };
    and_then_clean(run, delete).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_redis_baseline_writes_the_body_and_the_type_and_kind_headers_envoi_writes() {
        let serializer = envoi_core::serializer::Serializer::builder()
            .message::<crate::e2e::Job>()
            .build()
            .unwrap();
        let raw = serializer
            .encode(&envoi_core::Envelope::new(crate::e2e::job(7)))
            .unwrap();
        // envoi's own stamp headers (the bus name, once dispatched) are
        // bookkeeping a user's own producer does without.
        let packed: String = raw
            .headers
            .iter()
            .filter(|(name, _)| !name.starts_with("X-Message-Stamp-"))
            .map(|(name, value)| format!("{}:{name}{}:{value}", name.len(), value.len()))
            .collect();
        assert_eq!(REDIS_HEADERS, packed);
        assert_eq!(body(7).unwrap(), raw.body);
    }
}
