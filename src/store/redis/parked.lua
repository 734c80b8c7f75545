-- tollgate RLQS parked leases: what an Envoy's closed stream may still have used of its grants,
-- kept for a short while so that the Envoy's next stream (on any replica) settles it.
--
-- KEYS[1]: the parked hash (the bucket's key + ':=rlqs-parked', in the bucket's slot).
-- ARGV[1] the operation, ARGV[2] the Envoy's name, ARGV[3] the stream (unique across replicas),
-- ARGV[4] how long an entry stands (ms). Then by operation:
--   'seen': the stream reported the bucket. Reply: 1.
--   'park' ARGV[5] requests, ARGV[6] ms since the stream's last report: the stream closed with
--     these requests unsettled. Reply: 1.
--   'claim': a stream reports the bucket for the first time (and is seen).
--     Removes the Envoy's parked entry; reply {requests, ms since the parked stream's last
--     report}, or false if none stands or the name is shared.
--
-- A name is shared when two streams under it were alive at once (two Envoys behind one address,
-- or one name): their parked entries cannot be told apart, so for a while nothing under that
-- name is claimed. Fields: 'park <name>' = '<requests> <last report ms> <expiry ms>', requests
-- '-' when parked twice; 'seen <name>' = '<stream> <expiry ms> <shared until ms>'. 'park' and
-- 'claim' (once per stream and bucket) drop the fields whose times have all passed.
if redis.replicate_commands then pcall(redis.replicate_commands) end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local op, name, stream, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local park_field, seen_field = 'park ' .. name, 'seen ' .. name

local function standing(field)
  local v = redis.call('HGET', KEYS[1], field)
  if not v then return nil end
  local a, b, c = string.match(v, '^(%S+) (%S+) (%S+)$')
  return a, tonumber(b), tonumber(c)
end
local function fmt(n) return string.format('%d', n) end

-- The stream is alive until `expiry`; returns when the name stops being shared.
local function see(expiry)
  local other, other_expiry, shared = standing(seen_field)
  shared = shared or 0
  if other and other ~= stream and other_expiry > now then
    shared = math.max(shared, now + 6 * ttl)
  end
  redis.call('HSET', KEYS[1], seen_field, stream .. ' ' .. fmt(expiry) .. ' ' .. fmt(shared))
  return shared
end

-- Drops the entries of names that no stream uses any more (Envoys come and go).
local function sweep()
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local kind = string.sub(all[i], 1, 4)
    local _, b, c = string.match(all[i + 1], '^(%S+) (%S+) (%S+)$')
    local until_ms = kind == 'park' and tonumber(c) or math.max(tonumber(b) or 0, tonumber(c) or 0)
    if not until_ms or until_ms <= now then
      redis.call('HDEL', KEYS[1], all[i])
    end
  end
end

local reply = 1
if op == 'seen' then
  see(now + ttl)
elseif op == 'park' then
  sweep()
  -- The stream has ended: it no longer makes the name shared.
  see(now)
  local requests, _, expiry = standing(park_field)
  local value
  if requests and expiry > now then
    value = '- 0 ' .. fmt(now + ttl)
  else
    value = ARGV[5] .. ' ' .. fmt(now - tonumber(ARGV[6])) .. ' ' .. fmt(now + ttl)
  end
  redis.call('HSET', KEYS[1], park_field, value)
else
  sweep()
  local requests, last, expiry = standing(park_field)
  redis.call('HDEL', KEYS[1], park_field)
  local shared = see(now + ttl)
  if requests and requests ~= '-' and expiry > now and shared <= now then
    reply = {tonumber(requests), math.max(0, now - last)}
  else
    reply = false
  end
end
redis.call('PEXPIRE', KEYS[1], 6 * ttl)
return reply
