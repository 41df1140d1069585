"""The documentation holds: the generated references are up to date and name every flag and setting; every link and
every repository path that README.md and docs/*.md write exists; the diffs they show are the examples' own. Cheap:
nothing runs but argparse and the Markdown."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import glob
import importlib.util
import re
from pathlib import Path

import pytest

from tests.test_examples import FRAMEWORK_EXAMPLES, main_diff

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 200

WRITTEN_BY_THE_TOOL = ("studies/autotune.db", "studies/*/")
"""Paths the pages name that the tool writes when it runs (every study, a study's trial logs): not the
repository's."""


def generate():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel(page: Path) -> str:
    return str(page.relative_to(REPO))


# ---- the generated references ----------------------------------------------------------------------------------


@pytest.mark.parametrize("page", ["config.md", "cli.md"])
def test_the_generated_references_are_up_to_date(page):
    gen = generate()
    render = {gen.CONFIG_MD.name: gen.render_config, gen.CLI_MD.name: gen.render_cli}[page]
    assert (DOCS / page).read_text() == render(), f"docs/{page} is stale: run `python docs/generate.py`"


def dotted_fields(cls, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        inner = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(inner):
            out += dotted_fields(inner, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def test_the_config_reference_names_every_setting_of_the_job_and_the_spec():
    from autotune.spec import StudySpec
    from trainer.config import TrainConfig

    text = (DOCS / "config.md").read_text()
    job, spec = text.split("\n## Study spec\n", 1)
    for where, cls, part in (("TrainConfig", TrainConfig, job), ("StudySpec", StudySpec, spec)):
        missing = [path for path in dotted_fields(cls) if f"**`{path}`**" not in part]
        assert not missing, f"docs/config.md: no entry for {where} field(s) {', '.join(missing)}"


def test_the_cli_reference_names_every_flag_of_every_command():
    from autotune.cli import build_parser

    parser = build_parser()
    text = (DOCS / "cli.md").read_text()
    sections = dict(re.findall(r"^## autotune (\S+)\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = [f"autotune {name}" for name in commands if name not in sections]
    for name, sub in commands.items():
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help") and f"`{flag}`" not in sections.get(name, ""):
                    missing.append(f"autotune {name} {flag}")
    assert not missing, f"docs/cli.md does not name: {', '.join(missing)}"


# ---- links and paths -------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, no punctuation, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors a link may name in ``page``: its headings' (GitHub numbers repeats) and its ``<a id>``s."""
    found, seen = set(), {}
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        s = slug(heading)
        found.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    found.update(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    return found


def prose(page: Path) -> str:
    """The page without its code blocks (commands and diffs name paths on the user's machine)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def links(page: Path) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", prose(page)) if not re.match(r"[a-z]+:", t)]


def test_every_relative_link_and_its_anchor_exists():
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{rel(page)}: ({target}): no file {path}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{rel(page)}: ({target}): no anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".") or p.name == ".ci"}


def expand(path: str) -> list[str]:
    """``a{1,2}b`` as ``a1b``, ``a2b``."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in expand(path[:m.start()] + alt + path[m.end():])]


def repo_paths(page: Path) -> list[str]:
    """The repository paths a page writes in backticks: a word with a slash whose first part is a top-level entry
    of the repository (``examples/folder_ddp.py``, ``examples/seed_ddp.py:main``, ``bench/results/x-*``)."""
    out = []
    for token in re.findall(r"`([^`\s]+)`", prose(page)):
        token = re.sub(r":\w+$", "", token)  # a function of a script: examples/seed_ddp.py:main
        if "/" in token and token.split("/", 1)[0] in TOP and re.fullmatch(r"[\w.\-/*{},]+", token):
            out.append(token)
    return out


def test_every_repository_path_the_pages_name_exists():
    missing = []
    for page in PAGES:
        for path in repo_paths(page):
            if any(fnmatch.fnmatch(path, pattern) for pattern in WRITTEN_BY_THE_TOOL):
                continue
            for one in expand(path):
                if not glob.glob(str(REPO / one)):
                    missing.append(f"{rel(page)}: `{path}`" + (f" ({one})" if one != path else ""))
    assert not missing, "no such file in the repository:\n" + "\n".join(missing)


# ---- what the pages say ----------------------------------------------------------------------------------------


def test_the_readme_is_short_and_no_page_speaks_of_how_it_was_made():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    for page in [*PAGES, REPO / "bench" / "RESULTS.md"]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            assert not re.search(r"\bsessions?\b", line, re.I), f"{rel(page)}:{n}: {line.strip()}"


def diffs(page: Path) -> list[list[str]]:
    return [b.splitlines() for b in re.findall(r"```diff\n(.*?)\n```", page.read_text(), re.S)]


def test_every_diff_a_page_shows_is_an_examples_own():
    known = [main_diff(), *(main_diff(plain, tuned) for plain, tuned in FRAMEWORK_EXAMPLES)]
    for page in PAGES:
        for n, diff in enumerate(diffs(page), 1):
            assert diff in known, f"{rel(page)}: diff block {n} is no example's diff against its plain form"
