"""The repository stands on its own: its citations point into docs/, and its links resolve.

- no file cites the team's brief outside the repository (`../shared`, a bare `REFERENCE.md` /
  `DESIGN.md`): cite a page of docs/reference/, docs/design/ or docs/concepts/ (`docs/reference/formulas.md#flowgrpo`);
- every such citation (`docs/{reference,design,concepts}/PAGE.md`, with or without `#anchor`) names a page
  that exists and a heading it has, and nothing cites the retired single pages (`docs/reference.md`,
  `docs/design.md`, split into those folders);
- every relative link in README.md and docs/**/*.md points at a file that exists (and, into a
  markdown file, at a heading it has).

Fast: reads files, starts nothing. Each test lists every offender, not only the first.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", ".omni", "__pycache__", ".ruff_cache", ".pytest_cache", "node_modules"}
SKIP_FILES = {"tests/test_docs.py"}  # this file spells out the patterns it looks for

# The brief lives outside the repository: `../shared/...`, or the uppercase file names (also
# without `.md`, as in "per REFERENCE."). POLICY_REFERENCE or PREFERENCE do not match (\b).
OUTSIDE = re.compile(r"\.\./shared\b|/work/shared\b|\b(?:REFERENCE|DESIGN)\b")
DOC_CITE = re.compile(r"\bdocs/((?:reference|design|concepts)/[\w.-]+\.md)(?:#([\w-]+))?")
RETIRED = re.compile(r"\bdocs/(?:reference|design)\.md\b")
MD_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def repo_files() -> list[str]:
    """Tracked and untracked-but-not-ignored files (git), else every file outside SKIP_DIRS."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        files = [f for f in out.splitlines() if (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                 if p.is_file() and not SKIP_DIRS & set(p.relative_to(ROOT).parts)]
    return sorted(f for f in files if not SKIP_DIRS & set(Path(f).parts))


def text_of(rel: str) -> str | None:
    try:
        return (ROOT / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # binary (images, parquet): no citations in it


def matching_lines(pattern: re.Pattern[str], files: list[str]) -> list[tuple[str, int, str, re.Match[str]]]:
    found = []
    for rel in files:
        text = text_of(rel)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            found += [(rel, number, line.strip(), m) for m in pattern.finditer(line)]
    return found


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)  # not in code blocks
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}


def test_nothing_cites_the_brief_outside_the_repository():
    files = [f for f in repo_files() if f not in SKIP_FILES]
    hits = matching_lines(OUTSIDE, files)
    offenders = [f"{rel}:{n}: {line}" for rel, n, line, _ in hits]
    assert not offenders, ("cite a page of docs/reference/ or docs/design/ instead of the brief outside "
                           "the repository:\n  " + "\n  ".join(offenders))


def test_every_cited_docs_page_and_heading_exists():
    files = [f for f in repo_files() if f not in SKIP_FILES]
    cites = matching_lines(DOC_CITE, files)
    assert len(cites) > 20, "few `docs/reference/PAGE.md#anchor` citations found: the pattern or the files changed"
    missing = []
    for rel, n, line, match in cites:
        page, anchor = ROOT / "docs" / match.group(1), match.group(2)
        if not page.is_file():
            missing.append(f"{rel}:{n}: no page docs/{match.group(1)}: {line}")
        elif anchor and anchor not in anchors(page):
            missing.append(f"{rel}:{n}: no heading #{anchor} in docs/{match.group(1)}: {line}")
    missing += [f"{rel}:{n}: cites a retired page (now docs/reference/ and docs/design/): {line}"
                for rel, n, line, _ in matching_lines(RETIRED, files)]
    assert not missing, "\n  ".join(["citations of missing pages or headings:", *missing])


def test_relative_links_in_readme_and_docs_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
        for target in MD_LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            where = page if not path_part else (page.parent / path_part).resolve()
            label = f"{page.relative_to(ROOT)}: ({target})"
            if not where.exists():
                broken.append(f"{label}: no such file")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append(f"{label}: no heading #{anchor} in {where.relative_to(ROOT)}")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The patterns themselves: each flags what it must and passes what it must not."""
    assert OUTSIDE.search("see " + "../shared" + "/x.md") and OUTSIDE.search("per " + "REFER" + "ENCE.")
    assert OUTSIDE.search("(" + "DESI" + "GN.md)") and OUTSIDE.search("(" + "REFER" + "ENCE.md 4)")
    assert not OUTSIDE.search("POLICY_" + "REFER" + "ENCE = 1; PREFERENCE_ALGORITHMS; docs/reference.md")
    assert not OUTSIDE.search("shared memory; the shared cache; shared/ folders of a checkout")
    found = DOC_CITE.search("(docs/reference/formulas.md#clipped-policy-losses).")
    assert found and found.groups() == ("reference/formulas.md", "clipped-policy-losses")
    assert DOC_CITE.search("Layout (docs/design/architecture.md):").groups() == ("design/architecture.md", None)
    assert not DOC_CITE.search("docs/reference/{config,cli,metrics}.md; docs/sweeps.md")
    assert RETIRED.search("(docs/reference.md section 3)") and RETIRED.search("docs/design.md, Backends")
    assert not RETIRED.search("docs/reference/rollout.md; docs/design/conventions.md")
    assert github_anchor("## 6. Metric names".lstrip("# ")) == "6-metric-names"
    assert github_anchor("LTX-2.3 video prompts") == "ltx-23-video-prompts"
    assert github_anchor("The `pipeline` flow, end to end") == "the-pipeline-flow-end-to-end"
    assert MD_LINK.findall("[a](docs/x.md#y) ![img](p.png) [b](https://e.org)") == ["docs/x.md#y", "https://e.org"]
