"""Lowering (communication insertion) and validation of pipeline schedules.

Execution semantics of a lowered program
----------------------------------------
:func:`validate`'s deadlock replay, the simulator (:mod:`vpipe.sim`) and the runtime all assume:

* Each rank runs its action list in order, one action at a time.
* ``SEND`` posts an asynchronous send (``isend``) and returns at once; it never blocks. The
  runtime completes all outstanding sends at the end of the step.
* ``RECV`` posts an asynchronous receive (``irecv``) and returns at once; it never blocks.
* A compute action (``F``, ``B``, ``I``, ``W``, or an ``OVERLAP_F_B`` compound, whose parts run
  one after another) first waits for the receives that feed it, which were posted earlier on
  the same rank, then runs. Tensors between stages on the same rank are handed over locally.
* Matching: between two ranks, per direction, the k-th SEND the sender posts matches the k-th
  RECV the receiver posts (per-peer FIFO, as with NCCL, or gloo with one tag).

So a rank can only be stuck at a compute action whose input's matching SEND is never posted,
and posting a receive early can never block. A compute-only schedule is replayed as if each
output were sent right after its producer.

Lowering places each SEND right after its producer (after the whole compound for an overlap
action) and each RECV ``recv_lookahead`` compute actions before its consumer (default 1: the
transfer overlaps the preceding compute action while receive buffers stay few), moved earlier
where needed so that every peer's receives are posted in the order its sends are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vpipe.ir import Action, Kind, Schedule, ScheduleError, format_action

__all__ = ["lower", "validate", "Program", "compile_program", "replay"]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
_SF, _RF, _SB, _RB = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_OV = Kind.OVERLAP_F_B
_new = tuple.__new__

# Op codes of a compiled program.
OP_COMPUTE = 0  # arg: message id it waits on, or -1
OP_COMPUTE_MULTI = 1  # arg: index into Program.multi_waits
OP_SEND = 2  # arg: message id
OP_RECV = 3  # arg: message id
# Compute classes: kind code * n_stages + stage, kind codes F=0, B=1, I=2, W=3; compound k has
# class 4 * n_stages + k.
KIND_CODES = {_F: 0, _B: 1, _I: 2, _W: 3}
CODE_KINDS = (_F, _B, _I, _W)
_PART_BITS = 6  # ordering key = position << 6 | part index


@dataclass
class Program:
    """A schedule compiled to flat integer lists, the input of :func:`replay`.

    Message ids: ``(direction * (n_stages - 1) + boundary) * n_microbatches + microbatch``;
    direction 0 carries F(boundary)'s output to stage boundary+1, direction 1 carries the input
    gradient of stage boundary+1 to stage boundary.
    """

    n_ranks: int
    n_stages: int
    n_microbatches: int
    code: list[list[int]]
    arg: list[list[int]]
    cls: list[list[int]]  # compute class per op (-1 for comm ops)
    pos: list[list[int]]  # position of the op's action in the rank's list
    multi_waits: list[tuple[int, ...]] = field(default_factory=list)
    compounds: list[tuple[Action, ...]] = field(default_factory=list)
    lowered: bool = False
    placement: list[int] = field(default_factory=list)
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def n_messages(self) -> int:
        return 2 * max(self.n_stages - 1, 0) * self.n_microbatches

    def message(self, e: int) -> tuple[int, int, int]:
        """(direction, boundary, microbatch) of a message id."""
        nb = self.n_stages - 1
        q, m = divmod(e, self.n_microbatches)
        d, b = divmod(q, nb)
        return d, b, m


def _where(r: int, i: int, a: Action) -> str:
    return f"rank {r}, position {i}, action {format_action(a)}"


def _recv_action(d: int, b: int, m: int) -> Action:
    return _new(Action, (b + 1, _RF, m, ())) if d == 0 else _new(Action, (b, _RB, m, ()))


def _send_action(d: int, b: int, m: int) -> Action:
    return _new(Action, (b, _SF, m, ())) if d == 0 else _new(Action, (b + 1, _SB, m, ()))


def _check_header(s: Schedule) -> None:
    if s.n_ranks < 1 or s.n_stages < 1 or s.n_microbatches < 1:
        raise ScheduleError(
            f"schedule needs at least one rank, stage and microbatch, got ranks={s.n_ranks}, "
            f"stages={s.n_stages}, microbatches={s.n_microbatches}"
        )
    if len(s.actions) != s.n_ranks:
        raise ScheduleError(f"schedule has {len(s.actions)} action lists for {s.n_ranks} ranks")
    if set(s.placement) != set(range(s.n_stages)):
        extra = sorted(set(s.placement) - set(range(s.n_stages)))
        missing = sorted(set(range(s.n_stages)) - set(s.placement))
        raise ScheduleError(
            f"placement must map every stage 0..{s.n_stages - 1} to a rank "
            f"(missing {missing[:5]}, unexpected {extra[:5]})"
        )
    for st, r in s.placement.items():
        if not (isinstance(r, int) and 0 <= r < s.n_ranks):
            raise ScheduleError(
                f"placement puts stage {st} on rank {r}, outside 0..{s.n_ranks - 1}"
            )


def compile_program(schedule: Schedule, *, check: bool = True) -> Program:
    """Compile a compute-only or lowered schedule for :func:`replay`.

    With ``check`` every static rule of :func:`validate` is enforced (all but deadlock
    freedom, which needs the replay); without it the schedule is trusted (fast path for
    programs built by :func:`lower` from a validated schedule).
    """
    _check_header(schedule)
    P, S, M = schedule.n_ranks, schedule.n_stages, schedule.n_microbatches
    place = [schedule.placement[s] for s in range(S)]
    NB = S - 1
    # Remote input/output message bases per stage (-1 when the neighbour is on the same rank).
    f_in = [(s - 1) * M if s > 0 and place[s - 1] != place[s] else -1 for s in range(S)]
    f_out = [s * M if s < NB and place[s + 1] != place[s] else -1 for s in range(S)]
    b_in = [(NB + s) * M if s < NB and place[s + 1] != place[s] else -1 for s in range(S)]
    b_out = [(NB + s - 1) * M if s > 0 and place[s - 1] != place[s] else -1 for s in range(S)]
    n = S * M
    if check:
        fk, bk, wk = [-1] * n, [-1] * n, [-1] * n
        is_i = bytearray(n)
        where_f: dict[int, tuple[int, int, Action]] = {}
        sk = [-1] * (2 * NB * M if NB else 0)  # SEND key per message id
        rk = [-1] * len(sk)
        chan_send: dict[int, list[int]] = {}
        chan_recv: dict[int, list[int]] = {}
    codes, args, clss, poss = [], [], [], []
    multi: list[tuple[int, ...]] = []
    compounds: list[tuple[Action, ...]] = []
    lowered = False
    base_ov = 4 * S
    for r, acts in enumerate(schedule.actions):
        code: list[int] = []
        arg: list[int] = []
        cls: list[int] = []
        pos: list[int] = []
        codes.append(code)
        args.append(arg)
        clss.append(cls)
        poss.append(pos)
        for i, a in enumerate(acts):
            k = a[1]
            if k is _F or k is _B or k is _I or k is _W or k is _OV:
                if k is _OV:
                    parts = a[3]
                    if check and not 1 < len(parts) < (1 << _PART_BITS):
                        raise ScheduleError(f"{_where(r, i, a)}: overlap needs 2..63 parts")
                    cls.append(base_ov + len(compounds))
                    compounds.append(parts)
                else:
                    parts = (a,)
                    cls.append(-1)  # filled below
                waits = []
                posts = []
                for pi, p in enumerate(parts):
                    s, pk, m = p[0], p[1], p[2]
                    if check:
                        _check_compute(r, i, a, p, S, M, place)
                        key = i << _PART_BITS | pi
                        idx = s * M + m
                        if pk is _F:
                            if fk[idx] >= 0:
                                raise ScheduleError(
                                    f"{_where(r, i, a)}: duplicate forward {format_action(p)} "
                                    f"(also at position {fk[idx] >> _PART_BITS})"
                                )
                            fk[idx] = key
                            where_f[idx] = (r, i, a)
                        elif pk is _W:
                            if wk[idx] >= 0:
                                raise ScheduleError(
                                    f"{_where(r, i, a)}: duplicate weight gradient "
                                    f"{format_action(p)} (also at position {wk[idx] >> _PART_BITS})"
                                )
                            wk[idx] = key
                        else:
                            if bk[idx] >= 0:
                                other = format_action(Action(s, _I if is_i[idx] else _B, m))
                                raise ScheduleError(
                                    f"{_where(r, i, a)}: duplicate backward for stage {s} "
                                    f"microbatch {m} ({other} already at position "
                                    f"{bk[idx] >> _PART_BITS})"
                                )
                            bk[idx] = key
                            is_i[idx] = pk is _I
                    if pk is _F:
                        if f_in[s] >= 0:
                            waits.append(f_in[s] + m)
                        if f_out[s] >= 0:
                            posts.append(f_out[s] + m)
                    elif pk is not _W:
                        if b_in[s] >= 0:
                            waits.append(b_in[s] + m)
                        if b_out[s] >= 0:
                            posts.append(b_out[s] + m)
                if k is not _OV:
                    kc = 0 if k is _F else 1 if k is _B else 2 if k is _I else 3
                    cls[-1] = kc * S + a[0]
                if len(waits) <= 1:
                    code.append(OP_COMPUTE)
                    arg.append(waits[0] if waits else -1)
                else:
                    code.append(OP_COMPUTE_MULTI)
                    arg.append(len(multi))
                    multi.append(tuple(waits))
                pos.append(i)
                if posts:
                    # Compute-only replay: outputs count as sent right after the producer.
                    # In a lowered program the SEND actions post them instead.
                    for e in posts:
                        code.append(-OP_SEND - 1)
                        arg.append(e)
                        cls.append(-1)
                        pos.append(i)
            else:
                lowered = True
                e = _comm_message(r, i, a, S, M, place, check)
                code.append(OP_SEND if k is _SF or k is _SB else OP_RECV)
                arg.append(e)
                cls.append(-1)
                pos.append(i)
                if check:
                    d, b = divmod(e // M, NB)
                    peer = place[b + 1] if (k is _SF or k is _RB) else place[b]
                    if k is _SF or k is _SB:
                        if sk[e] >= 0:
                            raise ScheduleError(
                                f"{_where(r, i, a)}: duplicate send (also at position "
                                f"{sk[e] >> _PART_BITS})"
                            )
                        sk[e] = i << _PART_BITS
                        chan_send.setdefault(r * P + peer, []).append(e)
                    else:
                        if rk[e] >= 0:
                            raise ScheduleError(
                                f"{_where(r, i, a)}: duplicate receive (also at position "
                                f"{rk[e] >> _PART_BITS})"
                            )
                        rk[e] = i << _PART_BITS
                        chan_recv.setdefault(peer * P + r, []).append(e)
    # Virtual sends (code -3) are real in compute-only programs, dropped in lowered ones.
    for r in range(P):
        code, arg, cls, pos = codes[r], args[r], clss[r], poss[r]
        if any(c < 0 for c in code):
            keep = [j for j, c in enumerate(code) if c >= 0] if lowered else None
            if keep is None:
                codes[r] = [OP_SEND if c < 0 else c for c in code]
            else:
                codes[r] = [code[j] for j in keep]
                args[r] = [arg[j] for j in keep]
                clss[r] = [cls[j] for j in keep]
                poss[r] = [pos[j] for j in keep]
    prog = Program(
        P, S, M, codes, args, clss, poss, multi, compounds, lowered, place, schedule.actions
    )
    if check:
        _check_complete(schedule, prog, place, fk, bk, wk, is_i)
        if lowered:
            _check_comm(schedule, prog, place, fk, bk, sk, rk, chan_send, chan_recv)
    return prog


def _check_compute(r: int, i: int, a: Action, p: Action, S: int, M: int, place: list[int]) -> None:
    s, m = p[0], p[2]
    if not 0 <= s < S:
        raise ScheduleError(f"{_where(r, i, a)}: stage {s} out of range 0..{S - 1}")
    if not 0 <= m < M:
        raise ScheduleError(f"{_where(r, i, a)}: microbatch {m} out of range 0..{M - 1}")
    if place[s] != r:
        raise ScheduleError(
            f"{_where(r, i, a)}: runs stage {s}, which lives on rank {place[s]} "
            "(a stage lives on one rank)"
        )


def _comm_message(r: int, i: int, a: Action, S: int, M: int, place: list[int], check: bool) -> int:
    """The message id a SEND/RECV action carries; with ``check`` its legality."""
    s, k, m = a[0], a[1], a[2]
    NB = S - 1
    if k is _SF or k is _RB:
        b, d, nb = s, 0 if k is _SF else 1, s + 1
    else:
        b, d, nb = s - 1, 0 if k is _RF else 1, s - 1
    if check:
        if k is not _SF and k is not _RF and k is not _SB and k is not _RB:
            raise ScheduleError(f"{_where(r, i, a)}: unknown action kind")
        if not 0 <= s < S:
            raise ScheduleError(f"{_where(r, i, a)}: stage {s} out of range 0..{S - 1}")
        if not 0 <= m < M:
            raise ScheduleError(f"{_where(r, i, a)}: microbatch {m} out of range 0..{M - 1}")
        if place[s] != r:
            raise ScheduleError(
                f"{_where(r, i, a)}: stage {s} lives on rank {place[s]}, so its "
                f"communication belongs there"
            )
        if not 0 <= nb < S:
            raise ScheduleError(f"{_where(r, i, a)}: stage {s} has no neighbour stage {nb}")
        if place[nb] == r:
            raise ScheduleError(
                f"{_where(r, i, a)}: stages {s} and {nb} are both on rank {r}: "
                "no communication between same-rank stages (the tensor is handed over locally)"
            )
    return (d * NB + b) * M + m


def _check_complete(
    s: Schedule,
    prog: Program,
    place: list[int],
    fk: list[int],
    bk: list[int],
    wk: list[int],
    is_i: bytearray,
) -> None:
    """Every (stage, microbatch) has one F and one B, or one I then one W, in dependency order
    on its rank (local handoffs included)."""
    S, M = s.n_stages, s.n_microbatches
    acts = s.actions

    def at(key: int, r: int) -> str:
        i = key >> _PART_BITS
        return _where(r, i, acts[r][i])

    for st in range(S):
        r = place[st]
        local_prev = st > 0 and place[st - 1] == r
        local_next = st < S - 1 and place[st + 1] == r
        for m in range(M):
            idx = st * M + m
            f, b, w = fk[idx], bk[idx], wk[idx]
            if f < 0:
                raise ScheduleError(
                    f"rank {r}: missing action {st}F{m} (stage {st} is on rank {r})"
                )
            if b < 0:
                what = "W without its I" if w >= 0 else "no backward (B, or I and W)"
                raise ScheduleError(
                    f"rank {r}: stage {st} microbatch {m} has {what}: expected {st}B{m} or "
                    f"{st}I{m} followed by {st}W{m}"
                )
            if b < f:
                raise ScheduleError(f"{at(b, r)}: backward runs before its forward {st}F{m}")
            if is_i[idx]:
                if w < 0:
                    raise ScheduleError(f"{at(b, r)}: input gradient without a later {st}W{m}")
                if w < b:
                    raise ScheduleError(f"{at(w, r)}: weight gradient runs before {st}I{m}")
            elif w >= 0:
                raise ScheduleError(
                    f"{at(w, r)}: {st}W{m} after a full backward {st}B{m} (use I and W instead)"
                )
            if local_prev and fk[idx - M] > f:
                raise ScheduleError(
                    f"{at(f, r)}: needs {st - 1}F{m}'s output, which runs later on the same "
                    f"rank ({at(fk[idx - M], r)})"
                )
            if local_next and bk[idx + M] > b:
                raise ScheduleError(
                    f"{at(b, r)}: needs the gradient from stage {st + 1}, whose backward runs "
                    f"later on the same rank ({at(bk[idx + M], r)})"
                )


def _check_comm(
    s: Schedule,
    prog: Program,
    place: list[int],
    fk: list[int],
    bk: list[int],
    sk: list[int],
    rk: list[int],
    chan_send: dict[int, list[int]],
    chan_recv: dict[int, list[int]],
) -> None:
    """Every cross-rank edge has its SEND after the producer and its RECV before the
    consumer, and every peer's receives are posted in its send order (per-peer FIFO)."""
    S, M, P = s.n_stages, s.n_microbatches, s.n_ranks
    NB = S - 1
    acts = s.actions

    def at(key: int, r: int) -> str:
        i = key >> _PART_BITS
        return _where(r, i, acts[r][i])

    for b in range(NB):
        ra, rb = place[b], place[b + 1]
        if ra == rb:
            continue
        for d in (0, 1):
            src, dst = (ra, rb) if d == 0 else (rb, ra)
            prod_keys = fk if d == 0 else bk
            prod_stage, cons_stage = (b, b + 1) if d == 0 else (b + 1, b)
            cons_keys = fk if d == 0 else bk
            base = (d * NB + b) * M
            for m in range(M):
                e = base + m
                send, recv = _send_action(d, b, m), _recv_action(d, b, m)
                sp, rp = sk[e], rk[e]
                prod, cons = prod_keys[prod_stage * M + m], cons_keys[cons_stage * M + m]
                if sp < 0:
                    raise ScheduleError(
                        f"{at(prod, src)}: no {format_action(send)} sends its output to rank {dst}"
                    )
                if rp < 0:
                    raise ScheduleError(
                        f"{at(cons, dst)}: no {format_action(recv)} receives its input from "
                        f"rank {src}"
                    )
                if sp < prod:
                    raise ScheduleError(f"{at(sp, src)}: send runs before its producer")
                if rp > cons:
                    raise ScheduleError(f"{at(rp, dst)}: receive is posted after its consumer")
    # Every message now has one SEND and one RECV, so each channel carries the same set of
    # messages both ways and only their order can differ.
    for ch, sends in chan_send.items():
        recvs = chan_recv[ch]
        if sends == recvs:
            continue
        src, dst = divmod(ch, P)
        k = next(k for k, (es, er) in enumerate(zip(sends, recvs, strict=True)) if es != er)
        es, er = sends[k], recvs[k]
        raise ScheduleError(
            f"per-peer FIFO order broken between rank {src} and rank {dst}: send #{k} "
            f"({at(sk[es], src)}) is matched by receive #{k} ({at(rk[er], dst)}), "
            f"which expects {format_action(_send_action(*prog.message(er)))}"
        )


