-- publish: append a producer's outbox rows to one topic partition, each at most once.
-- KEYS[1] the target stream   KEYS[2] its producers hash   KEYS[3] its layout guard (same hash tag)
-- ARGV[1] the layout generation the rows were routed in ("0": never repartitioned)
-- ARGV[2] the producer ("app/partition")
-- ARGV[3] the sequence number the producer's record must have reached (0: none), so that a call
--         whose earlier call to this stream did not run (a pipelined step) adds nothing either
-- ARGV[4] the rows' sequence numbers, in order, as runs "first:count,first:count,..."
-- ARGV[5] n, the number of fields of each row, and ARGV[6 .. 5+n] their names
-- ARGV[6+n] head: when not empty, the last field of each row is head .. value .. '"}' (the
--         source headers, whose JSON differs only in the entry id); else the value as given
-- then per row its n field values.
-- A row at or below the last sequence recorded for the producer was appended before (a repeated
-- publish after a crash, or another relay): it is skipped. The last sequence is recorded in the
-- same call, so no crash can separate the append from the record.
-- Returns {appended, last sequence recorded}; an error reply before any write when the stream's
-- layout is not the rows' ("LAYOUT <current>": a repartition runs, "moving", or switched), the
-- target key is not a stream ("WRONGTYPE ...") or the earlier call did not run ("GAP ...").
local layout = redis.call('GET', KEYS[3]) or '0'
if layout ~= ARGV[1] then
  return redis.error_reply('LAYOUT ' .. layout)
end
local kind = redis.call('TYPE', KEYS[1])
kind = kind.ok or kind
if kind ~= 'stream' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE the target key ' .. KEYS[1] .. ' holds a ' .. kind .. ', not a stream')
end
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0')
if last < tonumber(ARGV[3]) then
  return redis.error_reply('GAP the rows before sequence ' .. ARGV[3] .. ' of ' .. ARGV[2] .. ' are not in ' .. KEYS[1])
end
local seqs = {}
for first, count in string.gmatch(ARGV[4], '(%d+):(%d+)') do
  first = tonumber(first)
  for seq = first, first + tonumber(count) - 1 do
    seqs[#seqs + 1] = seq
  end
end
local n = tonumber(ARGV[5])
local head = ARGV[6 + n]
local tail = ''
if head ~= '' then
  tail = '"}'
end
local stream = KEYS[1]
local appended = 0
local i = 7 + n
local args = {stream, '*'}
for j = 1, n do
  args[1 + 2 * j] = ARGV[5 + j]
end
for _, seq in ipairs(seqs) do
  if seq > last then
    for j = 1, n - 1 do
      args[2 + 2 * j] = ARGV[i + j - 1]
    end
    args[2 + 2 * n] = head .. ARGV[i + n - 1] .. tail
    redis.call('XADD', unpack(args, 1, 2 + 2 * n))
    last = seq
    appended = appended + 1
  end
  i = i + n
end
redis.call('HSET', KEYS[2], ARGV[2], last)
return {appended, last}
