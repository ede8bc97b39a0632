"""The contract every public name is held to: a bad argument is packing's own error, naming it.

The surface is DISCOVERED, not listed: every facade's ``__all__``, each function and class
constructor, and each public method a class defines. For each callable, ``BASE`` builds one
valid call (the base call); then each parameter, one at a time, is set to the standard bad
values of its annotated type:

    int      2.5 (non-integral), True (bool for int), "3" (wrong type), -1, 0, 2**70, None
    float    nan, inf, True, "1.0", None
    bool     "no", 1, None
    str      3, None; a Literal also "not-a-choice"
    Sequence "ab" (a string), 3, None
    Tensor   [1.0, 2.0] (a list), None

(None only where the annotation is not Optional). The call must raise a TypeError or
ValueError raised by packing's own code (the innermost frame is a file of packing/), whose
message names the parameter; or the triple (callable, parameter, kind) is in ``ALLOWED``
with a one-line reason (accepted on purpose). A public callable with parameters that has no
base call in ``BASE`` and no entry in ``NOT_CALLED`` FAILS ``test_every_public_callable_has_a_base_call``:
a new public name is covered the day it is added, or the test says what is missing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import traceback
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

PACKAGE = str(Path(__file__).resolve().parents[1] / "packing")
FACADES = [
    "packing", "packing.data", "packing.attention", "packing.planning", "packing.train",
    "packing.datasets", "packing.encode", "packing.model", "packing.verify", "packing.serve",
    "packing.serve.protocol", "packing.server",
    "packing.integrations.diffusers",
]  # fmt: skip
# LeRobot's LingBot-VA needs lerobot 0.6.1 and transformers: the oldest venv has them.
LINGBOT = all(importlib.util.find_spec(m) for m in ("lerobot", "transformers"))
if LINGBOT:
    FACADES.append("packing.integrations.lingbot_va")


# -- the surface ---------------------------------------------------------------------------
def _methods(cls: type) -> list[tuple[str, Callable[..., Any]]]:
    out = []
    for name, raw in vars(cls).items():
        if name.startswith("_") or isinstance(raw, property):
            continue
        fn = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
        if inspect.isfunction(fn) and fn.__module__.startswith("packing"):
            out.append((name, fn))
    return out


def surface() -> dict[str, Callable[..., Any]]:
    """``{"packing.planning.fill_packs": fill_packs, "packing.serve.PackShape.fits": ...}``,
    each object once (under the first facade that exports it)."""
    out: dict[str, Callable[..., Any]] = {}
    seen: set[int] = set()
    for facade in FACADES:
        module = importlib.import_module(facade)
        for name in module.__all__:
            obj = getattr(module, name)
            if id(obj) in seen or not callable(obj) or typing.get_origin(obj) is not None:
                continue  # constants and type aliases (Literal[...], Callable[...]) are data
            if isinstance(obj, typing.TypeAliasType | typing.TypeVar):
                continue
            seen.add(id(obj))
            out[f"{facade}.{name}"] = obj
            if inspect.isclass(obj):
                for m, fn in _methods(obj):
                    out[f"{facade}.{name}.{m}"] = fn
    return out


def _params(fn: Callable[..., Any], qualname: str) -> list[inspect.Parameter]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [
        p for p in sig.parameters.values()
        if p.name not in ("self", "cls") and not p.name.startswith("_")
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]  # fmt: skip


# -- bad values, from the annotation -------------------------------------------------------
def _annotation(p: inspect.Parameter) -> str:
    a = p.annotation
    return a if isinstance(a, str) else getattr(a, "__name__", str(a))


def bad_values(p: inspect.Parameter) -> list[tuple[str, Any]]:
    """(kind, value) pairs for ``p`` from its annotation (a string: ``from __future__``)."""
    text = _annotation(p).replace(" ", "")
    optional = "None" in text.split("|") or text.startswith("Optional")
    base = [t for t in text.split("|") if t != "None"]
    head = base[0] if len(base) == 1 else ""
    out: list[tuple[str, Any]] = []
    if head == "int":
        out += [("float", 2.5), ("bool", True), ("str", "3"), ("negative", -1), ("zero", 0)]
        out += [("huge", 2**70)]
    elif head == "float":
        out += [("nan", math.nan), ("inf", math.inf), ("bool", True), ("str", "1.0")]
    elif head == "bool":
        out += [("str", "no"), ("int", 1)]
    elif head == "str":
        out += [("int", 3)]
    elif head.startswith("Literal["):
        out += [("choice", "not-a-choice"), ("int", 3)]
    elif head.startswith(("Sequence[", "list[", "tuple[")):
        out += [("string", "ab"), ("int", 3)]
    elif head in ("Tensor", "torch.Tensor"):
        out += [("list", [1.0, 2.0])]
    if out and not optional and p.default is not None:
        out.append(("None", None))
    return out


# -- the base calls ------------------------------------------------------------------------
def _layout() -> Any:
    from packing.data import layout_from_lengths

    return layout_from_lengths([2, 3], [2, 3], 8)


def _batch() -> Any:
    from packing.data import PackedCollator

    eps = [
        {"x": torch.ones(n, 3), "a": torch.ones(n, 2), "episode_index": i}
        for i, n in enumerate([2, 3])
    ]
    return PackedCollator(["x", "a"], pad_to_multiple=4)(eps)


def _sampler() -> Any:
    from packing.planning import PackedBatchSampler

    return PackedBatchSampler([3, 4, 5], 8)


def _memory() -> Any:
    from packing.train import MemoryModel

    return MemoryModel(fixed=1e9, per_token=1e5, per_token_block=1e3)


def _grid_layout() -> Any:
    from packing.data import layout_from_lengths

    return layout_from_lengths([4, 2], [2, 1], 8, tokens_per_step=2)


def _ctx() -> torch.Tensor:
    return torch.zeros(1, 4, 2, 2)


@functools.cache
def _lingbot() -> Any:
    """A tiny LeRobot LingBot-VA policy packed (built once: lerobot is slow to import)."""
    from packing.integrations.lingbot_va import install
    from packing.integrations.lingbot_va.testing import tiny_policy

    torch.manual_seed(0)
    return install(tiny_policy(action_per_frame=2), latent_hw=(4, 4))


def _lingbot_batch() -> Any:
    from packing.integrations.lingbot_va.testing import toy_text_embeddings

    eps = [
        {"latents": torch.randn(f, 48, 4, 4), "actions": torch.randn(f, 2, 14),
         "text": toy_text_embeddings()("t"), "episode_index": i}
        for i, f in enumerate([2, 3])
    ]  # fmt: skip
    batch = _lingbot().collator(4 * 6)(eps)
    batch.extras.update(seed=0, step=0)
    return batch


def _lingbot_base() -> dict[str, Base]:
    if not LINGBOT:
        return {}
    import packing.integrations.lingbot_va as L
    from packing.integrations.lingbot_va.testing import tiny_policy

    def tokens() -> Any:
        return L.dual_stream_tokens(_lingbot_batch(), [1, 2], [4, 8], action_per_frame=2)

    shapes = {"latent_shape": (2, 3, 2, 2), "action_shape": (3, 3, 2, 1)}
    eps = [{"latents": torch.zeros(2, 1, 2, 2), "action": torch.zeros(8, 3), "task": "t"}]
    return {
        "packing.integrations.lingbot_va.install": lambda: (
            L.install, (tiny_policy(),), {"latent_hw": (4, 4)}),
        "packing.integrations.lingbot_va.PackedLingBotVA": lambda: (
            L.PackedLingBotVA, (tiny_policy(),), {"latent_hw": (4, 4)}),
        "packing.integrations.lingbot_va.PackedLingBotVA.collator": lambda: (
            _lingbot().collator, (4 * 6,), {}),
        "packing.integrations.lingbot_va.PackedLingBotVA.forward": lambda: (
            _lingbot().forward, (_lingbot_batch(),), {"reduction": "episode"}),
        "packing.integrations.lingbot_va.PackedLingBotVA.loss": lambda: (
            _lingbot().loss, (_lingbot_batch(),), {}),
        "packing.integrations.lingbot_va.PackedLingBotVA.draws": lambda: (
            _lingbot().draws, (_lingbot_batch(),), {}),
        "packing.integrations.lingbot_va.draw_episode": lambda: (L.draw_episode, (0, 0, 0), shapes),
        "packing.integrations.lingbot_va.lingbot_episodes": lambda: (
            L.lingbot_episodes, (eps, {"t": torch.zeros(4, 16)}), {}),
        "packing.integrations.lingbot_va.dual_stream_tokens": lambda: (
            L.dual_stream_tokens, (_lingbot_batch(), [1, 2], [4, 8]), {"action_per_frame": 2}),
        "packing.integrations.lingbot_va.lingbot_va_mask": lambda: (L.lingbot_va_mask, (tokens(),), {}),
        "packing.integrations.lingbot_va.clean_to_clean": lambda: (L.clean_to_clean, (tokens(),), {}),
        "packing.integrations.lingbot_va.noise_to_clean": lambda: (L.noise_to_clean, (tokens(),), {}),
        "packing.integrations.lingbot_va.noise_to_noise": lambda: (L.noise_to_noise, (tokens(),), {}),
        "packing.integrations.lingbot_va.chunk_window": lambda: (L.chunk_window, (tokens(),), {}),
        "packing.integrations.lingbot_va.LingShape": lambda: (L.LingShape, (), {"video": 2, "action": 2}),
        "packing.integrations.lingbot_va.phase_shapes": lambda: (L.phase_shapes, (2,), {}),
        "packing.integrations.lingbot_va.ChunkRequest": lambda: (L.ChunkRequest, (), {
            "session": "robot", "frames": torch.zeros(1, 48, 8, 16), "actions": None,
            "prompt": torch.zeros(3, 16), "negative": None, "seed": 0}),
    }  # fmt: skip


# name -> () -> (callable, args, kwargs). Small and readable: one valid call each.
Base = Callable[[], tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]


def _base() -> dict[str, Base]:
    import packing.attention as A
    import packing.data as D
    import packing.encode as E
    import packing.integrations.diffusers as F
    import packing.model as M
    import packing.planning as P
    import packing.serve as S
    import packing.serve.protocol as SP
    import packing.server as SV
    import packing.train as T
    import packing.verify as V

    ids = torch.tensor([0, 0, 1])
    return _lingbot_base() | {
        # planning
        "packing.BufferedPacker": lambda: (P.BufferedPacker, (8,), {}),
        "packing.PackedBatchSampler": lambda: (P.PackedBatchSampler, ([3, 4, 5], 8), {}),
        "packing.PackedBatchSampler.set_epoch": lambda: (_sampler().set_epoch, (1,), {}),
        "packing.PackedBatchSampler.replan_packs": lambda: (_sampler().replan_packs, (0,), {}),
        "packing.PackedBatchSampler.schedule": lambda: (_sampler().schedule, (0,), {}),
        "packing.PackedBatchSampler.state_dict": lambda: (_sampler().state_dict, (0,), {}),
        "packing.plan_packs": lambda: (P.plan_packs, ([3, 4, 5], 8), {}),
        "packing.frames_to_tokens": lambda: (P.frames_to_tokens, ([5],), {}),
        "packing.planning.fill_packs": lambda: (P.fill_packs, ([[0], [1], [2]], [3, 4, 5], 8), {}),
        "packing.planning.pack_fill": lambda: (P.pack_fill, ([[0], [1]], np.array([3, 4]), 8), {}),
        "packing.planning.compose_steps": lambda: (P.compose_steps, ([3, 4, 5],), {"token_budget": 8}),
        "packing.planning.step_token_budget": lambda: (
            P.step_token_budget, ([3, 4, 5],), {"episodes_per_step": 2.0}),
        "packing.planning.split_windows": lambda: (P.split_windows, (10, 4), {}),
        # data
        "packing.PackedCollator": lambda: (D.PackedCollator, (["x"],), {}),
        "packing.Stream": lambda: (D.Stream, ("x",), {}),
        "packing.data.layout_from_lengths": lambda: (D.layout_from_lengths, ([2, 3], [2, 3], 8), {}),
        "packing.unpack": lambda: (D.unpack, (_batch(),), {}),
        "packing.data.joint_layout": lambda: (D.joint_layout, (_batch(), ["x", "a"]), {}),
        "packing.PackedBatch.layout": lambda: (_batch().layout, ("x",), {}),
        # attention
        "packing.make_block_mask": lambda: (A.make_block_mask, (ids,), {}),
        "packing.attention.make_pool_block_mask": lambda: (A.make_pool_block_mask, (ids, ids), {}),
        "packing.document_mask_mod": lambda: (A.document_mask_mod, (ids,), {}),
        "packing.attention.dense_mask": lambda: (A.dense_mask, (ids,), {}),
        "packing.frame_causal": lambda: (A.frame_causal, (2,), {}),
        "packing.sliding_window": lambda: (A.sliding_window, (2,), {}),
        "packing.attention.prepare_attention": lambda: (A.prepare_attention, (_layout(),), {}),
        "packing.attention.resolve_backend": lambda: (A.resolve_backend, ("auto",), {"device": "cpu"}),
        "packing.attention.ascii_mask": lambda: (A.ascii_mask, (torch.eye(3, dtype=torch.bool),), {}),
        # train
        "packing.episode_noise": lambda: (T.episode_noise, (0, 0, 0, (2, 3)), {}),
        "packing.episode_timesteps": lambda: (T.episode_timesteps, (0, 0, [0, 1]), {}),
        "packing.train.episode_seed": lambda: (T.episode_seed, (0, 0, 0), {}),
        "packing.train.cfg_dropout_mask": lambda: (T.cfg_dropout_mask, (0, 0, [0, 1], 0.1), {}),
        "packing.reduce_loss": lambda: (T.reduce_loss, (torch.ones(3), ids, "token"), {}),
        "packing.broadcast_to_tokens": lambda: (T.broadcast_to_tokens, (torch.ones(2), ids), {}),
        "packing.LossNormalizer.for_step": lambda: (T.LossNormalizer.for_step, ([ids], "token"), {}),
        "packing.train.MemoryModel": lambda: (T.MemoryModel, (1e9, 1e5, 1e3), {}),
        "packing.train.MemoryModel.peak": lambda: (_memory().peak, (1024, 10**6, 2, 1), {}),
        "packing.train.MemoryModel.max_tokens": lambda: (_memory().max_tokens, (1e11, 10**6, 2, 1), {}),
        "packing.train.Probe": lambda: (T.Probe, (2, 1024, 10**6, 1, 1e9), {}),
        "packing.train.step_doc_ids": lambda: (T.step_doc_ids, (_layout(),), {}),
        "packing.train.token_weights": lambda: (T.token_weights, (ids, "token"), {}),
        "packing.train.local_denominator": lambda: (T.local_denominator, (ids, "token"), {}),
        "packing.train.StepProfiler": lambda: (T.StepProfiler, (), {"enabled": False}),
        "packing.train.StepProfiler.micro_step": lambda: (
            T.StepProfiler(enabled=False).micro_step, (), {"tokens": 3}),
        "packing.train.StepProfiler.table": lambda: (T.StepProfiler(enabled=False).table, (), {}),
        # model
        "packing.DiTConfig": lambda: (M.DiTConfig, (), {"dim": 32, "heads": 2, "depth": 1, "ffn_dim": 64}),
        "packing.DiTConfig.wan_1_3b": lambda: (M.DiTConfig.wan_1_3b, (), {}),
        "packing.DiTConfig.wan_2_2_5b": lambda: (M.DiTConfig.wan_2_2_5b, (), {}),
        "packing.model.text_tokens": lambda: (M.text_tokens, ("pick",), {}),
        "packing.model.pack_text": lambda: (M.pack_text, (["pick", "place"],), {}),
        "packing.model.param_count": lambda: (M.param_count, (M.DiTConfig.tiny(),), {}),
        # verify
        "packing.VerifyConfig": lambda: (V.VerifyConfig, (), {}),
        "packing.verify.Tolerances": lambda: (V.Tolerances, (), {"loss_rel": 1e-6, "grad_rel": 1e-5}),
        "packing.verify.load_factory": lambda: (V.load_factory, ("packing.model:tiny_reference_model",), {}),
        # encode
        "packing.encode.EncodeConfig": lambda: (E.EncodeConfig, ("src", "dst"), {}),
        "packing.encode.tiny_vae": lambda: (E.tiny_vae, (), {}),
        # the diffusers integration's functions that need no transformer
        "packing.integrations.diffusers.per_token_timesteps": lambda: (
            F.per_token_timesteps, (torch.tensor([700.0, 300.0]), _grid_layout()), {}),
        "packing.integrations.diffusers.patchify": lambda: (F.patchify, (torch.zeros(2, 4, 4, 4), (2, 2)), {}),
        "packing.integrations.diffusers.unpatchify": lambda: (
            F.unpatchify, (torch.zeros(8, 16), (2, 2), (2, 2)), {}),
        "packing.integrations.diffusers.pack_text_embeddings": lambda: (
            F.pack_text_embeddings, ([torch.zeros(3, 8), torch.zeros(2, 8)],), {}),
        # serve (the serve/faults branches own their validation)
        "packing.serve.PackShape": lambda: (S.PackShape, (), {"frames": 2, "actions": 2, "requests": 1}),
        "packing.serve.VideoShape": lambda: (S.VideoShape, (), {"frames": 2, "text": 4, "requests": 1}),
        "packing.serve.Request": lambda: (S.Request, (), {"context": _ctx(), "frames": 2, "actions": 2}),
        "packing.serve.VideoRequest": lambda: (
            S.VideoRequest, (), {"context": _ctx(), "text": torch.zeros(3, 8), "frames": 2}),
        "packing.serve.FlowScheduler": lambda: (S.FlowScheduler, (), {}),
        "packing.server.DiTAdapter": lambda: (SV.DiTAdapter, (), {}),
        "packing.server.WanAdapter": lambda: (SV.WanAdapter, (), {}),
        "packing.server.ServerConfig": lambda: (SV.ServerConfig, (), {}),
        "packing.serve.ContextCache": lambda: (S.ContextCache, (), {"pages": 4}),
        "packing.serve.ContextCache.pass_size": lambda: (S.ContextCache(pages=4).pass_size, (3,), {}),
        "packing.serve.ContextCache.window_pages": lambda: (
            S.ContextCache(pages=4, context_frames=8).window_pages, (2,), {}),
        "packing.serve.FlowScheduler.sigmas": lambda: (S.FlowScheduler().sigmas, (4,), {}),
        "packing.serve.FlowScheduler.coefficients": lambda: (S.FlowScheduler().coefficients, (4,), {}),
        "packing.serve.EngineConfig": lambda: (
            S.EngineConfig, (), {"shapes": (S.PackShape(frames=2, actions=2, requests=1),)}),
        # the protocol a served model implements, and its helpers
        "packing.serve.protocol.Steps": lambda: (SP.Steps, (False,), {}),
        "packing.serve.protocol.Steps.run": lambda: (
            SP.Steps(False).run, ("shape", lambda: None, _NoState()), {}),
        "packing.serve.protocol.quarantine": lambda: (
            SP.quarantine, (torch.zeros(2, dtype=torch.bool), [(torch.zeros(3, 2), ids)]), {}),
        "packing.serve.protocol.masks_from_doc_ids": lambda: (
            SP.masks_from_doc_ids, (ids, ids), {"backend": "sdpa", "inner": None,
                                                "document_mask": True}),
        "packing.serve.protocol.check_request_tensor": lambda: (
            SP.check_request_tensor, ("MyRequest", "frames", torch.zeros(2)), {}),
        "packing.serve.protocol.check_seed": lambda: (SP.check_seed, ("MyRequest.seed", 7), {}),
        "packing.serve.protocol.host_copy": lambda: (SP.host_copy, (torch.zeros(2),), {}),
        "packing.serve.protocol.to_host": lambda: (SP.to_host, (torch.zeros(2),), {}),
    }  # fmt: skip


class _NoState:
    """A step's holder for `Steps.run` whose step changes nothing."""

    def state(self) -> tuple[torch.Tensor, ...]:
        return ()