def replay(
    prog: Program,
    durations: list[float] | None = None,
    message_cost: list[float] | None = None,
) -> tuple[list[list[float]], list[float]]:
    """Run a compiled program under the module's execution semantics.

    Returns (per-rank op start times, per-message arrival times). ``durations`` is indexed by
    compute class (zero when omitted), ``message_cost`` by message id (zero when omitted); a
    transfer starts when both its SEND and RECV are posted. Raises ScheduleError naming where
    every stuck rank waits when the program deadlocks.
    """
    P = prog.n_ranks
    n_msg = prog.n_messages
    if durations is None:
        durations = [0.0] * (4 * prog.n_stages + len(prog.compounds))
    if message_cost is None:
        message_cost = [0.0] * n_msg
    send_t = [-1.0] * n_msg
    recv_t = [0.0] * n_msg
    arrive = [0.0] * n_msg
    waiter = [-1] * n_msg
    pcs = [0] * P
    clocks = [0.0] * P
    starts = [[0.0] * len(c) for c in prog.code]
    multi = prog.multi_waits
    ready = list(range(P - 1, -1, -1))
    blocked_on = [-1] * P
    while ready:
        r = ready.pop()
        codes, args, cls, st = prog.code[r], prog.arg[r], prog.cls[r], starts[r]
        i, n, t = pcs[r], len(codes), clocks[r]
        while i < n:
            c = codes[i]
            x = args[i]
            if c == 0:
                if x >= 0:
                    s = send_t[x]
                    if s < 0:
                        waiter[x] = r
                        blocked_on[r] = x
                        break
                    q = recv_t[x]
                    s = (s if s > q else q) + message_cost[x]
                    arrive[x] = s
                    if s > t:
                        t = s
                st[i] = t
                t += durations[cls[i]]
            elif c == 2:
                st[i] = t
                send_t[x] = t
                w = waiter[x]
                if w >= 0:
                    waiter[x] = -1
                    ready.append(w)
            elif c == 3:
                st[i] = t
                recv_t[x] = t
            else:
                es = multi[x]
                missing = next((e for e in es if send_t[e] < 0), -1)
                if missing >= 0:
                    waiter[missing] = r
                    blocked_on[r] = missing
                    break
                for e in es:
                    q = recv_t[e]
                    s = send_t[e]
                    s = (s if s > q else q) + message_cost[e]
                    arrive[e] = s
                    if s > t:
                        t = s
                st[i] = t
                t += durations[cls[i]]
            i += 1
        pcs[r] = i
        clocks[r] = t
    stuck = [r for r in range(P) if pcs[r] < len(prog.code[r])]
    if stuck:
        raise ScheduleError(_deadlock_message(prog, pcs, blocked_on, stuck))
    return starts, arrive


