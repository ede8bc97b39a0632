"""packing encode: a LeRobot video dataset, written by lerobot's own writer, becomes a latent
dataset whose latents are the VAE applied to lerobot's own decoded frames, that lerobot and
LeRobotEpisodes read and `packing verify` passes on; resumable; every bad input named."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packing._latent import latent_count, latent_rows, latent_spans
from packing.datasets import LeRobotEpisodes

try:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
except ImportError:
    LeRobotDataset = None

# Writing video datasets and decoding them is lerobot's (its extra pins torch < 2.12): CI's
# newest-torch run has no lerobot, and these tests skip there, saying why.
needs_lerobot = pytest.mark.skipif(
    LeRobotDataset is None,
    reason="lerobot is not installed (pip install -e '.[encode]' -c constraints.txt; it needs torch < 2.12): "
    "CI's torch 2.11 run has it",
)
pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (9, 13, 7, 17, 5)  # 7 is not 1 + 4k: encoded with pad_frames=True, refused without
FRONT, WRIST = "observation.images.front", "observation.images.wrist"
KEY = f"{FRONT}.latent"
HW = (32, 48)


def test_latent_alignment_rule():
    """Latent j covers frames 4j-3..4j and sits on the row of the last; padding is explicit."""
    assert latent_count(9, 4, pad=False) == 3
    assert latent_rows(9, 4, pad=False).tolist() == [0, 4, 8]
    assert latent_spans(9, 4, pad=False).tolist() == [[0, 0], [1, 4], [5, 8]]
    assert latent_rows(10, 4, pad=True).tolist() == [0, 4, 8, 9]
    assert latent_spans(10, 4, pad=True).tolist()[-1] == [9, 9]
    assert latent_count(1, 4, pad=False) == 1
    with pytest.raises(ValueError, match=r"10 frames is not 1 \+ 4k .* 9 or 13 would be"):
        latent_count(10, 4, pad=False)


@given(frames=st.integers(1, 400), tc=st.integers(1, 8))
def test_latent_spans_partition_the_frames(frames, tc):
    """Padded, every frame is covered once, in order: frame 0 alone, then <= tc frames a latent,
    each stored on its last frame; unpadded, only F = 1 + tc*k is accepted."""
    spans = latent_spans(frames, tc, pad=True)
    assert spans[0].tolist() == [0, 0] and spans[-1, 1] == frames - 1
    assert (spans[1:, 0] == spans[:-1, 1] + 1).all()
    assert ((spans[:, 1] - spans[:, 0]) < tc).all()
    assert (latent_rows(frames, tc, pad=True) == spans[:, 1]).all()
    if (frames - 1) % tc:
        with pytest.raises(ValueError, match="would be dropped"):
            latent_count(frames, tc, pad=False)
    else:
        assert latent_count(frames, tc, pad=False) == len(spans) == 1 + (frames - 1) // tc


def _write_video_dataset(root: Path) -> Path:
    """Two cameras of seeded frames (a moving gradient plus noise: something to encode),
    state and action, two tasks; lerobot's writer encodes the videos (SVT-AV1, offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    features = {
        FRONT: {"dtype": "video", "shape": (*HW, 3), "names": ["height", "width", "channels"]},
        WRIST: {"dtype": "video", "shape": (32, 32, 3), "names": ["height", "width", "channels"]},
        "observation.state": {"dtype": "float32", "shape": (6,), "names": None},
        "action": {"dtype": "float32", "shape": (6,), "names": None},
    }
    ds = LeRobotDataset.create(repo_id="local/video", fps=10, features=features, root=root)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0 : HW[0], 0 : HW[1]]
    for e, n in enumerate(LENGTHS):
        for f in range(n):
            base = (yy * 4 + xx * 3 + 20 * f + 50 * e) % 256
            img = np.stack([base, 255 - base, (base * 2) % 256], -1) + rng.integers(0, 20, (*HW, 3))
            ds.add_frame(
                {
                    FRONT: np.clip(img, 0, 255).astype(np.uint8),
                    WRIST: rng.integers(0, 255, (32, 32, 3)).astype(np.uint8),
                    "observation.state": rng.standard_normal(6).astype(np.float32),
                    "action": (100 * e + f + np.arange(6)).astype(np.float32),
                    "task": ("pick", "place")[e % 2],
                }
            )
        ds.save_episode(parallel_encoding=False)  # no process pool inside pytest
    ds.finalize()
    return root


