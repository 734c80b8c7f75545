-- One request's group of bucket ops, all or nothing (follows bucket.lua; the twin of
-- `evaluate` in src/bucket/group.rs). token_bucket.lua runs batches of groups with it, budget.lua
-- the token buckets on a budget's path.

-- Keys a group charged, with the TTL they need at least; written once, after every group ran
-- (write_dirty), with what they then contain.
local dirty = {}

-- Evaluates `group`, a list of ops {k (key index), cap, rps, need, role ('0' enforced, '1'
-- shadow, '2' quota mode), debt (nil: charged only when admitted), unseen (tokens asked by
-- requests answered without the store since)}, committing what it takes to `running`. Returns
-- whether it is admitted and per op {allowed, tokens, retry_ms, reset_ms, forgiven, fastest
-- refill, k}.
local function evaluate_group(group)
  local tentative = {}
  local ops = {}
  local enforced_short, quota_ops, quota_allowed = false, 0, 0
  for i, op in ipairs(group) do
    local k, cap, rps, need, role, debt = op[1], op[2], op[3], op[4], op[5], op[6]
    local rate = rps / 1000
    -- What a leased bucket records as asked of it: this op's need and the denials it did not see.
    local ask = math.max(need, 0) + op[7]
    local s = tentative[k]
    if s == nil then s = load(k) end
    local st = refill(s, cap, rate)
    local room, room_rate = unleased(st, cap, rate)
    local raises = s and raises_ceiling(st, rps)
    local allowed = need < 0 or st[1] >= need
    local retry = 0
    if not allowed then retry = wait_ms(room, room_rate, st[1], math.max(need, 0)) end
    local forgiven = 0
    if allowed or debt then
      forgiven = debit(st, cap, rps, need, debt, room)
    elseif raises then
      note_spec(st, cap, rps)
    end
    local asks = ask > 0 and leases_live(st[8])
    if asks then asked_record(st, ask) end
    tentative[k] = st
    if role == '0' then
      if not allowed then enforced_short = true end
    elseif role == '2' then
      quota_ops = quota_ops + 1
      if allowed then quota_allowed = quota_allowed + 1 end
    end
    ops[i] = {k, cap, rps, rate, need, debt, allowed, st[1], retry, forgiven, ceiling(st), raises,
              room, room_rate, asks and ask}
  end
  local admitted = (not enforced_short) and (quota_ops == 0 or quota_allowed > 0)

  local results = {}
  for i = 1, #group do
    local k, cap, rps, rate, need, debt, allowed, tokens, retry, forgiven, fastest, raises, room,
      room_rate, asks = unpack(ops[i])
    local charged
    if admitted then
      running[k] = tentative[k]
      charged = allowed or debt ~= nil
    else
      -- A denied group takes only what is charged always, replayed on the committed state, and
      -- records a raised rate ceiling and its demand.
      local committed = load(k)
      local st = refill(committed, cap, rate)
      raises = committed and raises_ceiling(st, rps)
      forgiven = 0
      if debt then
        forgiven = debit(st, cap, rps, need, debt, room)
        if asks then asked_record(st, asks) end
        running[k] = st
      elseif raises or asks then
        local noted = {unpack(committed)}
        if raises then
          note_spec(noted, cap, rps)
          note_spec(st, cap, rps)
        end
        if asks then asked_record(noted, asks) end
        running[k] = noted
      end
      tokens, fastest = st[1], ceiling(st)
      charged = debt ~= nil
    end
    -- Written when charged, when its spec raised the rate ceiling, and when it asked of a leased
    -- bucket.
    if ((charged and need ~= 0) or raises or asks) and rate > 0 then
      local ttl = life(running[k], floor_of(debt))
      if dirty[k] == nil or dirty[k] < ttl then dirty[k] = ttl end
    end
    local reset = wait_ms(room, room_rate, tokens, room)
    if reset < 0 then reset = 0 end
    results[i] = {allowed, tokens, retry, reset, forgiven, fastest, k}
  end
  return admitted, results
end

-- Only charged buckets are written; an idle bucket is full by the time it expires. A write never
-- moves an expiry earlier: the bucket lives as long as the longest of what it had left and what
-- the charges need. The expiry is absolute on the clock the balance was computed with. Afterwards
-- dirty[k] is the TTL written.
local function write_dirty()
  for k, ttl in pairs(dirty) do
    dirty[k] = store(k, running[k], ttl, false)
  end
end

-- How long after now key k is certainly kept (after write_dirty): the TTL just written, else what
-- is left of its expiry, 0 when missing.
local function kept(k)
  if dirty[k] then return dirty[k] end
  if not running[k] then return 0 end
  local at = expiry(k, false)
  if at == false then return MAX_WAIT end
  if not at then return 0 end
  return math.max(0, at - now)
end

-- Reads one group from ARGV at index a (its op count, then seven values per op, as
-- token_bucket.lua describes); returns it and the index after it.
local function read_group(a)
  local n = tonumber(ARGV[a]); a = a + 1
  local group = {}
  for i = 1, n do
    group[i] = {tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
                ARGV[a + 4], tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])}
    a = a + 7
  end
  return group, a
end

-- A number as the reply carries it: an integer reply when it is one (most balances, debts and
-- rates are; Redis then neither formats nor the replica parses text), else exact as %.17g text.
local function exact(x)
  if x == math.floor(x) and x > -2^53 and x < 2^53 then return x end
  return string.format('%.17g', x)
end

-- Appends a group's reply to out: admitted, then seven values per op; how long each key is kept
-- is left as 0 in a slot noted in pending, for fill_kept once every group has run and written.
local function reply_group(out, admitted, results, pending)
  out[#out + 1] = admitted and 1 or 0
  for _, r in ipairs(results) do
    local allowed, tokens, retry, reset, forgiven, fastest, k = unpack(r)
    out[#out + 1] = allowed and 1 or 0
    out[#out + 1] = exact(tokens)
    out[#out + 1] = retry
    out[#out + 1] = reset
    out[#out + 1] = exact(forgiven)
    out[#out + 1] = exact(fastest)
    out[#out + 1] = 0
    pending[#pending + 1] = {#out, k}
  end
end

local function fill_kept(out, pending)
  for _, slot in ipairs(pending) do
    out[slot[1]] = kept(slot[2])
  end
end
