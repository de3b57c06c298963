-- repartition_claim: claim a topic for one run of a repartition, before the run reads anything.
-- KEYS[1] the topic's plan hash   KEYS[2] its runner lease   KEYS[3] its abort mark
--         (all under the topic's hash tag: one slot)
-- ARGV[1] the plan to record (JSON), or "" to take up the recorded one (--resume)
-- ARGV[2] the runner's lease value   ARGV[3] the lease's time to live in ms
-- Returns {"taken", plan}; {"held", plan, runner} when a plan is recorded already (for a new
-- one) or its runner's lease is alive (either "" when there is none); {"aborting", ""} while an
-- abort of it is under way; {"none", ""} when there is no plan to take up.
-- Protects: one command at a time runs a topic's repartition, and a second one reads nothing.
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {'aborting', ''}
end
local recorded = redis.call('HGET', KEYS[1], 'plan')
local runner = redis.call('GET', KEYS[2])
if ARGV[1] ~= '' then
  if recorded or runner then
    return {'held', recorded or '', runner or ''}
  end
elseif not recorded then
  return {'none', ''}
elseif runner then
  return {'held', recorded, runner}
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
if ARGV[1] ~= '' then
  redis.call('HSET', KEYS[1], 'plan', ARGV[1])
  return {'taken', ARGV[1]}
end
return {'taken', recorded}
