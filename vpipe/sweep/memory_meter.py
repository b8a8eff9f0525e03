"""The memory meter every implementation is measured with: bytes autograd saves for backward.

It counts through autograd's saved-tensor hooks, so vpipe's runtime and torch's baseline are
metered alike, whatever their own bookkeeping. Importing this module does not import torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any


class SavedTensorMeter:
    """Live bytes of tensors autograd saved for backward (activations), and their peak.

    Storages of the tensors given as ``exclude`` (parameters, and so also views of them such
    as a transposed weight) are not counted; a storage saved several times counts once. A
    packed tensor is released when autograd frees the node that saved it (after its backward or
    weight-gradient computation), so the peak includes activations held for a deferred W.
    """

    def __init__(self, exclude: Iterable[Any] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live = 0
        self.peak = 0
        self.samples: list[tuple[int, int]] = []
        self._refs: dict[int, list[int]] = {}

    def _add(self, key: int, nbytes: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.samples.append((time.time_ns(), self.live))
        else:
            ref[0] += 1

    def _drop(self, key: int) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.live -= ref[1]
            self.samples.append((time.time_ns(), self.live))

    def hooks(self) -> Any:
        """A context manager under which autograd's saved tensors are metered."""
        import torch

        meter = self

        class _Held:
            __slots__ = ("t", "key")

            def __init__(self, t: Any) -> None:
                storage = t.untyped_storage()
                # detached: holding the tensor with its grad_fn from inside its own graph is
                # a cycle Python cannot collect, which kept a split backward's graph (held
                # from I to W) alive after W, growing every step
                self.t, self.key = t.detach(), storage.data_ptr()
                meter._add(self.key, storage.nbytes())

            def __del__(self) -> None:
                meter._drop(self.key)

        def pack(t: Any) -> Any:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in meter._exclude:
                return t
            return _Held(t)

        def unpack(x: Any) -> Any:
            return x.t if isinstance(x, _Held) else x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
