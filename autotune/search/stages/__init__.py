"""The stages of a search: measure the bottleneck before searching — the likeliest fastest first, an end-to-end answer
within the first trials, and then only what can still raise the bound.

A trainer is as fast as the slower of two things: what the GPUs can compute (the *ceiling*) and what the input
pipeline can feed them (its *supply*). Both are cheap to measure on their own, and together they bound every
end-to-end run (at most the smaller of the two), so they say where to look. Before each trial the planner looks at
what is known and enqueues the next thing worth running, in this order (``StagePlanner.enqueue_next``):

1. **first ceiling** — the model alone on synthetic data at the largest batch (lower after an OOM), for the precision
   and layout the ceiling's grid (``bounds.grid``) ranks likeliest fastest. On a GPU it is measured without and with
   cuDNN's per-shape algorithm search, each on shapes its worker has not run (``autotune.search.evaluate`` starts a
   fresh worker where it has): cuDNN's plan cache is keyed without the search flag, so a second run in the same worker
   would reuse the first's plans and show no difference.
2. **first supply** — the input pipeline likeliest fastest alone (``training.mode: loader``, no model) at that batch
   with the most loader workers.
3. **candidates** — end-to-end trials at the ceiling's precision, layout and batch for the pipelines whose bound
   (min(supply, ceiling)) is within ``REACH`` of the best: one per decode family, the best of each (ties broken by
   measured headroom), the best bound first; and one at each precision and layout the ceiling cannot tell from the
   fastest (their intervals overlap: the end-to-end runs tell them apart, and the stages go on from the one that did
   best). The first runs as soon as one ceiling and one supply are known. A candidate whose every trial fails (OOM at
   its batch and at the repair's, an invalid combination) is replaced by the next; a precision whose end-to-end trials
   diverge and never train is dropped for the next-fastest one.
4. **trial 0 again** — when its interval was still wider than the precision asked at its time cap, in a fresh
   process: the gain over trial 0 is the headline.
5. **cuDNN per precision and layout** — for every precision and layout a candidate runs at, the measurement without
   the algorithm search beside the one with it; the search stays on for that pair only where it buys ``CUDNN_KEEP``.
6. **the project's pipeline on a script's folder** — where a user's script reads an image folder through a loader of
   its own and that loader's supply is below the ceiling, the project's fastest pipeline alone on the same folder
   (``run.image_loader``'s): once, a figure to say beside the script's own with the change to make.
7. **what limits the bound** — while the input pipelines bound every run below the ceiling, the next pipeline's
   supply; otherwise the ceiling's grid, one dimension at a time from the fastest pair, along the dimension's order
   until a step is measurably slower (the rest of that direction is then taken as dominated: the order is the prior, the
   measurement confirms it), a dimension with a one-off cost (torch.compile: a compile per graph) last and only
   where the budget left pays for that cost and end-to-end trials after it (``affords_one_off``), the cost priced by
   what this machine paid for the same graph (``_budget.one_off_price``: a compile from the on-disk caches costs
   seconds), and said when it runs slower; then the pipelines not measured yet (they can only tie, and ties are run
   end to end).
   A supply stops early, in-band, once its interval lies above the ceiling's or below what could still reach the
   best (``stop_when``).
8. **smaller batches** of the fastest pair, halving, while they keep ``PLATEAU`` of its pace: the smallest on the
   plateau becomes the candidates' batch, and a batch below it bounds what a trial there can reach. On CPU ranks,
   where the ceiling starts at the baseline's batch, then **larger ones** while the largest measured is measurably
   the fastest.
9. **uncertain pipelines** — one dropped on a supply whose interval stayed wide, but whose top reaches the band,
   gets an end-to-end trial.
10. **refine** — the sampler draws the other knobs (batch, accumulation, loader, DDP, the hybrid share, ...) with the
   pipeline, precision, layout and compile of the best end-to-end trials held, round-robin over those within
   ``REACH`` of the best; a compiled one also holds what its graph is keyed by (``Table.graph_settings``: each
   change is a new compile) and searches the input side around it. Draws the stages do not make (no stages, nothing
   measured yet) hold compile at the baseline's (``Refine.hold_one_off``). A draw whose measured ceiling (its
   precision, layout and batch) or supply reaches no higher than the bottom of the best's interval is not launched
   (``bound``): it is told to Optuna as pruned, so the sampler learns it, and costs no trial of the budget.
11. **confirm** — when the budget left pays for no more than that, and only where the best's interval overlaps
   other configurations', each tied leader (at most ``CONFIRM_TOP``) runs once more, before any step from 5 on: the
   best is named by its runs combined (``autotune.study.view.configurations``), not by the luckiest of several single
   runs, and leaders that still overlap are named a tie.

**The budget.** Measurements of parts spend at most ``PARTS_SHARE`` of this search's trials and of its time (the
first ceiling and supply excepted): the rest is end to end. A budget too small for the first ceiling, the first
supply and one end-to-end trial runs no stages, and one too small for the cuDNN comparison leaves cuDNN at its
default; either is said (``outline``, ``take_notes``), never skipped silently.

**What a job can measure.** A job measures its ceiling only if it can make a synthetic batch, its supply only if the
runtime gets its DataLoader (``Plan.measures_ceiling`` / ``Plan.measures_supply``, both true for the built-in job);
with neither, the search runs the sampler alone and says so.

Every measurement of a part is a trial of the parts study (``autotune.study.view``): dashboard, show, report, resume
and many workers work as for any trial, while Optuna's own view of the main study holds end-to-end trials only.

**Where each step lives.** ``StagePlanner`` (``_planner``) keeps the order and the plan's line, and holds the
measured view (``autotune.search.bounds.Measured``, read for its plan), the budget (``_budget.Spend``) and the notes
(``_notes``); each step is an object given those (``_ask.Ask``): the first measurements (``_first``: stages 1-2),
the candidates and trial 0 again (``_candidates``: 3-4), cuDNN (``_cudnn``: 5), the project's pipeline on a script's
folder (``_folder``: 6), what limits the bound (``_limits``: 7-9), refine (``_refine``: 10), confirm (``_confirm``:
11).
"""

from autotune.search.stages._ask import BLOCKED, REACH
from autotune.search.stages._budget import PARTS_SHARE, Budget
from autotune.search.stages._confirm import CONFIRM_TOP
from autotune.search.stages._cudnn import CUDNN_KEEP, evidence
from autotune.search.stages._first import CEILING_DATA
from autotune.search.stages._planner import StagePlanner

__all__ = ["BLOCKED", "CEILING_DATA", "CONFIRM_TOP", "CUDNN_KEEP", "PARTS_SHARE", "REACH", "Budget",
           "StagePlanner", "evidence"]
