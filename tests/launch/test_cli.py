"""`pp-runtime generate` (DESIGN.md §3.1, §3.3): JSONL in, JSONL out in input order, bad requests
answered with an error line while the others complete; a bad command line or configuration exits
with status 2 and exactly one stderr line naming the problem, never a traceback.

Most cases call ``launch.cli.main`` in process (a subprocess costs seconds of imports); a few run
the installed console script to check what a user's shell really sees."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.cli import main
from pp_runtime import LLM, SamplingParams

SCRIPT = Path(sys.executable).with_name("pp-runtime")
FAST = ["--threads", "1", "--memory-budget-gb", "0.05"]  # tiny models: one thread is fastest (see below)



def run_main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse errors leave through sys.exit
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def run_script(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *argv], cwd=cwd, capture_output=True, text=True, timeout=300)


def assert_usage_error(rc: int, err: str, message: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("pp-runtime: error: ") and message in lines[0], lines[0]


# ---- JSONL end to end ------------------------------------------------------------------------
def request_lines() -> list[tuple[str, str | None]]:
    """(line, expected error substring or None for a good request) for a 256-token, 512-position model."""
    j = json.dumps
    return [
        (j({"id": "good1", "prompt_token_ids": [5, 6, 7], "max_tokens": 4}), None),
        (j({"id": "empty", "prompt_token_ids": []}), "empty prompt"),
        (j({"id": "neg", "prompt_token_ids": [3, -1]}), "prompt_token_ids[1] = -1 is outside the vocabulary"),
        (j({"id": "vocab", "prompt_token_ids": [256]}), "prompt_token_ids[0] = 256 is outside the vocabulary"),
        (j({"id": "good2", "prompt_token_ids": list(range(3, 60)), "max_tokens": 5, "temperature": 0.7,
            "top_p": 0.9, "top_k": 20, "seed": 4}), None),
        (j({"id": "float", "prompt_token_ids": [1, 2.5]}), "prompt_token_ids[1] = 2.5 is not an integer"),
        (j({"id": "strid", "prompt_token_ids": ["7"]}), "prompt_token_ids[0] = '7' is not an integer"),
        (j({"id": "long", "prompt_token_ids": [4] * 500, "max_tokens": 20}),
         "prompt length 500 + max_tokens 20 = 520 exceeds the model's max length 512"),
        (j({"id": "mt0", "prompt_token_ids": [4], "max_tokens": 0}), "max_tokens must be a positive integer"),
        (j({"id": "mtneg", "prompt_token_ids": [4], "max_tokens": -5}), "max_tokens must be a positive integer"),
        (j({"id": "temp", "prompt_token_ids": [4], "temperature": -0.5}), "temperature must be a finite number ≥ 0"),
        (j({"id": "topp0", "prompt_token_ids": [4], "top_p": 0}), "top_p must be in (0, 1]"),
        (j({"id": "topp2", "prompt_token_ids": [4], "top_p": 1.01}), "top_p must be in (0, 1]"),
        (j({"id": "topk", "prompt_token_ids": [4], "top_k": -2}), "top_k must be an integer ≥ 0"),
        ('{"id": "broken", "prompt_token_ids": [1,', "line 15: malformed JSON"),
        (j({"id": "unknown", "prompt_token_ids": [8, 9], "max_tokens": 3, "colour": "red"}), None),
        (j({"id": "text", "prompt": "hello"}), "has no tokenizer"),
        (j({"id": "good3", "prompt_token_ids": [10], "max_tokens": 2, "stop_token_ids": []}), None),
    ]


def test_generate_jsonl_end_to_end(hf_models: dict, tmp_path: Path) -> None:
    cases = request_lines()
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(text for text, _ in cases) + "\n")
    model = str(hf_models["llama"])
    proc = run_script(["generate", "--model", model, "--input", str(inp), "--output", str(outp),
                       "--chunk-size", "16", "--quiet", *FAST], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "warning: line 16 (unknown): ignoring unknown fields colour" in proc.stderr
    rows = [json.loads(x) for x in outp.read_text().splitlines()]
    # one output line per input line, same order, every field of §3.3
    assert [r["id"] for r in rows] == [json.loads(t)["id"] if i != 14 else "line15" for i, (t, _) in enumerate(cases)]
    for row, (text, error) in zip(rows, cases):
        assert set(row) >= {"id", "token_ids", "finish_reason", "error", "ttft_s", "latency_s"}
        if error is None:
            obj = json.loads(text)
            assert row["finish_reason"] == "length" and row["error"] is None, row
            assert len(row["token_ids"]) == obj["max_tokens"]
            assert all(0 <= t < 256 for t in row["token_ids"])
            assert row["ttft_s"] > 0 and row["latency_s"] >= row["ttft_s"]
        else:
            assert row["finish_reason"] == "error" and error in row["error"], row
            assert row["token_ids"] == []
    # the good requests got exactly what the Python API gives them alone
    good = [json.loads(t) for t, e in cases if e is None]
    with LLM(model=model, memory_budget_gb=0.05) as llm:
        outs = llm.generate([g["prompt_token_ids"] for g in good],
                            [SamplingParams(**{k: v for k, v in g.items() if k in SamplingParams.__dataclass_fields__})
                             for g in good])
    assert [o.token_ids for o in outs] == [r["token_ids"] for r in rows if r["error"] is None]


def test_generate_stdout_and_run_dir(hf_models: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt_token_ids": [1, 2], "max_tokens": 3}\n{"id": "b", "prompt_token_ids": []}\n'
                   '{"id": "c", "prompt_token_ids": [1, 2], "max_tokens": 2, "logprobs": null}\n')
    run_dir = tmp_path / "run"
    rc, out, err = run_main(["generate", "--model", str(hf_models["qwen2"]), "--input", str(inp), "--run-dir",
                             str(run_dir), "--quiet", "--chunk-budget", "tokens", "--admission", "longest_first",
                             "--logprobs", "1", *FAST], capsys)
    assert rc == 0, err
    rows = [json.loads(x) for x in out.splitlines()]
    assert [(r["id"], r["finish_reason"], len(r["token_ids"])) for r in rows] == [("a", "length", 3), ("b", "error", 0),
                                                                                   ("c", "length", 2)]
    # --logprobs is every line's default: one entry a token, the token first, then the likeliest
    assert [[e[0]["token_id"] for e in r["logprobs"]] for r in (rows[0], rows[2])] == [rows[0]["token_ids"],
                                                                                       rows[2]["token_ids"]]
    assert all(e[-1]["rank"] == 1 and len(e) in (1, 2) for r in (rows[0], rows[2]) for e in r["logprobs"])
    assert [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()] == rows
    workers = json.loads((run_dir / "workers.json").read_text())
    assert [(w["stage"], w["tp_rank"], w["device"]) for w in workers] == [(0, 0, "cpu")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["chunk_budget"] == "tokens" and summary["scheduler"] == "sarathi"
    assert summary["admission"] == "longest_first"
    assert (summary["pp"], summary["tp"], summary["chunk_size"]) == (1, 1, 256)
    assert summary["num_requests"] == 3 and summary["decode_tokens"] == 5
    assert isinstance(summary["max_batch_size"], int) and 1 <= summary["max_batch_size"] <= 64
    assert all((run_dir / f).stat().st_size > 0 for f in ("gantt.png", "bubble_cdf.png", "trace.json"))


def test_prefix_caching_flag_shares_a_system_prompt(hf_models: dict, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    system = list(range(3, 43))  # 40 tokens: two whole 16-token blocks to share
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": system + [50 + i] * (i + 1),
                                       "max_tokens": 4}) + "\n" for i in range(3)))
    out = {}
    for flag in (("--no-enable-prefix-caching",), (), ("--enable-prefix-caching",)):  # on by default
        run_dir = tmp_path / f"run{flag[0] if flag else ''}"
        # one request a micro-batch: the second prompt starts after the first one's blocks are in
        rc, text, err = run_main(["generate", "--model", str(hf_models["llama"]), "--input", str(inp), "--run-dir",
                                  str(run_dir), "--quiet", "--max-batch-size", "1", *flag, *FAST], capsys)
        assert rc == 0, err
        out[flag] = [json.loads(x)["token_ids"] for x in text.splitlines()]
        summary = json.loads((run_dir / "summary.json").read_text())
        on = flag != ("--no-enable-prefix-caching",)
        # the setting (None: each worker decides, vLLM's default) and what each worker does
        assert summary["enable_prefix_caching"] == on and summary["cuda_graphs"] is None
        workers = json.loads((run_dir / "workers.json").read_text())
        assert [w["cuda_graphs"] for w in workers] == [False]
        assert summary["prefix_cache_hit_tokens"] == (2 * 32 if on else 0)
    assert out[()] == out[("--enable-prefix-caching",)] == out[("--no-enable-prefix-caching",)]


def test_verbose_run_prints_memory_plan(hf_models: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt_token_ids": [1, 2], "max_tokens": 2}\n')
    rc, out, err = run_main(["generate", "--model", str(hf_models["llama"]), "--input", str(inp), *FAST], capsys)
    assert rc == 0 and "B = ⌊(M_G − M_S)/(L·m_kv)⌋" in err
    assert "kv admission optimistic: a request starts once its prompt fits the free blocks; the newest is " \
        "preempted when blocks run out; at most 64 a micro-batch, 64 running" in err
    assert json.loads(out)["finish_reason"] == "length"
    assert "--matmul-precision" not in err


def test_step_costs_fit_prints_the_costs_to_reuse(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """--step-costs fit measures at start-up and prints the values in the form the flag takes;
    the run directory records them."""
    from pp_runtime import calibration
    monkeypatch.setattr(calibration, "fit_step_costs", lambda samples: (5.31e-4, 0.5234, 0.003125))
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt_token_ids": [1, 2], "max_tokens": 2}\n')
    rc, out, err = run_main(["generate", "--model", "llama-tiny", "--pp", "2", "--launcher", "local", "--input",
                             str(inp), "--step-costs", "fit", "--run-dir", str(tmp_path / "run"), *FAST], capsys)
    assert rc == 0, err
    assert "--step-costs 0.000531,0.523,0.00313 reuses them" in err and "fitting step costs on" in err
    assert json.loads(out)["finish_reason"] == "length"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step_costs"] == [5.31e-4, 0.5234, 0.003125] and summary["num_requests"] == 1


@pytest.mark.parametrize("precision", ["medium", "int8"])
def test_a_precision_that_changes_nothing_says_so(precision: str, hf_models: dict, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    """An HF folder's fp32 weights take no int8 products (they are for GGUF blocks), nor bf16 ones
    on a CPU without AVX512-BF16: the run goes on as "highest" and one line says so."""
    from stages import cpu_kernels
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt_token_ids": [1, 2], "max_tokens": 2}\n')
    rc, out, err = run_main(["generate", "--model", str(hf_models["llama"]), "--input", str(inp),
                             "--matmul-precision", precision, *FAST], capsys)
    assert rc == 0 and json.loads(out)["finish_reason"] == "length"
    took = precision == "medium" and cpu_kernels.bf16_products()
    line = f"pp-runtime: --matmul-precision {precision} changes no product here"
    assert (line in err) != took


# ---- bad command lines and configurations ----------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A well-formed GGUF file of an architecture we do not run."""
    import gguf
    import numpy as np
    path = tmp_path_factory.mktemp("gguf") / "tiny-gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt_token_ids": [1, 2, 3], "max_tokens": 2}\n')
    return f


