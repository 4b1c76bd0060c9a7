--[[
 cli_filter.lua (elastic-slurm): the job_submit hook's request and rewrite, from sbatch's side.

 For sites that keep network calls out of slurmctld. It runs inside sbatch as the submitting user, who
 can bypass it with their own SLURM_CONF, so it is a convenience: enforcement stays in job_submit.lua.
 The batch script is read from the path sbatch was given (scripts on stdin are not seen). The circuit
 breaker state lives in a small per-user file (each sbatch is a new process). See docs/hook.md.
 Its helpers are global functions, as in Slurm's example scripts (the unit tests call them).
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

-- The submitting user's uid (sbatch runs as that user), nil when /proc does not say.
local function my_uid()
  local f = io.open("/proc/self/status", "r")
  local status = f and f:read("*a") or ""
  if f then f:close() end
  return tonumber(status:match("\nUid:%s+(%d+)"))
end

-- One breaker file per user and predictor URL, in $XDG_RUNTIME_DIR (private) when set, else cli_state_dir:
-- "<failures> <open_until>". `write`: save the breaker `b` there, else load it.
local function state_file(config, uid)
  local url = tostring(config.predictor_url):gsub("^http://", ""):gsub("[^%w_.-]", "_")
  local dir = os.getenv("XDG_RUNTIME_DIR") or config.cli_state_dir
  return dir .. "/elastic-slurm-breaker." .. (uid or tostring(os.getenv("USER"))) .. "." .. url
end

local function breaker_file(b, path, write)
  local f = io.open(write and path .. ".tmp" or path, write and "w" or "r")
  if not f then return end
  if write then
    f:write(string.format("%d %.3f\n", b.failures, b.open_until))
    f:close()
    os.rename(path .. ".tmp", path)
    return
  end
  local failures, open_until = (f:read("*a") or ""):match("^(%d+) ([%d.]+)")
  f:close()
  b.failures, b.open_until = tonumber(failures) or 0, tonumber(open_until) or 0
end

local function option(options, name)
  local v = options[name]
  if v == nil or v == "" or v == "unset" then return nil end
  return tostring(v)
end

-- An sbatch GPU option as a TRES list: --gres `[gres:]name[:type][:count],...` entry by entry, --gpus and
-- --gpus-per-node `[type:]count` as the gpu entry; `prefix` the Slurm's spelling (elastic.conf's gres_prefix: what
-- job_submit.lua sees for the same options, gres: on 22.05, gres/ on 24.11), default gres:.
function option_tres(name, value, prefix)
  if value == nil then return nil end
  prefix = prefix or "gres:"
  if name ~= "gres" then return prefix .. "gpu:" .. value end
  local out = {}
  for entry in value:gmatch("[^,]+") do out[#out + 1] = entry:match("^gres[:/]") and entry or (prefix .. entry) end
  return table.concat(out, ",")
end

function job_from_options(options, time_str2mins, uid)
  local nodes = option(options, "nodes")
  local min_nodes, max_nodes
  if nodes then
    local lo, hi = nodes:match("^(%d+)%-?(%d*)$")
    min_nodes, max_nodes = tonumber(lo), tonumber(hi) or tonumber(lo)
  end
  local function positive(v)
    v = tonumber(v)
    if v and v >= 0 then return v end
    return nil
  end
  local time = option(options, "time")
  local switch = option(options, "switches")
  local prefix = cfg and cfg.gres_prefix
  return {
    user = os.getenv("USER"), uid = uid, partition = option(options, "partition"), name = option(options, "job-name"),
    min_nodes = min_nodes, max_nodes = max_nodes, ntasks_per_node = positive(option(options, "ntasks-per-node")),
    tres_per_node = option(options, "gpus-per-node") and option_tres("gpus-per-node", option(options, "gpus-per-node"),
      prefix) or option_tres("gres", option(options, "gres"), prefix),
    tres_per_job = option_tres("gpus", option(options, "gpus"), prefix),
    time_limit_min = time and time_str2mins and positive(elastic.num(time_str2mins(time))) or nil,
    req_switch = switch and tonumber(switch:match("^(%d+)")) or nil,
  }
end

-- Apply a rewrite reply to sbatch's options, by long option name. An option cannot be unset from Lua (an
-- empty --gres becomes "gres:", which sbatch rejects), so each GPU option the user gave is set to its
-- consistent value instead: --gpus to the total, --gres / --gpus-per-node to the per-node count.
function apply_cli_options(options, reply)
  local nodes, per_node, tasks = reply.nodes, reply.gpus_per_node, reply.tasks_per_node
  local per_task = option(options, "gpus-per-task")
  if per_task and (not tasks or per_node == 0 or per_node % tasks ~= 0) then
    return nil, elastic.per_task_split(per_node, tasks)
  end
  local partition = elastic.moved_to(option(options, "partition"), reply)
  local gres, new_gres, why = option(options, "gres"), nil, nil
  if gres then  -- computed before any option is set: a request of several GPU types is kept as written
    new_gres, why = elastic.set_gpu_tres(option_tres("gres", gres), per_node, partition and (reply.gpu or "") or nil)
    if not new_gres then return nil, "--gres: " .. why end
  end
  options["nodes"] = tostring(nodes)
  if partition then options["partition"] = partition end
  if reply.constraint then options["constraint"] = reply.constraint end
  if gres then options["gres"] = (new_gres:gsub("gres:", "")) end
  if option(options, "gpus-per-node") or not gres then options["gpus-per-node"] = tostring(per_node) end
  if option(options, "gpus") then options["gpus"] = tostring(nodes * per_node) end
  if per_task then options["gpus-per-task"] = tostring(per_node / tasks) end
  if tasks then
    options["ntasks-per-node"] = tostring(tasks)
    if option(options, "ntasks") then options["ntasks"] = tostring(nodes * tasks) end
  end
  if reply.switches then options["switches"] = tostring(reply.switches) end
  if reply.decision_id ~= nil then options["comment"] = elastic.comment_with(option(options, "comment"), reply.decision_id) end
  return true
end

function slurm_cli_setup_defaults(options, early_pass)
  return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
  if not loaded then return slurm.SUCCESS end
  local lines = elastic.directive_lines(script_of(options))
  if #lines == 0 or elastic.untouched(options["job-name"], options.comment, options.dependency, cfg.helper_marker) then
    return slurm.SUCCESS
  end
  -- An elastic job survives a node's death (the launcher drops the node): without --no-kill slurmctld
  -- cancels the whole job. job_submit/lua 22.05 cannot set it (no kill_on_node_fail field); sbatch can.
  -- (A malformed #ELASTIC line is the service's 422, which rejects the job: the option goes with it.)
  if options["no-kill"] ~= "set" then
    options["no-kill"] = "set"
    slurm.log_verbose("elastic: --no-kill set: a node failure shrinks the job instead of ending it")
  end
  local uid = my_uid()
  local path = state_file(cfg, uid)
  local breaker = elastic.new_breaker(cfg.breaker_failures, cfg.breaker_open_s)
  breaker_file(breaker, path)
  local before = breaker.failures .. " " .. breaker.open_until
  local test_only = options["test-only"] == "set"   -- no job follows: the service stores nothing
  local outcome = elastic.plan(cfg, breaker, "cli_filter", lines, job_from_options(options, slurm.time_str2mins, uid),
                               nil, nil, nil, test_only)
  if breaker.failures .. " " .. breaker.open_until ~= before then breaker_file(breaker, path, true) end
  if outcome.kind == "reject" then
    slurm.log_error("%s", elastic.reject_message(elastic.reject_text(outcome, lines), "cli_filter"))
    return slurm.ERROR
  end
  local applied, why = outcome.kind ~= "skip", outcome.why
  if outcome.kind == "rewrite" then
    applied, why = apply_cli_options(options, outcome)
    why = why and "plan not applied: " .. why
  end
  if test_only then   -- job_submit cannot tell a test: planned here, it plans no more; else it plans storing nothing
    local comment = option(options, "comment")
    options["comment"] = applied and elastic.comment_with(comment, "test-only")
      or (comment and comment .. " " or "") .. elastic.TEST_ONLY
  end
  slurm.log_info("%s", applied and outcome.reason or elastic.skip_message(why))
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, job_id, step_id)
  return slurm.SUCCESS
end
