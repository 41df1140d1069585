"""Stage 5, cuDNN per precision and layout: for every precision and layout a candidate runs at, the measurement
without the algorithm search beside the one with it, and the decision they make (recorded on the study)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.search.bounds import grid, pair_label
from autotune.search.stages._ask import Ask
from autotune.search.stages._first import ceiling_overrides
from autotune.space import get_path
from autotune.study.view import Stage, TrialView

CUDNN_KEEP = 0.99
"""cuDNN's algorithm search stays on only when it is worth more than 1 % of the steady pace (it makes the first step
of every new shape seconds long)."""


@dataclass
class Cudnn:
    """cuDNN's algorithm search: the evidence it is decided on, and the decisions."""

    ask: Ask

    def evidence(self, vs: list[TrialView]) -> Stage | str | None:
        """The measurement without the algorithm search beside the one with it, for each pair a candidate uses."""
        m = self.ask.measured
        if not (m.on_gpu and m.ceilings):
            return None
        decided = self.decisions()
        used = {m.pair_of(v) for v in vs if v.stage == Stage.CANDIDATE and not v.part}
        for pair in m.pairs():
            if pair not in used or pair_label(pair) in decided or self.has_one_off(pair):
                continue
            on = [v for v in m.ceilings_of(vs, pair) if v.setting("training.cudnn_benchmark") is True]
            if not on:
                continue
            batch = max(v.setting("training.batch_size") for v in on)
            name = self.ask.part(vs, Stage.CEILING, ceiling_overrides(m, pair, batch, False),
                                 attrs={"cudnn_evidence": True})
            if name:
                return name
        return None

    def decide(self, vs: list[TrialView]) -> None:
        """Record the decision for every pair measured at one batch with and without the search."""
        m = self.ask.measured
        if not m.on_gpu:
            return
        decided = self.decisions()
        changed = False
        for pair in m.pairs():
            label = pair_label(pair)
            if label in decided:
                continue
            by_batch: dict[int, dict[bool, TrialView]] = {}
            for v in m.ceilings_of(vs, pair):
                flag = (v.attrs.get("overrides") or {}).get("training.cudnn_benchmark")
                # Without the search, only a measurement made as evidence (on shapes new to its worker) counts.
                if flag is True or (flag is False and v.attrs.get("cudnn_evidence")):
                    slot = by_batch.setdefault(v.setting("training.batch_size"), {})
                    if flag not in slot or v.imgs_per_s > slot[flag].imgs_per_s:
                        slot[flag] = v
            for batch, slot in sorted(by_batch.items(), reverse=True):
                if True in slot and False in slot:
                    on, off = slot[True], slot[False]
                    decided[label] = {"benchmark": off.imgs_per_s < CUDNN_KEEP * on.imgs_per_s, "batch": batch,
                                      "with_search": evidence(on), "without_search": evidence(off)}
                    changed = True
                    break
        if changed:
            self.ask.study.set_user_attr("cudnn", decided)

    def decisions(self) -> dict[str, Any]:
        """cuDNN's algorithm search, decided per precision and layout (``pair_label``): ``benchmark`` and the two
        measurements it stands on."""
        return dict(self.ask.study.user_attrs.get("cudnn") or {})

    def decision(self, pair: tuple) -> bool | None:
        """A compiled point takes its eager point's decision: compiled convolutions are cuDNN's too, and evidence on
        shapes new to a worker would be a compile in a fresh one."""
        decided = self.decisions()
        d = decided.get(pair_label(pair)) or decided.get(pair_label(self.ask.measured.plain(pair)))
        return d["benchmark"] if d else None

    def has_one_off(self, pair: tuple) -> bool:
        """Whether ``pair`` is at a value with a one-off cost (compiled)."""
        return self.ask.measured.plain(pair) != tuple(pair)

    def cudnn_for(self, config: dict[str, Any]) -> bool | None:
        """cuDNN's algorithm search for a config's precision and layout, where the stages decided it."""
        return self.decision(tuple(get_path(config, dim.path) for dim in grid()))


def evidence(v: TrialView) -> dict[str, Any]:
    """A measurement a cuDNN decision stands on, as the study records it."""
    return {"trial": v.label, "imgs_per_s": v.imgs_per_s, "first_step_s": v.attrs.get("first_step_s"),
            "shapes_new_to_worker": v.attrs.get("shapes_new_to_worker")}
