-- sink_write: add one chunk of a Spark task's entries to a partition, each entry at most once.
-- KEYS[1] stream   KEYS[2] marker of this chunk, optional (same {topic:partition} hash tag)
-- ARGV[1] marker time to live in seconds   ARGV[2] MAXLEN ("" for none)   ARGV[3] MINID ("" for none)
-- then, per entry in the chunk's order: the number m of fields and values, and those m arguments.
-- Returns the number of entries added.
-- Protects the sink's promise of no duplicates and no loss: the marker counts the chunk's entries
-- already added, so a replay of the same rows adds nothing and a retry after an attempt whose
-- input ended early adds exactly the entries that attempt did not reach. Without a marker every
-- entry is added (one call per chunk is still cheaper than one XADD reply per entry).
local marker = KEYS[2]
local done = 0
if marker then
  done = tonumber(redis.call('GET', marker) or '0')
end
local head = {'XADD', KEYS[1]}
if ARGV[2] ~= '' then
  head = {'XADD', KEYS[1], 'MAXLEN', '~', ARGV[2]}
elseif ARGV[3] ~= '' then
  head = {'XADD', KEYS[1], 'MINID', '~', ARGV[3]}
end
head[#head + 1] = '*'
local base = #head
local seen, added = 0, 0
local i = 4
while i <= #ARGV do
  local m = tonumber(ARGV[i])
  seen = seen + 1
  if seen > done then
    local args = {unpack(head)}
    for j = 1, m do
      args[base + j] = ARGV[i + j]
    end
    redis.call(unpack(args))
    added = added + 1
  end
  i = i + 1 + m
end
if marker and seen > done then
  redis.call('SET', marker, seen, 'EX', ARGV[1])
end
return added
