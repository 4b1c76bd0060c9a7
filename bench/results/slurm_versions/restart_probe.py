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
