--[[
 elastic_common.lua: what job_submit.lua and cli_filter.lua share (elastic-slurm, docs/hook.md).

 Transport and apply: the service decides (POST /v1/plan); this parses the #ELASTIC lines (to reject bad
 ones while the service is down), calls it under one budget with a breaker, caches its decisions (and its
 bands), and validates and applies a decision from any source. Every failure is kind = "skip": the callers
 fail open. Loaded with dofile() from the calling script's directory; all state in the returned table M.
]]
local M = {}

local socket = require("socket")
local cjson = require("cjson.safe")

local PREFIX, HELPER_MARKER = "#ELASTIC", "elastic-helper"
local NO_VAL, NO_VAL16, INFINITE = 4294967294, 65534, 4294967295
M.REJECT_CODE = 2072 -- ESLURM_INVALID_GRES: "Invalid generic resource (gres) specification"
-- Slurm 22.05 always prints its own line after our rejection; ours names it as a consequence, not a --gres problem.
local SLURM_REJECT_LINE = { job_submit = "Invalid generic resource (gres) specification",
                            cli_filter = "cli_filter plugin terminated with error" }

function M.reject_message(message, source)
  return string.format('elastic: %s; job rejected: Slurm\'s next line ("%s") is this rejection', message,
                       SLURM_REJECT_LINE[source])
end

-- The clock of the breaker and the cache (seconds); tests step their own. HTTP budgets use socket.gettime.
M.now = socket.gettime

