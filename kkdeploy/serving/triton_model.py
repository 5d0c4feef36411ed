"""The Python-backend model of a kkdeploy Triton repository; ``triton_repo`` copies this file as ``1/model.py``.

One file, two roles, chosen by the ``kkdeploy_role`` parameter of the model's ``config.pbtxt``:

``front`` (the model clients call). Triton's dynamic batcher gathers requests of 1..B sequences (``max_batch_size``
is the engine's fixed batch B, so Triton itself rejects a request of more than B sequences, a wrong width, dtype
or mask shape with a 400). ``execute`` concatenates them, pads the batch to exactly B with zero rows whose mask is
all False (fully masked rows: the model sets them to zeros, and every row is computed independently of the
others), calls the fixed-batch engine model once through BLS, and splits the result back, request by request.
Padding rows are never returned. A missing ``valid_token_mask`` means every token is valid, as in the model.

``engine`` (``<name>_engine``, fixed batch B). Serves ``kkdeploy.load(<version>/artifacts)``: the chosen engine
or the validated PyTorch fallback, with every check ``kkdeploy.load`` makes (hashes, environment, versions).

Every tensor crosses the stub boundary as DLPack (``to_dlpack``/``from_dlpack``), never through ``as_numpy()``
or ``Tensor(name, ndarray)``: the stub's numpy bridge is compiled against numpy 1.x and, under numpy 2, silently
misreads arrays (an FP32 ``[1, 2, 3]`` arrived as ``[1, 1, 1]`` on our machine). DLPack does not involve numpy.

This module must stay importable without Triton (``triton_python_backend_utils`` exists only inside the stub): the
pure helpers below are unit-tested directly.
"""

from __future__ import annotations

import json
import os
import site

# A kkdeploy environment that is a virtualenv (or has user site-packages) is not the stub's default sys.path:
# ``kkdeploy serve`` names its site dirs here; addsitedir also runs their .pth files (editable installs).
for _dir in filter(None, os.environ.get("KKDEPLOY_SITE_DIRS", "").split(os.pathsep)):
    site.addsitedir(_dir)

# config.pbtxt parameters written by triton_repo
ROLE = "kkdeploy_role"
ENGINE_MODEL = "kkdeploy_engine_model"
ARTIFACTS = "kkdeploy_artifacts"
DEVICE_TYPE = "kkdeploy_device_type"
INPUT_X, INPUT_MASK, OUTPUT_Y = "x", "valid_token_mask", "y"


def parameter(model_config: dict, key: str, default: str | None = None) -> str | None:
    value = (model_config.get("parameters") or {}).get(key)
    return value.get("string_value", default) if isinstance(value, dict) else default


def chunks(sizes: list[int], batch: int) -> list[list[int]]:
    """Indices of requests grouped in order so that each group holds at most ``batch`` sequences.

    Triton's batcher never hands over more than ``max_batch_size`` sequences; this keeps the front correct even
    if a future scheduler did (a request is never split: each one holds at most ``batch``)."""
    groups, current, used = [], [], 0
    for i, n in enumerate(sizes):
        if current and used + n > batch:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


def pad_batch(xs: list, masks: list, batch: int):
    """``(x, mask, bounds)``: the inputs stacked and padded to ``batch`` rows with zeros and all-False masks;
    ``bounds[i]`` is the row range of input ``i``."""
    import torch

    n = sum(int(x.shape[0]) for x in xs)
    if n > batch:
        raise ValueError(f"{n} sequences do not fit the engine's fixed batch of {batch}")
    x0 = xs[0]
    x = torch.zeros((batch, *x0.shape[1:]), dtype=x0.dtype)
    mask = torch.zeros((batch, x0.shape[1]), dtype=torch.bool)
    bounds, row = [], 0
    for xi, mi in zip(xs, masks):
        k = int(xi.shape[0])
        x[row:row + k] = xi
        mask[row:row + k] = True if mi is None else mi
        bounds.append((row, row + k))
        row += k
    return x, mask, bounds


