-- member_heartbeat: keep a worker in its app's member list, drop expired members, list the live.
-- KEYS[1] members (sorted set: member -> expiry)   KEYS[2] joined (sorted set: member -> join time)
-- KEYS[3] member info (hash: member -> JSON)       (all on the same {app} hash tag; server ms)
-- ARGV[1] member id   ARGV[2] time to live in ms   ARGV[3] its info (JSON)
-- ARGV[4] "1" to join or stay, "0" to leave now
-- Returns {now, present, member, joined, expiry, info, member, ...} of the live members; present
-- is 1 when the caller was a member before this call (unexpired, in all three keys), else 0.
-- The server's clock decides who expired and who joined when, so workers whose clocks differ
-- agree on the members.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]))
local present = 0
if expiry and expiry > now and redis.call('ZSCORE', KEYS[2], ARGV[1])
    and redis.call('HGET', KEYS[3], ARGV[1]) then
  present = 1
end
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  redis.call('ZREM', KEYS[1], unpack(expired))
  redis.call('ZREM', KEYS[2], unpack(expired))
  redis.call('HDEL', KEYS[3], unpack(expired))
end
if ARGV[4] == '1' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('ZADD', KEYS[2], 'NX', now, ARGV[1])
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
end
local out = {tostring(now), present}
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  out[#out + 1] = member
  out[#out + 1] = redis.call('ZSCORE', KEYS[2], member) or tostring(now)
  out[#out + 1] = redis.call('ZSCORE', KEYS[1], member)
  out[#out + 1] = redis.call('HGET', KEYS[3], member) or '{}'
end
return out
