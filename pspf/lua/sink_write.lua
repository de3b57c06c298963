-- sink_write: add one chunk of a Spark task's entries to a partition, at most once.
-- KEYS[1] stream   KEYS[2] marker of this chunk       (same {topic:partition} hash tag)
-- ARGV[1] marker time to live in seconds   ARGV[2] MAXLEN ("" for none)   ARGV[3] MINID ("" for none)
-- then, per entry: the number m of fields and values, and those m arguments.
-- Returns the number of entries added, or 0 when the marker says this chunk was written before.
-- Protects the sink's no-duplicates promise: a replayed micro-batch or a retried task writes the
-- same chunk again under the same marker, and the marker and the entries change together.
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
local trim = {}
if ARGV[2] ~= '' then
  trim = {'MAXLEN', '~', ARGV[2]}
elseif ARGV[3] ~= '' then
  trim = {'MINID', '~', ARGV[3]}
end
local added = 0
local i = 4
while i <= #ARGV do
  local m = tonumber(ARGV[i])
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
  i = i + 1 + m
end
redis.call('SET', KEYS[2], added, 'EX', ARGV[1])
return added
