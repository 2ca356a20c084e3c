"""Offline checks of everything under deploy/: manifests, Helm chart, systemd units, config.

* Every object in deploy/k8s/*.yaml, and every object the Helm chart renders, is validated
  against the Kubernetes 1.30 OpenAPI schemas in *strict* mode (unknown fields are errors)
  with kubernetes-validate, whose wheel ships the schemas: nothing is downloaded.
* The chart is rendered by Helm's own Go template engine (Helm v4 SDK) through the
  helm-python-sdk wheel, which bundles it as a shared library driven with ctypes: no helm
  binary, no Go toolchain, no network. With its defaults and a release ``gcache`` in
  namespace ``gcache`` the chart must render exactly the plain manifests (modulo Helm's
  own labels and the config checksum annotation).
* The master's peer computation (a shell script in the StatefulSet) is executed against a
  stub ``gcache-master`` to check the --listen/--peers each pod really gets.
* The config TOML, the systemd units and the env example are checked against the real
  option table (gcache.config.OPTIONS) and the daemons' real click flags.

The whole module runs in a few seconds.
"""

from __future__ import annotations

import configparser
import copy
import os
import re
import shlex
import shutil
import subprocess
import tomllib
import warnings
from pathlib import Path

import pytest

from gcache.config import OPTIONS, load_config, parse_size

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_DIR = DEPLOY / "k8s"
CHART = DEPLOY / "helm" / "gcache"
SYSTEMD = DEPLOY / "systemd"
CONFIG = DEPLOY / "config"

K8S_VERSION = "1.30"  # kubernetes-validate ships 1.25 ... 1.37 schemas in its wheel
NAMESPACE = "gcache"
CLUSTER_DOMAIN = "cluster.local"

# Flags the deploy files use that the brief specifies but the daemons do not have yet.
# They are accepted here, with a warning, until the CLI grows them (none left: the disk
# tier's --disk-dir/--disk now exist).
PENDING_FLAGS: dict[str, set[str]] = {"server": set(), "master": set()}
# The master CLI as specified, for when gcache.master.cli cannot be imported.
MASTER_SPEC_FLAGS = {"--listen", "--peers", "--data-dir", "--token"}
# [master] keys the spec allows while gcache.config.OPTIONS has no master-scope options.
MASTER_SPEC_KEYS = {"listen", "peers", "data_dir", "token", "heartbeat_timeout_ms"}

HELM_ONLY_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by"}
CLUSTER_SCOPED = {"Namespace"}


# ---------------------------------------------------------------- loading


def _yaml():
    return pytest.importorskip("yaml", reason="pyyaml is in the [test] extra")


def _docs(text: str) -> list[dict]:
    return [d for d in _yaml().safe_load_all(text) if d]


def plain_objects() -> list[dict]:
    objs: list[dict] = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        objs += _docs(path.read_text())
    return objs


def render_chart(values: dict | None = None, *, name: str = "gcache",
                 namespace: str = NAMESPACE) -> list[dict]:
    helm = pytest.importorskip(
        "helm_python", reason="helm-python-sdk (Helm's Go SDK in a wheel) is in the [test] extra")
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values or {}, name=name, namespace=namespace)
    objs: list[dict] = []
    for template, text in sorted(rendered.items()):
        if template.endswith(".yaml"):
            objs += _docs(text)
    return objs


def validate(obj: dict) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in [test]")
    try:
        kv.validate(obj, K8S_VERSION, strict=True)
    except kv.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{obj['kind']}/{obj['metadata'].get('name')}: {where}: {exc.message}")


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(workload: dict, name: str | None = None) -> dict:
    cs = workload["spec"]["template"]["spec"]["containers"]
    return cs[0] if name is None else next(c for c in cs if c["name"] == name)


def server_args(ds: dict) -> dict[str, str]:
    """The server container's --flag value pairs (also --flag=value)."""
    args = container(ds, "server")["args"]
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        tok = args[i]
        assert tok.startswith("--"), f"stray argument {tok!r} in {args}"
        if "=" in tok:
            k, v = tok.split("=", 1)
            i += 1
        else:
            k, v = tok, args[i + 1]
            i += 2
        assert k not in out, f"{k} given twice"
        out[k] = v
    return out


