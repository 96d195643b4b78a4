"""Bad input is refused where it enters, naming the thing and the fix: names that become store paths
or MLflow names, keys given twice, unreadable sources, and media whose declared size or duration
would stall a decoder (a decompression bomb), at ingest, in rollout and in eval."""

from __future__ import annotations

import copy
import io
import struct
import subprocess
import sys
import wave
import zlib
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from omni_core.config import DatasetConfig, apply_overrides, read_yaml, validate_pipeline
from omni_core.data import ingest, write_fixture
from omni_core.data.media import image_problem, video_problem, wav_problem
from omni_core.errors import ConfigError, DataError, ModelError
from omni_core.media_limits import (
    MediaLimitError,
    MediaLimits,
    check_rows,
    image_size,
    video_seconds,
    wav_seconds,
)
from omni_core.storage import Store

ROOT = Path(__file__).resolve().parents[1]
EVAL_REGISTER = ROOT / "configs" / "eval_register.yaml"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose every chunk CRC is valid, whose IHDR declares width x height RGB pixels, and whose
    IDAT holds a few compressed bytes: ~100 bytes that decode to width * height * 3 bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b"")


BOMB = png_declaring(30_000, 30_000)  # 900 M pixels, 2.7 GB of RGB


def wav_declaring(seconds: int) -> bytes:
    """A valid WAV of `seconds` at 1 frame per second: a long declared duration in a few bytes."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(1)
        w.writeframes(b"\x80" * seconds)
    return out.getvalue()


def mp4_declaring(seconds: int, version: int = 0) -> bytes:
    def box(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I4s", 8 + len(body), kind) + body

    times = struct.pack(">QQIQ", 0, 0, 1000, seconds * 1000) if version else struct.pack(">IIII", 0, 0, 1000, seconds * 1000)
    mvhd = bytes([version, 0, 0, 0]) + times + bytes(80)
    return box(b"ftyp", b"isom\x00\x00\x02\x00isomiso2mp41") + box(b"moov", box(b"mvhd", mvhd)) + box(b"mdat", b"x")


def avi_declaring(seconds: int) -> bytes:
    avih = struct.pack("<IIIII", 1_000_000, 0, 0, 0, seconds) + bytes(36)  # 1 frame per second
    hdrl = b"hdrl" + b"avih" + struct.pack("<I", len(avih)) + avih
    body = b"AVI " + b"LIST" + struct.pack("<I", len(hdrl)) + hdrl
    return b"RIFF" + struct.pack("<I", len(body)) + body


# ---- names that become paths and MLflow names, refused by `omni validate` ------------------------


def validate_with(overrides: list[str]) -> None:
    validate_pipeline(apply_overrides(copy.deepcopy(read_yaml(EVAL_REGISTER)), overrides), "eval_register.yaml")


GOOD_DATASET = '{source: "fixtures://gsm8k?rows=8", converter: gsm8k}'


@pytest.mark.parametrize(("overrides", "message"), [
    ([f'datasets={{"../x": {GOOD_DATASET}, gsm8k: {GOOD_DATASET}}}'], "datasets: dataset key '../x' is not a name"),
    ([f'datasets={{"a/b": {GOOD_DATASET}, gsm8k: {GOOD_DATASET}}}'], "dataset key 'a/b' is not a name"),
    ([f'datasets={{".hidden": {GOOD_DATASET}, gsm8k: {GOOD_DATASET}}}'], "dataset key '.hidden' is not a name"),
    ([f'datasets={{"-rf": {GOOD_DATASET}, gsm8k: {GOOD_DATASET}}}'], "dataset key '-rf' is not a name"),
    ([f'datasets={{"x\'y": {GOOD_DATASET}, gsm8k: {GOOD_DATASET}}}'], "dataset key \"x'y\" is not a name"),
    ([f'datasets={{{"a" * 129}: {GOOD_DATASET}, gsm8k: {GOOD_DATASET}}}'], "is 129 characters long"),
    (["stages.rl.data=gsm8k:../train"], "stages.rl.data: split '../train' is not a name"),
    (["stages.eval.data=gsm8k:te/st"], "stages.eval.data: split 'te/st' is not a name"),
    (["stages.eval.data=../gsm8k:test"], "stages.eval.data: dataset key '../gsm8k' is not a name"),
    (["stages.register.model_name=../champion"], "stages.register.model_name: registered model name '../champion'"),
    (["stages.register.model_name=a' or name='b"], "registered model name \"a' or name='b\" is not a name"),
    (["name=../pipeline"], "name: String should match pattern"),
    (["stages.rl.name=../rl"], "String should match pattern"),
    ([f"name={'p' * 129}"], "name: String should have at most 128 characters"),
])
def test_names_that_become_paths_are_refused_at_validate_time(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_with(overrides)
    assert message in str(err.value)


@pytest.mark.parametrize(("source", "message"), [
    ("hf://../../etc", "hf:// takes a Hugging Face dataset id"),
    ("hf://org/name/../../x", "hf:// takes a Hugging Face dataset id"),
    ("hf://just-a-name", "hf:// takes a Hugging Face dataset id"),
    ("ftp://host/raw", "unknown scheme 'ftp'"),
    ("s3:///raw", "s3:// needs a bucket"),
    ("fixtures://gsm8k?rows=100000000", "a fixture has 1 to 1000000 rows"),
    ("fixtures://gsm8k?rows=0", "a fixture has 1 to 1000000 rows"),
    ("fixtures://gsm8k?rows=-5", "rows='-5' is not a non-negative integer"),
    ("fixtures://gsm8k?rows=8&rows=9", "rows is given 2 times"),
    ("fixtures://gsm8k?rows=8&bad_rows=9", "bad_rows=9 is more than rows=8"),
    ("fixtures://gsm8k?rows=8&evil=1", "unknown parameter(s) evil"),
    ("fixtures://..?rows=8", "fixture name '..' is not a name"),
    ("fixtures://../gsm8k?rows=8", "a fixture has no path"),
    ("fixtures://gsm8k/../../x?rows=8", "a fixture has no path"),
])
def test_unreadable_sources_are_refused_at_validate_time(source: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_with([f"datasets.gsm8k.source={source}"])
    assert "datasets.gsm8k.source: " in str(err.value) and message in str(err.value)


def test_usual_sources_and_names_still_validate() -> None:
    for source in ("fixtures://gsm8k?rows=64&seed=0&bad_rows=2", "hf://FanqingM/MMK12", "s3://omni/raw/gsm8k",
                   "/data/raw/gsm8k", "data/raw", "file:///data/raw"):
        validate_with([f"datasets.gsm8k.source={source}"])
    validate_with(["stages.register.model_name=gsm8k-grpo_v1.2", "stages.eval.data=gsm8k:test"])


def test_omni_validate_exits_non_zero_on_a_dataset_key_that_climbs_out(tmp_path: Path) -> None:
    """The issue's reproduction, through the CLI."""
    config = read_yaml(EVAL_REGISTER)
    config["datasets"]["../x"] = config["datasets"]["gsm8k"]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "flows.cli", "validate", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "datasets: dataset key '../x' is not a name" in result.stderr


