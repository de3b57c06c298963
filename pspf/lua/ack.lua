-- ack: update the partition's state backup, acknowledge a batch and move its dead entries to the
-- DLQ, all only under the caller's lease.
-- KEYS[1] stream   KEYS[2] lease   KEYS[3] DLQ stream
-- KEYS[4] backup hash (its first bucket)   KEYS[5] backup meta   KEYS[6] backup log
-- KEYS[7...] the backup's other buckets the call writes; with "replace", every other bucket of the
--            old and the new layout (all deleted first). All on one {topic:partition} tag.
-- ARGV[1] group    ARGV[2] lease value held by the caller
-- ARGV[3] n, the number of ids to ack   ARGV[4] d, the number of dead entries
-- ARGV[5] the backup update: "" for none; "update" (also added to the log); "replace" (the first
--         part of a whole upload: backup, meta and log emptied first); "upload" (a later part)
-- ARGV[6] the most and the fewest log entries to keep, "most:fewest" (about: MAXLEN ~); between
--         them, as many updates as hold about as many values as the backup (``acking.log_length``)
-- ARGV[7] with an "update": the identities the backup may hold now, comma-separated ("" not to
--         check); a backup with another one went back (a fail-over lost writes): nothing is done
-- ARGV[8] the number of buckets the values are spread over (the log's length follows their count)
-- then the n entry ids to acknowledge;
-- then, per dead entry: its id, the number m of DLQ fields and values, and those m arguments;
-- then, with a backup update: the batch identity ("" to leave it), the numbers c of checkpoints,
-- e of other meta fields, g of groups of values to set and h of groups of fields to delete; then c
-- pairs (topic, checkpoint), e pairs (meta field, value); per group to set: the index of its
-- bucket in KEYS, the number s of values, s pairs (field, value); per group to delete: the index,
-- the number r of fields, r fields (fields hold "namespace\0key"); and last the log entry's data:
-- the update packed by the caller (its one field, see ``broker.log_data``), "" for an upload.
-- An update's log entry holds "prev" (the identity it follows), "id" and "data".
-- The values hash holds the identity too (field "__backup\0identity", meta "marked" says so): an
-- update finding another there (the hash deleted or evicted alone) is refused as BACKUP_DAMAGED.
-- Returns {acknowledged, moved to the DLQ}, or the error reply "LEASE_LOST", "BACKUP_WENT_BACK" or
-- "BACKUP_DAMAGED".
-- Protects invariants 3, 4 and 7: the backup holds a batch's effects in the same atomic step that
-- acknowledges its entries; a dead entry is added to the DLQ and acknowledged in one step, only
-- while it is still pending (a repeated call after a crash moves it once); and a worker whose
-- lease expired or moved can neither update the backup nor acknowledge nor dead-letter anything.
if redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return redis.error_reply('LEASE_LOST lease on ' .. KEYS[1] .. ' is not held by this worker')
end
local chunk = 500
local n, d, backup = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local mark = '__backup\0identity'
if backup == 'update' then
  local head = redis.call('HMGET', KEYS[5], 'identity', 'marked')
  local held = head[1] or ''
  if ARGV[7] ~= '' and not string.find(',' .. ARGV[7] .. ',', ',' .. held .. ',', 1, true) then
    return redis.error_reply('BACKUP_WENT_BACK the state backup of ' .. KEYS[1] .. ' is at "' .. held ..
                             '", not where this worker left it')
  end
  if head[2] and redis.call('HGET', KEYS[4], mark) ~= head[1] then
    return redis.error_reply('BACKUP_DAMAGED the state backup of ' .. KEYS[1] .. ' has lost its values ' ..
                             '(deleted or evicted) while its meta is at "' .. held .. '"')
  end
end
local first_id = 9
local i = first_id + n
local dead_at = i
for _ = 1, d do
  i = i + 2 + tonumber(ARGV[i + 1])
end
if backup ~= '' then
  local most, fewest = string.match(ARGV[6], '^(%d+):(%d+)$')
  most, fewest = tonumber(most), tonumber(fewest)
  local logged = backup == 'update' and most > 0
  local prev = ''
  if logged then
    prev = redis.call('HGET', KEYS[5], 'identity') or ''
  end
  if backup == 'replace' then
    for first = 4, #KEYS, chunk do
      redis.call('DEL', unpack(KEYS, first, math.min(first + chunk - 1, #KEYS)))
    end
  end
  local identity = ARGV[i]
  local c, e, g, h = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
  local at = i + 5
  if c + e > 0 then
    local meta = {}
    for k = at, at + 2 * c - 1, 2 do
      meta[#meta + 1] = 'cp:' .. ARGV[k]
      meta[#meta + 1] = ARGV[k + 1]
    end
    for k = at + 2 * c, at + 2 * (c + e) - 1 do
      meta[#meta + 1] = ARGV[k]
    end
    redis.call('HSET', KEYS[5], unpack(meta))
  end
  at = at + 2 * (c + e)
  local changed = 0
  for _ = 1, g do
    local key, s = KEYS[tonumber(ARGV[at])], tonumber(ARGV[at + 1])
    for first = at + 2, at + 1 + 2 * s, 2 * chunk do
      redis.call('HSET', key, unpack(ARGV, first, math.min(first + 2 * chunk - 1, at + 1 + 2 * s)))
    end
    at, changed = at + 2 + 2 * s, changed + s
  end
  for _ = 1, h do
    local key, r = KEYS[tonumber(ARGV[at])], tonumber(ARGV[at + 1])
    for first = at + 2, at + 1 + r, chunk do
      redis.call('HDEL', key, unpack(ARGV, first, math.min(first + chunk - 1, at + 1 + r)))
    end
    at, changed = at + 2 + r, changed + r
  end
  if identity ~= '' then
    redis.call('HSET', KEYS[5], 'identity', identity, 'marked', '1')
    redis.call('HSET', KEYS[4], mark, identity)
  end
  if logged then
    local keep = most
    if changed > 0 then
      local held = redis.call('HLEN', KEYS[4]) * tonumber(ARGV[8])
      keep = math.max(fewest, math.min(most, math.floor(held / changed)))
    end
    redis.call('XADD', KEYS[6], 'MAXLEN', '~', keep, '*', 'prev', prev,
               'id', identity ~= '' and identity or prev, 'data', ARGV[at])
  end
end
local acked = 0
for first = first_id, first_id + n - 1, chunk do
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, first, math.min(first + chunk - 1, first_id + n - 1)))
end
local moved = 0
i = dead_at
for _ = 1, d do
  local id, m = ARGV[i], tonumber(ARGV[i + 1])
  if #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1) > 0 then
    redis.call('XADD', KEYS[3], '*', unpack(ARGV, i + 2, i + 1 + m))
    redis.call('XACK', KEYS[1], ARGV[1], id)
    moved = moved + 1
  end
  i = i + 2 + m
end
return {acked, moved}
