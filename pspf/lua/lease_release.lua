-- lease_release: give a lease up at once so a standby can take the partition.
-- KEYS[1] lease    ARGV[1] lease value held by the caller
-- Returns 1 when released, 0 when the lease was no longer the caller's (nothing is touched).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
