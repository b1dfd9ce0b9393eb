"""Timing helpers of the benchmarks: interleaved rounds give one sample per function and round,
and the spread is the samples' range over their median."""
from tensorplay_hpc.bench.timing import interleaved, spread


def test_spread_is_the_range_over_the_median():
    assert spread([2.0, 1.0, 4.0]) == 1.5
    assert spread([3.0, 3.0]) == 0.0


def test_interleaved_gives_each_function_one_sample_a_round(world):
    calls = {"a": 0, "b": 0}

    def count(name):
        def call():
            calls[name] += 1
        return call

    samples = interleaved([count("a"), count("b")], repeat=5, warmup=1, comm=world)
    assert [len(s) for s in samples] == [5, 5]
    assert all(seconds >= 0 for s in samples for seconds in s)
    assert calls["a"] >= 1 + 1 + 5 and calls["b"] >= 1 + 1 + 5   # warm-up, probe, rounds
