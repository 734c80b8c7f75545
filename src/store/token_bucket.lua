-- tollgate token buckets: the Redis twin of src/bucket.rs. Same algorithm, same floating point
-- order of operations; tests/equivalence.rs requires both to give identical answers. Change
-- one, change the other.
--
-- KEYS: the distinct bucket keys of the batch (one Cluster slot).
-- ARGV: group count, then per group its op count, then per op five values:
--       key index (into KEYS), capacity, refill per second, need, shadow (1/0).
-- Reply: now_ms, then per group: admitted (1/0), then per op:
--        allowed (1/0), tokens (exact, as %.17g), retry_after_ms (-1 = never), reset_ms.
-- Bucket hash fields: t = tokens (%.17g), l = last refill (ms since epoch, server clock).

-- TIME makes the script non-deterministic; Redis < 5 needs effects replication for that.
if redis.replicate_commands then pcall(redis.replicate_commands) end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- Committed state per key index: {tokens, last} or false when no bucket is stored.
local running = {}
local function load(k)
  local s = running[k]
  if s == nil then
    local v = redis.call('HMGET', KEYS[k], 't', 'l')
    local tokens, last = tonumber(v[1]), tonumber(v[2])
    if tokens and last then s = {tokens, last} else s = false end
    running[k] = s
  end
  return s
end

-- A missing bucket is full; a clock step back refills nothing and keeps the later timestamp.
local function refill(s, cap, rate)
  if not s then return cap, now end
  return math.min(cap, s[1] + math.max(0, now - s[2]) * rate), math.max(s[2], now)
end

local out = {now}
local dirty = {}
local a = 2
for _ = 1, tonumber(ARGV[1]) do
  local n = tonumber(ARGV[a]); a = a + 1
  local tentative = {}
  local ops = {}
  local admitted = true
  for i = 1, n do
    local k = tonumber(ARGV[a])
    local cap = tonumber(ARGV[a + 1])
    local rate = tonumber(ARGV[a + 2]) / 1000
    local need = tonumber(ARGV[a + 3])
    local shadow = ARGV[a + 4] == '1'
    a = a + 5
    local s = tentative[k]
    if s == nil then s = load(k) end
    local tokens, last = refill(s, cap, rate)
    local allowed = tokens >= need
    local retry = 0
    if allowed then
      tokens = math.min(cap, tokens - need)
    elseif need > cap then
      retry = -1
    else
      retry = math.ceil((need - tokens) / rate)
    end
    tentative[k] = {tokens, last}
    if not (allowed or shadow) then admitted = false end
    ops[i] = {k, cap, rate, need, allowed, tokens, retry}
  end

  out[#out + 1] = admitted and 1 or 0
  for i = 1, n do
    local k, cap, rate, need, allowed, tokens, retry = unpack(ops[i])
    if admitted then
      running[k] = tentative[k]
      if allowed and need ~= 0 and rate > 0 then dirty[k] = math.ceil(cap / rate) + 1000 end
    else
      tokens = refill(load(k), cap, rate)
    end
    local reset = 0
    if tokens < cap then reset = math.ceil((cap - tokens) / rate) end
    out[#out + 1] = allowed and 1 or 0
    out[#out + 1] = string.format('%.17g', tokens)
    out[#out + 1] = retry
    out[#out + 1] = reset
  end
end

-- Only debited buckets are written; an idle bucket is full by the time it expires.
for k, ttl in pairs(dirty) do
  local s = running[k]
  redis.call('HSET', KEYS[k], 't', string.format('%.17g', s[1]), 'l', string.format('%d', s[2]))
  redis.call('PEXPIRE', KEYS[k], string.format('%d', ttl))
end
return out
