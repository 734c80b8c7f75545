-- RLQS leases (follows bucket.lua in one script): sets replicas' leases on buckets, the twin
-- of `lease` in src/bucket/lease.rs.
--
-- KEYS: the distinct bucket keys of the call (one Cluster slot).
-- ARGV: op count, then per op eleven values: key index (into KEYS), capacity, refill per second,
--       replica, capacity wanted, rate wanted, time to live (ms), demand per second, unit (the
--       smallest capacity worth leasing), fresh (1: the whole capacity is taken again), the most
--       of the unleased rate to take (1: all).
-- Reply: now_ms, then per op one string of six numbers (%.17g): capacity leased, rate leased, the
--        other replicas' live leases' capacity, rate and demand, and 1 if the op was refused for
--        the bucket's MAX_LEASEHOLDERS (else 0) (one string, not six: a first report's leases are
--        thousands of ops, and each format and reply element costs).
-- Most leaseholders with a live lease on one bucket (src/bucket/lease.rs MAX_LEASEHOLDERS): every
-- op and request here reads all of them.
local MAX_LEASEHOLDERS = 100
local out = {now}
local a = 2
for _ = 1, tonumber(ARGV[1]) do
  local k = tonumber(ARGV[a])
  local cap, rps = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local replica = ARGV[a + 3]
  local want_c, want_r = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  local ttl, demand, unit = tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7]), tonumber(ARGV[a + 8])
  local fresh = ARGV[a + 9] == '1'
  local of_unleased = tonumber(ARGV[a + 10])
  a = a + 11
  -- A bucket that never refills (capacity 0) has nothing to lease.
  local release = want_c <= 0 and want_r <= 0
  local st, live, holds = nil, {}, false
  if rps > 0 then
    st = refill(load(k), cap, rps / 1000)
    for _, h in ipairs(st[8]) do
      if h[4] > now then
        live[#live + 1] = h
        if h[1] == replica then holds = true end
      end
    end
  end
  if rps <= 0 then
    out[#out + 1] = '0 0 0 0 0 0'
  elseif not release and #live >= MAX_LEASEHOLDERS and not holds then
    out[#out + 1] = '0 0 0 0 0 1'
  else
    local before, banked, oc, orate, od = 0, 0, 0, 0, 0
    for _, h in ipairs(live) do
      if h[1] == replica then
        if not fresh then before = h[2] end
        banked = bank(h, now, cap)
      else
        oc = oc + h[2]
        orate = orate + h[3]
        od = od + h[5]
      end
    end
    od = od + asked_per_second(st)
    local c = math.min(want_c, math.max(0, cap - oc))
    local r = math.min(want_r, math.max(0, rps - orate) * of_unleased)
    if c > before then c = math.min(c, before + banked + math.max(st[1], 0)) end
    if c < unit then c = 0 end
    if c > before then
      local from_bank = math.min(banked, c - before)
      banked = banked - from_bank
      st[1] = st[1] - (c - before - from_bank)
    end
    note_spec(st, cap, rps)
    local mine = {replica, c, r, now + ttl, demand, banked, now}
    local leases, placed = {}, false
    for _, h in ipairs(live) do
      if h[1] == replica then
        placed = true
        if not release then leases[#leases + 1] = mine end
      else
        leases[#leases + 1] = h
      end
    end
    if not placed and not release then leases[#leases + 1] = mine end
    st[8] = leases
    running[k] = st
    store(k, st, life(st, st[1]), true)
    out[#out + 1] = string.format('%.17g %.17g %.17g %.17g %.17g 0', c, r, oc, orate, od)
  end
end
return out