# ---- keys given twice ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "key", "lines"), [
    ("name: p\nseed: 1\nseed: 2\nstages: []\n", "seed", (2, 3)),
    ("name: p\nstages:\n  - name: a\n    kind: ingest\n    datasets: [x]\n    name: b\n", "name", (3, 6)),
    ("name: p\ndatasets:\n  x: {source: a, converter: b, source: c}\nstages: []\n", "source", (3, 3)),
    ("name: p\ndatasets:\n  x: {source: a, converter: b}\n  x: {source: c, converter: b}\nstages: []\n", "x", (3, 4)),
])
def test_a_key_written_twice_is_refused_naming_it_and_its_lines(tmp_path: Path, text: str, key: str,
                                                                 lines: tuple[int, int]) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    assert f"key '{key}' appears twice in one mapping (line {lines[0]} and line {lines[1]})" in str(err.value)


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("base: &b {lr: 1, steps: 2}\nother:\n  <<: *b\n  lr: 3\n")
    assert read_yaml(path)["other"] == {"lr": 3, "steps": 2}


def test_an_override_given_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"override 'seed=2': seed is already set by 'seed=1'; give each key once"):
        apply_overrides({"seed": 0}, ["seed=1", "seed=2"])
    assert apply_overrides({"a": {}}, ["a.b=1", "a.c=2"]) == {"a": {"b": 1, "c": 2}}
    with pytest.raises(ConfigError, match=r"override 'a=\{b: 1, b: 2\}': key 'b' appears twice in one mapping; keep one"):
        apply_overrides({}, ["a={b: 1, b: 2}"])


