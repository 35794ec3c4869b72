"""The cluster recipes in tools/cluster (package data: `shardflow recipes DIR`; SLURM
batch script, Kubeflow PyTorchJob, indexed conversion Job): their structure, and their
commands. Each recipe's shell runs for real under bash with the launchers stubbed (srun,
scontrol, torchrun and shardflow record their arguments), so the variables are expanded as on
a cluster; every flag then goes through the real parsers (shardflow train's, shardflow
convert's, torchrun's). The commands, as written, must be the
ones in docs/storage-and-cluster.md's "On a cluster" block. No cluster needed."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # PyYAML: webdataset depends on it
from conftest import ROOT

CLUSTER = ROOT / "tools" / "cluster"
SBATCH = CLUSTER / "slurm_train.sbatch"
README_SECTION = "## On a cluster"
DOC = ROOT / "docs" / "storage-and-cluster.md"  # where that section lives
TRAIN = "shardflow.tools.train"  # what `shardflow train` runs; torchrun --module starts it
# What the training operator gives every pod (PET_*: torchrun's own variables).
OPERATOR_ENV = {"PET_MASTER_ADDR": "shardflow-train-master-0", "PET_MASTER_PORT": "23456"}
SLURM_ENV = {"SLURM_JOB_NODELIST": "gpu-node-[07-08]", "SLURM_NNODES": "2",
             "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "shardflow-train",
             "SLURM_CPUS_PER_TASK": "64"}
FIRST_NODE = "gpu-node-07"


# -- reading the recipes ------------------------------------------------------------------------

def documents(name: str) -> dict[str, dict[str, Any]]:
    """The YAML file's objects by `Kind/name`."""
    docs = [d for d in yaml.safe_load_all((CLUSTER / name).read_text()) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def pod_specs(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pod specs of a Job (by the Job's name) or of a PyTorchJob (by replica type)."""
    if obj["kind"] == "PyTorchJob":
        return {role: spec["template"]["spec"]
                for role, spec in obj["spec"]["pytorchReplicaSpecs"].items()}
    return {obj["metadata"]["name"]: obj["spec"]["template"]["spec"]}


def only_container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["containers"]
    return container


def script_of(container: dict[str, Any]) -> str:
    """The bash script a container runs (command [bash, -c], the script in args)."""
    assert container["command"] == ["bash", "-c"], container["command"]
    (script,) = container["args"]
    return str(script)


def sbatch_defaults() -> dict[str, str]:
    """The script's settings block: NAME=${NAME:-default}."""
    found = re.findall(r"^(\w+)=\$\{\1:-([^}]*)\}", SBATCH.read_text(), flags=re.M)
    return dict(found)


def sbatch_options() -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH (--[\w-]+)=(\S+)", SBATCH.read_text(), flags=re.M))


def tool_commands(shell: str) -> list[list[str]]:
    """The commands in shell text that convert or train (`shardflow convert ...`, torchrun
    with --module TRAIN), as words (variables unexpanded, quotes removed, a leading `exec`
    dropped)."""
    commands = []
    for line in shell.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        words = words[1:] if words[:1] == ["exec"] else words
        if words[:2] == ["shardflow", "convert"] or TRAIN in words:
            commands.append(words)
    return commands


def recipe_commands() -> set[tuple[str, ...]]:
    scripts = [SBATCH.read_text()]
    for name in ("pytorchjob.yaml", "convert_job.yaml"):
        for obj in documents(name).values():
            if obj["kind"] != "ConfigMap":
                scripts += [script_of(only_container(p)) for p in pod_specs(obj).values()]
    return {tuple(c) for s in scripts for c in tool_commands(s)}


# -- running them with the launchers stubbed ----------------------------------------------------

RECORD = '#!/bin/sh\nprintf \'%s\\0\' "$@" > "$ARGV_DIR/$(basename "$0")"\n'
HOSTNAMES = RECORD + f"printf '{FIRST_NODE}\\ngpu-node-08\\n'\n"


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of launchers that record their arguments in $ARGV_DIR instead of running."""
    folder = tmp_path_factory.mktemp("stubs")
    for name, text in {"srun": RECORD, "torchrun": RECORD, "shardflow": RECORD,
                       "scontrol": HOSTNAMES}.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def run_recorded(cmd: list[str], env: dict[str, str], stubs: Path, tmp: Path
                 ) -> dict[str, list[str]]:
    """Run `cmd` with the stubs first on PATH; the arguments each stub was called with."""
    argv_dir = tmp / "argv"
    argv_dir.mkdir()
    env = {**env, "PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp), "ARGV_DIR": str(argv_dir)}
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stderr}"
    return {p.name: p.read_text().split("\0")[:-1] for p in argv_dir.iterdir()}


def container_env(container: dict[str, Any], docs: dict[str, dict[str, Any]]
                  ) -> dict[str, str]:
    """The environment Kubernetes gives the container: its ConfigMaps (from `docs`, the
    recipe's objects), values, and resourceFieldRefs to its own integer CPU limit."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(docs[f"ConfigMap/{source['configMapRef']['name']}"]["data"])
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("resourceFieldRef")
        if ref is None:
            env[var["name"]] = var["value"]
            continue
        assert ref["containerName"] == container["name"], ref
        kind, resource = ref["resource"].split(".")
        env[var["name"]] = str(int(container["resources"][kind][resource]))
    return env


# -- the real parsers ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    """shardflow train's, shardflow convert's and torchrun's own argument parsers."""
    from torch.distributed.run import get_args_parser

    from shardflow.tools import make_shards, train

    found = {"shardflow train": train.build_parser(),
             "shardflow convert": make_shards.build_parser(), "torchrun": get_args_parser()}
    for name, parser in found.items():
        parser.prog = name  # for the messages
    return found


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag of the parser and of its subcommands, spelled out."""
    found = set()
    for action in parser._actions:
        found |= set(action.option_strings)
        for sub in (action.choices or {}).values() \
                if isinstance(action, argparse._SubParsersAction) else ():
            found |= option_strings(sub)
    return found


def parse(parser: argparse.ArgumentParser, argv: list[str], own: int | None = None
          ) -> argparse.Namespace:
    """`argv` parsed; a flag or value the parser refuses fails the test with its message, and
    so does a flag it would take only as an abbreviation of a longer one (among the first
    `own` words: those after are a launched script's)."""
    flags = {w.split("=")[0] for w in argv[:own] if w.startswith("--")}
    assert flags <= option_strings(parser), (parser.prog, flags - option_strings(parser))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit:
            pass
    raise AssertionError(f"{parser.prog} refuses {argv}:\n{err.getvalue()}")


def torchrun_and_train(parsers: dict[str, argparse.ArgumentParser], argv: list[str]
                       ) -> tuple[argparse.Namespace, argparse.Namespace]:
    """torchrun's arguments and shardflow train's, from torchrun's argv."""
    launch = parse(parsers["torchrun"], argv, own=argv.index(TRAIN))
    assert launch.module and launch.training_script == TRAIN, launch
    return launch, parse(parsers["shardflow train"], launch.training_script_args)


# -- SLURM --------------------------------------------------------------------------------------

def test_the_sbatch_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_sbatch_allocation_is_one_task_per_node_with_the_gpus_torchrun_starts():
    options, settings = sbatch_options(), sbatch_defaults()
    assert options["--ntasks-per-node"] == "1"  # one torchrun per node
    assert int(options["--nodes"]) >= 1 and int(options["--cpus-per-task"]) >= 1
    assert options["--gpus-per-node"] == settings["GPUS_PER_NODE"]
    assert {"SHARDFLOW", "SHARED", "DATA", "RUN", "EPOCHS"} <= set(settings)


def test_sbatch_runs_one_torchrun_per_node_meeting_on_the_first_node(parsers, stubs, tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    calls = run_recorded(["bash", str(SBATCH)], {**SLURM_ENV, "SHARDFLOW": str(checkout)},
                         stubs, tmp_path)
    assert calls["scontrol"] == ["show", "hostnames", SLURM_ENV["SLURM_JOB_NODELIST"]]
    srun = calls["srun"]
    assert "--ntasks-per-node=1" in srun and "--cpus-per-task=64" in srun
    launch, train = torchrun_and_train(parsers, srun[srun.index("torchrun") + 1:])
    settings = sbatch_defaults()
    assert (launch.nnodes, launch.nproc_per_node) == ("2", settings["GPUS_PER_NODE"])
    assert launch.rdzv_backend == "c10d" and launch.rdzv_id == SLURM_ENV["SLURM_JOB_ID"]
    assert launch.rdzv_endpoint == f"{FIRST_NODE}:{settings['RDZV_PORT']}"
    shared = settings["SHARED"]
    assert (train.data, str(train.out)) == (f"{shared}/shards/train",
                                           f"{shared}/runs/{SLURM_ENV['SLURM_JOB_NAME']}")
    assert train.device == "cuda"


# -- Kubernetes ---------------------------------------------------------------------------------

def test_the_shared_volume_is_one_claim_many_nodes_can_mount():
    (claim,) = documents("shared_volume.yaml").values()
    assert claim["kind"] == "PersistentVolumeClaim" and claim["apiVersion"] == "v1"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "convert_job.yaml"])
def test_every_pod_mounts_the_shared_volume_and_keeps_its_paths_on_it(name):
    (claim,) = documents("shared_volume.yaml").values()
    docs = documents(name)
    paths = {k: v for o in docs.values() if o["kind"] == "ConfigMap"
             for k, v in o["data"].items() if k in ("DATA", "RUN", "SRC", "OUT")}
    assert paths
    for obj in (o for o in docs.values() if o["kind"] != "ConfigMap"):
        for role, pod in pod_specs(obj).items():
            volumes = {v["name"]: v for v in pod["volumes"]}
            (mount,) = [m for m in only_container(pod)["volumeMounts"]
                        if volumes[m["name"]].get("persistentVolumeClaim")]
            assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == \
                claim["metadata"]["name"], role
            assert all(p.startswith(mount["mountPath"] + "/") for p in paths.values()), paths


def test_the_pytorchjob_has_a_master_and_workers_with_the_gpus_torchrun_starts():
    docs = documents("pytorchjob.yaml")
    job = docs["PyTorchJob/shardflow-train"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    assert replicas["Worker"]["replicas"] >= 1
    gpus = int(job["spec"]["nprocPerNode"])
    containers = {role: only_container(pod) for role, pod in pod_specs(job).items()}
    assert containers["Master"] == containers["Worker"]  # one container, edited alike
    container = containers["Master"]
    assert container["name"] == "pytorch"  # the container the operator sets up
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] \
        == gpus
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/shared", "/dev/shm"}


def test_the_pytorchjob_runs_torchrun_with_the_operators_variables(parsers, stubs, tmp_path):
    docs = documents("pytorchjob.yaml")
    job = docs["PyTorchJob/shardflow-train"]
    container = only_container(pod_specs(job)["Worker"])
    nodes = 1 + job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
    env = {**container_env(container, docs), **OPERATOR_ENV, "PET_NNODES": str(nodes),
           "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"]}
    calls = run_recorded(["bash", "-c", script_of(container)], env, stubs, tmp_path)
    launch, train = torchrun_and_train(parsers, calls["torchrun"])
    assert (launch.nnodes, launch.node_rank) == (str(nodes), 1)
    assert launch.nproc_per_node == job["spec"]["nprocPerNode"]
    assert (launch.master_addr, launch.master_port) == ("shardflow-train-master-0", 23456)
    cpus = int(container["resources"]["limits"]["cpu"])
    assert train.loader_threads == cpus // int(job["spec"]["nprocPerNode"])
    assert (train.data, str(train.out)) == (env["DATA"], env["RUN"])
    assert train.device == "cuda"


def test_the_conversion_is_an_indexed_job_of_parts_then_a_suspended_merge():
    docs = documents("convert_job.yaml")
    convert, merge = docs["Job/shardflow-convert"], docs["Job/shardflow-merge"]
    settings = docs["ConfigMap/shardflow-convert-settings"]["data"]
    spec = convert["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == int(settings["PARTS"]) >= spec["parallelism"] >= 1
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    (fail_job,) = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert fail_job["onExitCodes"]["values"] == [1, 2]  # cliutil: data error, usage error
    assert merge["spec"]["suspend"] is True  # started once every part is complete


def run_job(name: str, stubs: Path, tmp: Path, **env: str
            ) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """The conversion Job's container, its environment, and what it passes to shardflow
    convert."""
    docs = documents("convert_job.yaml")
    container = only_container(pod_specs(docs[f"Job/{name}"])[name])
    env = {**container_env(container, docs), **env}
    calls = run_recorded(["bash", "-c", script_of(container)], env, stubs, tmp)
    assert calls["shardflow"][0] == "convert", calls["shardflow"]
    return container, env, calls["shardflow"][1:]


def test_each_conversion_pod_converts_its_own_part(parsers, stubs, tmp_path):
    parts = int(documents("convert_job.yaml")["ConfigMap/shardflow-convert-settings"]
                ["data"]["PARTS"])
    container, env, argv = run_job("shardflow-convert", stubs, tmp_path,
                                   JOB_COMPLETION_INDEX=str(parts - 1))
    args = parse(parsers["shardflow convert"], argv)
    assert (args.kind, args.src, str(args.out)) == (env["KIND"], env["SRC"], env["OUT"])
    assert args.part == (parts - 1, parts)
    assert args.workers == int(container["resources"]["limits"]["cpu"])


def test_the_merge_job_merges_the_parts_folder(parsers, stubs, tmp_path):
    _, env, argv = run_job("shardflow-merge", stubs, tmp_path)
    args = parse(parsers["shardflow convert"], argv)
    assert (args.kind, str(args.out)) == ("merge", env["OUT"])


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "convert_job.yaml"])
def test_no_script_holds_a_reference_kubernetes_would_replace(name):
    """Kubernetes replaces $(NAME) in command and args before bash sees them, where NAME is
    one of the container's variables: the scripts use $NAME, and bash's $(( )) stays as is."""
    for obj in documents(name).values():
        for pod in pod_specs(obj).values() if obj["kind"] != "ConfigMap" else ():
            script = script_of(only_container(pod))
            assert not re.findall(r"\$\([A-Za-z_]\w*\)", script), script


def test_every_recipe_says_what_to_edit_at_the_top():
    for path in sorted(CLUSTER.iterdir()):
        if path.suffix in (".yaml", ".sbatch"):
            head = path.read_text()[:2500]
            assert "EDIT" in head, f"{path.name}: no EDIT notes at the top"


# -- README -------------------------------------------------------------------------------------

def readme_section() -> str:
    text = DOC.read_text()
    heading = re.search(rf"^{README_SECTION}$", text, flags=re.M)
    assert heading is not None, f"{DOC.name} has lost its {README_SECTION!r} section"
    return re.split(r"^## ", text[heading.end():], maxsplit=1, flags=re.M)[0]


def test_the_recipes_run_the_commands_the_readme_shows():
    fenced = "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", readme_section(), re.M | re.S))
    shown = {tuple(c) for c in tool_commands(fenced)}
    ours = recipe_commands()
    assert len(ours) == 4  # SLURM, PyTorchJob, convert, merge
    assert shown == ours, {"only in the docs": shown - ours,
                           "only in the recipes": ours - shown}


def test_the_files_and_jobs_the_readme_names_exist():
    section = readme_section()
    files = set(re.findall(r"\bcluster/([\w.]+)", section))
    assert files and all((CLUSTER / f).exists() for f in files), files
    jobs = {o["metadata"]["name"] for n in ("pytorchjob.yaml", "convert_job.yaml")
            for o in documents(n).values()}
    named = set(re.findall(r"\bjob[/ ](shardflow-[\w-]+)", section))
    assert named <= jobs, named - jobs
