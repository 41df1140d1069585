"""Stages 7 to 9, what limits the bound: the next pipeline's supply while the pipelines bound every run below the
ceiling, else the ceiling's grid one dimension at a time from the fastest pair; the fastest pair's smaller (on CPU
ranks also larger) batches; an end-to-end trial of a pipeline only an imprecise supply kept out."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import PLATEAU, grid, pair_label
from autotune.search.stages._ask import BLOCKED, Ask
from autotune.search.stages._candidates import Candidates
from autotune.search.stages._cudnn import Cudnn
from autotune.search.stages._first import First, ceiling_overrides
from autotune.study.view import Stage, TrialView

LAUNCH_BOUND = 60.0
"""The model alone keeping the GPUs busy less of the time than this (NVML, %) is bound by the host's kernel launches,
not by the GPUs' compute."""


@dataclass
class Limits:
    """The measurements that can still raise the bound, and the pipelines left uncertain."""

    ask: Ask
    first: First
    candidates: Candidates
    cudnn: Cudnn

    def limiting(self, vs: list[TrialView]) -> Stage | str | None:
        m = self.ask.measured
        best = m.best_pair(vs) if m.ceilings else None
        pipes = m.pipes(vs) if m.supplies else []
        if m.supplies and not pipes:
            return self.first.next_supply(vs)
        ceiling = m.pair_interval(vs, best[0]) if best is not None else None
        if ceiling is not None and pipes and max(p.upper for p in pipes) < ceiling.low:
            # The pipelines alone feed less than the model takes: a faster model cannot raise the bound; another
            # pipeline can.
            name = self.first.next_supply(vs)
            if name:
                return name
            self.ask.notes.note("input-bound", f"stages: no other precision or layout is measured: the input "
                                               f"pipelines (at most {max(p.point for p in pipes):,.0f} imgs/s) bound "
                                               f"every trial below the ceiling ({best[1]:,.0f})")
            return None
        if ceiling is not None and pipes and \
                max(p.with_model(ceiling.value, reach=True) for p in pipes) < ceiling.low:
            # Their decode shares the GPUs with the model: a pipeline that decodes less of each batch on them raises
            # the bound more than a faster model does, so the pipelines are measured first.
            top = max(pipes, key=lambda p: p.with_model(ceiling.value))
            name = self.first.next_supply(vs)
            if name:
                self.ask.notes.note("decode-bound", f"stages: {m.pipe_name(top.family)}'s decode takes "
                                                    f"{top.decode_share(ceiling.value):.0%} of each sample's time on "
                                                    "the GPUs beside the model, bounding it at "
                                                    f"{top.with_model(ceiling.value):,.0f}: the other pipelines are "
                                                    "measured before other precisions and layouts")
                return name
        if best is not None:
            name = self.explore(vs, best[0])
            if name:
                return name
        return self.first.next_supply(vs)

    def explore(self, vs: list[TrialView], best: tuple) -> Stage | str | None:
        """One dimension at a time from the fastest pair: each direction along the dimension's order until a step
        measures slower (its interval below the fastest's). A dimension with a one-off cost (a compile) comes last,
        unless the model alone leaves the GPUs idle (``launch_bound``): its steps then wait on the host's kernel
        launches, which a compile cuts and another precision or layout does not, so it comes first."""
        m = self.ask.measured
        dims = list(enumerate(grid()))
        busy = self.launch_bound(vs, best)
        if busy is not None:
            dims.sort(key=lambda d: d[1].one_off_s is None)
            self.ask.notes.note("launch-bound", f"stages: the model alone keeps the GPUs {busy:.0f} % busy at "
                                                f"{pair_label(best)}: the host's kernel launches bound its steps, so "
                                                "compiled is weighed before other precisions and layouts")
        for i, dim in dims:
            # The other dimensions are explored without the one-off cost (each compiled point is a compile); the
            # costly one last, from the best (the grid's order), where the budget pays for it.
            frm = best if dim.one_off_s is not None else m.without_one_off(vs, best)
            top = m.pair_interval(vs, frm)
            top_ips = top.value
            order = dim.order(m.choices(dim.path), m.on_gpu)
            pos = order.index(frm[i])
            for step in (1, -1):
                k = pos + step
                while 0 <= k < len(order):
                    q = (*frm[:i], order[k], *frm[i + 1:])
                    state, request = m.pair_state(vs, q)
                    if state == "pending":
                        return BLOCKED
                    if state in (None, "retry"):
                        request = request or ceiling_overrides(m, q, m.ceiling_batch(), True if m.on_gpu else None)
                        if dim.one_off_s is not None and k > 0 and not self.ask.spend.affords_one_off(
                                vs, dim, order, k, m.paid_here(dim, request)):
                            break
                        return self.ask.part(vs, Stage.CEILING, request)
                    measured = m.pair_interval(vs, q)
                    ips = measured.value if measured is not None else None
                    if measured is not None and measured.below(top):
                        rest = order[k + 1:] if step > 0 else order[:k][::-1]
                        slower, held = dim.value_label(order[k]), dim.value_label(frm[i])
                        if dim.one_off_s is not None:  # what its one-off cost bought, measured: nothing
                            self.ask.notes.note(f"slower:{dim.path}:{q}", f"stages: {slower} ran slower than {held} "
                                                f"at {pair_label(frm)}'s other settings ({ips:,.0f} against "
                                                f"{top_ips:,.0f} imgs/s): {held} stays")
                        if rest:
                            labels = ", ".join(dim.value_label(x) for x in rest)
                            self.ask.notes.note(f"dominated:{dim.path}:{q}", f"stages: {labels} not measured: "
                                                f"{slower} already ran slower than {held} at "
                                                f"{pair_label(frm)}'s other settings ({ips:,.0f} against "
                                                f"{top_ips:,.0f} imgs/s), and the order ranks {labels} below it")
                        break
                    k += step
        return None

    def launch_bound(self, vs: list[TrialView], best: tuple) -> float | None:
        """The GPUs' busy share (NVML, %) while the model alone ran at ``best``, where it is below ``LAUNCH_BOUND``
        and a one-off dimension (compile) is there to weigh; else None (on CPU ranks: no utilization)."""
        m = self.ask.measured
        if not any(d.one_off_s is not None and len(m.choices(d.path)) > 1 for d in grid()):
            return None
        utils = [v.util for v in m.ceilings_of(vs, best) if v.util is not None]
        busy = max(utils, default=None)
        return busy if busy is not None and busy < LAUNCH_BOUND else None

    def batches(self, vs: list[TrialView]) -> Stage | str | None:
        """The fastest pair's next smaller batch while the smallest keeps ``PLATEAU`` of its pace; on CPU ranks then
        the next larger one while the largest is clearly the fastest."""
        m = self.ask.measured
        best = m.best_pair(vs) if m.ceilings else None
        if best is None:
            return None
        if self.cudnn.has_one_off(best[0]):
            return None  # a ladder of compiled points is a compile at every batch, and compiled refinement holds it
        pair, top = best
        by_batch: dict[int, float] = {}
        intervals = {}
        for v in m.ceilings_of(vs, pair):
            b = v.setting("training.batch_size")
            if v.imgs_per_s > by_batch.get(b, 0.0):
                by_batch[b], intervals[b] = v.imgs_per_s, v.interval
        smallest, largest = min(by_batch), max(by_batch)
        choices = m.choices("training.batch_size")
        lower = [b for b in choices if b <= smallest // 2] if by_batch[smallest] >= PLATEAU * top else []
        flag = self.cudnn.decision(pair)
        if lower:
            return self.ask.part(vs, Stage.CEILING, ceiling_overrides(
                m, pair, max(lower), (True if flag is None else flag) if m.on_gpu else None))
        # CPU ranks start from the baseline's batch (``ceiling_batch``), and a larger one can be faster there too:
        # up the choices while the largest measured is measurably the fastest.
        below = [intervals[b] for b in by_batch if b < largest]
        higher = [b for b in choices if b > largest]
        if m.on_gpu or not higher or by_batch[largest] < top or \
                (below and not max(below, key=lambda i: i.value).below(intervals[largest])):
            return None
        return self.ask.part(vs, Stage.CEILING, ceiling_overrides(m, pair, min(higher), None))

    def uncertain(self, vs: list[TrialView]) -> Stage | None:
        """An end-to-end trial of a pipeline dropped on a supply whose interval stayed wide but whose top reaches
        the band."""
        c = self.candidates
        ranked = c.ranking(vs)
        if ranked is None or self.ask.spend.budget.left < 2:
            return None
        for pipe in ranked[1]:
            fixed = c.settings(vs, pipe)
            if c.state_of(vs, c.defining_values(fixed)) == "untried":
                self.ask.notes.note(f"uncertain:{pipe.family}", f"stages: {self.ask.measured.pipe_name(pipe.family)}'s "
                                    f"supply is uncertain ({pipe.point:,.0f} imgs/s, up to {pipe.upper:,.0f}): run "
                                    "end to end as well")
                c.enqueue(fixed, {"stage": Stage.CANDIDATE, "uncertain": True})
                return Stage.CANDIDATE
        return None