def _deadlock_message(
    prog: Program, pcs: list[int], blocked_on: list[int], stuck: list[int]
) -> str:
    parts = []
    for r in stuck[:6]:
        i = prog.pos[r][pcs[r]]
        d, b, m = prog.message(blocked_on[r])
        src = prog.placement[b] if d == 0 else prog.placement[b + 1]
        if prog.lowered:
            what = f"{format_action(_recv_action(d, b, m))} from rank {src}"
        else:
            prod = f"{b}F{m}" if d == 0 else f"the backward of stage {b + 1} microbatch {m}"
            what = f"{prod} on rank {src}"
        parts.append(f"{_where(r, i, prog.actions[r][i])} waits for {what}")
    more = f"; and {len(stuck) - 6} more stuck ranks" if len(stuck) > 6 else ""
    return "deadlock: " + "; ".join(parts) + more


def validate(schedule: Schedule) -> None:
    """Check a compute-only or lowered schedule; raise ScheduleError naming rank, position and
    action of the first problem (or, for a deadlock, where every stuck rank waits)."""
    replay(compile_program(schedule, check=True))


def lower(schedule: Schedule, *, check: bool = True, recv_lookahead: int = 1) -> Schedule:
    """Insert SEND/RECV actions for every cross-rank edge of a compute-only schedule.

    SENDs go right after their producer; each RECV goes ``recv_lookahead`` compute actions
    before its consumer (0: right before it), earlier where per-peer FIFO order needs it. No
    communication is inserted between stages on the same rank. With ``check`` the input is
    validated first, so the result is valid (deadlock-free under the module's semantics).
    """
    if recv_lookahead < 0:
        raise ScheduleError(f"recv_lookahead must be >= 0, got {recv_lookahead}")
    for r, i, a in _first_comm(schedule):
        raise ScheduleError(f"{_where(r, i, a)}: schedule is already lowered")
    if check:
        validate(schedule)
    P, S, M = schedule.n_ranks, schedule.n_stages, schedule.n_microbatches
    place = [schedule.placement[s] for s in range(S)]
    NB = S - 1
    f_out = [s * M if s < NB and place[s + 1] != place[s] else -1 for s in range(S)]
    b_out = [(NB + s - 1) * M if s > 0 and place[s - 1] != place[s] else -1 for s in range(S)]
    f_in = [s - 1 if s > 0 and place[s - 1] != place[s] else -1 for s in range(S)]
    b_in = [s if s < NB and place[s + 1] != place[s] else -1 for s in range(S)]
    n_msg = 2 * NB * M
    # Consumer compute index of each message on its rank.
    consumer = [0] * n_msg
    sends: list[dict[int, list[Action]]] = []
    chan: dict[int, list[int]] = {}
    for r, acts in enumerate(schedule.actions):
        out: dict[int, list[Action]] = {}
        sends.append(out)
        for j, a in enumerate(acts):
            k = a[1]
            for p in a[3] if k is _OV else (a,):
                s, pk, m = p[0], p[1], p[2]
                if pk is _F:
                    if f_in[s] >= 0:
                        consumer[f_in[s] * M + m] = j
                    e = f_out[s]
                    if e >= 0:
                        out.setdefault(j, []).append(_new(Action, (s, _SF, m, ())))
                        chan.setdefault(r * P + place[s + 1], []).append(e + m)
                elif pk is not _W:
                    if b_in[s] >= 0:
                        consumer[(NB + b_in[s]) * M + m] = j
                    e = b_out[s]
                    if e >= 0:
                        out.setdefault(j, []).append(_new(Action, (s, _SB, m, ())))
                        chan.setdefault(r * P + place[s - 1], []).append(e + m)
    # Receives per (rank, slot): slot j means "just before compute action j".
    slots: list[dict[int, list[Action]]] = [{} for _ in range(P)]
    for ch in sorted(chan):
        dst = ch % P
        dslots = slots[dst]
        msgs = chan[ch]
        placed = [0] * len(msgs)
        lim = 1 << 62
        for q in range(len(msgs) - 1, -1, -1):  # latest slot that keeps send order
            want = consumer[msgs[q]] - recv_lookahead
            lim = want if want < lim else lim
            placed[q] = lim if lim > 0 else 0
        for e, j in zip(msgs, placed, strict=True):
            d, rest = divmod(e, NB * M)
            b, m = divmod(rest, M)
            dslots.setdefault(j, []).append(_recv_action(d, b, m))
    lowered = []
    for r, acts in enumerate(schedule.actions):
        rs, ss = slots[r], sends[r]
        prog: list[Action] = []
        for j, a in enumerate(acts):
            if j in rs:
                prog.extend(rs[j])
            prog.append(a)
            if j in ss:
                prog.extend(ss[j])
        lowered.append(prog)
    return schedule.replace_actions(lowered)


def _first_comm(schedule: Schedule):
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            k = a[1]
            if k is _SF or k is _RF or k is _SB or k is _RB:
                yield r, i, a
                return
