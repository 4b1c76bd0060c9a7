-- elastic_common.lua (docs/hook.md): job_submit.lua's and cli_filter.lua's transport, validation and apply. The service
-- parses the #ELASTIC lines and decides (POST /v1/plan); the hook keeps its decisions and bands (a lookup, no policy).
local M = {}
local socket, cjson = require("socket"), require("cjson.safe")
local NO_VAL, NO_VAL16 = 4294967294, 65534   -- Slurm's "unset" (NO_VAL and above: INFINITE)
local MAX_REPLY_BYTES, MAX_BANDS, MAX_TTL_S = 512 * 1024, 64, 3600   -- a 9 MB reply cost 375-616 ms of Lua (#24.5)
local CLAIM_EVERY_S = 10   -- the hook reads slurmctld's jobs for claims at most this often (#42.6)
M.REJECT_CODE = 2072 -- ESLURM_INVALID_GRES; Slurm prints its text after ours, which names it as this rejection
local SLURM_REJECT_LINE = { job_submit = "Invalid generic resource (gres) specification",
                            cli_filter = "cli_filter plugin terminated with error" }
M.now = socket.gettime   -- the clock of the breaker and the cache (tests step their own); budgets use socket's
local DEFAULTS = { predictor_url = "http://127.0.0.1:8470", budget_ms = 100, breaker_failures = 3, breaker_open_s = 30,
                   helper_marker = "elastic-helper", cli_state_dir = "/tmp", cache_entries = 1024,
                   max_gpus_per_node = "",    -- debug=4,a100=8 (installer); cfg.gpus: {debug = 4, a100 = 8}
                   gres_prefix = "gres:" }    -- this Slurm's TRES spelling (installer): gres: 22.05, gres/ 24.11

-- elastic.conf (key = value); a numeric key whose value is not a number keeps its default and is reported.
function M.read_config(path)
  local cfg, problems, number = {}, {}, 0
  for k, v in pairs(DEFAULTS) do cfg[k] = v end
  local f = path and io.open(path, "r")
  if not f then return cfg, "cannot read " .. tostring(path) .. ": defaults used" end
  for raw in f:lines() do
    number = number + 1
    local key, value = raw:match("^%s*([%w_]+)%s*=%s*(.-)%s*$")
    local default = DEFAULTS[key or ""]
    if type(default) == "number" and not tonumber(value) then
      problems[#problems + 1] = string.format("%s:%d: %s: expected a number, got %q; default %s used",
                                              path, number, key, value, default)
    elseif default ~= nil then
      cfg[key] = type(default) == "number" and tonumber(value) or value
    end
  end
  f:close()
  cfg.gpus = {}
  for name, n in cfg.max_gpus_per_node:gmatch("([^%s,=]+)=(%d+)") do cfg.gpus[name] = tonumber(n) end
  return cfg, problems[1] and table.concat(problems, "; ") or nil
end

-- The #ELASTIC lines ({no, line}) of the directive block, as slurm_plugin/contracts/directives.py reads them and sbatch
-- reads #SBATCH: lines end at \n only (a lone \r ends none), the block ends at the first line whose first character
-- other than space, \t, \v, \f, \r is not `#`; none in the script of `sbatch --wrap`, where sbatch reads no #SBATCH line.
-- Only lines that end within the first MAX_HEADER_BYTES bytes, and the first MAX_HEADER_LINES lines, are read (issue
-- #41.11: a 2 MB header of comments cost 0.56 s of Lua under slurmctld's locks). The second value says where the scan
-- stopped at a cap ("line 1025", "byte 65536"), nil when it read the whole block.
local WRAP_HEADER = "#!/bin/sh\n# This script was created by sbatch --wrap.\n"
M.MAX_HEADER_BYTES, M.MAX_HEADER_LINES = 65536, 1024
function M.directive_lines(script)
  local found, pos, number = {}, 1, 0
  if type(script) ~= "string" or script:sub(1, #WRAP_HEADER) == WRAP_HEADER then return found end
  local head = #script > M.MAX_HEADER_BYTES and script:sub(1, M.MAX_HEADER_BYTES) or script
  while pos <= #head do
    if number == M.MAX_HEADER_LINES then return found, "line " .. (number + 1) end
    local s = head:find("\n", pos, true)
    local cut = not s and head ~= script and head:sub(pos)   -- a line the cap cuts: unread, unless it ends the block
    if cut then
      local first = cut:match("^[ \t\v\f\r]*(.?)")
      return found, (first == "" or first == "#") and "byte " .. M.MAX_HEADER_BYTES or nil
    end
    local line = head:sub(pos, (s or #head + 1) - 1)
    number, pos = number + 1, (s or #head) + 1
    local first = line:match("^[ \t\v\f\r]*(.?)")
    if first ~= "" and first ~= "#" then return found end
    if line == "#ELASTIC" or line:match("^#ELASTIC[ \t]") then found[#found + 1] = { no = number, line = line } end
  end
  return found, head ~= script and "byte " .. M.MAX_HEADER_BYTES or nil
end
-- Jobs never touched: launcher helpers, expand: allocations, jobs cli_filter planned (a decision id in the comment).
function M.untouched(name, comment, dependency, marker)
  return type(dependency) == "string" and dependency:find("expand:", 1, true) ~= nil
    or type(name) == "string" and name:sub(1, #marker) == marker
    or type(comment) == "string" and (comment:sub(1, #marker + 1) == marker .. ":"
                                      or comment:find("elastic:decision=", 1, true) ~= nil)
end

local resolved = {}   -- a name lookup has no socket timeout: once per host and Lua state, outside the budget
-- A request sent whose status line had not come by the budget: `poll()` (never waits) is true once the service has
-- answered it below 500, false once it answered 5xx or closed, nil while nothing came; `close()` drops it.
local function late_answer(sock, partial)
  local late = {}
  function late.poll()
    sock:settimeout(0)
    local line, err, part = sock:receive("*l", partial)
    if line then local status = tonumber(line:match("^HTTP/%d%.%d (%d%d%d)")); return status ~= nil and status < 500 end
    if err == "timeout" then partial = part; return nil end
    return false
  end
  function late.close() sock:close() end
  return late
end
-- POST `body` to `url`; each step (connect, send, every receive) gets only what is left of one budget, so a server
-- that drips a byte at a time cannot stretch it. Returns status, body; or nil, why ("timeout", ...) and, when the
-- budget ran out waiting for the status line of a request sent and `keep_late`, its late_answer (open, for the caller).
function M.post_json(url, body, budget_s, keep_late, extra_headers)
  local deadline = socket.gettime() + budget_s
  local host, port, path = tostring(url):match("^http://([^/:]+):?(%d*)(/?.*)$")
  if not host then return nil, "bad predictor_url " .. tostring(url) end
  local ip = host:match("^%d+%.%d+%.%d+%.%d+$")
  if not ip then resolved[host] = resolved[host] or socket.dns.toip(host); ip = resolved[host] end
  local sock = ip and socket.tcp()
  if not sock then return nil, ip and "no socket" or "cannot resolve " .. host end
  local function step(method, ...)
    local left = deadline - socket.gettime()
    if left <= 0 then return nil, "timeout" end
    sock:settimeout(left, "t")
    return sock[method](sock, ...)
  end
  local function fail(why) sock:close(); return nil, why end
  port, path = tonumber(port) or 80, path:gsub("/+$", "")
  local request = "POST " .. (path ~= "" and path or "/") .. " HTTP/1.0\r\nHost: " .. host .. ":" .. port
    .. "\r\nContent-Type: application/json\r\nConnection: close\r\n" .. (extra_headers or "") .. "Content-Length: "
    .. #body .. "\r\n\r\n" .. body
  local ok, err = step("connect", ip, port)
  if ok then ok, err = step("send", request) end
  local sent, partial = ok
  if ok then ok, err, partial = step("receive", "*l") end
  if not ok and keep_late and sent and err == "timeout" then return nil, err, late_answer(sock, partial) end
  if not ok then return fail(err) end
  local status, length, header = tonumber(ok:match("^HTTP/%d%.%d (%d%d%d)"))
  if not status then return fail("bad status line") end
  repeat
    header, err = step("receive", "*l")
    if not header then return fail(err) end
    length = tonumber(header:lower():match("^content%-length:%s*(%d+)")) or length
  until header == ""
  local long = (length or 0) > MAX_REPLY_BYTES and ("reply of %d bytes, more than %d"):format(length, MAX_REPLY_BYTES)
  if long then return fail(long) end
  local text, closed, partial = step("receive", length or MAX_REPLY_BYTES + 1)   -- no length: one byte past the limit
  if not length and closed == "closed" then text = partial end
  if text and #text > MAX_REPLY_BYTES then return fail("reply larger than " .. MAX_REPLY_BYTES .. " bytes") end
  if not text then return fail(closed == "closed" and "truncated body" or closed) end
  sock:close()
  return status, text
end
-- The service's failures are transport failures, 5xx and unusable 200s; a 4xx is the job's problem and counts for
-- nothing (#41.11: three scripts of one user opened it for everyone). After `k` failures in a row calls are skipped
-- for `open_s`; the next call is a trial: a failure reopens it, a success closes it. A timeout waiting for the answer
-- opens it at once (a hung service costs one budget a period, #41.11); `late` (post_json's, kept when `watch_late`:
-- job_submit's breaker lives as long as slurmctld's Lua state) closes it again as soon as that answer comes below 500,
-- so one slow answer costs only the submissions made before it came (#26.3).
function M.new_breaker(k, open_s, watch_late)
  local b = { k = k, open_s = open_s, failures = 0, open_until = 0, watch_late = watch_late }   -- read_config's
  local function drop_late() if b.late then b.late.close(); b.late = nil end end
  function b.success() drop_late(); b.failures, b.open_until = 0, 0 end
  function b.is_open(now)
    local answered = b.late and b.open_until > now and b.late.poll()
    if answered then b.success() elseif answered == false then drop_late() end
    return b.open_until > now, b.open_until - now
  end
  function b.failure(now) b.failures = b.failures + 1; if b.failures >= b.k then b.open_until = now + b.open_s end end
  function b.timeout(now, late)
    if not b.watch_late then return b.failure(now) end
    drop_late()
    b.failures, b.open_until, b.late = math.max(b.failures, b.k), now + b.open_s, late
  end
  return b
end
-- The request fields a decision depends on; `uid`: a user's own profile plans only that user's jobs (#24.6).
local KEY_FIELDS = { "uid", "user", "partition", "min_nodes", "max_nodes", "ntasks_per_node", "tres_per_node",
                     "tres_per_job", "time_limit_min", "req_switch", "account", "qos" }
-- The request's cache keys, built once a submission (JSON arrays: each part quoted, nil as false, distinct from any
-- value; integers exact): the exact key and, when exactly one min_efficiency=<v> token has v a decimal in [0, 1] as
-- directives.py reads it, the bands' key (that token as min_efficiency=*) and v: the service accepts it whenever it
-- accepted the request of the bands.
function M.cache_key(request)
  local job, values = request.job or {}, {}
  local lines, masked, fields = { request.source or "" }, { "bands", request.source or "" }, {}
  for i, line in ipairs(request.directives) do
    lines[i + 1], masked[i + 2] = line, line
    if line:find("min_efficiency=", 1, true) then
      for v in line:gmatch("%smin_efficiency=(%S+)") do values[#values + 1] = v end
      masked[i + 2] = line:gsub("(%s)min_efficiency=%S+", "%1min_efficiency=*")
    end
  end
  for i, field in ipairs(KEY_FIELDS) do
    local v = job[field]
    fields[i] = v == nil and false or v
  end
  fields = cjson.encode(fields)
  local v = #values == 1 and (values[1]:match("^%d+$") or values[1]:match("^%d+%.%d+$") or values[1]:match("^%.%d+$"))
  v = v and tonumber(v) <= 1 and tonumber(v)
  return cjson.encode(lines) .. fields, v and cjson.encode(masked) .. fields or nil, v or nil
end
-- Entries live for the `cache_ttl_s` they came with (absent or 0: not kept); a full cache is emptied (no LRU on the
-- hot path). Reuses are counted per decision id (up to the 4096 ids the service takes) and sent as `reused`.
function M.new_cache(max_entries)
  local c = { max = tonumber(max_entries) or DEFAULTS.cache_entries, entries = {}, size = 0, reused = {}, ids = 0 }
  function c.get(key, now)
    local e = c.entries[key]
    if e and e.expires <= now then c.entries[key], c.size, e = nil, c.size - 1, nil end
    return e and e.reply
  end
  function c.put(key, reply, ttl_s, now)
    ttl_s = tonumber(ttl_s)
    -- not (ttl_s > 0): NaN compares false with every bound (#41.7: a NaN TTL pinned a decision for 31 days)
    if c.max < 1 or not ttl_s or not (ttl_s > 0) or reply.decision_id == nil then return end
    if c.entries[key] == nil and c.size >= c.max then c.entries, c.size = {}, 0 end
    c.size = c.size + (c.entries[key] == nil and 1 or 0)
    c.entries[key] = { reply = reply, expires = now + math.min(ttl_s, MAX_TTL_S) }
  end
  function c.note_reuse(id)
    if c.reused[id] == nil and c.ids >= math.min(c.max, 4096) then return end
    c.ids, c.reused[id] = c.ids + (c.reused[id] and 0 or 1), (c.reused[id] or 0) + 1
  end
  -- #42.6: job_submit cannot tell `sbatch --test-only` (its job_desc is a job's), but slurmctld's jobs (`slurm.jobs`)
  -- show which of its decisions a job holds (`elastic:decision=<id>` in the comment). A kept decision is reused only
  -- once a job holds it, and the ids seen held go to the service (`X-Elastic-Claimed`), which expires the others.
  c.held, c.held_n, c.pending, c.claimed = {}, 0, {}, {}   -- c.last_job: the newest job id read (nil: none yet)
  function c.asked(id)   -- a decision the service stored unclaimed for this hook
    if c.pending[id] == nil and #c.pending_ids >= 4096 then c.pending, c.pending_ids = {}, {} end   -- bounded
    if c.pending[id] == nil then c.pending_ids[#c.pending_ids + 1] = id end
    c.pending[id] = true
  end
  c.pending_ids = {}
  -- slurmctld's jobs ("<job id>" -> record): reads the comments of jobs newer than the last one read, while a
  -- decision waits for its job, at most every CLAIM_EVERY_S unless `now_needed` (a kept answer to confirm); the
  -- first call reads none (the jobs before this hook was loaded hold none of its decisions). A read looks at every
  -- job id: about 3 ms for 10,000 jobs (lua5.1, tests/unit/test_lua_hook_cache.py)
  function c.see_jobs(jobs, now, now_needed)
    local first = c.last_job == nil
    if type(jobs) ~= "table" or (not first and next(c.pending) == nil) then return end
    if not first and not now_needed and now < (c.read_at or -math.huge) + CLAIM_EVERY_S then return end
    c.read_at = now
    local seen = c.last_job or -1
    local last = seen
    for key, job in pairs(jobs) do
      local id = tonumber(key)   -- Slurm 22.05 keys the table by the job id as a string
      if id and id > seen and first then
        if id > last then last = id end
      elseif id and id > seen then
        local held = type(job) ~= "nil" and tostring(job.comment or ""):match("elastic:decision=(d%-%d+)")
        if held then
          if c.pending[held] then c.pending[held], c.claimed[held] = nil, true end
          if c.held[held] == nil then
            if c.held_n >= 4096 then c.held, c.held_n = {}, 0 end   -- bounded: an old decision is asked again
            c.held[held], c.held_n = true, c.held_n + 1
          end
        end
        if id > last then last = id end
      end
    end
    c.last_job = last
  end
  function c.claims()   -- the header naming the decisions seen held since the last answer, or nil
    local ids = {}
    for id in pairs(c.claimed) do ids[#ids + 1] = id end
    table.sort(ids)
    return #ids > 0 and ("X-Elastic-Claimed: " .. table.concat(ids, " ") .. "\r\n") or nil
  end
  return c
end

-- The one TRES/GRES reader here, as slurm_plugin.contracts.tres (its _gpu_item states the grammar; vectors in
-- tests/vectors/tres.json): gpu entries ({type, count, kv}) `[gres:|gres/]gpu[:type][:count|=count]` (count 1 when
-- absent: a MIG profile `gpu:1g.10gb` is 1 GPU; `(IDX:..)` and ASCII whitespace ignored), the other entries, and the
-- first malformed gpu entry's error. Counts: ASCII digits up to 2^31-1; types: 1-64 of [A-Za-z0-9_.-].
local MAX_COUNT = 2147483647
local function count_of(text, item)
  local n = #text <= 10 and text:match("^%d+$") and tonumber(text)
  if n and n <= MAX_COUNT then return n end
  return nil, ("GPU entry %q: count %q is not a number in 0..%d"):format(item, text, MAX_COUNT)
end
local function type_of(text, item)
  if #text >= 1 and #text <= 64 and text:match("^[%w_.%-]+$") then return text end
  return nil, ("GPU entry %q: type %q is not 1-64 of A-Z a-z 0-9 _ . -"):format(item, text)
end
local function gpu_item(item)   -- entry, or nil (not a gpu entry), or false and why (malformed)
  local body = item:gsub("%(.*$", ""):match("^%s*(.-)%s*$")
  local rest = (body:match("^gres[:/](.*)$") or body):match("^gpu(.*)$")
  if rest == "" then return { count = 1 } end
  if rest == nil or not rest:match("^[:=]") then return nil end
  local function entry(gtype, terr, count, cerr, kv)
    if terr or cerr then return false, terr or cerr end
    return { type = gtype, count = count, kv = kv }
  end
  if rest:sub(1, 1) == "=" then
    local n, cerr = count_of(rest:sub(2), item)
    return entry(nil, nil, n, cerr, true)
  end
  rest = rest:sub(2)
  local head, count = rest:match("^([^=]*)=(.*)$")
  if head then
    local t, terr = type_of(head, item)
    local n, cerr = count_of(count, item)
    return entry(t, terr, n, cerr, true)
  end
  local fields = {}
  for f in (rest .. ":"):gmatch("([^:]*):") do fields[#fields + 1] = f end
  if #fields == 1 then
    if rest:match("^%d+$") then
      local n, cerr = count_of(rest, item)
      return entry(nil, nil, n, cerr)
    end
    local t, terr = type_of(rest, item)
    return entry(t, terr, 1)
  end
  if #fields == 2 then
    local t, terr = type_of(fields[1], item)
    local n, cerr = count_of(fields[2], item)
    return entry(t, terr, n, cerr)
  end
  return false, ("GPU entry %q: expected gpu[:type][:count], got %d fields after gpu"):format(item, #fields)
end
local parsed, n_parsed = {}, 0   -- list -> its entries: a rewrite reads each of its lists several times
local function tres_entries(list)   -- entries split at the commas outside () and [] (a `(IDX:..)` holds commas)
  local text = tostring(list or "")
  local known = parsed[text]
  if known then return known[1], known[2], known[3] end
  local gpus, others, err = {}, {}, nil
  local depth, start, pos = 0, 1, 1
  local function flush(item)
    item = item:match("^%s*(.-)%s*$")
    if item == "" then return end
    local e, why = gpu_item(item)
    if e then gpus[#gpus + 1] = e elseif e == false then err = err or why else others[#others + 1] = item end
  end
  while true do
    local at, _, ch = text:find("([,%[%]%(%)])", pos)
    if not at then break end
    if ch == "," then
      if depth == 0 then flush(text:sub(start, at - 1)); start = at + 1 end
    elseif ch == "[" or ch == "(" then depth = depth + 1 else depth = depth - 1 end
    pos = at + 1
  end
  flush(text:sub(start))
  if n_parsed >= 256 then parsed, n_parsed = {}, 0 end   -- bounded: the lists of a few recent jobs
  parsed[text], n_parsed = { gpus, others, err }, n_parsed + 1
  return gpus, others, err   -- shared with the next reader of this list: read only
end
-- (GPU count, GPU type) of a TRES/GRES list or nil: entries add up, but an accounting `gres/gpu=N` is the total of the
-- `gres/gpu:T=N` beside it; the type is the typed entries' one type when no untyped request entry stands beside them.
-- A malformed gpu entry: nil, nil, why.
function M.gpu_tres(list)
  local gpus, _, err = tres_entries(list)
  if err then return nil, nil, err end
  if #gpus == 0 then return nil, nil end
  local has_total, untyped, types, ntypes, count = false, false, {}, 0, 0
  for _, e in ipairs(gpus) do
    if e.type == nil then has_total, untyped = has_total or e.kv, untyped or not e.kv
    elseif not types[e.type] then types[e.type], ntypes = true, ntypes + 1 end
  end
  for _, e in ipairs(gpus) do count = count + ((has_total and e.kv and e.type) and 0 or e.count) end
  return count, (ntypes == 1 and not untyped) and next(types) or nil
end
-- The distinct GPU types a list names, sorted; nil and why for a malformed gpu entry.
function M.gpu_types(list)
  local gpus, _, err = tres_entries(list)
  if err then return nil, err end
  local seen, out = {}, {}
  for _, e in ipairs(gpus) do
    if e.type and not seen[e.type] then seen[e.type], out[#out + 1] = true, e.type end
  end
  table.sort(out)
  return out
end
local function gpu_count(list) return (M.gpu_tres(list)) end
function M.several_types(types)
  return ("several GPU types (%s): one count would lose them; kept as written"):format(table.concat(types, ", "))
end
-- The list with its gpu entries replaced by one `<prefix>gpu[:type]:count` after the others (count nil: removed),
-- keeping the request's one GPU type unless `gpu` (a moved job's new type) differs: the new nodes lack it.
-- `prefix`: `gres:` (the default) or `gres/`, the spelling of this Slurm (M.tres_prefix).
-- nil and why when the list has a malformed gpu entry or names several GPU types (one count would lose them).
function M.set_gpu_tres(list, count, gpu, prefix)
  local _, others, err = tres_entries(list)
  local out = {}
  for i, item in ipairs(others) do out[i] = item end
  local types = M.gpu_types(list)
  if err then return nil, err end
  if count and #types > 1 then
    return nil, M.several_types(types)
  end
  local _, gpu_type = M.gpu_tres(list)
  if gpu_type and gpu and gpu_type:lower() ~= tostring(gpu):lower() then gpu_type = nil end
  if count then out[#out + 1] = (prefix or "gres:") .. "gpu:" .. (gpu_type and (gpu_type .. ":") or "") .. count end
  return table.concat(out, ",")
end

local function num(v, unset) return type(v) == "number" and v < NO_VAL and v ~= unset and v or nil end  -- unset: nil
M.num = num
local function str(v) return type(v) == "string" and v ~= "" and v or nil end
local function one_line(s, n) s = tostring(s):gsub("[%c]+", " "); return #s > n and s:sub(1, n - 3) .. "..." or s end
-- The job_desc fields the hook reads, read once (each read of slurmctld's job_desc is a C call that walks its field
-- names, and the script is copied at each read): a plain table the rest reads instead.
local DESC_FIELDS = { "name", "comment", "dependency", "user_name", "partition", "min_nodes", "max_nodes", "qos",
                      "tres_per_node", "ntasks_per_node", "tres_per_job", "tres_per_task", "tres_per_socket",
                      "time_limit", "req_switch", "account", "cpus_per_task", "num_tasks", "min_cpus" }
function M.read_desc(job_desc)
  local d = {}
  for _, key in ipairs(DESC_FIELDS) do d[key] = job_desc[key] end
  return d
end
function M.job_from_desc(d, submit_uid)
  return { user = str(d.user_name), uid = num(submit_uid), partition = str(d.partition), name = str(d.name),
           min_nodes = num(d.min_nodes), max_nodes = num(d.max_nodes), tres_per_node = str(d.tres_per_node),
           ntasks_per_node = num(d.ntasks_per_node, NO_VAL16), tres_per_job = str(d.tres_per_job), qos = str(d.qos),
           time_limit_min = num(d.time_limit), req_switch = num(d.req_switch), account = str(d.account) }
end
local function is_count(v, lo) return type(v) == "number" and v == math.floor(v) and v >= lo and v < 1e6 end
local function named(v, max, pat) return v == nil or type(v) == "string" and #v <= max and v:match(pat) ~= nil end

-- Why a decision (a fresh reply or a kept band) cannot be applied; nil when it can.
local function invalid(r)
  if type(r) ~= "table" then return "reply is not a JSON object" end
  for k, v in pairs(r) do if v == cjson.null then r[k] = nil end end
  if r.action == "keep" then return nil end
  if r.action ~= "rewrite" then return "unknown action " .. tostring(r.action) end
  if not is_count(r.nodes, 1) then return "bad nodes " .. tostring(r.nodes) end
  if not is_count(r.gpus_per_node, 0) then return "bad gpus_per_node " .. tostring(r.gpus_per_node) end
  if r.tasks_per_node ~= nil and not is_count(r.tasks_per_node, 1) then return "bad tasks_per_node" end
  if r.switches ~= nil and not is_count(r.switches, 1) then return "bad switches" end
  if not named(r.partition, 64, "^[%w_.:+-]+$") then return "bad partition " .. tostring(r.partition) end
  local c = r.constraint
  if not named(c, 256, "^%[[%w_-]+%*%d+[%w_*&-]*%]$") then return "bad constraint " .. tostring(c) end
  local t = r.time_limit_min
  if t ~= nil and not (type(t) == "number" and t == math.floor(t) and t >= 1 and t < NO_VAL) then
    return "bad time_limit_min " .. tostring(t)
  end
end
local function reason_of(text, fallback)   -- one line, led by "elastic:"
  local r = one_line(type(text) == "string" and text or fallback, 400)
  return r:sub(1, 8) == "elastic:" and r or "elastic: " .. r
end
-- The band (an interval with a reason) of `kept` bands that holds min_efficiency `v`, as a decision validated like
-- a fresh reply, its reason with `v` as the service prints bounds (planner.shown_bound); nil when none is valid.
local function band_decision(kept, v)
  for _, b in ipairs(kept and kept.bands or {}) do
    if type(b) == "table" and type(b.above) == "number" and type(b.upto) == "number" and type(b.reason) == "string"
       and b.above < v and v <= b.upto then
      local out, shown = {}, string.format("%g", v)
      for k, value in pairs(b) do out[k] = value end
      if invalid(out) then return nil end
      shown = tonumber(shown) == v and shown or string.format("%.17g", v)
      out.kind, out.decision_id, out.cached = out.action, kept.decision_id, true
      out.reason = reason_of((b.reason:gsub("{min_efficiency}", shown))) .. " (cached predictions)"
      return out
    end
  end
end

-- Ask the service about `lines` (M.directive_lines') and `job`, unless `cache` (optional) holds a decision for it that
-- fits `parts` (part_list; nil: unchecked). Never raises: a 422 is kind = "reject", any failure (misfit too) "skip".
-- `test_only`: `sbatch --test-only` (no job follows): the service stores nothing, and no cache is read or written.
function M.plan(cfg, breaker, source, lines, job, cache, parts, spent_s, test_only)
  local function outside(r) return parts and M.outside(r, job.partition, parts, cfg.gpus) end
  local request, now, key, masked, v = { source = source, directives = {}, job = job }, M.now()
  if test_only then request.test_only, cache = true, nil end
  for i, entry in ipairs(lines) do request.directives[i] = entry.line end
  if cache then
    local jobs = source == "job_submit" and type(slurm) == "table" and slurm.jobs or nil
    cache.see_jobs(jobs, now)
    key, masked, v = M.cache_key(request)
    local hit = cache.get(key, now) or masked and band_decision(cache.get(masked, now), v)
    -- a decision no job holds (it answered a `--test-only`, or its job was refused) is not reused: asked again
    if hit and jobs and not cache.held[hit.decision_id] then cache.see_jobs(jobs, now, true) end
    if hit and source == "job_submit" and not cache.held[hit.decision_id] then hit = nil end
    if hit and not outside(hit) then cache.note_reuse(hit.decision_id); return hit end
  end
  local open, left = breaker.is_open(now)
  if open then return { kind = "skip", why = ("predictor unavailable, retry in %d s"):format(math.ceil(left)) } end
  request.reused = cache and cache.ids > 0 and cache.reused or nil
  local body, why = cjson.encode(request)
  if not body then return { kind = "skip", why = "cannot encode request: " .. tostring(why) } end
  local budget_s = (tonumber(cfg.budget_ms) or 100) / 1000 - (spent_s or 0)
  local status, text, late = M.post_json(cfg.predictor_url .. "/v1/plan", body, budget_s, breaker.watch_late,
                                         cache and cache.claims())
  -- reuse counts and claims are delivered by a 200, dropped by a 400 (refused again otherwise), kept after anything
  if cache and (status == 200 or status == 400) then cache.reused, cache.ids, cache.claimed = {}, 0, {} end
  local reply
  if status == 422 then
    local err = cjson.decode(text); err = type(err) == "table" and err or {}
    return { kind = "reject", field = type(err.field) == "string" and err.field or nil,
             message = one_line(type(err.error) == "string" and err.error or one_line(text, 300), 600) }
  elseif status == 200 then
    reply, why = cjson.decode(text)
    why = reply == nil and ("unreadable reply: " .. tostring(why)) or invalid(reply)
    local misfit = not why and outside(reply)   -- a decision this job's partitions cannot hold: the job's problem
    if misfit then return { kind = "skip", why = misfit } end
  elseif status and status < 500 then   -- the job's problem (a 400: e.g. its directive block), not the service's
    local err = cjson.decode(text)
    err = type(err) == "table" and type(err.error) == "string" and ": " .. one_line(err.error, 300) or ""
    return { kind = "skip", why = "HTTP " .. status .. err }
  else
    why = status and ("HTTP " .. status) or tostring(text)
  end
  if why == "timeout" then
    breaker.timeout(M.now(), late)
  elseif why then
    breaker.failure(M.now())
  end
  if why then
    local _, retry = breaker.is_open(M.now())
    if retry > 0 then why = why .. string.format("; not asking again for %d s", math.ceil(retry)) end
    return { kind = "skip", why = why }
  end
  breaker.success()
  reply.kind, reply.reason = reply.action, reason_of(reply.reason, reply.action)
  if reply.decision_id ~= nil then reply.decision_id = one_line(reply.decision_id, 64):gsub("%s", "_") end
  if cache and reply.decision_id ~= nil and source == "job_submit" then cache.asked(reply.decision_id) end
  local bands = masked and type(reply.bands) == "table" and #reply.bands <= MAX_BANDS and reply.bands
  reply.bands = nil
  if cache then   -- kept as it is reused: marked cached, its reason saying so
    local kept = { cached = true, reason = reply.reason .. " (cached)" }
    for k, value in pairs(reply) do kept[k] = kept[k] or value end
    cache.put(key, kept, reply.cache_ttl_s, now)
    if bands then cache.put(masked, { bands = bands, decision_id = reply.decision_id }, reply.cache_ttl_s, now) end
  end
  return reply
end

function M.reject_message(message, source)   -- Slurm's next line is this rejection, not a --gres problem
  return string.format('elastic: %s; job rejected: Slurm\'s next line ("%s") is this rejection', message,
                       SLURM_REJECT_LINE[source])
end
-- A 422 as the user reads it: the script's line number in place of the service's (it counts the lines it was sent).
function M.reject_text(outcome, lines)
  local index = type(outcome.field) == "string" and tonumber(outcome.field:match("^directives%[(%d+)%]$"))
  local entry, m = index and lines[index + 1], outcome.message
  return entry and "line " .. entry.no .. ": " .. m:gsub("^line %d+: ", "", 1) or m
end
function M.skip_message(why) return "elastic: prediction skipped (" .. why .. "); job submitted as written" end
function M.comment_with(c, id)   -- the user's comment, then the decision's id
  return (type(c) == "string" and c ~= "" and c .. " " or "") .. "elastic:decision=" .. id end
-- cli_filter's mark of `sbatch --test-only` for job_submit, which cannot tell (docs/hook.md)
M.TEST_ONLY = "elastic:test-only"
function M.test_only(comment) return type(comment) == "string" and comment:find(M.TEST_ONLY, 1, true) ~= nil end
local function counted(n, word) return string.format("%d %s%s", n, word, n == 1 and "" or "s") end
function M.per_task_split(per_node, tasks)   -- the reason --gpus-per-task refuses a layout
  return string.format("%s per node %s not split over %s (--gpus-per-task)", counted(per_node, "GPU"),
                       per_node == 1 and "does" or "do", tasks and counted(tasks, "task") or "the tasks")
end
-- The partition a comparison of partitions (the reply lists `alternatives`) moves the job to; nil when it stays,
-- and always for a single partition's answer (the cluster model may name the default partition otherwise than Slurm).
function M.moved_to(asked, r) return r.alternatives ~= nil and r.partition ~= asked and r.partition or nil end
-- The partitions decision `r` leaves a job that asked `asked` (nil: none named) to run in, comma-separated: the one a
-- comparison moved it to, else those it asked, else part_list's default; nil when none is known.
function M.partitions_for(asked, r, parts)
  local names = M.moved_to(asked, r) or asked
  for name, p in pairs(names == nil and parts or {}) do names = p.flag_default == 1 and name or names end
  return names
end
-- Why rewrite `r` fits none of the partitions it may run in (#24.5; nil when it fits one): `parts` is job_submit's
-- part_list (Slurm's node counts), `gpus` elastic.conf's max_gpus_per_node (the installer's reading of Slurm's nodes).
function M.outside(r, asked, parts, gpus)
  local names, why = r.action == "rewrite" and (M.partitions_for(asked, r, parts) or ""), "no partition to run in"
  for name in (names or ""):gmatch("[^,]+") do
    local p, most = parts[name], gpus[name]
    local room = p and math.min(tonumber(p.total_nodes) or 0, tonumber(p.max_nodes) or NO_VAL) or 0
    if r.nodes <= room and r.gpus_per_node <= (most or -1) then return nil end
    why = ("%s x %s, partition %s takes at most %s x %s"):format(counted(r.nodes, "node"), counted(r.gpus_per_node,
      "GPU"), name, counted(room, "node"), most and counted(most, "GPU") or "? GPUs (not in elastic.conf)")
  end
  return names and "decision outside its partition: " .. why or nil
end
-- The TRES spelling slurmctld accepts in a job_desc's tres_per_* fields: 22.05 takes only `gres:gpu:2`, 24.11 only
-- `gres/gpu:2` (either refuses the other: "Invalid Trackable RESource (TRES) specification"; docs/slurm-versions.md).
-- The job's own request entries show it (sbatch wrote them in its Slurm's spelling; an accounting-form `gres/gpu=N`
-- says nothing); a job with none, `default` (elastic.conf's gres_prefix, the installer's reading of Slurm).
function M.tres_prefix(job_desc, default)
  for _, key in ipairs({ "tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket" }) do
    for entry in (str(job_desc[key]) or ""):gmatch("[^,]+") do
      local sep = not entry:find("=", 1, true) and entry:match("^gres([:/])")
      if sep then return "gres" .. sep end
    end
  end
  return default or "gres:"
end
-- A rewrite's job_desc values and environment, computed before any is assigned, and whether the GPU request changed;
-- or nil and why it cannot be applied consistently. `prefix` as M.tres_prefix (default: the job's own, else gres:).
function M.rewrite_fields(job_desc, reply, prefix)
  prefix = M.tres_prefix(job_desc, prefix)
  local nodes, per_node, tasks = reply.nodes, reply.gpus_per_node, reply.tasks_per_node
  local f, env = { min_nodes = nodes, max_nodes = nodes, req_switch = reply.switches, features = reply.constraint }, {}
  local why
  for _, key in ipairs({ "tres_per_task", "tres_per_node", "tres_per_job" }) do
    local types, err = M.gpu_types(job_desc[key])
    if not types then return nil, key .. ": " .. err end
    if #types > 1 then return nil, key .. ": " .. M.several_types(types) end
  end
  f.partition = M.moved_to(str(job_desc.partition), reply)
  local new_type = f.partition and (reply.gpu or "") or nil   -- moved: a typed request keeps only this type
  local per_task = gpu_count(job_desc.tres_per_task)
  if per_task then
    if not tasks or per_node % tasks ~= 0 or per_node == 0 then return nil, M.per_task_split(per_node, tasks) end
    f.tres_per_task, why = M.set_gpu_tres(job_desc.tres_per_task, per_node / tasks, new_type, prefix)
    if why then return nil, "tres_per_task: " .. why end
    env.SLURM_GPUS_PER_TASK = tostring(per_node / tasks)
  end
  f.tres_per_node, why = M.set_gpu_tres(job_desc.tres_per_node, per_node > 0 and per_node or nil, new_type, prefix)
  if why then return nil, "tres_per_node: " .. why end
  if job_desc.tres_per_job ~= nil then
    f.tres_per_job, why = M.set_gpu_tres(job_desc.tres_per_job, nil, nil, prefix)
    if why then return nil, "tres_per_job: " .. why end
  end
  local cpus_per_task = num(job_desc.cpus_per_task, NO_VAL16) or 1
  if tasks then f.ntasks_per_node, env.SLURM_NTASKS_PER_NODE = tasks, tostring(tasks) end
  if num(job_desc.num_tasks) then   -- a task count (-n, or one sbatch derived): it follows the new layout
    if tasks then
      f.num_tasks = nodes * tasks
      env.SLURM_NTASKS, env.SLURM_NPROCS = tostring(f.num_tasks), tostring(f.num_tasks)
      if num(job_desc.min_cpus) then f.min_cpus = f.num_tasks * cpus_per_task end
    end
  elseif num(job_desc.min_cpus) then
    -- sbatch derived it from its node count; stale, slurmctld may refuse the job ("Requested node configuration...")
    f.min_cpus = nodes * (tasks or 1) * cpus_per_task
  end
  -- A layout without a task count: the count too. 22.05 derived it (nodes x ntasks_per_node: the batch step's
  -- SLURM_NTASKS, srun's default); 24.11 does not, and srun in the job then starts one task per node.
  if tasks and not num(job_desc.num_tasks) then f.num_tasks = nodes * tasks end
  if reply.decision_id ~= nil then f.comment = M.comment_with(job_desc.comment, reply.decision_id) end
  local changed = gpu_count(job_desc.tres_per_job) ~= nil or per_task ~= nil
    or gpu_count(job_desc.tres_per_node) ~= per_node
  if changed then env.SLURM_GPUS, env.SLURM_GPUS_PER_NODE = tostring(nodes * per_node), tostring(per_node) end
  return f, env, changed
end

-- The time limit a rewrite sets (issue #40): the reply's time_limit_min (the planner's rule: the layout chosen is
-- predicted slower than the one asked, the limit scaled by their ratio), capped at the lowest MaxTime of the partitions
-- the job may run in (`parts`, part_list: max_time in minutes; INFINITE or not known: no cap), never below the job's
-- own. Returns the limit (nil: unchanged) and, when a MaxTime held it, a note for the reason line.
function M.time_limit(job_desc, reply, parts)
  local want, own = reply.time_limit_min, num(job_desc.time_limit)
  if not want or not own or want <= own then return nil end
  local cap, where
  for name in (M.partitions_for(str(job_desc.partition), reply, parts) or ""):gmatch("[^,]+") do
    local most = parts and parts[name] and num(parts[name].max_time)
    if most and (not cap or most < cap) then cap, where = most, name end
  end
  if not cap or want <= cap then return want end
  if cap <= own then
    return nil, ("time limit kept at %d min: partition %s's MaxTime is %d min"):format(own, where, cap)
  end
  return cap, ("time limit capped at partition %s's MaxTime, %d min"):format(where, cap)
end

-- Apply a decision to a batch job's job_desc (a keep: its id in the comment), read from `desc` (M.read_desc of it);
-- true and a note for the reason line (nil: none), or nil and why nothing changed. SLURM_GPUS and _PER_NODE follow a
-- changed GPU request (srun in the job reads them), others only where sbatch set them. `parts`: job_submit's
-- part_list, for the partitions' MaxTime (M.time_limit).
function M.apply_job_desc(job_desc, desc, decision, gres_prefix, parts)
  local fields, env = { comment = decision.decision_id and M.comment_with(desc.comment, decision.decision_id) }, {}
  local note
  if decision.kind ~= "keep" then fields, env = M.rewrite_fields(desc, decision, gres_prefix) end
  if not fields then return nil, env end
  if decision.kind ~= "keep" then fields.time_limit, note = M.time_limit(desc, decision, parts) end
  for key, value in pairs(fields) do job_desc[key] = value end
  local target = next(env) ~= nil and job_desc.environment or nil
  for key, value in pairs(target and env or {}) do
    if target[key] ~= nil or key == "SLURM_GPUS" or key == "SLURM_GPUS_PER_NODE" then target[key] = value end
  end
  return true, note
end

return M
