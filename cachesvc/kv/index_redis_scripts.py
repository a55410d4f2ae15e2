"""The Lua scripts of the Redis prefix index (`cachesvc.kv.index_redis`): each call one round trip,
atomic on the server. Their keys and what each stores are in that module's docstring."""

# Shared by every script: tier bit helpers over the block entries of one worker.
LUA_HELPERS = """
local p = ARGV[1]
local function add(w, wkey, b, hashes)
  for _, h in ipairs(hashes) do
    local hk = p .. 'h:' .. h
    local m = tonumber(redis.call('HGET', hk, w) or '0')
    redis.call('HSET', hk, w, bit.bor(m, b))
    redis.call('SADD', wkey, h)
  end
end
local function remove(w, wkey, b, hashes)
  for _, h in ipairs(hashes) do
    local hk = p .. 'h:' .. h
    local m = tonumber(redis.call('HGET', hk, w) or '0')
    if bit.band(m, b) ~= 0 then
      m = bit.band(m, bit.bnot(b))
      if m == 0 then
        redis.call('HDEL', hk, w)
        redis.call('SREM', wkey, h)
      else
        redis.call('HSET', hk, w, m)
      end
    end
  end
end
local function drop(w)
  local wkey = p .. 'w:' .. w
  for _, h in ipairs(redis.call('SMEMBERS', wkey)) do
    redis.call('HDEL', p .. 'h:' .. h, w)
  end
  redis.call('DEL', wkey, p .. 's:' .. w)
  redis.call('SREM', p .. 'workers', w)
end
"""

# ARGV: prefix, worker, incarnation, events as JSON [[seq, kind, bit_a, bit_b, [hex...]], ...].
# Returns 1 when every event was applied or already covered, 0 on a gap or unknown stream.
APPLY = (
    LUA_HELPERS
    + """
local w, inc = ARGV[2], ARGV[3]
local skey = p .. 's:' .. w
local cur = redis.call('HMGET', skey, 'incarnation', 'next_seq')
if not cur[1] or cur[1] ~= inc then return 0 end
local nxt = tonumber(cur[2])
local wkey = p .. 'w:' .. w
local ok = 1
for _, e in ipairs(cjson.decode(ARGV[4])) do
  local seq, kind = e[1], e[2]
  if seq > nxt then ok = 0 break end
  if seq == nxt then
    if kind == 'S' then add(w, wkey, e[3], e[5])
    elseif kind == 'R' then remove(w, wkey, e[3], e[5])
    elseif kind == 'M' then remove(w, wkey, e[3], e[5]) add(w, wkey, e[4], e[5])
    elseif kind == 'C' then remove(w, wkey, e[3], redis.call('SMEMBERS', wkey))
    end
    nxt = nxt + 1
  end
end
redis.call('HSET', skey, 'next_seq', nxt)
return ok
"""
)

# ARGV: prefix, worker, incarnation, next_seq, blocks as JSON [[bit, [hex...]], ...].
# A snapshot older than what the index already follows (same life, lower next_seq) is ignored:
# another router got there first. Returns 1 when applied.
RESYNC = (
    LUA_HELPERS
    + """
local w, inc, nxt = ARGV[2], ARGV[3], tonumber(ARGV[4])
local skey = p .. 's:' .. w
local cur = redis.call('HMGET', skey, 'incarnation', 'next_seq')
if cur[1] == inc and tonumber(cur[2]) > nxt then return 0 end
drop(w)
local wkey = p .. 'w:' .. w
for _, tier in ipairs(cjson.decode(ARGV[5])) do add(w, wkey, tier[1], tier[2]) end
redis.call('HSET', skey, 'incarnation', inc, 'next_seq', nxt)
redis.call('SADD', p .. 'workers', w)
return 1
"""
)

DROP = LUA_HELPERS + "drop(ARGV[2])\nreturn 1\n"

# ARGV: prefix, num_tiers, hex... Returns {worker, count of tier 0, ..., count of tier k-1, ...}
# for every worker holding the first block, counting each block in its fastest tier.
LOOKUP = """
local p, k = ARGV[1], tonumber(ARGV[2])
local counts, alive = {}, nil
for i = 3, #ARGV do
  local flat = redis.call('HGETALL', p .. 'h:' .. ARGV[i])
  local masks = {}
  for j = 1, #flat, 2 do masks[flat[j]] = tonumber(flat[j + 1]) end
  local next_alive = {}
  local any = false
  if alive == nil then
    for w, _ in pairs(masks) do next_alive[w] = true any = true end
  else
    for w, _ in pairs(alive) do
      if masks[w] then next_alive[w] = true any = true end
    end
  end
  if not any then break end
  alive = next_alive
  for w, _ in pairs(alive) do
    local c = counts[w]
    if c == nil then c = {} for t = 1, k + 1 do c[t] = 0 end counts[w] = c end
    local rank = k
    for t = 0, k - 1 do
      if bit.band(masks[w], bit.lshift(1, t)) ~= 0 then rank = t break end
    end
    c[rank + 1] = c[rank + 1] + 1
  end
end
local out = {}
for w, c in pairs(counts) do
  table.insert(out, w)
  for t = 1, k do table.insert(out, c[t]) end
end
return out
"""
