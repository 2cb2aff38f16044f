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
/// A payload key that another program made something other than a hash is
/// moved too, as an entry whose `X-Envoi-Invalid-Headers` field says so
/// (with the key's text as the body when it is a string): the worker parks
/// it with that reason, and the messages delayed behind it still move.
///
/// KEYS: delay set, stream. ARGV: batch limit, payload key prefix, trim
/// (`''` for none).
pub(crate) static MOVE_DUE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local function add(fields)
  if ARGV[3] ~= '' then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(fields))
  else
    redis.call('XADD', KEYS[2], '*', unpack(fields))
  end
end
for _, id in ipairs(due) do
  local key = ARGV[2] .. id
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'hash' then
    local fields = redis.call('HGETALL', key)
    if #fields > 0 then
      add(fields)
    end
  elseif kind ~= 'none' then
    local fields = {'X-Envoi-Invalid-Headers',
      'the payload `' .. key .. '` of delayed message `' .. id .. '` is a ' .. kind .. ', not a hash'}
    if kind == 'string' then
      table.insert(fields, 'body')
      table.insert(fields, redis.call('GET', key))
    end
    add(fields)
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

/// Gives entries pending for this consumer back to the group, without
/// touching the stream: each one stays pending, moved (`XCLAIM ... JUSTID`)
/// to the group's release consumer, where [`CLAIM_RELEASED`] takes it for
/// the next `get` of any handle in the group. Other groups on the stream
/// see nothing of it. The entry's delivery count says whether it was handed
/// out: kept for a message released after a delivery, one less for an
/// entry read ahead and never handed out, so that [`CLAIM_RELEASED`] marks
/// only the first as redelivered. An id not pending for this consumer
/// (settled, claimed by another consumer, released already) is skipped.
/// Returns how many were given back.
///
/// KEYS: stream. ARGV: group, release consumer, this consumer, `1` when the
/// entries were handed out (`0` when read ahead only), id, ...
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local released = 0
for i = 5, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if #p > 0 and p[1][2] == ARGV[3] then
    local count = tonumber(p[1][4])
    if ARGV[4] == '0' and count > 0 then
      count = count - 1
    end
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'RETRYCOUNT', count, 'JUSTID')
    released = released + 1
  end
end
return released
",
    )
});

/// Takes up to ARGV[4] entries given back by [`RELEASE`] (pending for the
/// release consumer), oldest first, for this consumer (`XCLAIM`, which
/// counts a delivery). Returns `{entries, ids}`: the entries as `XCLAIM`
/// gives them, and the ids of those handed out before (to be marked as
/// redelivered).
///
/// KEYS: stream. ARGV: group, release consumer, this consumer, count
/// (at most 1000).
pub(crate) static CLAIM_RELEASED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[4]), ARGV[2])
if #pending == 0 then
  return {{}, {}}
end
local ids, again = {}, {}
for i, p in ipairs(pending) do
  ids[i] = p[1]
  if tonumber(p[4]) > 0 then
    again[#again + 1] = p[1]
  end
end
return {redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, unpack(ids)), again}
",
    )
});

/// Rejects pending entries: acknowledges each one and deletes it from the
/// stream (`XDEL`) unless another group on the stream still needs it (has
/// it pending, or has not read that far). An id that is not pending is
/// left alone. Returns how many entries were deleted.
///
/// KEYS: stream. ARGV: group, id, ...
pub(crate) static REJECT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local groups = {}
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local f = {}
  for i = 1, #g, 2 do
    f[g[i]] = g[i + 1]
  end
  groups[#groups + 1] = f
end
local function needed(id)
  for _, f in ipairs(groups) do
    if #redis.call('XPENDING', KEYS[1], f['name'], id, id, 1) > 0 then
      return true
    end
    if #redis.call('XRANGE', KEYS[1], '(' .. f['last-delivered-id'], id, 'COUNT', 1) > 0 then
      return true
    end
  end
  return false
end
local deleted = 0
for i = 2, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 and not needed(ARGV[i]) then
    deleted = deleted + redis.call('XDEL', KEYS[1], ARGV[i])
  end
end
return deleted
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

/// A Lua function, `group_fields(stream, group)`: the group's `XINFO GROUPS`
/// fields as a table (`pending`, `last-delivered-id`, `lag`, ...), or nil
/// when the stream or the group does not exist.
macro_rules! group_fields {
    () => {
        r"
local function group_fields(stream, group)
  if redis.call('EXISTS', stream) == 0 then
    return nil
  end
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local f = {}
    for i = 1, #g, 2 do
      f[g[i]] = g[i + 1]
    end
    if f['name'] == group then
      return f
    end
  end
  return nil
end
"
    };
}

/// Counts waiting messages: the group's pending entries, the entries after
/// its last delivered id (`lag`, counted by hand when Redis cannot tell),
/// and the delayed ones. Without a group, every entry waits.
///
/// KEYS: stream, delay set. ARGV: group.
pub(crate) static COUNT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        group_fields!(),
        r"
local count = redis.call('ZCARD', KEYS[2])
local g = group_fields(KEYS[1], ARGV[1])
if g == nil then
  return count + redis.call('XLEN', KEYS[1])
end
local lag = g['lag']
if not lag then
  lag = #redis.call('XRANGE', KEYS[1], '(' .. g['last-delivered-id'], '+')
end
return count + g['pending'] + lag
"
    ))
});

