-- publish: append a producer's outbox rows to one topic partition, each at most once.
-- KEYS[1] the target stream   KEYS[2] its producers hash (same hash tag)
-- ARGV[1] the producer ("app/partition")
-- ARGV[2] the sequence number the producer's record must have reached (0: none), so that a call
--         whose earlier call to this stream did not run (a pipelined step) adds nothing either
-- ARGV[3] the rows' sequence numbers, in order, as runs "first:count,first:count,..."
-- ARGV[4] n, the number of fields of each row, and ARGV[5 .. 4+n] their names
-- ARGV[5+n] head: when not empty, the last field of each row is head .. value .. '"}' (the
--         source headers, whose JSON differs only in the entry id); else the value as given
-- then per row its n field values.
-- A row at or below the last sequence recorded for the producer was appended before (a repeated
-- publish after a crash, or another relay): it is skipped. The last sequence is recorded in the
-- same call, so no crash can separate the append from the record.
-- Returns {appended, last sequence recorded}; an error reply before any write when the target
-- key is not a stream ("WRONGTYPE ...") or the earlier call did not run ("GAP ...").
local kind = redis.call('TYPE', KEYS[1])
kind = kind.ok or kind
if kind ~= 'stream' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE the target key ' .. KEYS[1] .. ' holds a ' .. kind .. ', not a stream')
end
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if last < tonumber(ARGV[2]) then
  return redis.error_reply('GAP the rows before sequence ' .. ARGV[2] .. ' of ' .. ARGV[1] .. ' are not in ' .. KEYS[1])
end
local seqs = {}
for first, count in string.gmatch(ARGV[3], '(%d+):(%d+)') do
  first = tonumber(first)
  for seq = first, first + tonumber(count) - 1 do
    seqs[#seqs + 1] = seq
  end
end
local n = tonumber(ARGV[4])
local head = ARGV[5 + n]
local tail = ''
if head ~= '' then
  tail = '"}'
end
local stream = KEYS[1]
local appended = 0
local i = 6 + n
local args = {stream, '*'}
for j = 1, n do
  args[1 + 2 * j] = ARGV[4 + j]
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
redis.call('HSET', KEYS[2], ARGV[1], last)
return {appended, last}
