-- redrive: put one DLQ entry back into its source stream and remove it from the DLQ, atomically.
-- KEYS[1] DLQ stream   KEYS[2] source stream          (same {topic:partition} hash tag)
-- ARGV[1] DLQ entry id   ARGV[2..] the fields and values of the entry to add to the source
-- Returns the new entry's id, or false when the DLQ entry is gone (redriven or purged already).
-- Protects invariant 3: an entry leaves the DLQ exactly when it is back in its partition, so a
-- redrive killed midway and run again moves each entry exactly once.
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then
  return false
end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
redis.call('XDEL', KEYS[1], ARGV[1])
return id
