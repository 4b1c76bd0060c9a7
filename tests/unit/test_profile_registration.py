"""#45.2: a new model becomes plannable by itself. The workers publish the shapes of the model the script built;
the launcher registers them under the job's own (munge) credential when the predictor has no profile of the
job's `#ELASTIC model=`, once a job; the service then plans that user's next submission of it."""
from __future__ import annotations

import json

import torch

from elastic_launcher.controller import Controller
from elastic_launcher.store_keys import MODEL_PROFILE
from slurm_plugin.contracts.profiles import profile_body
from tests.unit.test_auth import FakeSigner, app, launcher, serve_app  # noqa: F401 - fixtures
from tests.unit.test_controller_plan import FakePredictor, make_controller


def _model() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    m[0].bias.requires_grad_(False)   # frozen: not in the profile
    return m


def test_the_body_follows_the_services_own_rule_for_a_module():
    from predictor.profiles import profile_from_module
    body = profile_body("my-net", _model().named_parameters())
    built = profile_from_module(_model(), "my-net")
    assert body["tensors"] == [{"name": t.name, "numel": t.numel, "dtype": t.dtype} for t in built.tensors]
    assert [t["name"] for t in body["tensors"]] == ["2.bias", "2.weight", "0.weight"]   # DDP's order, no frozen one


def test_a_job_registers_an_unknown_model_under_its_own_credential_once(app, serve_app, monkeypatch):  # noqa: F811
    signer = FakeSigner(uid=1000)
    client = launcher(serve_app(app), monkeypatch, signer, job_id=7, token=None)   # no tool token in the job
    body = profile_body("my-net", _model().named_parameters())
    assert client.ensure_profile(body) == ("registered", "my-net")
    store = app.extensions["elastic_predictor"].store
    stored = store.get_profile("my-net")
    assert [t["numel"] for t in stored["tensors"]] == [3, 48, 128] and store.profile_owner("my-net") == (True, 1000)
    assert len(signer.signed) == 1 and json.loads(signer.signed[0])["name"] == "my-net"
    assert client.ensure_profile(body) == ("known", "my-net")       # nothing posted a second time
    assert len(signer.signed) == 1


def test_without_a_service_the_outcome_says_which_case_it_is(monkeypatch):
    from elastic_launcher.reporting import PredictorClient
    body = profile_body("my-net", _model().named_parameters())
    assert PredictorClient(None, None, timeout_s=1).ensure_profile(body)[0] == "not configured"
    assert PredictorClient("http://127.0.0.1:9", None, timeout_s=1).ensure_profile(body)[0] == "unreachable"


class _Store:
    def __init__(self, values: dict):
        self.values = values

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key].encode()


class _Registering(FakePredictor):
    def __init__(self, answers):
        super().__init__([])
        self.answers, self.bodies = list(answers), []

    def ensure_profile(self, body):
        self.bodies.append(body)
        return self.answers.pop(0)


def test_the_launcher_registers_under_the_directives_model_name_and_records_it_once(tmp_path):
    predictor = _Registering([("unreachable", "connection refused"), ("registered", "resnet50")])
    c = make_controller(tmp_path, predictor)
    c.server = _Store({})
    Controller._register_profile(c)                      # the workers have not published yet: nothing asked
    assert predictor.bodies == []
    c.server = _Store({MODEL_PROFILE: json.dumps(profile_body("resnet-tiny", _model().named_parameters()))})
    Controller._register_profile(c)                      # unreachable: asked again at the next measurement
    Controller._register_profile(c)
    Controller._register_profile(c)                      # done: not asked again
    assert [b["name"] for b in predictor.bodies] == [c.config.directives.model] * 2   # the name the rows carry
    (rec,) = [r for r in c.records.items if r["kind"] == "model_profile"]
    assert (rec["outcome"], rec["tensors"]) == ("registered", 3)


def test_the_cli_registers_any_module_callable_under_the_name_given(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from predictor.cli import main as predictor_cli
    (tmp_path / "mynets.py").write_text("import torch\nNOT_CALLABLE = 3\n"
                                        "def build():\n    return torch.nn.Sequential(torch.nn.Linear(4, 2))\n"
                                        "def broken():\n    raise RuntimeError('needs a config')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    db = str(tmp_path / "p.db")
    runner = CliRunner()
    made = runner.invoke(predictor_cli, ["profile", "mynets:build", "--name", "my-net", "--db", db, "--json"])
    assert made.exit_code == 0, made.output
    body = json.loads(made.output.splitlines()[0])
    assert body["name"] == "my-net" and [t["numel"] for t in body["tensors"]] == [2, 8]
    assert "registered profile 'my-net'" in made.output
    for spec, why in (("mynets:missing", "mynets:missing: cannot import it"),
                      ("mynets:NOT_CALLABLE", "mynets:NOT_CALLABLE is a int, not a callable"),
                      ("mynets:broken", "mynets:broken() raised RuntimeError: needs a config")):
        refused = runner.invoke(predictor_cli, ["profile", spec])
        assert refused.exit_code == 1 and why in refused.output, refused.output
