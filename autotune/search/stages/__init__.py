"""The stages of a search: measure the bottleneck before searching — the likeliest fastest first, an end-to-end answer
within the first trials, and then only what can still raise the bound.

A trainer is as fast as the slower of two things: what the GPUs can compute (the *ceiling*) and what the input
pipeline can feed them (its *supply*). Both are cheap to measure on their own, and together they bound every
end-to-end run (at most the smaller of the two), so they say where to look. Before each trial the planner
(``_planner``) reads both studies once (``autotune.search.bounds.Snapshot``) and asks each stage, in the order of its
table ``_planner.STAGES`` (mirrored here and in docs/search.md), for its next request; the first that asks for
something has it enqueued. Each stage is one module exposing one object with ``next(snapshot)``: a ``Request`` (a
measurement of a part or an end-to-end trial, with its attrs), ``WAIT`` (another search worker runs what it needs) or
None. No stage builds or imports another; what several share is in ``_ask``, ``_budget``, ``_notes``, ``_measure``
and ``_ranking``, which are no stages.

1. **first ceiling** (``_ceiling``) — the model alone on synthetic data at the largest batch (lower after an OOM),
   at the point of the grid (precision, layout, compile: ``autotune.study.measured.grid``) likeliest fastest. On a
   GPU without and with cuDNN's per-shape algorithm search, each on shapes its worker has not run
   (``autotune.search.evaluate`` starts a fresh worker where it has): cuDNN's plan cache is keyed without the search
   flag, so a second run in the same worker would reuse the first's plans and show no difference.
2. **first supply** (``_supply``) — the input pipeline likeliest fastest alone (``training.mode: loader``, no model)
   at that batch with the most loader workers.
3. **candidates** (``_candidates``) — end-to-end trials at the ceiling's precision, layout and batch for the
   pipelines whose bound (min(supply, ceiling)) is within ``REACH`` of the best: one per decode family, the best of
   each (ties broken by measured headroom), the best bound first; and one at each point the ceiling cannot tell from
   the fastest (their intervals overlap: the end-to-end runs tell them apart, and the stages go on from the one that
   did best). A candidate whose every trial fails is replaced by the next; a precision whose end-to-end trials diverge
   and never train is dropped for the next-fastest one.
4. **trial 0 again** (``_baseline``) — when its interval was still wider than the precision asked at its time cap,
   in a fresh process: the gain over trial 0 is the headline.
5. **confirm** (``_confirm``) — when the budget left pays for no more than that, and only where the best's interval
   overlaps other configurations', each tied leader (at most ``CONFIRM_TOP``) runs once more, before any further
   exploration: the best is named by its runs combined (``autotune.study.view.configurations``).
6. **cudnn** (``_cudnn``) — for every point a candidate runs at, the measurement without the algorithm search beside
   the one with it; the search stays on for that point only where it buys ``CUDNN_KEEP`` (the planner records each
   decision on the study, keyed by the point's settings).
7. **image folder** (``_folder``) — where a user's script reads an image folder through a loader of its own and that
   loader's supply is below the ceiling, the project's fastest pipeline alone on the same folder, once.
8. **limiting** (``_limiting``) — while the input pipelines bound every run below the ceiling, the next pipeline's
   supply; otherwise the ceiling's grid, one dimension at a time from the best point, along the dimension's order until
   a step is measurably slower; a dimension with a one-off cost (torch.compile) last and only where the budget pays for
   it (``_budget.Spend.affords_one_off``, priced by what this machine paid for the same graph), first where the model
   alone leaves the GPUs idle; then the pipelines not measured yet. A supply stops early, in-band, once its interval
   lies above the ceiling's or below what could still reach the best (``_measure.stop_when``).
9. **batches** (``_batches``) — smaller batches of the best point, halving, while they keep ``PLATEAU`` of its
   pace; on CPU ranks, where the ceiling starts at the baseline's batch, then larger ones while the largest measured
   is measurably the fastest.
10. **uncertain** (``_uncertain``) — a pipeline dropped on a supply whose interval stayed wide, but whose top reaches
    the band, gets an end-to-end trial.
11. **profile** (``_profile``) — where the best end-to-end configuration reaches well below what its parts allow
    together (they do not explain it), it runs once more with a few steps profiled after its windows: its step split
    into waiting for data, the host-to-device copy, forward and backward, the optimizer, DDP's communication and the
    host's launch gaps; once.
12. **climb** (``_climb``) — from the fastest end-to-end configuration, one searched knob one step along its order
    at a time, the knobs what limits the job points to first (the profiled step's largest part, where there is a
    profile); a faster move (or a tied, cheaper one) becomes the point, any other closes its direction, until no move
    is left.
13. **refine** (``_refine``) — the sampler draws the other knobs with the pipeline, precision, layout and compile of
    the best end-to-end trials held, round-robin over those within ``REACH`` of the best; a compiled one also holds
    what its graph is keyed by (``Table.graph_settings``). A draw whose measured bound reaches no higher than the
    bottom of the best's interval is not launched (``StagePlanner.bound``).
14. **hold one-off** (``_hold``) — a draw the stages leave to the sampler holds compile at the baseline's value.

**The budget.** Measurements of parts spend at most ``PARTS_SHARE`` of this search's trials and of its time (the
first ceiling and supply excepted): the rest is end to end. A budget too small for the first ceiling, the first
supply and one end-to-end trial runs no stages, and one too small for the cuDNN comparison leaves cuDNN at its
default; either is said (``StagePlanner.outline``, ``take_notes``), never skipped silently.

**What a job can measure.** A job measures its ceiling only if it can make a synthetic batch, its supply only if the
runtime gets its DataLoader (``Plan.measures_ceiling`` / ``Plan.measures_supply``, both true for the built-in job);
with neither, the search climbs from trial 0 (``_climb``), then the sampler draws, and it says so.

Every measurement of a part is a trial of the parts study (``autotune.study.view``): dashboard, show, report, resume
and many workers work as for any trial, while Optuna's own view of the main study holds end-to-end trials only.
"""

from autotune.search.stages._ask import REACH, WAIT, Request
from autotune.search.stages._budget import PARTS_SHARE, Budget
from autotune.search.stages._confirm import CONFIRM_TOP
from autotune.search.stages._cudnn import CUDNN_KEEP
from autotune.search.stages._measure import CEILING_DATA
from autotune.search.stages._planner import STAGES, StagePlanner

__all__ = ["CEILING_DATA", "CONFIRM_TOP", "CUDNN_KEEP", "PARTS_SHARE", "REACH", "STAGES", "WAIT", "Budget", "Request",
           "StagePlanner"]
