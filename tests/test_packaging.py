"""setup.py ships every package of the project (what Dataflow workers get with --setup_file)."""

from tests.conftest import REPO, setup_arguments


def test_every_top_level_package_is_shipped():
    packages = set(setup_arguments()["packages"])
    on_disk = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert on_disk <= packages, on_disk - packages
    assert not {"tests", "benchmarks"} & packages
    assert {"pipeline", "transforms", "model", "runners"} <= on_disk
