"""MkDocs hooks of the docs site (mkdocs.yml `hooks:`).

A page added at the top of docs/ (a feature's user page: docs/sweeps.md, docs/trl.md, ...) that the
nav does not list is added to the nav's "Guides" section, titled by its first `# ` heading, so a
feature's page is on the site without an edit of mkdocs.yml. A page in a section folder
(docs/tutorials/, ...) must be listed: mkdocs' `validation.omitted_files: warn` fails the strict build.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

GUIDES = "Guides"


def listed_pages(nav: Any) -> set[str]:
    """Every page path the nav names, at any depth."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(listed_pages(item) for item in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(listed_pages(value) for value in nav.values())) if nav else set()
    return set()


def page_title(path: Path) -> str:
    match = re.search(r"^# (.+?)\s*$", path.read_text(encoding="utf-8"), re.M)
    return match.group(1).replace("`", "") if match else path.stem.replace("-", " ").capitalize()


def unlisted_top_pages(docs_dir: Path, nav: list[Any]) -> list[str]:
    listed = listed_pages(nav)
    return sorted(p.name for p in docs_dir.glob("*.md") if p.name not in listed)


def on_config(config: Any) -> Any:
    nav = config["nav"]
    if not nav:
        return config
    docs_dir = Path(config["docs_dir"])
    extra = [{page_title(docs_dir / name): name} for name in unlisted_top_pages(docs_dir, nav)]
    if not extra:
        return config
    for item in nav:
        if isinstance(item, dict) and GUIDES in item:
            item[GUIDES] = [*item[GUIDES], *extra]
            break
    else:
        nav.append({GUIDES: extra})
    return config
