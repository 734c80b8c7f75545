-- Concurrency slot sets: the steps on sets that slot.lua and budget.lua share (follows bucket.lua
-- and group.lua; the twin of `Slots::read_sets`, `close_sets` and `give_back` in
-- src/slot/mod.rs).
--
-- A set is a sorted set of record keys scored by when their slot expires (ms); expired slots
-- are dropped by score, and the key itself goes an hour after its latest slot (LINGER: only
-- cleaning up, long after its slots stopped counting). A set here is {key, max, ttl (ms)}.

local LINGER = 3600000

-- Drops the set's expired slots; returns its reading: {open, expired, ms until it frees (-1:
-- not asked), given back (1/0)}.
local function sweep(key)
  local expired = redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  return {redis.call('ZCARD', key), expired, -1, 0}
end

-- Every set swept: the readings, and the first full set's index (0: none).
local function read_sets(sets)
  local readings, full = {}, 0
  for i, set in ipairs(sets) do
    readings[i] = sweep(set[1])
    if full == 0 and readings[i][1] >= set[2] then full = i end
  end
  return readings, full
end

-- After read_sets: an admitted request's slot added to every set; for a refused one, when each
-- full set's earliest slot frees.
local function close_sets(sets, record, admitted, readings)
  for i, set in ipairs(sets) do
    if admitted then
      redis.call('ZADD', set[1], now + set[3], record)
      local latest = redis.call('ZRANGE', set[1], -1, -1, 'WITHSCORES')
      redis.call('PEXPIREAT', set[1], tonumber(latest[2]) + LINGER)
      readings[i][1] = readings[i][1] + 1
    elseif readings[i][1] >= set[2] then
      local earliest = redis.call('ZRANGE', set[1], 0, 0, 'WITHSCORES')
      if earliest[2] then readings[i][3] = math.max(0, tonumber(earliest[2]) - now) end
    end
  end
end

-- The record's slot given back to every set it is still open in: the readings, and how many
-- were given back.
local function give_back(sets, record)
  local readings, given = {}, 0
  for i, set in ipairs(sets) do
    readings[i] = sweep(set[1])
    if redis.call('ZREM', set[1], record) == 1 then
      given = given + 1
      readings[i][1] = readings[i][1] - 1
      readings[i][4] = 1
    end
  end
  return readings, given
end

-- Appends every reading: open, expired, ms until it frees, given back.
local function append_readings(out, readings)
  for _, r in ipairs(readings) do
    for j = 1, 4 do out[#out + 1] = r[j] end
  end
end
