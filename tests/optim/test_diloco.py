"""DiLoCoOptimizer: parity with post-local SGD and with a reference that simulates every replica
in one process (fragments, Nesterov outer steps, overlapped syncs, 16-bit deltas, node-local
data parallelism), checkpoints that resume exactly, and the errors on bad input."""
import copy

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.comm import lifetime
from tensorplay_hpc.distributed.algorithms.model_averaging import averagers
from tensorplay_hpc.distributed.optim import DiLoCoOptimizer, PostLocalSGDOptimizer
from tensorplay_hpc.distributed.optim.fragment_schedule import FragmentSchedule

WORLD = MPI.COMM_WORLD
pytestmark = pytest.mark.timeout(60)
# The test model's 4 parameters hold 32, 8, 24 and 3 elements: 3 fragments balanced by element
# count are [0], [1], [2, 3]; 2 fragments are [0], [1, 2, 3].
FRAGMENTS = {1: [[0, 1, 2, 3]], 2: [[0], [1, 2, 3]], 3: [[0], [1], [2, 3]]}


class _Double(torch.nn.Module):
    def forward(self, x):
        return x.double()


def _model(mixed=False):
    """float64; ``mixed``: the first layer in float32, so that fragment 1 spans two dtypes."""
    torch.manual_seed(0)
    first = torch.nn.Linear(4, 8) if mixed else torch.nn.Linear(4, 8).double()
    return torch.nn.Sequential(first, torch.nn.Tanh(), _Double(), torch.nn.Linear(8, 3).double())


