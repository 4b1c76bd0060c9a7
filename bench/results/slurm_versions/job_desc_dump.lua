local FIELDS = { "min_nodes", "max_nodes", "num_tasks", "ntasks_per_node", "cpus_per_task", "min_cpus", "pn_min_cpus",
  "tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket", "cpus_per_tres", "mem_per_tres", "time_limit", "time_min",
  "req_switch", "wait4switch", "partition", "shared", "contiguous", "priority", "nice", "gres", "pn_min_memory",
  "req_nodes", "exc_nodes", "features", "comment", "dependency", "array_inx", "bitflags", "argc" }
function slurm_job_submit(job_desc, part_list, submit_uid)
  local out = {}
  for _, k in ipairs(FIELDS) do out[#out + 1] = k .. "=" .. tostring(job_desc[k]) end
  slurm.log_user("%s", table.concat(out, " "))
  return slurm.SUCCESS
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