BAD_CONFIGS = {  # name: (extra arguments, message); {llama} {gguf} {dir} {missing} are filled in below
    "unknown_flag": (["--model", "{llama}", "--bogus"], "unrecognized arguments: --bogus"),
    "chunk_0": (["--model", "{llama}", "--chunk-size", "0"], "argument --chunk-size: must be > 0, got 0"),
    "chunk_text": (["--model", "{llama}", "--chunk-size", "big"], "argument --chunk-size: expected an integer"),
    "batch_0": (["--model", "{llama}", "--max-batch-size", "0"], "argument --max-batch-size: must be > 0, got 0"),
    "pp_too_big": (["--model", "{llama}", "--pp", "5"], "pp=5 exceeds the model's num_layers=4"),
    "tp_heads": (["--model", "{llama}", "--tp", "3"], "tp=3 does not divide the model's num_heads=4"),
    "tp_local": (["--model", "{llama}", "--tp", "2", "--launcher", "local"],
                 "the local launcher runs tp=1 only"),
    "bad_scheduler": (["--model", "{llama}", "--scheduler", "fifo"], "argument --scheduler: invalid choice"),
    "partition": (["--model", "{llama}", "--pp", "2", "--partition", "3,3"],
                  "partition [3, 3] sums to 6, model has 4 layers"),
    "partition_text": (["--model", "{llama}", "--partition", "a,b"], "--partition must be comma-separated"),
    "partition_float_text": (["--model", "{llama}", "--pp", "2", "--partition", "3.0,2.0"],
                             "partition [3, 2] sums to 5, model has 4 layers"),
    "partition_third": (["--model", "{llama}", "--pp", "2", "--partition", "2.25,1.75"],
                        "partition entries must be positive multiples of 0.5"),
    "partition_half_sum": (["--model", "{llama}", "--pp", "2", "--partition", "2.5,2"],
                           "partition [2.5, 2] sums to 4.5, model has 4 layers"),
    "kv_dtype": (["--model", "{llama}", "--kv-cache-dtype", "int8"], "argument --kv-cache-dtype: invalid choice"),
    "cuda_graphs_on_cpu": (["--model", "{llama}", "--cuda-graphs"], "DeviceConfig.cuda_graphs needs device cuda, got 'cpu'"),
    "kv_fp16_on_bf16": (["--model", "{llama}", "--dtype", "bfloat16", "--kv-cache-dtype", "float16"],
                        "kv_cache_dtype float16 is for float32 models on CPU"),
    "kv_fp8_on_bf16": (["--model", "{llama}", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8"],
                       "kv_cache_dtype fp8 is for float32 models on CPU"),
    "chunk_budget": (["--model", "{llama}", "--chunk-budget", "bytes"], "argument --chunk-budget: invalid choice"),
    "admission": (["--model", "{llama}", "--admission", "lifo"], "argument --admission: invalid choice"),
    "step_costs": (["--model", "{llama}", "--step-costs", "1e-3,0.5"], "argument --step-costs: expected 'fit' or 3"),
    "step_costs_negative": (["--model", "{llama}", "--step-costs", "1e-3,-0.5,0"],
                            "argument --step-costs: expected 'fit' or 3 numbers ≥ 0"),
    "matmul_precision": (["--model", "{llama}", "--matmul-precision", "low"],
                         "argument --matmul-precision: invalid choice"),
    "matmul_medium_on_bf16": (["--model", "{llama}", "--dtype", "bfloat16", "--matmul-precision", "medium"],
                              "matmul_precision medium is for float32 models on CPU"),
    "matmul_int8_on_bf16": (["--model", "{llama}", "--dtype", "bfloat16", "--matmul-precision", "int8"],
                            "matmul_precision int8 is for float32 models on CPU"),
    "missing_model": (["--model", "{missing}"], "not found"),
    "not_a_model": (["--model", "{dir}"], "is not a model"),
    "gguf_arch": (["--model", "{gguf}"], "GGUF architecture 'gpt2'"),
    "cuda": (["--model", "{llama}", "--device", "cuda"], "--device cuda requested but no CUDA GPU is available"),
    "budget_tiny": (["--model", "{llama}", "--memory-budget-gb", "0.0001"], "memory budget too small"),
    "budget_0": (["--model", "{llama}", "--memory-budget-gb", "0"], "argument --memory-budget-gb: must be"),
    "threads": (["--model", "{llama}", "--threads", "-1"], "argument --threads: must be ≥ 0"),
    "top_p": (["--model", "{llama}", "--top-p", "0"], "--top-p must be in (0, 1]"),
    "temperature": (["--model", "{llama}", "--temperature", "-1"], "--temperature must be a finite number ≥ 0"),
    "temperature_inf": (["--model", "{llama}", "--temperature", "inf"], "--temperature must be a finite number"),
    "max_tokens": (["--model", "{llama}", "--max-tokens", "0"], "argument --max-tokens: must be > 0"),
    "logprobs": (["--model", "{llama}", "--logprobs", "21"], "--logprobs must be an integer in [0, 20]"),
    "min_tokens": (["--model", "{llama}", "--min-tokens", "65"], "--min-tokens must be an integer in [0, max_tokens=64]"),
    "repetition_penalty": (["--model", "{llama}", "--repetition-penalty", "0"],
                           "--repetition-penalty must be a number > 0 (1: off), got 0.0"),
    "presence_penalty": (["--model", "{llama}", "--presence-penalty", "3"], "--presence-penalty must be a number in [-2, 2]"),
    "output_dir_missing": (["--model", "{llama}", "--output", "{missing}/out.jsonl"], "does not exist"),
    "output_is_dir": (["--model", "{llama}", "--output", "{dir}"], "is a directory"),
    "max_model_len_over": (["--model", "{llama}", "--max-model-len", "5000"],
                           "max_model_len=5000 exceeds the model's 512 positions"),
    "corrupt_safetensors": (["--model", "{junk}"], "model.safetensors is not a readable safetensors file"),
}


def fill(args: list[str], paths: dict[str, str]) -> list[str]:
    return [a.format(**paths) for a in args]


@pytest.mark.parametrize("name", BAD_CONFIGS)
def test_bad_configuration(name: str, hf_models: dict, gpt2_gguf: Path, jsonl: Path, tmp_path: Path,
                           capsys: pytest.CaptureFixture) -> None:
    if name == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    args, message = BAD_CONFIGS[name]
    (tmp_path / "not_a_model").mkdir()
    junk = tmp_path / "junk"  # a real config.json beside a safetensors file that is not one
    junk.mkdir()
    (junk / "config.json").write_bytes((hf_models["llama"] / "config.json").read_bytes())
    (junk / "model.safetensors").write_bytes(b"\xff" * 1024)
    paths = {"llama": str(hf_models["llama"]), "gguf": str(gpt2_gguf), "dir": str(tmp_path / "not_a_model"),
             "missing": str(tmp_path / "missing"), "junk": str(junk)}
    rc, out, err = run_main(["generate", "--input", str(jsonl), *fill(args, paths)], capsys)
    assert_usage_error(rc, err, message)
    assert out == ""


@pytest.mark.parametrize("args, message", [
    ([], "give either --input FILE or --prompt TEXT"),
    (["--input", "{missing}"], "no such file"),
    (["--input", "{dir}"], "not a file"),
    (["--input", "{jsonl}", "--prompt", "hi"], "give either --input FILE or --prompt TEXT"),
    (["--input", "{jsonl}", "--chat"], "--chat applies to --prompt texts"),
    (["--prompt", "hello"], "has no tokenizer"),  # random HF model folder: no tokenizer files
])
def test_bad_inputs(args: list[str], message: str, hf_models: dict, jsonl: Path, tmp_path: Path,
                    capsys: pytest.CaptureFixture) -> None:
    paths = {"missing": str(tmp_path / "missing.jsonl"), "dir": str(tmp_path), "jsonl": str(jsonl)}
    rc, out, err = run_main(["generate", "--model", str(hf_models["llama"]), *FAST, *fill(args, paths)], capsys)
    assert_usage_error(rc, err, message)


@pytest.mark.parametrize("file, content, message", [
    ("config.json", "[1, 2]", "config.json must hold a JSON object, got a list"),
    ("tokenizer.json", "{not json", "tokenizer.json could not be read as a tokenizer"),
    ("tokenizer_config.json", "{not json", "tokenizer_config.json is not valid JSON"),
])
def test_broken_model_files_are_one_line(file: str, content: str, message: str, hf_models: dict, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(hf_models["llama"], folder)
    if file == "tokenizer_config.json":  # read only beside a tokenizer.json
        (folder / "tokenizer.json").write_text("{}")
    (folder / file).write_text(content)
    rc, out, err = run_main(["generate", "--model", str(folder), "--prompt", "hello", *FAST], capsys)
    assert_usage_error(rc, err, message)


def test_input_from_stdin_and_unwritable_output(hf_models: dict, jsonl: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """--input - reads standard input; an --output that fails at the end (full disk, path gone)
    still gives the run's results, on stdout, and one line naming the flag."""
    import io

    import pp_runtime.jsonl
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(jsonl.read_bytes())))
    rc, out, err = run_main(["generate", "--model", str(hf_models["llama"]), *FAST, "--input", "-"], capsys)
    assert rc == 0 and json.loads(out)["finish_reason"] == "length"
    monkeypatch.chdir(tmp_path)  # --output - is standard output too, not a file named "-"
    rc, out, err = run_main(["generate", "--model", str(hf_models["llama"]), *FAST, "--input", str(jsonl),
                             "--output", "-"], capsys)
    assert rc == 0 and json.loads(out)["finish_reason"] == "length" and not (tmp_path / "-").exists()

    def full_disk(path: str, rows: list[dict]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pp_runtime.jsonl, "write_results", full_disk)
    rc, out, err = run_main(["generate", "--model", str(hf_models["llama"]), *FAST, "--quiet", "--input", str(jsonl),
                             "--output", str(tmp_path / "out.jsonl")], capsys)
    assert_usage_error(rc, err, "--output")
    assert "No space left on device" in err and json.loads(out)["finish_reason"] == "length"


def test_unwritable_run_dir_keeps_the_results(hf_models: dict, jsonl: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A run directory that fails at the end (full disk, a worker gone before its timings were
    read) is written after the results: --output still gets them, and one line names --run-dir."""
    import pp_runtime.rundir

    def full_disk(run_dir: str, llm: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pp_runtime.rundir, "write_run_dir", full_disk)
    out_file = tmp_path / "out.jsonl"
    rc, out, err = run_main(["generate", "--model", str(hf_models["llama"]), *FAST, "--quiet", "--input", str(jsonl),
                             "--output", str(out_file), "--run-dir", str(tmp_path / "run")], capsys)
    assert_usage_error(rc, err, "--run-dir")
    assert "No space left on device" in err and "results were written" in err
    assert json.loads(out_file.read_text())["finish_reason"] == "length"
    # the plots come last: one that cannot be drawn keeps the results and the run's files
    import pp_runtime.report
    monkeypatch.undo()
    monkeypatch.setattr(pp_runtime.report, "make_report", lambda dirs: full_disk(dirs[0], None))
    out_file.unlink()
    rc, out, err = run_main(["generate", "--model", str(hf_models["llama"]), *FAST, "--quiet", "--input", str(jsonl),
                             "--output", str(out_file), "--run-dir", str(tmp_path / "run")], capsys)
    assert_usage_error(rc, err, "--run-dir")
    assert "plots not written (No space left on device)" in err
    assert json.loads(out_file.read_text())["finish_reason"] == "length"
    assert (tmp_path / "run" / "summary.json").is_file() and not (tmp_path / "run" / "gantt.png").exists()


def test_quiet_ray_run_prints_nothing_but_its_results(hf_models: dict, jsonl: Path, tmp_path: Path) -> None:
    """--quiet under Ray: no progress, and none of Ray's start-up lines either."""
    proc = run_script(["generate", "--model", str(hf_models["llama"]), *FAST, "--quiet", "--input", str(jsonl),
                       "--pp", "2", "--launcher", "ray"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["finish_reason"] == "length"
    assert not [line for line in proc.stderr.splitlines() if "ray" in line.lower() or "generate" in line], proc.stderr


def test_worker_death_outside_a_run_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    """A worker that dies while starting (no run to report it in) exits 1 with one line naming it."""
    import launch.cli
    from pp_runtime.executor import WorkerError

    def dies(args: object) -> int:
        raise WorkerError("stage 1 (tp rank 0) on node 127.0.0.1 died\nwhile loading its weights")

    monkeypatch.setattr(launch.cli, "cmd_generate", dies)
    rc, out, err = run_main(["generate", "--prompt", "hi"], capsys)
    assert rc == 1 and out == ""
    assert err.splitlines() == ["pp-runtime: error: stage 1 (tp rank 0) on node 127.0.0.1 died while loading its weights"]


def test_unreachable_ray_address_fails_fast() -> None:
    """ray.init retries an unreachable GCS forever: a host:port that refuses is one clear error."""
    from launch.ray_cluster import _check_reachable
    with pytest.raises(ValueError, match="RAY_ADDRESS=127.0.0.1:1: no Ray cluster answers there"):
        _check_reachable("127.0.0.1:1")
    for other in ("auto", "ray://127.0.0.1:1", "http://127.0.0.1:1"):  # forms ray.init fails on itself
        _check_reachable(other)


def test_no_command(capsys: pytest.CaptureFixture) -> None:
    rc, _, err = run_main([], capsys)
    assert_usage_error(rc, err, "required")


def test_console_script_usage_errors(hf_models: dict, jsonl: Path, tmp_path: Path) -> None:
    """What the shell sees: status 2, one stderr line, for a parse error and for a model check."""
    p = run_script(["generate", "--input", str(jsonl), "--chunk-size", "0"], tmp_path)
    assert_usage_error(p.returncode, p.stderr, "argument --chunk-size: must be > 0, got 0")
    p = run_script(["generate", "--input", str(jsonl), "--model", str(hf_models["llama"]), "--pp", "9"], tmp_path)
    assert_usage_error(p.returncode, p.stderr, "pp=9 exceeds the model's num_layers=4")
    assert p.stdout == ""


# ---- text prompts on a model folder with its own tokenizer -------------------------------------
CHAT_TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }} {{ m['content'] }} {{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant{% endif %}")


@pytest.fixture(scope="module")
def tok_model(hf_models: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random LLaMA folder plus a word-level tokenizer that, like LLaMA's, prepends <s>."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    folder = tmp_path_factory.mktemp("tok_model") / "llama"
    shutil.copytree(hf_models["llama"], folder)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 250)] + ["user", "assistant", "hello", "world"]
    vocab = {w: i for i, w in enumerate(words)} | {"huge": 300}  # an id the model does not have
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])  # matched whole in chat-template text
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}))
    return folder


