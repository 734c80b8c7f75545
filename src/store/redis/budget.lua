-- Money budgets (follows bucket.lua, group.lua and sets.lua in one script): a request's hold
-- taken at every level of its path at once, and its settlement at stream end; the twin of
-- src/budget/ledger.rs.
--
-- Money is whole nano-units, stored as decimal text and added on two limbs ({high, low}, low
-- below 10^9): Lua's numbers are exact only to 2^53, a budget of 10^9 units is 10^18 nano-units.
-- Prices are applied by the caller (each charge rounded up once); the script only adds,
-- subtracts and compares.
--
-- Keys, all in the org's hash tag (so the level keys the script names lie in KEYS[1]'s slot):
--   <level base>:<period start>     hash: s = spent, h = held, in the period, w = how many of
--                                   its alerts the spend has crossed
--   <level base>:<period start>:q   sorted set of its open holds, '<amount>|<record key>' by
--                                   expiry (ms)
--   (each hash also has x = when it expires, ms)
--   the concurrency limits' slot sets (sets.lua), which a hold takes a slot of and a settlement
--   or a cancel gives back to
--   <level base>:<period start>:L  hash: per leaseholder of a global budget (at the global
--                                   tier) '<granted> <reported> <round> <member>': what it is
--                                   granted and has reported spent in the period, its last
--                                   renewal's round, and its member of :q
--                                   ('<unspent>|@<holder>', '' when it holds nothing unspent),
--                                   which expires as a hold does but is always charged
--   KEYS[1], the request's record   hash: b = its binding (the request's path), v = price
--                                   version, r = its price row, a = amount held,
--                                   t = tokens held (0 once trued up), e = hold expiry (ms),
--                                   o = open (1/0), c = charged so far, k = the settled kinds'
--                                   cost, p = the levels held ('<key> <period end> ...'),
--                                   k:<kind> = 1 per settled usage kind
--
-- KEYS: the request's record, then the token buckets on the path, then its slot sets.
-- ARGV: 'hold', 'settle', 'cancel', 'peek' or 'lease', what an expired hold becomes ('charge' or 'release'), how long a
--       record and a period's state outlive it (ms), price version ('' for a settlement that can
--       only be priced at its record's), price row, binding; level count, then per level: base
--       key, amount, the periods around the caller's clock (previous start, start, end, next
--       end), the alert count and each alert's spend (ascending); bucket count, then per bucket: key index, capacity, refill per
--       second, max debt ('' = charged only if admitted); set count, then per set: key index, max,
--       ttl (ms); then for 'hold': amount, tokens, hold
--       TTL (ms); for 'settle': kind count, then per kind: name, tokens, cost at this version;
--       for 'lease': the leaseholder, the lease's TTL (ms), then per level: spent reported,
--       granted wanted (both in the period, in all), and the renewal's round.
-- Reply: now_ms, outcome, then
--   hold ('admitted', 'duplicate': the record is open with this binding and hold, 'reused': the
--     record is another request's or closed, 'denied'): the exhausted level (1-based, 0: none),
--     the short bucket (0: none), the level count and per level: used (spent + held), spent,
--     period end (ms), and the alerts crossed before and after the op, the count of buckets evaluated and per bucket: tokens (%.17g) and
--     retry (ms, -1: never);
--   settle ('settled'): the amount charged now, what the hold was ('open', 'expired',
--     'settled', 'none', 'other': the record has another binding, nothing charged), the count of
--     levels charged and per level as for a hold;
--   and last, for every outcome but 'reprice' and 'peeked', the count of holds found expired (at
--   the op's first level), then the count of sets read and per set: open, expired, ms until it
--   frees (-1: not full or not refused), given back (1/0); and for a hold the full set that
--   refused it (1-based, 0: none);
--   peek ('peeked'): per level its spent and held money, period end, and the count of its
--     leaseholders and per leaseholder its name, grant and reported spend, nothing changed;
--   lease ('leased'): per level what the holder is granted, the level's spent and held money
--     and period end;
--   settle ('reprice'): the hold's version and price row, at which the caller prices again;
--   cancel ('cancelled'), then what the hold was ('open': released, its tokens given back; 'none': a
--     closed record is left, so that the hold, should it still arrive, takes nothing; 'settled',
--     'expired', 'other': nothing to undo).

local LIMB = 1000000000
local function money(text)
  if not text or text == '' then return {0, 0} end
  local n = #text
  if n <= 9 then return {0, tonumber(text)} end
  return {tonumber(string.sub(text, 1, n - 9)), tonumber(string.sub(text, n - 8))}
end
local function money_text(m)
  if m[1] == 0 then return string.format('%d', m[2]) end
  return string.format('%d%09d', m[1], m[2])
end
local function less(a, b)
  return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2])
