"""#45.3: one token story. Jobs write with their own munge credential; the lab's (and the demo's) service takes
munge credentials; nothing tells a user to give a job the site's tool token."""
from __future__ import annotations

import re
from pathlib import Path

from slurm_plugin.lab.demo import lab_slurm
from slurm_plugin.lab.demo_services import PredictorService
from slurm_plugin.lab.testbed import Testbed
from slurm_plugin.lab.testbed_conf import TestbedConfig
from tests.unit.test_auth import COLLECTIVE, FakeSigner, Scripted, launcher, scripted  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[2]


def test_the_lab_service_takes_munge_credentials_and_its_jobs_get_no_token(tmp_path):
    bed = Testbed(TestbedConfig(lab=tmp_path / "lab", port_base=17500))
    service = PredictorService(bed)
    service.dir.mkdir(parents=True)
    (service.dir / "token").write_text("tool-token\n")   # what start() writes first
    env = service.service_env()
    assert env["ELASTIC_PREDICTOR_MUNGE"] == "1"
    assert env["ELASTIC_PREDICTOR_MUNGE_SOCKET"] == str(bed.config.munge_socket)
    assert env["ELASTIC_PREDICTOR_SLURM_CONF"] == str(bed.config.slurm_conf)   # the job is checked with Slurm
    jobs_env = lab_slurm(bed).env
    assert "tool-token" not in str(jobs_env) and jobs_env["ELASTIC_MUNGE_SOCKET"] == str(bed.config.munge_socket)


def test_a_refused_write_does_not_tell_the_user_to_put_the_tool_token_in_the_job(scripted, monkeypatch,  # noqa: F811
                                                                                   caplog):
    Scripted.answers = [(401, b'{"reason": "missing_credential"}')]
    client = launcher(scripted, monkeypatch, FakeSigner(), job_id=7)
    with caplog.at_level("WARNING"):
        assert client.observe([COLLECTIVE]) is False
    (message,) = [r.getMessage() for r in caplog.records if "not allowed to write" in r.getMessage()]
    assert "ELASTIC_PREDICTOR_MUNGE=1" in message and "the tool token stays out of jobs" in message
    assert "give the job" not in message


def test_no_users_guide_line_puts_the_tool_token_in_a_job():
    for doc in ("docs/user-guide.md", "README.md", "docs/launcher.md"):
        text = (ROOT / doc).read_text()
        assert not re.search(r"(export|give the job|job's environment).{0,40}ELASTIC_PREDICTOR_TOKEN", text), doc
    for template in (ROOT / "sbatch_templates").glob("*.sbatch"):
        assert "ELASTIC_PREDICTOR_TOKEN" not in template.read_text(), template.name
