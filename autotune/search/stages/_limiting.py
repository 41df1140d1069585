"""What limits the bound: while the input pipelines bound every run below the ceiling, the next pipeline's supply;
otherwise the ceiling's grid, one dimension at a time from the best point; then the pipelines not measured yet."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.formatting import fmt_ips
from autotune.search.bounds import Snapshot, Status
from autotune.search.stages._ask import WAIT, Ask, Request, Wait
from autotune.search.stages._measure import ceiling_overrides, next_supply
from autotune.study.measured import Point, grid
from autotune.study.view import Stage

LAUNCH_BOUND = 60.0
"""The model alone keeping the GPUs busy less of the time than this (NVML, %) is bound by the host's kernel launches,
not by the GPUs' compute."""


@dataclass
class Limiting:
    """The measurements that can still raise the bound."""

    ask: Ask

    def next(self, snap: Snapshot) -> Request | Wait | None:
        m, f = self.ask.scope, fmt_ips
        best = snap.best if m.ceilings else None
        pipes = snap.pipes if m.supplies else []
        if m.supplies and not pipes:
            return next_supply(self.ask, snap)
        ceiling = best.interval if best is not None else None
        if ceiling is not None and pipes and max(p.upper for p in pipes) < ceiling.low:
            # The pipelines alone feed less than the model takes: a faster model cannot raise the bound; another
            # pipeline can.
            asked = next_supply(self.ask, snap)
            if asked:
                return asked
            self.ask.notes.note("input-bound", f"stages: no other precision or layout is measured: the input "
                                               f"pipelines (at most {f(max(p.point for p in pipes))} {snap.per}) "
                                               f"bound every trial below the ceiling ({f(best.value)})")
            return None
        if ceiling is not None and pipes and \
                max(p.with_model(ceiling.value, reach=True) for p in pipes) < ceiling.low:
            # Their decode shares the GPUs with the model: a pipeline that decodes less of each batch on them raises
            # the bound more than a faster model does, so the pipelines are measured first.
            top = max(pipes, key=lambda p: p.with_model(ceiling.value))
            asked = next_supply(self.ask, snap)
            if asked:
                self.ask.notes.note("decode-bound", f"stages: {m.pipe_name(top.family)}'s decode takes "
                                                    f"{top.decode_share(ceiling.value):.0%} of each sample's time on "
                                                    "the GPUs beside the model, bounding it at "
                                                    f"{f(top.with_model(ceiling.value))}: the other pipelines are "
                                                    "measured before other precisions and layouts")
                return asked
        if best is not None:
            asked = self.explore(snap, best.point)
            if asked:
                return asked
        return next_supply(self.ask, snap)

    def explore(self, snap: Snapshot, best: Point) -> Request | Wait | None:
        """One dimension at a time from the best point: each direction along the dimension's order until a step
        measures slower (its interval below the fastest's). A dimension with a one-off cost (a compile) comes last,
        unless the model alone leaves the GPUs idle (``launch_bound``): its steps then wait on the host's kernel
        launches, which a compile cuts and another precision or layout does not, so it comes first."""
        m, f = self.ask.scope, fmt_ips
        dims = list(enumerate(grid()))
        busy = self.launch_bound(snap, best)
        if busy is not None:
            dims.sort(key=lambda d: d[1].one_off_s is None)
            self.ask.notes.note("launch-bound", f"stages: the model alone keeps the GPUs {busy:.0f} % busy at "
                                                f"{best.label}: the host's kernel launches bound its steps, so "
                                                "compiled is weighed before other precisions and layouts")
        for i, dim in dims:
            # The other dimensions are explored without the one-off cost (each compiled point is a compile); the
            # costly one last, from the best (the grid's order), where the budget pays for it.
            frm = best if dim.one_off_s is not None else snap.without_one_off(best)
            top = snap.interval(frm)
            order = dim.order(m.choices(dim.path), m.on_gpu)
            pos = order.index(frm[i])
            for step in (1, -1):
                k = pos + step
                while 0 <= k < len(order):
                    q = frm.at(i, order[k])
                    state, request = snap.point_state(q)
                    if state == Status.PENDING:
                        return WAIT
                    if state in (Status.UNASKED, Status.RETRY):
                        request = request or ceiling_overrides(m, q, m.ceiling_batch(), True if m.on_gpu else None)
                        if dim.one_off_s is not None and k > 0 and not self.ask.spend.affords_one_off(
                                snap, dim, order, k, m.paid_here(dim, request)):
                            break
                        return self.ask.part(snap, Stage.CEILING, request)
                    measured = snap.interval(q)
                    if measured is not None and measured.below(top):
                        rest = order[k + 1:] if step > 0 else order[:k][::-1]
                        slower, held = dim.value_label(order[k]), dim.value_label(frm[i])
                        figures = f"{f(measured.value)} against {f(top.value)} {snap.per}"
                        if dim.one_off_s is not None:  # what its one-off cost bought, measured: nothing
                            self.ask.notes.note(f"slower:{dim.path}:{q}", f"stages: {slower} ran slower than {held} "
                                                f"at {frm.label}'s other settings ({figures}): {held} stays")
                        if rest:
                            labels = ", ".join(dim.value_label(x) for x in rest)
                            self.ask.notes.note(f"dominated:{dim.path}:{q}", f"stages: {labels} not measured: "
                                                f"{slower} already ran slower than {held} at {frm.label}'s other "
                                                f"settings ({figures}), and the order ranks {labels} below it")
                        break
                    k += step
        return None

    def launch_bound(self, snap: Snapshot, best: Point) -> float | None:
        """The GPUs' busy share (NVML, %) while the model alone ran at ``best``, where it is below ``LAUNCH_BOUND``
        and a one-off dimension (compile) is there to weigh; else None (on CPU ranks: no utilization)."""
        m = self.ask.scope
        if not any(d.one_off_s is not None and len(m.choices(d.path)) > 1 for d in grid()):
            return None
        utils = [v.util for v in snap.ceilings_of(best) if v.util is not None]
        busy = max(utils, default=None)
        return busy if busy is not None and busy < LAUNCH_BOUND else None
