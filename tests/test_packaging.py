"""setup.py ships every package of the project (what Dataflow workers get with --setup_file)."""

from setuptools import distutils  # noqa: F401  (makes distutils.core importable on 3.12+)
from distutils.core import run_setup

from tests.conftest import REPO


def test_every_top_level_package_is_shipped():
    packages = set(run_setup(str(REPO / "setup.py"), stop_after="init").packages)
    on_disk = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert on_disk <= packages, on_disk - packages
    assert not {"tests", "benchmarks"} & packages
    assert {"pipeline", "transforms", "model", "runners"} <= on_disk
