-- last_ids: the last generated id of each stream, as XINFO STREAM says, without its entries.
-- KEYS the streams (of one server)   ARGV none
-- Returns one id per stream, '0-0' for a stream that does not exist.
-- The id an empty read waits after and compares with the checkpoint (Broker.read_new). Trimming
-- and XDEL leave it as it was; the last entry still there (XREVRANGE) is not it once retention
-- emptied the stream, and would look like a stream that went back.
local ids = {}
for k, key in ipairs(KEYS) do
  ids[k] = '0-0'
  if redis.call('EXISTS', key) == 1 then
    local info = redis.call('XINFO', 'STREAM', key)
    for i = 1, #info, 2 do
      if info[i] == 'last-generated-id' then
        ids[k] = info[i + 1]
        break
      end
    end
  end
end
return ids
