"""Backward passes of one stage and microbatch: full (B), input-only (I) and weight-only (W).

Split backward without recomputation. The autograd graph below a stage's outputs has two parts:
``C``, the nodes on some path from the outputs to a stage input (what I must run), and the rest,
which leads only to parameters (``D``). A *frontier* node is a C node with an edge into D (for
a linear layer: its addmm node, whose weight branch I does not need). While I computes the input
gradients (graph retained), a pre-hook on every frontier node records the gradient arriving at
it. W then runs autograd once per frontier node, rooted at that node with the recorded gradient
and asking only for the parameters it reaches through D, so the engine evaluates only the node's
weight branches: the input-gradient chain is not evaluated again, and each saved tensor is
released as soon as W used it.

When two frontier nodes reach one D node (a weight used twice in a stage) the per-node calls
would not be independent; W then falls back to one backward from the outputs to the parameters
(correct, but it recomputes the input chain). ``WeightTask.recomputes`` tells which was used.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

try:  # the engine call behind torch.autograd.backward/grad, without their argument checks
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - older torch
    _engine_run_backward = None

__all__ = ["WeightTask", "backward_full", "backward_input", "grad_node"]


def grad_node(t: torch.Tensor) -> Node | None:
    """The autograd node gradients of ``t`` flow into: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


class WeightTask:
    """What W needs for one (stage, microbatch): roots with their gradients, and parameters."""

    __slots__ = ("parts", "recomputes")

    def __init__(self, parts: list[tuple[list, list, list]], recomputes: bool) -> None:
        self.parts = parts  # (roots: tensors or GradientEdges, grads, params) per autograd call
        self.recomputes = recomputes

    def run(self) -> None:
        """Accumulate this microbatch's weight gradients into ``.grad`` and free the graph."""
        parts, self.parts = self.parts, []
        for roots, grads, params in parts:
            _accumulate(roots, grads, params)


def backward_full(
    roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """B: accumulate parameter gradients and return the gradients of ``inputs`` (None where an
    input got none). Inputs are this stage's own leaves, so reading ``.grad`` is exact."""
    _accumulate(roots, grads, ())
    out = []
    for x in inputs:
        out.append(x.grad)
        x.grad = None
    return tuple(out)


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    param_nodes: dict[Node, torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightTask]:
    """I: return the gradients of ``inputs`` (the stage's float inputs that require grad) and
    the W task that later accumulates the parameter gradients."""
    roots, grads = list(roots), list(grads)
    params = list(param_nodes.values())
    whole = [(roots, grads, params)] if params else []
    needed = [x for x in inputs if x.requires_grad]
    if not needed:  # first stage: nothing to send back, W does the whole backward
        return tuple(None for _ in inputs), WeightTask(whole, False)
    input_nodes = {grad_node(x) for x in needed}
    root_nodes = [grad_node(t) for t in roots]
    in_c, order, kids = _nodes_reaching(root_nodes, input_nodes)
    plan = _frontier_plan(root_nodes, in_c, order, kids, param_nodes)
    if plan is None:
        got = _input_grads(roots, grads, needed)
        return _align(inputs, needed, got), WeightTask(whole, True)

    frontier, root_parts = plan
    captured: dict[Node, tuple] = {}
    handles = [n.register_prehook(_recorder(captured, n)) for n, _ in frontier]
    try:
        got = _input_grads(roots, grads, needed)
    finally:
        for h in handles:
            h.remove()
    parts = []
    for node, params in frontier:
        g_out = captured.get(node)
        if g_out is None:
            continue
        edges, gs = [], []
        for k, g in enumerate(g_out):
            if g is not None:
                edges.append(GradientEdge(node, k))
                gs.append(g)
        if edges:
            parts.append((edges, gs, params))
    for i, params in root_parts:
        parts.append(([roots[i]], [grads[i]], params))
    return _align(inputs, needed, got), WeightTask(parts, False)


def _accumulate(roots: Sequence, grads: Sequence, params: Sequence) -> None:
    """Backward from ``roots`` accumulating into ``.grad`` of ``params`` (all leaves if empty).
    Calls the engine directly: torch.autograd.backward's Python argument handling costs tens
    of microseconds per call, and this runs for every B and every W part. The engine still
    checks gradient shapes against the roots."""
    if _engine_run_backward is None:
        torch.autograd.backward(list(roots), list(grads), inputs=list(params) or None)
        return
    _engine_run_backward(
        tuple(roots),
        tuple(grads),
        False,
        False,
        tuple(params),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _input_grads(roots: Sequence, grads: Sequence, inputs: Sequence) -> tuple:
    """Gradients of ``inputs`` (None where unused), keeping the graph for W."""
    if _engine_run_backward is None:
        return torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
    return _engine_run_backward(
        tuple(roots),
        tuple(grads),
        True,
        False,
        tuple(inputs),
        allow_unreachable=True,
        accumulate_grad=False,
    )


def _recorder(store: dict, node: Node):
    def hook(grad_outputs: tuple) -> None:
        store[node] = grad_outputs

    return hook


def _align(inputs, needed, got) -> tuple[torch.Tensor | None, ...]:
    by_id = {id(x): g for x, g in zip(needed, got, strict=True)}
    return tuple(by_id.get(id(x)) for x in inputs)


def _nodes_reaching(
    roots: list[Node | None], targets: set[Node]
) -> tuple[set[Node], list[Node], dict[Node, list[Node]]]:
    """The nodes (from ``roots`` down) with a path to a target; all nodes in children-first
    order; each node's children (read once: ``next_functions`` builds new tuples per call)."""
    order: list[Node] = []
    kids: dict[Node, list[Node]] = {}
    stack = [(n, False) for n in roots if n is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in kids:
            continue
        children = kids[node] = [fn for fn, _ in node.next_functions if fn is not None]
        stack.append((node, True))
        stack.extend((c, False) for c in children if c not in kids)
    reach: set[Node] = set()
    for node in order:
        if node in targets or any(c in reach for c in kids[node]):
            reach.add(node)
    return reach, order, kids


def _frontier_plan(
    root_nodes: list[Node | None],
    in_c: set[Node],
    order: list[Node],
    kids: dict[Node, list[Node]],
    param_nodes: dict[Node, torch.Tensor],
) -> tuple[list[tuple[Node, list]], list[tuple[int, list]]] | None:
    """Frontier nodes with the parameters each reaches through D only, plus output roots that
    lie entirely in D. None when two of them share a D node (W must then recompute)."""
    owner: dict[Node, int] = {}
    frontier: list[tuple[Node, list]] = []
    root_parts: list[tuple[int, list]] = []

    def claim(starts: list[Node], who: int) -> list | None:
        params, stack = [], list(starts)
        while stack:
            n = stack.pop()
            prev = owner.get(n)
            if prev == who:
                continue
            if prev is not None:
                return None
            owner[n] = who
            p = param_nodes.get(n)
            if p is not None:
                params.append(p)
            stack.extend(kids[n])
        return params

    for node in order:
        if node not in in_c:
            continue
        d_children = [c for c in kids[node] if c not in in_c]
        if not d_children:
            continue
        params = claim(d_children, len(frontier) + len(root_parts))
        if params is None:
            return None
        if params:
            frontier.append((node, params))
    for i, node in enumerate(root_nodes):
        if node is None or node in in_c:
            continue
        params = claim([node], len(frontier) + len(root_parts))
        if params is None:
            return None
        if params:
            root_parts.append((i, params))
    return frontier, root_parts
