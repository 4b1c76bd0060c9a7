--[[
 job_submit.lua (elastic-slurm): right-size GPU jobs that carry #ELASTIC directives (docs/hook.md).

 Jobs without #ELASTIC lines, launcher helper jobs and expand: allocations pass untouched and silently.
 A malformed #ELASTIC line is rejected here, even when the predictor is down. Otherwise the raw lines and
 the job's request go to POST /v1/plan within a hard total budget; the service decides, the hook validates
 and applies. A decision is reused for identical requests within the cache_ttl_s the service sent with it,
 and the decisions it precomputed for other min_efficiency values answer those (docs/hook.md "Decision bands").
 Any failure of the service (down, slow, 5xx, garbage, circuit open) accepts the job as written.
 Installed with elastic_common.lua and elastic.conf beside it by `elastic-slurm install-plugin`.
]]
local dir = (debug.getinfo(1, "S").source:match("^@(.*/)") or "./")
local loaded, elastic = pcall(dofile, dir .. "elastic_common.lua")
local cfg, breaker, cache
if loaded then
  local problem
  cfg, problem = elastic.read_config(dir .. "elastic.conf")
  if problem then slurm.log_error("slurm_job_submit: elastic: %s", problem) end
  breaker = elastic.new_breaker(cfg.breaker_failures, cfg.breaker_open_s)
  -- Module state lives as long as slurmctld's Lua state (until the script is reloaded): repeated
  -- submissions within the service's cache_ttl_s reuse its decision without a call.
  cache = elastic.new_cache(cfg.cache_entries)
else
  slurm.log_error("slurm_job_submit: elastic: cannot load %s: %s", dir .. "elastic_common.lua", tostring(elastic))
end

local function submit(job_desc, submit_uid)
  local lines = elastic.directive_lines(job_desc.script)
  if #lines == 0 or elastic.is_helper(job_desc.name, job_desc.comment, job_desc.dependency, cfg.helper_marker)
     or elastic.planned(job_desc.comment) then
    return slurm.SUCCESS
  end
  local directives, err = elastic.parse_lines(lines)
  if err then
    slurm.log_user("%s", elastic.reject_message(err.message, "job_submit"))
    return slurm.ESLURM_INVALID_GRES or elastic.REJECT_CODE
  end
  local started = elastic.now()
  local outcome = elastic.plan(cfg, breaker, elastic.request("job_submit", lines, elastic.job_from_desc(job_desc, submit_uid)),
                              cache, directives)
  local ms = (elastic.now() - started) * 1000
  if outcome.kind == "reject" then
    slurm.log_user("%s", elastic.reject_message(elastic.reject_text(outcome, lines), "job_submit"))
    return slurm.ESLURM_INVALID_GRES or elastic.REJECT_CODE
  elseif outcome.kind == "skip" then
    slurm.log_info("slurm_job_submit: elastic: uid %s: prediction skipped (%.1f ms): %s", tostring(submit_uid), ms, outcome.why)
    slurm.user_msg(elastic.skip_message(outcome))
    return slurm.SUCCESS
  end
  if outcome.kind == "rewrite" then
    local applied, why = elastic.apply_job_desc(job_desc, outcome)
    if applied == nil then
      slurm.log_info("slurm_job_submit: elastic: uid %s: rewrite not applied: %s", tostring(submit_uid), why)
      slurm.user_msg(elastic.skip_message({ why = "plan not applied: " .. why }))
      return slurm.SUCCESS
    end
  end
  if outcome.kind == "keep" and outcome.decision_id ~= nil then
    job_desc.comment = elastic.comment_with(job_desc.comment, outcome.decision_id)
  end
  slurm.log_info("slurm_job_submit: elastic: uid %s: %s%s (%.1f ms) %s", tostring(submit_uid), outcome.kind,
                 outcome.cached and ", cached" or "", ms, outcome.reason)
  slurm.user_msg(outcome.reason)
  return slurm.SUCCESS
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  if not loaded or job_desc.script == nil then return slurm.SUCCESS end
  local ok, rc = pcall(submit, job_desc, submit_uid)
  if ok then return rc end
  slurm.log_error("slurm_job_submit: elastic: uid %s: hook error: %s", tostring(submit_uid), tostring(rc))
  slurm.user_msg("elastic: prediction skipped (hook error, see slurmctld log); job submitted as written")
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

slurm.log_info("job_submit.lua: elastic-slurm hook initialized (%s)", loaded and tostring(cfg.predictor_url) or "disabled")
return slurm.SUCCESS