# ---- media over the limits: declared sizes, read without decoding ----------------------------------


def test_declared_sizes_are_read_from_headers() -> None:
    assert image_size(BOMB) == (30_000, 30_000)
    assert wav_seconds(wav_declaring(700)) == 700
    assert video_seconds(mp4_declaring(900)) == 900 and video_seconds(mp4_declaring(900, version=1)) == 900
    assert video_seconds(avi_declaring(800)) == 800


@pytest.mark.parametrize(("check", "data", "reason"), [
    (image_problem, BOMB, "image too large: declares 30000x30000 = 900000000 pixels, over max_image_pixels=40000000"),
    (image_problem, png_declaring(7000, 7000), "image too large: declares 7000x7000"),
    (wav_problem, wav_declaring(601), "audio too long: declares 601.0 s, over max_audio_seconds=600"),
    (video_problem, mp4_declaring(601), "video too long: declares 601.0 s, over max_video_seconds=600"),
    (video_problem, avi_declaring(3600), "video too long: declares 3600.0 s"),
])
def test_media_over_a_limit_has_a_reason(check, data: bytes, reason: str) -> None:
    assert reason in check(data)


def test_a_jpeg_bomb_is_refused_by_its_header(tmp_path: Path) -> None:
    """Non-PNG images are read by PIL's lazy open; PIL's own DecompressionBombError is turned into a reason."""
    from PIL import Image

    small = io.BytesIO()
    Image.new("RGB", (16, 16)).save(small, format="JPEG")
    data = bytearray(small.getvalue())
    sof = data.index(b"\xff\xc0")  # baseline frame header: length(2) precision(1) height(2) width(2)
    data[sof + 5:sof + 9] = struct.pack(">HH", 60_000, 60_000)
    assert "image too large" in image_problem(bytes(data))
    data[sof + 5:sof + 9] = struct.pack(">HH", 8_000, 6_000)  # 48 M pixels: under PIL's limit, over ours
    assert "declares 6000x8000 = 48000000 pixels" in image_problem(bytes(data))


def test_limits_are_options_of_the_dataset() -> None:
    lenient = MediaLimits.of(DatasetConfig(source="x", converter="mmk12", max_image_pixels=100_000_000))
    assert lenient.image_problem(png_declaring(7000, 7000)) is None
    assert "over max_image_pixels=100000000" in lenient.image_problem(BOMB)
    strict = MediaLimits(max_audio_seconds=1.5)
    assert strict.audio_problem(wav_declaring(2)) and not strict.audio_problem(wav_declaring(1))
    with pytest.raises(ConfigError, match="max_image_pixels: Input should be less than or equal to 178956970"):
        validate_with(["datasets.gsm8k.max_image_pixels=1000000000"])


def mmk12_with(tmp_path: Path, images: dict[int, bytes]) -> Path:
    """The mmk12 fixture's raw shards with the train rows at `images`' indices given those images."""
    raw = tmp_path / "raw"
    files = write_fixture("mmk12", raw, rows=8, seed=0)
    table = pq.read_table(files[0])
    rows = table.to_pylist()
    for index, data in images.items():
        rows[index]["image"] = {"bytes": data, "path": f"{index}.png"}
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), files[0])
    return raw


@pytest.mark.parametrize("workers", [1, 2])
def test_mmk12_quarantines_a_decompression_bomb_with_its_reason(tmp_path: Path, workers: int) -> None:
    raw = mmk12_with(tmp_path, {3: BOMB})
    store = Store(str(tmp_path / "store"))
    config = DatasetConfig(source=str(raw), converter="mmk12", max_quarantine_fraction=0.5)
    dv = ingest(store, "mmk12", config, progress=lambda _: None, workers=workers)
    assert dv.manifest["counts"] == {"read": 10, "rows": 9, "quarantined": 1, "skipped": 0}
    with store.open_read(dv.manifest["quarantine"].split(str(tmp_path / "store") + "/")[-1]) as f:
        quarantined = pq.read_table(f).to_pylist()
    assert [(q["split"], q["row"]) for q in quarantined] == [("train", 3)]
    assert quarantined[0]["reason"].startswith("image too large: declares 30000x30000 = 900000000 pixels")
    assert "max_image_pixels" not in dv.manifest["options"]  # the default: ids of existing versions stay
    raised = ingest(store, "mmk12", config.model_copy(update={"max_image_pixels": 100_000_000}),
                    progress=lambda _: None)
    assert raised.version != dv.version and raised.manifest["options"]["max_image_pixels"] == 100_000_000
    assert raised.manifest["counts"]["quarantined"] == 1
    with pytest.raises(DataError, match="image too large: declares 128x128"):  # the fixture's images
        ingest(store, "mmk12", config.model_copy(update={"max_image_pixels": 1000}), progress=lambda _: None)


