"""The bytes-to-loss benchmark reads each case's curve from the training job's metrics.csv:
validation loss, cross-node bytes and training seconds at each validation; its nodes' link is
throttled to the rate it names."""
import subprocess
import time

import pytest

from launch import only_in_single_rank_run
from simulated_nodes import NodesUnavailable, SimulatedNodes
from tensorplay_hpc.bench.cli import available
from tensorplay_hpc.bench.local_sgd import CASES, LINK, STEPS, Curve
from tensorplay_hpc.train.history import History

RECEIVE = ("import socket\n"
           "server = socket.create_server(('0.0.0.0', 5001))\n"
           "connection, _ = server.accept()\n"
           "while connection.recv(1 << 20):\n"
           "    pass\n")


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
    assert names[0] == "ddp" and len(set(names)) == len(names) == 13
    assert {"postlocal period=4", "postlocal period=16", "diloco H=16", "diloco H=64",
            "diloco H=256", "diloco H=16 bfloat16", "diloco H=64 fragments=4",
            "diloco H=64 node-local", "diloco H=64 node-local 1024 steps"} <= set(names)
    assert {case.steps for case in CASES} == {STEPS, 2 * STEPS}


def test_first_validation_within_a_loss():
    curve = Curve(steps=[64, 128, 192], losses=[3.0, 2.04, 1.9], crossed=[1, 2, 3],
                  seconds=[1.0, 2.0, 3.0])
    assert curve.first_within(2.05) == 1 and curve.first_within(1.9) == 2
    assert curve.first_within(1.5) is None


@only_in_single_rank_run
def test_throttled_nodes_send_at_the_benchmarks_link_rate():
    """5 MB from n1 to n2 take at least 0.3 s at 100 Mbit/s (0.4 s at the full rate; a
    32 kB burst above it)."""
    assert LINK == "100mbit"
    try:
        cluster = SimulatedNodes(nodes=2, slots=1, throttle=LINK).start()
    except NodesUnavailable as reason:
        pytest.skip(f"no simulated nodes: {reason}")
    try:
        shown = cluster.run(["tc", "qdisc", "show", "dev", "eth0"], node="n1",
                            capture_output=True, text=True, timeout=30).stdout
        assert "tbf" in shown and "rate 100Mbit" in shown, shown
        receiver = subprocess.Popen([*cluster.enter("n2"), "python3", "-c", RECEIVE])
        send = (f"import socket, time\n"
                f"for attempt in range(50):\n"
                f"    try:\n"
                f"        s = socket.create_connection(('{cluster.address('n2')}', 5001))\n"
                f"        break\n"
                f"    except OSError:\n"
                f"        time.sleep(0.1)\n"
                f"start = time.perf_counter()\n"
                f"s.sendall(bytes(5_000_000))\n"
                f"s.shutdown(socket.SHUT_WR)\n"
                f"s.recv(1)\n"
                f"print(time.perf_counter() - start)\n")
        result = cluster.run(["python3", "-c", send], node="n1", capture_output=True,
                             text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert float(result.stdout) >= 0.3
        receiver.wait(timeout=30)
    finally:
        cluster.stop()