# Public callables with parameters that get no base call here, each with the reason. Keep
# this short: a name belongs here only when a base call needs a model, a GPU, a process
# group, a file or a network, and its arguments are tested in the file named.
NOT_CALLED: dict[str, str] = {
    "packing.DiT": "builds a model; DiTConfig is the checked boundary (tests/test_model.py)",
    "packing.DiT.patchify": "model internals on tensors (tests/test_model.py)",
    "packing.DiT.unpatchify": "model internals on tensors (tests/test_model.py)",
    "packing.DiT.prepare": "takes a PackedBatch from the collator (tests/test_model.py)",
    "packing.DiT.predict": "takes a PackedBatch from the collator (tests/test_model.py)",
    "packing.DiT.forward": "takes a PackedBatch from the collator (tests/test_model.py)",
    "packing.DiT.velocity": "the serve engine's call (tests/test_serve.py)",
    "packing.DiTConfig.tiny": "only **overrides, checked by DiTConfig",
    "packing.HFEpisodes": "needs a datasets.Dataset (tests/test_hf.py, test_contract_cases.py)",
    "packing.LeRobotEpisodes": "needs a dataset on disk (tests/test_lerobot.py)",
    "packing.LeRobotEpisodes.token_lengths": "needs a dataset on disk (tests/test_lerobot.py)",
    "packing.LossNormalizer": "built by for_step (checked above)",
    "packing.PackedBatch": "built by PackedCollator; namespaces tested in tests/test_collate.py",
    "packing.PackedBatch.token_layout": "the model's output check (tests/test_losses.py)",
    "packing.PackedBatch.to": "a device move (tests/test_collate.py)",
    "packing.PackedBatchSampler.load_state_dict": "takes state_dict()'s dict (tests/test_sampler.py)",
    "packing.StreamLayout": "built by layout_from_lengths (checked above)",
    "packing.StreamLayout.to": "a device move",
    "packing.compare_packed_unpacked": "trains two models (tests/test_verify.py)",
    "packing.find_leaks": "runs a model (tests/test_leak.py)",
    "packing.flow_matching_inputs": "tensor arithmetic on the caller's tensors (tests/test_losses.py)",
    "packing.packed_attention": "attention kernel on q, k, v (tests/test_attention.py)",
    "packing.run_verify": "trains two models (tests/test_verify.py); VerifyConfig is checked",
    "packing.shard_model": "needs a process group (tests/test_fsdp.py, test_contract_cases.py)",
    "packing.data.JointLayout": "built by joint_layout (checked above)",
    "packing.data.JointLayout.join": "model internals (tests/test_collate.py)",
    "packing.data.JointLayout.split": "model internals (tests/test_collate.py)",
    "packing.data.JointLayout.to": "a device move",
    "packing.data.pack": "only **kwargs, forwarded to PackedCollator (checked above)",
    "packing.attention.BLOCK_MASK_GRAPHS": "a cache object of block masks, not an entry point",
    "packing.attention.AttentionMask": "built by prepare_attention (checked above)",
    "packing.attention.ascii_blocks": "renders a BlockMask (tests/test_block_mask.py)",
    "packing.attention.save_png": "writes a file (tests/test_masks.py)",
    "packing.attention.with_block_rule": "composes an InnerMask with a rule (tests/test_block_mask.py)",
    "packing.planning.PackPlan": "built by plan_packs; its invariants: test_contract_cases.py",
    "packing.planning.PackPlan.to_json": "writes a file (tests/test_plan.py)",
    "packing.planning.PackPlan.from_json": "reads a file (tests/test_plan.py)",
    "packing.planning.PackPlan.to_arrow": "writes a file (tests/test_plan.py)",
    "packing.planning.PackPlan.from_arrow": "reads a file (tests/test_plan.py)",
    "packing.planning.slice_piece": "takes a plan's piece (tests/test_plan.py)",
    "packing.train.StepProfiler.write_json": "writes a file (tests/test_profile.py)",
    "packing.train.batch_rng_keys": "takes a PackedBatch with seed/step (tests/test_conditioning.py)",
    "packing.train.fit_memory_model": "takes probes (tests/test_fsdp.py)",
    "packing.train.gathered_named_parameters": "needs a sharded model (tests/test_fsdp.py)",
    "packing.train.global_denominator": "a collective; local_denominator is checked above",
    "packing.train.packed_noise": "takes a PackedBatch (tests/test_conditioning.py)",
    "packing.train.probe_peak": "needs a GPU (tests/test_gpu.py)",
    "packing.train.profiling": "a context manager over StepProfiler (checked above)",
    "packing.datasets.episode_lengths": "needs a dataset on disk (tests/test_lerobot.py)",
    "packing.datasets.write_default_dataset": "writes a dataset (tests/test_lerobot.py)",
    "packing.model.PackInputs": "built by DiT.prepare",
    "packing.model.KVCache": "a view over a pool the context cache allocates (tests/test_serve_cache.py)",
    "packing.model.tiny_reference_model": "builds a model (tests/test_verify.py)",
    "packing.verify.Leak": "a result record built by find_leaks",
    "packing.verify.Leak.describe": "a result record's rendering",
    "packing.verify.LeakReport": "a result record built by find_leaks",
    "packing.verify.LeakReport.summary": "a result record's rendering",
    "packing.verify.Tolerances.for_dtype": "takes a torch.dtype (tests/test_verify.py)",
    "packing.verify.VerifyReport": "a result record built by run_verify",
    "packing.verify.VerifyReport.to_json": "a result record's file (tests/test_verify.py)",
    "packing.verify.VerifyReport.format": "a result record's rendering (tests/test_verify.py)",
    "packing.verify.assert_no_leaks": "runs a model (tests/test_leak.py)",
    "packing.verify.verify_rank": "one rank of a torchrun process group (tests/test_ddp.py)",
    "packing.encode.encode_dataset": "reads and writes datasets; EncodeConfig is checked (tests/test_encode.py)",
    "packing.encode.EncodeReport": "a result record built by encode_dataset",
    "packing.encode.EncodeReport.format": "a result record's rendering (tests/test_encode.py)",
    "packing.serve.Engine": "needs a model (serve/faults branches: tests/test_serve.py)",
    "packing.serve.Engine.submit": "needs an engine (bad requests: tests/test_serve_faults.py)",
    "packing.serve.Engine.cancel": "needs an engine (tests/test_serve_faults.py)",
    "packing.serve.Engine.end_session": "needs an engine (tests/test_serve_cache.py)",
    "packing.serve.Engine.warm_up": "needs an engine (tests/test_serve_warm_up.py)",
    "packing.serve.InferenceReport": "a result record built by verify_inference",
    "packing.serve.InferenceReport.to_json": "a result record's file",
    "packing.serve.PackShape.fits": "takes Requests (tests/test_serve.py)",
    "packing.serve.VideoShape.fits": "takes VideoRequests (tests/test_serve.py)",
    "packing.server.PolicyClient": "connects to a server (tests/test_serve_server.py)",
    "packing.server.PolicyClient.infer": "a network call (tests/test_serve_server.py)",
    "packing.server.DiTAdapter.request": "takes a client's observation (tests/test_serve_server.py)",
    "packing.server.DiTAdapter.reply": "takes the engine's Result (tests/test_serve_server.py)",
    "packing.server.DiTAdapter.default_request": "takes an engine (tests/test_serve_boundaries.py)",
    "packing.server.WanAdapter.default_request": "takes an engine (tests/test_serve_boundaries.py)",
    "packing.server.WanAdapter.request": "takes a client's observation (tests/test_serve_server.py)",
    "packing.server.WanAdapter.reply": "takes the engine's Result (tests/test_serve_server.py)",
    "packing.server.PolicyServer": "needs an engine and a port (tests/test_serve_server.py)",
    "packing.server.PolicyServer.running": "starts a server (tests/test_serve_server.py)",
    "packing.serve.Request.noise": "the engine's call (tests/test_serve.py)",
    "packing.serve.Result": "a result record built by the engine",
    "packing.serve.VideoEngine": "needs a model (serve/faults branches: tests/test_serve_wan.py)",
    "packing.serve.VideoModel.velocity": "a protocol a user's model implements",
    "packing.serve.VideoPack": "built by the video engine",
    "packing.serve.reference_sample": "a scalar reference sampler of the scheduler tests",
    "packing.serve.verify_inference": "runs the inference proof (tests/test_cli.py)",
    "packing.serve.Engine.from_packs": "needs a model's Packs (tests/test_serve_protocol.py)",
}
NOT_CALLED.update({  # the protocol's methods: a model implements them, the engine calls them
    f"packing.serve.protocol.Packs.{m}": "a protocol a served model implements "
    "(tests/test_serve_protocol.py)"
    for m in ("check", "fits", "fresh", "layout", "state", "step", "flags", "result", "member",
              "joined", "left", "end_session", "sweep", "then")
})  # fmt: skip
NOT_CALLED.update(
    {
        "packing.attention.with_tile_rule": "attaches a rule to a mask_mod (tests/test_lingbot_va.py)",
        "packing.integrations.lingbot_va.EpisodeDraws": "a record built by draw_episode (checked above)",
        "packing.integrations.lingbot_va.DualStreamTokens": "built by dual_stream_tokens (checked above)",
        "packing.integrations.lingbot_va.DualStreamTokens.join": "the packed forward's plumbing",
        "packing.integrations.lingbot_va.DualStreamTokens.take": "the packed forward's plumbing",
        "packing.integrations.lingbot_va.LingShape.fits": "takes the engine's phases (plumbing)",
        "packing.integrations.lingbot_va.ServingReport": "a result record built by prove_serving",
        "packing.integrations.lingbot_va.prove_serving": "runs the serving proof (tests/test_lingbot_serve.py)",
    }
)
NOT_CALLED.update({  # LingBot-VA served: each needs a LeRobot policy (tests/test_lingbot_serve.py)
    f"packing.integrations.lingbot_va.{n}": "needs a LeRobot policy (tests/test_lingbot_serve.py)"
    for n in [
        "LingBotVAEngine", "LingBotVAAdapter", "LingBotVAAdapter.request", "LingBotVAAdapter.reply",
        "LingBotVAAdapter.end_session", "LingBotVAAdapter.unserved", "LingBotVAAdapter.from_policy",
        "PolicyEncoders", "PolicyEncoders.text", "PolicyEncoders.unserved",
        "PolicyEncoders.end_session", "ServedLingBotVA", *(f"ServedLingBotVA.{m}" for m in (
            "check", "executed", "fits", "member", "fresh", "layout", "state", "step", "flags",
            "result", "then", "joined", "left", "sweep", "end_session")),
    ]
})  # fmt: skip
NOT_CALLED.update({  # the diffusers integration: every entry needs a diffusers transformer
    f"packing.integrations.diffusers.{n}": "needs a diffusers transformer (tests/test_diffusers*.py)"
    for n in [
        "PackedAdapter", "PackedAdapter.compile_blocks", "PackedAdapter.prepare",
        "PackedAdapter.rope_rows", "PackedAdapter.masks", "PackedAdapter.velocity",
        "PackedAdapter.packed_forward", "PackedAdapter.run_blocks", "PackedLTX",
        "PackedLTX.rope_rows", "PackedLTX.packed_forward", "PackedWan", "PackedWan.rope_rows",
        "PackedWan.packed_forward", "ServedWan", "ServedWan.velocity", "install", "FamilyParts",
        "drop_masked_rows",
    ]
})  # fmt: skip