end
local function plus(a, b)
  local hi, lo = a[1] + b[1], a[2] + b[2]
  if lo >= LIMB then hi, lo = hi + 1, lo - LIMB end
  return {hi, lo}
end
-- a - b, or zero when b is larger.
local function minus(a, b)
  if less(a, b) then return {0, 0} end
  local hi, lo = a[1] - b[1], a[2] - b[2]
  if lo < 0 then hi, lo = hi - 1, lo + LIMB end
  return {hi, lo}
end

local argi = 0
local function arg()
  argi = argi + 1
  return ARGV[argi]
end
local op, lost, life, version, row, binding = arg(), arg(), tonumber(arg()), arg(), arg(), arg()
local record = KEYS[1]
-- Keys expire by their x field, on the script's clock, not by Redis's own expiry, which runs on
-- the clock the script started at (a millisecond earlier, at times); PEXPIREAT only cleans up.
local function expired(key)
  local x = redis.call('HGET', key, 'x')
  if x and tonumber(x) < now then
    redis.call('DEL', key)
    return true
  end
  return not x
end

-- A level's state in a period, by key: {spent, held, period end, written, alerts crossed,
-- alerts crossed when loaded, alert spends}. Loading it settles the holds that expired: their
-- amount is no longer held and, under 'charge', is spent.
local ledger = {}
-- Holds found expired at the first level the op loads (its top one, where every hold of the
-- requests under it is listed once): what the reply counts.
local swept, top = 0, nil
local function level(key, finish, alerts)
  local l = ledger[key]
  if l then return l end
  if top == nil then top = key end
  local v = redis.call('HMGET', key, 's', 'h', 'x', 'w')
  local q = key .. ':q'
  if v[3] and tonumber(v[3]) < now then
    redis.call('DEL', key, q, key .. ':L')
    v = {}
  end
  local w = tonumber(v[4]) or 0
  l = {money(v[1]), money(v[2]), finish, false, w, w, alerts or {}}
  local due = redis.call('ZRANGEBYSCORE', q, '-inf', now)
  if #due > 0 then
    for _, m in ipairs(due) do
      local amount = money(string.match(m, '^(%d+)|'))
      l[2] = minus(l[2], amount)
      -- A lease's holder may have spent all of it: charged whatever 'lost' says.
      if lost == 'charge' or string.find(m, '|@', 1, true) then l[1] = plus(l[1], amount) end
    end
    redis.call('ZREMRANGEBYSCORE', q, '-inf', now)
    l[4] = true
    if key == top then swept = #due end
  end
  ledger[key] = l
  return l
end

-- Written levels live until their period's end plus a record's life, so that a settlement late
-- by that much still finds the period it charges.
local function write_levels()
  for key, l in pairs(ledger) do
    if l[4] then
      local expires = string.format('%d', l[3] + life)
      redis.call('HSET', key, 's', money_text(l[1]), 'h', money_text(l[2]), 'x', expires,
        'w', string.format('%d', l[5]))
      redis.call('PEXPIREAT', key, expires)
      redis.call('PEXPIREAT', key .. ':q', expires)
    end
  end
end

-- Counts the alerts each level's spend has now crossed; a level whose count grew is written.
local function alert()
  for _, l in pairs(ledger) do
    local crossed = 0
    for _, a in ipairs(l[7]) do
      if not less(l[1], a) then crossed = crossed + 1 end
    end
    if crossed > l[5] then
      l[5] = crossed
      l[4] = true
    end
  end
end

local levels = {}
for i = 1, tonumber(arg()) do
  local base, amount = arg(), money(arg())
  local before, start, finish, after = tonumber(arg()), tonumber(arg()), tonumber(arg()), tonumber(arg())
  if now < start then
    start, finish = before, start
  elseif now >= finish then
    start, finish = finish, after
  end
  local alerts = {}
  for j = 1, tonumber(arg()) do alerts[j] = money(arg()) end
  levels[i] = {base .. ':' .. string.format('%d', start), amount, finish, nil, alerts}