def k8s_quantity(q: str | int) -> int:
    q = str(q)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
    for suffix, mult in units.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * mult)
    return int(float(q))


def known_flags(daemon: str) -> set[str]:
    """The daemon's real click flags (plus the spec's, if its CLI cannot be imported)."""
    try:
        if daemon == "server":
            from gcache.server.cli import main
        else:
            from gcache.master.cli import main
    except ImportError:
        if daemon == "server":
            raise
        return set(MASTER_SPEC_FLAGS)
    return {o for p in main.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def check_flags(daemon: str, used: set[str], where: str) -> None:
    real = known_flags(daemon)
    unknown = used - real - PENDING_FLAGS[daemon]
    assert not unknown, f"{where} passes flags gcache-{daemon} does not have: {sorted(unknown)}"
    pending = (used & PENDING_FLAGS[daemon]) - real
    if pending:
        warnings.warn(f"{where} uses gcache-{daemon} flags that are specified but not "
                      f"implemented yet: {sorted(pending)}", stacklevel=2)


def master_script(sts: dict) -> str:
    c = container(sts, "master")
    assert c["command"] == ["/bin/sh", "-c"], c["command"]
    assert len(c["args"]) == 1
    return c["args"][0]


def master_fqdns(sts: dict, svc_name: str, ns: str) -> list[str]:
    name, port = sts["metadata"]["name"], api_port(sts)
    return [f"{name}-{i}.{svc_name}.{ns}.svc.{CLUSTER_DOMAIN}:{port}" for i in range(3)]


def api_port(sts: dict) -> int:
    ports = {p["name"]: p["containerPort"] for p in container(sts, "master")["ports"]}
    return ports["api"]


def normalize(obj: dict) -> dict:
    """Drop what only Helm adds; compare the config TOML by content, not layout."""
    obj = copy.deepcopy(obj)
    metas = [obj["metadata"]]
    if "template" in obj.get("spec", {}):
        metas.append(obj["spec"]["template"]["metadata"])
    for meta in metas:
        for key in HELM_ONLY_LABELS:
            meta.get("labels", {}).pop(key, None)
        ann = meta.get("annotations", {})
        for key in [k for k in ann if k.startswith("checksum/")]:
            del ann[key]
        if "annotations" in meta and not ann:
            del meta["annotations"]
    if obj["kind"] == "ConfigMap":
        obj["data"] = {k: tomllib.loads(v) if k.endswith(".toml") else v
                       for k, v in obj["data"].items()}
    return obj


def index(objs: list[dict]) -> dict[tuple[str, str], dict]:
    out = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    assert len(out) == len(objs), "two objects share a kind and name"
    return out


# ---------------------------------------------------------------- schema validation


def _plain_ids() -> list[str]:
    return [f"{o['kind']}/{o['metadata']['name']}" for o in plain_objects()]


@pytest.mark.parametrize("obj", plain_objects(), ids=_plain_ids())
def test_plain_manifest_is_valid_k8s(obj):
    validate(obj)
    if obj["kind"] not in CLUSTER_SCOPED:
        assert obj["metadata"].get("namespace") == NAMESPACE


def test_plain_manifests_have_every_piece():
    objs = index(plain_objects())
    for key in [("Namespace", "gcache"), ("ConfigMap", "gcache-config"),
                ("Secret", "gcache-token"), ("Secret", "gcache-raft-secret"),
                ("Service", "gcache-master"),
                ("Service", "gcache-master-client"), ("StatefulSet", "gcache-master"),
                ("DaemonSet", "gcache-server")]:
        assert key in objs, f"deploy/k8s lacks {key[0]} {key[1]}"


def test_strict_validation_is_not_vacuous():
    """A typo'd field or a wrong type must fail validation, or the checks above prove nothing."""
    kv = pytest.importorskip("kubernetes_validate")
    ds = one(plain_objects(), "DaemonSet")
    typo = copy.deepcopy(ds)
    container(typo)["volumeMount"] = container(typo).pop("volumeMounts")
    wrong_type = copy.deepcopy(ds)
    wrong_type["spec"]["template"]["spec"]["hostNetwork"] = "yes"
    for bad in (typo, wrong_type):
        with pytest.raises(kv.ValidationError):
            kv.validate(bad, K8S_VERSION, strict=True)


# ---------------------------------------------------------------- Helm chart


def test_chart_renders_valid_k8s():
    objs = render_chart()
    assert objs
    for obj in objs:
        validate(obj)


def test_chart_defaults_render_the_plain_manifests():
    rendered = index([normalize(o) for o in render_chart({"namespace": {"create": True}})])
    plain = index([normalize(o) for o in plain_objects()])
    assert sorted(rendered) == sorted(plain)
    for key, obj in plain.items():
        assert rendered[key] == obj, f"chart and deploy/k8s differ in {key[0]} {key[1]}"


def test_chart_lints_clean():
    helm = pytest.importorskip("helm_python")
    report = helm.lint(str(CHART), strict=True, namespace=NAMESPACE,
                       kube_version=f"v{K8S_VERSION}.0")
    bad = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not bad, bad


def test_chart_parameters_reach_the_objects():
    values = {
        "image": {"repository": "registry.example.com/gcache", "tag": "9.9.9"},
        "token": {"existingSecret": "my-token", "existingSecretKey": "tok"},
        "raftSecret": {"existingSecret": "my-raft", "existingSecretKey": "rs"},
        "server": {"memory": "100GiB", "disk": {"hostPath": "/nvme1/kv", "size": "2TiB"},
                   "resources": {"requests": {"cpu": "8", "memory": "110Gi"},
                                 "limits": {"cpu": "8", "memory": "110Gi"}},
                   # Helm merges maps with the defaults; null drops a default key
                   "nodeSelector": {"gpu": "h100", "nvidia.com/gpu.present": None},
                   "tolerations": [{"key": "dedicated", "operator": "Equal",
                                    "value": "llm", "effect": "NoSchedule"}]},
        "master": {"persistence": {"size": "5Gi", "storageClassName": "fast"},
                   "antiAffinity": "soft"},
    }
    objs = render_chart(values, name="kv", namespace="prod")
    for obj in objs:
        validate(obj)
        assert obj["metadata"].get("namespace") == "prod"
    assert not by_kind(objs, "Secret"), "existingSecret must not render a Secret"
    ds = one(objs, "DaemonSet", "kv-gcache-server")
    sts = one(objs, "StatefulSet", "kv-gcache-master")
    for wl in (ds, sts):
        assert container(wl)["image"] == "registry.example.com/gcache:9.9.9"
        env = {e["name"]: e for e in container(wl)["env"]}
        assert env["GCACHE_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "my-token",
                                                                   "key": "tok"}
    args = server_args(ds)
    assert args["--memory"] == "100GiB" and args["--disk"] == "2TiB"
    assert args["--masters"].split(",") == master_fqdns(sts, "kv-gcache-master", "prod")
    pod = ds["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["disk"]["hostPath"]["path"] == "/nvme1/kv"
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"][0]["key"] == "dedicated"
    claim = sts["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["storageClassName"] == "fast"
    assert claim["resources"]["requests"]["storage"] == "5Gi"
    assert "preferredDuringSchedulingIgnoredDuringExecution" in \
        sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    check_master_script(sts, "kv-gcache-master", "prod")
    assert raft_secret_of(sts) == ("my-raft", "rs")
    assert "my-raft" not in secret_refs(ds)


def test_chart_without_disk_tier():
    ds = one(render_chart({"server": {"disk": {"enabled": False}}}), "DaemonSet")
    validate(ds)
    args = server_args(ds)
    assert "--disk-dir" not in args and "--disk" not in args
    pod = ds["spec"]["template"]["spec"]
    assert "disk" not in {v["name"] for v in pod["volumes"]}
    assert "initContainers" not in pod


def test_chart_refuses_other_master_counts():
    helm = pytest.importorskip("helm_python")
    with pytest.raises(helm.HelmError, match="fixed at 3"):
        render_chart({"master": {"replicas": 5}})


# ---------------------------------------------------------------- masters


def _sources():
    return [pytest.param(plain_objects, id="plain"), pytest.param(render_chart, id="helm")]


def check_master_script(sts: dict, svc_name: str, ns: str) -> None:
    """Run the pod's start script with a stub gcache-master and check its argv per ordinal."""
    script = master_script(sts)
    assert "$(" not in script, "kubelet would expand $(...) in the script itself"
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh to run the master start script")
    import tempfile

    fqdns = master_fqdns(sts, svc_name, ns)
    with tempfile.TemporaryDirectory() as d:
        stub = Path(d) / "gcache-master"
        stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n')
        stub.chmod(0o755)
        for i in range(3):
            out = Path(d) / f"argv{i}"
            env = {"PATH": f"{d}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                   "POD_NAME": f"{sts['metadata']['name']}-{i}", "ARGV_OUT": str(out)}
            subprocess.run([sh, "-c", script], env=env, check=True, timeout=10)
            argv = out.read_text().splitlines()
            flags = dict(zip(argv[::2], argv[1::2]))
            assert flags["--listen"] == fqdns[i], "a master's --listen is its Raft identity"
            assert flags["--peers"].split(",") == [f for j, f in enumerate(fqdns) if j != i]
            data_dir = flags["--data-dir"]
    mounts = {m["name"]: m["mountPath"] for m in container(sts, "master")["volumeMounts"]}
    claims = [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]]
    assert any(Path(data_dir).is_relative_to(mounts[c]) for c in claims), \
        f"--data-dir {data_dir} is not on a persistent volume"


@pytest.mark.parametrize("source", _sources())
def test_masters_statefulset(source):
    objs = source()
    sts = one(objs, "StatefulSet")
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    assert spec["replicas"] == 3
    assert spec["podManagementPolicy"] == "Parallel", "Raft members must start together"
    assert spec["volumeClaimTemplates"], "master state needs a persistent volume"
    claim = spec["volumeClaimTemplates"][0]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"]
    headless = one(objs, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    labels = pod_labels(sts)
    for svc in by_kind(objs, "Service"):
        if svc["spec"]["selector"].get("app.kubernetes.io/component") == "master":
            assert svc["spec"]["selector"].items() <= labels.items()
            port_names = {p["name"] for p in container(sts)["ports"]}
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    c = container(sts, "master")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["raft"] == ports["api"] + 1
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = c[probe]["httpGet"]  # answered without the token (master/api.py probe)
        assert get["path"] == path and get["port"] in ("api", ports["api"])
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    anti = pod["affinity"]["podAntiAffinity"]
    term = anti["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    check_token_env(objs, c)
    check_master_script(sts, spec["serviceName"], NAMESPACE)
    check_flags("master", set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", master_script(sts))),
                f"{source.__name__} StatefulSet")


def pod_labels(workload: dict) -> dict:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    return labels


def check_token_env(objs: list[dict], c: dict) -> None:
    env = {e["name"]: e for e in c["env"]}
    ref = env["GCACHE_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = one(objs, "Secret", ref["name"])
    assert ref["key"] in secret["stringData"]
    assert "REPLACE" in secret["stringData"][ref["key"]], "the example token must say so"
    assert "--token" not in c.get("args", []), "a token on the command line shows in ps"


def secret_refs(workload: dict) -> set[str]:
    """Every Secret a workload's pods can read: env, envFrom, and secret/projected volumes."""
    pod = workload["spec"]["template"]["spec"]
    refs: set[str] = set()
    for c in pod["containers"] + pod.get("initContainers", []):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs.add(ref["name"])
        for e in c.get("envFrom", []):
            if "secretRef" in e:
                refs.add(e["secretRef"]["name"])
    for v in pod.get("volumes", []):
        if "secret" in v:
            refs.add(v["secret"]["secretName"])
        for src in v.get("projected", {}).get("sources", []):
            if "secret" in src:
                refs.add(src["secret"]["name"])
    return refs


def raft_secret_of(sts: dict) -> tuple[str, str]:
    """(Secret name, key) the masters read their Raft secret from, checked end to end:
    GCACHE_RAFT_SECRET_FILE names a file in a read-only mount of that Secret's key."""
    c = container(sts, "master")
    env = {e["name"]: e for e in c["env"]}
    assert "GCACHE_RAFT_SECRET" not in env, "mount the Raft secret as a file"
    path = Path(env["GCACHE_RAFT_SECRET_FILE"]["value"])
    mount = next(m for m in c["volumeMounts"] if path.parent == Path(m["mountPath"]))
    assert mount.get("readOnly") is True
    volume = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}[mount["name"]]
    item = next(i for i in volume["secret"]["items"] if i["path"] == path.name)
    assert volume["secret"]["defaultMode"] & 0o007 == 0, "the Raft secret is not world-readable"
    return volume["secret"]["secretName"], item["key"]


@pytest.mark.parametrize("source", _sources())
def test_only_masters_get_the_raft_secret(source):
    """pysyncobj unpickles what it decrypts with the Raft secret: the masters get their own,
    from a Secret the server DaemonSet never mounts, and it is not the token's."""
    objs = source()
    sts, ds = one(objs, "StatefulSet"), one(objs, "DaemonSet")
    name, key = raft_secret_of(sts)
    token_ref = {e["name"]: e for e in container(sts, "master")["env"]}["GCACHE_TOKEN"]
    assert name != token_ref["valueFrom"]["secretKeyRef"]["name"], \
        "the Raft secret must live in its own Secret, apart from the token"
    secret = one(objs, "Secret", name)
    assert "REPLACE" in secret["stringData"][key], "the example Raft secret must say so"
    assert secret["stringData"][key] != one(objs, "Secret", token_ref["valueFrom"][
        "secretKeyRef"]["name"])["stringData"]["token"]
    assert name in secret_refs(sts)
    assert name not in secret_refs(ds), "the servers must never be able to read the Raft secret"
    server_env = {e["name"] for c in ds["spec"]["template"]["spec"]["containers"]
                  for e in c.get("env", [])}
    assert not {"GCACHE_RAFT_SECRET", "GCACHE_RAFT_SECRET_FILE"} & server_env
    check_flags("master", {"--raft-secret-file"}, f"{source.__name__} StatefulSet")


def test_systemd_raft_secret_is_the_masters_alone():
    """The env file is read by both units: the Raft secret is a credential of the master
    unit only, never a variable in gcache.env."""
    env = read_env_example()
    assert not any(k.startswith("GCACHE_RAFT_SECRET") for k in env)
    units = {}
    for unit in ("gcache-master", "gcache-server"):
        cp = configparser.ConfigParser(strict=False, interpolation=None)
        cp.optionxform = str
        cp.read_string((SYSTEMD / f"{unit}.service").read_text())
        units[unit] = cp["Service"]
    master, server = units["gcache-master"], units["gcache-server"]
    cred_name, cred_path = master["LoadCredential"].split(":", 1)
    assert cred_path.startswith("/etc/gcache/") and cred_path != "/etc/gcache/gcache.env"
    argv = shlex.split(master["ExecStart"].replace("\\\n", " ").replace("\n", " "))
    assert argv[argv.index("--raft-secret-file") + 1] == f"%d/{cred_name}"
    assert "raft" not in " ".join(f"{k}={v}" for k, v in server.items()).lower()


# ---------------------------------------------------------------- servers


@pytest.mark.parametrize("source", _sources())
def test_servers_daemonset(source):
    objs = source()
    ds = one(objs, "DaemonSet")
    sts = one(objs, "StatefulSet")
    pod = ds["spec"]["template"]["spec"]
    c = container(ds, "server")
    args = server_args(ds)
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists"
               for t in pod["tolerations"])
    assert pod["terminationGracePeriodSeconds"] >= 60
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    pod_labels(ds)

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    shm = volumes[mounts[args["--shm-dir"]]]
    assert args["--shm-dir"] == "/dev/shm" and shm["hostPath"]["path"] == "/dev/shm"
    disk = volumes[mounts[args["--disk-dir"]]]
    assert disk["hostPath"]["path"].startswith("/mnt/nvme")
    parse_size(args["--disk"])

    env = {e["name"]: e for e in c["env"]}
    assert args["--name"] == "$(NODE_NAME)"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(c["args"])):
        assert ref in env, f"$({ref}) is not a container env var: kubelet leaves it literal"
    check_token_env(objs, c)

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(args["--listen"].rsplit(":", 1)[1]) == ports["data"] == 7070
    assert int(args["--metrics-listen"].rsplit(":", 1)[1]) == ports["metrics"] == 9100
    for probe, path in (("startupProbe", "/healthz"), ("readinessProbe", "/readyz"),
                        ("livenessProbe", "/healthz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path and get["port"] in ("metrics", 9100)

    arena = parse_size(args["--memory"])
    res = c["resources"]
    assert k8s_quantity(res["limits"]["memory"]) >= arena + 2**30, \
        "the arena's shmem pages are charged to the pod: the limit must exceed --memory"
    assert res["requests"]["memory"] == res["limits"]["memory"]

    headless = sts["spec"]["serviceName"]
    assert args["--masters"].split(",") == master_fqdns(sts, headless, NAMESPACE)

    cfg_dir, cfg_key = os.path.split(args["--config"])
    cfg_volume = volumes[mounts[cfg_dir]]
    cm = one(objs, "ConfigMap", cfg_volume["configMap"]["name"])
    assert cfg_key in cm["data"]
    check_flags("server", set(args), f"{source.__name__} DaemonSet")


# ---------------------------------------------------------------- config


def check_toml_keys(data: dict, where: str) -> None:
    master_opts = {n for n, o in OPTIONS.items() if o.scope in ("master", "common")}
    has_master_scope = any(o.scope == "master" for o in OPTIONS.values())
    for table, values in data.items():
        assert table in ("server", "client", "master"), f"{where}: unknown table [{table}]"
        for key in values:
            if table == "master":
                allowed = master_opts if has_master_scope else master_opts | MASTER_SPEC_KEYS
                assert key in allowed, f"{where}: [master] {key} is not a master option"
            else:
                assert key in OPTIONS, f"{where}: [{table}] {key} is not in gcache.config.OPTIONS"
                assert OPTIONS[key].scope in (table, "common"), \
                    f"{where}: [{table}] {key} is a {OPTIONS[key].scope} option"
            assert key != "token", f"{where}: the token belongs in a Secret / env file"


@pytest.mark.parametrize("source", _sources())
def test_configmap_toml_is_valid_config(source, tmp_path):
    cm = one(source(), "ConfigMap")
    assert cm["data"], "empty ConfigMap"
    for key, text in cm["data"].items():
        assert key.endswith(".toml")
        check_toml_keys(tomllib.loads(text), f"ConfigMap {key}")
        path = tmp_path / key
        path.write_text(text)
        for scope in ("server", "client"):
            load_config(scope, path, env={})  # the real loader: types, ranges, unknown keys


def test_example_config_is_valid(tmp_path):
    path = CONFIG / "gcache.toml.example"
    check_toml_keys(tomllib.loads(path.read_text()), path.name)
    for scope in ("server", "client"):
        load_config(scope, path, env={})


# ---------------------------------------------------------------- systemd


def read_env_example() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (CONFIG / "gcache.env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"bad env line {line!r}"
            out[key] = value
    return out


def test_env_example_names_only_real_variables():
    env = read_env_example()
    assert "REPLACE" in env["GCACHE_TOKEN"], "the example token must say so"
    daemon_envs = {o.env for o in OPTIONS.values()}
    try:
        from gcache.master.cli import main as master_main
        daemon_envs |= {p.envvar for p in master_main.params if isinstance(p.envvar, str)}
    except ImportError:
        pass
    for key in env:
        if key.startswith("GCACHE_"):
            assert key in daemon_envs, f"{key} is read by no gcache daemon"


@pytest.mark.parametrize("unit", ["gcache-master", "gcache-server"])
def test_systemd_unit(unit):
    path = SYSTEMD / f"{unit}.service"
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read_string(path.read_text(), source=str(path))
    assert {"Unit", "Service", "Install"} <= set(cp.sections())
    svc = cp["Service"]
    assert svc["Restart"] == "on-failure"
    assert svc["KillSignal"] == "SIGTERM"
    assert int(svc["TimeoutStopSec"].rstrip("s")) >= 30
    assert svc["LimitMEMLOCK"] and svc["LimitNOFILE"]
    assert svc["EnvironmentFile"].lstrip("-") == "/etc/gcache/gcache.env"
    assert svc["User"] == "gcache"
    assert cp["Install"]["WantedBy"] == "multi-user.target"

    argv = shlex.split(svc["ExecStart"].replace("\\\n", " ").replace("\n", " "))
    assert Path(argv[0]).name == unit
    flags = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")}
    check_flags(unit.removeprefix("gcache-"), flags, path.name)
    assert "--token" not in flags, "the token comes from the env file, not the command line"
    env = read_env_example()
    for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", svc["ExecStart"]):
        assert var in env, f"{path.name} uses ${{{var}}}, which gcache.env.example lacks"
    if unit == "gcache-server":
        assert "/dev/shm" in svc["ReadWritePaths"]
        assert svc.get("RemoveIPC", "no") == "no"
        assert svc.get("PrivateDevices", "no") == "no", "the arena lives in the host /dev/shm"
    else:
        i = argv.index("--data-dir")
        assert argv[i + 1] == "/var/lib/" + svc["StateDirectory"]


# ---------------------------------------------------------------- image


def test_dockerfile_copies_the_package_and_matches_the_manifests():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = set(project["tool"]["setuptools"]["package-dir"].values())
    sources: set[str] = set()
    for line in re.findall(r"^COPY (?!--)(.+)$", text, re.M):
        *srcs, _dest = line.split()
        sources |= {src.rstrip("/") for src in srcs}
    for src in sources:
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
    assert package_dirs | {"pyproject.toml", project["project"]["readme"]} <= sources, \
        f"Dockerfile misses {package_dirs - sources}"
    assert "torch" not in re.sub(r"#.*", "", text).replace("! pip show torch", "")
    uid = re.search(r"--uid (\d+)", text)[1]
    image = f"gcache:{project['project']['version']}"
    for wl in (one(plain_objects(), "StatefulSet"), one(plain_objects(), "DaemonSet")):
        assert container(wl)["image"] == image
        assert str(wl["spec"]["template"]["spec"]["securityContext"]["runAsUser"]) == uid


@pytest.mark.timeout(60)
def test_service_monitors_behind_a_value_scrape_servers_and_masters_once() -> None:
    assert by_kind(render_chart(), "ServiceMonitor") == []  # off by default
    objs = render_chart({"monitoring": {"serviceMonitor": {
        "enabled": True, "labels": {"release": "prometheus"}}}})
    monitors = {o["metadata"]["name"]: o for o in by_kind(objs, "ServiceMonitor")}
    assert set(monitors) == {"gcache-server", "gcache-master"}
    services = by_kind(objs, "Service")
    for name, port in (("gcache-server", "metrics"), ("gcache-master", "api")):
        sm = monitors[name]
        assert sm["metadata"]["labels"]["release"] == "prometheus"
        (ep,) = sm["spec"]["endpoints"]
        assert ep["path"] == "/metrics" and ep["port"] == port
        want = sm["spec"]["selector"]["matchLabels"]
        chosen = [s for s in services if want.items() <= s["metadata"]["labels"].items()]
        assert len(chosen) == 1, f"{name} must select exactly one Service, not {len(chosen)}"
        svc = chosen[0]
        assert port in {p["name"] for p in svc["spec"]["ports"]}
        assert svc["spec"]["publishNotReadyAddresses"] is True
        workload = next(o for o in objs if o["kind"] in ("DaemonSet", "StatefulSet")
                        and svc["spec"]["selector"].items() <= pod_labels(o).items())
        assert workload["kind"] == ("DaemonSet" if name == "gcache-server" else "StatefulSet")
    for svc in services:
        if svc["metadata"]["name"].endswith("-metrics"):
            validate(svc)
