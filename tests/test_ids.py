import os
import subprocess
import sys

import pytest

from transforms.ids import make_sample_id, split_sample_id, stable_hash


def test_layout_is_file_row_sub():
    assert make_sample_id(0, 0, 0) == 0
    assert make_sample_id(0, 0, 1) == 1
    assert make_sample_id(0, 1, 0) == 256
    assert make_sample_id(1, 0, 0) == 1 << 40


def test_split_inverts_make():
    for position in [(0, 0, 0), (3, 17, 2), ((1 << 23) - 1, (1 << 32) - 1, 255)]:
        assert split_sample_id(make_sample_id(*position)) == position


def test_largest_id_fits_int64():
    assert make_sample_id((1 << 23) - 1, (1 << 32) - 1, 255) < 1 << 63


@pytest.mark.parametrize("position", [(-1, 0, 0), (1 << 23, 0, 0), (0, 1 << 32, 0), (0, 0, 256)])
def test_out_of_range_positions_are_refused(position):
    with pytest.raises(ValueError, match="out of id range"):
        make_sample_id(*position)


def test_stable_hash_is_the_same_in_another_process_with_another_hash_seed():
    code = "from transforms.ids import stable_hash; print([stable_hash(i) for i in (0, 1, 1 << 40)])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == str([stable_hash(i) for i in (0, 1, 1 << 40)])
