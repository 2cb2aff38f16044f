//! The Lua scripts that make multi-step operations atomic on the server.
//!
//! Each runs as one unit in Redis, so several workers calling the same
//! script never interleave inside it. Times come from the server's `TIME`,
//! not from the clients, so clients with skewed clocks agree on when a
//! delayed message is due.

use std::sync::LazyLock;

use redis::Script;

/// Stores a delayed message: its fields in a hash, its id in the delay set
/// scored with the due time in server milliseconds.
///
/// KEYS: delay set, payload hash. ARGV: delay in ms, id, field, value, ...
///
/// Sent with `EVAL` (not `EVALSHA`) so it can share a pipeline with plain
/// `XADD`s without a `NOSCRIPT` failure half-way through a batch.
pub(crate) const SEND_DELAYED: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[2], unpack(ARGV, 3))
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[2])
return 1
";

/// Moves due delayed messages into the stream: `ZRANGEBYSCORE`, `XADD` and
/// `ZREM` in one script, so no message is moved twice however many workers
/// run it at once. Returns `{moved, ms until the next one is due or -1}`.
///
/// KEYS: delay set, stream. ARGV: batch limit, payload key prefix, trim
/// (`''` for none).
pub(crate) static MOVE_DUE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, id in ipairs(due) do
  local key = ARGV[2] .. id
  local fields = redis.call('HGETALL', key)
  if #fields > 0 then
    if ARGV[3] ~= '' then
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(fields))
    else
      redis.call('XADD', KEYS[2], '*', unpack(fields))
    end
  end
  redis.call('DEL', key)
  redis.call('ZREM', KEYS[1], id)
end
local upcoming = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local wait = -1
if #upcoming > 0 then
  wait = math.max(0, tonumber(upcoming[2]) - now)
end
return {#due, wait}
",
    )
});

/// Acknowledges and deletes entries, but only those that are pending in the
/// group: an id that was never handed out is left alone. Returns how many
/// were acknowledged.
///
/// KEYS: stream. ARGV: group, id, id, ...
pub(crate) static ACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local n = 0
for i = 2, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
return n
",
    )
});

/// Gives a pending entry back: re-adds its fields at the end of the stream
/// and acknowledges and deletes the old entry, atomically. Returns the new
/// id, or nil when the entry is not pending (already settled).
///
/// KEYS: stream. ARGV: group, id, trim (`''` for none).
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #pending == 0 then
  return false
end
local entry = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if #entry == 0 then
  return false
end
if ARGV[3] ~= '' then
  return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', unpack(entry[1][2]))
end
return redis.call('XADD', KEYS[1], '*', unpack(entry[1][2]))
",
    )
});

/// Resets the idle time of an entry pending for this consumer (`XCLAIM ...
/// JUSTID` to itself). Returns 1 when renewed, 0 when the entry is not
/// pending, -1 when another consumer has claimed it since.
///
/// KEYS: stream. ARGV: group, id, consumer.
pub(crate) static KEEPALIVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #pending == 0 then
  return 0
end
if pending[1][2] ~= ARGV[3] then
  return -1
end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return 1
",
    )
});

/// Deletes the group's consumers that hold no pending entry and have been
/// idle at least the given time (every handle is a consumer of its own, so
/// without this they pile up across restarts). Deleting a consumer with
/// nothing pending loses nothing: it is recreated on its next read. Returns
/// how many were deleted.
///
/// KEYS: stream. ARGV: group, min idle ms, the caller's consumer name.
pub(crate) static PRUNE_CONSUMERS: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local removed = 0
local min_idle = tonumber(ARGV[2])
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local name, pending, idle
  for i = 1, #c, 2 do
    if c[i] == 'name' then name = c[i + 1]
    elseif c[i] == 'pending' then pending = c[i + 1]
    elseif c[i] == 'idle' then idle = c[i + 1] end
  end
  if name ~= nil and name ~= ARGV[3] and pending == 0 and idle ~= nil and idle >= min_idle then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name)
    removed = removed + 1
  end
end
return removed
",
    )
});
