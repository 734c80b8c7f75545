-- Reads one bucket without changing it (tollgate explain): its fields (token_bucket.lua names
-- them), Redis's clock and the key's time to live. KEYS[1]: the bucket.
local v = redis.call('HMGET', KEYS[1], 't', 'l', 'r', 'p', 'q', 'c', 's', 'h')
local now = redis.call('TIME')
return {v[1], v[2], v[3], v[4], v[5], v[6], v[7], now[1], now[2], redis.call('PTTL', KEYS[1]), v[8]}
