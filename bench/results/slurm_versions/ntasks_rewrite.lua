function slurm_job_submit(job_desc, part_list, submit_uid)
  if job_desc.comment == "rw" or job_desc.comment == "rwn" then
    local p = (job_desc.tres_per_job or ""):match("^gres/") and "gres/" or "gres:"
    job_desc.min_nodes, job_desc.max_nodes = 2, 2
    job_desc.tres_per_node = p .. "gpu:2"
    job_desc.tres_per_job = ""
    job_desc.ntasks_per_node = 2
    job_desc.min_cpus = 4
    if job_desc.comment == "rwn" then job_desc.num_tasks = 4 end
  end
  return slurm.SUCCESS
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
