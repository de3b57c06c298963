-- publish: append a producer's outbox rows to one topic partition, each at most once.
-- KEYS[1] the target stream   KEYS[2] its producers hash (same hash tag)
-- ARGV[1] the producer ("app/partition")
-- then per row: its sequence number, the number m of its fields and values, and those m arguments.
-- Rows come in sequence order. A row at or below the last sequence recorded for the producer was
-- appended before (a repeated publish after a crash, or another relay): it is skipped. The last
-- sequence is recorded in the same call, so no crash can separate the append from the record.
-- Returns {appended, last sequence recorded}; the error reply "WRONGTYPE ..." before any write
-- when the target key is not a stream.
local kind = redis.call('TYPE', KEYS[1])
kind = kind.ok or kind
if kind ~= 'stream' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE the target key ' .. KEYS[1] .. ' holds a ' .. kind .. ', not a stream')
end
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local appended = 0
local i = 2
while i <= #ARGV do
  local seq, m = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  if seq > last then
    redis.call('XADD', KEYS[1], '*', unpack(ARGV, i + 2, i + 1 + m))
    last = seq
    appended = appended + 1
  end
  i = i + 2 + m
end
redis.call('HSET', KEYS[2], ARGV[1], last)
return {appended, last}
