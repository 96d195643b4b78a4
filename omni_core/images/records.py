"""Build records: `images/{target}/{tag}.json` in the store, one per content-addressed tag.

A record is how an image's digest reaches later stages: a training stage reads the record of the tag
it needs and runs `record.pinned_ref` (registry/repository@sha256:...), and `image_tags(record)`
puts the same facts on its MLflow run.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from omni_core.storage import Store


class BuildRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    target: str
    tag: str
    content_digest: str  # sha256 of the inputs (see omni_core.images.tag); the tag is its prefix
    repository: str
    registry: str | None
    ref: str  # [registry/]repository:tag
    digest: str | None  # manifest digest in the registry (None: built locally, not pushed)
    image_id: str | None
    pushed: bool
    platforms: list[str]
    build_args: dict[str, str]
    stage: str | None
    dockerfile: str
    base_image: str  # the FROM of the built stage, ARGs resolved
    base_digest: str | None
    builder: str | None  # None: found in the registry, not built by this store's user
    log_uri: str | None
    built_at: str  # ISO 8601, UTC
    seconds: float

    @property
    def pinned_ref(self) -> str:
        """`registry/repository@sha256:...` once pushed (immutable), else the tag reference."""
        if self.digest and self.registry:
            return f"{self.registry}/{self.repository}@{self.digest}"
        return self.ref


def record_key(target: str, tag: str) -> str:
    return f"images/{target}/{tag}.json"


def log_key(target: str, tag: str) -> str:
    return f"images/{target}/{tag}.log"


def save_record(store: Store, record: BuildRecord) -> None:
    store.write_json(record_key(record.target, record.tag), record.model_dump(mode="json"))


def load_record(store: Store, target: str, tag: str) -> BuildRecord | None:
    key = record_key(target, tag)
    return BuildRecord.model_validate(store.read_json(key)) if store.exists(key) else None


def list_records(store: Store, target: str | None = None) -> list[BuildRecord]:
    """Every build record (of one target, or all), oldest first."""
    keys = [k for k in store.list(f"images/{target}" if target else "images") if k.endswith(".json")]
    return sorted((BuildRecord.model_validate(store.read_json(k)) for k in keys), key=lambda r: r.built_at)


def image_tags(record: BuildRecord, prefix: str = "omni.image") -> dict[str, str]:
    """MLflow tags naming the image a stage ran in (no credentials: references and digests only)."""
    tags = {f"{prefix}.target": record.target, f"{prefix}.tag": record.tag, f"{prefix}.ref": record.pinned_ref}
    if record.digest:
        tags[f"{prefix}.digest"] = record.digest
    return tags
