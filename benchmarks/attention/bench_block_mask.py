"""Block mask build: packing.attention._masks.make_block_mask vs create_block_mask (eager and _compile=True).

For 8K-256K tokens and 1-256 episodes, on GPU and CPU: build time (median of CUDA-event timed
calls after warm-up; host wall time on CPU), host-device syncs (the build runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any sync), and recompiles as the
lengths change (``torch._dynamo`` graph counters). The baseline is ``create_block_mask`` with
the plain mask_mod a user writes (``doc[q] == doc[kv]``); the library's own mask_mod
(``document_mask_mod``, which also reads padding) is timed too, and the two BlockMasks are
checked to describe the same tiles.

    python benchmarks/attention/bench_block_mask.py             # GPU, full sizes (~2 min on H200)
    python benchmarks/attention/bench_block_mask.py --quick     # tiny, CPU, for CI
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import harness
from packing.attention import document_mask_mod, frame_causal, make_block_mask


def doc_ids_for(T: int, k: int, rng: torch.Generator, fill: float = 0.97) -> torch.Tensor:
    """``k`` random-length episodes filling ~``fill`` of ``T``, tail padding -1 (int32, CPU)."""
    real = max(k, int(T * fill))
    cuts = torch.sort(torch.randperm(real - 1, generator=rng)[: k - 1] + 1).values
    bounds = [0, *cuts.tolist(), real]
    doc = torch.full((T,), -1, dtype=torch.int32)
    for i in range(k):
        doc[bounds[i] : bounds[i + 1]] = i
    return doc


def tiles_of(bm: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(any tile, full tile) dense bool (Q blocks, KV blocks) of a BlockMask."""

    def dense(num: torch.Tensor, idx: torch.Tensor, n_kv: int) -> torch.Tensor:
        num, idx = num[0, 0].cpu(), idx[0, 0].cpu()
        out = torch.zeros(idx.shape[0], n_kv, dtype=torch.bool)
        for r in range(idx.shape[0]):
            out[r, idx[r, : num[r]].long()] = True
        return out

    n_kv = -(-bm.seq_lengths[1] // bm.BLOCK_SIZE[1])
    part = dense(bm.kv_num_blocks, bm.kv_indices, n_kv)
    full = (
        dense(bm.full_kv_num_blocks, bm.full_kv_indices, n_kv)
        if bm.full_kv_num_blocks is not None
        else torch.zeros_like(part)
    )
    return part | full, full


def no_sync(fn: Any, device: torch.device) -> bool | None:
    """True if ``fn()`` runs with no host-device sync (sync debug mode 'error' raises on one)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        ok = True
    except RuntimeError as e:
        if "synchroniz" not in str(e).lower():
            raise
        ok = False
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return ok


def time_into(r: dict[str, Any], key: str, fn: Any, device: torch.device, **kw: Any) -> bool:
    """Median ms of ``fn`` into ``r[key]``; a failure is recorded as ``r[key + " error"]``
    (never hidden: the table says what failed). Returns whether it ran."""
    try:
        r[key] = harness.time_fn(fn, device=device, **kw).median_ms
        return True
    except Exception as e:
        r[key] = None
        r[f"{key} error"] = f"{type(e).__name__}: {str(e)[:600]}"
        import traceback

        traceback.print_exc()
        return False


def same_tiles(ours: Any, theirs: Any) -> bool:
    """Our BlockMask lists the very tiles create_block_mask lists (partial and full)."""
    a_any, a_full = tiles_of(ours)
    b_any, b_full = tiles_of(theirs)
    return bool(torch.equal(a_any, b_any) and torch.equal(a_full, b_full))


def build_rows(args: Any, device: torch.device, sizes: list[int], docs: list[int]) -> list[dict]:
    rng = torch.Generator().manual_seed(args.seed)
    rows: list[dict] = []
    eager_cap = args.eager_cap if device.type == "cuda" else min(args.eager_cap, 32768)
    for T in sizes:
        for k in docs:
            if k > T // 64:
                continue
            doc = doc_ids_for(T, k, rng).to(device)
            mod = document_mask_mod(doc)

            def plain(b: Any, h: Any, q: Any, kv: Any, doc: torch.Tensor = doc) -> Any:
                return doc[q] == doc[kv]  # what a user writes for a document mask

            r: dict[str, Any] = {"device": device.type, "tokens": T, "episodes": k}
            ours_fn = partial(make_block_mask, doc)
            eager_fn = partial(create_block_mask, plain, None, None, T, T, device=device)
            comp_fn = partial(eager_fn, _compile=True)
            lib_comp_fn = partial(create_block_mask, mod, None, None, T, T, device=device,
                                  _compile=True)  # fmt: skip
            ours = harness.time_fn(ours_fn, device=device, warmup=3, iters=args.iters)
            r["ours ms"] = ours.median_ms
            r["ours p90"] = ours.p90_ms
            r["ours syncs"] = None if device.type != "cuda" else not no_sync(ours_fn, device)
            if device.type == "cuda":
                # make_block_mask(compile=True): the tile classification as one compiled graph
                oc_fn = partial(make_block_mask, doc, compile=True)
                if time_into(r, "ours compiled ms", oc_fn, device, warmup=3, iters=args.iters):
                    r["ours compiled syncs"] = not no_sync(oc_fn, device)
                # compile="cuda_graph": that graph captured in a CUDA graph (3 launches a call)
                og_fn = partial(make_block_mask, doc, compile="cuda_graph")
                if time_into(r, "ours cuda_graph ms", og_fn, device, warmup=3, iters=args.iters):
                    r["ours cuda_graph syncs"] = not no_sync(og_fn, device)
                    r["ours cuda_graph same tables"] = same_tiles(og_fn(), ours_fn())
            if eager_cap >= T:
                time_into(
                    r, "cbm eager ms", eager_fn, device, warmup=1, iters=max(3, args.iters // 5)
                )
            if args.compiled_cap >= T:
                time_into(r, "cbm compiled ms", comp_fn, device, warmup=2, iters=args.iters)
                time_into(r, "cbm compiled, library mod ms", lib_comp_fn, device, warmup=2,
                          iters=args.iters)  # fmt: skip
            modes = ("ours ms", "ours compiled ms", "ours cuda_graph ms")
            best = min(r[m] for m in modes if r.get(m))
            r["ours best ms"] = best
            if r.get("cbm compiled ms"):
                r["speedup vs compiled"] = r["cbm compiled ms"] / best
            if r.get("cbm eager ms"):
                r["speedup vs eager"] = r["cbm eager ms"] / best
            if T <= 16384:  # same tiles as create_block_mask (the dense reference of tiles)
                ref = create_block_mask(mod, None, None, T, T, device=device)
                r["same tiles"] = same_tiles(make_block_mask(doc), ref)
            rows.append(r)
            print(r, flush=True)
    return rows


def inner_rows(args: Any, device: torch.device, T: int) -> list[dict]:
    """Frame-causal (32 tokens/frame): our tile rule vs create_block_mask on the same mod."""
    rng = torch.Generator().manual_seed(args.seed + 7)
    rows = []
    for k in (1, 8, 64):
        if k > T // 64:
            continue
        doc = doc_ids_for(T, k, rng).to(device)
        inner = frame_causal(32)
        mod = document_mask_mod(doc, inner=inner)
        ours_fn = partial(make_block_mask, doc, inner=inner)
        comp_fn = partial(create_block_mask, mod, None, None, T, T, device=device, _compile=True)
        ours = harness.time_fn(ours_fn, device=device, iters=args.iters)
        r: dict[str, Any] = {"device": device.type, "tokens": T, "episodes": k,
                             "mask": "frame_causal_32", "ours ms": ours.median_ms}  # fmt: skip
        r["ours syncs"] = None if device.type != "cuda" else not no_sync(ours_fn, device)
        if args.compiled_cap >= T and time_into(
            r, "cbm compiled ms", comp_fn, device, warmup=2, iters=args.iters
        ):
            r["speedup vs compiled"] = r["cbm compiled ms"] / ours.median_ms
        if T <= 16384:
            ref = create_block_mask(mod, None, None, T, T, device=device)
            r["same tiles"] = same_tiles(make_block_mask(doc, inner=inner), ref)
        rows.append(r)
        print(r, flush=True)
    return rows


def count_graphs(
    device: torch.device, case: str, builder: str, layouts: list[torch.Tensor], step: Any
) -> dict[str, Any]:
    """Run ``step`` on each layout; count dynamo graphs compiled after the first step.
    A failure stops the run and is recorded in the row."""
    errors: list[str] = []
    start = None
    for i, doc in enumerate(layouts):
        try:
            step(doc.to(device))
        except Exception as e:
            errors.append(f"step {i}: {type(e).__name__}: {str(e)[:160]}")
            break
        if i == 0:
            start = harness.dynamo_counters()["unique_graphs"]
    end = harness.dynamo_counters()["unique_graphs"]
    return {"device": device.type, "case": case, "builder": builder, "steps": len(layouts),
            "graphs after step 0": end - (start or 0), "errors": "; ".join(errors) or None}  # fmt: skip


def recompile_rows(args: Any, device: torch.device, T: int, steps: int) -> list[dict]:
    """Lengths change every step. (a) fixed T (static budget), new episodes each step;
    (b) T changes too (padding to a multiple of 128 only). Count graphs compiled after the
    first step, for create_block_mask(_compile=True) and for compiled flex_attention fed by
    make_block_mask (what packing.attention runs)."""
    from torch.nn.attention.flex_attention import flex_attention

    rng = torch.Generator().manual_seed(args.seed + 3)
    rows = []
    for case in ("fixed T, new episodes", "T varies (pad to 128)"):
        # Varying T: every new T is a new graph for a static-shape compile, by design; 6 steps
        # show it without spending minutes compiling up to the recompile limit.
        Ts = (
            [T] * steps if case.startswith("fixed") else [T - 128 * i for i in range(min(steps, 6))]
        )
        layouts = [doc_ids_for(t, int(torch.randint(2, 12, (1,), generator=rng)), rng) for t in Ts]

        def cbm(d: torch.Tensor) -> None:
            create_block_mask(document_mask_mod(d), None, None, d.shape[0], d.shape[0],
                              device=device, _compile=True)  # fmt: skip

        torch._dynamo.reset()
        rows.append(count_graphs(device, case, "create_block_mask(_compile=True)", layouts, cbm))
        if device.type == "cuda":
            rows.append(count_graphs(device, case, "make_block_mask(compile=True)", layouts,
                                     partial(make_block_mask, compile=True)))  # fmt: skip
            # ours + compiled flex (fwd), as packing.attention calls it
            torch._dynamo.reset()
            flex = torch.compile(flex_attention, dynamic=False)

            def ours_flex(d: torch.Tensor, flex: Any = flex) -> None:
                q = torch.randn(1, 4, d.shape[0], 64, device=device, dtype=torch.bfloat16)
                flex(q, q, q, block_mask=make_block_mask(d))

            rows.append(count_graphs(device, case, "make_block_mask + compiled flex_attention",
                                     layouts, ours_flex))  # fmt: skip
        for r in rows[-3:]:
            print(r, flush=True)
    return rows


def main() -> None:
    p = harness.base_parser(__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--eager-cap", type=int, default=65536, help="largest T for eager cbm")
    p.add_argument("--compiled-cap", type=int, default=262144)
    p.add_argument("--cpu", action="store_true", help="also run the CPU rows next to the GPU")
    p.add_argument("--sizes", default="", help="token counts, e.g. 65536 (default: all)")
    p.add_argument("--docs", default="", help="episode counts, e.g. 16 (default: all)")
    p.add_argument("--no-extra", action="store_true", help="skip inner-mask and recompile rows")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    devices = [torch.device(args.device)]
    if args.cpu and args.device != "cpu":
        devices.append(torch.device("cpu"))

    rows, extra, recompiles = [], [], []
    for dev in devices:
        if args.quick:
            # CPU smoke: no compiled builder (an Inductor C++ compile takes minutes on CI)
            sizes, docs, rT, steps = [512, 1024], [1, 3], 512, 2
            args.iters, args.compiled_cap = 2, 0
        elif dev.type == "cuda":
            sizes, docs = [8192, 65536, 262144], [4, 16, 64]
            rT, steps = 65536, 10
        else:
            sizes, docs, rT, steps = [8192, 32768, 65536], [1, 16, 256], 16384, 4
            args.iters = min(args.iters, 10)
            args.compiled_cap = 32768
        if args.sizes:
            sizes = [int(x) for x in args.sizes.split(",")]
        if args.docs:
            docs = [int(x) for x in args.docs.split(",")]
        rows += build_rows(args, dev, sizes, docs)
        if args.no_extra:
            continue
        extra += inner_rows(args, dev, rT)
        # written after each part: the first H200 run lost its JSON to a timeout at the end
        harness.write_json("block_mask", args, {"rows": rows, "inner_rows": extra,
                                               "recompiles": recompiles}, device=args.device)  # fmt: skip
        if dev.type == "cuda":  # recompiles are a GPU concern (CPU compiles take minutes)
            recompiles += recompile_rows(args, dev, rT, steps)

    cols = ["device", "tokens", "episodes", "mask", "ours ms", "ours compiled ms",
            "ours cuda_graph ms", "ours syncs", "ours compiled syncs", "ours cuda_graph syncs",
            "ours cuda_graph same tables", "cbm eager ms", "cbm compiled ms",
            "cbm compiled, library mod ms", "speedup vs compiled", "speedup vs eager",
            "same tiles"]  # fmt: skip
    print(harness.markdown_table(rows + extra, cols))
    print()
    print(harness.markdown_table(recompiles, ["device", "case", "builder", "steps",
                                             "graphs after step 0", "errors"]))  # fmt: skip
    harness.write_json(
        "block_mask",
        args,
        {"rows": rows, "inner_rows": extra, "recompiles": recompiles},
        device=args.device,
    )


if __name__ == "__main__":
    main()
