"""Every flag that names a file, and every model or job a command is pointed at, fails as one line
with exit code 2 when it is missing or wrong — before Ray or a model is started — and the helps
answer without importing torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str, home: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ONPOLICY_HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run([sys.executable, "-m", "onpolicy.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def one_line(p: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr and "\x1b[" not in p.stderr, p.stderr[-2000:]
    for f in fragments:
        assert f in lines[0], lines[0]


def test_demo_with_a_bad_model_path_exits_2_before_starting_ray(tmp_path: Path) -> None:
    p = run("demo", "--model", str(tmp_path / "no-such-model"), home=tmp_path)
    one_line(p, "model", str(tmp_path / "no-such-model"))
    assert "starting Ray" not in p.stderr


@pytest.mark.parametrize(("argv", "fragment"), [
    (["jobs", "--tls-ca", "{missing}"], "--tls-ca {missing}: no such file"),
    (["jobs", "--token-file", "{dir}"], "--token-file {dir}: not a regular file"),
    (["submit", "{spec}", "--tls-ca", "{missing}"], "--tls-ca {missing}: no such file"),
    (["up", "--port", "0", "--tls-cert", "{missing}", "--tls-key", "{missing}"], "--tls-cert {missing}: no such file"),
    (["up", "--port", "0", "--tls-cert", "{spec}", "--tls-key", "{spec}", "--tls-client-ca", "{missing}"],
     "--tls-client-ca {missing}: no such file"),
    (["up", "--port", "0", "--state-dir", "{spec}"], "--state-dir {spec}: not a directory"),
    (["up", "--port", "0", "--allow-reward-modules", "my-pkg"], "'my-pkg' is not a top-level package name"),
    (["export", "nosuchjob", "--hf", "{dir}/out", "--state-dir", "{dir}"], "nosuchjob: neither a checkpoint"),
    (["export", "{dir}", "--hf", "{dir}/out"], "no checkpoint"),
    (["diagnose", "{missing}"], "{missing}: no such file"),
])
def test_file_flags_are_one_line_usage_errors(tmp_path: Path, argv: list[str], fragment: str) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("model: tiny-qwen3\n")
    names = {"missing": str(tmp_path / "missing.pem"), "dir": str(tmp_path), "spec": str(spec)}
    p = run(*(a.format(**names) for a in argv), home=tmp_path)
    one_line(p, fragment.format(**names))


def test_yaml_errors_give_line_and_column_and_unknown_fields_a_suggestion(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("model: tiny-qwen3\nsteps: [1,\n  2\nrollout: {a: b}\n")
    one_line(run("submit", str(spec), home=tmp_path), "not valid YAML at line 4, column 8")
    spec.write_text("model: tiny-qwen3\nrollout:\n  temprature: 0\n")
    one_line(run("submit", str(spec), home=tmp_path), "rollout.temprature", "did you mean 'temperature'?")


def test_helps_import_no_torch() -> None:
    code = ("import sys\nfrom onpolicy.cli.main import build_parser\nparser = build_parser()\n"
            "for cmd in [[], *[[c] for c in parser._subparsers._group_actions[0].choices]]:\n"
            "    try:\n        parser.parse_args([*cmd, '--help'])\n    except SystemExit:\n        pass\n"
            "heavy = sorted(m for m in ('torch', 'ray', 'transformers', 'vllm') if m in sys.modules)\n"
            "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "usage: onpolicy export" in p.stdout  # every help was printed
    assert p.stderr.strip().splitlines()[-1] == "HEAVY=", p.stderr[-500:]
