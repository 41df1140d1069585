"""The search engine: what is checked before a study is touched (``prepare``), the stages that measure the
bottleneck first (``stages``), and the ask → evaluate → record loop (``engine``, ``evaluate``, ``record``), with
failed combinations repaired (``repair``) and a live view (``progress``)."""

from autotune.search.engine import best_line, search
from autotune.search.prepare import SearchOptions

__all__ = ["SearchOptions", "best_line", "search"]
