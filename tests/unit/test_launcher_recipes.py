"""launcher/: the Kubernetes manifests validate against the schemas of the version they name
(``kubernetes-validate``, strict: an unknown field is an error), and the Slurm script's dry
run prints the commands it would run. The Slurm script runs for real on a Slurm cluster in
tests/faults/test_slurm.py."""

from __future__ import annotations

import itertools
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "launcher" / "kubernetes"
SBATCH = REPO / "launcher" / "slurm" / "ftmem.sbatch"
K8S_VERSION = "1.33.0"
"""The version the manifests name in their header."""


def _docs(path: Path) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def job_pods(job: dict[str, Any]) -> dict[str, Any]:
    """The selector of a Job's pods (the label Kubernetes gives them)."""
    return {"matchLabels": {"job-name": job["metadata"]["name"]}}


def test_the_kubernetes_manifests_validate_against_their_version() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    files = sorted(K8S.glob("*.yaml"))
    assert [f.name for f in files] == ["etcd.yaml", "ftmem-job.yaml"]
    kinds = []
    for f in files:
        assert f"Kubernetes {K8S_VERSION.rsplit('.', 1)[0]}" in f.read_text().split("---")[0]
        for doc in _docs(f):
            kv.validate(doc, K8S_VERSION, strict=True)
            kinds.append(doc["kind"])
    policies = ["NetworkPolicy", "NetworkPolicy"]  # one for etcd, one for the Job's pods
    assert sorted(kinds) == sorted(
        ["Service", "StatefulSet", "Service", "Job", "PersistentVolumeClaim", *policies]
    )
    job = next(d for d in _docs(K8S / "ftmem-job.yaml") if d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"  # /dev/shm: not Docker's 64 MiB
    train = pod["containers"][0]
    args = " ".join(train["args"])
    assert "--rdzv-backend etcd-v3" in args and "--ftmem-key-file /run/ftmem/mesh.key" in args
    # etcd over TLS with this Job's client certificate (torch's etcd-v2 --rdzv-conf names).
    assert "--rdzv-conf protocol=https,ca_cert=/run/ftmem/ca.crt,ssl_cert=" in args
    assert '--ftmem-metrics-addr "$POD_IP"' in args and "0.0.0.0" not in args
    # Non-root, no capabilities; the keys reach the uid through the init container (K2, K3).
    ctx = pod["securityContext"]
    assert ctx["runAsNonRoot"] and ctx["runAsUser"] == ctx["fsGroup"] == 10001
    assert ctx["seccompProfile"]["type"] == "RuntimeDefault"
    assert train["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    init = pod["initContainers"][0]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert "chmod 0600 /run/ftmem/*" in init["args"][0]
    env = {e["name"]: e.get("value") for e in train["env"]}
    assert env["FTMEM_TIER_KEY_FILE"] == "/run/ftmem/tier.key"
    secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"ftmem-mesh-key", "ftmem-tier-key", "ftmem-etcd-client"}
    mounts = {m["name"] for m in train["volumeMounts"]}
    assert "keys" in mounts and not mounts & {"mesh-key", "tier-key", "etcd-client"}
    policy = next(d for d in _docs(K8S / "ftmem-job.yaml") if d["kind"] == "NetworkPolicy")
    assert policy["spec"]["podSelector"] == job_pods(job)
    etcd = next(d for d in _docs(K8S / "etcd.yaml") if d["kind"] == "StatefulSet")
    member = etcd["spec"]["template"]["spec"]["containers"][0]
    assert member["image"].rsplit(":", 1)[1].startswith("v3.6")  # v3 only: no --enable-v2
    assert not any("enable-v2" in a for a in member["args"])
    assert "--client-cert-auth" in member["args"] and "--peer-client-cert-auth" in member["args"]
    assert not any("http://" in a for a in member["args"])
    etcd_policy = next(d for d in _docs(K8S / "etcd.yaml") if d["kind"] == "NetworkPolicy")
    rules = {
        r["ports"][0]["port"]: r["from"][0]["podSelector"] for r in etcd_policy["spec"]["ingress"]
    }
    assert rules == {2379: job_pods(job), 2380: etcd["spec"]["selector"]}
    # A misspelled field is refused: the validation is not vacuous.
    job["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(job, K8S_VERSION, strict=True)


def _dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(
        ["bash", str(SBATCH)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**base, "FTMEM_DRY_RUN": "1", "SHARED_DIR": str(tmp_path / "shared"), **env},
    )


def test_the_slurm_script_runs_one_agent_per_node_without_killing_the_job(
    tmp_path: Path,
) -> None:
    slurm = {
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NAME": "ftmem",
        "SLURM_RESTART_COUNT": "1",
        "TRAIN_NODES": "3",
        "RDZV_ENDPOINT": "n1:29500",
    }
    out = _dry_run(tmp_path, **slurm)
    assert out.returncode == 0, out.stderr
    lines = [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]
    sruns = [x for x in lines if x[0] == "srun"]
    assert len(sruns) == 3  # cleanup, the agents, cleanup
    # Only this job's runs are cleaned: its earlier attempts' before, this one's after.
    assert sruns[0][-3:] == ["ftmem", "77-0", "77-1"] and "--run-id" in sruns[0][-4]
    assert sruns[2][-4:] == ["cleanup", "--remove", "--run-id", "77-1"]
    assert "--overlap" in sruns[2]  # not held up by the agents' step on a lost node
    launch = sruns[1]
    assert "--no-kill" in launch and "--kill-on-bad-exit=0" in launch
    flags = dict(itertools.pairwise(launch))
    assert flags["--nnodes"] == "3" and flags["--rdzv-id"] == "77-1"  # a new one per attempt
    assert flags["--rdzv-endpoint"] == "n1:29500"
    shared = tmp_path / "shared"
    # A mesh key of this job's own; the tier key shared by every job of these checkpoints.
    assert flags["--ftmem-key-file"] == str(shared / "mesh-77.key")
    assert any(x[:2] == ["ftmem", "keygen"] and x[2] == str(shared / "mesh-77.key") for x in lines)
    assert ["private_key", str(shared / "tier.key")] in lines
    assert ["private_dir", str(shared)] in lines and [
        "private_dir",
        str(shared / "checkpoints"),
    ] in lines
    # Each node's local tier is made private there (mktemp -d) under LOCAL_DIR.
    assert (
        flags["--ftmem-flush-dir"] == "@LOCAL_TIER@"
        and "mktemp -d" in launch[launch.index("-c") + 1]
    )
    assert launch[launch.index("-c") + 4] == "/tmp"  # LOCAL_DIR's default (no SLURM_TMPDIR)
    assert flags["--ftmem-flush-persistent-dir"] == str(shared / "checkpoints")

    too_few = _dry_run(tmp_path, **{**slurm, "SLURM_JOB_NUM_NODES": "2"})
    assert too_few.returncode == 2 and "fewer than TRAIN_NODES=3" in too_few.stderr
    outside = _dry_run(tmp_path)
    assert outside.returncode != 0 and "run this under sbatch" in outside.stderr
