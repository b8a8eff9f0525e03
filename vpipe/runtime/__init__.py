"""vpipe's pipeline runtime: execute lowered schedules on torch.distributed.

``Pipeline`` (pipeline.py) is the public entry point; ``launch`` starts local processes or
joins torchrun. Inside:

- executor.py compiles this rank's program once into one closure per action (a table maps each
  action kind to its compile function) and runs them in order. Values move between actions
  through per-stage, per-microbatch dicts (stage.py).
- Overlap actions (overlap.py): an ``OVERLAP_F_B`` runs its parts one after another, unless the
  forward part's stage module defines ``overlapped_forward_backward(forward, backward)``: then
  that method gets both parts and steps them (``fetch()``, ``compute()``, ``deliver()`` each,
  or ``run()``) in the order it chooses, e.g. to interleave them; it must finish both.
- Local handoff (the V-schedule case): when stages s and s+1 share a rank, F(s) puts its output,
  detached, straight into stage s+1's input slot, and B/I(s+1) puts its input gradient straight
  into stage s's output-gradient slot. No copy, no communication, nothing to wait for.
- Split backward (backward.py): I computes input gradients while recording the gradient at
  each autograd node that also feeds a parameter branch; W later runs only those branches.
- Communication (comm.py): receives are posted where the program puts them and waited right
  before the consuming compute; adjacent communication actions are posted as one batch.
  Messages that one batch sends to a peer which receives them in one batch travel packed as one
  (packing.py; which ones: vpipe/ir/bundling.py). On gloo a poster thread posts each batch, in
  order, off the compute thread.
- Shapes (meta.py): inferred per microbatch input shape by a one-off probe through the stages.
"""

from vpipe import compat

__all__ = ["Pipeline"]

# Lazy, so that launch's helpers (device names, process start) load without torch.
__getattr__ = compat.forward_attributes(__name__, ("vpipe.runtime.pipeline",))
