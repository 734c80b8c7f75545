-- tollgate token buckets: the Redis twin of src/bucket/. Same algorithm, same floating point
-- order of operations; tests/equivalence.rs requires both to give identical verdicts, balances,
-- leases, refill times and TTLs. Change one, change the other.
--
-- This is the part both bucket scripts share; token_bucket.lua (batches of requests) and
-- lease.lua (RLQS leases) follow it in one script each.
--
-- Bucket hash fields (numbers as %.17g, times as integers, ms since the epoch on the server's
--        clock): t = tokens, l = last refill, r = refill per second in force (src/bucket
--        BucketState::fastest_refill), p = a faster pending rate (0: none), q = when p takes
--        effect, c = largest capacity of any charge, s = slowest refill per second of any charge,
--        h = the leases (src/bucket/lease.rs), seven words each: replica, capacity, refill per
--        second, expiry (ms), demand per second, banked tokens, when set (ms); absent when none;
--        u = tokens other requests asked while it had leases (src/bucket/lease.rs Asked): the
--        previous window's, the current one's, and when the current one started (ms).

-- TIME makes the script non-deterministic; Redis < 5 needs effects replication for that.
if redis.replicate_commands then pcall(redis.replicate_commands) end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- Waits and TTLs are capped at 2^52 ms (bucket MAX_WAIT_MS): now + TTL stays exact.
local MAX_WAIT = 4503599627370496
-- A rate faster than the one in force takes effect this long after a charge first uses it
-- (bucket RATE_RAISE_DELAY_MS).
local RAISE_DELAY = 6000