# (callable, parameter, kind) -> why the value is accepted on purpose.
ALLOWED: dict[tuple[str, str, str], str] = {}


def allow(name: str, params: str, kinds: str, why: str) -> None:
    for p in params.split():
        for k in kinds.split():
            ALLOWED[(name, p, k)] = why


_KEYS = "seed step episode_index"
_HASHED = "an int64 key, hashed by splitmix64: 0 and negatives are distinct valid keys"
for _fn in ("packing.episode_noise", "packing.train.episode_seed"):
    allow(_fn, _KEYS, "zero negative", _HASHED)
allow("packing.encode.EncodeConfig", "num_workers", "zero", "0: decode between encodes (default)")
allow("packing.encode.EncodeConfig", "seed", "zero", "seed 0 of the random-init VAEs")
allow("packing.encode.tiny_vae", "seed", "zero", "seed 0 of the random init")
for _fn in ("packing.episode_timesteps", "packing.train.cfg_dropout_mask"):
    allow(_fn, "seed step", "zero negative", _HASHED)
allow("packing.PackedBatchSampler", "rank", "zero", "rank 0 is a rank")
allow("packing.Stream", "pad_value", "bool", "a bool stream pads with False or True")
allow("packing.VerifyConfig", "episodes", "huge", "the first N episodes: all, when N is more")
allow("packing.attention.prepare_attention", "head_dim", "huge", "a kernel-choice hint only")
allow("packing.attention.resolve_backend", "head_dim", "huge", "a kernel-choice hint only")
allow("packing.data.layout_from_lengths", "max_docs", "zero", "0 documents: an empty layout")
allow(
    "packing.plan_packs",
    "fixed_tokens split_overlap",
    "huge",
    "used only with oversize='split', where a piece is checked against the budget",
)
allow(
    "packing.plan_packs",
    "token_budget tokens_per_step split_multiple",
    "huge",
    "a size larger than every episode is a valid plan (one pack, or no cut)",
)
allow("packing.plan_packs", "fixed_tokens split_overlap", "zero", "0 is the default: none")
allow("packing.plan_packs", "max_docs", "huge", "no limit in practice")
allow("packing.BufferedPacker", "token_budget buffer_size max_docs", "huge", "no limit in practice")
allow(
    "packing.PackedBatchSampler",
    "token_budget balance_window replan_window max_docs",
    "huge",
    "a window or budget above the data's size is the whole epoch",
)
allow("packing.PackedBatchSampler", "seed", "zero huge", "any seed >= 0 (numpy SeedSequence)")
allow("packing.PackedBatchSampler.set_epoch", "epoch", "zero huge", "any epoch >= 0")
allow("packing.PackedBatchSampler.replan_packs", "epoch", "zero huge", "any epoch >= 0")
allow("packing.PackedBatchSampler.schedule", "epoch", "zero huge", "any epoch >= 0")
allow("packing.PackedBatchSampler.state_dict", "consumed", "zero", "nothing consumed yet")
allow("packing.PackedCollator", "max_docs", "huge", "a size: refused only when a pack is over it")
allow("packing.Stream", "tokens_per_step", "huge", "a size, checked against the data")
allow("packing.frames_to_tokens", "temporal_compression", "huge", "one latent frame per episode")
allow("packing.frames_to_tokens", "action_tokens_per_frame text_tokens", "zero", "none (default)")
allow(
    "packing.frames_to_tokens",
    "action_tokens_per_frame text_tokens",
    "huge",
    "exact int64 arithmetic up to the overflow check",
)
allow("packing.planning.fill_packs", "token_budget max_docs", "huge", "no limit in practice")
allow("packing.planning.fill_packs", "rounds", "zero huge", "rounds of re-planning: 0 = none")
allow("packing.planning.pack_fill", "token_budget", "huge", "fill is then ~0")
allow("packing.planning.compose_steps", "token_budget max_docs", "huge", "a size")
allow("packing.planning.step_token_budget", "multiple", "huge", "rounds up to one multiple")
allow("packing.planning.split_windows", "max_steps", "huge", "one window")
allow("packing.planning.split_windows", "overlap", "zero", "no overlap (default)")
allow("packing.data.layout_from_lengths", "padded tokens_per_step max_docs", "huge", "a size")
allow("packing.frame_causal", "tokens_per_frame kv_tokens_per_frame", "huge", "one frame")
allow("packing.sliding_window", "window", "zero", "a window of 0: the token itself")
allow("packing.sliding_window", "window", "huge", "the whole episode")
allow("packing.reduce_loss", "tokens_per_step", "huge", "a step longer than the episode")
allow("packing.LossNormalizer.for_step", "tokens_per_step", "huge", "as reduce_loss")
allow("packing.train.MemoryModel.peak", "tokens params", "zero huge", "arithmetic: any size")
allow("packing.train.MemoryModel.peak", "depth world", "huge", "arithmetic: any size")
allow("packing.train.MemoryModel.max_tokens", "params", "zero huge", "0 tokens when it cannot fit")
allow("packing.train.MemoryModel.max_tokens", "depth world multiple", "huge", "as above")
allow("packing.train.Probe", "tokens params depth world", "huge", "a measurement")
allow("packing.train.step_doc_ids", "num_steps", "huge", "a size")
allow("packing.train.token_weights", "tokens_per_step", "huge", "as reduce_loss")
allow("packing.train.local_denominator", "tokens_per_step", "huge", "as reduce_loss")
allow("packing.train.StepProfiler", "kernel_step", "zero huge", "a step number")
allow(
    "packing.train.StepProfiler.micro_step",
    "tokens padded_tokens documents",
    "zero huge",
    "counts the caller reports",
)
allow("packing.train.StepProfiler.table", "last", "huge", "every record")
allow(
    "packing.DiTConfig",
    "latent_channels action_dim text_len vocab freq_dim",
    "huge",
    "a width: the model is built only when asked",
)
allow("packing.DiTConfig", "dim depth ffn_dim", "huge", "a width, as above")
allow("packing.DiTConfig.wan_1_3b", "depth", "huge", "a config, not a model")
allow("packing.DiTConfig.wan_2_2_5b", "depth", "huge", "a config, not a model")
allow("packing.model.text_tokens", "text_len", "huge", "refused when over the vocabulary limit")
allow("packing.model.pack_text", "text_len", "huge", "a size")
allow("packing.VerifyConfig", "seed", "zero", "seed 0 is the default")
_LB = "packing.integrations.lingbot_va."
allow(_LB + "draw_episode", _KEYS, "zero negative", _HASHED)
allow(_LB + "PackedLingBotVA.collator", "token_budget max_docs text_budget", "huge",
      "a size: refused only when a pack is built over it")  # fmt: skip
