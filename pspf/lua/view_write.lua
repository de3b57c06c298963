-- view_write: write one view's final values from a batch, packed as msgpack, in one call.
-- KEYS[1] the view (a hash or a sorted set)
-- ARGV[1] "hash" or "zset"
-- ARGV[2] msgpack [fields, values]: a value nil removes its field (member); a hash's value is text
--         or a number, a sorted set's a score. Numbers reach HSET/ZADD as the server writes a
--         script's numbers, with 17 significant digits: exact for scores, and for the ints the
--         worker sends as numbers (up to 2^53; larger ones come as their digits).
-- Returns the number of fields.
-- Why a script: packing a batch's thousands of HSET arguments costs the worker more than the rest
-- of the view's work; msgpack packs the same in a tenth of the time. Each value is final (no
-- increments), so writing a batch again changes nothing.
local data = cmsgpack.unpack(ARGV[2])
local fields, values = data[1], data[2]
local hash = ARGV[1] == 'hash'
local set, removed = {}, {}
for i = 1, #fields do
  local value = values[i]
  if value == nil then
    removed[#removed + 1] = fields[i]
  elseif hash then
    set[#set + 1] = fields[i]
    set[#set + 1] = value
  else
    set[#set + 1] = value
    set[#set + 1] = fields[i]
  end
end
-- unpack() is bounded by the Lua stack: at most 7,000 arguments per call
for i = 1, #set, 7000 do
  redis.call(hash and 'HSET' or 'ZADD', KEYS[1], unpack(set, i, math.min(i + 6999, #set)))
end
for i = 1, #removed, 7000 do
  redis.call(hash and 'HDEL' or 'ZREM', KEYS[1], unpack(removed, i, math.min(i + 6999, #removed)))
end
return #fields
