"""The lab: a local Slurm testbed (`testbed`, `testbed_conf`) and the end-to-end demo (`demo*`) built on it.

Top of the import order (docs/design.md): the lab uses slurm_plugin's core, predictor and elastic_launcher;
none of them imports the lab. Its commands join `elastic-slurm` through `slurm_plugin.cli`.
"""
