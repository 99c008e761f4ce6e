"""The `pdcluster` CLI: help everywhere, torch-free parsing, clean errors, handler wiring.

Handlers are exercised with fake `engine` / `benchmarks.engine_bench` modules, so these tests
check the CLI's own contract without running a model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pdcluster.cluster import cli

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = [["make-tiny-model"], ["convert-gguf"], ["generate"], ["bench"], ["bench", "engine"],
               ["bench", "metadata"], ["bench", "transfer"], ["bench", "serve"],
               ["bench", "router"], ["bench", "curve"], ["bench", "client"], ["metadata"],
               ["serve"], ["router"],
               ["router", "serve"], ["metadata", "serve"], ["replay"]]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdcluster.cluster.cli", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )


def test_top_level_help_lists_every_subcommand() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: pdcluster")
    for name in ("make-tiny-model", "generate", "metadata", "bench"):
        assert name in proc.stdout


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=" ".join)
def test_subcommand_help(words: list[str]) -> None:
    proc = run_cli(*words, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: pdcluster {' '.join(words)}")
    assert "--help" in proc.stdout


def test_help_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from pdcluster.cluster.cli import main\n"
        f"for words in {[[], *SUBCOMMANDS]!r}:\n"
        "    try:\n"
        "        main([*words, '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'engine'}),"
        " file=sys.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "[]"


def test_no_subcommand_is_a_usage_error() -> None:
    proc = run_cli()
    assert proc.returncode == 2
    assert "usage: pdcluster" in proc.stderr


def test_generate_missing_model_is_one_line_error() -> None:
    proc = run_cli("generate", "--model", "/nonexistent", "--prompt", "hi")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "/nonexistent" in lines[0]


def test_generate_folder_without_config_is_one_line_error(tmp_path: Path) -> None:
    proc = run_cli("generate", "--model", str(tmp_path), "--prompt", "hi")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "config.json" in proc.stderr


def test_generate_needs_exactly_one_prompt() -> None:
    assert run_cli("generate", "--model", "m").returncode == 2
    both = run_cli("generate", "--model", "m", "--prompt", "a", "--prompt-ids", "1")
    assert both.returncode == 2


@pytest.mark.parametrize("text, ids", [("1,2,3", [1, 2, 3]), (" 7 , 8,", [7, 8])])
def test_parse_token_ids(text: str, ids: list[int]) -> None:
    assert cli.parse_token_ids(text) == ids


@pytest.mark.parametrize("text", ["", "1,x", "-1,2", ","])
def test_parse_token_ids_rejects(text: str) -> None:
    with pytest.raises(Exception, match="token ids|integers"):
        cli.parse_token_ids(text)


class FakeLLM:
    calls: list[tuple] = []

    def __init__(self, model: str, **kwargs: object) -> None:
        FakeLLM.calls.append(("init", model, kwargs))

    def generate(self, prompts: list, params: object) -> list:
        FakeLLM.calls.append(("generate", prompts, params))
        return [types.SimpleNamespace(text=" Paris", token_ids=[5, 6, 7])]


class FakeSamplingParams:
    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> type[FakeLLM]:
    module = types.ModuleType("pdcluster.engine")
    module.LLM = FakeLLM
    module.SamplingParams = FakeSamplingParams
    monkeypatch.setitem(sys.modules, "pdcluster.engine", module)
    FakeLLM.calls = []
    return FakeLLM


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_generate_wiring(fake_engine, model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    rc = cli.main(["generate", "--model", str(model_dir), "--prompt", "The capital",
                   "--max-tokens", "3", "--seed", "1", "--block-size", "8"])
    assert rc == 0
    (_, model, kwargs), (_, prompts, params) = fake_engine.calls
    assert model == str(model_dir)
    assert kwargs == {"dtype": "float32", "device": "cpu", "block_size": 8,
                      "tensor_parallel_size": 1}
    assert prompts == ["The capital"]
    assert params.kwargs == {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                             "seed": 1}
    out, err = capsys.readouterr()
    assert "The capital" in out and "Paris" in out
    assert "3 tokens" in err


def test_generate_passes_num_blocks_and_prompt_ids(fake_engine, model_dir: Path) -> None:
    cli.main(["generate", "--model", str(model_dir), "--prompt-ids", "1,2", "--num-blocks", "9"])
    (_, _, kwargs), (_, prompts, _) = fake_engine.calls
    assert kwargs["num_kv_blocks"] == 9
    assert prompts == [[1, 2]]


def test_generate_config_error_is_one_line(
    monkeypatch: pytest.MonkeyPatch, fake_engine, model_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    def reject(**kwargs: object) -> None:
        raise ValueError("max_tokens must be >= 1")

    monkeypatch.setattr(sys.modules["pdcluster.engine"], "SamplingParams", reject)
    rc = cli.main(["generate", "--model", str(model_dir), "--prompt", "x", "--max-tokens", "0"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == "pdcluster generate: error: max_tokens must be >= 1"


def test_make_tiny_model_wiring(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    seen = {}

    def make_tiny_model(out_dir, *, arch, seed, preset):
        seen.update(out_dir=out_dir, arch=arch, seed=seed, preset=preset)
        return Path(out_dir)

    module = types.ModuleType("pdcluster.engine.models.tiny_model")
    module.make_tiny_model = make_tiny_model
    monkeypatch.setitem(sys.modules, "pdcluster.engine", types.ModuleType("pdcluster.engine"))
    monkeypatch.setitem(sys.modules, "pdcluster.engine.models.tiny_model", module)
    out = str(tmp_path / "m")
    assert cli.main(["make-tiny-model", out, "--arch", "qwen2", "--seed", "3"]) == 0
    assert seen == {"out_dir": out, "arch": "qwen2", "seed": 3, "preset": "tiny"}
    assert capsys.readouterr().out.strip() == out


@pytest.fixture
def fake_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("pdcluster.benchmarks.engine_bench")
    module.run = lambda args: {"quick": args.quick, "engine": {"tok_s": 12.5}, "ratio": 1.25}
    monkeypatch.setitem(sys.modules, "pdcluster.benchmarks.engine_bench", module)


@pytest.mark.parametrize("as_json", [True, False])
def test_bench_engine_prints_json_last(fake_bench, capsys, as_json: bool) -> None:
    argv = ["bench", "engine", "--quick"] + (["--json"] if as_json else [])
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == {"quick": True, "engine": {"tok_s": 12.5}, "ratio": 1.25}
    if as_json:
        assert len(lines) == 1
    else:
        assert any(line.startswith("engine.tok_s") for line in lines[:-1])


def test_bench_offers_exactly_what_the_package_ships() -> None:
    """`pdcluster bench` lists the benchmarks of pdcluster/benchmarks and nothing else: the
    harnesses of the checkout (chaos, peers, vllm, the studies) are `python -m benchmarks`."""
    shipped = {"engine", "transfer", "metadata", "router", "serve", "curve", "trace", "client",
               "planner", "tp", "tp-transfer"}
    assert set(cli.BENCHMARKS) == shipped
    package = REPO_ROOT / "pdcluster" / "benchmarks"
    for module, _ in cli.BENCHMARKS.values():
        assert (package / f"{module}.py").is_file(), module
    for harness in ("chaos", "peers", "vllm"):
        proc = run_cli("bench", harness, "--help")
        assert proc.returncode == 2 and "invalid choice" in proc.stderr, proc.stderr
    proc = run_cli("bench", "engine", "--moe")
    assert proc.returncode == 2 and "unrecognized arguments: --moe" in proc.stderr


def test_model_arg_resolution(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcluster.cluster.cli_common import UsageError, resolve_model_arg

    monkeypatch.chdir(model_dir.parent)
    assert resolve_model_arg(model_dir.name) == str(model_dir)  # absolute, for Ray workers
    with pytest.raises(UsageError, match="GGUF file not found"):
        resolve_model_arg("missing.gguf")
    (model_dir / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(UsageError, match="not a model folder or a GGUF file"):
        resolve_model_arg(str(model_dir / "weights.bin"))
