-- tollgate RLQS demand registry: what each tollgate replica's Envoys ask of one bucket, so that
-- every replica can take its share of the bucket in proportion to demand.
--
-- KEYS[1]: the registry hash (the bucket's key + ':=rlqs', in the bucket's slot).
-- ARGV: member (a replica), its demand (requests per second), how long it stands (ms).
-- Reply: the sum of the demands that stand, as %.17g. Field values: '<demand> <expiry ms>'.
if redis.replicate_commands then pcall(redis.replicate_commands) end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. string.format('%d', now + ttl))
local all = redis.call('HGETALL', KEYS[1])
local sum = 0
for i = 1, #all, 2 do
  local demand, expiry = string.match(all[i + 1], '^(%S+) (%S+)$')
  if demand and tonumber(expiry) > now then
    sum = sum + tonumber(demand)
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
redis.call('PEXPIREAT', KEYS[1], string.format('%d', now + ttl))
return string.format('%.17g', sum)
