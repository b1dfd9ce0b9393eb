"""Join: ranks with fewer inputs shadow the collectives of the others."""
import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from joinables import CPUJoinable
from tensorplay_hpc.distributed.algorithms.join import Join, JoinHook


class _CountingHook(JoinHook):
    def __init__(self, counter):
        self.counter = counter

    def main_hook(self):
        self.counter.all_reduce(0)

    def post_hook(self, is_last_joiner):
        self.counter.last_joiner = is_last_joiner


class Counter(CPUJoinable):
    """Adds up, every iteration, one per rank still training: a collective to shadow."""

    def __init__(self, process_group=None):
        super().__init__(process_group)
        self.total = 0
        self.last_joiner = None

    def all_reduce(self, value):
        tensor = torch.tensor([value], dtype=torch.int64)
        comm.all_reduce(tensor, self.group.comm)
        self.total += int(tensor.item())

    def iteration(self):
        Join.notify_join_context(self)
        self.all_reduce(1)

    def join_hook(self, **kwargs):
        return _CountingHook(self)


def _inputs(rank):
    return 2 + rank


def test_uneven_inputs_are_shadowed(world):
    rank, size = world.Get_rank(), world.Get_size()
    counter = Counter()
    with Join([counter]):
        for _ in range(_inputs(rank)):
            counter.iteration()
    # every iteration of every rank is counted on every rank
    assert counter.total == sum(_inputs(r) for r in range(size))
    assert counter.last_joiner is (rank == size - 1)
    # outside the context the joinable is switched off again
    assert Join.notify_join_context(counter) is None


def test_two_joinables_share_one_context(world):
    rank, size = world.Get_rank(), world.Get_size()
    first, second = Counter(), Counter()
    with Join([first, second]):
        for _ in range(_inputs(rank)):
            first.iteration()
            second.iteration()  # not the first joinable: its notify is a no-op
    expected = sum(_inputs(r) for r in range(size))
    assert (first.total, second.total) == (expected, expected)


@pytest.mark.mpi(min_size=2)
def test_throw_on_early_termination(world):
    rank = world.Get_rank()
    counter = Counter()
    with pytest.raises(RuntimeError) as raised:
        with Join([counter], throw_on_early_termination=True):
            for _ in range(_inputs(rank)):
                counter.iteration()
    if rank == 0:
        assert str(raised.value) == "Rank 0 exhausted all inputs."
    else:
        assert "Detected at least one rank that exhausted inputs" in str(raised.value)
    # every rank did exactly the first rank's iterations before stopping
    assert counter.total == _inputs(0) * world.Get_size()


def test_even_inputs_with_throw_run_to_the_end(world):
    counter = Counter()
    with Join([counter], throw_on_early_termination=True):
        for _ in range(3):
            counter.iteration()
    assert counter.total == 3 * world.Get_size()
    assert counter.last_joiner is True


def test_disabled_join_runs_no_hooks(world):
    counter = Counter()
    with Join([counter], enable=False):
        for _ in range(2):
            assert Join.notify_join_context(counter) is None
            counter.all_reduce(1)
    assert counter.total == 2 * world.Get_size()
    assert counter.last_joiner is None


def test_notify_returns_a_handle_inside_the_context(world):
    counter = Counter()
    with Join([counter]):
        work = Join.notify_join_context(counter)
        assert work.wait() is True
        counter.all_reduce(1)
    assert counter.total == world.Get_size()


def test_needs_a_joinable():
    with pytest.raises(ValueError, match="at least one joinable"):
        Join([])


def test_an_entry_that_is_not_joinable_is_named():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"joinables\[1\] is a Linear, which is not a Joinable"):
        Join([Counter(MPI.COMM_WORLD), model])


@pytest.mark.mpi(min_size=2)
def test_joinables_on_different_groups_are_rejected(world):
    with pytest.raises(ValueError, match="multiple process groups"):
        Join([Counter(MPI.COMM_WORLD), Counter(MPI.COMM_SELF)])


def test_joinable_must_call_the_base_constructor():
    class Forgetful(Counter):
        def __init__(self):  # skips Joinable.__init__
            pass

    with pytest.raises(RuntimeError, match="Joinable.__init__"):
        Join.notify_join_context(Forgetful())
