-- Argo CD health of cosmosq.io CosmosQueue and QueueConsumerGroup, read from the conditions
-- the operator writes (kstatus' Reconciling and Stalled, and Ready, Degraded, Paused).
-- Lua 5.1, as Argo CD runs it. See docs/gitops.md.
local hs = { status = "Progressing", message = "Waiting for the operator" }
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration ~= obj.metadata.generation then
  hs.message = "Waiting for the operator to observe generation " .. obj.metadata.generation
  return hs
end
local conditions = {}
for _, c in ipairs(obj.status.conditions) do
  conditions[c.type] = c
end
local function holds(type)
  return conditions[type] ~= nil and conditions[type].status == "True"
end
local function said(type)
  local c = conditions[type]
  return (c.reason or type) .. ": " .. (c.message or "")
end
if holds("Stalled") then
  hs.status = "Degraded"
  hs.message = said("Stalled")
elseif holds("Paused") then
  hs.status = "Suspended"
  hs.message = said("Paused")
elseif holds("Reconciling") then
  hs.message = said("Reconciling")
elseif holds("Degraded") then
  hs.status = "Degraded"
  hs.message = said("Degraded")
elseif holds("Ready") then
  hs.status = "Healthy"
  hs.message = said("Ready")
elseif conditions["Ready"] ~= nil then
  hs.message = said("Ready")
end
return hs
