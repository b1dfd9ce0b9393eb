"""Communication hooks for :class:`~tensorplay_hpc.distributed.parallel.DistributedDataParallel`.

The hook interface is PyTorch's. ``ddp.register_comm_hook(state, hook)`` makes DDP call
``hook(state, bucket)`` once per gradient bucket in every backward pass, in bucket order (the
same order on every rank, so hooks may run collectives), as soon as the bucket's gradients are
all ready. What a hook receives (a :class:`.grad_bucket.GradBucket`) and may return is
described in :mod:`.grad_bucket`. DDP waits on the result when the backward pass ends and copies
it into the bucket if it is another tensor. The hook must do the averaging itself.

Built-in hooks, with PyTorch's names, arguments and arithmetic:

- :func:`.default_hooks.allreduce_hook`: average over a group;
- :func:`.default_hooks.fp16_compress_hook`, :func:`.default_hooks.bf16_compress_hook`: average
  in 16-bit floats (half the bytes);
- :func:`.default_hooks.fp16_compress_wrapper`, :func:`.default_hooks.bf16_compress_wrapper`: run
  another hook (such as PowerSGD) on a 16-bit copy of each bucket;
- :func:`.powerSGD_hook.powerSGD_hook`, :func:`.powerSGD_hook.batched_powerSGD_hook` with
  :class:`.powerSGD_hook.PowerSGDState`: low-rank compression with error feedback (its state
  goes into checkpoints through ``state_dict()``);
- :func:`.post_localSGD_hook.post_localSGD_hook`: global, then subgroup averaging;
- :func:`.ddp_zero_hook.hook_with_zero_step`: a ZeroRedundancyOptimizer step overlapped with the
  backward pass; :func:`.ddp_zero_hook.hook_with_zero2_step` (not in PyTorch): ZeRO-2, the
  gradients reduced only to the ranks that own them.

And one of this package: :func:`.hierarchical_hook.hierarchical_allreduce_hook` with
:class:`.hierarchical_hook.HierarchicalState`: within each node, then across nodes on
``1 / ranks_per_node`` of each bucket, so a node sends each gradient once.
"""

__all__ = ["ddp_zero_hook", "default_hooks", "grad_bucket", "hierarchical_hook",
           "post_localSGD_hook", "powerSGD_hook"]
