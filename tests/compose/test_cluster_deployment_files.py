"""The Redis Cluster deployment files (compose/docker-compose.cluster.yml, k8s/redis-cluster.yaml,
k8s/keda-scaledobject-cluster.yaml) are valid for the tools that read them, the same way the
single-Redis files are (test_deployment_files.py), and agree with the code and with each other:
the cluster URL names real nodes, the init command joins all six with one replica per master,
KEDA reads the lane streams tidegate writes. Where the machine allows private namespaces, the two
cluster-forming scripts are also run against six real redis-servers."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.compose.test_deployment_files import COMPOSE, K8S_VERSION, SCHEMAS, option
from tests.compose.test_deployment_files import compose as single_compose
from tidegate import keys
from tidegate.model_files.served_model import served_models
from tidegate.redis_conn import cluster_nodes, is_cluster_url
from tidegate.settings import Settings

CLUSTER_COMPOSE = COMPOSE / "docker-compose.cluster.yml"
REDIS_CLUSTER = COMPOSE / "k8s" / "redis-cluster.yaml"
KEDA_CLUSTER = COMPOSE / "k8s" / "keda-scaledobject-cluster.yaml"
ROLES = ("api", "gateway", "worker", "batch-worker")
NODES = 6
REDIS_PORT = 6379


def cluster_compose() -> dict:
    return yaml.safe_load(CLUSTER_COMPOSE.read_text())


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def one(path: Path, kind: str) -> dict:
    [doc] = [d for d in docs(path) if d["kind"] == kind]
    return doc


def redis_options(args: list[str]) -> dict[str, str]:
    """`--name value` pairs of a redis-server command line."""
    assert "redis-server" in args, args
    rest = args[args.index("redis-server") + 1:]
    assert len(rest) % 2 == 0 and all(a.startswith("--") for a in rest[::2]), rest
    return dict(zip(rest[::2], rest[1::2], strict=True))


def node_services(services: dict) -> list[str]:
    """The compose services that run a cluster-enabled redis-server."""
    return sorted(name for name, s in services.items() if isinstance(s.get("command"), list)
                  and "redis-server" in s["command"]
                  and redis_options(s["command"]).get("--cluster-enabled") == "yes")


def compose_script(command: list[str]) -> str:
    """The shell script of a compose `sh -ec <script>` command, as the container's shell gets it
    (compose turns `$$` into `$`)."""
    assert command[:2] == ["sh", "-ec"], command
    return command[2].replace("$$", "$")


def assert_shell_parses(script: str) -> None:
    out = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr


def statefulset_dns_names() -> tuple[list[str], str]:
    """The pods' stable names within their namespace (`<pod>.<service>`), and their port."""
    sts = one(REDIS_CLUSTER, "StatefulSet")
    service = one(REDIS_CLUSTER, "Service")
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    [port] = [p["port"] for p in service["spec"]["ports"] if p["name"] == "redis"]
    name, svc = sts["metadata"]["name"], service["metadata"]["name"]
    return [f"{name}-{i}.{svc}" for i in range(sts["spec"]["replicas"])], port


