-- read: deliver new entries of one partition to a consumer, only under the caller's lease.
-- KEYS[1] the stream   KEYS[2] its lease (same hash tag)
-- ARGV[1] group   ARGV[2] consumer   ARGV[3] count   ARGV[4] the lease value held by the caller
-- The fenced read of a cluster, where one MULTI cannot span partitions (Broker.read_new).
-- Returns {0} when the lease is not the caller's (nothing delivered), {1, entries} when entries
-- were delivered, {2, last generated id} when there were none: the id to wait after, which
-- trimming leaves as it was (the last entry still there is not it once retention emptied the stream).
if redis.call('GET', KEYS[2]) ~= ARGV[4] then
  return {0}
end
local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
if reply and reply[1] and #reply[1][2] > 0 then
  return {1, reply[1][2]}
end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then
    return {2, info[i + 1]}
  end
end
return {2, '0-0'}
