"""#42: the profile a worker's rows are labelled with is the job's `#ELASTIC model=`: the launcher hands it to the
workers (ELASTIC_MODEL) and a script whose --profile differs stops at start, naming both (before, the script's
option was never compared and the job's rows said a model that did not run)."""
from __future__ import annotations

import pytest

from elastic_launcher.examples.common import WorkerEnv
from elastic_launcher.launch_config import Directives

BASE = {"ELASTIC_GROUP": "g", "ELASTIC_STORE_ADDR": "h:1/job", "SLURM_LOCALID": "0"}


def test_a_profile_other_than_the_directives_model_stops_the_worker_naming_both():
    env = WorkerEnv.from_environ({**BASE, **Directives.from_script("#!/bin/bash\n#ELASTIC model=gpt2\n").worker_env()})
    assert env.model == "gpt2" and env.profile("gpt2") == "gpt2"
    with pytest.raises(SystemExit, match=r"--profile resnet50 disagrees with the job's `#ELASTIC model=gpt2`"):
        env.profile("resnet50")


def test_without_a_model_directive_the_scripts_profile_stands():
    env = WorkerEnv.from_environ({**BASE, **Directives.from_script("#!/bin/bash\n#ELASTIC gpus=1-4\n").worker_env()})
    assert env.model is None and env.profile("resnet50") == "resnet50"


def test_train_checks_the_profile_before_it_builds_anything(monkeypatch):
    from elastic_launcher.examples import common
    monkeypatch.setattr(common, "pick_device", lambda *a, **k: pytest.fail("got past the profile check"))
    with pytest.raises(SystemExit, match="disagrees with the job's `#ELASTIC model=gpt2`"):
        common.train(None, None, None, None, None, profile="resnet50", environ={**BASE, "ELASTIC_MODEL": "gpt2"})
