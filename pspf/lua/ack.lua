-- ack: acknowledge a batch and move its dead entries to the DLQ, only under the caller's lease.
-- KEYS[1] stream   KEYS[2] lease   KEYS[3] DLQ stream      (same {topic:partition} hash tag)
-- ARGV[1] group    ARGV[2] lease value held by the caller  ARGV[3] n, the number of ids to ack
-- ARGV[4..3+n] entry ids to acknowledge
-- then, per dead entry: its id, the number m of DLQ fields and values, and those m arguments.
-- Returns {acknowledged, moved to the DLQ}, or the error reply "LEASE_LOST".
-- Protects invariants 3 and 4: a dead entry is added to the DLQ and acknowledged in one atomic
-- step, only while it is still pending (so a repeated call after a crash moves it once), and a
-- worker whose lease expired or moved cannot acknowledge or dead-letter anything.
if redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return redis.error_reply('LEASE_LOST lease on ' .. KEYS[1] .. ' is not held by this worker')
end
local acked = 0
local chunk = 500
local last_id = 3 + tonumber(ARGV[3])
for first = 4, last_id, chunk do
  local last = math.min(first + chunk - 1, last_id)
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, first, last))
end
local moved = 0
local i = last_id + 1
while i <= #ARGV do
  local id, m = ARGV[i], tonumber(ARGV[i + 1])
  if #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1) > 0 then
    redis.call('XADD', KEYS[3], '*', unpack(ARGV, i + 2, i + 1 + m))
    redis.call('XACK', KEYS[1], ARGV[1], id)
    moved = moved + 1
  end
  i = i + 2 + m
end
return {acked, moved}
