"""Issue 17 on the real `ninfer` command (subprocesses): what a new user hits in the first hour.

Threads (item 1), start-up without torch (item 3), clean errors before any load (item 4), local and
embedded models in ls / show / run, the prompt as an argument or on stdin, --ctx-size (item 6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer_core.threads import busy_hint, cpu_quota, default_threads, physical_cores
from tiny_model_dir import write_tiny_model_dir

GREEDY = ("--max-tokens", "3", "--temperature", "0", "--device", "cpu")


def ninfer(*args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_app", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("first_hour") / "tiny-dense"
    write_tiny_model_dir(directory, moe=False, max_positions=2048)
    return directory


@pytest.fixture(autouse=True)
def private_home(tmp_path, monkeypatch):
    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "home"))


# ---- item 3: start-up ---------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["serve", "--help"], ["ls"], ["ls", "--aliases"],
                                  ["show", "qwen3.5-0.8b"], ["show", "SmolLM2-135M-Instruct"], ["pull", "--help"]])
def test_help_ls_show_pull_do_not_import_torch(args):
    """Importing torch costs seconds: `--help`, `ls`, `show` and `pull` must not (measured: docs/performance.md)."""
    code = ("import sys\nfrom ninfer_app.cli import cli\ntry:\n    cli(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.stderr.strip().endswith("no torch"), proc.stderr


# ---- item 1: threads ----------------------------------------------------------------------------

def test_default_threads_are_the_physical_cores_under_the_cpu_quota(tmp_path):
    sysfs = tmp_path / "cpu"
    for cpu, core in ((0, 0), (1, 0), (2, 1), (3, 1)):  # two cores with two hyper-threads each
        topology = sysfs / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert physical_cores([0, 1, 2, 3], sysfs) == 2 and physical_cores([0, 1], sysfs) == 1
    assert physical_cores([7], sysfs) == 1  # no topology files: every logical CPU counts
    v2, v1 = tmp_path / "cpu.max", (tmp_path / "quota", tmp_path / "period")
    v2.write_text("150000 100000\n")
    assert cpu_quota(v2, v1) == 2
    v2.write_text("max 100000\n")
    assert cpu_quota(v2, v1) is None
    assert cpu_quota(tmp_path / "none", v1) is None
    assert 1 <= default_threads() <= (os.cpu_count() or 1)
    assert "--threads 1" in busy_hint(2, load=3.1, cpus=2) and busy_hint(2, load=1.5, cpus=2) is None
    assert busy_hint(1, load=9.0, cpus=2) is None  # one thread already


def test_threads_flag_and_environment_are_applied(model_dir):
    """The stats line names torch's own thread count after the flag / NINFER_THREADS / the default."""
    flag = ninfer("run", str(model_dir), "hi", "--threads", "1", *GREEDY)
    assert flag.returncode == 0, flag.stderr
    assert ", 1 thread]" in flag.stderr
    env = ninfer("run", str(model_dir), "hi", *GREEDY, NINFER_THREADS="2")
    assert ", 2 threads]" in env.stderr, env.stderr
    default = ninfer("run", str(model_dir), "hi", *GREEDY, NINFER_THREADS="")
    n = default_threads()
    assert f", {n} thread{'s' if n != 1 else ''}]" in default.stderr, default.stderr
    one_line_error(ninfer("run", str(model_dir), "hi", "--threads", "0"), "--threads must be at least 1")
    one_line_error(ninfer("run", str(model_dir), "hi", NINFER_THREADS="many"), "NINFER_THREADS must be a number")


# ---- item 4: errors before any load -------------------------------------------------------------

@pytest.mark.parametrize("flags, needle", [
    (["--spec", "magic"], "--spec must be one of mtp, dflash, ngram"),
    (["--weights", "q7"], "--weights must be one of auto, bf16, int8, int4"),
    (["--dtype", "f32"], "--dtype must be auto or one of float32"),
    (["--kv-dtype", "fp4"], "unknown KV dtype 'fp4'"),
    (["--device", "gpu"], "unsupported device 'gpu'"),
    (["--spec", "dflash"], "--spec dflash needs --draft-model"),
    (["--ctx-size", "0"], "--max-context must be a positive number"),
    (["--cpu-math", "fast"], "--cpu-math must be one of bf16, int8, exact, got 'fast'"),
])
def test_bad_flags_are_reported_before_the_model_is_read(flags, needle):
    """The model does not exist: a flag error proves the flags were checked first (no 15 s load)."""
    one_line_error(ninfer("run", "/no/such/model", "hi", *flags), needle)


def test_missing_paths_are_not_sent_to_the_hub():
    for spec in ("/nonexistent", "./missing.gguf"):
        line = one_line_error(ninfer("run", spec, "hi"), f"{spec}: no such file or directory")
        assert "pull" not in line
        one_line_error(ninfer("show", spec), "no such file or directory")
    offline = ninfer("run", "org/not-pulled", "hi", HF_HUB_OFFLINE="1")  # a hub name is pulled first
    notice, error = [line for line in offline.stderr.splitlines() if line.strip()]
    assert offline.returncode == 1 and "pulling it" in notice and error.startswith("error: ") and "HF_HUB_OFFLINE" in error