allow(_LB + "lingbot_episodes", "action_per_frame", "huge", "checked against each episode read")
allow(_LB + "ChunkRequest", "seed", "zero", "seed 0 is a seed")
allow(_LB + "LingShape", "video action", "zero", "a pack of the other loop alone (phase_shapes)")
if not LINGBOT:  # without lerobot the facade is not walked: its entries would name nothing
    for _key in [k for k in NOT_CALLED if k.startswith(_LB)]:
        del NOT_CALLED[_key]
    for _case in [c for c in ALLOWED if c[0].startswith(_LB)]:
        del ALLOWED[_case]

allow("packing.server.DiTAdapter", "seed", "zero", "seed 0 is a seed")
allow("packing.server.WanAdapter", "seed", "zero", "seed 0 is a seed")
allow("packing.server.ServerConfig", "port", "zero", "port 0: the OS picks a free port")
allow(
    "packing.server.DiTAdapter", "frames", "zero", "a chunk may generate no frames (actions only)"
)
allow("packing.serve.Request", "frames", "zero", "a request may generate no frames")
allow("packing.serve.Request", "seed", "zero", "seed 0 is a seed")
allow("packing.serve.VideoRequest", "seed", "zero", "seed 0 is a seed")


def _call(name: str, base: Base, param: inspect.Parameter, value: Any) -> BaseException | None:
    fn, args, kwargs = base()
    bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    bound.arguments[param.name] = value
    try:
        fn(*bound.args, **bound.kwargs)
    except Exception as e:
        return e
    return None


