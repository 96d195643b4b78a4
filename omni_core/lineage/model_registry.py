"""The MLflow model registry written safely by several runs at once.

MLflow's registry has no compare-and-set: creating a registered model that another run created a
moment before fails, two runs registering the same checkpoint get two versions, and an alias is
whatever the last `set_registered_model_alias` wrote. So every write here is followed by a read that
settles the outcome by a rule every racer computes alike, with the embedded sqlite registry and with
a tracking server (Postgres) that several machines write to:

- a registered model: created, or taken as it is when the creation fails because it exists;
- a version: one per registration key (the register stage's cache key, tag `omni.register_key`):
  of the versions with the same key, the lowest number is kept and a racer that created another
  deletes its own and uses that one (MLflow numbers versions in commit order, so the lower one is
  always visible to the racer that created the higher); the version's tags, which two identical runs
  may write at once, are set again when a racer inserted the same tag first;
- an alias: moved to what the rule names, then read again with the rule re-evaluated, until a read
  after the last move agrees (a move that fails because a racer moved or created the alias meanwhile
  is one more round). Whoever writes last re-checks after writing, so the alias ends where the
  rule over everything committed points, whatever the interleaving;
- `candidate`: the newest version;
- `champion`: the best-scoring of the current champion and the versions that passed their promotion
  gate (tag `omni.promotion` = promoted) against it or against the champion it was compared with
  itself (tag `omni.champion_version`); ties: the lower version. One at a time this is the gate's own
  outcome (a version that passed beats the champion it was compared with); register stages that
  passed against the same champion at once end with the best of them, never a later one over a
  better one. A version that passed but lost such a race is tagged `kept`. (A version withdrawn by
  hand: move `champion` and set its `omni.promotion` to anything but `promoted`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlflow.exceptions import MlflowException

from omni_core.lineage.redact import redact_mapping, redact_text

CANDIDATE, CHAMPION = "candidate", "champion"
PROMOTED, KEPT = "promoted", "kept"
REGISTER_KEY = "omni.register_key"
SETTLE_ROUNDS = 20  # each round is a read after a racer's write; two racers settle in two or three


def ensure_registered_model(client: Any, name: str, pipeline: str) -> None:
    """The registered model `name`, created if missing; a concurrent creator's is taken as it is."""
    try:
        client.get_registered_model(name)
        return
    except MlflowException:
        pass
    try:
        client.create_registered_model(name, tags=redact_mapping({"omni.pipeline": pipeline}),
                                       description=redact_text(f"Checkpoints registered by pipeline {pipeline}"))
    except MlflowException:
        client.get_registered_model(name)  # created by another run since the lookup; else its error stands


def _versions(client: Any, name: str, extra: str = "") -> list[Any]:
    query = f"name='{name}'" + (f" and {extra}" if extra else "")
    return list(client.search_model_versions(query, order_by=["version_number DESC"]))


def keep_first_of_key(client: Any, name: str, version: Any, key: str) -> tuple[Any, bool]:
    """(the version to use, whether it is `version`): of the versions of `name` registered under `key`,
    the lowest; `version`, created by this run, is deleted when another one is lower."""
    same = _versions(client, name, f"tags.`{REGISTER_KEY}` = '{key}'")
    first = min(same, key=lambda v: int(v.version), default=version)
    if int(first.version) >= int(version.version):
        return version, True
    client.delete_model_version(name, version.version)
    return client.get_model_version(name, first.version), False


def set_version_tags(client: Any, name: str, version: str, tags: dict[str, str]) -> None:
    """Tags on a model version that a racer may be tagging too (two identical runs share one version,
    keep_first_of_key): MLflow's set reads the tag then inserts it, so the slower insert of a new tag
    fails on the unique key; the tag then exists and a second set updates it (the last write stands)."""
    for key, value in tags.items():
        try:
            client.set_model_version_tag(name, version, key, value)
        except MlflowException:
            if not _has_tag(client, name, version, key):
                raise  # not a racer's insert: the error stands
            client.set_model_version_tag(name, version, key, value)


def _has_tag(client: Any, name: str, version: str, key: str) -> bool:
    try:
        return key in (client.get_model_version(name, version).tags or {})
    except MlflowException:
        return False


def alias_version(client: Any, name: str, alias: str) -> Any | None:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def settle_alias(client: Any, name: str, alias: str, rule: Callable[[Any | None], str | None]) -> str | None:
    """Moves `alias` to `rule(current holder)` until a round with no move in between agrees: the holder
    read, the rule evaluated (its own reads after that), the holder read again and unchanged. Returns
    the version it ends on (None: the rule names none and the alias is unset)."""
    held: str | None = None
    for _ in range(SETTLE_ROUNDS):
        current = alias_version(client, name, alias)
        held = None if current is None else str(current.version)
        wanted = rule(current)
        again = alias_version(client, name, alias)
        if held != (None if again is None else str(again.version)):
            continue  # moved by another run meanwhile: evaluate again
        if wanted is None or held == wanted:
            return held
        try:
            client.set_registered_model_alias(name, alias, wanted)
        except MlflowException:
            after = alias_version(client, name, alias)
            if _exists(client, name, wanted) and held == (None if after is None else str(after.version)):
                raise
            # a racer's write: the version the rule named was deleted since it was read (a racer that
            # registered the same key dropped its own, keep_first_of_key), or the alias was written at
            # once by another run (MLflow's set reads then inserts: the slower insert of a new alias fails
            # on the unique key): evaluate again
    return held


def _exists(client: Any, name: str, version: str) -> bool:
    try:
        client.get_model_version(name, version)
        return True
    except MlflowException:
        return False


def settle_candidate(client: Any, name: str) -> str | None:
    """`candidate` on the newest version of `name`."""
    def newest(_: Any) -> str | None:
        found = _versions(client, name)
        return str(found[0].version) if found else None

    return settle_alias(client, name, CANDIDATE, newest)


def settle_champion(client: Any, name: str, metric: str, greater_is_better: bool,
                    score_of: Callable[[Any], float | None]) -> str | None:
    """`champion` on the best of the current champion and the versions that passed their gate against
    it or against the champion it was compared with itself (`omni.champion_version`): those that
    raced it. `score_of(version)`: the current champion's score."""
    def best(current: Any | None) -> str | None:
        entries: list[tuple[float | None, int]] = []
        if current is None:
            rivals = {""}
        else:
            entries.append((score_of(current), int(current.version)))
            rivals = {str(current.version), (current.tags or {}).get("omni.champion_version", "")}
        for v in _versions(client, name, f"tags.`omni.promotion` = '{PROMOTED}'"):
            tags = v.tags or {}
            if (tags.get("omni.champion_version", "") in rivals and tags.get("omni.metric") == metric
                    and tags.get("omni.score") and (current is None or str(v.version) != str(current.version))):
                entries.append((float(tags["omni.score"]), int(v.version)))
        scored = [e for e in entries if e[0] is not None]
        if not scored:  # nothing to compare: a champion stays
            return str(entries[0][1]) if entries else None
        sign = 1.0 if greater_is_better else -1.0
        return str(min(scored, key=lambda e: (-sign * e[0], e[1]))[1])

    return settle_alias(client, name, CHAMPION, best)
