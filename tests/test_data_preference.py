"""Omni-Preference: JSONL-per-modality fixture, converter, split rule, and ingestion to local and S3."""

from __future__ import annotations

import io
import json
import wave
from pathlib import PurePosixPath

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from omni_core.config import DatasetConfig
from omni_core.data import (
    holds_preference_pairs,
    ingest,
    preference_converters,
    resolve_source,
    write_fixture,
)
from omni_core.data.converter import RowSkipped
from omni_core.data.omni_preference import SCHEMA, OmniPreferenceConverter, media_rel, split_of
from omni_core.storage import Store

pytestmark = pytest.mark.usefixtures("omni_cache")
COLUMNS = {"image": "images", "video": "videos", "audio": "audios"}


def _read(store: Store, keys: list[str]) -> pa.Table:
    tables = []
    for key in keys:
        with store.open_read(key) as f:
            tables.append(pq.read_table(f))
    return pa.concat_tables(tables)


def _raw_lines(source: str) -> dict[tuple[str, int], dict]:
    raw = resolve_source(source)
    out = {}
    for modality in COLUMNS:
        lines = raw.path(f"dataset_jsonl/{modality}/final_rl_data.jsonl").read_text().splitlines()
        out.update({(modality, n): json.loads(line) for n, line in enumerate(lines)})
    return out


def test_fixture_writes_the_dataset_layout_deterministically(tmp_path) -> None:
    a = write_fixture("omni_preference", tmp_path / "a", rows=4, seed=3, bad_rows=5)
    b = write_fixture("omni_preference", tmp_path / "b", rows=4, seed=3, bad_rows=5)
    rel = [p.relative_to(tmp_path / "a").as_posix() for p in a]
    assert rel == [p.relative_to(tmp_path / "b").as_posix() for p in b]
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert {f"dataset_jsonl/{m}/final_rl_data.jsonl" for m in COLUMNS} <= set(rel)
    assert {r.split("/")[0] for r in rel} == {"dataset_jsonl", "rlaif-v-dataset", "video-dataset", "audio_files"}
    line = json.loads((tmp_path / "a/dataset_jsonl/video/final_rl_data.jsonl").read_text().splitlines()[0])
    assert set(line) == {"videos", "messages", "solution"} and line["videos"][0].startswith("/data/academic_source/")
    assert "### Context\nVideo file: " in line["messages"][0]["content"]
    other = write_fixture("omni_preference", tmp_path / "c", rows=4, seed=4)
    assert other[-1].read_bytes() != a[-1].read_bytes()


def test_the_converter_says_it_holds_preference_pairs() -> None:
    assert OmniPreferenceConverter.preference_pairs and preference_converters() == ["omni_preference"]
    assert holds_preference_pairs("omni_preference") and not holds_preference_pairs("gsm8k")
    assert not holds_preference_pairs("no_such_converter")


def test_split_rule_is_by_media_name_about_ten_percent() -> None:
    names = [f"{n:09d}.jpg" for n in range(4000)]
    share = sum(split_of(n) == "test" for n in names) / len(names)
    assert 0.08 < share < 0.12
    assert [split_of(n) for n in names[:50]] == [split_of(n) for n in names[:50]]
    assert media_rel("/data/rlaif-v-dataset/x/1.jpg_") == "rlaif-v-dataset/x/1.jpg"


def test_ingest_produces_preference_rows_with_media_embedded(store: Store) -> None:
    source = "fixtures://omni_preference?rows=6&seed=1"
    dv = ingest(store, "pref", DatasetConfig(source=source, converter="omni_preference"), progress=lambda _: None)
    assert dv.manifest["counts"] == {"read": 18, "rows": 18, "quarantined": 0, "skipped": 0}
    raw_lines = _raw_lines(source)
    seen = set()
    for split in ("train", "test"):
        table = _read(store, dv.shard_keys(split))
        assert table.schema.equals(SCHEMA) and table.num_rows > 0
        for index, row in enumerate(table.to_pylist()):
            info = row["extra_info"]
            modality, line_no = info["modality"], int(info["sample_id"].rsplit("_", 1)[1])
            seen.add((modality, line_no))
            src = raw_lines[(modality, line_no)]
            solution = json.loads(src["solution"])
            context = src["messages"][0]["content"].split("### Context\n", 1)[1]
            fields = dict(item.split(": ", 1) for item in context.split("\n"))
            better, loser = solution["better"], "AB".replace(solution["better"], "")
            assert row["data_source"] == f"omni_preference/{modality}" and row["ability"] == f"{modality}_qa"
            assert row["prompt"] == [{"role": "user", "content": f"<{modality}>{fields['Question']}"}]
            assert row["chosen"] == {"role": "assistant", "content": fields[f"Candidate {better}"]}
            assert row["rejected"] == {"role": "assistant", "content": fields[f"Candidate {loser}"]}
            assert (row["win_score"], row["lose_score"]) == (solution[f"score_{better}"], solution[f"score_{loser}"])
            assert row["win_score"] > row["lose_score"] and row["reward_model"] == {"style": "preference"}
            source_media = media_rel(src[COLUMNS[modality]][0])
            assert info == {"split": split, "index": index, "sample_id": f"omni_pref_{modality}_{line_no}",
                            "question": fields["Question"], "modality": modality, "source_media": source_media,
                            "source_media_name": PurePosixPath(source_media).name, "better": better}
            assert split_of(info["source_media_name"]) == split
            assert {c: row[c] is None for c in COLUMNS.values()} == {c: m != modality for m, c in COLUMNS.items()}
            data = row[COLUMNS[modality]][0]["bytes"]
            if modality == "image":
                Image.open(io.BytesIO(data)).load()
            elif modality == "audio":
                with wave.open(io.BytesIO(data)) as wav:
                    assert wav.getnframes() > 0
            else:
                assert data[4:8] == b"ftyp"
    assert seen == set(raw_lines)


def test_bad_lines_are_quarantined_and_equal_verdicts_skipped(store: Store) -> None:
    config = DatasetConfig(source="fixtures://omni_preference?rows=6&seed=0&bad_rows=5", converter="omni_preference",
                           max_quarantine_fraction=0.5)
    dv = ingest(store, "pref", config, progress=lambda _: None)
    assert dv.manifest["counts"] == {"read": 23, "rows": 18, "quarantined": 4, "skipped": 1}
    with store.open_read(dv.manifest["quarantine"]) as f:
        quarantine = pq.read_table(f).to_pylist()
    assert sorted(r["reason"].split(":")[0] for r in quarantine) == [
        "malformed preference JSON", "missing video file", "no ### Context block (media file, Question, "
        "Candidate A, Candidate B) in the messages", "undecodable image"]
    assert all(r["source_file"].startswith("dataset_jsonl/") and json.loads(r["raw"])["line"] == r["row"]
               for r in quarantine)


def test_an_equal_verdict_is_skipped_not_rejected(tmp_path) -> None:
    write_fixture("omni_preference", tmp_path, rows=2, seed=0, bad_rows=5)
    raw = resolve_source(str(tmp_path))
    converter = OmniPreferenceConverter()
    records = [r for s in converter.splits(raw) for _, _, r in converter.records(raw, s)]
    equal = [r for r in records if '"better": "equal"' in str(r["row"].get("solution"))]
    assert len(equal) == 1
    with pytest.raises(RowSkipped, match="equal"):
        converter.convert(equal[0], "train", 0, raw)