-- ---------------------------------------------------------------- config
-- A reply is read only up to this size (#24.5: a 9 MB reply cost 375-616 ms of Lua in slurmctld).
local MAX_REPLY_BYTES, MAX_BANDS = 512 * 1024, 64

local DEFAULTS = {
  predictor_url = "http://127.0.0.1:8470",   -- elastic-predictor serve's default --port
  budget_ms = 100,
  breaker_failures = 3,
  breaker_open_s = 30,
  helper_marker = HELPER_MARKER,
  cli_state_dir = "/tmp",
  cache_entries = 1024,
}

function M.read_config(path)
  local cfg = {}
  for k, v in pairs(DEFAULTS) do cfg[k] = v end
  local f = path and io.open(path, "r")
  if not f then return cfg, "cannot read " .. tostring(path) .. ": defaults used" end
  local problems, number = {}, 0
  for raw in f:lines() do
    number = number + 1
    local key, value = raw:match("^%s*([%w_]+)%s*=%s*(.-)%s*$")
    if key and DEFAULTS[key] ~= nil then
      if type(DEFAULTS[key]) == "number" and tonumber(value) == nil then
        problems[#problems + 1] = string.format("%s:%d: %s: expected a number, got %q; default %s used",
                                                path, number, key, value, tostring(DEFAULTS[key]))
        value = DEFAULTS[key]
      elseif type(DEFAULTS[key]) == "number" then
        value = tonumber(value)
      end
      cfg[key] = value
    end
  end
  f:close()
  return cfg, (#problems > 0 and table.concat(problems, "; ") or nil)
end

-- ---------------------------------------------------------------- directives
-- Python's repr() of a str, for messages identical to slurm_plugin/directives.py.
local function py_repr(s)
  local quote = "'"
  if s:find("'", 1, true) and not s:find('"', 1, true) then quote = '"' end
  local out = s:gsub("[%c\\'\"]", function(c)
    if c == "\\" then return "\\\\" end
    if c == quote then return "\\" .. c end
    if c == "'" or c == '"' then return c end
    if c == "\n" then return "\\n" elseif c == "\r" then return "\\r" elseif c == "\t" then return "\\t" end
    return string.format("\\x%02x", c:byte())
  end)
  return quote .. out .. quote
end

-- Lines of the directive block only: stops at the first line that is neither blank nor a comment, so a
-- large script costs no more than its header. Line ends: \n, \r\n or \r (as Python's splitlines).
-- None in the script `sbatch --wrap` writes: sbatch reads no #SBATCH line there (directives.py WRAP_HEADER).
local WRAP_HEADER = "#!/bin/sh\n# This script was created by sbatch --wrap.\n"
function M.directive_lines(script)
  local found = {}
  if type(script) ~= "string" or script:sub(1, #WRAP_HEADER) == WRAP_HEADER then return found end
  local pos, number, size = 1, 0, #script
  while pos <= size do
    local s, e = script:find("[\r\n]", pos)
    local line
    if s then
      line = script:sub(pos, s - 1)
      if script:sub(s, s + 1) == "\r\n" then e = s + 1 end
    else
      line, e = script:sub(pos), size
    end
    number = number + 1
    pos = e + 1
    if line:find("%S") and line:sub(1, 1) ~= "#" then break end
    local head = line:sub(1, #PREFIX + 1)
    if line == PREFIX or head == PREFIX .. " " or head == PREFIX .. "\t" then
      found[#found + 1] = { no = number, line = line }
    end
  end
  return found
end

local function int_in(lo, hi)
  return function(value)
    if not value:match("^[0-9]+$") then return nil, "expected an integer, got " .. py_repr(value) end
    local number = tonumber(value)
    if number < lo or number > hi then
      return nil, (value:gsub("^0+(%d)", "%1")) .. " is outside " .. lo .. ".." .. hi
    end
    return number
  end
end

local function choice(...)
  local options = { ... }
  return function(value)
    for _, o in ipairs(options) do if o == value then return value end end
    return nil, "expected one of " .. table.concat(options, "|") .. ", got " .. py_repr(value)
  end
end

local function matching(pattern, max, what)
  return function(value)
    if #value < 1 or #value > max or not value:match(pattern) then
      return nil, py_repr(value) .. " is not a valid " .. what
    end
    return value
  end
end

local function gpus(value)
  local parts = {}
  for part in (value .. "-"):gmatch("([^-]*)-") do parts[#parts + 1] = part end
  if #parts > 2 then return nil, "expected N or MIN-MAX, got " .. py_repr(value) end
  local count = int_in(1, 4096)
  local low, err = count(parts[1])
  if not low then return nil, err end
  local high, err2 = count(parts[#parts])
  if not high then return nil, err2 end
  if low > high then return nil, "minimum " .. low .. " is above maximum " .. high end
  return { min = low, max = high }
end

local function fraction(value)
  if not (value:match("^[0-9]+$") or value:match("^[0-9]+%.[0-9]+$") or value:match("^%.[0-9]+$")) then
    return nil, "expected a decimal in [0, 1], got " .. py_repr(value)
  end
  local number = tonumber(value)
  if number < 0 or number > 1 then return nil, value .. " is outside [0, 1]" end
  return number
end

local KEYS = {
  model = matching("^[A-Za-z0-9_.:/+-]+$", 128, "model name"),
  gpus = gpus,
  per_gpu_batch = int_in(1, 65536),
  max_global_batch = int_in(1, 16777216),
  min_efficiency = fraction,
  gpu_type = matching("^[A-Za-z0-9_.-]+$", 64, "GPU type"),
  objective = choice("throughput", "efficiency", "cost"),
  elastic = choice("on", "off"),
  batch_policy = choice("grow_global", "keep_global"),
  lr_scaling = choice("linear", "sqrt", "none"),
}
local KNOWN = {}
for k in pairs(KEYS) do KNOWN[#KNOWN + 1] = k end
table.sort(KNOWN)
local KNOWN_TEXT = table.concat(KNOWN, ", ")

local function directive_error(number, line, reason)
  return nil, { line_no = number, line = line, reason = reason,
                message = "line " .. number .. ": " .. reason .. ": " .. py_repr(line) }
end

-- Returns the typed values, or nil and an error table (message names the line, quotes it).
function M.parse_lines(lines)
  local result = {}
  local where = {} -- key -> the entry that gave it (for errors across keys)
  for _, entry in ipairs(lines) do
    local number, line = entry.no, entry.line
    local tokens = {}
    for token in line:sub(#PREFIX + 1):gmatch("%S+") do tokens[#tokens + 1] = token end
    if #tokens == 0 or tokens[1]:sub(1, 1) == "#" then
      return directive_error(number, line, "no key=value after #ELASTIC")
    end
    for _, token in ipairs(tokens) do
      if token:sub(1, 1) == "#" then break end
      local eq = token:find("=", 1, true)
      local key = eq and token:sub(1, eq - 1) or ""
      local value = eq and token:sub(eq + 1) or ""
      if key == "" or value == "" then
        return directive_error(number, line, "expected key=value, got " .. py_repr(token))
      end
      if not KEYS[key] then
        return directive_error(number, line, "unknown key " .. py_repr(key) .. " (known: " .. KNOWN_TEXT .. ")")
      end
      if result[key] ~= nil then
        return directive_error(number, line, "key " .. py_repr(key) .. " given twice")
      end
      local typed, err = KEYS[key](value)
      if typed == nil then return directive_error(number, line, key .. ": " .. err) end
      result[key] = typed
      where[key] = entry
    end
  end
  local cap, batch, gpus = result.max_global_batch, result.per_gpu_batch, result.gpus
  if cap ~= nil and batch ~= nil and gpus ~= nil and cap < batch * gpus.min then
    local e = where.max_global_batch
    return directive_error(e.no, e.line, string.format(
      "max_global_batch %d is below per_gpu_batch %d x gpus min %d = %d: no allowed size fits",
      cap, batch, gpus.min, batch * gpus.min))
  end
  return result
end

-- True for jobs the hook must never touch: launcher helpers and expand: allocations.
function M.is_helper(name, comment, dependency, marker)
  marker = marker or HELPER_MARKER
  if type(dependency) == "string" and dependency:find("expand:", 1, true) then return true end
  if type(name) == "string" and name:sub(1, #marker) == marker then return true end
  if type(comment) == "string" and comment:sub(1, #marker + 1) == marker .. ":" then return true end
  return false
end

-- ---------------------------------------------------------------- HTTP
-- Name resolution is not bounded by a socket timeout: each host is resolved once per Lua state (slurmctld
-- keeps it until the script is reloaded) and the address is connected to afterwards.
local resolved = {}

-- POST `body` to `url`; every step (connect, send, each receive) gets only what is left of `budget_s`.
-- Returns status, body_text; or nil, error string ("timeout", "connection refused", ...).
function M.post_json(url, body, budget_s)
  local deadline = socket.gettime() + budget_s
  local host, port, path = tostring(url):match("^http://([^/:]+):?(%d*)(/?.*)$")
  if not host then return nil, "bad predictor_url " .. tostring(url) end
  port, path = tonumber(port) or 80, path:gsub("/+$", "")
  local sock = socket.tcp()
  if not sock then return nil, "no socket" end
  local function fail(err) sock:close(); return nil, err end
  local function left()   -- false when the budget is spent, else the socket's timeout is what is left of it
    local r = deadline - socket.gettime()
    if r > 0 then sock:settimeout(r, "t") end
    return r > 0
  end
  local function step(method, arg, arg2)   -- sock:method(...) within what is left of the budget
    if not left() then return nil, "timeout" end
    return sock[method](sock, arg, arg2)
  end
  local ip = host:match("^%d+%.%d+%.%d+%.%d+$")
  if not ip then resolved[host] = resolved[host] or socket.dns.toip(host); ip = resolved[host] end
  if not ip then return fail("cannot resolve " .. host) end
  local ok, err = step("connect", ip, port)
  if not ok then return fail(err) end
  ok, err = step("send", "POST " .. (path ~= "" and path or "/") .. " HTTP/1.0\r\nHost: " .. host .. ":" .. port ..
    "\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " .. #body .. "\r\n\r\n" .. body)
  if not ok then return fail(err) end
  local status_line, err2 = step("receive", "*l")
  if not status_line then return fail(err2) end
  local status = tonumber(status_line:match("^HTTP/%d%.%d (%d%d%d)"))
  if not status then return fail("bad status line") end
  local length
  while true do
    local header, err3 = step("receive", "*l")
    if not header then return fail(err3) end
    if header == "" then break end
    local n = header:lower():match("^content%-length:%s*(%d+)")
    if n then length = tonumber(n) end
  end
  if not left() then return fail("timeout") end
  if length and length > MAX_REPLY_BYTES then
    return fail(string.format("reply of %d bytes, more than %d", length, MAX_REPLY_BYTES))
  end
  local text, err4, partial
  if length then
    text, err4, partial = sock:receive(length)
  else  -- no length: read at most one byte past the limit
    text, err4, partial = sock:receive(MAX_REPLY_BYTES + 1)
    if not text and err4 == "closed" then text = partial end
    if text and #text > MAX_REPLY_BYTES then return fail("reply larger than " .. MAX_REPLY_BYTES .. " bytes") end
  end
  if not text then return fail(err4 == "closed" and "truncated body" or err4) end
  sock:close()
  return status, text
end

-- ---------------------------------------------------------------- circuit breaker
-- After `k` failures in a row (a timeout is one failure, like any other) the breaker opens for `open_s`
-- seconds: calls are skipped. One slow answer on a loaded host (170 ms against a 100 ms budget) is not a hung
-- service and must not turn the next `open_s` of submissions away unplanned (issue #26.3); a hung service
-- times out every call, so it opens the breaker after k budgets (slurmctld runs the calls one at a time).
-- The next call after `open_s` is a trial; a failure reopens it at once, a success closes it.
function M.new_breaker(k, open_s)
  local b = { k = tonumber(k) or DEFAULTS.breaker_failures, open_s = tonumber(open_s) or DEFAULTS.breaker_open_s,
              failures = 0, open_until = 0 }
  function b.is_open(now) return b.open_until > now, b.open_until - now end
  function b.success() b.failures, b.open_until = 0, 0 end
  function b.failure(now)
    b.failures = b.failures + 1
    if b.failures >= b.k then b.open_until = now + b.open_s end
  end
  return b
end

-- ---------------------------------------------------------------- decision cache
-- A reply is kept for the `cache_ttl_s` it came with (absent or 0: not kept), keyed by exactly the request
-- fields a decision depends on; failures never (the breaker handles those). A reply's `bands` (its decision for
-- every other min_efficiency, docs/plan-contract.md) are kept under the key with that value masked. When full,
-- the cache is emptied (no LRU on the hot path). Reuses are counted per decision id and sent as `reused`.
local KEY_FIELDS = { "user", "partition", "min_nodes", "max_nodes", "ntasks_per_node", "tres_per_node",
                     "tres_per_job", "time_limit_min", "req_switch", "account", "qos" }
local MAX_TTL_S = 3600

-- Every part length-prefixed (a directive line cannot forge a separator), nil distinct from any value; the job
-- name and uid are left out. `masked`: each min_efficiency=<v> token reads min_efficiency=* (the bands' key).
function M.cache_key(request, masked)
  local parts = { (masked and "bands " or "") .. (request.source or ""), tostring(#request.directives) }
  for _, line in ipairs(request.directives) do
    parts[#parts + 1] = masked and line:gsub("(%s)min_efficiency=%S+", "%1min_efficiency=*") or line
  end
  local job = request.job or {}
  for _, field in ipairs(KEY_FIELDS) do
    local v = job[field]
    parts[#parts + 1] = v == nil and "\0" or (type(v) == "number" and string.format("%.17g", v) or tostring(v))
  end
  for i, part in ipairs(parts) do parts[i] = #part .. ":" .. part end
  return table.concat(parts)
end

function M.new_cache(max_entries)
  local c = { max = tonumber(max_entries) or DEFAULTS.cache_entries, entries = {}, size = 0, reused = {},
              reused_ids = 0 }
  function c.get(key, now)
    local e = c.entries[key]
    if e == nil then return nil end
    if e.expires > now then return e.reply end
    c.entries[key], c.size = nil, c.size - 1
    return nil
  end
  function c.put(key, reply, ttl_s, now)
    ttl_s = tonumber(ttl_s)
    if c.max < 1 or not ttl_s or ttl_s <= 0 or reply.decision_id == nil then return false end
    if c.entries[key] == nil then
      if c.size >= c.max then c.entries, c.size = {}, 0 end
      c.size = c.size + 1
    end
    c.entries[key] = { reply = reply, expires = now + math.min(ttl_s, MAX_TTL_S) }
    return true
  end
  function c.note_reuse(decision_id)
    if c.reused[decision_id] == nil then
      if c.reused_ids >= math.min(c.max, 4096) then return end  -- the service takes up to 4096 ids
      c.reused_ids = c.reused_ids + 1
    end
    c.reused[decision_id] = (c.reused[decision_id] or 0) + 1
  end
  -- The counts for the next request (nil when none); `restore` puts them back after a failure.
  function c.take_reused()
    if c.reused_ids == 0 then return nil end
    local taken = c.reused
    c.reused, c.reused_ids = {}, 0
    return taken
  end
  function c.restore(taken)
    for id, n in pairs(taken or {}) do
      if c.reused[id] == nil then c.reused_ids = c.reused_ids + 1 end
      c.reused[id] = (c.reused[id] or 0) + n
    end
  end
  return c
end

-- ---------------------------------------------------------------- TRES / GRES strings
-- The one reader of GPU entries in a comma-separated TRES/GRES list here, as slurm_plugin.client.gpu_tres reads
-- them (both checked against tests/vectors/tres.json): `[gres:|gres/]gpu[:type][:count|=count]`, count 1 when
-- absent, a `(IDX:..)` suffix ignored. Returns the gpu entries ({type, count, kv}) and the other entries.
local function valid_type(t) return t ~= "" and t:match("^[%w_.%-]+$") ~= nil end

local function gpu_item(item)
  local body = item:gsub("%(.*$", ""):match("^%s*(.-)%s*$")
  body = body:match("^gres[:/](.*)$") or body
  local rest = body:match("^gpu(.*)$")
  if rest == nil or not (rest == "" or rest:match("^[:=]")) then return nil end
  if rest == "" then return { count = 1 } end
  local n = rest:match("^=(%d+)$")
  if n then return { count = tonumber(n), kv = true } end
  local head, sep, count = rest:sub(2):match("^([^=]*)(=)(.*)$")
  if not sep then head, sep, count = rest:sub(2):match("^([^:]*)(:)(.*)$") end
  if sep then
    if valid_type(head) and count:match("^%d+$") then return { type = head, count = tonumber(count), kv = sep == "=" } end
    return nil
  end
  head = rest:sub(2)
  if head:match("^%d+$") then return { count = tonumber(head) } end
  if valid_type(head) and not head:match("^%d") then return { type = head, count = 1 } end
  return nil
end

local function tres_entries(list)
  local gpus, others, depth, cur = {}, {}, 0, ""
  local function flush()
    local item = cur:match("^%s*(.-)%s*$")
    if item ~= "" then
      local e = gpu_item(item)
      if e then gpus[#gpus + 1] = e else others[#others + 1] = item end
    end
    cur = ""
  end
  for ch in tostring(list or ""):gmatch(".") do
    if ch == "," and depth == 0 then flush() else
      if ch == "[" or ch == "(" then depth = depth + 1 elseif ch == "]" or ch == ")" then depth = depth - 1 end
      cur = cur .. ch
    end
  end
  flush()
  return gpus, others
end

-- (GPU count or nil, GPU type or nil) of a TRES/GRES list: entries add up, except that in the accounting
-- form an untyped `gres/gpu=N` is the total of the typed `gres/gpu:T=N` beside it; the type is the one type
-- of the typed entries when no untyped request entry stands beside them.
local function gpu_tres(list)
  local gpus = tres_entries(list)
  if #gpus == 0 then return nil, nil end
  local has_total, untyped, types, ntypes, count = false, false, {}, 0, 0
  for _, e in ipairs(gpus) do
    if e.type == nil and e.kv then has_total = true end
    if e.type == nil and not e.kv then untyped = true end
    if e.type ~= nil and not types[e.type] then types[e.type], ntypes = true, ntypes + 1 end
  end
  for _, e in ipairs(gpus) do
    if not (has_total and e.kv and e.type ~= nil) then count = count + e.count end
  end
  local gpu_type = (ntypes == 1 and not untyped) and next(types) or nil
  return count, gpu_type
end
M.gpu_tres = gpu_tres

local function gpu_count(list) return (gpu_tres(list)) end

local function counted(n, word)  -- "1 GPU", "2 GPUs" (predictor.records.counted)
  return string.format("%d %s%s", n, word, n == 1 and "" or "s")
end

function M.per_task_split(per_node, tasks)   -- the reason --gpus-per-task refuses a layout
  return string.format("%s per node %s not split over %s (--gpus-per-task)", counted(per_node, "GPU"),
                       per_node == 1 and "does" or "do", tasks and counted(tasks, "task") or "the tasks")
end

-- ---------------------------------------------------------------- request / reply
local function num(v, unset)   -- nil for Slurm's unset sentinels
  if type(v) ~= "number" or v == unset or v == NO_VAL or v == INFINITE then return nil end
  return v
end
M.num = num

local function str(v)
  if type(v) ~= "string" or v == "" then return nil end
  return v
end

-- The text of a service's rejection as the user reads it: the service numbers the #ELASTIC lines it was sent
-- (field `directives[i]`, message `line i+1: ...`); the script's line number replaces that one, as the hook's
-- own directive errors, the launcher and `elastic-predictor plan` count lines. `lines`: M.directive_lines'.
function M.reject_text(outcome, lines)
  local index = type(outcome.field) == "string" and tonumber(outcome.field:match("^directives%[(%d+)%]$"))
  local entry = index and lines[index + 1]
  if not entry then return outcome.message end
  return "line " .. entry.no .. ": " .. (outcome.message:gsub("^line %d+: ", "", 1))
end

function M.request(source, lines, job)
  local raw = {}
  for i, entry in ipairs(lines) do raw[i] = entry.line end
  return { source = source, directives = raw, job = job }
end

function M.job_from_desc(job_desc, submit_uid)
  return {
    user = str(job_desc.user_name), uid = num(submit_uid), partition = str(job_desc.partition),
    name = str(job_desc.name), min_nodes = num(job_desc.min_nodes), max_nodes = num(job_desc.max_nodes),
    ntasks_per_node = num(job_desc.ntasks_per_node, NO_VAL16), tres_per_node = str(job_desc.tres_per_node),
    tres_per_job = str(job_desc.tres_per_job), time_limit_min = num(job_desc.time_limit),
    req_switch = num(job_desc.req_switch), account = str(job_desc.account), qos = str(job_desc.qos),
  }
end

local function is_count(v, lo)
  return type(v) == "number" and v == math.floor(v) and v >= lo and v < 1e6
end

local function one_line(s, max)
  s = tostring(s):gsub("[%c]+", " ")
  if #s > max then s = s:sub(1, max - 3) .. "..." end
  return s
end

local function validate(reply)
  if type(reply) ~= "table" then return "reply is not a JSON object" end
  for k, v in pairs(reply) do if v == cjson.null then reply[k] = nil end end
  if reply.action == "keep" then return nil end
  if reply.action ~= "rewrite" then return "unknown action " .. tostring(reply.action) end
  if not is_count(reply.nodes, 1) then return "bad nodes " .. tostring(reply.nodes) end
  if not is_count(reply.gpus_per_node, 0) then return "bad gpus_per_node " .. tostring(reply.gpus_per_node) end
  if reply.tasks_per_node ~= nil and not is_count(reply.tasks_per_node, 1) then return "bad tasks_per_node" end
  if reply.switches ~= nil and not is_count(reply.switches, 1) then return "bad switches" end
  if reply.partition ~= nil and (type(reply.partition) ~= "string" or not reply.partition:match("^[%w_.:+-]+$")
                                 or #reply.partition > 64) then
    return "bad partition " .. tostring(reply.partition)
  end
  if reply.constraint ~= nil and (type(reply.constraint) ~= "string" or #reply.constraint > 256
                                  or not reply.constraint:match("^%[[%w_-]+%*%d+[%w_*&-]*%]$")) then
    return "bad constraint " .. tostring(reply.constraint)
  end
  return nil
end

-- A decision's reason as the user reads it: one line, led by "elastic:".
local function reason_of(text, fallback)
  local r = one_line(type(text) == "string" and text or fallback, 400)
  return r:sub(1, 8) == "elastic:" and r or "elastic: " .. r
end

-- A bound as the service prints it in a reason (predictor.planner.shown_bound).
local function shown(v)
  local s = string.format("%g", v)
  return tonumber(s) == v and s or string.format("%.17g", v)
end

-- A reply's `bands` when each is an interval with a reason (nil otherwise); a band's decision is validated
-- when it is applied, like a fresh reply.
local function bands_of(reply)
  local bands = reply.bands
  if type(bands) ~= "table" or #bands == 0 or #bands > MAX_BANDS then return nil end
  for _, b in ipairs(bands) do
    if type(b) ~= "table" or type(b.above) ~= "number" or type(b.upto) ~= "number" or type(b.reason) ~= "string" then
      return nil
    end
  end
  return bands
end

-- The cached decision for `request`: an identical request's, else the band of its min_efficiency (`d`: the
-- parsed directives). A copy: its reason says it was reused.
local function cached(cache, request, d, now)
  local out, hit = {}, cache.get(M.cache_key(request), now)
  if hit then
    for k, v in pairs(hit) do out[k] = v end
    out.cached, out.reason = true, hit.reason .. " (cached)"
    return out
  end
  local v = d and d.min_efficiency
  hit = v and cache.get(M.cache_key(request, true), now)
  for _, band in ipairs(hit and hit.bands or {}) do
    if band.above < v and v <= band.upto then
      for k, value in pairs(band) do out[k] = value end
      if validate(out) then return nil end  -- a decision applied is a valid one, from any source
      out.kind, out.decision_id, out.cached = out.action, hit.decision_id, true
      out.reason = reason_of((band.reason:gsub("{min_efficiency}", shown(v)))) .. " (cached predictions)"
      return out
    end
  end
  return nil
end

-- Ask the service, unless `cache` (optional) holds a decision for this request. Never raises; every failure
-- is kind = "skip".
function M.plan(cfg, breaker, request, cache, d)
  local now = M.now()
  local hit = cache and cached(cache, request, d, now)
  if hit then
    cache.note_reuse(hit.decision_id)
    return hit
  end
  local open, left = breaker.is_open(now)
  if open then
    return { kind = "skip", why = string.format("predictor unavailable, retry in %d s", math.ceil(left)) }
  end
  local reused = cache and cache.take_reused()
  request.reused = reused
  local body, encode_err = cjson.encode(request)
  request.reused = nil
  if not body then
    if cache then cache.restore(reused) end
    return { kind = "skip", why = "cannot encode request: " .. tostring(encode_err) }
  end
  local status, text = M.post_json(cfg.predictor_url .. "/v1/plan", body, (tonumber(cfg.budget_ms) or 100) / 1000)
  -- Reuse counts are delivered with a 200, dropped by a 400 (refused again otherwise), kept after anything else.
  if cache and status ~= 200 and status ~= 400 then cache.restore(reused) end
  local why
  if not status then
    why = tostring(text)
  elseif status == 422 then
    breaker.success()
    local err = cjson.decode(text)
    local message = type(err) == "table" and type(err.error) == "string" and err.error or one_line(text, 300)
    return { kind = "reject", message = one_line(message, 600),
             field = type(err) == "table" and type(err.field) == "string" and err.field or nil }
  elseif status ~= 200 then
    why = "HTTP " .. status
  else
    local reply, err = cjson.decode(text)
    why = reply == nil and ("unreadable reply: " .. tostring(err)) or validate(reply)
    if not why then
      breaker.success()
      reply.kind, reply.reason = reply.action, reason_of(reply.reason, reply.action)
      if reply.decision_id ~= nil then reply.decision_id = one_line(reply.decision_id, 64):gsub("%s", "_") end
      local bands = d and d.min_efficiency ~= nil and bands_of(reply)
      reply.bands = nil
      if cache then
        cache.put(M.cache_key(request), reply, reply.cache_ttl_s, now)
        if bands then
          cache.put(M.cache_key(request, true), { bands = bands, decision_id = reply.decision_id }, reply.cache_ttl_s, now)
        end
      end
      return reply
    end
  end
  breaker.failure(M.now())
  local _, retry = breaker.is_open(M.now())
  if retry > 0 then why = why .. string.format("; not asking again for %d s", math.ceil(retry)) end
  return { kind = "skip", why = why }
end

function M.skip_message(outcome)
  return "elastic: prediction skipped (" .. outcome.why .. "); job submitted as written"
end

function M.comment_with(comment, decision_id)
  local tag = "elastic:decision=" .. tostring(decision_id)
  if type(comment) == "string" and comment ~= "" then return comment .. " " .. tag end
  return tag
end

-- True when cli_filter already planned this job (its decision id is in the comment).
function M.planned(comment)
  return type(comment) == "string" and comment:find("elastic:decision=", 1, true) ~= nil
end

-- Replace (or add) the gpu entries of a comma-separated TRES list by one canonical entry after the others,
-- `gres:gpu[:type]:count`, keeping the request's one GPU type (`gpu_tres`); count nil removes the gpu entries.
-- `gpu` (optional, a moved job's new GPU type): a type other than it is dropped, since the new partition's
-- nodes do not have it; an untyped request matches any type.
local function set_gpu_tres(list, count, gpu)
  local _, out = tres_entries(list)
  local _, gpu_type = gpu_tres(list)
  if gpu_type and gpu and gpu_type:lower() ~= tostring(gpu):lower() then gpu_type = nil end
  if count then
    out[#out + 1] = "gres:gpu:" .. (gpu_type and (gpu_type .. ":") or "") .. count
  end
  return table.concat(out, ",")
end
M.set_gpu_tres = set_gpu_tres

-- The partition a comparison of partitions (several named, or gpu_type=any; the reply lists `alternatives`)
-- moves the job to, nil when it stays where it is. A single partition's answer never moves the job: the
-- cluster model may name the default partition otherwise than Slurm.
function M.moved_to(asked, reply)
  if reply.alternatives == nil or reply.partition == nil or reply.partition == asked then return nil end
  return reply.partition
end

-- The new job_desc values for a rewrite reply, computed before anything is assigned; or nil and why the
-- reply cannot be applied consistently (the caller then keeps the job as written).
function M.rewrite_fields(job_desc, reply)
  local nodes, per_node, tasks = reply.nodes, reply.gpus_per_node, reply.tasks_per_node
  local f, env = { min_nodes = nodes, max_nodes = nodes }, {}
  f.partition = M.moved_to(str(job_desc.partition), reply)
  local new_type = f.partition and (reply.gpu or "") or nil   -- moved: a typed request keeps only this type
  local per_task = gpu_count(job_desc.tres_per_task)
  if per_task then
    if not tasks or per_node % tasks ~= 0 or per_node == 0 then
      return nil, M.per_task_split(per_node, tasks)
    end
    f.tres_per_task = set_gpu_tres(job_desc.tres_per_task, per_node / tasks, new_type)
    env.SLURM_GPUS_PER_TASK = tostring(per_node / tasks)
  end
  f.tres_per_node = set_gpu_tres(job_desc.tres_per_node, per_node > 0 and per_node or nil, new_type)
  if job_desc.tres_per_job ~= nil then f.tres_per_job = set_gpu_tres(job_desc.tres_per_job, nil) end
  local cpus_per_task = num(job_desc.cpus_per_task, NO_VAL16) or 1
  if tasks then
    f.ntasks_per_node = tasks
    env.SLURM_NTASKS_PER_NODE = tostring(tasks)
  end
  if num(job_desc.num_tasks) then
    -- a task count (-n, or derived by sbatch from --ntasks-per-node / --ntasks-per-gpu): follow the new layout
    if tasks then
      f.num_tasks = nodes * tasks
      env.SLURM_NTASKS, env.SLURM_NPROCS = tostring(f.num_tasks), tostring(f.num_tasks)
      if num(job_desc.min_cpus) then f.min_cpus = f.num_tasks * cpus_per_task end
    end
  elseif num(job_desc.min_cpus) then
    -- No task count: sbatch derived min_cpus from its node count; left stale (2 nodes -> 1 node x 1 task keeps
    -- 2) it is "Requested node configuration is not available". Derived again as sbatch would.
    f.min_cpus = nodes * (tasks or 1) * cpus_per_task
  end
  if reply.switches then f.req_switch = reply.switches end
  -- a mixed-type plan: counts of each type's nodes by node feature (`[h100*2&a100*2]`), replacing the job's own
  if reply.constraint then f.features = reply.constraint end
  if reply.decision_id ~= nil then f.comment = M.comment_with(job_desc.comment, reply.decision_id) end
  local changed = gpu_count(job_desc.tres_per_job) ~= nil or per_task ~= nil
    or gpu_count(job_desc.tres_per_node) ~= per_node
  if changed then
    env.SLURM_GPUS = tostring(nodes * per_node)
    env.SLURM_GPUS_PER_NODE = tostring(per_node)
  end
  return f, env, changed
end

-- Apply a rewrite reply to a job_desc. Returns true when the GPU request changed, or nil and why nothing was
-- changed. SLURM_GPUS / SLURM_GPUS_PER_NODE are always set (srun in the job would ask for sbatch's old
-- values), the other variables only when sbatch exported them (job_submit.lua cannot unset one).
function M.apply_job_desc(job_desc, reply)
  local fields, env, changed = M.rewrite_fields(job_desc, reply)
  if not fields then return nil, env end
  for key, value in pairs(fields) do job_desc[key] = value end
  local target = job_desc.script ~= nil and job_desc.environment or nil
  if target ~= nil then
    for key, value in pairs(env) do
      if target[key] ~= nil or key == "SLURM_GPUS" or key == "SLURM_GPUS_PER_NODE" then
        target[key] = value
      end
    end
  end
  return changed
end

return M
