--[[
 cli_filter.lua (elastic-slurm): the job_submit hook's request and rewrite, from sbatch's side.

 For sites that keep network calls out of slurmctld. It runs inside sbatch as the submitting user, who
 can bypass it with their own SLURM_CONF, so it is a convenience: enforcement stays in job_submit.lua.
 The batch script is read from the path sbatch was given (scripts on stdin are not seen). The circuit
 breaker state lives in a small per-user file (each sbatch is a new process). See docs/hook.md.
]]
local dir = (debug.getinfo(1, "S").source:match("^@(.*/)") or "./")
local loaded, elastic = pcall(dofile, dir .. "elastic_common.lua")
local cfg
if loaded then
  local problem
  cfg, problem = elastic.read_config(dir .. "elastic.conf")
  if problem and slurm.log_error then slurm.log_error("cli_filter: elastic: %s", problem) end
end

local function is_sbatch()
  local f = io.open("/proc/self/comm", "r")
  local comm = f and f:read("*l")
  if f then f:close() end
  return comm == "sbatch"
end

local function script_of(options)
  if not is_sbatch() then return nil end
  local argv = options.argv
  local path = type(argv) == "table" and argv[1] or nil
  if options.wrap ~= nil or type(path) ~= "string" then return nil end
  local f = io.open(path, "r")
  if not f then return nil end
  local text = f:read(65536)
  f:close()
  return text
end

-- One breaker file per user and predictor URL, in $XDG_RUNTIME_DIR (private) when set, else cli_state_dir.
local function state_file(config)
  local f = io.open("/proc/self/status", "r")
  local status = f and f:read("*a") or ""
  if f then f:close() end
  local uid = status:match("\nUid:%s+(%d+)") or tostring(os.getenv("USER"))
  local url = tostring(config.predictor_url):gsub("^http://", ""):gsub("[^%w_.-]", "_")
  local dir = os.getenv("XDG_RUNTIME_DIR") or config.cli_state_dir
  return dir .. "/elastic-slurm-breaker." .. uid .. "." .. url
end

function slurm_cli_setup_defaults(options, early_pass)
  return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
  if not loaded then return slurm.SUCCESS end
  local lines = elastic.directive_lines(script_of(options))
  if #lines == 0 or elastic.is_helper(options["job-name"], options.comment, options.dependency, cfg.helper_marker) then
    return slurm.SUCCESS
  end
  local _, err = elastic.parse_lines(lines)
  if err then
    slurm.log_error("%s", elastic.reject_message(err.message, "cli_filter"))
    return slurm.ERROR
  end
  -- An elastic job survives a node's death (the launcher drops the node): without --no-kill slurmctld
  -- cancels the whole job. job_submit/lua 22.05 cannot set it (no kill_on_node_fail field); sbatch can.
  if options["no-kill"] ~= "set" then
    options["no-kill"] = "set"
    slurm.log_verbose("elastic: --no-kill set: a node failure shrinks the job instead of ending it")
  end
  local breaker = elastic.new_breaker(cfg.breaker_failures, cfg.breaker_open_s, state_file(cfg))
  local outcome = elastic.plan(cfg, breaker, elastic.request("cli_filter", lines, elastic.job_from_options(options, slurm.time_str2mins)))
  if outcome.kind == "reject" then
    slurm.log_error("%s", elastic.reject_message(elastic.reject_text(outcome, lines), "cli_filter"))
    return slurm.ERROR
  elseif outcome.kind == "skip" then
    slurm.log_info("%s", elastic.skip_message(outcome))
    return slurm.SUCCESS
  end
  if outcome.kind == "rewrite" then
    local applied, why = elastic.apply_cli_options(options, outcome)
    if not applied then
      slurm.log_info("%s", elastic.skip_message({ why = "plan not applied: " .. why }))
      return slurm.SUCCESS
    end
  end
  slurm.log_info("%s", outcome.reason)
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, job_id, step_id)
  return slurm.SUCCESS
end
