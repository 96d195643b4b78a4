"""Rules for the user text that becomes a store path, a file name or an MLflow name, checked when a
pipeline file is validated (so `omni validate` refuses it, before anything runs).

A name is one path segment: letters, digits, `_`, `.` and `-`, not starting with `.` or `-`, at
most 128 characters. So it cannot climb out of its folder (`..`, `/`), hide (`.x`), read as a
command-line option (`-x`), or break an MLflow search filter (quotes, backticks).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlparse

NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
MAX_NAME_LENGTH = 128
_NAME = re.compile(NAME_PATTERN)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Hugging Face repo ids (huggingface_hub's validate_repo_id): ORG/NAME, no `..` or `--`, at most 96 chars.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
FIXTURE_PARAMS = ("rows", "seed", "bad_rows")
MAX_FIXTURE_ROWS = 1_000_000
SOURCE_SCHEMES = ("fixtures", "s3", "hf", "file", "")


def name_problem(value: object, what: str) -> str | None:
    """Why `value` cannot be used as `what` (a dataset key, a registered model name, ...), or None."""
    if not isinstance(value, str):
        return f"{what} must be a string, got {type(value).__name__}"
    if len(value) > MAX_NAME_LENGTH:
        return f"{what} {value[:40]!r}... is {len(value)} characters long; use at most {MAX_NAME_LENGTH}"
    if not _NAME.match(value):
        return (f"{what} {value!r} is not a name: use letters, digits, '_', '.' and '-', starting with a letter, "
                "digit or '_' (it becomes a store path and an MLflow name)")
    return None


def check_name(value: str, what: str) -> str:
    """`value` if it is a usable name, else ValueError (pydantic reports it under the key)."""
    if problem := name_problem(value, what):
        raise ValueError(problem)
    return value


def check_env_name(value: str, what: str) -> str:
    """`value` if it is an environment variable name (POSIX: letters, digits, '_', not starting with a
    digit), else ValueError."""
    if not _ENV_NAME.match(value):
        raise ValueError(f"{what} {value!r} is not an environment variable name: use letters, digits and '_', "
                         "not starting with a digit")
    return value


def check_relative_store_path(value: str, what: str) -> str:
    """`value` (a store key or a URI) if no part of its path is `..`, else ValueError."""
    path = urlparse(value).path if "://" in value else value
    if ".." in path.replace("\\", "/").split("/"):
        raise ValueError(f"{what} {value!r} climbs out with '..'; give the folder's own key or URI")
    return value


def source_problem(uri: str) -> str | None:
    """Why a dataset `source:` cannot be read, as far as can be told without reading it, or None."""
    parsed = urlparse(uri)
    if parsed.scheme not in SOURCE_SCHEMES:
        return f"unknown scheme '{parsed.scheme}' in {uri!r}; use fixtures://NAME?rows=N, a path, s3://BUCKET/... or hf://ORG/NAME"
    if parsed.scheme == "fixtures":
        return _fixture_problem(uri, parsed.netloc, parsed.path, parsed.query)
    if parsed.scheme == "hf":
        repo = parsed.netloc + parsed.path
        if not _HUB_ID.match(repo) or ".." in repo or "--" in repo or len(repo) > 96:
            return f"{uri!r}: hf:// takes a Hugging Face dataset id, hf://ORG/NAME (letters, digits, '_', '.', '-')"
        return None
    if parsed.scheme == "s3" and not parsed.netloc:
        return f"{uri!r}: s3:// needs a bucket, s3://BUCKET/PREFIX"
    return None


def _fixture_problem(uri: str, name: str, path: str, query: str) -> str | None:
    usage = "fixtures://NAME?rows=N&seed=S&bad_rows=K"
    if path not in ("", "/") or (problem := name_problem(name, "fixture name")):
        return f"{uri!r}: {problem if path in ('', '/') else 'a fixture has no path'}; use {usage}"
    params = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - set(FIXTURE_PARAMS))
    if unknown:
        return f"{uri!r}: unknown parameter(s) {', '.join(unknown)}; use {usage}"
    values: dict[str, int] = {}
    for key, given in params.items():
        if len(given) > 1:
            return f"{uri!r}: {key} is given {len(given)} times; give it once"
        if not re.fullmatch(r"\d+", given[0]):
            return f"{uri!r}: {key}={given[0]!r} is not a non-negative integer"
        values[key] = int(given[0])
    rows = values.get("rows", 64)
    if not 1 <= rows <= MAX_FIXTURE_ROWS:
        return f"{uri!r}: rows={rows}; a fixture has 1 to {MAX_FIXTURE_ROWS} rows"
    if values.get("bad_rows", 0) > rows:
        return f"{uri!r}: bad_rows={values['bad_rows']} is more than rows={rows}"
    return None
