"""The bytes-to-loss benchmark reads each case's curve from the training job's metrics.csv:
validation loss, cross-node bytes and training seconds at each validation."""
from tensorplay_hpc.bench.cli import available
from tensorplay_hpc.bench.local_sgd import CASES, Curve
from tensorplay_hpc.train.history import History


def test_curve_has_the_validation_steps_bytes_and_seconds_of_the_metrics(tmp_path):
    history = History(losses=[5.0, 4.0, 3.0, 2.5], tokens_per_second=[100.0, 200.0, 400.0, 320.0],
                      validation={2: 4.5, 4: 2.75}, cross_node_bytes={2: 1000, 3: 1500, 4: 2048})
    history.write_csv(tmp_path / "metrics.csv")
    curve = Curve.read(tmp_path / "metrics.csv", tokens_per_step=64)
    assert curve == Curve(steps=[2, 4], losses=[4.5, 2.75], crossed=[1000, 2048],
                          seconds=[2 * 64 / 200.0, 4 * 64 / 320.0])


def test_benchmark_is_listed_and_compares_every_kind_with_ddp_first():
    assert "local-sgd" in available()
    names = [case.name for case in CASES]
    assert names[0] == "ddp" and len(set(names)) == len(names) == 11
    assert {"postlocal period=4", "postlocal period=16", "diloco H=16", "diloco H=64",
            "diloco H=256", "diloco H=16 bfloat16", "diloco H=64 fragments=4",
            "diloco H=64 node-local"} <= set(names)