def test_text_prompts_use_the_folder_tokenizer(tok_model: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    from pp_runtime.tokenizer import load_tokenizer
    tok = load_tokenizer("hf", str(tok_model))
    assert tok.encode("hello world w7") == [1, 252, 253, 7]  # <s> first, as transformers would add it
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat == [1, 250, 252, 2, 1, 251]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with LLM(model=str(tok_model), memory_budget_gb=0.05) as llm:
        plain, chatted = llm.generate([tok.encode("hello world w7"), chat], params)
        assert llm.generate(["hello world w7"], params)[0].token_ids == plain.token_ids  # text via the API

    # --prompt: printed as text, one line per prompt
    base = ["generate", "--model", str(tok_model), "--max-tokens", "5", "--quiet", *FAST]
    rc, out, err = run_main([*base, "--prompt", "hello world w7", "--prompt", "hello huge"], capsys)
    assert rc == 0, err
    assert out.splitlines() == [tok.decode_output(plain.token_ids),
                                "error: prompt_token_ids[2] = 300 is outside the vocabulary [0, 256)"]
    rc, out, err = run_main([*base, "--chat", "--prompt", "hello"], capsys)
    assert rc == 0 and out.splitlines() == [tok.decode_output(chatted.token_ids)]
    # --prompt with --output: JSONL rows that also carry the text
    rc, out, err = run_main([*base, "--prompt", "hello world w7", "--output", str(tmp_path / "o.jsonl")], capsys)
    row = json.loads((tmp_path / "o.jsonl").read_text())
    assert rc == 0 and out == "" and row["token_ids"] == plain.token_ids and row["text"] == tok.decode_output(plain.token_ids)

    # JSONL "prompt" text: the same tokens as the ids it encodes to
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "text", "prompt": "hello world w7", "max_tokens": 5}) + "\n" +
                   json.dumps({"id": "ids", "prompt_token_ids": [1, 252, 253, 7], "max_tokens": 5}) + "\n")
    rc, out, err = run_main(["generate", "--model", str(tok_model), "--input", str(inp), "--quiet", *FAST,
                             "--run-dir", str(tmp_path / "run")], capsys)
    rows = [json.loads(x) for x in out.splitlines()]
    assert rc == 0 and [r["token_ids"] for r in rows] == [plain.token_ids] * 2
    assert rows[0]["text"] == tok.decode_output(plain.token_ids) and "text" not in rows[1]  # text in, text out
    assert [json.loads(x) for x in (tmp_path / "run" / "results.jsonl").read_text().splitlines()] == rows


