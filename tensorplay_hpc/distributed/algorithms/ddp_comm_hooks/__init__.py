"""Communication hooks for :class:`~tensorplay_hpc.distributed.parallel.DistributedDataParallel`.

The hook interface is PyTorch's. ``ddp.register_comm_hook(state, hook)`` makes DDP call
``hook(state, bucket)`` once per gradient bucket in every backward pass, in bucket order (the
same order on every rank, so hooks may run collectives), as soon as the bucket's gradients are
all ready. ``bucket`` is a :class:`~tensorplay_hpc.distributed.parallel.reducer.GradBucket`:

- ``buffer()``: the flat 1-D tensor of the bucket's gradients, not yet averaged;
- ``gradients()`` / ``parameters()``: per-parameter views of it / the parameters, in bucket order;
- ``index()``, ``is_last()`` (the last bucket of the iteration), ``set_buffer(tensor)``.

The hook returns either an object with ``wait()`` that returns the reduced flat tensor (like
:class:`.default_hooks.BucketWork`; an ``is_completed()`` method, if present, lets DDP drive MPI
progress while the backward pass goes on) or a ``torch.futures.Future`` whose value is that
tensor (or a one-element list of it). DDP waits on it when the backward pass ends and copies the
result into the bucket if it is another tensor. The hook must do the averaging itself.

Built-in hooks: :func:`.default_hooks.allreduce_hook` (average over a group) and
:func:`.post_localSGD_hook.post_localSGD_hook` (global, then subgroup averaging).
"""
