-- lease_renew: extend a lease, only if the caller still holds it.
-- KEYS[1] lease    ARGV[1] lease value held by the caller    ARGV[2] time to live in ms
-- Returns 1 when renewed, 0 when the lease expired or belongs to another worker.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
