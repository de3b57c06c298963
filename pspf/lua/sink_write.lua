-- sink_write: add one chunk of a Spark task's entries to a partition, each entry at most once, then
-- trim the stream, never past an entry one of its consumer groups has yet to acknowledge.
-- KEYS[1] stream   KEYS[2] its layout key   KEYS[3] marker of this chunk, optional
--         (all three share the {topic:partition} hash tag)
-- ARGV[1] the layout generation the writer routed with ("0": never repartitioned; a missing
--         layout key is generation "0")
-- ARGV[2] marker time to live in seconds   ARGV[3] MAXLEN ("" for none)   ARGV[4] MINID ("" for none)
-- then, per entry in the chunk's order: the number m of fields and values, and those m arguments.
-- Returns the number of entries added; an error reply "LAYOUT <current>" before any write (marker
-- included) when the stream's layout is not the writer's (a repartition runs, "moving", or has
-- switched to another count), as lua/add.lua does.
-- Protects the sink's promise of no duplicates and no loss: the marker counts the chunk's entries
-- already added, so a replay of the same rows adds nothing and a retry after an attempt whose
-- input ended early adds exactly the entries that attempt did not reach. Without a marker every
-- entry is added (one call per chunk is still cheaper than one XADD reply per entry).
-- Protects invariant 3 (nothing is lost) against trimming: the floor is the lowest, over the
-- stream's groups, of each group's oldest pending id, or its last-delivered-id when nothing is
-- pending; every group has acknowledged every entry below it. MINID trims to the lower of MINID and
-- the floor; MAXLEN removes the oldest entries beyond MAXLEN but none at or above the floor, so a
-- stream may stay longer than MAXLEN while an app lags. A stream without groups has no floor.
-- Trimming is approximate (~: whole nodes of entries go) and runs once, after the entries are added.

-- Entries a MAXLEN trim looks at in one call, at most: twice the rows of a Spark chunk, so a
-- stream that grew past MAXLEN while an app lagged is back to MAXLEN a few chunks after it caught up.
local SCAN = 4000

-- The parts of a stream id as decimal text without leading zeros (a bare "MS" is "MS-0").
local function parts(id)
  local ms, seq = string.match(id, '^(%d+)%-?(%d*)$')
  if seq == '' then
    seq = '0'
  end
  return (string.gsub(ms, '^0+(%d)', '%1')), (string.gsub(seq, '^0+(%d)', '%1'))
end

-- Compares as text, not numbers: ids go up to 2^64 - 1, more than a Lua number holds exactly.
local function less(a, b)
  if #a ~= #b then
    return #a < #b
  end
  return a < b
end

local function id_less(a, b)
  local a_ms, a_seq = parts(a)
  local b_ms, b_seq = parts(b)
  if a_ms ~= b_ms then
    return less(a_ms, b_ms)
  end
  return less(a_seq, b_seq)
end

-- The lowest id some group of the stream still needs, or nil when it has no groups.
local function floor_of(stream)
  local floor = nil
  for _, flat in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local group = {}
    for i = 1, #flat, 2 do
      group[flat[i]] = flat[i + 1]
    end
    local needed = group['last-delivered-id']
    if group['pending'] > 0 then
      needed = redis.call('XPENDING', stream, group['name'])[2]
    end
    if floor == nil or id_less(needed, floor) then
      floor = needed
    end
  end
  return floor
end

local function trim(stream, maxlen, minid)
  local floor = floor_of(stream)
  if maxlen ~= '' then
    if floor == nil then
      redis.call('XTRIM', stream, 'MAXLEN', '~', maxlen)
      return
    end
    local excess = redis.call('XLEN', stream) - tonumber(maxlen)
    if excess <= 0 then
      return
    end
    -- Keep from the (excess + 1)-th oldest entry, or from the floor when that comes first.
    local count = math.min(excess + 1, SCAN)
    local oldest = redis.call('XRANGE', stream, '-', floor, 'COUNT', count)
    minid = floor
    if #oldest == count then
      minid = oldest[count][1]
    end
  elseif floor ~= nil and id_less(floor, minid) then
    minid = floor
  end
  redis.call('XTRIM', stream, 'MINID', '~', minid)
end

local current = redis.call('GET', KEYS[2]) or '0'
if current ~= ARGV[1] then
  return redis.error_reply('LAYOUT ' .. current)
end

local marker = KEYS[3]
local done = 0
if marker then
  done = tonumber(redis.call('GET', marker) or '0')
end
local seen, added = 0, 0
local i = 5
while i <= #ARGV do
  local m = tonumber(ARGV[i])
  seen = seen + 1
  if seen > done then
    redis.call('XADD', KEYS[1], '*', unpack(ARGV, i + 1, i + m))
    added = added + 1
  end
  i = i + 1 + m
end
if marker and seen > done then
  redis.call('SET', marker, seen, 'EX', ARGV[2])
end
if added > 0 and (ARGV[3] ~= '' or ARGV[4] ~= '') then
  trim(KEYS[1], ARGV[3], ARGV[4])
end
return added