# ---- rollout and eval refuse rows over the limits --------------------------------------------------


def test_check_rows_names_the_row_and_the_fix() -> None:
    rows = [{"images": [{"bytes": png_declaring(8, 8)}]}, {"images": [{"bytes": BOMB}]}]
    with pytest.raises(MediaLimitError) as err:
        check_rows(rows, MediaLimits(), "stage rl: dataset split mmk12:train")
    message = str(err.value)
    assert message.startswith("stage rl: dataset split mmk12:train: row 1: image too large: declares 30000x30000")
    assert "datasets.NAME.max_image_pixels" in message and isinstance(err.value, DataError)
    check_rows([{"audios": [{"bytes": wav_declaring(2)}], "videos": None}], MediaLimits(), "x")


def test_rollout_decoding_refuses_a_bomb_with_a_model_error() -> None:
    from omni_core.models.multimodal_inputs import row_media

    with pytest.raises(ModelError, match="an image of the batch is too large to decode"):
        row_media([{"prompt": [], "images": [{"bytes": BOMB}]}])


@pytest.fixture
def oversized_version(tmp_path: Path) -> tuple[Store, SimpleNamespace]:
    """A committed mmk12 version holding a 7000x7000 image (ingested with a raised limit)."""
    store = Store(str(tmp_path / "store"))
    raw = mmk12_with(tmp_path, {0: png_declaring(7000, 7000)})
    config = DatasetConfig(source=str(raw), converter="mmk12", max_image_pixels=100_000_000)
    return store, ingest(store, "mmk12", config, progress=lambda _: None)


def test_rl_stage_refuses_rows_over_the_limits_before_any_actor_decodes_them(oversized_version) -> None:
    from omni_core.config import RayConfig
    from omni_core.config.models import RLStage
    from omni_core.training.ray_stage import run_rl_stage

    store, dv = oversized_version
    stage = RLStage(name="rl", data="mmk12:train", model="tiny://qwen3-omni")
    with pytest.raises(MediaLimitError, match=r"stage rl: dataset split mmk12:train: row 0: image too large: "
                                              r"declares 7000x7000 = 49000000 pixels, over max_image_pixels=40000000"):
        run_rl_stage(pipeline="p", stage=stage, seed=0, store=store, shard_keys=dv.shard_keys("train"),
                     dataset_version=dv.version, ray_config=RayConfig(), tracking_uri=None, mlflow_run_id=None,
                     progress=lambda _: None, media_limits=MediaLimits())


def test_eval_stage_refuses_rows_over_the_dataset_limits(oversized_version) -> None:
    from omni_core.config.models import PipelineConfig
    from omni_core.pipeline.stages.eval import run_eval

    store, dv = oversized_version
    config = PipelineConfig.model_validate({
        "name": "p", "datasets": {"mmk12": {"source": "fixtures://mmk12?rows=8", "converter": "mmk12"}},
        "stages": [{"name": "rl", "kind": "rl", "data": "mmk12:train", "model": "tiny://qwen3-omni",
                    "algorithm": {"name": "gspo"}, "reward": {"name": "mmk12"}},
                   {"name": "eval", "kind": "eval", "after": ["rl"], "data": "mmk12:train"}]})
    ctx = SimpleNamespace(config=config, stage=config.stage("eval"), store=store,
                          upstream={"rl": SimpleNamespace(name="rl", outputs={})},
                          inputs={"dataset": {"name": "mmk12", "version": dv.version, "split": "train"}})
    with pytest.raises(MediaLimitError, match=rf"stages.eval: mmk12@{dv.version}:train: row 0: image too large"):
        run_eval(ctx)


