"""Dump what pyslurm 24.11 gives for nodes and jobs (the fields PyslurmBackend reads) as JSON."""
import json, sys
import pyslurm

def node(n):
    return {"name": n.name, "state": n.state, "configured_gres": n.configured_gres, "allocated_gres": n.allocated_gres,
            "partitions": list(n.partitions or ())}

def job(j):
    layout = j.get_resource_layout_per_node() if j.allocated_nodes else {}
    return {"id": j.id, "name": j.name, "state": j.state, "allocated_nodes": j.allocated_nodes,
            "resource_layout_per_node": layout, "gres_per_node": j.gres_per_node, "comment": j.comment,
            "batch_host": j.batch_host, "state_reason": j.state_reason, "partition": j.partition,
            "num_nodes": j.num_nodes, "end_time": j.end_time, "priority": j.priority, "time_limit": j.time_limit}

out = {"nodes": [node(n) for n in sorted(pyslurm.Nodes.load().values(), key=lambda n: n.name)],
       "jobs": [job(j) for j in sorted(pyslurm.Jobs.load().values(), key=lambda j: j.id)]}
json.dump(out, sys.stdout, indent=1, sort_keys=True, default=str)
