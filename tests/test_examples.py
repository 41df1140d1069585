"""The examples and what the README says of them: the diffs it shows are the diffs between each tuned script and its
plain form (the seed scripts', about a dozen lines; a Lightning or Accelerate script's, a few)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main_diff(plain: str = "seed_ddp_plain.py", tuned: str = "seed_ddp.py") -> list[str]:
    plain = (REPO / "examples" / plain).read_text().splitlines()
    tuned = (REPO / "examples" / tuned).read_text().splitlines()
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


FRAMEWORK_EXAMPLES = (("lightning_ddp_plain.py", "lightning_ddp.py"), ("accelerate_lm_plain.py", "accelerate_lm.py"),
                      ("hf_trainer_lm_plain.py", "hf_trainer_lm.py"))
IN_THE_README = FRAMEWORK_EXAMPLES[:2]
"""The framework examples whose diff the README shows too (docs/frameworks.md shows every one)."""


def shown(page: Path) -> list[list[str]]:
    return [b.splitlines() for b in re.findall(r"```diff\n(.*?)\n```", page.read_text(), re.S)]


def test_the_docs_show_each_framework_example_against_its_plain_form_in_a_few_lines():
    for plain, tuned in FRAMEWORK_EXAMPLES:
        diff = main_diff(plain, tuned)
        pages = [REPO / "docs" / "frameworks.md", *([REPO / "README.md"] if (plain, tuned) in IN_THE_README else [])]
        for page in pages:
            assert diff in shown(page), f"{page.name}: no diff block of {tuned} against {plain}"
        assert len([x for x in diff if x.startswith("+")]) <= 6, diff
