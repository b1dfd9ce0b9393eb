"""The training loop: data-parallel steps, checkpoints, preemption and resume, outputs."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from tensorplay_hpc import checkpoint, comm
from tensorplay_hpc.comm import capabilities, fault_tolerance, trace
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.node_layout import NodeLayout
from tensorplay_hpc.comm.small_collectives import all_gather_object, barrier

from . import strategy as strategies
from .config import TrainConfig, UsageError
from .cross_node import CrossNodeBytes
from .data import VOCAB_SIZE, Corpus, batch_for_rank, validation_batches
from .history import History
from .model import CharTransformer, next_token_loss
from .plot import plot_losses
from .preemption import EXIT_PREEMPTED, Preemption
from .preflight import check_launch
from .progress import Progress
from .recovery import EXIT_UNRECOVERABLE, Rollback, Unrecoverable, refusal, survive
from .run_folder import METRICS_FILE, PLOT_FILE, write_settings
from .timeline import TIMELINE_FILE, plot_timeline

__all__ = ["Outcome", "Run", "threads_per_rank", "train"]


@dataclass
class Outcome:
    """How a run ended. ``exit_code`` is 0, or :data:`EXIT_PREEMPTED` after a signal."""

    steps: int
    loss: float
    validation_loss: Optional[float]
    tokens_per_second: float
    checkpoint: Optional[str]
    exit_code: int


def threads_per_rank(world: MPI.Intracomm, requested: int) -> int:
    """``--threads``, else Slurm's CPUs per task, else the node's cores over its ranks."""
    if requested:
        return requested
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(os.environ["SLURM_CPUS_PER_TASK"])
    layout = NodeLayout(world)
    ranks_here = len(layout.nodes[layout.node])
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


def _device(config: TrainConfig, world: MPI.Intracomm) -> torch.device:
    """The rank's device; :class:`UsageError` on every rank when a rank has no GPU for
    ``--device cuda``. Collective."""
    if config.device == "cpu":
        return torch.device("cpu")
    without = [rank for rank, has in enumerate(all_gather_object(torch.cuda.is_available(), world))
               if not has]
    if without:
        raise UsageError(f"--device cuda, but ranks {without} of {world.Get_size()} see no GPU "
                         "(torch.cuda.is_available() is False there): use --device cpu, or "
                         "launch where every rank has a GPU")
    device = comm.device_for_rank(world)
    torch.cuda.set_device(device)
    return device


def _enable_recovery(config: TrainConfig, world: MPI.Intracomm) -> None:
    """Turn lost ranks into :class:`~tensorplay_hpc.comm.fault_tolerance.RankLost` where ULFM
    works (before the run makes its first communicator), and say on rank 0 when a lost rank
    will end the job instead. Local."""
    unavailable = capabilities.recovery_unavailable()
    if unavailable is None:
        fault_tolerance.enable()
    reason = refusal(config)
    if reason is not None and world.Get_rank() == 0:
        ending = ("the job" if unavailable else
                  f"the job with status {EXIT_UNRECOVERABLE} on every survivor")
        print(f"--recover: a lost rank will end {ending}: {reason}", flush=True)


class Run(comm.Closeable):
    """One training run on every rank of ``world``: build, maybe resume, train, report.

    Collective: construct it, call :meth:`train` and :meth:`close` (or use it as a context
    manager) on every rank.
    """

    def __init__(self, config: TrainConfig, world: Optional[MPI.Intracomm] = None) -> None:
        world = MPI.COMM_WORLD if world is None else world
        if config.recover:
            _enable_recovery(config, world)
        self._resumable = check_launch(config, world)
        if config.trace is not None:
            trace.enable(config.trace)
        self.config = config
        torch.set_num_threads(threads_per_rank(world, config.threads))
        self.device = _device(config, world)
        self.corpus = Corpus.from_stdlib()
        self._build(world)
        self.history = History()
        self.last_checkpoint: Optional[str] = None
        self._checkpointer: Optional[checkpoint.AsyncCheckpointer] = None
        self._saving: Optional[Tuple[checkpoint.SaveHandle, int]] = None   # in the background
        # The state of the last committed steps, where the survivors of a lost rank go on.
        self._rollback = Rollback() if fault_tolerance.enabled() and not refusal(config) else None

    def _build(self, world: MPI.Intracomm) -> None:
        """The run's group, model, optimizer and validation batches over the ranks of
        ``world`` (the model as ``config.seed`` makes it). Collective over ``world``."""
        config = self.config
        self.world = world
        self.group = comm.ProcessGroup(world, owner="the training run")
        torch.manual_seed(config.seed)
        module = CharTransformer(VOCAB_SIZE, config.context, config.width, config.layers,
                                 config.heads).to(self.device)
        self.strategy = strategies.build(module, config, self.group)
        self.validation = [tuple(t.to(self.device) for t in batch) for batch in validation_batches(
            self.corpus.validation, seed=config.seed, batches=config.eval_batches,
            batch_size=config.batch_size, context=config.context, rank=self.group.rank,
            world_size=self.group.size)]

    def close(self) -> None:
        """Free the communicators of the model, the optimizer and the run (after the
        background checkpoint, if one is being written). Collective. After a recovery, the
        survivors leave together: they end without ``MPI_Finalize``
        (:func:`~tensorplay_hpc.comm.fault_tolerance.finalize_would_stall`)."""
        if self._checkpointer is not None:
            self._checkpointer.close()
        if self._rollback is not None:
            self._rollback.close()
        self.strategy.close()
        if fault_tolerance.finalize_would_stall():
            barrier(self.group.comm)
        self.group.close()

    # -- pieces -----------------------------------------------------------------------------

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.config.context

    def _say(self, line: str) -> None:
        if self.group.rank == 0:
            print(line, flush=True)

    def _introduce(self) -> None:
        config, parameters = self.config, sum(p.numel() for p in self.strategy.module.parameters())
        self._say(f"tensorplay-hpc train: {self.group.size} ranks on {self.device.type}, "
                  f"--optimizer {config.optimizer} --inner {config.inner} --lr {config.lr}, "
                  f"{parameters / 1e6:.2f}M parameters ({config.layers} layers, width "
                  f"{config.width}, {config.heads} heads, context {config.context})")
        self._say(f"corpus: Python {sys.version_info.major}.{sys.version_info.minor} standard "
                  f"library, {self.corpus.files} files: {self.corpus.train.numel() / 1e6:.1f} MB "
                  f"train, {self.corpus.validation.numel() / 1e6:.1f} MB validation; "
                  f"{config.steps} steps of {config.batch_size} x {config.context} bytes")

    def _load_newest(self) -> Optional[Tuple[str, Dict[str, Any]]]:
        """``(path, extras)`` of the newest checkpoint that fits the run and loads (the ranks
        verify its checksums together), passing over damaged ones; ``None`` if none loads.
        Collective."""
        for path in reversed(self._resumable):
            try:
                with trace.caller("checkpoint load"):
                    return path, checkpoint.load(path, model=self.strategy.module,
                                                 optimizer=self.strategy.optimizer,
                                                 process_group=self.world,
                                                 replica_group=self.strategy.replica_group)
            except checkpoint.CheckpointError as error:
                self._say(f"--resume: passing over {path}: {error}")
        return None

    def _resume(self) -> None:
        """Continue from the newest checkpoint that loads; start at step 0 if the folder has
        none. :class:`UsageError` on every rank, before anything is written, when it has some
        and none loads. Collective."""
        directory = self.config.checkpoint_dir
        if not self._resumable:
            self._say(f"--resume: no checkpoint in {directory}, starting at step 0")
            return
        found = self._load_newest()
        if found is None:
            raise UsageError(f"--resume: none of the {len(self._resumable)} checkpoints in "
                             f"{directory} loads (see above), and nothing was written; move "
                             "them away to start afresh, or choose another --run-dir")
        path, extra = found
        for change in self.config.changes_from(extra["config"]):
            self._say(f"--resume: {change}")
        self.history = History.from_extra(extra["history"])
        self.history.restarts.append(self.history.step)
        self.strategy.resumed_at(self.history.step, extra)
        # Loading the optimizer's state brought back the checkpoint's hyperparameters: the
        # command line's apply, as the changes printed above say.
        self.strategy.apply_hyperparameters(self.config)
        self.last_checkpoint = path
        saved_ranks = int(extra["config"].get("ranks", self.group.size))
        note = ("" if saved_ranks == self.group.size else
                f" (saved by {saved_ranks} ranks: the losses may differ in the last digits from "
                "an uninterrupted run)")
        self._say(f"resumed from {path} at step {self.history.step}{note}")

    def _validate(self) -> float:
        module = self.strategy.module
        module.eval()
        with torch.no_grad():
            losses = torch.stack([next_token_loss(module, x, y) for x, y in self.validation])
        module.train()
        mean = losses.mean().double().cpu().reshape(1)
        with trace.caller("validation"):
            comm.all_reduce(mean, self.group.comm, comm.ReduceOp.AVG)
        return mean.item()

    def _save(self, progress: Progress, reason: str, background: bool = False) -> None:
        """Checkpoint now, after the background save still being written (if any): blocking,
        or in the ``background`` (training stalls only for the host copy). Collective."""
        self._finish_save(progress)
        step = self.history.step
        path = str(self.config.checkpoint_dir / f"step-{step:07d}.h5")
        started = time.perf_counter()
        extra = {"step": step, "config": {**self.config.describe(), "ranks": self.group.size},
                 "history": self.history.to_extra(), **self.strategy.hook_extra()}
        state = dict(model=self.strategy.module, optimizer=self.strategy.optimizer,
                     extra=extra, keep=self.config.keep or None,
                     replica_group=self.strategy.replica_group)
        with trace.caller("checkpoint save"), trace.span("checkpoint save", "io"):
            if background:
                if self._checkpointer is None:
                    self._checkpointer = checkpoint.AsyncCheckpointer(self.world)
                self._saving = (self._checkpointer.save(path, **state), step)
                return
            self.last_checkpoint = checkpoint.save(path, process_group=self.world, **state)
        progress.say(f"checkpoint at step {step} ({reason}): {self.last_checkpoint} "
                     f"in {time.perf_counter() - started:.1f} s")
        self._write_outputs()

    def _finish_save(self, progress: Progress, if_done: bool = False) -> None:
        """Wait for the checkpoint being written in the background and report it; with
        ``if_done``, only once every rank's write has finished. Collective."""
        if self._saving is None:
            return
        handle, step = self._saving
        if if_done:
            done = torch.tensor([int(handle.done())])
            comm.all_reduce(done, self.group.comm, comm.ReduceOp.MIN)
            if not done.item():
                return
        self._saving = None
        with trace.caller("checkpoint save"):
            self.last_checkpoint = handle.wait()
        progress.say(f"checkpoint at step {step} (periodic): {self.last_checkpoint}, training "
                     f"stalled {handle.stall_seconds:.3f} s, written in the background in "
                     f"{handle.write_seconds:.1f} s")
        self._write_outputs()

    def _write_outputs(self) -> None:
        if self.group.rank != 0:
            return
        self.history.write_csv(self.config.run_dir / METRICS_FILE)
        c = self.config
        plot_losses(self.history, self.config.run_dir / PLOT_FILE,
                    f"{self.group.size} ranks, --optimizer {c.optimizer} --inner {c.inner}, "
                    f"{c.layers}x{c.width} transformer")

    def train_step(self, step: int) -> float:
        """Step ``step + 1`` on this rank's share of the global batch: forward, backward, the
        optimizer's step; returns this rank's loss. Collective (the strategy's communication)."""
        config, s = self.config, self.strategy
        inputs, targets = (t.to(self.device) for t in batch_for_rank(
            self.corpus.train, seed=config.seed, step=step, batch_size=config.batch_size,
            context=config.context, rank=self.group.rank, world_size=self.group.size))
        s.optimizer.zero_grad(set_to_none=True)
        with trace.span("forward"):
            loss = next_token_loss(s.model, inputs, targets)
        with trace.span("backward"):
            loss.backward()
        s.after_backward()
        with trace.span("optimizer step"):
            s.optimizer.step()
        return loss.item()

    # -- the run ----------------------------------------------------------------------------

    def train(self, preemption: Preemption) -> Outcome:
        """Train to ``config.steps``, checkpointing every ``checkpoint_every`` steps, at the end,
        and when ``preemption`` caught a signal on any rank. Collective."""
        config = self.config
        self._introduce()
        if config.resume:
            self._resume()
        if self.group.rank == 0:
            write_settings(config, self.group.size, self.history.step)
        progress = Progress(self.group.rank, config.steps, self.history.step, bar=config.progress,
                            log_every=config.log_every)
        seconds, steps_here, exit_code = 0.0, 0, 0
        crossed = CrossNodeBytes(self.world)
        crossed_before = max(self.history.cross_node_bytes.items(), default=(0, 0))[1]
        if self._rollback is not None:
            self._rollback.commit(self.history.step, self.strategy)
        while self.history.step < config.steps:
            started, sent = time.perf_counter(), trace.bytes_communicated()
            try:
                with trace.span(f"step {self.history.step + 1}"):
                    local_loss = self.train_step(self.history.step)
                    with trace.caller("loss and stop agreement"):
                        loss, stop = preemption.agree(local_loss, self.group.comm)
                if (self._rollback is not None
                        and (self.history.step + 1) % config.recover_every == 0):
                    with trace.caller("rollback copies"):
                        self._rollback.commit(self.history.step + 1, self.strategy)
                seconds += time.perf_counter() - started
                steps_here += 1
                speed = steps_here * self.tokens_per_step / seconds
                self.history.losses.append(loss)
                self.history.bytes_communicated.append(trace.bytes_communicated() - sent)
                self.history.tokens_per_second.append(speed)
                done = self.history.step
                validation = None
                if (config.eval_every and done % config.eval_every == 0) or done == config.steps:
                    validation = self.history.validation[done] = self._validate()
                if self._logged(done, validation is not None or stop):
                    self.history.cross_node_bytes[done] = crossed_before + crossed.total()
            except fault_tolerance.RankLost as lost:   # in the step, the commit or the metrics
                progress = self._recover(lost, progress)
                crossed = CrossNodeBytes(self.world)
                continue
            progress.step(loss, speed, validation)
            self._finish_save(progress, if_done=True)
            if stop:
                progress.say(f"{preemption.name}: stopping at step {done} of {config.steps}")
                self._save(progress, "preempted")
                exit_code = EXIT_PREEMPTED
                break
            if done == config.steps:
                self._save(progress, "final")
            elif config.checkpoint_every and done % config.checkpoint_every == 0:
                self._save(progress, "periodic", background=True)
        self._finish_save(progress)
        progress.close()
        self._write_outputs()
        self._write_trace()
        outcome = Outcome(
            steps=self.history.step,
            loss=self.history.losses[-1] if self.history.losses else float("nan"),
            validation_loss=self.history.validation.get(self.history.step),
            tokens_per_second=steps_here * self.tokens_per_step / seconds if seconds else 0.0,
            checkpoint=self.last_checkpoint, exit_code=exit_code)
        self._summarize(outcome)
        return outcome

    def _recover(self, lost: fault_tolerance.RankLost, progress: Progress) -> Progress:
        """Go on without the lost ranks: shrink the job's communicator, roll back to the newest
        step every survivor committed, rebuild the groups and re-split the data. Returns the
        progress display of the new rank 0. Collective over the survivors.

        Raises:
            Unrecoverable: on every survivor, saying why (the job then exits with
                :data:`~.recovery.EXIT_UNRECOVERABLE`).
        """
        started = time.perf_counter()
        me = MPI.COMM_WORLD.Get_rank()
        print(f"[world rank {me}] --recover: {lost}", file=sys.stderr, flush=True)
        if self._rollback is None:
            raise Unrecoverable(f"--recover: cannot go on after losing a rank: "
                                f"{refusal(self.config)}")
        progress.close()
        # The old groups' communicators are revoked: they are left to MPI_Finalize.
        self._checkpointer, self._saving = None, None
        gone: List[int] = []
        while True:
            try:
                survivors, newly_gone, step = survive(self.world, self._rollback)
            except Unrecoverable as why:
                raise Unrecoverable(f"--recover: cannot go on after losing ranks: {why}") from None
            gone = sorted(gone + newly_gone)
            try:
                nodes = (NodeLayout(survivors).nodes if self.config.optimizer == "hsdp"
                         else ())
                reason = refusal(self.config, survivors.Get_size(), [len(n) for n in nodes])
                if reason is not None:
                    raise Unrecoverable(f"--recover: cannot go on after losing world ranks "
                                        f"{gone}: {reason}")
                self._build(survivors)
                self._rollback.restore(step, self.strategy)
                break
            except fault_tolerance.RankLost as again:   # while the groups were rebuilt
                print(f"[world rank {me}] --recover: {again}", file=sys.stderr, flush=True)
        self.history.rolled_back_to(step)
        self.history.recoveries.append(step)
        progress = Progress(self.group.rank, self.config.steps, step, bar=self.config.progress,
                            log_every=self.config.log_every)
        progress.say(f"--recover: world ranks {gone} lost; {self.group.size} ranks go on from "
                     f"step {step}, the newest every survivor committed (recovered in "
                     f"{time.perf_counter() - started:.2f} s)")
        return progress

    def _logged(self, step: int, event: bool) -> bool:
        """Whether ``step`` gets the metrics counted only now and then (the bytes that crossed
        nodes): with a progress line (every ``--log-every``, the last step), a checkpoint or
        an ``event`` (a validation loss, a stop). The same on every rank."""
        c = self.config
        return (event or step == c.steps or any(every and step % every == 0 for every in (
            c.log_every, c.checkpoint_every)))

    def _write_trace(self) -> None:
        """With tracing on: the trace files, and on rank 0 the timeline. Collective."""
        merged = trace.write(self.world)
        if merged is not None:
            timeline = merged.parent / TIMELINE_FILE
            plot_timeline(merged, timeline)
            self._say(f"trace: {merged} (Chrome trace JSON, one file per rank beside it), "
                      f"timeline: {timeline}")

    def _summarize(self, outcome: Outcome) -> None:
        config, run_dir = self.config, self.config.run_dir
        if outcome.exit_code == EXIT_PREEMPTED:
            self._say(f"preempted at step {outcome.steps}: exit code {EXIT_PREEMPTED}; "
                      f"run again with --resume to continue from {outcome.checkpoint}")
            return
        validation = ("" if outcome.validation_loss is None
                      else f", validation {outcome.validation_loss:.4f}")
        first = self.history.losses[0] if self.history.losses else float("nan")
        self._say(f"done: {outcome.steps} steps; loss {first:.4f} at step 1 -> train "
                  f"{outcome.loss:.4f}{validation} (nats per byte)")
        if outcome.tokens_per_second:
            self._say(f"throughput: {outcome.tokens_per_second:,.0f} tokens/s on {self.group.size} "
                      f"ranks ({outcome.tokens_per_second / self.group.size:,.0f} per rank)")
        self._say(f"metrics: {run_dir / METRICS_FILE}")
        self._say(f"plot: {run_dir / PLOT_FILE}")
        self._say(f"checkpoints: {config.checkpoint_dir} (latest {outcome.checkpoint})")


def train(config: TrainConfig, world: Optional[MPI.Intracomm] = None,
          preemption: Optional[Preemption] = None) -> Outcome:
    """Build a :class:`Run` for ``config`` and train, on every rank of ``world``. Collective.

    Pass ``preemption`` entered early (before the slow imports and setup) to catch signals
    that arrive during startup; by default the run catches them from here on."""
    if preemption is not None:
        with Run(config, world) as run:
            return run.train(preemption)
    with Preemption() as caught, Run(config, world) as run:
        return run.train(caught)

