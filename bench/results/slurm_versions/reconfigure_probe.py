"""After `scontrol reconfigure`, is a GPU job refused? Usage (from a checkout, the lab up):
    python reconfigure_probe.py LAB PORT_BASE SLURM_VERSION N {client,testbed}
client: `CommandBackend.reconfigure` alone; testbed: `Testbed.reconfigure` (waits until no node reads unknown).
Each of N rounds: reconfigure, `sbatch --test-only -N1 --gpus-per-node=4`, then count the nodes reading unknown."""
import collections
import os
import subprocess
import sys
from pathlib import Path

from slurm_plugin.lab.testbed import Testbed
from slurm_plugin.lab.testbed_conf import TestbedConfig

lab, port_base, version, rounds, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
bed = Testbed(TestbedConfig(lab=Path(lab), port_base=port_base, slurm=version))
env = {**os.environ, **bed.env()}
tally = collections.Counter()
for _ in range(rounds):
    bed.reconfigure() if how == "testbed" else bed.client.reconfigure()
    refused = subprocess.run(["sbatch", "--test-only", "-N1", "--gpus-per-node=4", "--wrap", "true"], env=env,
                             capture_output=True, text=True).returncode != 0
    unknown = sum(n.state.startswith("unknown") for n in bed.client.nodes())
    tally[f"refused={refused} unknown_after={unknown}"] += 1
print(f"Slurm {version}, {how}.reconfigure, {rounds} rounds: {dict(sorted(tally.items()))}")
