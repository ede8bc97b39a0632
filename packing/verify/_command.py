"""`packing verify` as a command: its options, the model factory, the dataset, the run.

``packing.cli`` parses the flags into a `VerifyConfig`; `run_verify` (`packing.verify._run`)
turns it into a call of `packing.verify._harness.compare_packed_unpacked`::

    VerifyConfig  --build_model-->       model (the --model factory, or the reference DiT sized
                                         from the dataset's features by reference_streams)
                  --load_episodes-->     the first --episodes episodes via LeRobotEpisodes
                  --default_token_budget, plan_packs-->  packs
                  --compare_packed_unpacked-->           VerifyReport

Every input error is raised here, before the comparison starts, and names the flag and the
fix (exit status 2 in ``packing.cli``). The distributed run (`packing.verify._distributed`) reuses
the same steps up to the packs.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from packing._validate import (
    check_bool,
    check_choice,
    check_finite,
    check_int,
    check_optional_int,
    check_real,
)
from packing.verify._harness import RunOptions

__all__ = [
    "DEFAULT_MODEL",
    "ModelFactoryError",
    "Setup",
    "VerifyConfig",
    "build_model",
    "build_reference",
    "check_device",
    "check_finite_episodes",
    "dataset_features",
    "default_token_budget",
    "load_episodes",
    "load_factory",
    "model_and_episodes",
    "prepare",
    "reference_streams",
    "token_budget",
]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


DEFAULT_MODEL = "packing.model:tiny_reference_model"
_NORMALISERS = ("global", "per-micro-step", "per-rank")
# A verify run is a proof on a small dataset: a pack of 2**22 tokens is far above any real
# step (about 0.5 GB of latents per pack), and 64 processes above any single host's GPUs.
_MAX_BUDGET = 2**22
_MAX_NPROC = 64


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """The options of ``packing verify`` (``packing verify --help`` says the same)."""

    device: str = "cpu"
    dtype: str = "float32"
    compile: bool = False
    steps: int = 3
    episodes: int | None = None  # None: every episode of the dataset
    token_budget: int | None = None  # None: about a third of the step's tokens, >= the longest
    mask: str = "document"
    document_mask: bool = True
    reduction: str = "episode"
    dataset: str | None = None  # None: the embedded default dataset
    model: str | None = None  # "module:factory"; None: the tiny reference model
    reference: str | None = None  # "module:factory(model)"; None: model.reference() or a copy
    seed: int = 0
    lr: float = 1e-4
    adam_eps: float = 1e-6
    leak_check: bool = True
    loss_normaliser: str = "global"
    # {model stream: dataset feature}, e.g. {"latents": "observation.latent"}; streams not
    # listed read the feature of their own name (the reference model also looks by shape).
    features: Mapping[str, str] = field(default_factory=dict)
    # distributed (packing.verify._distributed): W ranks, FSDP2, the distributed sampler
    nproc: int = 1
    checkpointing: str = "full"
    blocks: str = "blocks"
    noise_key: str = "episode"
    fsdp_autocast: bool = False  # bf16: fp32 sharded parameters + autocast, not bf16 params
    threads: int | None = None  # CPU threads for torch in every process (None: 1)
    check_finite: bool = True  # a NaN/inf in the data is named before the run, not DIVERGED

    def __post_init__(self) -> None:
        for name in ("device", "blocks"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a string")
        check_device(self.device)
        check_choice("dtype", self.dtype, sorted(_DTYPES))
        check_choice("mask", self.mask, ("document", "frame-causal"))
        check_choice("reduction", self.reduction, ("token", "frame", "episode"))
        check_choice("loss_normaliser", self.loss_normaliser, _NORMALISERS)
        check_choice("checkpointing", self.checkpointing, ("full", "ops", "attention", "none"))
        check_choice("noise_key", self.noise_key, ("episode", "rank"))
        for flag in ("compile", "document_mask", "leak_check", "fsdp_autocast", "check_finite"):
            check_bool(flag, getattr(self, flag))
        # Bounded resources: refused here, before a process, thread or buffer is made.
        cores = _cores()
        check_int("nproc", self.nproc, min=1, max=_MAX_NPROC, hint="processes")
        check_optional_int(
            "threads", self.threads, min=1, max=cores, hint=f"this machine has {cores} cores"
        )
        check_int("steps", self.steps, min=1, max=10_000, hint="AdamW steps")
        check_optional_int(
            "episodes", self.episodes, min=2, hint="packing needs at least 2 episodes"
        )
        check_optional_int(
            "token_budget", self.token_budget, min=1, max=_MAX_BUDGET, hint="tokens per pack"
        )
        check_int("seed", self.seed, min=0, max=2**63 - 1)
        # The same bounds as packing verify's flags: a learning rate above 10 or an eps above 1
        # diverges in a step or two, and the report would blame the model.
        for name, value, top in (("lr", self.lr, 10.0), ("adam_eps", self.adam_eps, 1.0)):
            if check_real(name, value, min=0.0, hint=f"at most {top:g}") > top:
                raise ValueError(f"{name}={value!r} must be <= {top:g}")
        check_real("lr", self.lr, above=0.0)
        for flag in ("dataset", "model", "reference"):
            if getattr(self, flag) is not None and not isinstance(getattr(self, flag), str):
                raise TypeError(f"{flag}={getattr(self, flag)!r} must be a string or None")
        if not isinstance(self.features, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.features.items()
        ):
            raise TypeError(f"features={self.features!r} must map stream names to feature names")
        self._check_mode()
        for flag, spec in (("model", self.model), ("reference", self.reference)):
            if spec is not None and spec.count(":") != 1:
                raise ValueError(
                    f"{flag}={spec!r}: expected 'module:factory', e.g. 'my_models:build' for a "
                    "function build() in my_models.py on the Python path"
                )

    def _check_mode(self) -> None:
        """Refuse flags of the other mode: a flag that would be ignored is an error."""
        if self.nproc == 1:
            ignored = [
                flag
                for flag, on in (
                    (f"--checkpointing {self.checkpointing}", self.checkpointing != "full"),
                    (f"--blocks {self.blocks}", self.blocks != "blocks"),
                    ("--fsdp-autocast", self.fsdp_autocast),
                    ("--noise-key rank", self.noise_key == "rank"),
                    ("--loss-normaliser per-rank", self.loss_normaliser == "per-rank"),
                )
                if on
            ]
            if ignored:
                raise ValueError(
                    f"{', '.join(ignored)} apply to the distributed run only; add --nproc 2 "
                    "(or launch with torchrun), or drop them"
                )
            return
        if self.reference is not None:
            raise ValueError(
                f"--reference {self.reference} is single-process: the distributed run's "
                "unpacked side is a plain copy of the model on rank 0 (its leak check runs the "
                "packed model's weights in that copy); drop --nproc, or drop --reference"
            )
        if self.loss_normaliser == "per-micro-step":
            raise ValueError(
                "--loss-normaliser per-micro-step is the single-process ablation; across "
                "processes the planted mistake is --loss-normaliser per-rank"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def run_options(self) -> RunOptions:
        """How both sides train, as the harness takes it."""
        return RunOptions(
            steps=self.steps,
            reduction=self.reduction,
            seed=self.seed,
            lr=self.lr,
            adam_eps=self.adam_eps,
            device=torch.device(self.device),
            dtype=self.torch_dtype,
            compile=self.compile,
            leak_check=self.leak_check,
            normalise=self.loss_normaliser,
        )


class ModelFactoryError(RuntimeError):
    """The ``--model`` (or ``--reference``) factory raised; the message names the factory and
    the error."""


def _cores() -> int:
    """The CPU cores this process may run on (its affinity, not the whole machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_device(device: str) -> torch.device:
    """``device`` as a torch device that exists here, or a ValueError naming the fix."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"--device {device!r} is not a torch device; use cpu, cuda or cuda:N"
        ) from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(
                f"--device {device}: torch sees no CUDA GPU (torch {torch.__version__}, {build}); "
                "run on a machine with a GPU and a CUDA build of torch, or use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1}); pick one of them"
            )
    elif dev.type != "cpu" and not _backend_available(dev):
        raise ValueError(f"--device {device}: {dev.type} is not available here; use cpu or cuda")
    return dev


def _backend_available(dev: torch.device) -> bool:
    module = getattr(torch, dev.type, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def load_factory(spec: str, flag: str = "--model") -> Callable[..., nn.Module]:
    """``"module:factory"`` -> the factory callable, with an error that names what is missing
    (``flag`` names the option in it)."""
    for name, value in (("spec", spec), ("flag", flag)):
        if not isinstance(value, str):
            raise TypeError(f"{name}={value!r} must be a string, e.g. 'my_models:build'")
    if spec.count(":") != 1:
        raise ValueError(f"{flag} {spec!r}: expected 'module:factory', e.g. 'my_models:build'")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"{flag} {spec}: cannot import module {module_name!r} ({e}); put its directory on "
            "PYTHONPATH or install it"
        ) from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise AttributeError(
            f"{flag} {spec}: module {module_name!r} has no callable {attr!r}; expected a "
            "function that returns a model (see docs/verify.md)"
        )
    return factory  # type: ignore[no-any-return]


def build_model(config: VerifyConfig, sizes: Mapping[str, Any] | None = None) -> nn.Module:
    """Call the factory with the options it must honour; refuse options it cannot take.

    ``mask`` and ``document_mask`` are passed only when they differ from the default, so a
    user's ``factory()`` without parameters works for the plain run, and asking it for
    ``--mask frame-causal`` is an error rather than a silently ignored flag. ``sizes`` (the
    reference model's ``latent_shape``/``action_dim``, from the dataset) go to the factory
    as they are.
    """
    import inspect

    spec = config.model or DEFAULT_MODEL
    factory = load_factory(spec)
    kwargs: dict[str, Any] = dict(sizes or {})
    if config.mask != "document":
        kwargs["mask"] = config.mask
    if not config.document_mask:
        kwargs["document_mask"] = False
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [k for k in kwargs if k not in params and not takes_any]
    if missing:
        flags = {"mask": f"--mask {config.mask}", "document_mask": "--no-document-mask"}
        raise TypeError(
            f"--model {spec}: the factory takes no {missing} parameter, so "
            f"{', '.join(flags[k] for k in missing)} cannot be applied; add the parameter to the "
            "factory or drop the flag"
        )
    try:
        model = factory(**kwargs)
    except Exception as e:
        raise ModelFactoryError(
            f"--model {spec}: the factory raised {type(e).__name__}: {' '.join(str(e).split())}; "
            "fix the factory (run it in Python to debug), then run verify again"
        ) from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"--model {spec} returned {type(model).__name__}, expected nn.Module")
    streams = getattr(model, "streams", None)
    if not streams:
        raise AttributeError(
            f"--model {spec}: the model has no `streams` attribute; declare the streams it "
            "reads, primary first, e.g. streams = [Stream('latents', grid=(4, 8)), "
            "Stream('action')] (see docs/verify.md)"
        )
    return model


def build_reference(config: VerifyConfig, model: nn.Module) -> tuple[nn.Module | None, str]:
    """The unpacked side: ``--reference`` factory called with the packed model, else the
    model's own ``reference()`` (e.g. an unmodified upstream model run one episode at a time),
    else None (a copy of the packed model runs one episode per micro-step)."""
    if config.reference is not None:
        factory = load_factory(config.reference, "--reference")
        try:
            ref = factory(model)
        except Exception as e:
            raise ModelFactoryError(
                f"--reference {config.reference}: the factory raised {type(e).__name__}: "
                f"{' '.join(str(e).split())}; fix the factory (run it in Python to debug), "
                "then run verify again"
            ) from e
        where = config.reference
    elif callable(getattr(model, "reference", None)):
        ref = model.reference()  # type: ignore[operator]
        where = f"{type(model).__name__}.reference()"
    else:
        return None, "a copy of the model"
    if not isinstance(ref, nn.Module):
        raise TypeError(f"the reference ({where}) is {type(ref).__name__}, expected nn.Module")
    return ref, where


def default_token_budget(lengths: Sequence[int]) -> int:
    """About a third of one step's tokens (so ~3 packs of several episodes), never below the
    longest episode nor the two shortest together (so that some pack holds two episodes and
    the leak check has something to check), rounded up to a multiple of 128 (of 8 below 512
    tokens)::

        lengths [160, 64, 288, 96]        (608 tokens)   -> max(203, 288, 160)  -> 288
        lengths [160, ..., 288] x 12 eps  (2,016 tokens) -> max(672, 288, 128)  -> 768
        lengths [5, 2, 9, 3, 7]           (26 tokens)    -> max(9, 9, 5)        -> 16
        lengths [45, 60, 30]              (135 tokens)   -> max(45, 60, 75)     -> 80
    """
    want = max(-(-sum(lengths) // 3), max(lengths), _two_shortest(lengths))
    multiple = 128 if want >= 512 else 8
    return -(-want // multiple) * multiple


def _two_shortest(lengths: Sequence[int]) -> int:
    """Tokens of the two shortest episodes together: the least budget a pack of two needs."""
    return sum(sorted(lengths)[:2])


# LeRobot's writer adds these to every dataset; they are bookkeeping, never a model stream.
_LEROBOT_DEFAULT_FEATURES = ("timestamp", "frame_index", "episode_index", "index", "task_index")


def dataset_features(config: VerifyConfig) -> tuple[Path, str, dict[str, dict[str, Any]]]:
    """(root, how the report names it, ``meta/info.json`` features) of the dataset to verify on."""
    from packing._lerobot_v3 import check_root, load_info

    if config.dataset is None:
        from packing.datasets import default_dataset_root

        root, where = default_dataset_root(), "embedded default dataset"
    else:
        root = Path(config.dataset).expanduser()
        where = str(config.dataset)
        check_root(root)
    return root, where, dict(load_info(root)["features"])


def reference_streams(
    features: Mapping[str, Mapping[str, Any]], given: Mapping[str, str], where: str
) -> tuple[dict[str, str], dict[str, Any]]:
    """Which features feed the reference DiT, and its sizes from their shapes::

        features {"observation.latent": float16 (16, 8, 16), "action": float32 (7,), ...}
        -> ({"latents": "observation.latent", "action": "action"},
            {"latent_shape": (16, 8, 16), "action_dim": 7})

    ``given`` (``--feature STREAM=FEATURE``) wins; otherwise a stream takes the feature of its
    own name, else the only numeric feature of the right rank (3-D latents, 1-D action);
    anything ambiguous is an error that lists the candidates.
    """

    def numeric(spec: Mapping[str, Any]) -> bool:
        try:
            return np.dtype(spec.get("dtype")).kind == "f"
        except TypeError:
            return False

    def pick(stream: str, rank: int, example: str) -> str:
        if stream in given:
            return given[stream]
        if stream in features:
            return stream
        found = [
            name
            for name, spec in features.items()
            if name not in _LEROBOT_DEFAULT_FEATURES
            and numeric(spec)
            and len(spec.get("shape", ())) == rank
        ]
        if len(found) == 1:
            return found[0]
        shapes = {n: tuple(s.get("shape", ())) for n, s in features.items()}
        raise ValueError(
            f"{where}: cannot tell which feature is the reference model's {stream!r} stream "
            f"({rank}-D float, e.g. {example}): {'candidates ' + str(found) if found else 'none'} "
            f"among {shapes}; pass --feature {stream}=FEATURE"
        )

    mapping = {
        "latents": pick("latents", 3, "(C, H, W) latents"),
        "action": pick("action", 1, "(action_dim,)"),
    }
    sizes: dict[str, Any] = {}
    for stream, feature in mapping.items():
        if feature not in features:
            raise ValueError(
                f"--feature {stream}={feature}: {where} has no feature {feature!r}; its "
                f"features are {sorted(features)}"
            )
        shape = tuple(int(s) for s in features[feature].get("shape", ()))
        rank = 3 if stream == "latents" else 1
        if len(shape) != rank or not numeric(features[feature]):
            raise ValueError(
                f"feature {feature!r} of {where} is {features[feature].get('dtype')} {shape}; "
                f"the reference model's {stream!r} stream needs a {rank}-D float feature"
            )
        sizes["latent_shape" if stream == "latents" else "action_dim"] = (
            shape if stream == "latents" else shape[0]
        )
    return mapping, sizes


def load_episodes(
    config: VerifyConfig, keys: Sequence[str], mapping: Mapping[str, str] | None = None
) -> tuple[list[dict[str, Any]], str]:
    """The first ``config.episodes`` episodes through `LeRobotEpisodes` (the user's path).

    ``mapping`` ``{stream: feature}`` renames features to the model's stream names (with
    their ``_loss_mask``), so ``observation.latent`` reaches the model as ``latents``.
    """
    from packing.datasets import LeRobotEpisodes

    root, where, features = dataset_features(config)
    mapping = {k: (mapping or {}).get(k, config.features.get(k, k)) for k in keys}
    unknown = sorted(set(config.features) - set(keys))
    if unknown:
        raise ValueError(
            f"--feature {unknown[0]}=...: the model has no stream {unknown[0]!r}; its streams "
            f"are {list(keys)}"
        )
    for stream, feature in mapping.items():
        if feature not in features:
            hint = "" if stream != feature else f"; map it with --feature {stream}=FEATURE"
            raise ValueError(
                f"the model's stream {stream!r} reads feature {feature!r}, which {where} does "
                f"not have (features: {sorted(features)}){hint}"
            )
    feats = list(mapping.values())
    if len(set(feats)) != len(feats):
        raise ValueError(f"two streams read the same feature: {mapping}; map each to its own")
    ds = LeRobotEpisodes(root, keys=feats)
    n = len(ds) if config.episodes is None else config.episodes
    if n > len(ds):
        raise ValueError(f"--episodes {n} > {len(ds)} episodes in {where}")
    renames = {f: s for s, f in mapping.items() if f != s}
    renames |= {f"{f}_loss_mask": f"{s}_loss_mask" for f, s in list(renames.items())}
    return [{renames.get(k, k): v for k, v in ds[i].items()} for i in range(n)], where


def model_and_episodes(
    config: VerifyConfig,
) -> tuple[nn.Module, list[dict[str, Any]], str, dict[str, str]]:
    """(model, episodes, where the data came from, {stream: feature}) for a verify run.

    The reference model (no ``config.model``) is sized from the dataset: its latent shape
    and action width come from the features `reference_streams` picks. Seed torch first:
    the model is initialised here.
    """
    mapping: dict[str, str] = dict(config.features)
    sizes: dict[str, Any] = {}
    if config.model is None:
        _, where, features = dataset_features(config)
        mapping, sizes = reference_streams(features, config.features, where)
    model = build_model(config, sizes)
    # A model whose episodes are not the dataset's features as they are (LingBot-VA: actions
    # per latent frame, text embeddings) names the features it reads (``dataset_keys``) and
    # turns the loaded episodes into its own (``adapt_episodes``).
    names = list(getattr(model, "dataset_keys", [s.name for s in model.streams]))  # type: ignore[union-attr]
    episodes, where = load_episodes(config, names, mapping)
    adapt = getattr(model, "adapt_episodes", None)
    if callable(adapt):
        episodes = adapt(episodes)
    return model, episodes, where, mapping


@dataclass(frozen=True)
class Setup:
    """What both harnesses need before the comparison: the model (and the unpacked side's
    reference), the episodes, both collates, each episode's tokens and the token budget."""

    model: nn.Module
    episodes: list[dict[str, Any]]
    where: str
    mapping: dict[str, str]
    streams: list[Any]
    unpacked: Any  # PackedCollator of one-episode batches
    packed: Any  # PackedCollator of packs under `budget`
    lengths: list[int]
    budget: int

    def info(self, config: VerifyConfig, **more: Any) -> dict[str, Any]:
        """The report's config block: the flags as run, and what they resolved to."""
        return {
            **asdict(config),
            "features": {s.name: self.mapping.get(s.name, s.name) for s in self.streams},
            "model": config.model or DEFAULT_MODEL,
            "dataset": self.where,
            "token_budget": self.budget,
            **more,
        }


def token_budget(
    lengths: Sequence[int],
    tokens_per_step: int,
    given: int | None,
    episode_ids: Sequence[Any] | None = None,
    *,
    leak_check: bool = False,
) -> int:
    """The packs' budget: ``given`` (``--token-budget``) or `default_token_budget` rounded up
    to whole steps of the primary stream; refused when an episode does not fit, or (with the
    leak check) when no two episodes fit one pack."""
    budget = given or -(-default_token_budget(lengths) // tokens_per_step) * tokens_per_step
    total = -(-sum(lengths) // tokens_per_step) * tokens_per_step
    if budget > total:  # refused before a pack of that size is allocated
        raise ValueError(
            f"--token-budget {budget:,} is more than the {sum(lengths):,} tokens of all "
            f"{len(lengths)} episodes together: every pack would be mostly padding; pass at "
            f"most {total:,} (packs hold several episodes when the budget is a fraction of it)"
        )
    if max(lengths) > budget:
        worst = max(range(len(lengths)), key=lambda i: lengths[i])
        raise ValueError(
            f"episode {worst if episode_ids is None else episode_ids[worst]} has {lengths[worst]:,} tokens > --token-budget {budget:,}; raise "
            "the budget"
        )
    pair = _two_shortest(lengths)
    if leak_check and pair > budget:
        raise ValueError(
            f"--token-budget {budget:,} holds one episode a pack (the two shortest have "
            f"{pair:,} tokens together): nothing to prove packing on and no leak to check; pass "
            f"--token-budget {-(-pair // tokens_per_step) * tokens_per_step:,} or more"
        )
    return budget


def check_finite_episodes(episodes: Sequence[Mapping[str, Any]], where: str) -> None:
    """A NaN or inf in the data is named (episode, key, first index, value) before the run:
    trained on, it makes both runs diverge, which would read as the model's fault."""
    for i, ep in enumerate(episodes):
        for key, value in ep.items():
            if isinstance(value, torch.Tensor):
                try:
                    check_finite(f"episode {ep.get('episode_index', i)} of {where}:", key, value)
                except ValueError as e:
                    raise ValueError(f"{e}; or pass --no-check-finite to train on it") from None


def prepare(config: VerifyConfig) -> Setup:
    """Model, episodes, collates and budget of a verify run, from its config (both harnesses).

    One-episode batches pad to a multiple of 128 tokens when every stream's step fits it; a
    grid of 15 tokens would pad to lcm(128, 15) = 1,920 (3% real), so such streams use 8.
    """
    from packing.data import PackedCollator

    torch.manual_seed(config.seed)
    model, episodes, where, mapping = model_and_episodes(config)
    if config.check_finite:
        check_finite_episodes(episodes, where)
    streams = list(model.streams)  # type: ignore[arg-type]
    multiple = 128 if all(128 % s.tokens_per_step == 0 for s in streams) else 8
    unpacked = PackedCollator(streams, pad_to_multiple=multiple)
    lengths = [unpacked([ep]).layout(streams[0].name).num_tokens for ep in episodes]
    ids = [ep.get("episode_index", i) for i, ep in enumerate(episodes)]
    budget = token_budget(
        lengths, streams[0].tokens_per_step, config.token_budget, ids, leak_check=config.leak_check
    )
    return Setup(
        model=model,
        episodes=episodes,
        where=where,
        mapping=mapping,
        streams=streams,
        unpacked=unpacked,
        packed=PackedCollator(streams, token_budget=budget),
        lengths=lengths,
        budget=budget,
    )
