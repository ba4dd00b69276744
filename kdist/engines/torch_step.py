"""What runs inside the torch engine's step: the step primitives (autograd, one
all-reduce of the gradients per call, optimizers in place), and the sum over the
process group that its all-reduces use."""

import torch
import torch.distributed as dist

from kdist.engines import contract
from kdist.errors import UsageError
from kdist.step import context as step_context
from kdist.step.context import current_scope, loss_of


class Primitives(step_context.Primitives):
    """`kdist.step.context.Primitives` on torch: autograd, and one all-reduce of
    the gradients per call."""

    applies_in_scope = False  # Keras' torch optimizers update the tensors in place.

    def __init__(self, engine, whole=False):
        self.engine = engine
        self.whole = whole  # Every process sees the whole batch (`eval_whole`).

    def value_and_grad(self, context, fn, variables, tensors, scale):
        """Differentiates `fn(*tensors)` with autograd; inside another
        `value_and_grad`'s loss, keeps the graph so that loss can be
        differentiated through this gradient (a gradient penalty). A
        non-trainable variable's parameter records its graph while `fn` runs,
        as TensorFlow's and JAX's gradients reach such variables too."""
        if torch._C._functorch.maybe_current_level() is not None:
            raise UsageError(
                "kdist.value_and_grad inside keras.ops.vectorized_map: torch's autograd "
                "cannot differentiate inside its vmap; take each example's gradient by "
                "differentiating a sum over the batch with respect to its tensor (each "
                "example's gradient is its own: kdist.grad(lambda x: ops.sum(f(x)), x))")
        scope = current_scope()
        sources = [scope.get_current_value(v) for v in variables]  # Their parameters.
        frozen = [s for s in sources
                  if s.is_leaf and s.is_floating_point() and not s.requires_grad]
        leaves = [t if t.requires_grad else t.detach().requires_grad_(True) for t in tensors]
        try:
            for source in frozen:
                source.requires_grad_(True)
            with torch.enable_grad():
                value = fn(*leaves)
                loss = loss_of(value, scale)
                # A loss that reads nothing differentiated (its forward pass ran before):
                # no gradient, as TensorFlow's and JAX's give (`kdist.value_and_grad` says).
                grads = (torch.autograd.grad(loss, sources + leaves, allow_unused=True,
                                             create_graph=context.depth > 1)
                         if loss.requires_grad else [None] * len(sources + leaves))
        finally:
            for source in frozen:
                source.requires_grad_(False)
        return value, list(grads[:len(sources)]), list(grads[len(sources):])

    def sum_over_replicas(self, grads):
        if self.whole or self.engine.num_replicas == 1:
            return grads
        with torch.no_grad():
            summed = iter(self.engine._all_reduce_sum([g for g in grads if g is not None]))
        return [None if g is None else next(summed) for g in grads]

    def replicas_sharing(self):
        return 1 if self.whole else self.engine.num_replicas

    def sum_over_shares(self, values):
        with torch.no_grad():
            return self.engine._all_reduce_sum([v.detach() for v in values])

    def gather_shares(self, tensors):
        rank, count = self.engine.shard
        out = []
        for tensor in tensors:
            if tensor.requires_grad:
                out.append(_AllGather.apply(tensor, rank, count))
                continue
            sent = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
            whole = _all_gather(sent, count)
            out.append(whole.bool() if tensor.dtype == torch.bool else whole)
        return out

    def apply(self, context, optimizer, apply, grads, variables):
        with context.optimizer_applying(), torch.no_grad():
            return apply(grads, variables)


def _all_gather(tensor, count):
    parts = [torch.empty_like(tensor) for _ in range(count)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


class _AllGather(torch.autograd.Function):
    """Every process's rows of a tensor, in rank order; the gradient of a process's
    own rows sums every process's gradient for them (one all-reduce)."""

    @staticmethod
    def forward(ctx, tensor, rank, count):
        ctx.own = slice(rank * tensor.shape[0], (rank + 1) * tensor.shape[0])
        return _all_gather(tensor.detach(), count)

    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()
        dist.all_reduce(summed)
        return summed[ctx.own], None, None


def seed_offsets(variables, rank):
    """(variable, shift) of each `keras.random.SeedGenerator` state among
    `variables`: what process `rank` adds to it for a train step, so every
    replica draws its own dropout masks and noise (process 0, none: it draws
    what one device would for its rows)."""
    return [(v, torch.tensor([rank * contract.SEED_STRIDE, 0], dtype=v.value.dtype,
                             device=v.value.device))
            for v in variables if rank and v.path.endswith("seed_generator_state")]


def all_reduce_sum(tensors):
    """`tensors` summed over the process group: one all-reduce of a flat buffer
    per dtype they are summed in. float64 and int64 are summed as themselves,
    other ints as int64 and other floats (bfloat16, float16) as float32, so
    no sum is rounded below its tensors' precision."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(_summed_dtype(t.dtype), []).append(i)
    out = list(tensors)
    for dtype, indices in groups.items():
        flat = torch.cat([tensors[i].reshape(-1).to(dtype) for i in indices])
        dist.all_reduce(flat)
        start = 0
        for i in indices:
            t = tensors[i]
            out[i] = flat[start:start + t.numel()].reshape(t.shape).to(t.dtype)
            start += t.numel()
    return out


def _summed_dtype(dtype):
    if dtype == torch.float64:
        return dtype
    return torch.float32 if dtype.is_floating_point else torch.int64