# ---- other user text that becomes a path, an environment or a shell argument ----------------------


@pytest.mark.parametrize(("overrides", "message"), [
    (["ray.env_vars=[HF_TOKEN, 'A=B']"], "ray.env_vars: 'A=B' is not an environment variable name"),
    (["ray.env_vars=['$(id)']"], "ray.env_vars: '$(id)' is not an environment variable name"),
    (["stages.rl.checkpoint.resume_mode=resume_path",
      "stages.rl.checkpoint.resume_from_path=runs/p/../../../etc/global_step_1"],
     "stages.rl.checkpoint.resume_from_path: resume_from_path 'runs/p/../../../etc/global_step_1' climbs out"),
    (["stages.rl.checkpoint.resume_mode=resume_path",
      "stages.rl.checkpoint.resume_from_path=s3://bucket/runs/../x"], "climbs out with '..'"),
])
def test_other_paths_and_environment_names_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_with(overrides)
    assert message in str(err.value)


def test_verl_overrides_reach_the_ray_job_as_single_shell_words(tmp_path: Path) -> None:
    """backend.overrides are appended verbatim; the Ray Job's entry point (a shell line) quotes each one,
    so `$(...)`, `;` and backticks stay text. Run here through bash with `echo` as the interpreter."""
    from omni_core.backends.verl.options import VerlBackend, VerlTraining
    from omni_core.backends.verl.render import render

    hostile = ["trainer.project_name=$(touch pwned1)", "trainer.experiment_name=x;touch pwned2",
               "+a.b=`touch pwned3`", "+c.d='quoted' && touch pwned4"]
    backend = VerlBackend(shared_dir=str(tmp_path / "shared"), python="/bin/echo", overrides=hostile)
    training = VerlTraining(task="grpo", model="/models/m", train_files=[str(tmp_path / "train.parquet")],
                            total_steps=1, batch_size=2, lr=1e-5)
    command = render(training, backend, backend.run_dir("p", "k", "rl"))
    result = subprocess.run(["bash", "-c", command.entrypoint], cwd=tmp_path, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob("pwned*"))
    printed = result.stdout.splitlines()[-1]
    assert all(item in printed for item in hostile)


@pytest.mark.parametrize(("name", "source", "message"), [
    ("../x", "fixtures://gsm8k?rows=8", "ingest ../x: dataset name '../x' is not a name"),
    ("a/b", "fixtures://gsm8k?rows=8", "dataset name 'a/b' is not a name"),
    ("gsm8k", "hf://../x", "ingest gsm8k: source: 'hf://../x': hf:// takes a Hugging Face dataset id"),
])
def test_omni_ingest_checks_its_name_and_source_as_a_pipeline_would(tmp_path: Path, name: str, source: str,
                                                                     message: str) -> None:
    """`omni ingest NAME --source URI` refuses before it starts Prefect or writes anything."""
    result = subprocess.run([sys.executable, "-m", "flows.cli", "ingest", name, "--source", source, "--converter",
                             "gsm8k", "--store", str(tmp_path / "store")], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*"))


@pytest.mark.parametrize("entry_point", ["verl_omni.main; touch pwned", "-c", "$(id)", "a..b", "../x"])
def test_a_verl_omni_entry_point_is_a_module_name(entry_point: str) -> None:
    from pydantic import ValidationError

    from omni_core.backends.verl_omni.options import VerlOmniBackend

    with pytest.raises(ValidationError, match="is not a Python module name"):
        VerlOmniBackend(entry_point=entry_point, shared_dir="/tmp/shared")
    assert VerlOmniBackend(entry_point="verl_omni.trainer.main_omni", shared_dir="/tmp/shared").entry_point


def test_an_image_spec_with_a_key_twice_is_refused(tmp_path: Path) -> None:
    from omni_core.images.errors import ImageBuildError
    from omni_core.images.spec import load_spec

    spec = tmp_path / "spec.yaml"
    spec.write_text("target: a\ndockerfile: Dockerfile\ncontext: .\ntarget: b\n")
    with pytest.raises(ImageBuildError, match=r"key 'target' appears twice in one mapping \(line 1 and line 4\)"):
        load_spec(spec)