def _verdict(e: BaseException | None, param: str) -> str | None:
    """None when ``e`` is packing's own error naming ``param``, else what is wrong."""
    if e is None:
        return "accepted"
    frames = traceback.extract_tb(e.__traceback__)
    where = frames[-1].filename if frames else "?"
    if isinstance(e, LookupError) and where.startswith(PACKAGE) and param in str(e):
        return None  # a name that is not there (errors.md: KeyError), named
    if not isinstance(e, TypeError | ValueError):
        return f"{type(e).__name__} from {Path(where).name}: {str(e)[:80]}"
    if not where.startswith(PACKAGE):
        return f"{type(e).__name__} from inside {Path(where).name}: {str(e)[:80]}"
    if param not in str(e):
        return f"message does not name {param!r}: {str(e)[:100]}"
    return None


def _cases() -> list[tuple[str, str, str, Any]]:
    base = _base()
    out = []
    for name, fn in surface().items():
        if name not in base:
            continue
        for p in _params(fn, name):
            for kind, value in bad_values(p):
                out.append((name, p.name, kind, value))
    return out


def test_every_public_callable_has_a_base_call() -> None:
    """A new public callable with parameters fails here until it has a recipe in BASE (or a
    reason in NOT_CALLED): nothing on the surface is skipped silently."""
    base = _base()
    missing = [
        name for name, fn in surface().items()
        if _params(fn, name) and name not in base and name not in NOT_CALLED
    ]  # fmt: skip
    assert not missing, f"add a base call to BASE (or a reason to NOT_CALLED) for {missing}"
    stale = sorted(set(base) - set(surface())) + sorted(set(NOT_CALLED) - set(surface()))
    assert not stale, f"BASE/NOT_CALLED name callables that are not public: {stale}"


