"""P2P over gloo with GPU tensors goes through host copies (gloo moves host memory only); here
against a stand-in process group, so it runs without a GPU."""

import threading

import pytest
import torch

from vpipe.runtime.comm import P2P


class _Work:
    def __init__(self, on_wait=None):
        self.on_wait, self.done = on_wait, False

    def wait(self):
        if self.on_wait is not None and not self.done:
            self.on_wait()
        self.done = True
        return True

    def is_completed(self):
        return self.done


class _Group:
    """Records posted operations; a receive fills its buffer with 7s when waited for."""

    def __init__(self, backend: str):
        self.backend, self.posted = backend, []

    def _get_backend(self, device):
        name, coalesce = self.backend, self.backend == "nccl"
        return type("B", (), {"name": lambda self: name, "supports_coalescing": coalesce})()

    def send(self, tensors, peer, tag):
        self.posted.append(("send", tensors[0]))
        return _Work()

    def recv(self, tensors, peer, tag):
        self.posted.append(("recv", tensors[0]))
        return _Work(lambda: tensors[0].fill_(7.0))


def test_channels_are_the_default_on_nccl_only(monkeypatch):
    import vpipe.runtime.comm as comm

    made = []
    monkeypatch.setattr(comm, "_channel_routes", lambda group, pairs: made.append(pairs) or {})
    nccl = P2P(_Group("nccl"), torch.device("cuda", 0), [(0, 1)])
    assert nccl.channels and not nccl.coalesce and made == [[(0, 1)]]
    gloo = P2P(_Group("gloo"), torch.device("cpu"), [(0, 1)])
    assert not gloo.channels and made == [[(0, 1)]]
    assert not P2P(_Group("nccl"), torch.device("cuda", 0), channels=False).channels


def test_gloo_with_gpu_tensors_receives_into_a_host_buffer():
    assert not P2P(_Group("gloo"), torch.device("cpu")).via_host
    assert not P2P(_Group("nccl"), torch.device("cuda", 0), channels=False).via_host
    group = _Group("gloo")
    p2p = P2P(group, torch.device("cuda", 0), post_thread=False)  # posted when flushed
    assert p2p.via_host
    dst = torch.zeros(3)  # stands for the device tensor
    p2p.queue_recv(dst, 1)
    p2p.queue_send(torch.ones(2), 1)
    (recv_work,), (send_work,) = p2p.flush()
    (_, host), (_, sent) = group.posted
    assert host is not dst and host.device.type == "cpu" and sent.device.type == "cpu"
    assert not recv_work.is_completed() and dst.sum() == 0
    recv_work.wait()
    assert dst.tolist() == [7.0, 7.0, 7.0] and recv_work.is_completed()
    blocking = torch.zeros(2)
    p2p.recv_now(blocking, 1)
    assert blocking.tolist() == [7.0, 7.0]


class _SlowGroup(_Group):
    """Records which thread posts; a send to peer 9 fails."""

    def send(self, tensors, peer, tag):
        if peer == 9:
            raise RuntimeError("peer 9 is gone")
        self.posted.append(("send", tensors[0], threading.current_thread().name))
        return _Work()

    def recv(self, tensors, peer, tag):
        self.posted.append(("recv", tensors[0], threading.current_thread().name))
        return _Work(lambda: tensors[0].fill_(7.0))


def test_the_poster_thread_is_gloos_default_and_posts_in_flush_order():
    assert P2P(_Group("gloo"), torch.device("cpu"))._poster is not None
    assert P2P(_Group("gloo"), torch.device("cpu"), post_thread=False)._poster is None
    assert P2P(_Group("nccl"), torch.device("cuda", 0), channels=False)._poster is None
    group = _SlowGroup("gloo")
    p2p = P2P(group, torch.device("cpu"))
    bufs = [torch.zeros(2) for _ in range(6)]
    works = []
    for k in range(3):  # three batches: a receive and a send each
        p2p.queue_recv(bufs[2 * k], 1)
        p2p.queue_send(bufs[2 * k + 1], 1)
        works += p2p.flush()
    for (w,) in reversed(works):  # waiting out of order waits for the posting first
        w.wait()
        assert w.is_completed()
    assert [(op, id(t)) for op, t, _ in group.posted] == [
        (op, id(b)) for b, op in zip(bufs, ["recv", "send"] * 3, strict=True)
    ]
    assert {name for _, _, name in group.posted} == {"vpipe-p2p-poster"}
    assert all(b.tolist() == [7.0, 7.0] for b in bufs[::2])


def test_a_posting_error_is_raised_by_the_wait():
    p2p = P2P(_SlowGroup("gloo"), torch.device("cpu"))
    p2p.queue_send(torch.ones(1), 9)
    ((work,),) = p2p.flush()
    with pytest.raises(RuntimeError, match="peer 9 is gone"):
        work.wait()
    assert work.is_completed()


def test_the_poster_thread_is_refused_off_gloo():
    with pytest.raises(ValueError, match="post_thread is for gloo"):
        P2P(_Group("nccl"), torch.device("cuda", 0), post_thread=True)


def test_a_host_copied_receive_is_ready_once_its_data_arrived():
    """gloo with device tensors receives into a host buffer copied over on wait(): a probe
    (Part.ready) must say yes as soon as the data is in that buffer, before any wait."""
    import torch

    from vpipe.runtime.comm import _CopyOnWait

    class Work:
        done = False

        def is_completed(self):
            return self.done

        def wait(self):
            self.done = True

    work, dst = Work(), torch.zeros(3)
    r = _CopyOnWait(work, torch.arange(3.0), dst)
    assert not r.is_completed()
    work.done = True
    assert r.is_completed() and dst.sum() == 0  # ready, not yet copied
    r.wait()
    assert r.is_completed() and dst.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    ("me", "want"),
    [
        (0, [("up01", "send"), ("down01", "recv")]),
        (1, [("up01", "recv"), ("down01", "send"), ("up12", "send"), ("down12", "recv")]),
        (2, [("up12", "recv"), ("down12", "send")]),
    ],
)
def test_connect_exchanges_once_per_channel_in_one_global_order(monkeypatch, me, want):
    """Each channel (direction of a pair) carries one tiny message before the first step, the
    lower rank sending first, pairs in one order on every rank (no two ranks wait on each
    other): rank 1 finishes its pair with rank 0 before it starts the one with rank 2."""
    import vpipe.runtime.comm as comm

    posted = []

    class Channel(_Group):
        def __init__(self, name):
            super().__init__("nccl")
            self.name = name

        def send(self, tensors, peer, tag):
            posted.append((self.name, "send"))
            return _Work()

        def recv(self, tensors, peer, tag):
            posted.append((self.name, "recv"))
            return _Work()

    def routes(group, pairs):
        out = {}
        for a, b in pairs:
            if me in (a, b):
                peer = b if a == me else a
                lo, hi = min(a, b), max(a, b)
                up, down = Channel(f"up{lo}{hi}"), Channel(f"down{lo}{hi}")
                out[True, peer] = (up if me == lo else down, 0)
                out[False, peer] = (down if me == lo else up, 0)
        return out

    monkeypatch.setattr(comm, "_channel_routes", routes)
    monkeypatch.setattr(comm.dist, "get_rank", lambda group=None: me)
    p2p = P2P(_Group("nccl"), torch.device("cpu"), [(1, 2), (0, 1)], channels=True)
    assert p2p.connect_s is None
    seconds = p2p.connect()
    assert posted == want
    assert seconds > 0 and p2p.connect_s == seconds
