"""Right after a slurmctld restart, what do the nodes read? Usage (from a checkout, the lab up):
    python restart_probe.py LAB PORT_BASE SLURM_VERSION N
Each of N rounds: `Testbed.stop_controller(kill=True)`, `start_controller()`, then every node's state and `is_up()`."""
import sys, time
from pathlib import Path
from slurm_plugin.lab.testbed import Testbed
from slurm_plugin.lab.testbed_conf import TestbedConfig
bed = Testbed(TestbedConfig(lab=Path(sys.argv[1]), port_base=int(sys.argv[2]), slurm=sys.argv[3]))
for i in range(int(sys.argv[4])):
    bed.stop_controller(kill=True); bed.start_controller()
    states = [n.state for n in bed.client.nodes()]
    print(i, states, "is_up:", bed.is_up())
    time.sleep(1)
