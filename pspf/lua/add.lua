-- add: append entries to one topic partition unless its layout moved on (a repartition).
-- KEYS[1] the stream   KEYS[2] its layout key (same hash tag)
-- ARGV[1] the layout generation the producer read with the partition count ("0": never
--         repartitioned; a missing key is generation "0")
-- then per entry: n, and n strings: its field names and values, interleaved
-- Returns the entries' ids; an error reply "LAYOUT <current>" before any write when the stream's
-- layout is not the producer's (a repartition runs, "moving", or has switched to another count).
local current = redis.call('GET', KEYS[2]) or '0'
if current ~= ARGV[1] then
  return redis.error_reply('LAYOUT ' .. current)
end
local ids = {}
local i = 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local args = {'XADD', KEYS[1], '*'}
  for j = i + 1, i + n do
    args[#args + 1] = ARGV[j]
  end
  ids[#ids + 1] = redis.call(unpack(args))
  i = i + n + 1
end
return ids
