-- A plain token bucket: the reference the RLS path is measured against (bench/path.sh), what one
-- exact decision costs Redis when the script does nothing else (no leases, debts, batches or
-- pre-check replies). KEYS[1]: the bucket; ARGV: capacity, refill per second, tokens asked.
-- Reply: 1 admitted, 0 denied.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local capacity, rate, need = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local stored = redis.call('HMGET', KEYS[1], 't', 'l')
local tokens, last = tonumber(stored[1]) or capacity, tonumber(stored[2]) or now
tokens = math.min(capacity, tokens + (now - last) * rate / 1000)
local admitted = tokens >= need
if admitted then tokens = tokens - need end
redis.call('HSET', KEYS[1], 't', string.format('%.17g', tokens), 'l', now)
redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - tokens) / rate * 1000) + 1000)
return admitted and 1 or 0
