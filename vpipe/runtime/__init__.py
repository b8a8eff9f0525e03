"""vpipe's pipeline runtime: execute lowered schedules on torch.distributed.

``Pipeline`` is the public entry point; ``launch`` starts local processes or joins torchrun.
"""

from vpipe.runtime.pipeline import Pipeline

__all__ = ["Pipeline"]