def _loss(model, replica, step):
    """The loss of ``replica``'s batch at inner step ``step``: the same on every rank."""
    generator = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(5, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    return torch.nn.functional.mse_loss(model(x.to(model[0].weight.dtype)), y)


def _inner(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _outer(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class Reference:
    """DiLoCo written out for every replica in one process. A replica is a group of ranks
    (one rank, or a node with ``node_local``) whose gradient is the average of its ranks'."""

    def __init__(self, groups, sync_every, fragments, overlap_steps=0, delta_dtype=None,
                 mixed=False):
        self.groups = groups
        self.models = [_model(mixed) for _ in groups]
        self.inner = [_inner(m.parameters()) for m in self.models]
        self.global_ = [p.detach().clone().requires_grad_() for p in self.models[0].parameters()]
        self.outer = _outer(self.global_)
        self.sync_every, self.fragments = sync_every, FRAGMENTS[fragments]
        self.overlap_steps, self.delta_dtype = overlap_steps, delta_dtype
        self.steps = 0
        self.in_flight = []   # (fragment, started, average, each replica's fragment at start)

    def load(self, state):
        for model, inner in zip(self.models, self.inner):
            with torch.no_grad():
                for p, g in zip(model.parameters(), state["global"]):
                    p.copy_(g)
            inner.load_state_dict(copy.deepcopy(state["inner"]))
        with torch.no_grad():
            for p, g in zip(self.global_, state["global"]):
                p.copy_(g)
        self.outer.load_state_dict(copy.deepcopy(state["outer"]))
        self.steps = state["inner_steps"]

    def _params(self, replica, fragment):
        params = list(self.models[replica].parameters())
        return [params[i] for i in self.fragments[fragment]]

    def step(self):
        step = self.steps + 1
        for model, inner, ranks in zip(self.models, self.inner, self.groups):
            grads = []
            for rank in ranks:
                model.zero_grad()
                _loss(model, rank, step).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for i, p in enumerate(model.parameters()):
                total = grads[0][i]
                for other in grads[1:]:
                    total = total + other[i]
                p.grad = total / len(ranks)
            inner.step()
        self.steps = step
        for entry in [e for e in self.in_flight if e[1] + self.overlap_steps == step]:
            self.in_flight.remove(entry)
            self._apply(*entry)
        for f in range(len(self.fragments)):
            if (step - f * self.sync_every // len(self.fragments)) % self.sync_every == 0:
                entry = self._start(f)
                if self.overlap_steps:
                    self.in_flight.append(entry)
                else:
                    self._apply(*entry)

    def _start(self, f):
        average = []
        for k, i in enumerate(self.fragments[f]):
            deltas = [self.global_[i].detach() - self._params(r, f)[k].detach()
                      for r in range(len(self.models))]
            if self.delta_dtype is not None:
                deltas = [d.to(self.delta_dtype) for d in deltas]
            total = deltas[0]
            for d in deltas[1:]:
                total = total + d
            average.append(total.to(self.global_[i].dtype) / len(deltas))
        local = [[p.detach().clone() for p in self._params(r, f)] for r in range(len(self.models))]
        return f, self.steps, average, local

    def _apply(self, f, started, average, local):
        for p in self.global_:
            p.grad = None
        for i, delta in zip(self.fragments[f], average):
            self.global_[i].grad = delta
        self.outer.step()
        with torch.no_grad():
            for r in range(len(self.models)):
                for k, (i, p) in enumerate(zip(self.fragments[f], self._params(r, f))):
                    drift = p - local[r][k] if self.overlap_steps else None
                    p.copy_(self.global_[i])
                    if drift is not None:
                        p.add_(drift)


def _train(optimizer, model, steps, first=1):
    for step in range(first, first + steps):
        optimizer.zero_grad()
        _loss(model, WORLD.rank, step).backward()
        optimizer.step()


def _diloco(process_group=None, mixed=False, **options):
    """A model whose parameters differ on every rank but 0 (the construction broadcasts rank
    0's), and DiLoCo over it."""
    model = _model(mixed)
    if WORLD.rank:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(WORLD.rank)
    return model, DiLoCoOptimizer(_inner(model.parameters()), _outer(model.parameters()),
                                  process_group=process_group, **options)


def _check(model, optimizer, reference, replica, exact):
    """``exact``: bit for bit. Otherwise within 1e-12: at more than 2 ranks MPI may add the
    ranks' values in another order than the reference's sum from rank 0 up (e.g. (a+b)+(c+d)),
    and floating-point addition is not associative."""
    ours = list(model.parameters()) + optimizer.state_dict()["global"]
    theirs = list(reference.models[replica].parameters()) + reference.global_
    for a, b in zip(ours, theirs):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_fragments_are_balanced_by_elements_and_staggered():
    schedule = FragmentSchedule([32, 8, 24, 3], fragments=3, sync_every=5, overlap_steps=0)
    assert schedule.bounds == [(0, 1), (1, 2), (2, 4)]
    # offsets 0, 5 // 3 = 1 and 10 // 3 = 3
    assert [schedule.starting(s) for s in range(0, 11)] == [
        [], [1], [], [2], [], [0], [1], [], [2], [], [0]]
    assert FragmentSchedule([1, 1, 100, 1], 2, 4, 0).bounds == [(0, 2), (2, 4)]


@pytest.mark.filterwarnings("ignore:With a period of 1")
def test_sync_every_step_with_plain_outer_sgd_equals_averaging_every_step(world):
    """Outer SGD(lr=1) sets global to global - (global - mean(local)), which is the average up
    to rounding (the subtraction and addition each round), so not bitwise."""
    models = [_model(), _model()]
    ours = DiLoCoOptimizer(torch.optim.SGD(models[0].parameters(), lr=0.05, momentum=0.9),
                           torch.optim.SGD(models[0].parameters(), lr=1.0), sync_every=1)
    averaged = PostLocalSGDOptimizer(
        torch.optim.SGD(models[1].parameters(), lr=0.05, momentum=0.9),
        averagers.PeriodicModelAverager(period=1))
    _train(ours, models[0], 6)
    _train(averaged, models[1], 6)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    ours.close()


@pytest.mark.parametrize("fragments,overlap_steps,mixed", [(1, 0, False), (3, 1, False),
                                                          (2, 1, True)])
def test_equals_the_reference_with_nesterov_fragments_and_overlap(world, fragments,
                                                                  overlap_steps, mixed):
    model, ours = _diloco(sync_every=6, fragments=fragments, overlap_steps=overlap_steps,
                          mixed=mixed)
    reference = Reference([[r] for r in range(world.size)], 6, fragments, overlap_steps,
                          mixed=mixed)
    for step in range(1, 15):
        _train(ours, model, 1, first=step)
        reference.step()
    _check(model, ours, reference, world.rank, exact=world.size <= 2)
    # bytes: every start sends its fragment's deltas in the parameters' dtypes (none on one rank)
    sizes = [sum(p.nbytes for p in reference._params(0, f)) for f in range(fragments)]
    starts = [sum(1 for s in range(1, 15) if (s - f * 6 // fragments) % 6 == 0)
              for f in range(fragments)]
    assert ours.bytes_synced == (sum(n * k for n, k in zip(sizes, starts))
                                 if world.size > 1 else 0)
    ours.close()


def test_16_bit_deltas_equal_the_reference_with_the_same_casts(world):
    model, ours = _diloco(sync_every=4, fragments=2, delta_dtype=torch.bfloat16)
    cast = Reference([[r] for r in range(world.size)], 4, 2, delta_dtype=torch.bfloat16)
    full = Reference([[r] for r in range(world.size)], 4, 2)
    for step in range(1, 10):
        _train(ours, model, 1, first=step)
        cast.step()
        full.step()
    # bfloat16 sums of 4 ranks may round in another order than the reference's: a few units
    # of bfloat16's last place of the deltas (about 1e-2), well below 1e-3 after averaging
    for a, b, c in zip(model.parameters(), cast.models[world.rank].parameters(),
                       full.models[world.rank].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 if world.size <= 2 else 1e-3)
        assert (a - c).abs().max() > 1e-6     # the casts did happen
    ours.close()


def test_node_local_equals_the_reference_where_nodes_average_gradients(world):
    nodes = comm.NodeLayout(world).nodes
    model, ours = _diloco(sync_every=4, fragments=2, overlap_steps=1, node_local=True)
    reference = Reference([list(ranks) for ranks in nodes], 4, 2, overlap_steps=1)
    for step in range(1, 11):
        _train(ours, model, 1, first=step)
        reference.step()
    node = next(n for n, ranks in enumerate(nodes) if world.rank in ranks)
    _check(model, ours, reference, node,
           exact=len(nodes) <= 2 and max(len(ranks) for ranks in nodes) <= 2)
    # each rank of a node sends its share of the fragment's deltas to the other nodes
    share = 0
    if len(nodes) > 1:
        size, rank = len(nodes[node]), nodes[node].index(world.rank)
        for f, starts in ((0, 2), (1, 3)):   # fragment 0 after steps 4 and 8, 1 after 2, 6, 10
            n = sum(p.numel() for p in reference._params(0, f))
            share += starts * 8 * (n // size + (rank < n % size))
    assert ours.bytes_synced == share
    ours.close()


def test_state_dict_mid_schedule_with_a_sync_in_flight_resumes_exactly(world):
    model, ours = _diloco(sync_every=6, fragments=3, overlap_steps=1)
    _train(ours, model, 8)                     # fragment 1 started its sync after step 8
    state = copy.deepcopy(ours.state_dict())   # as a checkpoint would keep it
    assert [entry["fragment"] for entry in state["in_flight"]] == [1]
    saved_model = copy.deepcopy(model.state_dict())
    resumed_model, resumed = _diloco(sync_every=6, fragments=3, overlap_steps=1)
    resumed_model.load_state_dict(saved_model)
    resumed.load_state_dict(state)
    _train(ours, model, 7, first=9)
    _train(resumed, resumed_model, 7, first=9)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    ours.close()
    resumed.close()


def test_an_hdf5_checkpoint_with_a_sync_in_flight_resumes_exactly(world, folder):
    from tensorplay_hpc import checkpoint
    model, ours = _diloco(sync_every=6, fragments=3, overlap_steps=1)
    _train(ours, model, 8)                     # fragment 1 started its sync after step 8
    path = checkpoint.save(f"{folder}/diloco.h5", model, ours, replica_group=MPI.COMM_SELF)
    resumed_model, resumed = _diloco(sync_every=6, fragments=3, overlap_steps=1)
    checkpoint.load(path, resumed_model, resumed, replica_group=MPI.COMM_SELF)
    _train(ours, model, 7, first=9)
    _train(resumed, resumed_model, 7, first=9)
    for a, b in zip(list(model.parameters()) + ours.state_dict()["global"],
                    list(resumed_model.parameters()) + resumed.state_dict()["global"]):
        assert torch.equal(a, b)
    if world.size > 1:   # the syncs in flight need the ranks that started them
        with pytest.raises(checkpoint.CheckpointError, match="saved on .* ranks with a DiLoCo "
                           "sync in flight"):
            alone_model, alone = _diloco(sync_every=6, fragments=3, overlap_steps=1,
                                         process_group=MPI.COMM_SELF)
            try:
                checkpoint.load(path, alone_model, alone, process_group=MPI.COMM_SELF)
            finally:
                alone.close()
    ours.close()
    resumed.close()


def test_a_state_from_one_rank_loads_at_the_world_size_at_a_sync_boundary(world):
    alone_model = _model()   # every rank runs the same one-rank job, on replica 0's data
    alone = DiLoCoOptimizer(_inner(alone_model.parameters()), _outer(alone_model.parameters()),
                            sync_every=4, process_group=MPI.COMM_SELF)
    for step in range(1, 5):
        alone.zero_grad()
        _loss(alone_model, 0, step).backward()
        alone.step()
    state = copy.deepcopy(alone.state_dict())
    assert state["in_flight"] == [] and state["inner_steps"] == 4
    model, ours = _diloco(sync_every=4)
    model.load_state_dict(alone_model.state_dict())
    ours.load_state_dict(state)
    reference = Reference([[r] for r in range(world.size)], 4, 1)
    reference.load(state)
    for step in range(5, 13):
        _train(ours, model, 1, first=step)
        reference.step()
    _check(model, ours, reference, world.rank, exact=world.size <= 2)
    alone.close()
    ours.close()


@pytest.mark.parametrize("options,message", [
    ({"sync_every": 0}, "sync_every must be at least 1, got 0"),
    ({"sync_every": 4, "fragments": 5},
     r"fragments must be between 1 and the number of parameters \(4\), got 5"),
    ({"sync_every": 4, "fragments": 2, "overlap_steps": 2},
     r"overlap_steps must be at least 0 and below sync_every // fragments = 2"),
    ({"sync_every": 4, "delta_dtype": torch.int8}, "delta_dtype must be None"),
])
def test_bad_settings_are_refused_on_every_rank(world, options, message):
    model = _model()
    with pytest.raises(ValueError, match=rf"{message}.*\(rank {world.rank}\)"):
        DiLoCoOptimizer(_inner(model.parameters()), _outer(model.parameters()), **options)


def test_an_outer_optimizer_over_other_parameters_is_refused(world):
    model = _model()
    with pytest.raises(ValueError, match=rf"the outer optimizer must hold the same parameters "
                                         rf"as the inner one.*\(rank {world.rank}\)"):
        DiLoCoOptimizer(_inner(model.parameters()), _outer(list(model.parameters())[:2]), 4)


@pytest.mark.mpi(min_size=2)
def test_a_rank_with_another_model_is_named(world):
    model = _model() if world.rank != 1 else torch.nn.Sequential(
        torch.nn.Linear(4, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    with pytest.raises(ValueError, match=r"ranks \[1\] differ from rank 0.*parameter 0"):
        DiLoCoOptimizer(_inner(model.parameters()), _outer(model.parameters()), 4)


def test_parameters_cannot_be_added_later(world):
    model, ours = _diloco(sync_every=4)
    with pytest.raises(NotImplementedError, match=rf"parameters are fixed.*rank {world.rank}"):
        ours.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    ours.close()


def test_a_state_with_other_settings_is_refused(world):
    model, saved = _diloco(sync_every=4)
    state = saved.state_dict()
    model, ours = _diloco(sync_every=4, fragments=2)
    with pytest.raises(ValueError, match=rf"saved with fragments=1 \(this optimizer has 2\) "
                                         rf"\(rank {world.rank}\)"):
        ours.load_state_dict(state)
    saved.close()
    ours.close()


def test_close_frees_the_communicators_and_a_later_step_is_an_error(world):
    before = len(lifetime.open_objects())
    model, ours = _diloco(sync_every=2, node_local=True)
    assert len(lifetime.open_objects()) == before + 3   # the group, the node, the other nodes
    ours.close()
    ours.close()                                        # closing again does nothing
    assert len(lifetime.open_objects()) == before
    with pytest.raises(RuntimeError, match=rf"DiLoCoOptimizer is closed.*rank {world.rank}"):
        ours.step()
