#!/usr/bin/env bash
# Issue 8's GPU checks as one device call (docs/BENCHMARKS.md, "Utilisation of the decode-maximal
# batch"): the Table-2 ratio and MFU of LLaMA-7B-shaped random weights in bf16 with each attention
# backend, for a chunk after cached context and with an fp8 K/V cache, the decode kernel alone, the
# host's cost of a launch, then the CUDA tests. Run from the repository root on a CUDA machine:
#
#   bash scripts/gpu_checks.sh            # figures and logs under $OUT (default /tmp/gpu_checks)
#
# ~5-7 minutes on an H200 (277 s with CHUNKS=512,2048 in the fourth GPU run, before the cached-chunk
# step; each 7B model is drawn on the host in ~45 s): give the device call timeout_s 600. At most 8
# files come back from a device call: keep it so. xformers may be carried as a wheel in
# .whl/ (the GPU image has none); each step has its own timeout, so one that fails or hangs leaves
# the others' figures.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_checks}
failed=""
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:.
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -c "import xformers, xformers.ops; print('xformers', xformers.__version__)" 2>&1 | tail -1
# norms, RoPE, SiLU·mul and the K/V write as one Triton kernel each (fused against torch's eager ops
# was the twentieth session's pair: ELEMENTWISE=fused,eager), decodes' K/V read in place (paged
# against gathered was the eighth session's: CUDA_DECODE=paged,gathered);
# xformers, where it imports, fails in a second if its wheel has no operator for this torch (it
# says so, and the script exits 1), else runs the same
timeout 300 python3 benchmarks/decode_maximal.py --model llama-7b --device cuda --dtype bfloat16 \
    --attention torch --chunk "${CHUNKS:-512,1024,2048}" --cuda-decode "${CUDA_DECODE:-paged}" \
    --cuda-elementwise "${ELEMENTWISE:-fused}" --decodes 4,16,32,64 \
    --context 512 --rounds 10 --threads 4 --profile 3 --json "$OUT/dm_7b_torch.json" 2>&1 | tee "$OUT/dm_7b_torch.log" \
    || failed+=" decode_maximal(torch)"
if python3 -c "import xformers.ops" 2>/dev/null; then  # the image has none: carry a wheel built for its torch
    timeout 200 python3 benchmarks/decode_maximal.py --model llama-7b --device cuda --dtype bfloat16 \
        --attention xformers --chunk 512 --decodes 4,16,32,64 --context 512 --rounds 10 --threads 4 \
        --json "$OUT/dm_7b_xformers.json" 2>&1 | tee "$OUT/dm_7b_xformers.log" || failed+=" decode_maximal(xformers)"
else
    echo "gpu_checks: xformers does not import here; its decode_maximal run skipped"
fi
# a later chunk of a long prompt (after 512 cached tokens of its own), the state of most chunks in
# serving: its attention passes SDPA torch's bottom-right causal bias (flash), where an explicit
# (n, ctx) mask ran before, and the math path with GQA (unmeasured on a GPU when it was changed)
timeout 150 python3 benchmarks/decode_maximal.py --model llama-7b --device cuda --dtype bfloat16 \
    --attention torch --chunk 512,2048 --chunk-cached --decodes 4,16,32,64 --context 512 --rounds 10 --threads 4 \
    --profile 3 --json "$OUT/dm_7b_cached.json" 2>&1 | tee -a "$OUT/dm_7b_torch.log" || failed+=" decode_maximal(cached)"
timeout 120 python3 benchmarks/cuda_paged_decode.py 2>&1 | tee "$OUT/paged_decode.log" || failed+=" cuda_paged_decode"
# an fp8 K/V cache (--kv-cache-dtype fp8): the decode kernel reads half the bytes of a bf16 cache;
# the profile shows whether a fresh chunk's K/V round trip still runs as torch's elementwise
# kernels (5.3 ms of the 2048 step in the third GPU run, before write_kv_'s keep rows)
timeout 240 python3 benchmarks/decode_maximal.py --model llama-7b --device cuda --dtype bfloat16 \
    --attention torch --kv-cache-dtype fp8 --chunk 512,2048 --cuda-decode "${CUDA_DECODE:-paged}" \
    --decodes 4,16,32,64 --context 512 --rounds 10 \
    --threads 4 --profile 3 --json "$OUT/dm_7b_fp8.json" 2>&1 | tee "$OUT/dm_7b_fp8.log" || failed+=" decode_maximal(fp8)"
timeout 60 python3 benchmarks/cuda_paged_decode.py --kv-dtype float8_e4m3fn 2>&1 | sed "s/^/fp8 /" \
    | tee -a "$OUT/paged_decode.log" || failed+=" cuda_paged_decode(fp8)"
# what a decode-only step is bound by: the host's cost of one launch, torch op against Triton
# kernel; then decode-only steps eager against replayed CUDA graphs (--cuda-graphs)
timeout 90 python3 benchmarks/cuda_launch_overhead.py 2>&1 | tee "$OUT/host.log" \
    || failed+=" cuda_launch_overhead"
timeout 150 python3 benchmarks/cuda_graphs.py 2>&1 | tee -a "$OUT/host.log" || failed+=" cuda_graphs"
# sampled rows: the per-row sampler (a host read a row) against every row at once (one a batch)
timeout 60 python3 -m stages.batched_sampler 2>&1 | tee -a "$OUT/host.log" || failed+=" batched_sampler"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/launch/test_gpu.py tests/stages/test_triton_decode.py tests/stages/test_cuda_graphs.py \
    tests/stages/test_triton_elementwise.py tests/stages/test_sampler.py \
    tests/stages/test_attention.py tests/benchmarks/test_decode_maximal.py tests/benchmarks/test_cuda_benchmarks.py 2>&1 | tee "$OUT/pytest_gpu.log" || failed+=" pytest"
if [ -n "$failed" ]; then echo "gpu_checks: failed:$failed"; exit 1; fi
echo "gpu_checks: all steps ran"
