-- tollgate token buckets: the Redis twin of src/bucket.rs. Same algorithm, same floating point
-- order of operations; tests/equivalence.rs requires both to give identical verdicts, balances,
-- refill times and TTLs. Change one, change the other.
--
-- KEYS: the distinct bucket keys of the batch (one Cluster slot).
-- ARGV: group count, then per group its op count, then per op six values:
--       key index (into KEYS), capacity, refill per second, need, role (0 enforced, 1 shadow,
--       2 quota mode), max debt ('' = charged only when admitted, else charged always).
-- Reply: now_ms, then per group: admitted (1/0), then per op: allowed (1/0), tokens (exact, as
--        %.17g), retry_after_ms (-1 = never), reset_ms, forgiven tokens (%.17g), fastest refill
--        per second any charge of the bucket used (%.17g), ms after now the key is certainly
--        kept (its new TTL if written, else what is left of its expiry; 0 when missing).
-- Bucket hash fields: t = tokens (%.17g), l = last refill (ms since epoch, server clock),
--        r = fastest refill per second of any charge (%.17g).

-- TIME makes the script non-deterministic; Redis < 5 needs effects replication for that.
if redis.replicate_commands then pcall(redis.replicate_commands) end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- Waits and TTLs are capped at 2^52 ms (bucket.rs MAX_WAIT_MS): now + TTL stays exact.
local MAX_WAIT = 4503599627370496

-- Committed state per key index: {tokens, last, fastest} or false when no bucket is stored.
local running = {}
local function load(k)
  local s = running[k]
  if s == nil then
    local v = redis.call('HMGET', KEYS[k], 't', 'l', 'r')
    local tokens, last = tonumber(v[1]), tonumber(v[2])
    if tokens and last then s = {tokens, last, tonumber(v[3]) or 0} else s = false end
    running[k] = s
  end
  return s
end

-- A missing bucket is full; a clock step back refills nothing and keeps the later timestamp.
local function refill(s, cap, rate)
  if not s then return {cap, now, 0} end
  return {math.min(cap, s[1] + math.max(0, now - s[2]) * rate), math.max(s[2], now), s[3]}
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

-- Takes need from the state {tokens, last, fastest}, remembering the fastest refill rate; below
-- the floor the rest is forgiven (a balance already below it stays). Returns the tokens forgiven.
local function debit(st, cap, rps, need, debt)
  st[3] = math.max(st[3], rps)
  local after = math.min(cap, st[1] - need)
  local kept = math.max(after, math.min(st[1], floor_of(debt)))
  st[1] = kept
  return kept - after
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
    local allowed = need < 0 or st[1] >= need
    local retry = 0
    if not allowed then retry = wait_ms(cap, rate, st[1], math.max(need, 0)) end
    local forgiven = 0
    if allowed or debt then forgiven = debit(st, cap, rps, need, debt) end
    tentative[k] = st
    if role == '0' then
      if not allowed then enforced_short = true end
    elseif role == '2' then
      quota_ops = quota_ops + 1
      if allowed then quota_allowed = quota_allowed + 1 end
    end
    ops[i] = {k, cap, rps, rate, need, debt, allowed, st[1], retry, forgiven, st[3]}
  end
  local admitted = (not enforced_short) and (quota_ops == 0 or quota_allowed > 0)

  out[#out + 1] = admitted and 1 or 0
  for i = 1, n do
    local k, cap, rps, rate, need, debt, allowed, tokens, retry, forgiven, fastest = unpack(ops[i])
    local charged
    if admitted then
      running[k] = tentative[k]
      charged = allowed or debt ~= nil
    else
      -- A denied group takes only what is charged always, replayed on the committed state.
      local st = refill(load(k), cap, rate)
      forgiven = 0
      if debt then
        forgiven = debit(st, cap, rps, need, debt)
        running[k] = st
      end
      tokens, fastest = st[1], st[3]
      charged = debt ~= nil
    end
    if charged and need ~= 0 and rate > 0 then
      local ttl = wait(cap - floor_of(debt), rate) + 1000
      if ttl > MAX_WAIT then ttl = MAX_WAIT end
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

-- Only charged buckets are written; an idle bucket is full by the time it expires. The expiry
-- is absolute on the clock the balance was computed with, so it is exactly now + TTL.
for k, ttl in pairs(dirty) do
  local s = running[k]
  redis.call('HSET', KEYS[k], 't', string.format('%.17g', s[1]), 'l', string.format('%d', s[2]),
    'r', string.format('%.17g', s[3]))
  redis.call('PEXPIREAT', KEYS[k], string.format('%d', now + ttl))
end

-- How long after now key k is kept. PEXPIRETIME is Redis 7; on older servers PTTL counts from
-- the command's clock reading, which may be a millisecond later than TIME's: one is taken off.
local function kept(k)
  if dirty[k] then return dirty[k] end
  if not running[k] then return 0 end
  local ok, at = pcall(redis.call, 'PEXPIRETIME', KEYS[k])
  if ok then
    if at == -1 then return MAX_WAIT end
    if at < 0 then return 0 end
    return math.max(0, at - now)
  end
  local ttl = redis.call('PTTL', KEYS[k])
  if ttl == -1 then return MAX_WAIT end
  return math.max(0, ttl - 1)
end
for _, slot in ipairs(pending) do
  out[slot[1]] = kept(slot[2])
end
return out
