-- job_submit.lua (elastic-slurm, docs/hook.md): right-size GPU jobs with #ELASTIC lines; others pass silently.
-- The service decides (asked within one budget, or a kept decision); the hook checks, applies; failures submit as is.
local dir = (debug.getinfo(1, "S").source:match("^@(.*/)") or "./")
local socket = require("socket")
local loaded, elastic = pcall(dofile, dir .. "elastic_common.lua")
local cfg, breaker, cache, problem   -- breaker and cache: as long as slurmctld's Lua state (until a reload)
if loaded then
  cfg, problem = elastic.read_config(dir .. "elastic.conf")
  if problem then slurm.log_error("slurm_job_submit: elastic: %s", problem) end
  breaker = elastic.new_breaker(cfg.breaker_failures, cfg.breaker_open_s, true)
  cache = elastic.new_cache(cfg.cache_entries)
else
  slurm.log_error("slurm_job_submit: elastic: cannot load %s: %s", dir .. "elastic_common.lua", tostring(elastic))
end

local function submit(job_desc, script, uid, parts)
  local scan_started = socket.gettime()   -- the scan is in the budget: the request gets what it leaves
  local lines, capped = elastic.directive_lines(script)
  local scan_s = socket.gettime() - scan_started
  if capped then   -- at most once a submission, and only for a header of MAX_HEADER_LINES lines or _BYTES bytes
    slurm.log_info("slurm_job_submit: elastic: uid %s: header scan stopped at %s (%.1f ms; caps %d lines, %d bytes)",
                   tostring(uid), capped, scan_s * 1000, elastic.MAX_HEADER_LINES, elastic.MAX_HEADER_BYTES)
  end
  if #lines == 0 then return slurm.SUCCESS end
  local desc = elastic.read_desc(job_desc)   -- read once; written back through job_desc
  if elastic.untouched(desc.name, desc.comment, desc.dependency, cfg.helper_marker) then return slurm.SUCCESS end
  local started, outcome = elastic.now()
  if capped then   -- the block goes on past the caps: its #ELASTIC lines there are unread, so none is planned
    outcome = { kind = "skip", why = ("#ELASTIC lines after %s are not read: the header is read up to %d lines and "
                                      .. "%d bytes"):format(capped, elastic.MAX_HEADER_LINES, elastic.MAX_HEADER_BYTES) }
  else
    outcome = elastic.plan(cfg, breaker, "job_submit", lines, elastic.job_from_desc(desc, uid), cache, parts,
                           scan_s, elastic.test_only(desc.comment))
  end
  local ms, applied, why = (elastic.now() - started) * 1000
  if outcome.kind == "reject" then
    slurm.log_user("%s", elastic.reject_message(elastic.reject_text(outcome, lines), "job_submit"))
    return slurm.ESLURM_INVALID_GRES or elastic.REJECT_CODE
  elseif outcome.kind ~= "skip" then
    applied, why = elastic.apply_job_desc(job_desc, desc, outcome, cfg.gres_prefix, parts)
  end
  if applied then   -- `why`: what the hook adds to the reason (a partition's MaxTime held the time limit), or nil
    local reason = why and outcome.reason .. "; " .. why or outcome.reason
    slurm.log_info("slurm_job_submit: elastic: uid %s: %s%s (%.1f ms) %s", tostring(uid), outcome.kind,
                   outcome.cached and ", cached" or "", ms, reason)
    slurm.user_msg(reason)
  else
    why = outcome.why or ("plan not applied: " .. why)
    slurm.log_info("slurm_job_submit: elastic: uid %s: prediction skipped (%.1f ms): %s", tostring(uid), ms, why)
    slurm.user_msg(elastic.skip_message(why))
  end
  return slurm.SUCCESS
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  if not loaded then return slurm.SUCCESS end
  local script = job_desc.script   -- slurmctld copies the script at each read of the field: read once
  if script == nil then return slurm.SUCCESS end
  local ok, rc = pcall(submit, job_desc, script, submit_uid, part_list)
  if ok then return rc end
  slurm.log_error("slurm_job_submit: elastic: uid %s: hook error: %s", tostring(submit_uid), tostring(rc))
  slurm.user_msg("elastic: prediction skipped (hook error, see slurmctld log); job submitted as written")
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
slurm.log_info("job_submit.lua: elastic-slurm hook initialized (%s)", loaded and cfg.predictor_url or "disabled")
return slurm.SUCCESS
