-- sink_write: add one chunk of a Spark task's entries to a partition, each entry at most once.
-- KEYS[1] stream   KEYS[2] marker of this chunk       (same {topic:partition} hash tag)
-- ARGV[1] marker time to live in seconds   ARGV[2] MAXLEN ("" for none)   ARGV[3] MINID ("" for none)
-- then, per entry in the chunk's order: the number m of fields and values, and those m arguments.
-- Returns the number of entries added.
-- Protects the sink's promise of no duplicates and no loss: the marker counts the chunk's entries
-- already added, so a replay of the same rows adds nothing and a retry after an attempt whose
-- input ended early adds exactly the entries that attempt did not reach.
local done = tonumber(redis.call('GET', KEYS[2]) or '0')
local trim = {}
if ARGV[2] ~= '' then
  trim = {'MAXLEN', '~', ARGV[2]}
elseif ARGV[3] ~= '' then
  trim = {'MINID', '~', ARGV[3]}
end
local seen, added = 0, 0
local i = 4
while i <= #ARGV do
  local m = tonumber(ARGV[i])
  seen = seen + 1
  if seen > done then
    local args = {'XADD', KEYS[1]}
    for _, t in ipairs(trim) do
      args[#args + 1] = t
    end
    args[#args + 1] = '*'
    for j = i + 1, i + m do
      args[#args + 1] = ARGV[j]
    end
    redis.call(unpack(args))
    added = added + 1
  end
  i = i + 1 + m
end
if seen > done then
  redis.call('SET', KEYS[2], seen, 'EX', ARGV[1])
end
return added