def test_n_samples_each_prompt(tok_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--n (and a JSONL line's "n"): every sample comes out, --prompt texts one line each, a JSONL
    row's "outputs" in sample order (its own fields the first's, sample i seeded seed + i); a
    greedy n > 1 is a usage error for the flag and an error line for a JSONL line."""
    sampled = SamplingParams(n=3, temperature=0.8, max_tokens=5)
    with LLM(model=str(tok_model), memory_budget_gb=0.05, threads=1) as llm:
        texts = [c.text for c in llm.generate(["hello world w7"], sampled)[0].outputs]
        seeded = [llm.generate([[1, 252, 253, 7]], SamplingParams(temperature=0.8, max_tokens=5, seed=s))[0]
                  for s in (9, 10)]
    assert len(set(texts)) == 3
    base = ["generate", "--model", str(tok_model), "--max-tokens", "5", "--quiet", *FAST]
    rc, out, err = run_main([*base, "--n", "3", "--temperature", "0.8", "--prompt", "hello world w7"], capsys)
    assert rc == 0 and out.splitlines() == texts, err
    rc, out, err = run_main([*base, "--n", "2", "--prompt", "hello"], capsys)
    assert_usage_error(rc, err, "--n must be 1 when sampling is greedy (temperature 0), got n=2")

    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "s", "prompt_token_ids": [1, 252, 253, 7], "n": 2, "temperature": 0.8,
                               "seed": 9}) + "\n" +
                   json.dumps({"id": "g", "prompt_token_ids": [1, 252], "n": 2}) + "\n")
    rc, out, err = run_main([*base, "--input", str(inp), "--run-dir", str(tmp_path / "run")], capsys)
    rows = [json.loads(x) for x in out.splitlines()]
    assert rc == 0 and [[o["index"] for o in rows[0]["outputs"]]] == [[0, 1]]
    assert [o["token_ids"] for o in rows[0]["outputs"]] == [o.token_ids for o in seeded]
    assert rows[0]["token_ids"] == seeded[0].token_ids and rows[0]["finish_reason"] == seeded[0].finish_reason
    assert rows[1]["finish_reason"] == "error" and "outputs" not in rows[1]
    assert rows[1]["error"] == "line 2: n must be 1 when sampling is greedy (temperature 0), got n=2"
    assert [json.loads(x) for x in (tmp_path / "run" / "results.jsonl").read_text().splitlines()] == rows


def test_chat_template_helpers(tok_model: Path) -> None:
    """transformers' template helpers exist: raise_exception (an error line for --chat) and tojson."""
    from pp_runtime.tokenizer import load_tokenizer
    tok = load_tokenizer("hf", str(tok_model))
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    with pytest.raises(ValueError, match="^chat template: user first$"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    tok.chat_template = "{{ messages[0] | tojson }}"
    assert tok.apply_chat_template([{"role": "user", "content": "<w5>"}]) == tok.encode(
        '{"role": "user", "content": "<w5>"}', add_special_tokens=False)  # not HTML-escaped


@pytest.mark.parametrize("flag, want", (((), None), (("--cuda-graphs",), True), (("--no-cuda-graphs",), False)))
def test_cuda_graphs_flag_defaults_to_the_workers_choice(flag: tuple[str, ...], want: bool | None) -> None:
    """No flag: None (each worker replays on CUDA at tp 1, vLLM's default); --no-cuda-graphs:
    every step eager, as vLLM's --enforce-eager."""
    from launch.parser import build_parser, engine_kwargs
    a = build_parser().parse_args(["generate", "--model", "m", "--prompt", "hi", *flag])
    assert engine_kwargs(a)["cuda_graphs"] is want
