"""Decode-only steps eager against replayed CUDA graphs (stages/cuda_graphs.py), on one worker.

    PYTHONPATH=. python3 benchmarks/cuda_graphs.py                       # LLaMA-7B, bf16, context 512
    PYTHONPATH=. python3 benchmarks/cuda_graphs.py --decodes 1,4,16,64 --json out.json

Each B: a decode-only step of B decodes at ``--context`` keys, as the worker runs it (its metadata
built, then the layers), eagerly and through DecodeGraphs (captured at the first step of its
shape, outside the timing); CUDA events around each call (a host-bound step's events are as far
apart as its wall time), median of ``--rounds``; and the largest difference of the two outputs.
A decode-only step of LLaMA-7B took 12.6-13.1 ms eagerly on an H200 at every B from 4 to 64,
~3 ms of it the weights' stream (docs/BENCHMARKS.md, "The second GPU run").
"""
from __future__ import annotations

import argparse
import json
import random

import torch

from benchmarks.cuda_paged_decode import timed

from pp_runtime.batch import SeqChunk
from stages.attention import build_metadata
from stages.cuda_graphs import DecodeGraphs
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

            diff = (eager().float() - replayed().float()).abs().max().item()
            row = {"eager_ms": timed(eager, a.rounds), "graph_ms": timed(replayed, a.rounds), "max_diff": diff}
            row["speedup"] = row["eager_ms"] / row["graph_ms"]
            out["by_batch"][str(b)] = row
            print(f"B = {b:3d}: eager {row['eager_ms']:7.2f} ms   graph {row['graph_ms']:7.2f} ms   "
                  f"x{row['speedup']:.2f}   max |diff| {diff:.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
