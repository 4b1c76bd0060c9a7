"""Issue 15, a newcomer's first hour: nothing outside the checkout, one demo per lab, CLI errors that say
what to do, templates whose `model=` names the model that trains, one command that stops a kept lab."""
from __future__ import annotations

import fnmatch
import importlib
import json
import os
import re
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

import predictor
from predictor import cli as predictor_cli_module
from predictor import datasets
from predictor.cli import main as predictor_cli
from slurm_plugin import templates
from slurm_plugin.lab import demo, demo_calibrate
from slurm_plugin.cli import main as slurm_cli
from slurm_plugin.contracts.directives import parse_script

ROOT = Path(__file__).resolve().parents[2]


# --- 1. the data ships with the package -------------------------------------------------------------------
def test_vendored_datasets_live_in_the_package_and_load():
    package = Path(predictor.__file__).resolve().parent
    assert Path(datasets.DEFAULT_ROOT).resolve().is_relative_to(package), datasets.DEFAULT_ROOT
    sizes = {"pollux-t4": 5000, "morphling-a800": 60, "elasticflow-a100": 80}
    for name, loader in datasets.LOADERS.items():
        datasets.check(name)
        ds = loader()
        assert ds.name == name and len(ds.steps) >= sizes[name]
    assert max(sum(r["layout"]) for r in datasets.load_pollux().extra) == 64


def test_every_vendored_folder_says_where_it_comes_from():
    root = Path(datasets.DEFAULT_ROOT)
    folders = sorted(p for p in root.iterdir() if p.is_dir() and p.name != "roofline")
    assert [f.name for f in folders] == ["elasticflow-a100", "gavel-osdi20", "morphling-a800", "pollux-osdi21"]
    # roofline/: figures from vendors' datasheets and this project's counting, not a repository's files
    roofline = (root / "roofline" / "SOURCE.md").read_text(encoding="utf-8")
    assert "datasheet" in roofline and "License:" in roofline
    for folder in folders:
        source = (folder / "SOURCE.md").read_text(encoding="utf-8")
        assert re.search(r"Commit: `[0-9a-f]{40}`", source), folder
        license = "License: MIT" if folder.name == "gavel-osdi20" else "License: Apache-2.0"
        assert license in source and "https://github.com/" in source and "Left out" in source
    assert "Apache License" in (root / "LICENSE-Apache-2.0.txt").read_text()
    assert "MIT License" in (root / "LICENSE-MIT-gavel.txt").read_text()
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert size < 1_000_000, f"vendored data is {size} bytes"


def test_setup_py_installs_every_vendored_file():
    text = (ROOT / "setup.py").read_text()
    patterns = re.search(r'"predictor": \[(.*?)\]', text, re.S).group(1)
    patterns = re.findall(r'"([^"]+)"', patterns)
    package = ROOT / "predictor"
    for path in (package / "data").rglob("*"):
        if path.is_file():
            rel = path.relative_to(package).as_posix()
            assert any(fnmatch.fnmatchcase(rel, p) and rel.count("/") == p.count("/") for p in patterns), rel


def test_a_missing_data_file_is_named_not_a_traceback(tmp_path):
    shutil.copytree(datasets.DEFAULT_ROOT, tmp_path / "data")
    gone = tmp_path / "data" / "morphling-a800" / "traces" / "vit" / "placements.csv"
    gone.unlink()
    with pytest.raises(datasets.DatasetError, match=re.escape(str(gone))) as info:
        datasets.load_morphling(tmp_path / "data")
    assert "SOURCE.md" in str(info.value)
    with pytest.raises(datasets.DatasetError, match=re.escape(str(gone))):
        datasets.check("morphling-a800", tmp_path / "data")
    with pytest.raises(ValueError, match="known: pollux-t4"):
        datasets.check("pollux-a100")


def test_evaluate_checks_datasets_and_says_when_bench_is_absent(tmp_path, monkeypatch):
    runner = CliRunner()
    bad = runner.invoke(predictor_cli, ["evaluate", "--datasets", "pollux-a100"])
    assert bad.exit_code == 2 and "no dataset 'pollux-a100'" in bad.output and "pollux-t4" in bad.output
    monkeypatch.setattr(predictor_cli_module, "REPO_ROOT", tmp_path)     # an installed package: no bench/
    missing = runner.invoke(predictor_cli, ["evaluate", "--datasets", "pollux-t4"])
    assert missing.exit_code == 1 and "bench/accuracy.py" in missing.output and "--fit-errors" in missing.output
    assert "Traceback" not in missing.output
    db_without = runner.invoke(predictor_cli, ["evaluate", "--db", str(tmp_path / "x.db")])
    assert db_without.exit_code == 2 and "--fit-errors" in db_without.output