/// Deletes every message waiting for the group: the delayed ones (the delay
/// set and their payloads), and in the stream the group's pending entries
/// (acknowledged) and those it has not read (it moves past them). Entries
/// no other group needs are then trimmed like acknowledged ones. Without a
/// group, creates it past every entry. Returns how many messages there
/// were, as [`COUNT`] counts them.
///
/// KEYS: stream, delay set. ARGV: group, payload key prefix.
pub(crate) static PURGE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        group_fields!(),
        r"
local count = redis.call('ZCARD', KEYS[2])
local delayed = redis.call('ZRANGE', KEYS[2], 0, -1)
for i = 1, #delayed, 500 do
  local keys = {}
  for j = i, math.min(i + 499, #delayed) do
    keys[#keys + 1] = ARGV[2] .. delayed[j]
  end
  redis.call('DEL', unpack(keys))
end
redis.call('DEL', KEYS[2])
if redis.call('EXISTS', KEYS[1]) == 0 then
  return count
end
local g = group_fields(KEYS[1], ARGV[1])
if g == nil then
  count = count + redis.call('XLEN', KEYS[1])
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], '$')
  return count
end
local lag = g['lag']
if not lag then
  lag = #redis.call('XRANGE', KEYS[1], '(' .. g['last-delivered-id'], '+')
end
count = count + g['pending'] + lag
while true do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1000)
  if #pending == 0 then
    break
  end
  local ids = {}
  for i, p in ipairs(pending) do
    ids[i] = p[1]
  end
  redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
end
redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], '$')
return count
"
    ))
});

/// Lists waiting entries, oldest first: the group's pending entries, then
/// those after its last delivered id. Acknowledged entries that are not
/// trimmed yet are left out. Returns entries as `XRANGE` does.
///
/// KEYS: stream. ARGV: group, limit.
pub(crate) static LIST: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        group_fields!(),
        r"
local limit = tonumber(ARGV[2])
local g = group_fields(KEYS[1], ARGV[1])
if g == nil then
  return redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', limit)
end
local out = {}
if g['pending'] > 0 then
  for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', limit)) do
    local e = redis.call('XRANGE', KEYS[1], p[1], p[1])
    if #e > 0 then
      out[#out + 1] = e[1]
    end
  end
end
if #out < limit then
  local rest = redis.call('XRANGE', KEYS[1], '(' .. g['last-delivered-id'], '+', 'COUNT', limit - #out)
  for _, e in ipairs(rest) do
    out[#out + 1] = e
  end
end
return out
"
    ))
});

/// The entry with this id if it is still waiting (pending, or after the
/// group's last delivered id), as a one-entry `XRANGE` reply; else empty.
///
/// KEYS: stream. ARGV: group, id.
pub(crate) static FIND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        group_fields!(),
        r"
local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if #e == 0 then
  return e
end
local g = group_fields(KEYS[1], ARGV[1])
if g == nil then
  return e
end
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) > 0 then
  return e
end
if #redis.call('XRANGE', KEYS[1], '(' .. g['last-delivered-id'], ARGV[2], 'COUNT', 1) > 0 then
  return e
end
return {}
"
    ))
});

/// Deletes the entries every group on the stream has acknowledged from the
/// head of the stream (`XTRIM MINID`): everything older than the oldest
/// entry some group still needs (its oldest pending entry, or the one after
/// its last delivered id). Returns how many entries were deleted.
///
/// KEYS: stream.
pub(crate) static TRIM_ACKED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local floor, floor_ms, floor_seq
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local f = {}
  for i = 1, #g, 2 do
    f[g[i]] = g[i + 1]
  end
  local keep
  if f['pending'] > 0 then
    keep = redis.call('XPENDING', KEYS[1], f['name'], '-', '+', 1)[1][1]
  else
    local last = f['last-delivered-id']
    local ms, seq = string.match(last, '^(%d+)-(%d+)$')
    if tonumber(seq) < 9007199254740991 then
      keep = ms .. '-' .. string.format('%.0f', tonumber(seq) + 1)
    else
      keep = last
    end
  end
  local ms, seq = parse(keep)
  if floor == nil or ms < floor_ms or (ms == floor_ms and seq < floor_seq) then
    floor, floor_ms, floor_seq = keep, ms, seq
  end
end
if floor == nil then
  return 0
end
return redis.call('XTRIM', KEYS[1], 'MINID', floor)
",
    )
});