def redis_container() -> dict:
    [c] = one(REDIS_CLUSTER, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    return c


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def secret_ref(container: dict, name: str) -> tuple[str, str]:
    ref = env_of(container)[name]["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


# ---------------------------------------------------------------- compose


def test_cluster_compose_file_passes_docker_compose_config() -> None:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is missing: `make compose-tools` (Debian's package) installs it"
    out = subprocess.run([exe, "-f", str(CLUSTER_COMPOSE), "config", "-q"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # The command the file's header gives is the one that was just checked.
    assert f"docker-compose -f compose/{CLUSTER_COMPOSE.name} up" in CLUSTER_COMPOSE.read_text()


def test_cluster_compose_file_matches_the_compose_specification() -> None:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    jsonschema.validate(cluster_compose(), schema)


def test_cluster_compose_runs_six_redis7_cluster_nodes_with_aof_each_on_its_volume() -> None:
    services = cluster_compose()["services"]
    nodes = node_services(services)
    assert len(nodes) == NODES
    volumes = set()
    for name in nodes:
        node = services[name]
        assert re.fullmatch(r"redis:7\.\d+", node["image"]), node["image"]
        opts = redis_options(node["command"])
        assert opts["--appendonly"] == "yes" and opts["--appendfsync"] == "everysec"
        assert int(opts["--cluster-node-timeout"]) == 5000
        assert "PONG" in " ".join(node["healthcheck"]["test"])
        [volume] = node["volumes"]
        source, target = volume.split(":")
        assert target == "/data" and source in cluster_compose()["volumes"]
        volumes.add(source)
    assert len(volumes) == NODES  # one node's AOF and nodes.conf never in another's volume


def test_cluster_compose_init_joins_all_six_nodes_with_one_replica_per_master() -> None:
    services = cluster_compose()["services"]
    nodes = node_services(services)
    init = services["redis-init"]
    script = compose_script(init["command"])
    assert_shell_parses(script)
    assert "redis-cli --cluster create" in script
    assert re.search(r"--cluster-replicas 1\b", script) and "--cluster-yes" in script
    assert sorted(set(re.findall(r"\bredis-\d+\b", script))) == nodes
    # It starts once every node answers, and runs once.
    assert init["depends_on"] == {n: {"condition": "service_healthy"} for n in nodes}
    assert init["restart"] == "no"


def test_cluster_compose_url_names_nodes_of_the_file() -> None:
    services = cluster_compose()["services"]
    nodes = node_services(services)
    urls = {services[role]["environment"]["TIDEGATE_REDIS_URL"] for role in ROLES}
    [url] = urls  # every role on the same cluster
    assert is_cluster_url(url)
    assert Settings(redis_url=url).redis_url == url
    seeds, _ = cluster_nodes(url)
    assert seeds and {host for host, _ in seeds} <= set(nodes)
    assert {port for _, port in seeds} == {REDIS_PORT}


def test_cluster_compose_roles_are_the_single_redis_stack_s_on_the_cluster() -> None:
    """api, gateway, worker, batch worker and Prometheus as docker-compose.yml defines them (so
    test_deployment_files.py's checks of commands, ports and images hold here too), but on the
    cluster and started once it is formed."""
    single, cluster = single_compose()["services"], cluster_compose()["services"]
    assert set(cluster) == (set(single) - {"redis"}) | set(node_services(cluster)) | {"redis-init"}
    for role in (*ROLES, "prometheus"):
        mine, theirs = dict(cluster[role]), dict(single[role])
        if role in ROLES:
            pulled = {"model-pull": {"condition": "service_completed_successfully"}}
            if role == "gateway":  # it reads no model
                pulled = {}
            assert mine.pop("depends_on") == {
                "redis-init": {"condition": "service_completed_successfully"}, **pulled}
            assert theirs.pop("depends_on") == {"redis": {"condition": "service_healthy"},
                                                **pulled}
            mine["environment"] = {k: v for k, v in mine["environment"].items()
                                   if k != "TIDEGATE_REDIS_URL"}
            theirs["environment"] = {k: v for k, v in theirs["environment"].items()
                                     if k != "TIDEGATE_REDIS_URL"}
        assert mine == theirs, role


# ---------------------------------------------------------------- Kubernetes


def test_redis_cluster_manifests_are_valid_kubernetes() -> None:
    kinds = []
    for doc in docs(REDIS_CLUSTER):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["Job", "Service", "StatefulSet"]


def test_redis_cluster_statefulset_runs_six_announced_aof_nodes() -> None:
    sts = one(REDIS_CLUSTER, "StatefulSet")
    service = one(REDIS_CLUSTER, "Service")
    assert sts["spec"]["replicas"] == NODES
    assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    c = redis_container()
    assert re.fullmatch(r"redis:7\.\d+", c["image"]), c["image"]
    opts = redis_options(c["args"])
    assert opts["--cluster-enabled"] == "yes"
    assert opts["--appendonly"] == "yes" and opts["--appendfsync"] == "everysec"
    env = env_of(c)
    # Every $(VAR) of the args is defined, so Kubernetes expands it (it leaves unknown ones).
    for var in re.findall(r"\$\((\w+)\)", " ".join(c["args"])):
        assert var in env, var
    announced = re.fullmatch(r"\$\((\w+)\)", opts["--cluster-announce-ip"])
    assert announced
    assert env[announced.group(1)]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # Replicas authenticate to their masters with the clients' password.
    assert opts["--requirepass"] == opts["--masterauth"]
    # Identity (nodes.conf) and data survive a restart: both on the claimed volume.
    [claim] = sts["spec"]["volumeClaimTemplates"]
    [mount] = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert opts["--cluster-config-file"].startswith(mount["mountPath"].rstrip("/") + "/")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["redis"] == REDIS_PORT and ports["bus"] == REDIS_PORT + 10000
    probe = " ".join(c["readinessProbe"]["exec"]["command"])
    assert "redis-cli ping" in probe and "PONG" in probe


def test_redis_cluster_job_joins_the_statefulset_pods_by_their_dns_names() -> None:
    job = one(REDIS_CLUSTER, "Job")
    spec = job["spec"]["template"]["spec"]
    assert spec["restartPolicy"] in {"OnFailure", "Never"}
    [c] = spec["containers"]
    assert c["command"] == ["sh", "-ec"]
    [script] = c["args"]
    assert_shell_parses(script)
    assert "redis-cli --cluster create" in script
    assert re.search(r"--cluster-replicas 1\b", script) and "--cluster-yes" in script
    # redis-cluster-$i.redis-cluster.$NAMESPACE.svc.cluster.local for every pod index.
    names, _ = statefulset_dns_names()
    pod, svc = names[0].split(".")[0].rsplit("-", 1)[0], names[0].split(".")[1]
    template = re.search(r'"(\S+\$i\S*\.svc\.cluster\.local)"', script)
    assert template and template.group(1) == f"{pod}-$i.{svc}.$NAMESPACE.svc.cluster.local"
    loop = re.search(r"for i in ([\d ]+); do", script)
    assert loop and [int(i) for i in loop.group(1).split()] == list(range(len(names)))
    env = env_of(c)
    assert env["NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # redis-cli reads its password from REDISCLI_AUTH: the one the servers require.
    assert secret_ref(c, "REDISCLI_AUTH") == secret_ref(redis_container(), "REDISCLI_AUTH")


def test_config_yaml_shows_the_cluster_url_of_redis_cluster_yaml() -> None:
    text = (COMPOSE / "k8s" / "config.yaml").read_text()
    config = one(COMPOSE / "k8s" / "config.yaml", "ConfigMap")["data"]
    assert not is_cluster_url(config["TIDEGATE_REDIS_URL"])  # the default stays single Redis
    [url] = re.findall(r"^\s*#\s*TIDEGATE_REDIS_URL:\s*(\S+)\s*$", text, re.M)
    assert is_cluster_url(url)
    seeds, options = cluster_nodes(url)
    names, port = statefulset_dns_names()
    assert seeds and {host for host, _ in seeds} <= set(names)
    assert {p for _, p in seeds} == {port}
    assert options.get("password")  # the cluster requires one


# ---------------------------------------------------------------- KEDA


def test_cluster_keda_objects_match_kedas_crds() -> None:
    crds = {}
    for name in ("keda.sh_scaledobjects.yaml", "keda.sh_triggerauthentications.yaml"):
        crd = yaml.safe_load((SCHEMAS / name).read_text())
        version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
        crds[crd["spec"]["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    kinds = []
    for doc in docs(KEDA_CLUSTER):
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        jsonschema.validate(doc, crds[doc["kind"]])
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["ScaledObject", "TriggerAuthentication"]


def test_cluster_keda_scales_each_model_s_workers_on_its_lane_streams_in_the_cluster() -> None:
    """One redis-cluster-streams trigger per lane partition stream of the model its Deployment's
    workers serve, seeded with the StatefulSet's pods, authenticated with the Redis pods'
    password; thresholds and routed-stream triggers as keda-scaledobject.yaml's."""
    config = one(COMPOSE / "k8s" / "config.yaml", "ConfigMap")["data"]
    settings = Settings(models=config["TIDEGATE_MODELS"],
                        **({"lane_partitions": config["TIDEGATE_LANE_PARTITIONS"]}
                           if "TIDEGATE_LANE_PARTITIONS" in config else {}))
    served = {m.name for m in served_models(settings)}
    deployments = {d["metadata"]["name"]: d for path in (COMPOSE / "k8s").glob("*.yaml")
                   for d in docs(path) if d["kind"] == "Deployment"}
    auth = one(KEDA_CLUSTER, "TriggerAuthentication")
    [password] = [r for r in auth["spec"]["secretTargetRef"] if r["parameter"] == "password"]
    assert (password["name"], password["key"]) == secret_ref(redis_container(), "REDISCLI_AUTH")
    names, port = statefulset_dns_names()
    single = {d["metadata"]["name"]: d for d in docs(COMPOSE / "k8s" / "keda-scaledobject.yaml")}
    covered = set()
    for doc in (d for d in docs(KEDA_CLUSTER) if d["kind"] == "ScaledObject"):
        target = deployments[doc["spec"]["scaleTargetRef"]["name"]]
        [container] = target["spec"]["template"]["spec"]["containers"]
        [model] = served_models(Settings(models=[option(container["args"], "--model")]))
        # The single-Redis object this one replaces: same name, target and limits.
        theirs = single[doc["metadata"]["name"]]
        assert {k: v for k, v in doc["spec"].items() if k != "triggers"} == {
            k: v for k, v in theirs["spec"].items() if k != "triggers"}
        their_lag = {t["metadata"]["stream"]: t["metadata"] for t in theirs["spec"]["triggers"]
                     if t["type"] == "redis-streams"}
        streams = []
        for trigger in doc["spec"]["triggers"]:
            meta = trigger["metadata"]
            if trigger["type"] == "prometheus":
                assert trigger in theirs["spec"]["triggers"]
                continue
            assert trigger["type"] == "redis-cluster-streams"
            assert {"addresses", "stream", "consumerGroup", "lagCount",
                    "activationLagCount"} <= set(meta)
            assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
            assert meta["consumerGroup"] == keys.CONSUMER_GROUP
            assert int(meta["lagCount"]) >= 1 and int(meta["activationLagCount"]) >= 1
            # KEDA connects from its own namespace: full names, all in one namespace.
            seeds = meta["addresses"].split(",")
            namespaces = set()
            for seed in seeds:
                found = re.fullmatch(r"([\w-]+\.[\w-]+)\.([\w-]+)\.svc\.cluster\.local:(\d+)", seed)
                assert found, seed
                assert found.group(1) in names and int(found.group(3)) == port
                namespaces.add(found.group(2))
            assert len(namespaces) == 1 and len(set(seeds)) == len(seeds) == len(names)
            # A partition's threshold: its lane's single-Redis one, split over the partitions.
            parsed = keys.parse_lane_stream(meta["stream"])
            assert parsed and parsed[0] == model.name
            lane_single = their_lag[keys.lane_stream(model.name, parsed[1], 0)]
            assert int(meta["lagCount"]) == max(
                1, int(lane_single["lagCount"]) // settings.lane_partitions)
            assert meta["activationLagCount"] == lane_single["activationLagCount"]
            streams.append(meta["stream"])
        assert sorted(streams) == sorted(
            keys.lane_stream(model.name, lane, p)
            for lane in keys.LANES for p in range(settings.lane_partitions))
        assert len([t for t in doc["spec"]["triggers"] if t["type"] == "prometheus"]) == len(
            [t for t in theirs["spec"]["triggers"] if t["type"] == "prometheus"])
        covered.add(model.name)
    assert covered == served


# ---------------------------------------------------------------- the scripts, run


def _namespaces_usable() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip") and shutil.which("redis-server")
            and shutil.which("redis-cli") and shutil.which("getent")):
        return False
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
    major = re.search(r"v=(\d+)\.", version.stdout)
    if not major or int(major.group(1)) < 7:
        return False
    probe = subprocess.run(["unshare", "-rnmp", "--kill-child", "--mount-proc",
                            "ip", "link", "set", "lo", "up"],
                           capture_output=True, timeout=10)
    return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(
    not _namespaces_usable(),
    reason="needs unprivileged user, network, mount and pid namespaces and redis-server 7+")


def form_cluster(tmp_path: Path, hosts: list[str], server_args: list[str], command: list[str],
                 env: dict[str, str]) -> str:
    """Starts one redis-server per host name (its own loopback address, port 6379, the names in
    a private /etc/hosts) with the file's server arguments, runs the file's init command twice
    (the second finds the cluster formed), and returns CLUSTER NODES once the replicas joined.
    Everything runs in fresh namespaces: the servers die with them, hung or not."""
    lines = ["set -e", f"mount --bind {tmp_path / 'hosts'} /etc/hosts", "ip link set lo up",
             # getent's IPv4 lookups (AI_ADDRCONFIG) need an address off loopback, as any
             # container has.
             "ip addr add 10.99.0.1/32 dev lo"]
    ips = [f"127.0.0.{10 + i}" for i in range(len(hosts))]
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
        f"{ip} {host}\n" for ip, host in zip(ips, hosts, strict=True)))
    for i, ip in enumerate(ips):
        data = tmp_path / f"node{i}"
        data.mkdir()
        values = dict(env, POD_IP=ip)
        args = [re.sub(r"\$\((\w+)\)", lambda m, v=values: v[m.group(1)], a) for a in server_args]
        args = [str(data) + a[len("/data"):] if a.startswith("/data/") else a for a in args]
        # bind-source-addr: the cluster bus leaves from the node's own address, as in a pod.
        lines.append(shlex.join(["redis-server", *args, "--bind", ip, "--bind-source-addr", ip,
                                 "--port", str(REDIS_PORT), "--dir", str(data),
                                 "--daemonize", "yes", "--logfile", str(data / "log")]))
        lines.append(f"until redis-cli -h {ip} ping | grep -q PONG; do sleep 0.1; done")
    lines += [shlex.join(command), shlex.join(command),
              f"for i in $(seq 300); do [ $(redis-cli -h {ips[0]} cluster nodes | grep -c slave)"
              f" = {len(ips) // 2} ] && break; sleep 0.1; done",
              f"redis-cli -h {ips[0]} cluster nodes"]
    (tmp_path / "driver.sh").write_text("\n".join(lines) + "\n")
    # --kill-child: if the scripts hang, the timeout's kill of unshare takes the namespace's
    # first process down, and every server with it.
    out = subprocess.run(["unshare", "-rnmp", "--kill-child", "--mount-proc",
                          "sh", str(tmp_path / "driver.sh")],
                         capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def assert_three_masters_three_replicas(cluster_nodes_out: str) -> None:
    rows = [line.split() for line in cluster_nodes_out.splitlines()
            if re.match(r"^[0-9a-f]{40} ", line)][-NODES:]
    masters = [r for r in rows if "master" in r[2]]
    replicas = [r for r in rows if "slave" in r[2]]
    assert len(masters) == 3 and len(replicas) == 3, cluster_nodes_out[-2000:]
    assert all(len(r) > 8 for r in masters)  # every master serves slots
    assert {r[3] for r in replicas} == {r[0] for r in masters}  # one replica each


@needs_namespaces
def test_compose_init_forms_the_cluster_on_the_compose_nodes(tmp_path: Path) -> None:
    services = cluster_compose()["services"]
    nodes = node_services(services)
    command = services["redis-init"]["command"]
    out = form_cluster(tmp_path, nodes, services[nodes[0]]["command"][1:],
                       [*command[:2], compose_script(command)], {})
    assert "redis cluster ready" in out
    assert_three_masters_three_replicas(out)


@needs_namespaces
def test_k8s_job_forms_the_cluster_on_the_statefulset_pods(tmp_path: Path) -> None:
    names, _ = statefulset_dns_names()
    c = redis_container()
    [job] = one(REDIS_CLUSTER, "Job")["spec"]["template"]["spec"]["containers"]
    out = form_cluster(tmp_path, [f"{n}.tidegate.svc.cluster.local" for n in names],
                       c["args"][1:], [*job["command"], *job["args"]],
                       {"NAMESPACE": "tidegate", "REDISCLI_AUTH": "test-password"})
    assert "redis cluster ready" in out
    assert_three_masters_three_replicas(out)
