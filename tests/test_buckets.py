import pytest

from model.buckets import Bucketer, bucket_for, bucket_lengths


def test_powers_of_two_and_their_midpoints_up_to_max():
    assert bucket_lengths(256, 32) == (32, 48, 64, 96, 128, 192, 256)
    assert bucket_lengths(300, 32) == (32, 48, 64, 96, 128, 192, 256, 300)
    assert bucket_lengths(200, 64) == (64, 96, 128, 192, 200)
    assert bucket_lengths(16, 32) == (16,)
    assert bucket_lengths(3, 2) == (2, 3)


def test_smallest_bucket_that_fits():
    buckets = (32, 64, 128)
    assert [bucket_for(n, buckets) for n in (1, 32, 33, 128)] == [32, 32, 64, 128]
    with pytest.raises(ValueError, match="129 tokens does not fit"):
        bucket_for(129, buckets)
    with pytest.raises(ValueError):
        bucket_for(0, buckets)


def test_bucketer_emits_full_batches_then_flushes_partials():
    bucketer = Bucketer((4, 8), batch_size=2)
    emitted = []
    for key, n in [("a", 3), ("b", 7), ("c", 4), ("d", 2), ("e", 8)]:
        emitted += [(b.length, b.items) for b in bucketer.add(key, n)]
    assert emitted == [(4, ["a", "c"]), (8, ["b", "e"])]
    assert len(bucketer) == 1
    assert [(b.length, b.items) for b in bucketer.flush()] == [(4, ["d"])]
    assert len(bucketer) == 0


def test_partial_batches_pad_rows_to_a_power_of_two_on_the_data_axis():
    from model.extract import padded_rows
    assert [padded_rows(n, 8, 1) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert [padded_rows(n, 16, 4) for n in (1, 4, 5, 9, 16)] == [4, 4, 8, 16, 16]
    assert padded_rows(3, 6, 2) == 4 and padded_rows(5, 6, 2) == 6
