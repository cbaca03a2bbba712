"""Every deployment file in compose/ is valid for the tool that reads it and agrees with the code:
docker-compose and the Compose Specification, Kubernetes' schemas, KEDA's CRD; and the commands,
ports, images, environment variables, Redis keys and metric names match what tidegate runs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tidegate import keys
from tidegate.commands.cli import build_parser
from tidegate.model_files.served_model import served_models
from tidegate.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
SCHEMAS = Path(__file__).with_name("schemas")
K8S_VERSION = "1.33"
# Variables the files set that are not tidegate settings, and who reads them.
OTHER_ENV = {"REDIS_ADDRESS",  # KEDA's redis-streams scaler (addressFromEnv)
             "HF_HOME", "HF_TOKEN"}  # huggingface_hub: the shared model cache, gated repos


def compose() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def k8s_docs() -> list[dict]:
    docs = []
    for path in sorted((COMPOSE / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def containers() -> list[dict]:
    return [c for d in k8s_docs() if d["kind"] == "Deployment"
            for c in d["spec"]["template"]["spec"]["containers"]]


def option(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


# ---------------------------------------------------------------- validity


def test_compose_file_passes_docker_compose_config() -> None:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is missing: `make compose-tools` (Debian's package) installs it"
    out = subprocess.run([exe, "-f", str(COMPOSE / "docker-compose.yml"), "config", "-q"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_compose_file_matches_the_compose_specification() -> None:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    jsonschema.validate(compose(), schema)


def test_compose_requirements_redis_aof_gpu_and_healthchecks() -> None:
    services = compose()["services"]
    assert {"redis", "api", "gateway", "worker", "batch-worker", "prometheus"} <= set(services)
    assert "--appendonly" in services["redis"]["command"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    for name in ("redis", "api", "gateway", "worker", "batch-worker"):
        assert "healthcheck" in services[name], name


@pytest.mark.parametrize("name", ["keda-scaledobject.yaml", "keda-scaledobject-ttft.yaml"])
def test_keda_objects_match_kedas_crd(name: str) -> None:
    crd = yaml.safe_load((SCHEMAS / "keda.sh_scaledobjects.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = version["schema"]["openAPIV3Schema"]
    for doc in yaml.safe_load_all((COMPOSE / "k8s" / name).read_text()):
        assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
        jsonschema.validate(doc, schema)


def test_kubernetes_manifests_are_valid() -> None:
    kinds = set()
    for doc in k8s_docs():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a custom resource: checked against KEDA's CRD above
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "ConfigMap"} <= kinds


def test_grafana_dashboard_queries_only_exported_metrics() -> None:
    dash = json.loads((COMPOSE / "grafana-dashboard.json").read_text())
    exported = set()
    for source in ("worker/service/metrics.py", "tidegate/operations/operator_routes.py", "streaming/gateway.py"):
        exported |= set(re.findall(r'"(tidegate_[a-z_]+)"', (ROOT / source).read_text()))
    used = {name for panel in dash["panels"] for t in panel["targets"]
            for name in re.findall(r"tidegate_[a-z_]+", t["expr"])}
    assert used
    suffixes = ("_total", "_bucket", "_count", "_sum")
    missing = {u for u in used if u not in exported
               and not any(u.endswith(s) and u[: -len(s)] in exported for s in suffixes)}
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"


# ---------------------------------------------------------------- agreement with the code


def parse(args: list[str]) -> object:
    try:
        return build_parser().parse_args(args)
    except SystemExit as exc:  # argparse's way of refusing
        raise AssertionError(f"tidegate rejects {args}") from exc


def test_commands_parse_with_the_cli_and_ports_agree() -> None:
    services = compose()["services"]
    seen = set()
    batch = parse(services["batch-worker"]["command"])
    assert batch.command == "batch-worker"  # type: ignore[attr-defined]
    assert f"127.0.0.1:{batch.status_port}/readyz" in " ".join(  # type: ignore[attr-defined]
        services["batch-worker"]["healthcheck"]["test"])
    for name in ("api", "gateway", "worker"):
        args = services[name]["command"]
        assert parse(args).command == name
        seen.add(name)
        port = option(args, "--port")
        if port:
            assert any(p.endswith(f":{port}") for p in services[name]["ports"]), name
            assert f"127.0.0.1:{port}/readyz" in " ".join(services[name]["healthcheck"]["test"])
    worker_port = services["worker"]["environment"]["TIDEGATE_METRICS_PORT"]
    assert f"127.0.0.1:{worker_port}/readyz" in " ".join(services["worker"]["healthcheck"]["test"])
    for c in containers():
        args = c["args"]
        assert parse(args).command == c["name"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        port = option(args, "--port")
        if port:
            assert ports["http"] == int(port)
        else:  # the worker: its status port from the environment
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert ports["status"] == int(env["TIDEGATE_METRICS_PORT"])
        for probe in ("livenessProbe", "readinessProbe"):
            path = c[probe]["httpGet"]["path"]
            assert path == {"livenessProbe": "/healthz", "readinessProbe": "/readyz"}[probe]
            assert c[probe]["httpGet"]["port"] in ports
        seen.add(c["name"])
    assert seen == {"api", "gateway", "worker"}


def test_images_and_dockerfiles_agree() -> None:
    services = compose()["services"]
    images = {name: services[name]["image"] for name in ("api", "gateway", "worker")}
    images.update({c["name"]: c["image"] for c in containers()})
    assert images["api"] == images["gateway"] == "tidegate:cpu"
    assert images["worker"] == "tidegate:cuda"
    for dockerfile, port in (("Dockerfile", "8000"), ("Dockerfile.cuda", "9400")):
        text = (COMPOSE / dockerfile).read_text()
        assert 'ENTRYPOINT ["tidegate"]' in text and f"EXPOSE {port}" in text.replace(
            "EXPOSE 8000 8001 9400", "EXPOSE 8000 EXPOSE 9400")
        cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
        parse(cmd)
        # Every source package the wheel needs is copied in.
        for package in ("tidegate", "producer", "worker", "kernels", "streaming"):
            assert f"COPY {package} {package}" in text
    assert services["api"]["build"]["dockerfile"] == "compose/Dockerfile"
    assert services["worker"]["build"]["dockerfile"] == "compose/Dockerfile.cuda"


def test_environment_variables_are_tidegate_settings() -> None:
    known = {f"TIDEGATE_{name.upper()}" for name in Settings.model_fields} | OTHER_ENV
    names = set()
    services = compose()["services"]
    for name in ("api", "gateway", "worker", "batch-worker"):
        names |= set(services[name]["environment"])
    config = next(d for d in k8s_docs() if d["kind"] == "ConfigMap")
    names |= set(config["data"])
    for c in containers() + init_containers():
        names |= {e["name"] for e in c.get("env", [])}
    assert names and names <= known, f"unknown variables: {names - known}"


def init_containers() -> list[dict]:
    return [c for d in k8s_docs() if d["kind"] == "Deployment"
            for c in d["spec"]["template"]["spec"].get("initContainers", [])]


def test_the_model_cache_is_one_volume_every_role_shares_filled_by_pull_first() -> None:
    services = compose()["services"]
    pull = services["model-pull"]
    assert parse(pull["command"]).command == "pull"  # type: ignore[attr-defined]
    home = pull["environment"]["HF_HOME"]
    [volume] = pull["volumes"]
    assert volume.split(":") == ["hf-cache", home] and "hf-cache" in compose()["volumes"]
    for name in ("api", "worker", "batch-worker"):
        assert services[name]["volumes"] == [volume], name
        assert services[name]["environment"]["HF_HOME"] == home
        after = services[name]["depends_on"]["model-pull"]["condition"]
        assert after == "service_completed_successfully", name
    config = next(d for d in k8s_docs() if d["kind"] == "ConfigMap")
    claim = next(d for d in k8s_docs() if d["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on every node share it
    for d in k8s_docs():
        if d["kind"] != "Deployment" or d["metadata"]["name"] == "tidegate-gateway":
            continue
        pod = d["spec"]["template"]["spec"]
        [init] = pod["initContainers"]
        pulled = parse(init["args"])
        assert pulled.command == "pull"  # type: ignore[attr-defined]
        [main] = pod["containers"]
        [mount] = {m["mountPath"] for c in (init, main) for m in c["volumeMounts"]}
        assert mount == config["data"]["HF_HOME"]
        [source] = pod["volumes"]
        assert source["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        served = parse(main["args"])
        # The worker pulls the model it serves; the API the tokenizers of every served model.
        assert getattr(pulled, "model", None) == getattr(served, "model", None)
        assert pulled.tokenizer_only == (main["name"] == "api")  # type: ignore[attr-defined]


def test_prometheus_scrapes_every_role_where_it_listens() -> None:
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    services = compose()["services"]
    expected = {f"api:{option(services['api']['command'], '--port')}",
                f"gateway:{option(services['gateway']['command'], '--port')}",
                f"worker:{services['worker']['environment']['TIDEGATE_METRICS_PORT']}"}
    assert targets == expected


def test_keda_scales_each_model_s_workers_on_its_real_streams_and_group() -> None:
    """One ScaledObject per served model (config.yaml's TIDEGATE_MODELS), on the lane streams
    of the model its Deployment's workers serve."""
    config = next(d for d in k8s_docs() if d["kind"] == "ConfigMap")["data"]
    served = {m.name for m in served_models(Settings(models=config["TIDEGATE_MODELS"]))}
    deployments = {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] == "Deployment"}
    scaled = [d for d in yaml.safe_load_all(
        (COMPOSE / "k8s" / "keda-scaledobject.yaml").read_text()) if d]
    covered = set()
    for doc in scaled:
        target = deployments[doc["spec"]["scaleTargetRef"]["name"]]
        [container] = target["spec"]["template"]["spec"]["containers"]
        [model] = served_models(Settings(models=[option(container["args"], "--model")]))
        streams, routed = set(), set()
        for trigger in doc["spec"]["triggers"]:
            meta = trigger["metadata"]
            if trigger["type"] == "prometheus":  # the lanes' jobs on workers' routed streams
                assert float(meta["threshold"]) >= 1
                routed.add(meta["query"].strip())
                continue
            assert trigger["type"] == "redis-streams"
            assert meta["consumerGroup"] == keys.CONSUMER_GROUP
            assert int(meta["lagCount"]) >= 1 and int(meta["activationLagCount"]) >= 1
            assert meta["addressFromEnv"] in OTHER_ENV
            streams.add(meta["stream"])
        assert streams == {keys.lane_stream(model.name, lane, 0) for lane in keys.LANES}
        # The label the API's /metrics gives the summed routed streams (operator_routes.py).
        assert routed == {f'max(tidegate_queue_lag{{model="{model.name}",lane="{lane}",'
                          f'partition="routed"}})' for lane in keys.LANES}
        covered.add(model.name)
    assert covered == served
    ttft = yaml.safe_load((COMPOSE / "k8s" / "keda-scaledobject-ttft.yaml").read_text())
    assert "tidegate_time_to_first_token_seconds_bucket" in ttft["spec"]["triggers"][0][
        "metadata"]["query"]
