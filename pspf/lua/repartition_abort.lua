-- repartition_abort: take a topic's repartition for its abort, with no command a server at its
-- maxmemory refuses (GET, EXISTS, HGET, RENAME), so an abort can free what a copy filled.
-- KEYS[1] the topic's plan hash   KEYS[2] its runner lease   KEYS[3] its abort mark
--         (all under the topic's hash tag: one slot)
-- Returns {"held", runner} while a runner's lease is alive; {"switched", plan} when the plan has
-- begun its switch (nothing is changed); {"taken", plan} once the plan is the abort mark (a
-- claim or a resume is refused from then on; an abort taken up again finds it there); {"none",
-- ""} when there is neither a plan nor an abort under way.
-- Protects: an abort never deletes what a live run is staging, nor undoes a switch begun.
local runner = redis.call('GET', KEYS[2])
if runner then
  return {'held', runner}
end
local recorded = redis.call('HGET', KEYS[1], 'plan')
if recorded then
  if cjson.decode(recorded)['step'] ~= 'planned' then
    return {'switched', recorded}
  end
  redis.call('RENAME', KEYS[1], KEYS[3])
end
local marked = redis.call('HGET', KEYS[3], 'plan')
if not marked then
  return {'none', ''}
end
return {'taken', marked}
