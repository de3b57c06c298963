-- ack: acknowledge a batch of entries, only while the caller still holds the partition lease.
-- KEYS[1] stream   KEYS[2] lease                  (same {topic:partition} hash tag)
-- ARGV[1] group    ARGV[2] lease value held by the caller    ARGV[3..] entry ids
-- Returns the number of entries acknowledged, or the error reply "LEASE_LOST".
-- Protects invariant 4: a worker whose lease expired or moved cannot acknowledge anything.
if redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return redis.error_reply('LEASE_LOST lease on ' .. KEYS[1] .. ' is not held by this worker')
end
local acked = 0
local chunk = 500
for first = 3, #ARGV, chunk do
  local last = math.min(first + chunk - 1, #ARGV)
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, first, last))
end
return acked
