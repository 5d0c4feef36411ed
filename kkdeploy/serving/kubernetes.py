"""Kubernetes manifests for a written Triton repository: scale-out on paper, in files a cluster can apply.

What they say (docs/serving.md, "On a cluster"): one Deployment per repository and GPU type, pinned to that GPU
product (every engine was validated on the GPU it was built on); each pod runs ``tritonserver`` on the
repository with one model instance per GPU (``instance_group``), liveness on ``/v2/health/live`` and readiness on
``/v2/health/ready`` (the model's ready flag, which ``kkdeploy serve``'s watchdog turns false while a model is
broken); a Service in front; a HorizontalPodAutoscaler that adds replicas when Triton's queue time per request
grows (``nv_inference_queue_duration_us`` / ``nv_inference_request_success``, turned into a per-pod metric by the
Prometheus adapter rule in ``prometheus-adapter-rules.yaml``).

``check_manifests`` validates every file against the Kubernetes OpenAPI schemas (``kubernetes-validate``, strict:
an unknown field is an error), so a typo cannot reach a cluster.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import KKError

KUBERNETES_VERSION = "1.30.0"  # the schema version the manifests are checked against
QUEUE_METRIC = "kkdeploy_queue_us_per_request"
DEFAULT_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"  # Triton 2.51, as the nvidia-pytriton 0.7.0 server


def _name(info) -> str:
    return info.model.lower().replace("_", "-").replace(".", "-")[:50]


def manifests(info, manifest: dict, image: str = DEFAULT_IMAGE, repository_uri: str | None = None,
              target_queue_us: int = 2000, max_replicas: int = 8) -> dict[str, list[dict]]:
    """``{file name: [objects]}``. ``repository_uri``: where the cluster reads the repository (object storage)."""
    name = _name(info)
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "kkdeploy"}
    device = (manifest.get("environment") or {}).get("device") or {}
    gpu = info.device_type == "cuda"
    uri = repository_uri or f"s3://models/kkdeploy/{(device.get('name') or 'cpu').replace(' ', '-')}/{info.model}"
    resources = {"limits": {"nvidia.com/gpu": "1"}} if gpu else {"requests": {"cpu": "2", "memory": "4Gi"}}
    pod_spec = {
        "terminationGracePeriodSeconds": 30,
        "containers": [{
            "name": "tritonserver",
            "image": image,
            "args": ["tritonserver", f"--model-repository={uri}", "--strict-readiness=true",
                     "--exit-timeout-secs=10", "--model-control-mode=explicit", f"--load-model={info.model}"],
            "ports": [{"name": "http", "containerPort": 8000}, {"name": "grpc", "containerPort": 8001},
                      {"name": "metrics", "containerPort": 8002}],
            "resources": resources,
            # Liveness: the server process answers. Readiness: every model loaded and ready (strict readiness),
            # which is false while a model is broken and being reloaded; traffic moves away, the pod stays.
            "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10,
                              "failureThreshold": 3, "timeoutSeconds": 2},
            "readinessProbe": {"httpGet": {"path": f"/v2/models/{info.model}/ready", "port": "http"},
                               "periodSeconds": 2, "failureThreshold": 2, "timeoutSeconds": 2},
            "startupProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "periodSeconds": 5,
                             "failureThreshold": 120},
            # The load balancer stops routing before SIGTERM reaches the server.
            "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        }],
        # The Python backend's stubs exchange tensors through /dev/shm.
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}],
    }
    if gpu and device.get("name"):
        pod_spec["nodeSelector"] = {"nvidia.com/gpu.product": device["name"].replace(" ", "-")}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": labels, "annotations": {
                "prometheus.io/scrape": "true", "prometheus.io/port": "8002", "prometheus.io/path": "/metrics"}},
                "spec": pod_spec},
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {"selector": labels, "ports": [
            {"name": "http", "port": 8000, "targetPort": "http"},
            {"name": "grpc", "port": 8001, "targetPort": "grpc", "appProtocol": "grpc"},
            {"name": "metrics", "port": 8002, "targetPort": "metrics"}]},
    }
    hpa = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": 1, "maxReplicas": int(max_replicas),
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": QUEUE_METRIC},
                "target": {"type": "AverageValue", "averageValue": str(int(target_queue_us))}}}],
            "behavior": {"scaleUp": {"stabilizationWindowSeconds": 15,
                                     "policies": [{"type": "Pods", "value": 2, "periodSeconds": 30}]},
                         "scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }
    rule = (
        "rules:\n"
        f"- seriesQuery: 'nv_inference_queue_duration_us{{model=\"{info.model}\"}}'\n"
        "  resources: {overrides: {namespace: {resource: namespace}, pod: {resource: pod}}}\n"
        f"  name: {{as: \"{QUEUE_METRIC}\"}}\n"
        "  metricsQuery: 'sum(rate(nv_inference_queue_duration_us{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>) / "
        "clamp_min(sum(rate(nv_inference_request_success{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>), 1)'\n"
    )
    adapter = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": f"{name}-prometheus-adapter-rules", "labels": labels},
        "data": {"config.yaml": rule},
    }
    return {"deployment.yaml": [deployment], "service.yaml": [service], "hpa.yaml": [hpa],
            "prometheus-adapter-rules.yaml": [adapter]}


def write_manifests(folder: Path, info, manifest: dict, **options) -> list[Path]:
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for file, objects in manifests(info, manifest, **options).items():
        path = folder / file
        path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
        written.append(path)
    return written


def check_manifests(folder: Path, version: str = KUBERNETES_VERSION) -> list[str]:
    """Every object of every ``*.yaml`` under ``folder`` against the Kubernetes schemas (strict: unknown fields
    fail); returns the objects checked, as ``file: Kind/name``. A one-line error names the first problem."""
    import yaml

    try:
        import kubernetes_validate
    except ModuleNotFoundError:
        raise KKError("checking the manifests needs kubernetes-validate (pip install kubernetes-validate)") from None
    checked = []
    for path in sorted(Path(folder).glob("*.yaml")):
        for obj in yaml.safe_load_all(path.read_text()):
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                first = str(exc).splitlines()[0]
                raise KKError(f"{path.name}: {obj.get('kind')}/{obj.get('metadata', {}).get('name')} does not match "
                              f"the Kubernetes {version} schema: {first}") from None
            checked.append(f"{path.name}: {obj['kind']}/{obj['metadata']['name']}")
    return checked