def test_an_image_for_a_text_only_model_is_refused_cleanly(model_dir, tmp_path):
    image = tmp_path / "x.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n")
    one_line_error(ninfer("run", str(model_dir), "--image", str(image), "--prompt", "what is it?", *GREEDY),
                   "has no vision tower")
    one_line_error(ninfer("run", str(model_dir), "--image", str(tmp_path / "gone.png"), "--prompt", "x"),
                   "--image", "no such file")


def test_a_message_without_content_is_a_message_shape_error(model_dir, tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user"}]))
    one_line_error(ninfer("run", str(model_dir), "--messages", str(path)), "messages[1]: no 'content'")
    path.write_text(json.dumps([{"role": "user", "content": 3}]))
    one_line_error(ninfer("run", str(model_dir), "--messages", str(path)), "'content' must be a string or a list")


# ---- item 6: prompts, names, context ------------------------------------------------------------

def test_prompt_as_argument_option_or_stdin_give_the_same_answer(model_dir):
    by_option = ninfer("run", str(model_dir), "--prompt", "Say hi", *GREEDY, "--json")
    assert by_option.returncode == 0, by_option.stderr
    expected = json.loads(by_option.stdout)["token_ids"]
    by_argument = ninfer("run", str(model_dir), "Say hi", *GREEDY, "--json")
    by_stdin = ninfer("run", str(model_dir), *GREEDY, "--json", stdin="Say hi\n")
    assert json.loads(by_argument.stdout)["token_ids"] == expected
    assert json.loads(by_stdin.stdout)["token_ids"] == expected
    one_line_error(ninfer("run", str(model_dir)), "no prompt")
    one_line_error(ninfer("run", "what is the capital of France?"), "is not a model: the model comes first")
    one_line_error(ninfer("run", str(model_dir), "hi", "--prompt", "hi"), "give the prompt once")


def test_ctx_size_is_max_context(model_dir):
    for flag in ("--ctx-size", "--max-context"):
        one_line_error(ninfer("run", str(model_dir), "a fairly long prompt of many words", flag, "8", *GREEDY),
                       "context limit is 8 tokens")


def test_ls_show_and_run_see_local_checkpoints_and_the_embedded_model(model_dir):
    added = ninfer("add", str(model_dir), "--name", "mine")
    assert added.returncode == 0, added.stderr
    listed = {m["name"]: m for m in json.loads(ninfer("ls", "--json").stdout)}
    assert listed["mine"]["source"] == "local" and listed["mine"]["path"] == str(model_dir.resolve())
    assert listed["mine"]["arch"] and listed["mine"]["context"] == 2048
    assert listed["SmolLM2-135M-Instruct"]["source"] == "embedded"
    assert listed["SmolLM2-135M-Instruct"]["quantization"] == "Q4_1"
    shown = json.loads(ninfer("show", "mine", "--json").stdout)
    assert shown["architecture"] and shown["fit"]["context"] > 0
    by_path = json.loads(ninfer("show", str(model_dir), "--json").stdout)
    assert by_path["fit"] == shown["fit"]
    embedded = json.loads(ninfer("show", "SmolLM2-135M-Instruct", "--json").stdout)
    assert embedded["source"] == "embedded" and embedded["fit"]["weight_bytes"] == embedded["size_bytes"]
    ran = ninfer("run", "mine", "hi", *GREEDY, "--json")
    assert ran.returncode == 0 and len(json.loads(ran.stdout)["token_ids"]) == 3, ran.stderr
    one_line_error(ninfer("add", str(model_dir), "--name", "SmolLM2-135M-Instruct"), "is taken")
    forgot = ninfer("rm", "mine")
    assert forgot.returncode == 0 and "forgot mine" in forgot.stdout and model_dir.is_dir()
    assert "mine" not in {m["name"] for m in json.loads(ninfer("ls", "--json").stdout)}


def test_models_loaded_on_demand_take_the_engine_flags_but_not_the_startup_models_own(model_dir):
    """`ninfer serve --max-context 32768 --chat-template F --spec ngram --mmproj P`: another model
    loaded by name gets neither the startup model's template, drafter nor projector, and its own
    context limit."""
    from ninfer_app.serve_cli import on_demand_options
    from ninfer_core.llm import EngineOptions

    startup = EngineOptions(max_context=32768, chat_template="mine.jinja", spec="ngram", draft_tokens=4,
                            weights="bf16", max_seqs=8, mmproj="mmproj-F16.gguf")
    other = on_demand_options(startup, str(model_dir))
    assert (other.max_context, other.chat_template, other.spec, other.draft_tokens) == (2048, None, None, None)
    assert other.mmproj is None
    assert (other.weights, other.max_seqs) == ("bf16", 8)
