"""Decode-only steps eager against replayed CUDA graphs (stages/cuda_graphs.py), on one worker.

    PYTHONPATH=. python3 benchmarks/cuda_graphs.py                       # LLaMA-7B, bf16, context 512
    PYTHONPATH=. python3 benchmarks/cuda_graphs.py --decodes 1,4,16,64 --json out.json

Each B: a decode-only step of B decodes at ``--context`` keys, as the worker runs it (its metadata
built, then the layers), eagerly and through DecodeGraphs (captured at the first step of its
shape, outside the timing); CUDA events around each call (a host-bound step's events are as far
apart as its wall time), median of ``--rounds``; and the largest difference of the two outputs,
relative to the eager output's largest value. A replay's tables are as wide as its shape's (a
power of two of blocks), and the decode kernel picks its key spans from that width, so its sums
run in another order than the eager step's: through 32 layers of random weights in bf16 that
moved outputs by up to 2.0 (first H200 run). The last column is the replay against an eager step
over tables padded to the same width, which runs the same kernels: it must be 0, else the
capture (not rounding) is wrong.
A decode-only step of LLaMA-7B took 12.6-13.1 ms eagerly on an H200 at every B from 4 to 64,
~3 ms of it the weights' stream (docs/BENCHMARKS.md, "The second GPU run").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random

import torch

from benchmarks.cuda_paged_decode import timed

from pp_runtime.batch import SeqChunk
from stages.attention import build_metadata
from stages.cuda_graphs import DecodeGraphs, padded
from stages.profile import build_worker, fill_cache

BS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--decodes", default="1,4,16,32,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_graphs: needs a CUDA device")
    sizes = [int(b) for b in a.decodes.split(",")]
    w = build_worker(a.model, "cuda", a.dtype, "torch", block_size=BS)
    nb = -(-(a.context + 1) // BS)
    w.allocate_cache(max(sizes) * nb + 1)  # the last block: the padding rows' scratch
    fill_cache(w)
    graphs = DecodeGraphs(w.model, w.kv_caches, max(sizes) * nb, BS, None, w.dtype, capture=True)
    rng, vocab = random.Random(0), w.spec.source.config.vocab_size
    out = {"device": torch.cuda.get_device_name(), **vars(a), "by_batch": {}}
    with torch.inference_mode():
        for b in sizes:
            chunks = tuple(SeqChunk(j, a.context, (rng.randrange(vocab),), tuple(range(j * nb, (j + 1) * nb)), False,
                                    None) for j in range(b))
            ids = torch.tensor([c.token_ids[0] for c in chunks], device=w.device)

            def eager() -> torch.Tensor:
                return w.model(ids, build_metadata(chunks, BS, w.device), w.kv_caches)

            def replayed() -> torch.Tensor:
                return graphs.run(ids, build_metadata(chunks, BS, w.device))

            want, got = eager().float(), replayed().float()
            diff = (want - got).abs().max().item()
            rel = diff / max(want.abs().max().item(), 1e-30)
            same = None  # a step padding rows join runs other products than any eager step
            if padded(b) == b:
                wide_out = w.model(ids, wide(build_metadata(chunks, BS, w.device), graphs), w.kv_caches)
                same = (got - wide_out.float()).abs().max().item()
            row = {"eager_ms": timed(eager, a.rounds), "graph_ms": timed(replayed, a.rounds), "max_diff": diff,
                   "rel_diff": rel, "diff_same_width": same}
            row["speedup"] = row["eager_ms"] / row["graph_ms"]
            out["by_batch"][str(b)] = row
            print(f"B = {b:3d}: eager {row['eager_ms']:7.2f} ms   graph {row['graph_ms']:7.2f} ms   "
                  f"x{row['speedup']:.2f}   max |diff| {diff:.2e} ({rel:.1e} of max |out|)   "
                  f"vs eager at the graph's width {'—' if same is None else f'{same:.2e}'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


def wide(meta: object, graphs: DecodeGraphs) -> object:
    """The eager step's metadata with its tables padded (scratch block) to the replay's width:
    the decode kernel then picks the replay's spans. Only for steps no padding rows join."""
    width = graphs.shape(meta)[1]
    tables = meta.decode_tables
    pad = torch.full((tables.shape[0], width - tables.shape[1]), graphs.scratch, dtype=tables.dtype,
                     device=tables.device)
    keys = torch.arange(width * meta.block_size, device=tables.device)
    lens = torch.tensor(meta.ctx_lens, device=tables.device)
    return dataclasses.replace(meta, decode_tables=torch.cat([tables, pad], 1), decode_mask=keys < lens[:, None],
                               backend_cache={})


if __name__ == "__main__":
    main()
