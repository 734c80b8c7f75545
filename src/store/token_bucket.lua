-- tollgate token buckets: the Redis twin of src/bucket.rs. Same algorithm, same floating point
-- order of operations; tests/equivalence.rs requires both to give identical verdicts, balances,
-- refill times and TTLs. Change one, change the other.
--
-- KEYS: the distinct bucket keys of the batch (one Cluster slot).
-- ARGV: group count, then per group its op count, then per op six values:
--       key index (into KEYS), capacity, refill per second, need, role (0 enforced, 1 shadow,
--       2 quota mode), max debt ('' = charged only when admitted, else charged always).
-- Reply: now_ms, then per group: admitted (1/0), then per op: allowed (1/0), tokens (exact, as
--        %.17g), retry_after_ms (-1 = never), reset_ms, forgiven tokens (%.17g), the fastest
--        refill per second the bucket may get, in force or pending (%.17g), ms after now the key is certainly
--        kept (its new TTL if written, else what is left of its expiry; 0 when missing).
-- Bucket hash fields (numbers as %.17g, times as integers, ms since the epoch on the server's
--        clock): t = tokens, l = last refill, r = refill per second in force (src/bucket
--        BucketState::fastest_refill), p = a faster pending rate (0: none), q = when p takes
--        effect, c = largest capacity of any charge, s = slowest refill per second of any charge.

-- TIME makes the script non-deterministic; Redis < 5 needs effects replication for that.
if redis.replicate_commands then pcall(redis.replicate_commands) end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- Waits and TTLs are capped at 2^52 ms (bucket MAX_WAIT_MS): now + TTL stays exact.
local MAX_WAIT = 4503599627370496
-- A rate faster than the one in force takes effect this long after a charge first uses it
-- (bucket RATE_RAISE_DELAY_MS).
local RAISE_DELAY = 6000

-- Committed state per key index: {tokens, last, in force, pending, pending from, largest
-- capacity, slowest rate} or false when no bucket is stored.
local running = {}
local function load(k)
  local s = running[k]
  if s == nil then
    local v = redis.call('HMGET', KEYS[k], 't', 'l', 'r', 'p', 'q', 'c', 's')
    local tokens, last = tonumber(v[1]), tonumber(v[2])
    if tokens and last then
      s = {tokens, last, tonumber(v[3]) or 0, tonumber(v[4]) or 0, tonumber(v[5]) or 0,
           tonumber(v[6]) or 0, tonumber(v[7]) or 0}
    else
      s = false
    end
    running[k] = s
  end
  return s
end

-- A missing bucket is full; a clock step back refills nothing and keeps the later timestamp.
-- The refill runs at the spec's rate, never faster than the rate in force (0: unknown, no cap),
-- which a pending rate replaces from the moment it takes effect.
local function refill(s, cap, rate)
  if not s then return {cap, now, 0, 0, 0, 0, 0} end
  local function capped(in_force)
    if in_force > 0 then return math.min(rate, in_force / 1000) end
    return rate
  end
  local n = {s[1], s[2], s[3], s[4], s[5], s[6], s[7]}
  local from = s[2]
  local grown = 0
  if s[4] > 0 and s[5] <= now then
    local split = math.max(s[5], from)
    grown = (split - from) * capped(s[3])
    from = split
    n[3], n[4], n[5] = s[4], 0, 0
  end
  grown = grown + math.max(0, now - from) * capped(n[3])
  n[1] = math.min(cap, s[1] + grown)
  n[2] = math.max(s[2], now)
  return n
end

local function wait(deficit, rate)
  local ms = math.ceil(deficit / rate)
  if ms >= MAX_WAIT then return MAX_WAIT end
  return ms
end

-- Milliseconds until a balance grows from `from` to `to`; -1 if it never will.
local function wait_ms(cap, rate, from, to)
  if from >= to then return 0 end
  if to > cap or rate <= 0 then return -1 end
  return wait(to - from, rate)
end

local function floor_of(debt)
  if debt then return -debt end
  return 0
end

-- The ceiling a bound on the balance must use: the rate in force or the pending one.
local function ceiling(st)
  return math.max(st[3], st[4])
end

-- Whether rps refills faster than the ceiling of a bucket whose rate in force is known.
local function raises_ceiling(st, rps)
  return st[3] > 0 and rps > ceiling(st)
end

-- Records that a charge used the spec (cap, rps): its capacity and rate count for the bucket's
-- life, and a rate faster than the ceiling becomes pending.
local function note_spec(st, cap, rps)
  st[6] = math.max(st[6], cap)
  if rps <= 0 then return end
  if st[3] == 0 then
    st[3] = rps
  elseif raises_ceiling(st, rps) then
    st[4], st[5] = rps, now + RAISE_DELAY
  end
  if st[7] == 0 then st[7] = rps else st[7] = math.min(st[7], rps) end
end

-- Takes need from the state, recording the spec; below the floor the rest is forgiven (a balance
-- already below it stays). Returns the tokens forgiven.
local function debit(st, cap, rps, need, debt)
  note_spec(st, cap, rps)
  local after = math.min(cap, st[1] - need)
  local kept = math.max(after, math.min(st[1], floor_of(debt)))
  st[1] = kept
  return kept - after
end

-- How long a bucket written as st by a charge with floor fl must live: until it is full at its
-- largest capacity at its slowest rate, from its balance or the floor if lower, plus a second.
local function life(st, fl)
  local ttl = wait(st[6] - math.min(st[1], fl), st[7] / 1000) + 1000
  if ttl > MAX_WAIT then return MAX_WAIT end
  return ttl
