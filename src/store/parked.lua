-- tollgate RLQS parked leases: what an Envoy's closed stream may still have used of its grants,
-- kept for a short while so that the Envoy's next stream (on any replica) settles it.
--
-- KEYS[1]: the parked hash (the bucket's key + ':=rlqs-parked', in the bucket's slot).
-- ARGV[1] 'park': ARGV[2] the Envoy, ARGV[3] requests, ARGV[4] ms since the stream's last report,
--   ARGV[5] how long it stands (ms). An Envoy parked twice while standing is ambiguous (two Envoys
--   behind one name): the entry then settles nothing. Reply: 1.
-- ARGV[1] 'claim': ARGV[2] the Envoy. Removes its entry; reply {requests, ms since that stream's
--   last report}, or false if none stands (or it is ambiguous).
-- Field values: '<requests> <last report ms> <expiry ms>', requests '-' when ambiguous.
if redis.replicate_commands then pcall(redis.replicate_commands) end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local function parse(v)
  if not v then return nil end
  local requests, last, expiry = string.match(v, '^(%S+) (%S+) (%S+)$')
  if not expiry or tonumber(expiry) <= now then return nil end
  return requests, tonumber(last)
end
if ARGV[1] == 'park' then
  local ttl = tonumber(ARGV[5])
  local standing = parse(redis.call('HGET', KEYS[1], ARGV[2]))
  local value
  if standing then
    value = '- 0 ' .. string.format('%d', now + ttl)
  else
    value = ARGV[3] .. ' ' .. string.format('%d', now - tonumber(ARGV[4])) .. ' ' .. string.format('%d', now + ttl)
  end
  redis.call('HSET', KEYS[1], ARGV[2], value)
  redis.call('PEXPIRE', KEYS[1], ttl)
  return 1
end
local requests, last = parse(redis.call('HGET', KEYS[1], ARGV[2]))
redis.call('HDEL', KEYS[1], ARGV[2])
if not requests or requests == '-' then return false end
return {tonumber(requests), math.max(0, now - last)}
