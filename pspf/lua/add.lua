-- add: append entries to one topic partition unless its layout moved on (a repartition).
-- KEYS[1] the stream   KEYS[2] its layout key (same hash tag)
-- ARGV[1] the layout generation the producer read with the partition count ("0": never
--         repartitioned; a missing key is generation "0")
-- ARGV[2] "" (ids from the server's clock), or the id "MS-SEQ" the entries' ids must follow: an
--         ordered producer's last id, so its entries keep their order across streams. Each entry
--         then takes the server's time when that is later, else the id right after the one
--         before it; the server's next id when the stream is already past that.
-- then per entry: n, and n strings: its field names and values, interleaved
-- Returns the entries' ids; an error reply "LAYOUT <current>" before any write when the stream's
-- layout is not the producer's (a repartition runs, "moving", or has switched to another count).
local current = redis.call('GET', KEYS[2]) or '0'
if current ~= ARGV[1] then
  return redis.error_reply('LAYOUT ' .. current)
end
local ms, seq
if ARGV[2] ~= '' then
  local a, b = string.match(ARGV[2], '^(%d+)-(%d+)$')
  ms, seq = tonumber(a), tonumber(b)
end
local ids = {}
local i = 3
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local args = {'XADD', KEYS[1], '*'}
  for j = i + 1, i + n do
    args[#args + 1] = ARGV[j]
  end
  local id
  if ms then
    local now = redis.call('TIME')
    local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    if now_ms > ms then
      args[3] = string.format('%d-0', now_ms)
    else
      args[3] = string.format('%d-%d', ms, seq + 1)
    end
    id = redis.pcall(unpack(args))
    if type(id) == 'table' and id.err then
      args[3] = '*'
      id = redis.call(unpack(args))
    end
    local a, b = string.match(id, '^(%d+)-(%d+)$')
    ms, seq = tonumber(a), tonumber(b)
  else
    id = redis.call(unpack(args))
  end
  ids[#ids + 1] = id
  i = i + n + 1
end
return ids
