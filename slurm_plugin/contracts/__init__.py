"""Contracts the runtime (elastic_launcher) and the service (predictor) share, below both (issue #26.1).

A module here imports nothing of the project's above it and nothing heavier than the standard library, so the
runtime and the service can each depend on it without depending on each other:

- `batch`: how a global batch is split over ranks of different speeds (`split_batch`, `type_speeds`);
- `signing`: what a job signs to write to the service (`munge_payload`, `munge_sign`, `MUNGE_HEADER`).

The `#ELASTIC` grammar (slurm_plugin.directives) and Slurm's job_desc/TRES reading (slurm_plugin.client) sit in
the same bottom layer.
"""