def _config(src: Path, dst: Path, **kw):
    from packing.encode import EncodeConfig

    base = dict(cameras=(FRONT,), pad_frames=True, store_dtype="float32", chunk_latents=1,
                batch_size=2, num_workers=1)  # fmt: skip
    return EncodeConfig(src, dst, **{**base, **kw})


@pytest.fixture(scope="module")
def video_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if LeRobotDataset is None:
        pytest.skip("needs lerobot")
    return _write_video_dataset(tmp_path_factory.mktemp("enc") / "video")


@pytest.fixture(scope="module")
def latent_root(video_root: Path) -> Path:
    from packing.encode import encode_dataset

    dst = video_root.parent / "latent"
    lines: list[str] = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests that compare with it run: the same rounding
    try:
        report = encode_dataset(_config(video_root, dst), progress=lines.append)
    finally:
        torch.set_num_threads(before)
    assert report.episodes == len(LENGTHS) and report.resumed == 0
    assert report.dropped_videos == (WRIST,)  # not asked for: said so, not silently
    assert "episodes/s" in lines[-1] and "ETA" in lines[-1]
    return dst


def _lerobot_frames(root: Path, episode: int) -> torch.Tensor:
    """``(1, 3, F, H, W)`` in [-1, 1]: lerobot's own reader decoding the episode's video."""
    ds = LeRobotDataset("local/video", root=root, episodes=[episode], video_backend="pyav")
    frames = torch.stack([ds[i][FRONT] for i in range(len(ds))])  # (F, 3, H, W) in [0, 1]
    return (frames * 2 - 1).permute(1, 0, 2, 3)[None]