end
local buckets = {}
for i = 1, tonumber(arg()) do
  buckets[i] = {tonumber(arg()), tonumber(arg()), tonumber(arg()), tonumber(arg())}
end
local out = {now}
local sets = {}
for i = 1, tonumber(arg()) do
  sets[i] = {KEYS[tonumber(arg())], tonumber(arg()), tonumber(arg())}
end
-- What the op did to its sets: their readings, and for a hold the full set that refused it.
local set_readings, full = {}, 0
local function append_sets()
  out[#out + 1] = #set_readings
  append_readings(out, set_readings)
end

-- The token buckets' group for `need` tokens each.
local function bucket_group(need)
  local group = {}
  for i, b in ipairs(buckets) do group[i] = {b[1], b[2], b[3], need, '0', b[4], 0} end
  return group
end

-- Appends the count of `list`'s levels and, per level, its used and spent money, period end
-- and alerts crossed before and after.
local function readings(list)
  out[#out + 1] = #list
  for _, lv in ipairs(list) do
    out[#out + 1] = money_text(plus(lv[4][1], lv[4][2]))
    out[#out + 1] = money_text(lv[4][1])
    out[#out + 1] = lv[3]
    out[#out + 1] = lv[4][6]
    out[#out + 1] = lv[4][5]
  end
end

if op == 'peek' then
  out[#out + 1] = 'peeked'
  for _, lv in ipairs(levels) do
    local v = redis.call('HMGET', lv[1], 's', 'h', 'x')
    local leases = {}
    if v[3] and tonumber(v[3]) < now then
      v = {}
    else
      leases = redis.call('HGETALL', lv[1] .. ':L')
    end
    out[#out + 1] = v[1] or '0'
    out[#out + 1] = v[2] or '0'
    out[#out + 1] = lv[3]
    out[#out + 1] = #leases / 2
    for i = 1, #leases, 2 do
      local g, r = string.match(leases[i + 1], '^(%d+) (%d+) ')
      out[#out + 1] = leases[i]
      out[#out + 1] = g
      out[#out + 1] = r
    end
  end
  return out
end

if op == 'lease' then
  local holder, ttl = arg(), tonumber(arg())
  local granted = {}
  for i, lv in ipairs(levels) do
    local reported, wanted, round = money(arg()), money(arg()), tonumber(arg())
    local l = level(lv[1], lv[3], lv[5])
    lv[4] = l
    local q, leases = lv[1] .. ':q', lv[1] .. ':L'
    local g, r, n, m = {0, 0}, {0, 0}, 0, ''
    local rec = redis.call('HGET', leases, holder)
    if rec then
      local gt, rt, nt, mt = string.match(rec, '^(%d+) (%d+) (%d+) (.*)$')
      g, r, n, m = money(gt), money(rt), tonumber(nt), mt
    end
    -- A stray older than the last renewal applied: its spend counts, the grant stays.
    if round < n then wanted = g else n = round end
    if m ~= '' then
      if redis.call('ZSCORE', q, m) then
        redis.call('ZREM', q, m)
        l[2] = minus(l[2], minus(g, r))
      else
        -- It expired unrenewed, and loading the level charged it whole.
        r = g
      end
    end
    if less(r, reported) then
      l[1] = plus(l[1], minus(reported, r))
      r = reported
    end
    -- Never below what it was granted unless it asks for less: it may have committed that much.
    local floor = wanted
    if less(g, wanted) then floor = g end
    local unspent = minus(floor, r)
    local grow = minus(wanted, r)
    local room = minus(lv[2], plus(l[1], l[2]))
    if less(room, grow) then grow = room end
    if less(unspent, grow) then unspent = grow end
    g = plus(r, unspent)
    m = ''
    if unspent[1] > 0 or unspent[2] > 0 then
      m = money_text(unspent) .. '|@' .. holder
      redis.call('ZADD', q, string.format('%d', now + ttl), m)
      l[2] = plus(l[2], unspent)
    end
    redis.call('HSET', leases, holder,
      money_text(g) .. ' ' .. money_text(r) .. ' ' .. string.format('%d', n) .. ' ' .. m)
    redis.call('PEXPIREAT', leases, string.format('%d', lv[3] + life))
    l[4] = true
    granted[i] = g
  end
  alert()
  write_levels()
  out[#out + 1] = 'leased'
  for i, lv in ipairs(levels) do
    out[#out + 1] = money_text(granted[i])
    out[#out + 1] = money_text(lv[4][1])
    out[#out + 1] = money_text(lv[4][2])
    out[#out + 1] = lv[3]
  end
  return out
end

if op == 'hold' then
  local amount, tokens, ttl = money(arg()), tonumber(arg()), tonumber(arg())
  local outcome, exhausted, short = 'admitted', 0, 0
  for _, lv in ipairs(levels) do lv[4] = level(lv[1], lv[3], lv[5]) end
  local fresh = expired(record)
  if not fresh then
    -- Only the same request asking again is a retry: open, same path, same hold.
    local r = redis.call('HMGET', record, 'o', 'e', 'b', 'a', 't')
    if r[1] == '1' and tonumber(r[2]) > now and r[3] == binding and r[4] == money_text(amount)
        and tonumber(r[5]) == tokens then
      outcome = 'duplicate'
    else
      outcome = 'reused'
    end
  else
    for i, lv in ipairs(levels) do
      if exhausted == 0 and less(lv[2], plus(plus(lv[4][1], lv[4][2]), amount)) then exhausted = i end
    end
    set_readings, full = read_sets(sets)
    if exhausted > 0 then full = 0 end
    if exhausted > 0 or full > 0 then outcome = 'denied' end
  end
  local results = {}
  if outcome == 'admitted' and #buckets > 0 then
    local admitted
    admitted, results = evaluate_group(bucket_group(tokens))
    if not admitted then
      outcome = 'denied'
      for i, r in ipairs(results) do
        if short == 0 and not r[1] then short = i end
      end
    end
  end
  if outcome == 'admitted' then
    local expires = now + ttl
    local held = {}
    for _, lv in ipairs(levels) do
      lv[4][2] = plus(lv[4][2], amount)
      lv[4][4] = true
      redis.call('ZADD', lv[1] .. ':q', string.format('%d', expires), money_text(amount) .. '|' .. record)
      held[#held + 1] = lv[1] .. ' ' .. string.format('%d', lv[3])
    end
    redis.call('HSET', record, 'b', binding, 'v', version, 'r', row, 'a', money_text(amount),
      't', string.format('%d', tokens),
      'e', string.format('%d', expires), 'o', '1', 'c', '0', 'k', '0', 'p', table.concat(held, ' '),
      'x', string.format('%d', now + life))
    redis.call('PEXPIREAT', record, string.format('%d', now + life))
  end
  if fresh then close_sets(sets, record, outcome == 'admitted', set_readings) end
  write_dirty()
  alert()
  write_levels()
  out[#out + 1] = outcome
  out[#out + 1] = exhausted
  out[#out + 1] = short
  readings(levels)
  out[#out + 1] = #results
  for _, r in ipairs(results) do
    out[#out + 1] = string.format('%.17g', r[2])
    out[#out + 1] = r[3]
  end
  out[#out + 1] = swept
  append_sets()
  out[#out + 1] = full
  return out
end

if op == 'cancel' then
  local rec = {}
  if not expired(record) then rec = redis.call('HMGET', record, 'a', 't', 'e', 'o', 'p', 'b') end
  local had = 'none'
  if not rec[1] then
    redis.call('HSET', record, 'b', binding, 'v', version, 'r', row, 'a', '0', 't', '0',
      'e', string.format('%d', now), 'o', '0', 'c', '0', 'k', '0', 'p', '', 'x', string.format('%d', now + life))
    redis.call('PEXPIREAT', record, string.format('%d', now + life))
  elseif rec[6] ~= binding then
    had = 'other'
  elseif rec[4] ~= '1' then
    had = 'settled'
  elseif tonumber(rec[3]) <= now then
    had = 'expired'
  else
    had = 'open'
    local amount = money(rec[1])
    for key, finish in string.gmatch(rec[5], '(%S+) (%S+)') do
      local l = level(key, tonumber(finish))
      l[2] = minus(l[2], amount)
      l[4] = true
      redis.call('ZREM', key .. ':q', money_text(amount) .. '|' .. record)
    end
    local tokens = tonumber(rec[2]) or 0
    if tokens > 0 and #buckets > 0 then evaluate_group(bucket_group(-tokens)) end
    redis.call('HSET', record, 'o', '0', 't', '0')
  end
  if had ~= 'other' then set_readings = give_back(sets, record) end
  write_dirty()
  write_levels()
  out = {now, 'cancelled', had, swept}
  append_sets()
  return out
end

-- settle
local kinds = {}
for i = 1, tonumber(arg()) do kinds[i] = {arg(), tonumber(arg()), money(arg())} end
local rec = {}
if not expired(record) then
  rec = redis.call('HMGET', record, 'v', 'r', 'a', 't', 'e', 'o', 'c', 'k', 'p', 'x', 'b')
end
-- Another request's record: nothing.
if rec[1] and rec[11] ~= binding then return {now, 'settled', '0', 'other', 0, 0, 0} end
if rec[1] and rec[1] ~= version then return {now, 'reprice', rec[1], rec[2]} end
set_readings = give_back(sets, record)
-- No record and no price to charge at: nothing more.
if not rec[1] and version == '' then
  out = {now, 'settled', '0', 'none', 0, 0}
  append_sets()
  return out
end
local charged_levels = levels
if rec[1] then
  charged_levels = {}
  local i = 0
  for key, finish in string.gmatch(rec[9], '(%S+) (%S+)') do
    i = i + 1
    charged_levels[i] = {key, nil, tonumber(finish), nil, levels[i] and levels[i][5]}
  end
end
for _, lv in ipairs(charged_levels) do lv[4] = level(lv[1], lv[3], lv[5]) end

-- Only kinds not settled before count (a retried or duplicated call charges once).
local cost, tokens, fresh = {0, 0}, 0, {}
for _, kind in ipairs(kinds) do
  if not fresh[kind[1]] and redis.call('HEXISTS', record, 'k:' .. kind[1]) == 0 then
    fresh[#fresh + 1] = kind[1]
    fresh[kind[1]] = true
    cost = plus(cost, kind[3])
    tokens = tokens + kind[2]
  end
end

local had, held_tokens, charged, settled = 'none', 0, {0, 0}, {0, 0}
if rec[1] then
  local amount = money(rec[3])
  held_tokens, charged, settled = tonumber(rec[4]) or 0, money(rec[7]), money(rec[8])
  if rec[6] ~= '1' then
    had = 'settled'
  elseif tonumber(rec[5]) <= now then
    -- Loading its levels settled the expired hold: charged in full under 'charge'.
    had = 'expired'
    if lost == 'charge' then charged = plus(charged, amount) end
  else
    had = 'open'
    for _, lv in ipairs(charged_levels) do
      lv[4][2] = minus(lv[4][2], amount)
      lv[4][4] = true
      redis.call('ZREM', lv[1] .. ':q', money_text(amount) .. '|' .. record)
    end
  end
end
-- Every level is charged what the settled kinds cost beyond what it was charged already.
settled = plus(settled, cost)
local now_charge = minus(settled, charged)
if less(charged, settled) then charged = settled end
if now_charge[1] > 0 or now_charge[2] > 0 then
  for _, lv in ipairs(charged_levels) do
    lv[4][1] = plus(lv[4][1], now_charge)
    lv[4][4] = true
  end
end
-- Token buckets are trued up from the tokens held to the tokens used.
local delta = tokens - held_tokens
if #fresh > 0 and delta ~= 0 and #buckets > 0 then evaluate_group(bucket_group(delta)) end

if #fresh > 0 or had ~= 'settled' then
  local fields = {'o', '0', 'c', money_text(charged), 'k', money_text(settled)}
  if #fresh > 0 then
    fields[#fields + 1] = 't'
    fields[#fields + 1] = '0'
  end
  for _, name in ipairs(fresh) do
    fields[#fields + 1] = 'k:' .. name
    fields[#fields + 1] = '1'
  end
  if not rec[1] then
    local held = {}
    for _, lv in ipairs(charged_levels) do held[#held + 1] = lv[1] .. ' ' .. string.format('%d', lv[3]) end
    for _, f in ipairs({'b', binding, 'v', version, 'r', row, 'a', '0', 't', '0', 'e', string.format('%d', now),
                        'p', table.concat(held, ' ')}) do
      fields[#fields + 1] = f
    end
  end
  local expires = now + life
  if rec[10] and tonumber(rec[10]) > expires then expires = tonumber(rec[10]) end
  fields[#fields + 1] = 'x'
  fields[#fields + 1] = string.format('%d', expires)
  redis.call('HSET', record, unpack(fields))
  redis.call('PEXPIREAT', record, string.format('%d', expires))
end
write_dirty()
alert()
write_levels()
out[#out + 1] = 'settled'
out[#out + 1] = money_text(now_charge)
out[#out + 1] = had
readings(charged_levels)
out[#out + 1] = swept
append_sets()
return out