class TritonPythonModel:
    """Triton's entry point; delegates to the role named in config.pbtxt."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        role = parameter(config, ROLE)
        if role == "front":
            self.impl = _Front(config)
        elif role == "engine":
            self.impl = _Engine(config, args)
        else:
            raise ValueError(f"config.pbtxt parameter {ROLE} must be 'front' or 'engine', got {role!r}")

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self):
        self.impl = None


def _to_torch(tensor):
    from torch.utils.dlpack import from_dlpack

    return from_dlpack(tensor.to_dlpack())


def _to_triton(name: str, value):
    import triton_python_backend_utils as pb_utils
    from torch.utils.dlpack import to_dlpack

    return pb_utils.Tensor.from_dlpack(name, to_dlpack(value.detach().cpu().contiguous()))


def _error(message: str, code=None):
    import triton_python_backend_utils as pb_utils

    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
        message, pb_utils.TritonError.INTERNAL if code is None else code))


class _Front:
    def __init__(self, config: dict):
        import torch

        # The front only copies rows; torch's default thread pool would spin beside the engine's on the same cores.
        torch.set_num_threads(1)
        self.name = config["name"]
        self.batch = int(config["max_batch_size"])
        self.engine_model = parameter(config, ENGINE_MODEL)
        if not self.engine_model:
            raise ValueError(f"{self.name}: config.pbtxt lacks the {ENGINE_MODEL} parameter")

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        responses = [None] * len(requests)
        xs, masks = [], []
        for request in requests:
            x = _to_torch(pb_utils.get_input_tensor_by_name(request, INPUT_X))
            mask = pb_utils.get_input_tensor_by_name(request, INPUT_MASK)
            xs.append(x)
            masks.append(None if mask is None else _to_torch(mask))
        for group in chunks([int(x.shape[0]) for x in xs], self.batch):
            try:
                outputs = self._run([xs[i] for i in group], [masks[i] for i in group])
            except Exception as exc:  # noqa: BLE001 - the engine's error goes back to each caller
                for i in group:
                    responses[i] = _error(f"{self.name}: {exc}")
                continue
            for i, y in zip(group, outputs):
                responses[i] = pb_utils.InferenceResponse(output_tensors=[_to_triton(OUTPUT_Y, y)])
        return responses

    def _run(self, xs, masks):
        import triton_python_backend_utils as pb_utils

        x, mask, bounds = pad_batch(xs, masks, self.batch)
        request = pb_utils.InferenceRequest(
            model_name=self.engine_model, requested_output_names=[OUTPUT_Y],
            inputs=[_to_triton(INPUT_X, x), _to_triton(INPUT_MASK, mask)])
        response = request.exec()
        if response.has_error():
            raise RuntimeError(f"engine model {self.engine_model}: {response.error().message()}")
        y = _to_torch(pb_utils.get_output_tensor_by_name(response, OUTPUT_Y))
        return [y[a:b].clone() for a, b in bounds]


class _Engine:
    def __init__(self, config: dict, args: dict):
        import triton_python_backend_utils as pb_utils

        import torch

        import kkdeploy

        version_dir = os.path.join(args["model_repository"], args["model_version"])
        artifacts = os.path.join(version_dir, parameter(config, ARTIFACTS, "artifacts"))
        device = "cpu"
        if parameter(config, DEVICE_TYPE, "cpu") == "cuda":
            device = f"cuda:{int(args.get('model_instance_device_id') or 0)}"
        self.runner = kkdeploy.load(artifacts, device=device)
        self.device = torch.device(device)
        self.shape = [int(d) for d in next(i["dims"] for i in config["input"] if i["name"] == INPUT_X)]
        pb_utils.Logger.log_info(f"{config['name']}: serving {self.runner.backend} on {device}: {self.runner.reason}")
        with torch.inference_mode():  # first call outside the clock: lazy session/graph set-up
            x = torch.zeros(self.shape, dtype=_dtype(config), device=self.device)
            self.runner(x, torch.ones(self.shape[:2], dtype=torch.bool, device=self.device))

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        import torch

        responses = []
        for request in requests:
            try:
                x = _to_torch(pb_utils.get_input_tensor_by_name(request, INPUT_X)).to(self.device)
                mask = _to_torch(pb_utils.get_input_tensor_by_name(request, INPUT_MASK)).to(self.device)
                with torch.inference_mode():
                    y = self.runner(x, mask)
                responses.append(pb_utils.InferenceResponse(output_tensors=[_to_triton(OUTPUT_Y, y)]))
            except Exception as exc:  # noqa: BLE001 - one bad call must not take the model down
                responses.append(_error(f"engine: {type(exc).__name__}: {exc}"))
        return responses


def _dtype(config: dict):
    import torch

    kind = next(i["data_type"] for i in config["input"] if i["name"] == INPUT_X)
    return {"TYPE_FP32": torch.float32, "TYPE_FP16": torch.float16, "TYPE_BF16": torch.bfloat16}[kind]
