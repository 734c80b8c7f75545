-- tollgate RLQS demand registry: what each tollgate replica's Envoys ask of one bucket, and what
-- each replica took of it lately, so that every replica can take its share of the bucket in
-- proportion to demand, whichever leases first.
--
-- KEYS[1]: the registry hash (the bucket's key + ':=rlqs', in the bucket's slot).
-- ARGV[1] 'ask' or 'took', ARGV[2] the member (a replica), ARGV[3] its demand (requests per
-- second) or what it took (tokens), ARGV[4] how long that stands (ms).
-- Reply: {the sum of the standing demands, the sum of the standing takes of the other members},
-- as %.17g. Field values: '<demand> <expiry ms> <taken> <taken expiry ms>'.
if redis.replicate_commands then pcall(redis.replicate_commands) end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local member, amount, ttl = ARGV[2], ARGV[3], tonumber(ARGV[4])
local old = redis.call('HGET', KEYS[1], member)
local demand, expiry, taken, taken_expiry = '0', 0, '0', 0
if old then
  local d, e, t, te = string.match(old, '^(%S+) (%S+) (%S+) (%S+)$')
  if te then demand, expiry, taken, taken_expiry = d, tonumber(e), t, tonumber(te) end
end
if ARGV[1] == 'ask' then
  demand, expiry = amount, now + ttl
else
  taken, taken_expiry = amount, now + ttl
end
redis.call('HSET', KEYS[1], member, demand .. ' ' .. string.format('%d', expiry) .. ' ' .. taken .. ' ' .. string.format('%d', taken_expiry))
local all = redis.call('HGETALL', KEYS[1])
local demands, others, last = 0, 0, now
for i = 1, #all, 2 do
  local d, e, t, te = string.match(all[i + 1], '^(%S+) (%S+) (%S+) (%S+)$')
  local alive = false
  if te and tonumber(e) > now then
    demands = demands + tonumber(d)
    alive = true
  end
  if te and tonumber(te) > now then
    if all[i] ~= member then others = others + tonumber(t) end
    alive = true
  end
  if alive then
    last = math.max(last, tonumber(e), tonumber(te))
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
redis.call('PEXPIREAT', KEYS[1], string.format('%d', last))
return {string.format('%.17g', demands), string.format('%.17g', others)}
