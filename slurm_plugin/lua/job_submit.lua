-- job_submit.lua (elastic-slurm, docs/hook.md): right-size GPU jobs with #ELASTIC lines; others pass silently.
-- The service decides (asked within one budget, or a kept decision); the hook checks, applies; failures submit as is.
local dir = (debug.getinfo(1, "S").source:match("^@(.*/)") or "./")
local loaded, elastic = pcall(dofile, dir .. "elastic_common.lua")
local cfg, breaker, cache, problem   -- breaker and cache: as long as slurmctld's Lua state (until a reload)
if loaded then
  cfg, problem = elastic.read_config(dir .. "elastic.conf")
  if problem then slurm.log_error("slurm_job_submit: elastic: %s", problem) end
  breaker, cache = elastic.new_breaker(cfg.breaker_failures, cfg.breaker_open_s), elastic.new_cache(cfg.cache_entries)
else
  slurm.log_error("slurm_job_submit: elastic: cannot load %s: %s", dir .. "elastic_common.lua", tostring(elastic))
end

local function submit(job_desc, uid, parts)
  local lines = elastic.directive_lines(job_desc.script)
  if #lines == 0 or elastic.untouched(job_desc.name, job_desc.comment, job_desc.dependency, cfg.helper_marker) then
    return slurm.SUCCESS
  end
  local started = elastic.now()
  local outcome = elastic.plan(cfg, breaker, "job_submit", lines, elastic.job_from_desc(job_desc, uid), cache, parts)
  local ms, applied, why = (elastic.now() - started) * 1000
  if outcome.kind == "reject" then
    slurm.log_user("%s", elastic.reject_message(elastic.reject_text(outcome, lines), "job_submit"))
    return slurm.ESLURM_INVALID_GRES or elastic.REJECT_CODE
  elseif outcome.kind ~= "skip" then
    applied, why = elastic.apply_job_desc(job_desc, outcome, cfg.gres_prefix)
  end
  if applied then
    slurm.log_info("slurm_job_submit: elastic: uid %s: %s%s (%.1f ms) %s", tostring(uid), outcome.kind,
                   outcome.cached and ", cached" or "", ms, outcome.reason)
    slurm.user_msg(outcome.reason)
  else
    why = outcome.why or ("plan not applied: " .. why)
    slurm.log_info("slurm_job_submit: elastic: uid %s: prediction skipped (%.1f ms): %s", tostring(uid), ms, why)
    slurm.user_msg(elastic.skip_message(why))
  end
  return slurm.SUCCESS
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  if not loaded or job_desc.script == nil then return slurm.SUCCESS end
  local ok, rc = pcall(submit, job_desc, submit_uid, part_list)
  if ok then return rc end
  slurm.log_error("slurm_job_submit: elastic: uid %s: hook error: %s", tostring(submit_uid), tostring(rc))
  slurm.user_msg("elastic: prediction skipped (hook error, see slurmctld log); job submitted as written")
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
slurm.log_info("job_submit.lua: elastic-slurm hook initialized (%s)", loaded and cfg.predictor_url or "disabled")
return slurm.SUCCESS