def test_every_base_call_is_valid() -> None:
    """The base calls themselves succeed: a bad value's error is then caused by that value."""
    for base in _base().values():
        fn, args, kwargs = base()
        fn(*args, **kwargs)


def test_the_contract_walks_the_surface() -> None:
    """A guard against a vacuous pass: most of the surface is called, with many bad values."""
    cases = _cases()
    assert len({c[0] for c in cases}) >= 50 and len(cases) >= 400, len(cases)


@pytest.mark.parametrize(("name", "param", "kind", "value"), _cases(), ids=lambda x: str(x)[:40])
def test_bad_value_is_packings_own_error_naming_it(
    name: str, param: str, kind: str, value: Any
) -> None:
    key = (name, param, kind)
    verdict = _verdict(_call(name, _base()[name], _param(name, param), value), param)
    if key in ALLOWED:
        return  # accepted on purpose, for the reason given
    assert verdict is None, f"{name}({param}={value!r}) [{kind}]: {verdict}"


def _param(name: str, param: str) -> inspect.Parameter:
    fn = surface()[name]
    return next(p for p in _params(fn, name) if p.name == param)


def test_allowances_are_still_needed() -> None:
    """An allowance for a value that is refused now is stale: remove it."""
    cases = {(c[0], c[1], c[2]): c[3] for c in _cases()}
    unknown = sorted(k for k in ALLOWED if k not in cases)
    assert not unknown, (
        f"these allowances name no case (a typo, or a kind the type lacks): {unknown}"
    )
    stale = []
    for key in ALLOWED:
        if key in cases:
            e = _call(key[0], _base()[key[0]], _param(key[0], key[1]), cases[key])
            if _verdict(e, key[1]) is None:
                stale.append(key)
    assert not stale, f"these values are refused now; remove their ALLOWED entries: {stale}"


