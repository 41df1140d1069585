"""Stages 7 to 9, what limits the bound: the next pipeline's supply while the pipelines bound every run below the
ceiling, else the ceiling's grid one dimension at a time from the fastest pair; the fastest pair's smaller (on CPU
ranks also larger) batches; an end-to-end trial of a pipeline only an unsettled supply kept out."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.search.bounds import PLATEAU, grid, pair_label
from autotune.search.stages._ask import BLOCKED, Ask
from autotune.search.stages._candidates import Candidates
from autotune.search.stages._cudnn import Cudnn
from autotune.search.stages._first import First, ceiling_overrides
from autotune.study.view import TrialView


@dataclass
class Limits:
    """The measurements that can still raise the bound, and the pipelines left uncertain."""

    ask: Ask
    first: First
    candidates: Candidates
    cudnn: Cudnn

    def limiting(self, vs: list[TrialView]) -> str | None:
        m = self.ask.measured
        best = m.best_pair(vs) if m.ceilings else None
        pipes = m.pipes(vs) if m.supplies else []
        if m.supplies and not pipes:
            return self.first.next_supply(vs)
        if best is not None and pipes and max(p.point for p in pipes) < best[1] * (1 - m.tolerance):
            name = self.first.next_supply(vs)
            if name:
                return name
            self.ask.notes.note("input-bound", f"stages: no other precision or layout is measured: the input "
                                               f"pipelines (at most {max(p.point for p in pipes):,.0f} imgs/s) bound "
                                               f"every trial below the ceiling ({best[1]:,.0f})")
            return None
        if best is not None:
            name = self.explore(vs, best[0])
            if name:
                return name
        return self.first.next_supply(vs)

    def explore(self, vs: list[TrialView], best: tuple) -> str | None:
        """One dimension at a time from the fastest pair: each direction along the dimension's order until a step
        measures clearly slower."""
        m = self.ask.measured
        for i, dim in enumerate(grid()):
            # The other dimensions are explored without the one-off cost (each compiled point is a compile); the
            # costly one last, from the best (the grid's order), where the budget pays for it.
            frm = best if dim.once_s is not None else m.without_once(vs, best)
            top_ips = m.pair_ceiling(vs, frm)
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
                        if dim.once_s is not None and k > 0 and not self.ask.spend.affords_once(
                                vs, dim, order, k, m.paid_here(dim, request)):
                            break
                        return self.ask.part(vs, "ceiling", request)
                    ips = m.pair_ceiling(vs, q)
                    if ips is not None and ips < top_ips * (1 - m.measure.spread_target):
                        rest = order[k + 1:] if step > 0 else order[:k][::-1]
                        if dim.once_s is not None:  # what its one-off cost bought, measured: nothing
                            self.ask.notes.note(f"slower:{dim.path}:{q}", f"stages: {dim.word(order[k])} ran slower "
                                                f"than {dim.word(frm[i])} at {pair_label(frm)}'s other settings "
                                                f"({ips:,.0f} against {top_ips:,.0f} imgs/s): {dim.word(frm[i])} "
                                                "stays")
                        if rest:
                            words = ", ".join(dim.word(x) for x in rest)
                            self.ask.notes.note(f"dominated:{dim.path}:{q}", f"stages: {words} not measured: "
                                                f"{dim.word(order[k])} already ran slower than {dim.word(frm[i])} at "
                                                f"{pair_label(frm)}'s other settings ({ips:,.0f} against "
                                                f"{top_ips:,.0f} imgs/s), and the order ranks {words} below it")
                        break
                    k += step
        return None

    def batches(self, vs: list[TrialView]) -> str | None:
        """The fastest pair's next smaller batch while the smallest keeps ``PLATEAU`` of its pace; on CPU ranks then
        the next larger one while the largest is clearly the fastest."""
        m = self.ask.measured
        best = m.best_pair(vs) if m.ceilings else None
        if best is None:
            return None
        if self.cudnn.once_of(best[0]):
            return None  # a ladder of compiled points is a compile at every batch, and compiled refinement holds it
        pair, top = best
        by_batch: dict[int, float] = {}
        for v in m.ceilings_of(vs, pair):
            b = v.setting("training.batch_size")
            by_batch[b] = max(by_batch.get(b, 0.0), v.imgs_per_s)
        smallest, largest = min(by_batch), max(by_batch)
        choices = m.choices("training.batch_size")
        lower = [b for b in choices if b <= smallest // 2] if by_batch[smallest] >= PLATEAU * top else []
        flag = self.cudnn.decision(pair)
        if lower:
            return self.ask.part(vs, "ceiling", ceiling_overrides(
                m, pair, max(lower), (True if flag is None else flag) if m.on_gpu else None))
        # CPU ranks start from the baseline's batch (``ceiling_batch``), and a larger one can be faster there too:
        # up the choices while the largest measured is clearly the fastest.
        below = [x for b, x in by_batch.items() if b < largest]
        higher = [b for b in choices if b > largest]
        if m.on_gpu or not higher or by_batch[largest] < top or \
                (below and by_batch[largest] <= max(below) * (1 + m.measure.spread_target)):
            return None
        return self.ask.part(vs, "ceiling", ceiling_overrides(m, pair, min(higher), None))

    def uncertain(self, vs: list[TrialView]) -> str | None:
        """An end-to-end trial of a pipeline dropped on a supply that never settled but whose fastest steady window
        reaches the band."""
        c = self.candidates
        ranked = c.ranking(vs)
        if ranked is None or self.ask.spend.budget.left < 2:
            return None
        for pipe in ranked[1]:
            fixed = c.settings(vs, pipe)
            if c.identity_state(vs, c.identity_of(fixed)) == "untried":
                self.ask.notes.note(f"uncertain:{pipe.family}", f"stages: {self.ask.measured.pipe_name(pipe.family)}'s "
                                    f"supply never settled ({pipe.point:,.0f} imgs/s, up to {pipe.upper:,.0f}): run "
                                    "end to end as well")
                c.enqueue(fixed, {"stage": "candidate", "uncertain": True})
                return "candidate"
        return None
