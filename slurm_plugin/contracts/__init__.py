"""Contracts the runtime (elastic_launcher) and the service (predictor) share, below both (issue #26.1).

A module here imports nothing of the project's above it and nothing heavier than the standard library, so the
runtime and the service can each depend on it without depending on each other:

- `directives`: the `#ELASTIC` grammar (docs/directives.md; the Lua reads only what the hook needs of it);
- `tres`: Slurm's job_desc sentinels and the one TRES/GRES reading of GPUs (`gpu_tres`, `requested_shape`);
- `batch`: how a global batch is split over ranks of different speeds (`split_batch`, `type_speeds`);
- `signing`: what a job signs to write to the service (`munge_payload`, `munge_sign`, `MUNGE_HEADER`);
- `records`: the observation records' schema (`validate_record`, `validate_batch`) and the one name of a layout
  (`layout_name`): the service validates every post with it, the launcher checks what it posts with it.

Besides the standard library a contracts module imports only other contracts modules and slurm_plugin's two leaf
modules, `errors` and `hostlist` (tests/unit/test_import_layers.py).
"""
