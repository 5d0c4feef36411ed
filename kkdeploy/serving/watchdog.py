"""The watchdog of `kkdeploy serve`: notice a broken model, make readiness say so, heal it or give up.

Why. Triton does not restart a Python-backend stub that died (SIGKILL, out of memory, a crash in native code): every
request then fails with "Stub process ... is not healthy", while ``/v2/health/ready`` and the model's ready flag
stay true, so an orchestrator keeps routing traffic to a dead replica. ``kkdeploy serve`` runs the server with
explicit model control and watches it:

* stub liveness: the stubs of every model (found by the repository path on their command line) are checked every
  ``interval_s``; a stub that is gone or a zombie is a fault at once;
* a canary: every ``probe_every_s`` a one-sequence request with a fixed input (``triton_model.canary_case``) goes
  through the public endpoint, and its answer must equal, bit for bit, one of the answers the model computed
  for it at start on each batch bucket (pinned then: a reloaded model must still compute them). An error, a
  timeout or a different answer is a fault.

On a fault: one line, then the model is unloaded (readiness false at once: ``/v2/health/ready`` under strict
readiness and the model's ready flag), loaded again (Triton starts a new stub) and the canary must be exact
before the model counts as healed (one more line). A dead server, or a dead stub of a model with several
instances (whose unload Triton never completes), restarts the server instead. If that does not happen within
``heal_timeout_s``, ``HealFailed`` carries the reason and ``kkdeploy serve`` exits non-zero, so that a supervisor (systemd,
Kubernetes) restarts it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import KKError

EXIT_NOT_HEALED = 3


class HealFailed(KKError):
    """A model could not be healed within the bound; ``kkdeploy serve`` exits with EXIT_NOT_HEALED."""


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2:].split()[0] != "Z"


class Canary:
    """The canary request and its pinned answers ``{bucket: digest}``."""

    def __init__(self, model: str, seq_len: int, d_model: int, dtype: str, answers: dict[str, str]):
        import torch

        from .triton_model import canary_case

        self.model = model
        torch_dtype = {"float32": torch.float32, "float16": torch.float16}[dtype]
        x, mask = canary_case(seq_len, d_model, torch_dtype)
        self.x, self.mask = x.numpy(), mask.numpy()
        self.triton_type = {"float32": "FP32", "float16": "FP16"}[dtype]
        self.answers = dict(answers)

    @classmethod
    def from_file(cls, path: Path, model: str, seq_len: int, d_model: int, dtype: str) -> "Canary":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise KKError(f"the model did not record its canary answers in {path} ({exc}); is model.py from this "
                          f"kkdeploy?") from None
        return cls(model, seq_len, d_model, dtype, data["buckets"])

    def ask(self, url: str, timeout_s: float = 10.0) -> str | None:
        """None when the answer is exact, else what is wrong (one line). A fresh connection each time: an idle
        keep-alive connection of ours would hold the server at shutdown."""
        from .loadtest import digest

        try:
            y = infer_binary(url, self.model, [("x", self.x, self.triton_type),
                                               ("valid_token_mask", self.mask, "BOOL")], timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            text = str(exc).strip().splitlines()
            return f"the canary request failed: {text[0] if text else type(exc).__name__}"[:300]
        if digest(y) not in self.answers.values():
            return "the canary's answer differs from the validated answer"
        return None


def infer_binary(url: str, model: str, inputs: list, timeout_s: float = 10.0, output: str = "y") -> bytes:
    """One inference over Triton's HTTP/REST protocol with the binary tensor extension, standard library only
    (``kkdeploy serve`` needs no client package): ``inputs`` are ``(name, array, triton datatype)``; returns the
    output's raw bytes. Raises with the server's message on any error."""
    import http.client
    import json

    header = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": t,
                          "parameters": {"binary_data_size": a.nbytes}} for n, a, t in inputs],
              "outputs": [{"name": output, "parameters": {"binary_data": True}}]}
    head = json.dumps(header).encode()
    body = head + b"".join(a.tobytes() for _, a, _ in inputs)
    host, _, port = url.rpartition(":")
    connection = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout_s)
    try:
        connection.request("POST", f"/v2/models/{model}/infer", body=body,
                           headers={"Inference-Header-Content-Length": str(len(head)),
                                    "Content-Type": "application/octet-stream", "Connection": "close"})
        reply = connection.getresponse()
        data = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {data[:200].decode(errors='replace')}")
        size = int(reply.getheader("Inference-Header-Content-Length") or len(data))
        meta = json.loads(data[:size])
        offset = size
        for out in meta.get("outputs", []):
            length = int((out.get("parameters") or {}).get("binary_data_size", 0))
            if out.get("name") == output:
                return data[offset:offset + length]
            offset += length
        raise RuntimeError(f"the response has no output {output!r}")
    finally:
        connection.close()


class Watchdog:
    """``step()`` from the serving loop: checks what is due, heals what is broken, raises HealFailed."""

    def __init__(self, server, models: list[str], canary: Canary | None, log, *, interval_s: float = 0.5,
                 probe_every_s: float = 5.0, heal_timeout_s: float = 50.0, restart=None, stubs: bool = True):
        self.server, self.models, self.canary, self.log = server, list(models), canary, log
        # False for kkdeploy's in-process backend: the engine runs in tritonserver itself, so there are no stubs to
        # watch (a crash there takes the server down, which is healed by a restart).
        self.stubs_expected = stubs
        self.restart = restart  # (timeout_s) -> None: the server started again where it died (TritonServer.restart)
        self.interval_s, self.probe_every_s, self.heal_timeout_s = interval_s, probe_every_s, heal_timeout_s
        self.stubs: dict[str, list[int]] = {}
        self.next_probe = time.monotonic() + probe_every_s
        self.faults = 0
        self.healed = 0

    def baseline(self, timeout_s: float = 10.0) -> None:
        """Remember each model's stubs (a Python-backend model has one per instance)."""
        if not self.stubs_expected:
            self.stubs = {}
            return
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.server.stub_pids()
            if all(found.get(m) for m in self.models) or time.monotonic() > deadline:
                self.stubs = {m: found.get(m, []) for m in self.models}
                return
            time.sleep(0.1)

    def problem(self) -> tuple[list[str], str] | None:
        """``(models to reload, why)`` or None."""
        if not self.server.alive():
            return list(self.models), f"tritonserver died ({self.server.failure_reason()})"
        dead = self._dead_stub()
        if dead:
            return dead
        if self.canary is not None and time.monotonic() >= self.next_probe:
            self.next_probe = time.monotonic() + self.probe_every_s
            wrong = self.canary.ask(self.server.http_url)
            if wrong:  # a stub that died while the canary asked is the cause to name, not the canary's symptom
                return self._dead_stub() or (list(self.models), wrong)
        return None

    def _dead_stub(self) -> tuple[list[str], str] | None:
        for model, pids in self.stubs.items():
            for pid in pids:
                if not pid_alive(pid):
                    return [model], f"the Python-backend stub of {model} (pid {pid}) died"
        return None

    def _confirm(self, models: list[str], start: float, how: str) -> str | None:
        """None once the canary gets one of its pinned answers (healed: the stubs remembered anew, one line
        logged), else what the canary got."""
        wrong = self.canary.ask(self.server.http_url) if self.canary is not None else None
        if wrong is None:
            self.baseline()
            self.healed += 1
            self.next_probe = time.monotonic() + self.probe_every_s
            self.log(f"watchdog: {', '.join(models)} healed in {time.monotonic() - start:.1f} s ({how}; canary exact)")
        return wrong

    def step(self) -> None:
        found = self.problem()
        if found:
            self.heal(*found)

    def heal(self, models: list[str], why: str) -> None:
        self.faults += 1
        start = time.monotonic()
        deadline = start + self.heal_timeout_s
        # A model of several instances with one stub dead is never fully unloaded: Triton loads the new version, but
        # the old one's live stubs keep running beside it (one leaked engine per heal; measured on the CPU, and
        # now and then the server aborted in that unload: boost::interprocess::lock_exception). Restart instead.
        several_one_dead = any(len(self.stubs.get(m, [])) > 1 and not all(map(pid_alive, self.stubs[m]))
                               for m in models)
        restart_now = self.server.alive() and self.restart is not None and several_one_dead
        if restart_now:
            action = "restarting tritonserver (a model of several instances with a dead stub cannot be unloaded)"
        elif self.server.alive():
            action = "unloading (not ready) and reloading"
        else:
            action = "restarting tritonserver"
        self.log(f"watchdog: {', '.join(models)} broken: {why}; {action}")
        last = why
        order = sorted(models, key=lambda m: m != self.models[-1])  # an engine model before its front
        announced = action.startswith("restarting")
        while time.monotonic() < deadline:
            if restart_now or not self.server.alive():  # died, or died while we reloaded: start it again
                restart_now = False
                if not announced:  # found dead after the fault's line (a kill -9 is seen first as a reset peer)
                    self.log("watchdog: tritonserver died; restarting tritonserver")
                    announced = True
                if self.restart is None:
                    raise HealFailed(f"{', '.join(models)} could not be healed: tritonserver died "
                                     f"({self.server.failure_reason()})")
                try:
                    self.restart(max(1.0, deadline - time.monotonic()))
                except Exception as exc:  # noqa: BLE001 - not ready in time, a port taken: try again until the bound
                    last = f"tritonserver could not be restarted: {exc}"
                    time.sleep(0.5)
                    continue
                last = self._confirm(models, start, "tritonserver restarted")
                if last is None:
                    return
                continue
            for model in order:  # not ready from here on: readiness tells the truth while we heal
                self.server.unload(model, timeout_s=max(1.0, min(10.0, deadline - time.monotonic())))
            while time.monotonic() < deadline and any(self.server.model_states().get(m) == "READY" for m in order):
                time.sleep(0.1)
            loaded = all(self.server.load(m, timeout_s=max(1.0, deadline - time.monotonic())) for m in order)
            if loaded:
                last = self._confirm(models, start, "reloaded")
                if last is None:
                    return
            else:
                said = getattr(self.server, "last_load_error", None)
                why = self.server.failure_reason()
                last = f"Triton could not load {', '.join(order)} ({f'{said}; ' if said and said not in why else ''}{why})"
            time.sleep(0.5)
        for model in order:  # leave it unready: a supervisor restarts us, the load balancer routes elsewhere
            if self.server.alive():
                self.server.unload(model, timeout_s=2.0)
        raise HealFailed(f"{', '.join(models)} could not be healed within {self.heal_timeout_s:.0f} s: {last}")
