import collections

from transforms.partition import bucket_of, machines_for_buckets


def test_largest_buckets_go_to_the_least_loaded_machine():
    plan = machines_for_buckets({0: 10, 1: 7, 2: 6, 3: 2, 4: 1}, num_machines=2)
    # 10 -> m0; 7 -> m1; 6 -> m1 (7 < 10); 2 -> m0 (10 < 13); 1 -> m0 (12 < 13)
    assert plan == {0: 0, 1: 1, 2: 1, 3: 0, 4: 0}


def test_ties_break_by_bucket_then_machine_id():
    assert machines_for_buckets({5: 1, 3: 1, 4: 1}, num_machines=3) == {3: 0, 4: 1, 5: 2}


def test_every_bucket_gets_exactly_one_machine():
    buckets = {b: (b * 7919) % 113 for b in range(64)}
    plan = machines_for_buckets(buckets, num_machines=4)
    assert sorted(plan) == list(range(64)) and set(plan.values()) == {0, 1, 2, 3}


def test_buckets_are_roughly_uniform():
    counts = collections.Counter(bucket_of(i, 16) for i in range(16000))
    assert min(counts.values()) > 850 and max(counts.values()) < 1150
