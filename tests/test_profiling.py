"""--profile_dir: a jax.profiler trace of K batches, in the layout TensorBoard's profile plugin reads."""

import pytest

from tests.conftest import run_cli
from tests.test_host import host_args

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("k, traced", [(2, 2), (10, 5)])  # 6 batches: the first is never traced
def test_a_trace_of_k_batches_after_the_first(arc_streams, tiny_checkpoints, tmp_path, k, traced):
    import jax.profiler
    result = run_cli("runners.tpu_host", *host_args(arc_streams, tmp_path / "out", 0, tiny_checkpoints["gqa_tied"],
                                                    "--window", "1", "--max_samples", "6",  # 6 batches
                                                    "--profile_dir", str(tmp_path / "trace"),
                                                    "--profile_batches", str(k)))
    assert result.returncode == 0, result.stderr
    # TensorBoard / xprof look for <logdir>/plugins/profile/<run>/<host>.xplane.pb.
    runs = list((tmp_path / "trace" / "plugins" / "profile").iterdir())
    assert len(runs) == 1
    (xplane,) = runs[0].glob("*.xplane.pb")
    assert xplane.stat().st_size > 0 and (runs[0] / "perfetto_trace.json.gz").stat().st_size > 0
    host = jax.profiler.ProfileData.from_file(str(xplane)).find_plane_with_name("/host:CPU")
    events = [e.name for line in host.lines for e in line.events]
    assert events.count("batch") == traced  # one step marker per traced batch
    assert any("jit(forward)" in name for name in events)
    # The store path's host side of each batch (host/store_stats.py) is in the trace too.
    assert {"store/device_to_host", "store/split"} <= set(events)
