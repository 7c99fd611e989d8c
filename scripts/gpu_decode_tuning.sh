#!/usr/bin/env bash
# The CUDA paged decode kernel's tuning sweep as one device call (docs/BENCHMARKS.md, "Tuning the
# paged decode kernel"): every variant of benchmarks/cuda_paged_decode.py alone at four shapes of
# LLaMA-7B's heads, then the fastest variant at 64 × 512 against the defaults inside the
# decode-maximal step, then the kernel's CUDA tests. Run from the repository root on a CUDA machine:
#
#   bash scripts/gpu_decode_tuning.sh     # figures and logs under $OUT (default /tmp/gpu_decode_tuning)
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_decode_tuning}
failed=""
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
# decodes × context: the decode-maximal step's 64 × 512, then fewer decodes at longer contexts
# (fewer (decode, KV head) programs than the H200's 132 SMs at 4: where spans should pay)
for shape in 64x512 16x2048 4x4096 4x512; do
    timeout 120 python3 benchmarks/cuda_paged_decode.py --decodes "${shape%x*}" --context "${shape#*x}" \
        --json "$OUT/pd_$shape.json" 2>&1 | sed "s/^/$shape /" | tee -a "$OUT/pd.log" || failed+=" cuda_paged_decode($shape)"
done
# the fastest tuning at 64 × 512 as decode_maximal's --cuda-decode spelling (paged:KEY=VALUE...)
best=$(python3 - "$OUT/pd_64x512.json" <<'PY'
import json, sys
from benchmarks.cuda_paged_decode import VARIANTS
ms = json.load(open(sys.argv[1]))["ms"]
name = min((k for k in VARIANTS if k in ms and "aligned" not in VARIANTS[k]), key=ms.get)
print(":".join(["paged", *(f"{k}={v}" for k, v in VARIANTS[name].items())]))
PY
) || best=paged
echo "fastest at 64x512: $best" | tee -a "$OUT/pd.log"
timeout 240 python3 benchmarks/decode_maximal.py --model llama-7b --device cuda --dtype bfloat16 --attention torch \
    --chunk 512,2048 --cuda-decode "paged,$best" --decodes 4,16,32,64 --context 512 --rounds 10 --threads 4 \
    --json "$OUT/dm_tuned.json" 2>&1 | tee "$OUT/dm_tuned.log" || failed+=" decode_maximal"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/stages/test_triton_decode.py \
    tests/benchmarks/test_decode_maximal.py tests/benchmarks/test_cuda_benchmarks.py -k "decode" 2>&1 | tee "$OUT/pytest_gpu.log" || failed+=" pytest"
if [ -n "$failed" ]; then echo "gpu_decode_tuning: failed:$failed"; exit 1; fi
echo "gpu_decode_tuning: all steps ran"
