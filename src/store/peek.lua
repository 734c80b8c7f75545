-- Reads one bucket without changing it (tollgate explain): its fields, Redis's clock and the
-- key's time to live. KEYS[1]: the bucket.
local v = redis.call('HMGET', KEYS[1], 't', 'l', 'r')
local now = redis.call('TIME')
return {v[1], v[2], v[3], now[1], now[2], redis.call('PTTL', KEYS[1])}