end

local out = {now}
local dirty = {}
-- Reply slots to fill with how long each key is kept, once every group has run.
local pending = {}
local a = 2
for _ = 1, tonumber(ARGV[1]) do
  local n = tonumber(ARGV[a]); a = a + 1
  local tentative = {}
  local ops = {}
  local enforced_short, quota_ops, quota_allowed = false, 0, 0
  for i = 1, n do
    local k = tonumber(ARGV[a])
    local cap = tonumber(ARGV[a + 1])
    local rps = tonumber(ARGV[a + 2])
    local rate = rps / 1000
    local need = tonumber(ARGV[a + 3])
    local role = ARGV[a + 4]
    local debt = tonumber(ARGV[a + 5])
    a = a + 6
    local s = tentative[k]
    if s == nil then s = load(k) end
    local st = refill(s, cap, rate)
    local raises = s and raises_ceiling(st, rps)
    local allowed = need < 0 or st[1] >= need
    local retry = 0
    if not allowed then retry = wait_ms(cap, rate, st[1], math.max(need, 0)) end
    local forgiven = 0
    if allowed or debt then
      forgiven = debit(st, cap, rps, need, debt)
    elseif raises then
      note_spec(st, cap, rps)
    end
    tentative[k] = st
    if role == '0' then
      if not allowed then enforced_short = true end
    elseif role == '2' then
      quota_ops = quota_ops + 1
      if allowed then quota_allowed = quota_allowed + 1 end
    end
    ops[i] = {k, cap, rps, rate, need, debt, allowed, st[1], retry, forgiven, ceiling(st), raises}
  end
  local admitted = (not enforced_short) and (quota_ops == 0 or quota_allowed > 0)

  out[#out + 1] = admitted and 1 or 0
  for i = 1, n do
    local k, cap, rps, rate, need, debt, allowed, tokens, retry, forgiven, fastest, raises =
      unpack(ops[i])
    local charged
    if admitted then
      running[k] = tentative[k]
      charged = allowed or debt ~= nil
    else
      -- A denied group takes only what is charged always, replayed on the committed state, and
      -- records a raised rate ceiling.
      local committed = load(k)
      local st = refill(committed, cap, rate)
      raises = committed and raises_ceiling(st, rps)
      forgiven = 0
      if debt then
        forgiven = debit(st, cap, rps, need, debt)
        running[k] = st
      elseif raises then
        local noted = {unpack(committed)}
        note_spec(noted, cap, rps)
        note_spec(st, cap, rps)
        running[k] = noted
      end
      tokens, fastest = st[1], ceiling(st)
      charged = debt ~= nil
    end
    -- Written when charged, and when its spec raised the rate ceiling.
    if ((charged and need ~= 0) or raises) and rate > 0 then
      local ttl = life(running[k], floor_of(debt))
      if dirty[k] == nil or dirty[k] < ttl then dirty[k] = ttl end
    end
    local reset = wait_ms(cap, rate, tokens, cap)
    if reset < 0 then reset = 0 end
    out[#out + 1] = allowed and 1 or 0
    out[#out + 1] = string.format('%.17g', tokens)
    out[#out + 1] = retry
    out[#out + 1] = reset
    out[#out + 1] = string.format('%.17g', forgiven)
    out[#out + 1] = string.format('%.17g', fastest)
    out[#out + 1] = 0
    pending[#pending + 1] = {#out, k}
  end
end

-- When key k expires (ms since the epoch): nil when it is missing, false when it has no expiry.
-- PEXPIRETIME is Redis 7; on older servers PTTL counts from a clock reading up to a millisecond
-- past a fresh TIME, and `late` picks the later end of that millisecond (a write must never move
-- an expiry earlier), else the earlier one (how long a key is certainly kept).
local function expiry(k, late)
  local ok, at = pcall(redis.call, 'PEXPIRETIME', KEYS[k])
  if not ok then
    local ttl = redis.call('PTTL', KEYS[k])
    if ttl < 0 then at = ttl else
      local t = redis.call('TIME')
      at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
      if late then at = at + 1 end
    end
  end
  if at == -1 then return false end
  if at < 0 then return nil end
  return at
end

-- Only charged buckets are written; an idle bucket is full by the time it expires. A write never
-- moves an expiry earlier: the bucket lives as long as the longest of what it had left and what
-- this batch's charges need. The expiry is absolute on the clock the balance was computed with.
for k, ttl in pairs(dirty) do
  local at = expiry(k, true)
  if at == false then at = now + MAX_WAIT end
  if at then dirty[k] = math.max(ttl, math.min(math.max(0, at - now), MAX_WAIT)) end
  local s = running[k]
  redis.call('HSET', KEYS[k], 't', string.format('%.17g', s[1]), 'l', string.format('%d', s[2]),
    'r', string.format('%.17g', s[3]), 'p', string.format('%.17g', s[4]),
    'q', string.format('%d', s[5]), 'c', string.format('%.17g', s[6]),
    's', string.format('%.17g', s[7]))
  redis.call('PEXPIREAT', KEYS[k], string.format('%d', now + dirty[k]))
end

-- How long after now key k is certainly kept.
local function kept(k)
  if dirty[k] then return dirty[k] end
  if not running[k] then return 0 end
  local at = expiry(k, false)
  if at == false then return MAX_WAIT end
  if not at then return 0 end
  return math.max(0, at - now)
end

for _, slot in ipairs(pending) do
  out[slot[1]] = kept(slot[2])
end
return out
