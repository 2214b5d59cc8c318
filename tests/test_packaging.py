"""setup.py ships every package of the project (what Dataflow workers get with --setup_file), and the
Dataflow worker image (docker/Dockerfile) copies them all."""

from tests.conftest import REPO, setup_arguments


def test_every_top_level_package_is_shipped():
    packages = set(setup_arguments()["packages"])
    on_disk = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert on_disk <= packages, on_disk - packages
    assert not {"tests", "benchmarks"} & packages
    assert {"pipeline", "transforms", "model", "runners"} <= on_disk


def test_the_dataflow_worker_image_copies_every_package_and_ends_in_beams_boot():
    import re
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", dockerfile, re.M))
    top_level = {p.split(".")[0] for p in setup_arguments()["packages"]}
    assert copied == top_level
    assert re.search(r"^FROM apache/beam_python\$\{PYTHON_VERSION\}_sdk:\$\{BEAM_VERSION\}$", dockerfile, re.M)
    assert dockerfile.rstrip().splitlines()[-1] == 'ENTRYPOINT ["/opt/apache/beam/boot"]'