# -- the server's configuration: ServerConfig, PolicyServer, PolicyClient ----------------------
# The generic kinds above cover types, NaN and inf; a server also needs its values bounded
# (a duration asyncio cannot wait for, a summary period that floods the log) and its
# arguments checked together (one engine listed twice). Each case: packing's own error
# naming the parameter, before anything is allocated or connected.
def _tiny_engine() -> Any:
    from packing.model import DiT, DiTConfig
    from packing.serve import Engine, EngineConfig, PackShape

    torch.manual_seed(0)
    model = DiT(DiTConfig.tiny(latent_channels=4, latent_hw=(2, 2), action_dim=2)).eval()
    return Engine(model, EngineConfig(shapes=(PackShape(frames=4, actions=8, requests=2),)))


_DURATIONS = ("deadline_s", "drain_s", "send_timeout_s", "handshake_timeout_s", "summary_every_s")
SERVER_CASES: list[tuple[str, str, Any]] = [
    *[("ServerConfig", n, v) for n in _DURATIONS for v in (1e300, 86_400.5, -1.0, math.inf)],
    *[("ServerConfig", name, 0.0) for name in _DURATIONS if name != "drain_s"],
    ("ServerConfig", "summary_every_s", 1e-6),
    ("ServerConfig", "max_message_bytes", 2**41),
    ("ServerConfig", "max_connections", 0),
    ("ServerConfig", "host", ""),
    ("ServerConfig", "api_key", "two words\n"),
    ("ServerConfig", "metadata", {1: "a"}),
    ("PolicyServer", "engines", []),
    ("PolicyServer", "engines", "engine"),
    ("PolicyServer", "engines", "twice"),  # [engine, engine]
    ("PolicyServer", "adapter", object()),
    ("PolicyServer", "adapter", "refused"),  # defaults the engine refuses
    ("PolicyServer", "config", {"port": 0}),
    *[("PolicyClient", "timeout_s", v) for v in (-1, "5", 0, math.nan, math.inf, 1e300, True)],
    *[("PolicyClient", "port", v) for v in (0, 70_000, "80", 2.5)],
    ("PolicyClient", "host", ""),
    ("PolicyClient", "host", 3),
    ("PolicyClient", "api_key", ""),
    *[("PolicyClient", "max_message_bytes", v) for v in (0, 2.5, 2**70)],
]


