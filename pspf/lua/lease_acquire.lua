-- lease_acquire: take a free partition lease with a new fencing token.
-- KEYS[1] lease    KEYS[2] fencing counter         (same {topic:partition} hash tag)
-- ARGV[1] owner id ARGV[2] time to live in ms
-- Returns the lease value "owner|token" when taken, or false when another worker holds it.
-- Protects invariant 4: at most one live lease per partition, and every new holder gets a
-- token no earlier holder had, so a stale holder's calls are refused.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return false
end
local token = redis.call('INCR', KEYS[2])
local value = ARGV[1] .. '|' .. token
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return value
