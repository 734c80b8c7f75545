-- Concurrency slots (follows bucket.lua, group.lua and sets.lua in one script; the twin of
-- `Slots::apply` in src/slot/mod.rs, step for step).
--
-- A record is a hash {b = binding, a = admitted (1/0), g = given back (1/0), x = when it expires
-- (ms)}: records expire by x on the script's clock, as budget.lua's keys do, not by Redis's own
-- expiry, which runs on the clock the script started at (a millisecond earlier, at times);
-- PEXPIREAT only cleans up.
--
-- KEYS: the record, then the sets, then the token buckets' keys.
-- ARGV: 'take', 'give' or 'undo' (a give-back that records the take as refused), the binding, the set count, per set its max and ttl (ms); then the
--       group as token_bucket.lua reads one group (op count, seven values per op, key indexes
--       into KEYS).
-- Reply: verdict ('taken', 'refused', 'repeated', 'reused', 'given', 'nothing'), its number
--        (refused: the full set's index from 1, 0 = the buckets; repeated: admitted 1/0; given:
--        slots given back; else 0), now, per set read: open, expired, ms until its earliest slot
--        expires (-1 unless full and refused), given back (1/0); then 1 and the group's reply as token_bucket.lua
--        gives one, or 0.

local action, binding, nsets = ARGV[1], ARGV[2], tonumber(ARGV[3])
local record = KEYS[1]
local sets = {}
local a = 4
for i = 1, nsets do
  sets[i] = {KEYS[1 + i], tonumber(ARGV[a]), tonumber(ARGV[a + 1])}
  a = a + 2
end

local rec = redis.call('HMGET', record, 'b', 'a', 'g', 'x')
if rec[4] and tonumber(rec[4]) < now then
  redis.call('DEL', record)
  rec = {false, false, false, false}
end
if rec[1] and rec[1] ~= binding then
  return {'reused', 0, now}
end

if action == 'give' or action == 'undo' then
  if not rec[1] or rec[2] ~= '1' or rec[3] == '1' then
    return {'nothing', 0, now}
  end
  local readings, given = give_back(sets, record)
  local out = {'given', given, now}
  append_readings(out, readings)
  redis.call('HSET', record, 'g', 1, 'a', action == 'give' and 1 or 0)
  return out
end

if rec[1] then
  return {'repeated', tonumber(rec[2]), now}
end

local readings, full = read_sets(sets)

local group = read_group(a)
-- A full set: the buckets are only checked.
if full > 0 then
  for _, op in ipairs(group) do op[4] = 0 end
end
local group_admitted, results = evaluate_group(group)
write_dirty()
local admitted = full == 0 and group_admitted

local life = 0
for _, set in ipairs(sets) do life = math.max(life, set[3]) end
redis.call('HSET', record, 'b', binding, 'a', admitted and 1 or 0, 'g', 0, 'x', string.format('%d', now + life))
redis.call('PEXPIREAT', record, now + life)

close_sets(sets, record, admitted, readings)
local out = {admitted and 'taken' or 'refused', full, now}
append_readings(out, readings)

out[#out + 1] = 1
local pending = {}
reply_group(out, group_admitted, results, pending)
fill_kept(out, pending)
return out
