"""One pipeline stage on this rank: its module, the per-microbatch stash, and its backward.

Values between stages are tuples of tensors. Gradient tuples are aligned with the floating-point
positions of the value (``float_in`` / ``float_out``): integer tensors (token ids, bucket ids)
flow forward but carry no gradient. A stage's float inputs are fresh leaves (a receive buffer,
or the previous local stage's output detached), so each stage owns exactly its autograd graph
and its input gradients can be read from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from vpipe.errors import PipelineError
from vpipe.runtime.backward import WeightTask, backward_full, backward_input, grad_node
from vpipe.runtime.meta import TensorMeta, as_tuple
from vpipe.runtime.recompute import Selective, check_mode, rng_state

__all__ = ["Stage"]


class Stage:
    """Stage ``index`` of ``n_stages``: runs F, B, I and W for one microbatch at a time.

    Per-microbatch state (each entry removed by its last consumer):
    ``fwd_in`` input values waiting for F (a tuple, or a posted receive), ``grad_out`` output
    gradients waiting for B/I, ``grad_in`` input gradients waiting for SEND_B, ``weight`` W tasks
    left by I, and the stash ``_inputs``/``_outputs`` that backward needs.
    """

    def __init__(
        self,
        index: int,
        n_stages: int,
        module: nn.Module,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None,
        recompute: str = "none",
    ) -> None:
        self.index = index
        self.recompute = check_mode(recompute)
        self.full = recompute == "full"
        self.sends_outputs = False  # set by the executor: SEND_F ships F's outputs
        self.module = module
        self.is_first = index == 0
        self.is_last = index == n_stages - 1
        self.loss_fn = loss_fn
        params = [p for p in module.parameters() if p.requires_grad]
        # Holding the accumulators keeps them (and so their identity) alive across steps.
        self.param_nodes = {grad_node(p): p for p in params}
        self.in_meta: tuple[TensorMeta, ...] = ()
        self.out_meta: tuple[TensorMeta, ...] = ()
        self.float_in: tuple[int, ...] = ()
        self.float_out: tuple[int, ...] = ()
        # The metadata of the float positions: the shapes of the gradients exchanged.
        self.float_in_meta: tuple[TensorMeta, ...] = ()
        self.float_out_meta: tuple[TensorMeta, ...] = ()
        self.act_bytes: int | None = None  # measured at the first F after a shape change
        self.recompute_bytes = 0  # measured at the first recompute after a shape change
        self._measure_recompute = True
        self.fwd_in: dict[int, Any] = {}
        self.grad_out: dict[int, Any] = {}
        self.grad_in: dict[int, tuple] = {}
        self.weight: dict[int, WeightTask] = {}
        self._inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._kept: dict[int, tuple] = {}
        self._per_microbatch = (
            self._kept,
            self.fwd_in,
            self.grad_out,
            self.grad_in,
            self.weight,
            self._inputs,
            self._outputs,
        )
        self.loss_scale = 1.0

    def set_meta(self, in_meta: tuple[TensorMeta, ...], out_meta: tuple[TensorMeta, ...]) -> None:
        self.in_meta, self.out_meta = in_meta, out_meta
        self.float_in = tuple(i for i, (_, d) in enumerate(in_meta) if d.is_floating_point)
        self.float_out = tuple(i for i, (_, d) in enumerate(out_meta) if d.is_floating_point)
        self.float_in_meta = tuple(in_meta[i] for i in self.float_in)
        self.float_out_meta = tuple(out_meta[i] for i in self.float_out)
        self.act_bytes = None
        self._measure_recompute = True

    def live_entries(self) -> int:
        """Stashed per-microbatch entries (zero between steps)."""
        return sum(len(d) for d in self._per_microbatch)

    def clear(self) -> None:
        """Drop every per-microbatch entry (after a failed step)."""
        for d in self._per_microbatch:
            d.clear()

    # -- forward -----------------------------------------------------------------------------
    def forward(self, m: int, values: tuple[torch.Tensor, ...], target: Any) -> Any:
        """Run the module on microbatch ``m``; return its output tuple, or the unscaled loss on
        the last stage."""
        if not self.is_first:
            for i in self.float_in:
                values[i].requires_grad_(True)
        if self.full:
            return self._forward_kept(m, values, target)
        if self.act_bytes is None:
            out, self.act_bytes = self._measured_forward(values, target)
        else:
            out = self._run(values, target)
        self._inputs[m] = tuple(values[i] for i in self.float_in)
        if self.is_last:
            self._outputs[m] = (out,)
            return out
        outs = as_tuple(out, f"stage {self.index} output")
        self._outputs[m] = outs
        return outs

    def _forward_kept(self, m: int, values: tuple[torch.Tensor, ...], target: Any) -> Any:
        """Full recompute's F: no autograd graph; keep the inputs (and RNG) to run it again."""
        restore = rng_state(values[0].device if values else torch.device("cpu"))
        with torch.no_grad():
            out = self._run(values, target)
        self._kept[m] = (tuple(map(_compact, values)), target, restore)
        if self.act_bytes is None:
            self.act_bytes = _Bytes(self.module).add(self._kept[m][0]).total
        if self.is_last:
            return out
        outs = as_tuple(out, f"stage {self.index} output")
        if self.sends_outputs:
            self._outputs[m] = outs  # until SEND_F ships them
        return outs

    def _recompute(self, m: int) -> None:
        """Full recompute before a backward: F again from the kept inputs, with autograd."""
        values, target, restore = self._kept.pop(m)
        now = rng_state(values[0].device if values else torch.device("cpu"))
        restore()
        counter = _Bytes(self.module).exclude(values) if self._measure_recompute else None
        try:
            with torch.enable_grad():
                if counter is None:
                    out = self._run(values, target)
                else:
                    with saved_tensors_hooks(counter.pack, _same):
                        out = self._run(values, target)
        finally:
            now()
        outs = (out,) if self.is_last else as_tuple(out, f"stage {self.index} output")
        if counter is not None:
            self.recompute_bytes = counter.add(outs).total
            self._measure_recompute = False
        self._inputs[m] = tuple(values[i] for i in self.float_in)
        self._outputs[m] = outs

    def _run(self, values: tuple[torch.Tensor, ...], target: Any) -> Any:
        if self.recompute == "selective" and torch.is_grad_enabled():
            sel = Selective()
            with saved_tensors_hooks(sel.pack, sel.unpack), sel:
                return self._run_module(values, target)
        return self._run_module(values, target)

    def _run_module(self, values: tuple[torch.Tensor, ...], target: Any) -> Any:
        out = self.module(*values)
        if self.is_last:
            loss = self.loss_fn(out, target)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise PipelineError(
                    "loss_fn must return a scalar tensor (a mean over the microbatch)"
                )
            return loss
        return out

    def _measured_forward(self, values: tuple[torch.Tensor, ...], target: Any) -> tuple[Any, int]:
        """Forward that also counts the bytes this microbatch keeps alive: tensors saved for
        backward, inputs and outputs, each storage once, parameters and buffers excluded."""
        counter = _Bytes(self.module)
        if self.recompute == "selective":  # what the selective hooks keep, not what they drop
            sel = Selective()

            def pack(t: torch.Tensor) -> Any:
                kept = sel.pack(t)
                if not sel.dropped(kept):
                    counter.pack(t)
                return kept

            with saved_tensors_hooks(pack, sel.unpack), sel:
                out = self._run_module(values, target)
            self.recompute_bytes, self._measure_recompute = sel.lazy_bytes, False
        else:
            with saved_tensors_hooks(counter.pack, _same):
                out = self._run(values, target)
        counter.add(values).add(as_tuple(out, f"stage {self.index} output"))
        return out, counter.total

    def sent_values(self, m: int) -> tuple[torch.Tensor, ...]:
        """Microbatch ``m``'s outputs as they go to the next rank."""
        outs = self._outputs.pop(m) if self.full else self._outputs[m]
        return tuple(t.detach().contiguous() for t in outs)

    # -- backward ----------------------------------------------------------------------------
    def _roots(self, m: int, grads: tuple | None) -> tuple[list, list]:
        outs = self._outputs.pop(m)
        if self.is_last:
            loss = outs[0]
            return [loss], [torch.full_like(loss, self.loss_scale)]
        roots, gs = [], []
        for i, g in zip(self.float_out, grads, strict=True):
            if g is not None and outs[i].requires_grad:
                roots.append(outs[i])
                gs.append(g)
        return roots, gs

    def backward(self, m: int, grads: tuple | None) -> tuple:
        """B: parameter gradients accumulated, input gradients returned (aligned with
        ``float_in``)."""
        if self.full:
            self._recompute(m)
        roots, gs = self._roots(m, grads)
        inputs = self._inputs.pop(m)
        if not roots:
            return (None,) * len(inputs)
        return backward_full(roots, gs, inputs)

    def backward_input(self, m: int, grads: tuple | None) -> tuple:
        """I: input gradients now; the weight part is left in ``weight[m]`` for W (with full
        recompute, holding the graph I recomputed: W does not recompute)."""
        if self.full:
            self._recompute(m)
        roots, gs = self._roots(m, grads)
        inputs = self._inputs.pop(m)
        if not roots:
            self.weight[m] = WeightTask([], False)
            return (None,) * len(inputs)
        got, self.weight[m] = backward_input(roots, gs, inputs, self.param_nodes)
        return got

    def backward_weight(self, m: int) -> None:
        """W: accumulate microbatch ``m``'s parameter gradients."""
        self.weight.pop(m).run()


def _same(t: Any) -> Any:
    return t


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a copy when it views a larger storage (a bundle's receive buffer, the
    whole batch): what full recomputation keeps should hold no more than its inputs."""
    if t.untyped_storage().nbytes() <= t.nbytes:
        return t
    return t.detach().clone().requires_grad_(t.requires_grad)


class _Bytes:
    """Bytes of distinct storages counted (each once), the module's parameters and buffers
    (and any ``exclude`` d tensors) left out."""

    def __init__(self, module: nn.Module) -> None:
        self.seen = {
            t.untyped_storage().data_ptr() for t in module.state_dict(keep_vars=True).values()
        }
        self.total = 0

    def exclude(self, tensors: Any) -> _Bytes:
        self.seen |= {t.untyped_storage().data_ptr() for t in tensors}
        return self

    def add(self, tensors: Any) -> _Bytes:
        for t in tensors:
            self.pack(t)
        return self

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.total += storage.nbytes()
        return t