@needs_lerobot
def test_latents_equal_the_tiny_vae_on_lerobots_own_decoded_frames(video_root, latent_root):
    from packing.encode import tiny_vae

    vae = tiny_vae()
    eps = LeRobotEpisodes(latent_root, keys=[KEY, "action"])
    seen = []
    for e, n in enumerate(LENGTHS):
        x = _lerobot_frames(video_root, e)
        pad = (-(n - 1)) % 4  # pad_frames: the last frame repeated up to 1 + 4k
        x = torch.cat([x, x[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
        with torch.no_grad():
            want = vae.encode(x).latent_dist.mode()[0].permute(1, 0, 2, 3)
        got = eps[e][KEY]
        assert got.shape == (latent_count(n, 4, pad=True), 8, 2, 3) == want.shape
        assert (got - want).abs().max().item() <= 1e-5, e
        seen.append(got)
    # Not vacuous: the latents are not constant, and episodes differ from each other.
    assert seen[0].std() > 0.01 and (seen[0][:2] - seen[4][:2]).abs().max() > 0.01


@pytest.mark.skipif(
    importlib.util.find_spec("diffusers") is None, reason="needs diffusers (packing[encode])"
)
def test_chunked_and_batched_encodes_equal_the_whole_clip():
    from packing.encode import tiny_vae
    from packing.encode._vae import CausalEncoder

    vae = tiny_vae()
    g = torch.Generator().manual_seed(1)
    clips = torch.rand(2, 3, 17, 32, 48, generator=g) * 2 - 1
    with torch.no_grad():
        whole = [vae.encode(clips[i : i + 1]).latent_dist.mode() for i in range(2)]
    enc = CausalEncoder(vae)
    for cuts in ([0, 17], [0, 1, 5, 13, 17], [0, 9, 17], [0, 5, 9, 13, 17]):
        enc.reset()
        parts = [enc.push(clips[:1, :, a:b]) for a, b in itertools.pairwise(cuts)]
        got = torch.cat(parts, 2)
        # The same encoder calls on the same cache; only the final 1x1x1 conv sees fewer
        # frames at a time, which may round the last bit differently (measured: 6e-8).
        assert (got - whole[0]).abs().max() <= 1e-6, cuts
        if len(cuts) == 2:
            assert torch.equal(got, whole[0])
    # Control: without the cache carried across chunks (a fresh clip per chunk) it differs.
    enc.reset()
    assert (enc.push(clips[:1, :, 8:17])[:, :, 1:] - whole[0][:, :, 3:]).abs().max() > 1e-2
    # Two clips in one batch, the second cut short at 9 frames and padded with its last frame:
    # causal, so its first 3 latents are its own.
    short = torch.cat([clips[1:, :, :9], clips[1:, :, 8:9].expand(-1, -1, 8, -1, -1)], 2)
    enc.reset()
    both = enc.push(torch.cat([clips[:1], short]))
    with torch.no_grad():
        alone = vae.encode(clips[1:, :, :9]).latent_dist.mode()
    assert (both[:1] - whole[0]).abs().max() <= 1e-5
    assert (both[1:, :, :3] - alone).abs().max() <= 1e-5
    with pytest.raises(ValueError, match=r"first chunk of a clip holds 1 \+ 4m"):
        enc.reset()
        enc.push(clips[:1, :, :4])


@needs_lerobot
def test_the_latent_dataset_reads_with_lerobot_and_packing(video_root, latent_root):
    eps = LeRobotEpisodes(latent_root, keys=[KEY, "action", "observation.state"])
    src = LeRobotEpisodes(video_root, keys=["action", "observation.state"])
    assert eps.lengths.tolist() == list(LENGTHS)  # one row per video frame, as recorded
    assert eps.tasks == src.tasks
    for e in range(len(LENGTHS)):
        for k in ("action", "observation.state"):  # carried over unchanged
            assert torch.equal(eps[e][k], src[e][k])
        assert eps[e]["task"] == src[e]["task"]
    # Tokens count the latent frames the items hold (2x3 grid, 1x1 patches).
    want = [latent_count(n, 4, pad=True) * 6 for n in LENGTHS]
    assert eps.token_lengths(latent_key=KEY, patch=(1, 1, 1)).tolist() == want
    with pytest.raises(ValueError, match="already holds latent frames"):
        eps.token_lengths(latent_key=KEY, patch=(1, 1, 1), temporal_compression=4)
    info = json.loads((latent_root / "meta" / "info.json").read_text())
    spec = info["features"][KEY]["latent"]
    assert spec["temporal_compression"] == 4 and spec["source_feature"] == FRONT
    assert FRONT not in info["features"] and WRIST not in info["features"]
    # lerobot's own reader: frame by frame, latent 1 of episode 0 is on row 4 (its last frame).
    ds = LeRobotDataset("local/latent", root=latent_root)
    assert len(ds) == sum(LENGTHS)
    assert torch.equal(ds[4][KEY], eps[0][KEY][1])
    assert torch.equal(ds[1][KEY], torch.zeros_like(ds[1][KEY]))
    assert ds.meta.stats[KEY]["mean"].shape == (8, 1, 1)


@needs_lerobot
def test_resume_after_a_crash_mid_episode_gives_the_same_dataset(video_root, latent_root,
                                                                 monkeypatch, tmp_path):  # fmt: skip
    from packing.encode import EncodeError, _write, encode_dataset

    dst = tmp_path / "resumed"
    real = os.replace
    commits = []

    def crash_on_third(a, b):  # the third episode's file is half written, never renamed
        if str(b).endswith(".parquet") and "data" in Path(b).parts:
            if len(commits) == 2:
                raise KeyboardInterrupt("killed")
            commits.append(b)
        real(a, b)

    monkeypatch.setattr(_write.os, "replace", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        encode_dataset(_config(video_root, dst))
    monkeypatch.setattr(_write.os, "replace", real)
    assert len(list(dst.glob("data/*/.*.tmp"))) == 1  # the half episode, not a .parquet
    with pytest.raises(FileNotFoundError, match="unfinished packing encode"):
        LeRobotEpisodes(dst, keys=[KEY])  # a partial dataset never looks complete
    with pytest.raises(
        EncodeError, match=r"unfinished packing encode of another job .*store_dtype"
    ):
        encode_dataset(_config(video_root, dst, store_dtype="float16"))
    report = encode_dataset(_config(video_root, dst))
    assert (report.resumed, report.episodes) == (2, len(LENGTHS) - 2)
    assert not (dst / ".packing-encode").exists() and not list(dst.glob("data/*/.*.tmp"))
    import pyarrow.parquet as pq

    files = sorted(p.relative_to(latent_root) for p in latent_root.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(dst) for p in dst.rglob("*") if p.is_file())
    for f in files:
        if f.suffix == ".parquet":
            assert pq.read_table(dst / f).equals(pq.read_table(latent_root / f)), f
        else:
            assert (dst / f).read_bytes() == (latent_root / f).read_bytes(), f


@needs_lerobot
def test_bad_inputs_are_named_before_anything_is_written(video_root, latent_root, tmp_path):
    from packing.encode import EncodeError, encode_dataset

    dst = tmp_path / "out"
    cases = [
        (dict(cameras=("action",)), r"feature 'action' is float32, not a video"),
        (dict(cameras=("nope",)), r"has no feature 'nope'"),
        (dict(size=(30, 48)), r"30x48 .* multiples of 16 .* --size 16x48"),
        (dict(pad_frames=False), r"episode 2 of .*: 7 frames is not 1 \+ 4k.*--pad-frames"),
        (dict(vae=str(tmp_path / "no_vae")), r"no diffusers VAE folder"),
    ]
    for kw, match in cases:
        with pytest.raises(EncodeError if "vae" not in kw else FileNotFoundError, match=match):
            encode_dataset(_config(video_root, dst, **kw))
        assert not dst.exists(), kw
    if not torch.cuda.is_available():
        with pytest.raises(EncodeError, match="no CUDA GPU is visible"):
            encode_dataset(_config(video_root, dst, device="cuda"))
        assert not dst.exists()
    with pytest.raises(EncodeError, match="already holds a dataset"):
        encode_dataset(_config(video_root, latent_root))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    with pytest.raises(EncodeError, match="exists and is not empty"):
        encode_dataset(_config(video_root, tmp_path / "full"))


@needs_lerobot
def test_broken_videos_are_named_by_episode_and_file(video_root, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packing.encode import EncodeError, encode_dataset

    mp4 = Path(FRONT) / "chunk-000" / "file-000.mp4"
    missing = shutil.copytree(video_root, tmp_path / "missing")
    (missing / "videos" / mp4).unlink()
    with pytest.raises(
        EncodeError, match=rf"episode 0: camera '{FRONT}': its video .*{mp4}.* missing"
    ):
        encode_dataset(_config(missing, tmp_path / "o1"))

    corrupt = shutil.copytree(video_root, tmp_path / "corrupt")
    data = (corrupt / "videos" / mp4).read_bytes()
    (corrupt / "videos" / mp4).write_bytes(data[:200] + bytes(len(data) - 200))
    with pytest.raises(
        EncodeError, match=rf"episode \d+: camera .*decoding frames .*{mp4}.*corrupt"
    ):
        encode_dataset(_config(corrupt, tmp_path / "o2"))
    assert not (tmp_path / "o2" / "meta" / "info.json").exists()

    short = shutil.copytree(video_root, tmp_path / "short")
    path = next((short / "meta" / "episodes").glob("*/*.parquet"))
    table = pq.read_table(path)
    col = f"videos/{FRONT}/to_timestamp"
    to = table.column(col).to_numpy().copy()
    to[1] -= 0.2  # episode 1's span two frames shorter than its 13 rows
    table = table.set_column(table.column_names.index(col), col, pa.array(to))
    pq.write_table(table, path)
    with pytest.raises(EncodeError, match=r"episode 1: .* 11 video frames .* but 13 rows"):
        encode_dataset(_config(short, tmp_path / "o3"))


@needs_lerobot
def test_the_readmes_two_commands_and_their_errors(video_root, tmp_path, capsys):
    from packing.cli import main

    dst = tmp_path / "cli"
    args = ["encode", str(video_root), str(dst), "--vae", "tiny", "--cameras", FRONT]
    assert main([*args, "--size", "30x48", "--pad-frames"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--size" in err[0] and "multiples of 16" in err[0]
    assert main([*args, "--size", "big"]) == 2
    assert "expected HxW" in capsys.readouterr().err
    assert main(args) == 2  # episode 2 has 7 frames: refused without --pad-frames
    assert "--pad-frames" in capsys.readouterr().err
    assert main([*args, "--pad-frames", "--size", "64x96"]) == 0
    assert "5 episodes encoded" in capsys.readouterr().out
    eps = LeRobotEpisodes(dst, keys=[KEY])
    assert eps[0][KEY].shape == (3, 8, 4, 6) and eps[0][KEY].dtype == torch.float16
    # The README's second command: packing verify reads the latent dataset as it is.
    assert main(["verify", "--dataset", str(dst)]) == 0
    assert "PASS" in capsys.readouterr().out


def test_errors_of_a_video_dataset_point_to_packing_encode(tmp_path):
    with pytest.raises(FileNotFoundError, match="packing encode"):
        LeRobotEpisodes(tmp_path / "nowhere", keys=["latents"])


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (dict(cameras="front"), TypeError, "cameras='front' is a string"),
        (dict(cameras=()), ValueError, "each camera once, at least one"),
        (dict(size=(64,)), ValueError, "size"),
        (dict(size=(64.0, 96)), TypeError, "must be an int"),
        (dict(chunk_latents=0), ValueError, "chunk_latents"),
        (dict(batch_size=1.5), TypeError, "batch_size=1.5 must be an int"),
        (dict(num_workers=-1), ValueError, "num_workers"),
        (dict(pad_frames="yes"), TypeError, "pad_frames='yes' must be True or False"),
        (dict(device="tpu"), ValueError, "device='tpu'"),
        (dict(dtype="float16"), ValueError, "dtype"),
        (dict(store_dtype="int8"), ValueError, "store_dtype"),
        (dict(vae=""), TypeError, "vae=''"),
    ],
)
def test_config_refuses_bad_values_naming_them(kw, error, match):
    from packing.encode import EncodeConfig

    with pytest.raises(error, match=match):
        EncodeConfig("src", "dst", **kw)


@needs_lerobot
@pytest.mark.parametrize("episodes", [3, 4])
def test_verify_passes_on_a_small_encoded_dataset_with_every_default(
    latent_root, episodes, tmp_path, capsys
):
    """README's "Your own data" on 3 or 4 episodes: the default budget put each episode in a
    pack of its own, and verify FAILed ("leak check impossible"). It holds two now."""
    from packing.cli import main

    out = tmp_path / "r.json"
    argv = ["verify", "--dataset", str(latent_root), "--episodes", str(episodes)]
    assert main([*argv, "--steps", "1", "--json", str(out)]) == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["leak"]["ok"] is True and report["leak"]["num_docs"] >= 2
    assert max(report["pack_sizes"]) >= 2


@needs_lerobot
def test_encode_never_writes_inside_its_source(video_root, tmp_path):
    from packing.encode import EncodeError, encode_dataset

    before = sorted(p for p in video_root.rglob("*"))
    for dst, match in ((video_root, "is SRC itself"), (video_root / "latents", "inside SRC"),
                       (video_root.parent, "SRC .* is inside DST")):  # fmt: skip
        with pytest.raises(EncodeError, match=match):
            encode_dataset(_config(video_root, dst))
    assert sorted(p for p in video_root.rglob("*")) == before  # nothing written into SRC


def _saved_tiny_vae(folder: Path, **config) -> Path:
    from packing.encode import tiny_vae

    tiny_vae().save_pretrained(folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


@needs_lerobot
@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            {"scale_factor_temporal": 2},
            r"config says 2x time, 16x space .* 5 frames of 32x32 "
            r"pixels should give 3 latent frames of 2x2, but it fails on them",
        ),
        (
            {"scale_factor_spatial": 8},
            r"config says 4x time, 8x space .* of 16x16 pixels .* "
            r"3 latent frames of 1x1 .*16x space",
        ),
        ({"_class_name": "UNet2DConditionModel"}, r"describes a UNet2DConditionModel, not a VAE"),
    ],
)
def test_a_vae_that_is_not_what_its_config_says_is_refused_before_dst_exists(
    video_root, tmp_path, config, match
):
    """A config misstating the VAE's compression wrote (exit 0) a dataset nobody could read;
    a UNet folder as --vae crashed (exit 3) and left a half-started destination."""
    from packing.encode import EncodeError, encode_dataset

    vae = _saved_tiny_vae(tmp_path / "vae", **config)
    dst = tmp_path / "out"
    with pytest.raises(EncodeError, match=match):
        encode_dataset(_config(video_root, dst, vae=str(vae)))
    assert not dst.exists()


@needs_lerobot
def test_a_saved_vae_with_its_own_config_encodes(video_root, tmp_path):
    """The negative control of the probe: the same folder, config untouched, is accepted."""
    from packing.encode import encode_dataset

    vae = _saved_tiny_vae(tmp_path / "vae")
    report = encode_dataset(_config(video_root, tmp_path / "out", vae=str(vae)))
    assert report.episodes == len(LENGTHS)


@needs_lerobot
def test_a_device_this_machine_lacks_is_a_usage_error(video_root, tmp_path, capsys):
    from packing.cli import main
    from packing.encode import EncodeConfig, EncodeError, encode_dataset

    dst = tmp_path / "out"
    for device in ("cuda:x", "bogus", "cuda:-1"):
        with pytest.raises(EncodeError, match=rf"device='{device}': use 'cpu', 'cuda' or 'cuda:N'"):
            EncodeConfig(video_root, dst, device=device)
        assert main(["encode", str(video_root), str(dst), "--vae", "tiny", "--device", device]) == 2
        assert "is not a torch device" in capsys.readouterr().err
    count = torch.cuda.device_count()
    with pytest.raises(EncodeError, match=r"device='cuda:99' but .*(no CUDA GPU|pick one)"):
        encode_dataset(_config(video_root, dst, device="cuda:99"))
    assert not dst.exists() and count < 99


@needs_lerobot
def test_ctrl_c_during_encode_says_what_is_kept_and_a_rerun_resumes(
    video_root, tmp_path, monkeypatch, capsys
):
    from packing.cli import main
    from packing.encode import _write

    real = _write.LatentWriter.write
    calls = []

    def interrupted_on_third(self, *args, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return real(self, *args, **kw)

    monkeypatch.setattr(_write.LatentWriter, "write", interrupted_on_third)
    dst = tmp_path / "out"
    argv = ["encode", str(video_root), str(dst), "--vae", "tiny", "--cameras", FRONT,
            "--pad-frames", "--batch-size", "1"]  # fmt: skip
    assert main(argv) == 130
    err = [x for x in capsys.readouterr().err.splitlines() if not x.startswith("  ..")]
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith("packing encode: interrupted; 2/5 episodes written by this run")
    assert f"in {dst} are kept" in err[0] and "run the same command again to resume" in err[0]
    monkeypatch.setattr(_write.LatentWriter, "write", real)
    assert main(argv) == 0
    assert "3 episodes encoded, 2 found done" in capsys.readouterr().out


@needs_lerobot
@pytest.mark.parametrize("tc", [2, 8])
def test_a_temporal_compression_the_latents_do_not_have_is_refused_when_read(
    latent_root, tmp_path, tc
):
    """info.json saying 2 (or 8) for latents written at 4 served zero rows as latent frames."""
    root = shutil.copytree(latent_root, tmp_path / "lying")
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"][KEY]["latent"]["temporal_compression"] = tc
    (root / "meta" / "info.json").write_text(json.dumps(info))
    eps = LeRobotEpisodes(root, keys=[KEY])
    with pytest.raises(ValueError, match=rf"episode 0 of .*: latent feature '{KEY}': meta/info"
                       rf".json's temporal_compression {tc} puts .* the rows holding latents "
                       r"are \[0, 4, 8\]"):  # fmt: skip
        eps[0]
    assert LeRobotEpisodes(latent_root, keys=[KEY])[0][KEY].shape[0] == 3  # the control


@needs_lerobot
def test_a_destination_that_is_a_file_is_named(video_root, tmp_path):
    from packing.encode import EncodeError, encode_dataset

    (tmp_path / "dst").write_text("mine")
    with pytest.raises(EncodeError, match=r"destination .*dst is a file; pass a folder path"):
        encode_dataset(_config(video_root, tmp_path / "dst"))
    assert (tmp_path / "dst").read_text() == "mine"
