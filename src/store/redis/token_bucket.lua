-- Batches of requests against token buckets (follows bucket.lua and group.lua in one script).
--
-- KEYS: the distinct bucket keys of the batch (one Cluster slot).
-- ARGV: group count, then per group its op count, then per op seven values:
--       key index (into KEYS), capacity, refill per second, need, role (0 enforced, 1 shadow,
--       2 quota mode), max debt ('' = charged only when admitted, else charged always), tokens
--       asked unseen (by requests answered without the store since); then the channel the key of
--       every bucket an admitted group credits (need < 0) is published on ('' = none), so that
--       other replicas' pre-checks hear of the raise (src/store/redis/raises.rs).
-- Reply: now_ms, then per group: admitted (1/0), then per op: allowed (1/0), tokens (exact: an
--        integer when integral, else %.17g text), retry_after_ms (-1 = never), reset_ms, forgiven
--        tokens (exact), the fastest refill per second the bucket may get, in force or pending
--        (exact), ms after now the
--        key is certainly kept (its new TTL if written, else what is left of its expiry; 0 when
--        missing).

local out = {now}
-- Reply slots to fill with how long each key is kept, once every group has run.
local pending = {}
-- Key indexes of the buckets credited.
local raised = {}
local a = 2
for _ = 1, tonumber(ARGV[1]) do
  local group
  group, a = read_group(a)
  local admitted, results = evaluate_group(group)
  if admitted then
    for _, op in ipairs(group) do
      if op[4] < 0 then raised[op[1]] = true end
    end
  end
  reply_group(out, admitted, results, pending)
end

write_dirty()

local channel = ARGV[a]
if channel and channel ~= '' then
  -- A user without the permission loses only what the pre-checks learn, never the decision.
  for k in pairs(raised) do redis.pcall('PUBLISH', channel, KEYS[k]) end
end

fill_kept(out, pending)
return out
