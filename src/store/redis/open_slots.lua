-- The open slots of a concurrency slot set (sets.lua), read without changing it: those whose
-- expiry is after the server's clock (an expired one counts as gone, as a take would sweep it).
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
