"""Prompt-list datasets (vid_prompt, hpsv3, pickscore_sfw): fixtures, converters (the rows VeRL-Omni's data
scripts write) and the quarantine of lines no script can take, ingested into a local store."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from omni_core.config import DatasetConfig
from omni_core.data import get_converter, ingest, resolve_source, write_fixture
from omni_core.errors import DataError
from omni_core.storage import Store

pytestmark = pytest.mark.usefixtures("omni_cache")
NAMES = ("vid_prompt", "hpsv3", "pickscore_sfw")


def expected_row(name: str, prompt: str, split: str, index: int) -> dict:
    """The row each script writes for `prompt` (VeRL-Omni a1139bafffb5b9711f0a6b6edff8ecaa60bfff30)."""
    if name == "vid_prompt":  # examples/flowgrpo_trainer/ltx2/prepare_data.py _convert_split
        return {"data_source": "ltx2_t2av", "prompt": [{"role": "user", "content": prompt}],
                "negative_prompt": [{"role": "user", "content": ""}], "ability": "text_to_audio_video",
                "reward_model": {"style": "rule", "ground_truth": prompt}, "extra_info": {"split": split, "index": index}}
    if name == "hpsv3":  # examples/dancegrpo_trainer/data_process/wan22_hpsv3.py make_record
        system = {"role": "system", "content": ""}
        return {"data_source": "dance_grpo/hpsv3", "prompt": [system, {"role": "user", "content": prompt}],
                "negative_prompt": [system, {"role": "user", "content": " "}], "ability": "t2v",
                "reward_model": {"style": "model", "ground_truth": prompt}, "extra_info": {"split": split, "index": index}}
    # examples/flowgrpo_trainer/data_process/sd3_pickscore_sfw.py build_split
    return {"data_source": "flow_grpo/pickscore_sfw", "prompt": [{"role": "user", "content": prompt}],
            "ability": "preference_alignment", "reward_model": {"style": "model", "ground_truth": prompt},
            "extra_info": {"split": split, "index": index, "raw_prompt": prompt}}


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_deterministic_and_ingests_to_the_scripts_rows(name, tmp_path) -> None:
    a = write_fixture(name, tmp_path / "a", rows=8, seed=3, bad_rows=3)
    b = write_fixture(name, tmp_path / "b", rows=8, seed=3, bad_rows=3)
    assert [p.name for p in a] == ["train.txt", "test.txt"]
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert a[0].read_bytes() != write_fixture(name, tmp_path / "c", rows=8, seed=4)[0].read_bytes()
    store = Store(str(tmp_path / "store"))
    source = f"fixtures://{name}?rows=8&seed=1"
    dv = ingest(store, name, DatasetConfig(source=source, converter=name), progress=lambda _: None)
    assert dv.manifest["counts"] == {"read": 10, "rows": 10, "quarantined": 0, "skipped": 0}
    raw = resolve_source(source)
    for split in ("train", "test"):
        with store.open_read(dv.shard_keys(split)[0]) as f:
            table = pq.read_table(f)
        assert table.schema.equals(get_converter(name).schema)
        prompts = [line.strip() for line in raw.path(f"{split}.txt").read_text().splitlines() if line.strip()]
        assert len(prompts) == (8 if split == "train" else 2)  # the blank line in each file is no prompt
        assert table.to_pylist() == [expected_row(name, p, split, i) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("name", NAMES)
def test_undecodable_and_control_character_lines_are_quarantined(name, tmp_path) -> None:
    store = Store(str(tmp_path / "store"))
    config = DatasetConfig(source=f"fixtures://{name}?rows=8&seed=0&bad_rows=3", converter=name,
                           max_quarantine_fraction=0.5)
    dv = ingest(store, name, config, progress=lambda _: None)
    counts, train = dv.manifest["counts"], dv.manifest["splits"]["train"]
    assert counts["read"] == counts["rows"] + counts["quarantined"] + counts["skipped"] == 13
    with store.open_read(dv.manifest["quarantine"]) as f:
        quarantine = pq.read_table(f).to_pylist()
    assert all(q["split"] == "train" and q["source_file"] == "train.txt" for q in quarantine)
    reasons = sorted(q["reason"] for q in quarantine)
    if name == "hpsv3":  # the third bad line is Chinese: wan22_hpsv3.py leaves it out (skipped, not quarantined)
        assert reasons == ["line is not UTF-8 text", "prompt holds control characters"]
        assert (train["rows"], train["quarantined"], train["skipped"]) == (8, 2, 1)
    else:
        assert reasons == ["line is not UTF-8 text", "line is not UTF-8 text", "prompt holds control characters"]
        assert (train["rows"], train["quarantined"], train["skipped"]) == (8, 3, 0)


def test_a_source_without_the_prompt_files_is_refused(tmp_path) -> None:
    (tmp_path / "train.txt").write_text("a red fox in the snow\n")
    raw = resolve_source(str(tmp_path))
    converter = get_converter("vid_prompt")
    assert converter.splits(raw) == ["train"]
    with pytest.raises(DataError, match="test.txt is missing"):
        list(converter.records(raw, "test"))