def test_no_code_or_doc_points_outside_the_checkout():
    files = [ROOT / "README.md", ROOT / "setup.py", *(ROOT / "docs").glob("*.md"), *(ROOT / "predictor").rglob("*.py"),
             *(ROOT / "predictor" / "data").rglob("*.md"), *(ROOT / "slurm_plugin").rglob("*.py")]
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(\.\./|\bwork/)?shared/(data|docs)", text), path


# --- 3. the CLI -------------------------------------------------------------------------------------------
READ_COMMANDS = [
    ["models"], ["links"], ["decisions"], ["evaluate", "--fit-errors"],
    ["predict", "--profile", "resnet50", "--gpu", "H200", "--per-gpu-batch", "64"],
    ["plot", "scaling", "--out", "x.png"], ["plot", "links", "--out", "x.png"],
]


@pytest.mark.parametrize("argv", READ_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_read_commands_refuse_a_missing_database(argv, tmp_path):
    typo = tmp_path / "predictr.db"
    result = CliRunner().invoke(predictor_cli, [*argv, "--db", str(typo)])
    assert result.exit_code == 1, result.output
    assert f"no database at {typo} (--db)" in result.output
    assert not typo.exists(), "a read command created the database"


def test_plan_refuses_a_missing_database(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#ELASTIC model=resnet50 gpus=1-8 per_gpu_batch=64\nsrun true\n")
    env_db = tmp_path / "from-env.db"
    result = CliRunner().invoke(predictor_cli, ["plan", str(script)], env={"ELASTIC_PREDICTOR_DB": str(env_db)})
    assert result.exit_code == 1 and f"no database at {env_db} ($ELASTIC_PREDICTOR_DB)" in result.output
    assert not env_db.exists()


def test_plot_without_a_subcommand_names_them():
    result = CliRunner().invoke(predictor_cli, ["plot", "--db", "x.db"], prog_name="elastic-predictor")
    assert result.exit_code == 2
    assert "needs a subcommand first (links | scaling)" in result.output
    assert "elastic-predictor plot scaling --db" in result.output


def _history(tmp_path) -> str:
    db = str(tmp_path / "h.db")
    runner = CliRunner()
    assert runner.invoke(predictor_cli, ["profile", "resnet50", "--db", db]).exit_code == 0
    step = {"kind": "step", "profile": "resnet50", "gpu": "cpu", "layout": [1], "intra_link": "shm",
            "per_gpu_batch": 8, "iter_s": 0.05}
    (tmp_path / "h.jsonl").write_text(json.dumps(step) + "\n")
    assert runner.invoke(predictor_cli, ["import", "--db", db, str(tmp_path / "h.jsonl")]).exit_code == 0
    return db


def test_predict_names_the_cluster_option_and_close_profile_names(tmp_path):
    db = _history(tmp_path)
    runner = CliRunner()
    no_gpu = runner.invoke(predictor_cli, ["predict", "--db", db, "--profile", "resnet50", "--gpu", "cpu",
                                           "--per-gpu-batch", "8"])
    assert no_gpu.exit_code == 1 and "--cluster" in no_gpu.output and "predictor/cluster.json" in no_gpu.output
    cased = runner.invoke(predictor_cli, ["predict", "--db", db, "--profile", "ResNet50", "--gpu", "cpu",
                                          "--per-gpu-batch", "8"])
    assert cased.exit_code == 1 and "did you mean 'resnet50'?" in cased.output
    unknown = runner.invoke(predictor_cli, ["predict", "--db", db, "--profile", "mynet", "--gpu", "cpu",
                                            "--per-gpu-batch", "8"])
    assert unknown.exit_code == 1 and f"elastic-predictor profile torchvision:NAME or package.module:callable --name mynet --db {db}" in \
        " ".join(unknown.output.split())
    spec = runner.invoke(predictor_cli, ["profile", "ResNet50"])
    assert spec.exit_code == 1 and "did you mean 'resnet50'?" in spec.output


def test_no_layout_message_is_singular_for_one_gpu(tmp_path, monkeypatch):
    db = _history(tmp_path)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"partitions": [{"name": "p", "nodes": "n1", "gpus_per_node": 1, "gpu": "cpu",
                                                   "intra_link": "shm", "inter_link": "socket"}]}))
    result = CliRunner().invoke(predictor_cli, ["predict", "--db", db, "--cluster", str(cluster), "--profile",
                                                "resnet50", "--gpu", "cpu", "--per-gpu-batch", "8", "--gpus", "2"])
    assert result.exit_code == 1 and "no layout of 2 GPUs" in result.output
    assert "1 GPUs" not in result.output