-- Leases from the h field: a list of {replica, capacity, rate per second, expiry, demand,
-- banked, since, text}, text being the lease's seven words as stored, which format_leases writes
-- back unchanged (a lease op changes one replica's lease and keeps the others'; formatting numbers
-- is most of what a lease op costs Redis).
local function parse_leases(h)
  local leases = {}
  if not h then return leases end
  for text, replica, c, r, e, d, b, s in string.gmatch(h, '((%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+))') do
    leases[#leases + 1] = {replica, tonumber(c), tonumber(r), tonumber(e), tonumber(d), tonumber(b), tonumber(s), text}
  end
  return leases
end

local function format_leases(leases)
  local parts = {}
  for _, h in ipairs(leases) do
    parts[#parts + 1] = h[8] or string.format('%s %.17g %.17g %d %.17g %.17g %d', h[1], h[2], h[3], h[4], h[5], h[6], h[7])
  end
  return table.concat(parts, ' ')
end

-- Committed state per key index: {tokens, last, in force, pending, pending from, largest
-- capacity, slowest rate, leases, asked before, asked now, asked since} or false when no bucket is
-- stored.
local running = {}
-- Expiries the script knows without asking Redis (ms since the epoch; 0: no key): of a key it
-- found missing or has written. A first lease or charge of a key saves a command so, and thousands
-- of them arrive together when a fleet's first reports do.
local expiries = {}
-- The state as loaded, per key index (false: no bucket): a write leaves the fields it did not
-- change alone, which saves formatting them (a lease's renewal changes the balance and the leases).
local loaded = {}
local function load(k)
  local s = running[k]
  if s == nil then
    local v = redis.call('HMGET', KEYS[k], 't', 'l', 'r', 'p', 'q', 'c', 's', 'h', 'u')
    local tokens, last = tonumber(v[1]), tonumber(v[2])
    if tokens and last then
      s = {tokens, last, tonumber(v[3]) or 0, tonumber(v[4]) or 0, tonumber(v[5]) or 0,
           tonumber(v[6]) or 0, tonumber(v[7]) or 0, parse_leases(v[8]), 0, 0, 0}
      if v[9] then
        local p, c, since = string.match(v[9], '^(%S+) (%S+) (%S+)$')
        s[9], s[10], s[11] = tonumber(p), tonumber(c), tonumber(since)
      end
      loaded[k] = {unpack(s)}
    else
      s = false
      -- No field at all: no key (every write has them all; HMGET answers a missing key so).
      local none = true
      for i = 1, 9 do none = none and not v[i] end
      if none then expiries[k] = 0 end
    end
    running[k] = s
  end
  return s
end

-- The capacity and rate per second of the leases alive at `at`, summed in order.
local function leased_at(leases, at)
  local c, r = 0, 0
  for _, h in ipairs(leases) do
    if h[4] > at then
      c = c + h[2]
      r = r + h[3]
    end
  end
  return c, r
end

-- What lease h has banked for its leaseholder as of `at` (src/bucket/lease.rs bank): a lease with no
-- capacity banks its rate, up to cap; one with capacity keeps what its growth left.
local function bank(h, at, cap)
  if h[2] == 0 then return math.min(h[6] + h[3] * math.max(0, at - h[7]) / 1000, cap) end
  return h[6]
end

-- What the leases alive at `alive` have banked as of `at`, summed in order.
local function banked_at(leases, alive, at, cap)
  local b = 0
  for _, h in ipairs(leases) do
    if h[4] > alive then b = b + bank(h, at, cap) end
  end
  return b
end

-- Whether any lease is alive now.
local function leases_live(leases)
  for _, h in ipairs(leases) do
    if h[4] > now then return true end
  end
  return false
end

-- Asked (src/bucket/lease.rs): windows of ASKED_WINDOW ms in st[9] (previous), st[10] (current),
-- st[11] (when the current one started).
local ASKED_WINDOW = 5000
local function asked_roll(st)
  if st[11] == 0 or now >= st[11] + 2 * ASKED_WINDOW then
    st[9], st[10], st[11] = 0, 0, now
  elseif now >= st[11] + ASKED_WINDOW then
    st[9], st[10], st[11] = st[10], 0, st[11] + ASKED_WINDOW
  end
end

local function asked_record(st, need)
  asked_roll(st)
  st[10] = st[10] + need
end

local function asked_per_second(st)
  asked_roll(st)
  local span = ASKED_WINDOW + math.max(0, now - st[11])
  return (st[9] + st[10]) * 1000 / span
end

-- How long after now the last lease alive now expires (0 if none).
local function leased_for(leases)
  local ms = 0
  for _, h in ipairs(leases) do ms = math.max(ms, h[4] - now) end
  return ms
end

-- The pending rate becomes the rate in force.
local function take_effect(n)
  n[3], n[4], n[5] = n[4], 0, 0
end

-- A missing bucket is full; a clock step back refills nothing and keeps the later timestamp.
-- The refill runs at the spec's rate, never faster than the rate in force (0: unknown, no cap),
-- which a pending rate replaces from the moment it takes effect, less what live leases take; the
-- balance is capped at the capacity less what they lease. The interval is walked in pieces
-- between the moments those change (the raise, each lease's expiry).
local function refill(s, cap, rate)
  if not s then return {cap, now, 0, 0, 0, 0, 0, {}, 0, 0, 0} end
  local function capped(in_force)
    if in_force > 0 then return math.min(rate, in_force / 1000) end
    return rate
  end
  local n = {s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11]}
  local from, tokens = s[2], s[1]
  while true do
    local to = math.max(now, from)
    if n[4] > 0 and n[5] > from and n[5] < to then to = n[5] end
    for _, h in ipairs(s[8]) do
      if h[4] > from and h[4] < to then to = h[4] end
    end
    if n[4] > 0 and n[5] <= from and from < now then take_effect(n) end
    local hc, hr = leased_at(s[8], from)
    local grow = math.max(0, capped(n[3]) - hr / 1000)
    -- The banks grow while the balance refills: the two together stay within the capacity.
    local room = math.max(0, cap - hc - banked_at(s[8], from, to, cap))
    tokens = math.min(room, tokens + (to - from) * grow)
    from = to
    if from >= now then break end
  end
  if n[4] > 0 and n[5] <= now then take_effect(n) end
  n[1] = tokens
  n[2] = math.max(s[2], now)
  return n
end

-- What is left of the spec (cap, rate per ms) beside the leases alive now.
local function unleased(st, cap, rate)
  local hc, hr = leased_at(st[8], now)
  return math.max(0, cap - hc - banked_at(st[8], now, now, cap)), math.max(0, rate - hr / 1000)
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

-- The ceiling a bound on the balance must use: the rate in force or the pending one.
local function ceiling(st)
  return math.max(st[3], st[4])
end

-- Whether rps refills faster than the ceiling of a bucket whose rate in force is known.
local function raises_ceiling(st, rps)
  return st[3] > 0 and rps > ceiling(st)
end

-- Records that a charge used the spec (cap, rps): its capacity and rate count for the bucket's
-- life, and a rate faster than the ceiling becomes pending.
local function note_spec(st, cap, rps)
  st[6] = math.max(st[6], cap)
  if rps <= 0 then return end
  if st[3] == 0 then
    st[3] = rps
  elseif raises_ceiling(st, rps) then
    st[4], st[5] = rps, now + RAISE_DELAY
  end
  if st[7] == 0 then st[7] = rps else st[7] = math.min(st[7], rps) end
end

-- Takes need from the state, capped at room (what the leases leave of cap), recording the spec;
-- below the floor the rest is forgiven (a balance already below it stays). Returns the tokens
-- forgiven.
local function debit(st, cap, rps, need, debt, room)
  note_spec(st, cap, rps)
  local after = math.min(room, st[1] - need)
  local kept = math.max(after, math.min(st[1], floor_of(debt)))
  st[1] = kept
  return kept - after
end

-- How long a bucket written as st by a charge with floor fl must live: until it is full at its
-- largest capacity at its slowest rate, from its balance or the floor if lower, plus a second,
-- counted from when the last live lease expires.
local function life(st, fl)
  local ttl = wait(st[6] - math.min(st[1], fl), st[7] / 1000) + 1000 + leased_for(st[8])
  if ttl > MAX_WAIT then return MAX_WAIT end
  return ttl
end

-- When key k expires (ms since the epoch): nil when it is missing, false when it has no expiry.
-- PEXPIRETIME is Redis 7; on older servers PTTL counts from a clock reading between the script's
-- start (`now`) and a fresh TIME, in whole milliseconds: `late` adds it to the fresh TIME, plus a
-- millisecond (a write must never move an expiry earlier), else to `now` less a millisecond (how
-- long a key is certainly kept; from a fresh TIME it overstated that by up to the script's
-- running time, which a test on a Redis whose PTTL counts from the script's start caught).
local function expiry(k, late)
  local known = expiries[k]
  if known == 0 then return nil end
  if known then return known end
  local ok, at = pcall(redis.call, 'PEXPIRETIME', KEYS[k])
  if not ok then
    local ttl = redis.call('PTTL', KEYS[k])
    if ttl < 0 then at = ttl elseif late then
      local t = redis.call('TIME')
      at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl + 1
    else
      at = now + ttl - 1
    end
  end
  if at == -1 then return false end
  if at < 0 then return nil end
  return at
end


-- The hash fields of a bucket's spec history: name, index in the state, format.
local SPEC_FIELDS = {{'r', 3, '%.17g'}, {'p', 4, '%.17g'}, {'q', 5, '%d'}, {'c', 6, '%.17g'}, {'s', 7, '%.17g'}}

-- Writes key k's state s to live ttl ms from now, never moving its expiry earlier; returns the
-- TTL written. The leases are written only when `leases` is true (the lease script changes them).
local function store(k, s, ttl, leases)
  local at = expiry(k, true)
  if at == false then at = now + MAX_WAIT end
  if at then ttl = math.max(ttl, math.min(math.max(0, at - now), MAX_WAIT)) end
  -- One HSET for every field written: Redis counts each command, and an idle lease's renewal is
  -- a handful of them.
  local fields = {'t', string.format('%.17g', s[1]), 'l', string.format('%d', s[2])}
  local was = loaded[k]
  for _, f in ipairs(SPEC_FIELDS) do
    if not was or was[f[2]] ~= s[f[2]] then
      fields[#fields + 1] = f[1]
      fields[#fields + 1] = string.format(f[3], s[f[2]])
    end
  end
  if leases and #s[8] > 0 then
    fields[#fields + 1] = 'h'
    fields[#fields + 1] = format_leases(s[8])
  end
  if s[11] > 0 and not (was and was[9] == s[9] and was[10] == s[10] and was[11] == s[11]) then
    fields[#fields + 1] = 'u'
    fields[#fields + 1] = string.format('%.17g %.17g %d', s[9], s[10], s[11])
  end
  redis.call('HSET', KEYS[k], unpack(fields))
  loaded[k] = {unpack(s)}
  if leases and #s[8] == 0 then redis.call('HDEL', KEYS[k], 'h') end
  redis.call('PEXPIREAT', KEYS[k], string.format('%d', now + ttl))
  expiries[k] = now + ttl
  return ttl
end
