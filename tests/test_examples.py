"""The examples and what the README says of them: the diff it shows is the diff between the two seed scripts, and it
stays about a dozen lines."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main_diff() -> list[str]:
    plain = (REPO / "examples" / "seed_ddp_plain.py").read_text().splitlines()
    tuned = (REPO / "examples" / "seed_ddp.py").read_text().splitlines()
    a, b = plain[plain.index("def main():"):], tuned[tuned.index("def main():"):]
    return list(difflib.unified_diff(a, b, lineterm="", n=1))[2:]


def test_the_readme_shows_the_diff_between_the_seed_scripts():
    readme = (REPO / "README.md").read_text()
    shown = re.search(r"```diff\n(.*?)\n```", readme, re.S)
    assert shown is not None, "README: no diff block in 'Tune your own script'"
    assert shown.group(1).splitlines() == main_diff()


def test_the_runtime_adds_about_a_dozen_lines_to_the_seed_script():
    added = [x for x in main_diff() if x.startswith("+")]
    assert len(added) <= 12, added