# --- 4. templates name the model that trains --------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(templates.templates()))
def test_cpu_test_model_directive_is_the_trained_profile(name):
    text = templates.render(templates.get(name), templates.Params(cpu_test=True))
    model = parse_script(text)["model"]
    assert model == templates.CPU_PROFILES[name]
    assert model != parse_script(templates.get(name).text)["model"], "the tiny model is not the full one"
    if name in templates.PLAIN_SCRIPT:   # a plain script measures nothing of its own
        return
    _, command = templates.split_script(text)
    _, worker, inner = templates.command_parts(command)
    args = importlib.import_module(worker[2]).build_parser().parse_args(worker[3:] + inner)
    assert args.profile == model, "its measurements go in under the directive's name"
    if name == "resnet50":
        assert args.arch == model == demo_calibrate.PROFILE


def test_a_model_given_when_rendering_is_also_the_scripts_profile():
    for cpu_test in (False, True):
        text = templates.render(templates.get("resnet50"),
                                templates.Params(cpu_test=cpu_test, directives={"model": "mynet"}))
        _, command = templates.split_script(text)
        _, worker, _ = templates.command_parts(command)
        assert parse_script(text)["model"] == "mynet" and worker[worker.index("--profile") + 1] == "mynet"


# --- 2. one demo per lab ----------------------------------------------------------------------------------
def test_the_demo_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    lab = tmp_path / "lab"
    first = demo.LabLock(lab).acquire(17000)
    try:
        with pytest.raises(demo.DemoBusy) as info:
            demo.LabLock(lab).acquire(17040)
        message = str(info.value)
        assert f"pid {os.getpid()}" in message and f"in lab {lab} " in message and "running since 20" in message
        assert "port base 17000" in message and "--lab" in message
        holder = demo.LabLock.holder(lab)
        assert holder["pid"] == os.getpid() and holder["lab"] == str(lab)
        assert json.loads((lab / "demo.lock").read_text())["pid"] == os.getpid()
    finally:
        first.release()
    assert demo.LabLock.holder(lab) is None
    with demo.LabLock(lab).acquire(17040):          # free again: the next demo takes it
        assert demo.LabLock.holder(lab)["port_base"] == 17040
    assert demo.LabLock.holder(tmp_path / "never-used") is None


def test_demo_and_testbed_down_are_refused_while_a_demo_holds_the_lab(tmp_path):
    lab = tmp_path / "lab"
    runner = CliRunner()
    with demo.LabLock(lab).acquire(17000):
        again = runner.invoke(slurm_cli, ["demo", "--lab", str(lab), "--port-base", "17040"])
        assert again.exit_code == 1 and "elastic-slurm demo is running in lab" in again.output and "--port-base" in again.output
        assert f"pid {os.getpid()}" in again.output
        down = runner.invoke(slurm_cli, ["testbed", "down", "--lab", str(lab), "--port-base", "17000"])
        assert down.exit_code == 1 and "elastic-slurm demo is running in lab" in down.output and "kill -INT" in down.output


# --- 5. one command stops a kept lab ----------------------------------------------------------------------
def test_keep_hint_gives_one_stop_command_and_the_cluster_file(tmp_path):
    lines: list[str] = []
    run = demo.Demo(tmp_path / "lab", 17000, 1000, 30, timedelta(seconds=1), echo=lines.append)
    run.job_id = 7
    run.keep_hint()
    hint = "\n".join(lines)
    lab = tmp_path / "lab"
    assert f"elastic-slurm testbed down --lab {lab}" in hint
    assert f"--cluster {lab}/predictor/cluster.json" in hint and "--profile resnet-tiny --gpu cpu" in hint
    assert "kill $(cat" not in hint, "one command, not two"


def test_stop_lab_services_on_a_lab_that_runs_nothing(tmp_path):
    from slurm_plugin.lab.testbed import Testbed
    from slurm_plugin.lab.testbed_conf import TestbedConfig

    bed = Testbed(TestbedConfig(lab=tmp_path / "lab", port_base=17000))
    assert demo.stop_lab_services(bed) == (0, False)


def test_unknown_profile_hint_names_the_database_and_counts_agree(tmp_path):
    """#15: the 'register it' hint gives a command that runs as shown (with --db), and "1 GPU", not "1 GPUs"."""
    from predictor.errors import NotFoundError
    from slurm_plugin.contracts.records import counted
    from predictor.store import Store

    db = str(tmp_path / "hint.db")
    store = Store(db)
    store.migrate()
    with pytest.raises(NotFoundError) as info:
        store.get_profile("vgg99")
    store.close()
    assert f"elastic-predictor profile package.module:callable --name vgg99 --db {db}" in str(info.value.hint)
    assert [counted(n, "GPU") for n in (1, 2)] == ["1 GPU", "2 GPUs"]