def _server_call(name: str, param: str, value: Any) -> BaseException | None:
    import packing.server as S

    try:
        if name == "ServerConfig":
            S.ServerConfig(**{param: value})
        elif name == "PolicyClient":
            S.PolicyClient(**{param: value})
        else:
            engine, adapter = _tiny_engine(), S.DiTAdapter(actions=2, steps=4)
            args: dict[str, Any] = {"engines": engine, "adapter": adapter, "config": None}
            named = {"twice": [engine, engine], "refused": S.DiTAdapter(frames=9)}
            args[param] = named.get(value, value) if isinstance(value, str) else value
            S.PolicyServer(args["engines"], args["adapter"], args["config"])
    except Exception as e:
        return e
    return None


def _case_id(x: Any) -> str:
    """A test id the same in every xdist worker: an object's repr holds its address."""
    plain = isinstance(x, str | int | float | bool | dict | tuple | list) or x is None
    return str(x)[:30] if plain else type(x).__name__


@pytest.mark.parametrize(("name", "param", "value"), SERVER_CASES, ids=_case_id)
def test_the_servers_configuration_refuses_bad_values_naming_them(name, param, value) -> None:
    verdict = _verdict(_server_call(name, param, value), param)
    assert verdict is None, f"{name}({param}={value!r}): {verdict}"


def test_the_servers_good_configuration_is_accepted() -> None:
    """The control: the edges of every bound are accepted (a day, 0.1 s, drain_s=0)."""
    import packing.server as S

    S.ServerConfig(deadline_s=86_400, drain_s=0.0, summary_every_s=0.1, send_timeout_s=1e-3)
    S.PolicyServer(_tiny_engine(), S.DiTAdapter(actions=2, steps=4))
