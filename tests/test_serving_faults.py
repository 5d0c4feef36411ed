"""Serving survives its own faults (issue 33), with a real ``kkdeploy serve`` on loopback ports: a stub killed under
load is noticed and healed (readiness false meanwhile, never a wrong answer), two starts on one port give exactly
one "ready", SIGINT or SIGTERM under load stops within the 5 s budget leaving nothing (no server, no stub, no shared memory,
no work directory), requests in flight at the signal are answered, and the exit code says whether the stop was
clean.
Malformed HTTP bodies: the status Triton decides, and the server keeps answering exactly."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import kkdeploy
from kkdeploy.serving import loadtest, triton_server
from tests.conftest import build_serving_artifact

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return build_serving_artifact(tmp_path_factory.mktemp("faults") / "a", "--batch-buckets", "1")


@pytest.fixture(scope="module")
def install():
    return triton_server.find_server() or triton_server.install_server()


@pytest.fixture(scope="module")
def oracle(small):
    """A pool of requests and, for each, the direct engine's answers at every bucket that holds it."""
    plan = loadtest.LoadPlan(model="kkdeploy", seq_len=8, d_model=16, dtype="float32", mix=[[1, 1.0], [2, 1.0]],
                             padding=[0.0, 0.25], pool=12, seed=5)
    pool = loadtest.make_pool(plan)
    return pool, loadtest.expected_answers(kkdeploy.load(small), pool)


class Serve:
    """``kkdeploy serve`` as a subprocess; its lines with the time they arrived."""

    def __init__(self, artifacts: Path, ports: dict, *extra: str, sigint_ignored: bool = False):
        self.ports = ports
        env = {k: v for k, v in os.environ.items() if k != triton_server.ENV_SERVER}
        env["PYTHONUNBUFFERED"] = "1"
        # sigint_ignored: started as a shell starts a background job (`kkdeploy serve ... &`), SIGINT ignored
        self.proc = subprocess.Popen([sys.executable, "-m", "kkdeploy", "serve", "--artifacts", str(artifacts),
                                      "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
                                      "--metrics-port", str(ports["metrics"]), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
                                     if sigint_ignored else None)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append((time.monotonic(), line))

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout_s: float = 120.0) -> float | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hit = next((t for t, line in self.lines if re.search(pattern, line)), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None:
                time.sleep(0.3)  # the last lines
                return next((t for t, line in self.lines if re.search(pattern, line)), None)
            time.sleep(0.1)
        return None

    @property
    def workdir(self) -> str:
        return re.search(r"repository (\S+)/repository", self.text).group(1)

    def stub_pids(self) -> list[int]:
        return [pid for pid, _, state, cmd in triton_server._process_table()
                if "triton_python_backend_stub" in cmd and self.workdir in cmd and state != "Z"]

    def stub_pid(self) -> int:
        pids = self.stub_pids()
        assert len(pids) == 1, pids
        return pids[0]

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.reader.join(timeout=10)


def readiness(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


class Load:
    """Client threads sending pool requests in a loop (gRPC and HTTP keep-alive connections), every answer checked
    against the direct engine's; a poller records readiness every 0.2 s."""

    def __init__(self, ports: dict, oracle, clients=(("grpc", 0), ("http", 1))):
        self.pool, self.answers = oracle
        self.ports = ports
        self.stop = threading.Event()
        self.events: list[tuple[float, str, str, float]] = []  # (answered, ok|wrong|error, detail, sent)
        self.ready: list[tuple[float, int | None]] = []
        self.threads = [threading.Thread(target=self._client, args=(p, s), daemon=True) for p, s in clients]
        self.threads.append(threading.Thread(target=self._poll, daemon=True))
        for t in self.threads:
            t.start()

    def _client(self, protocol: str, seed: int):
        plan = loadtest.LoadPlan(model="kkdeploy", seq_len=8, d_model=16, dtype="float32", protocol=protocol,
                                 http_port=self.ports["http"], grpc_port=self.ports["grpc"], timeout_s=20)
        client = loadtest.Client(plan, self.pool, {}, f"t{seed}")
        rng = np.random.default_rng(seed)
        try:
            while not self.stop.is_set():
                k = int(rng.integers(len(self.pool)))
                sent = time.monotonic()
                try:
                    got = client.send(k)
                    self.events.append((time.monotonic(), "ok" if loadtest.answered_by(self.answers[k], got) is not None else "wrong", "",
                                        sent))
                except Exception as exc:  # noqa: BLE001 - an error is allowed, a wrong answer never
                    self.events.append((time.monotonic(), "error", str(exc)[:200], sent))
                    time.sleep(0.05)
        finally:
            client.close()

    def _poll(self):
        while not self.stop.is_set():
            self.ready.append((time.monotonic(), readiness(self.ports["http"])))
            time.sleep(0.2)

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)

    def count(self, kind: str, after: float = 0.0, before: float = float("inf")) -> int:
        return sum(1 for t, k, _, _ in self.events if k == kind and after <= t < before)

    def in_flight_at(self, moment: float) -> list[tuple]:
        """The requests sent before ``moment`` and answered (or failed) after it."""
        return [e for e in self.events if e[3] < moment < e[0]]


@contextlib.contextmanager
def watched_under_load(artifacts, oracle, *extra: str):
    """``kkdeploy serve`` with its watchdog (a canary every 2 s; ``extra`` arguments after), ready and answering a
    gRPC and an HTTP client in a loop for 2 s; yields ``(serve, load)`` and leaves nothing behind."""
    ports = triton_server.free_ports()
    serve = Serve(artifacts, ports, "--probe-interval", "2", "--heal-timeout", "45", *extra)
    load = None
    try:
        assert serve.wait_for(r"^ready in", 120), serve.text
        load = Load(ports, oracle)
        time.sleep(2.0)
        assert load.count("ok") > 0 and load.count("wrong") == 0
        yield serve, load
    finally:
        if load is not None:
            load.finish()
        serve.close()


def test_a_stub_killed_under_load_is_noticed_and_healed_never_a_wrong_answer(small, install, oracle):
    with watched_under_load(small, oracle) as (serve, load):
        killed_at = time.monotonic()
        os.kill(serve.stub_pid(), signal.SIGKILL)
        healed_at = serve.wait_for(r"watchdog: .* healed in", 60)
        assert healed_at is not None and healed_at - killed_at <= 60, serve.text
        time.sleep(2.0)  # traffic after healing
        load.finish()
        # Within 10 s: the model answers correctly again, or readiness is false.
        not_ready = [t for t, status in load.ready if killed_at <= t <= killed_at + 10 and status != 200]
        correct = load.count("ok", after=killed_at, before=killed_at + 10)
        assert not_ready or correct, (load.ready, load.events[-20:])
        # here: noticed by the stub check (every 0.5 s), not by the canary's luck (every 2 s), and readiness false
        # while it heals (within the 10 s above). The fault's line is the moment it was noticed; readiness follows
        # once Triton has begun the unload, which on a loaded 2-core CI machine came 3.06 s after the kill once.
        noticed_at = serve.wait_for(r"watchdog: \S+ broken: the Python-backend stub of \S+ \(pid \d+\) died", 5)
        assert noticed_at is not None and noticed_at - killed_at < 3, serve.text
        assert not_ready, load.ready
        # Healed: exact answers and readiness true again; never a wrong answer, before, during or after.
        assert load.count("ok", after=healed_at) > 0
        assert [status for t, status in load.ready if t > healed_at + 0.5][-1] == 200
        assert load.count("wrong") == 0, [e for e in load.events if e[1] == "wrong"][:3]
        assert len(re.findall(r"watchdog: .* broken", serve.text)) == 1  # one fault, one line
        assert "died" in serve.text
        assert serve.proc.poll() is None  # still serving
        serve.proc.send_signal(signal.SIGINT)
        assert serve.proc.wait(timeout=30) == 0, serve.text


def test_one_of_several_instances_killed_under_load_is_healed_never_a_wrong_answer(small, install, oracle):
    # docs/serving.md recommends --instances 4 for throughput on a GPU: one stub of several dying is the same fault
    with watched_under_load(small, oracle, "--instances", "2") as (serve, load):
        pids = serve.stub_pids()
        assert len(pids) == 2, (pids, serve.text)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        healed_at = serve.wait_for(r"watchdog: .* healed in", 60)
        assert healed_at is not None and healed_at - killed_at <= 60, serve.text
        assert f"(pid {pids[1]}) died" in serve.text
        # Triton never finishes unloading a model of several instances with a dead stub (its live stubs kept
        # running beside the reloaded ones): the watchdog restarts the server instead
        assert re.search(r"broken: .*; restarting tritonserver", serve.text), serve.text
        assert re.search(r"healed in .* \(tritonserver restarted", serve.text), serve.text
        time.sleep(2.0)
        load.finish()
        assert load.count("ok", after=healed_at) > 0
        assert load.count("wrong") == 0, [e for e in load.events if e[1] == "wrong"][:3]
        after = serve.stub_pids()
        assert len(after) == 2 and not set(after) & set(pids), (pids, after)  # two new stubs, none of the old
        workdir = serve.workdir
        serve.proc.send_signal(signal.SIGINT)
        assert serve.proc.wait(timeout=30) == 0, serve.text
        left = [pid for pid, _, state, cmd in triton_server._process_table() if workdir in cmd and state != "Z"]
        assert not left, left


@pytest.mark.parametrize("engine", ["auto", "inprocess"])
def test_a_server_killed_under_load_is_restarted_never_a_wrong_answer(small, install, oracle, engine):
    # Triton itself can die (it aborted once in CI while reloading a model after a stub was killed): the watchdog
    # starts it again on the same ports and repository (nothing answers while it is down), healed once the canary is
    # exact again. With the in-process backend this is also what a crash in the engine looks like.
    with watched_under_load(small, oracle, "--engine", engine) as (serve, load):
        server_pid = int(re.search(r"tritonserver pid (\d+)", serve.text).group(1))
        killed_at = time.monotonic()
        os.kill(server_pid, signal.SIGKILL)
        healed_at = serve.wait_for(r"watchdog: .* healed in .*tritonserver restarted", 60)
        assert healed_at is not None and healed_at - killed_at <= 60, serve.text
        time.sleep(2.0)
        load.finish()
        assert "restarting tritonserver" in serve.text and serve.proc.poll() is None
        assert load.count("ok", after=healed_at) > 0 and load.count("wrong") == 0
        assert [status for t, status in load.ready if t > healed_at + 0.5][-1] == 200
        running = triton_server.processes_mentioning(serve.workdir)
        assert running and server_pid not in running  # the new server and its stub, not the killed one
        workdir = serve.workdir
        serve.proc.send_signal(signal.SIGINT)
        assert serve.proc.wait(timeout=30) == 0, serve.text
        assert triton_server.processes_mentioning(workdir) == []


def test_two_simultaneous_starts_on_one_port_give_exactly_one_ready(small, install):
    ports = triton_server.free_ports()
    first, second = Serve(small, ports), Serve(small, ports)
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not (
                any(s.proc.poll() is not None for s in (first, second))
                and any(re.search(r"^ready in", s.text, re.M) for s in (first, second))):
            time.sleep(0.2)
        time.sleep(1.0)
        ready = [s for s in (first, second) if re.search(r"^ready in", s.text, re.M)]
        lost = [s for s in (first, second) if s.proc.poll() is not None]
        assert len(ready) == 1 and len(lost) == 1, (first.text, second.text)
        assert ready[0] is not lost[0]
        assert lost[0].proc.returncode == 2, lost[0].text
        assert "already in use" in lost[0].text and "Traceback" not in lost[0].text
        winner = ready[0]
        assert readiness(ports["http"]) == 200  # the winner keeps serving
        winner.proc.send_signal(signal.SIGINT)
        assert winner.proc.wait(timeout=30) == 0
    finally:
        first.close()
        second.close()


def stop_line(text: str) -> float:
    """The stop's own duration, from serve's "tritonserver stopped in N s" line."""
    return float(re.search(r"tritonserver stopped in ([\d.]+) s", text).group(1))


def shm_regions(workdir: str | None = None) -> set[str]:
    """The Python backend's regions in /dev/shm; with ``workdir``, those named on the command lines of the stubs
    serving from it."""
    if workdir is None:
        return {p.name for p in Path("/dev/shm").glob(f"{triton_server._SHM_PREFIX}*")}
    return {r for _, _, _, cmd in triton_server._process_table() if workdir in cmd
            for r in re.findall(rf"{triton_server._SHM_PREFIX}[\w-]+", cmd)}


def mapped_by_a_live_process(region: str) -> bool:
    """Another server's region (this machine may run several): some live process maps it."""
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if region in maps.read_text():
                return True
        except OSError:
            continue
    return False


def assert_nothing_left(serve: Serve, workdir: str, server_pid: int, shm_before: set, ours: set,
                        stubs: bool = True) -> None:
    assert "no process left" in serve.text
    assert not Path(f"/proc/{server_pid}").exists() or \
        Path(f"/proc/{server_pid}/stat").read_text().split()[2] == "Z"
    assert triton_server.processes_mentioning(workdir) == []  # no tritonserver, no stub
    # the regions of this server's stubs are gone (the in-process backend has no stubs, hence none)
    assert (ours or not stubs) and not ours & shm_regions(), (ours, serve.text)
    left = [r for r in shm_regions() - shm_before if not mapped_by_a_live_process(r)]
    assert not left, (left, serve.text)  # every process of ours is gone: an unmapped new region would be ours
    assert not Path(workdir).exists()


def test_the_stop_budget_is_the_issue_s_contract():
    from kkdeploy.commands import serve

    # Issue 33: stopped within 5 s of SIGINT/SIGTERM. The budget leaves 0.5 s for serve's own exit after the stop.
    assert serve.STOP_BUDGET_S == serve.DRAIN_TIMEOUT_S + serve.AFTER_DRAIN_S <= 4.5
    assert serve.RELEASE_S + serve.SERVER_EXIT_S + serve.KILL_S < serve.AFTER_DRAIN_S
    assert serve.RELEASE_S > 1.0  # the Python backend's fixed stub health check before finalize()


@pytest.mark.parametrize("signum, instances, engine", [(signal.SIGINT, 1, "auto"), (signal.SIGTERM, 1, "auto"),
                                                      (signal.SIGINT, 4, "auto"), (signal.SIGINT, 1, "inprocess"),
                                                      (signal.SIGTERM, 2, "inprocess")])
def test_a_signal_under_load_stops_within_the_budget_cleanly_leaving_nothing(small, install, oracle, signum, instances,
                                                                            engine):
    from kkdeploy.commands.serve import STOP_BUDGET_S

    ports = triton_server.free_ports()
    serve = Serve(small, ports, "--instances", str(instances), "--engine", engine)
    load = None
    try:
        assert serve.wait_for(r"^ready in", 120), serve.text
        workdir = serve.workdir
        server_pid = int(re.search(r"tritonserver pid (\d+)", serve.text).group(1))
        shm, ours = shm_regions(), shm_regions(workdir)
        # keep-alive connections open, requests in flight: two gRPC and two HTTP clients in a loop
        load = Load(ports, oracle, clients=(("grpc", 0), ("http", 1), ("grpc", 2), ("http", 3)))
        time.sleep(2.0)
        assert load.count("ok") > 0
        began, code, took = signal_and_wait(serve, signum)
        load.finish()
        assert took <= 5.0, (took, serve.text)  # issue 33, signal to exit, serve's own exit included
        assert stop_line(serve.text) <= STOP_BUDGET_S, serve.text
        assert code == 0, serve.text  # a clean stop: drained, the server exited by itself, nothing left
        assert "every request answered" in serve.text
        # one instance exits by itself; of several, Triton finalizes one after another, a second each, and those
        # still finalizing when the stop's budget runs out are ended with the server (their requests all answered)
        assert "exit code 0" in serve.text or (instances > 1 and "a stub was still exiting" in serve.text)
        assert load.count("wrong") == 0
        assert_nothing_left(serve, workdir, server_pid, shm, ours, stubs=engine != "inprocess")
    finally:
        if load is not None:
            load.finish()
        serve.close()


def test_sigint_stops_a_serve_started_with_sigint_ignored(small, install):
    # A background job of a non-interactive shell inherits SIGINT ignored, and Python then installs no handler:
    # `kill -INT` did nothing, and every stop test failed when the test suite itself ran as such a job.
    ports = triton_server.free_ports()
    serve = Serve(small, ports, "--no-watchdog", sigint_ignored=True)
    try:
        assert serve.wait_for(r"^ready in", 120), serve.text
        _, code, took = signal_and_wait(serve, signal.SIGINT)
        assert code == 0 and took <= 5.0, serve.text
    finally:
        serve.close()


def signal_and_wait(serve, signum) -> tuple[float, int, float]:
    """Send ``signum`` to serve and wait for it: (when it was sent, the exit code, seconds until the exit)."""
    began = time.monotonic()
    serve.proc.send_signal(signum)
    code = serve.proc.wait(timeout=30)
    return began, code, time.monotonic() - began

@pytest.fixture(scope="module")
def unbucketed(tmp_path_factory):
    """An artifact without batch buckets (one bucket of B = 2) and single-sequence requests with their answers:
    Triton's batcher holds a lone request for its --max-queue-delay-us, waiting for a second sequence."""
    out = build_serving_artifact(tmp_path_factory.mktemp("faults") / "b")
    plan = loadtest.LoadPlan(model="kkdeploy", seq_len=8, d_model=16, dtype="float32", mix=[[1, 1.0]],
                             padding=[0.0, 0.25], pool=6, seed=7)
    pool = loadtest.make_pool(plan)
    return out, (pool, loadtest.expected_answers(kkdeploy.load(out), pool))


def test_requests_in_flight_at_the_signal_are_answered_before_the_stop(unbucketed, install):
    """The drain waits for accepted requests: each single-sequence request waits 0.8 s in Triton's queue (a batch of
    2 is preferred), so one is in flight at the signal; it is answered exactly, and the stop is clean."""
    from kkdeploy.commands.serve import STOP_BUDGET_S

    artifacts, oracle = unbucketed
    ports = triton_server.free_ports()
    serve = Serve(artifacts, ports, "--max-queue-delay-us", "800000")
    load = None
    try:
        assert serve.wait_for(r"^ready in", 120), serve.text
        workdir = serve.workdir
        server_pid = int(re.search(r"tritonserver pid (\d+)", serve.text).group(1))
        shm, ours = shm_regions(), shm_regions(workdir)
        load = Load(ports, oracle, clients=(("grpc", 0),))  # one client: no second sequence to complete a batch
        time.sleep(2.0)
        assert load.count("ok") >= 1
        began, code, took = signal_and_wait(serve, signal.SIGINT)
        load.finish()
        held = load.in_flight_at(began)
        assert len(held) == 1 and held[0][1] == "ok", (held, serve.text)  # answered, exactly, during the stop
        assert held[0][0] - held[0][3] > 0.7  # it did wait in the queue
        assert code == 0 and took <= 5.0 and stop_line(serve.text) <= STOP_BUDGET_S, (took, serve.text)
        assert load.count("wrong") == 0
        assert_nothing_left(serve, workdir, server_pid, shm, ours)
    finally:
        if load is not None:
            load.finish()
        serve.close()


def test_a_stop_that_cannot_drain_exits_non_zero_and_still_leaves_nothing(small, install, oracle):
    from kkdeploy.commands.serve import AFTER_DRAIN_S

    ports = triton_server.free_ports()
    serve = Serve(small, ports, "--drain-timeout", "1", "--no-watchdog")
    frozen = None
    try:
        assert serve.wait_for(r"^ready in", 120), serve.text
        workdir = serve.workdir
        server_pid = int(re.search(r"tritonserver pid (\d+)", serve.text).group(1))
        shm, ours = shm_regions(), shm_regions(workdir)
        frozen = serve.stub_pid()
        os.kill(frozen, signal.SIGSTOP)  # the model can neither answer nor unload
        load = Load(ports, oracle, clients=(("http", 4),))  # a request that is in flight, and stays so
        time.sleep(0.5)
        began, code, took = signal_and_wait(serve, signal.SIGINT)
        load.finish()
        assert code == 1, serve.text  # honest: a request was cut off, this stop was not clean
        assert "unclean stop: requests were still in flight after 1 s" in serve.text, serve.text
        assert took <= 5.0 and stop_line(serve.text) <= 1 + AFTER_DRAIN_S, (took, serve.text)
        assert load.count("wrong") == 0
        assert_nothing_left(serve, workdir, server_pid, shm, ours)  # the frozen stub was killed, its region removed
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        serve.close()


MALFORMED = {  # what Triton's HTTP front answers (it decides these, before any model runs): see docs/serving.md
    "random bytes": (b"\x8f\x00\xffgarbage", 500, "failed to parse the request JSON"),
    "truncated JSON": (b'{"inputs":[{"name":"x","shape":[1,8,16],"datatype":"FP32","data":[0.0,', 500,
                       "failed to parse the request JSON"),
    "data count that does not match the shape": (json.dumps({"inputs": [{"name": "x", "shape": [1, 8, 16],
                                                                          "datatype": "FP32", "data": [0.0] * 10}]}),
                                                 500, "does not match"),
    "negative dimension": (json.dumps({"inputs": [{"name": "x", "shape": [-1, 8, 16], "datatype": "FP32",
                                                   "data": [0.0]}]}), 500, "Unable to parse 'shape'"),
    "unknown input": (json.dumps({"inputs": [{"name": "z", "shape": [1, 8, 16], "datatype": "FP32",
                                              "data": [0.0] * 128}]}), 400, "unexpected inference input"),
}


def test_malformed_http_bodies_get_triton_s_status_and_the_server_keeps_answering(small, install, oracle):
    ports = triton_server.free_ports()
    serve = Serve(small, ports, "--probe-interval", "1")
    try:
        assert serve.wait_for(r"^ready in", 120), serve.text
        url = f"http://127.0.0.1:{ports['http']}/v2/models/kkdeploy/infer"
        for what, (body, status, message) in MALFORMED.items():
            data = body if isinstance(body, bytes) else body.encode()
            request = urllib.request.Request(url, data=data, method="POST",
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(request, timeout=10)
            assert err.value.code == status, what
            assert message in err.value.read().decode(), what
        assert readiness(ports["http"]) == 200
        time.sleep(1.5)  # a canary ran after the bad bodies: they are no fault of the model's
        assert "broken" not in serve.text
        load = Load(ports, oracle, clients=(("http", 3),))
        time.sleep(1.0)
        load.finish()
        assert load.count("ok") > 0 and load.count("wrong") == 0 and load.count("error") == 0
        serve.proc.send_signal(signal.SIGINT)
        assert serve.proc.wait(timeout=30) == 0
    finally:
        serve.close()


def test_a_model_that_cannot_be_healed_makes_serve_exit_3_with_the_reason(small, install):
    ports = triton_server.free_ports()
    serve = Serve(small, ports, "--heal-timeout", "6")
    try:
        assert serve.wait_for(r"^ready in", 120), serve.text
        workdir = serve.workdir
        model_py = Path(workdir) / "repository" / "kkdeploy" / "1" / "model.py"
        model_py.write_text("raise RuntimeError('broken on purpose')\n")  # no reload can succeed
        killed_at = time.monotonic()
        os.kill(serve.stub_pid(), signal.SIGKILL)
        time.sleep(2.0)
        assert readiness(ports["http"]) != 200  # not ready while broken
        code = serve.proc.wait(timeout=60)
        assert code == 3, serve.text
        assert time.monotonic() - killed_at <= 30
        assert re.search(r"could not be healed within 6 s: .*", serve.text), serve.text
        kept = Path(tempfile.gettempdir()) / "kkdeploy-serve-last.log"  # the server's log outlives its work directory
        assert str(kept) in serve.text and "broken on purpose" in kept.read_text()
        assert len(re.findall(r"watchdog: .* broken", serve.text)) == 1
        assert triton_server.processes_mentioning(workdir) == [] and not Path(workdir).exists()
    finally:
        serve.close()


class FakeServer:
    """What the watchdog asks of a server, scripted."""

    http_url = "127.0.0.1:1"

    def __init__(self, stubs: dict, load_ok: bool = True):
        self.stubs, self.load_ok = stubs, load_ok
        self.calls: list[str] = []
        self.running = True

    def alive(self):
        return self.running

    def stub_pids(self):
        return self.stubs

    def unload(self, model, timeout_s=10.0):
        self.calls.append(f"unload {model}")
        return True

    def load(self, model, timeout_s=300.0):
        self.calls.append(f"load {model}")
        return self.load_ok

    def model_states(self):
        return {}

    def failure_reason(self):
        return "model.py raised"


def test_watchdog_logic_with_a_scripted_server():
    from kkdeploy.serving.watchdog import HealFailed, Watchdog, pid_alive

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert pid_alive(os.getpid()) and not pid_alive(dead.pid)
    lines: list[str] = []
    server = FakeServer({"kk": [os.getpid()], "kk_engine": [dead.pid]})
    dog = Watchdog(server, ["kk", "kk_engine"], None, lines.append, heal_timeout_s=5)
    dog.baseline(timeout_s=0.1)
    assert dog.problem() == (["kk_engine"], f"the Python-backend stub of kk_engine (pid {dead.pid}) died")
    server.stubs = {"kk": [os.getpid()], "kk_engine": [os.getpid()]}  # the reload starts a new stub
    dog.step()
    assert server.calls == ["unload kk_engine", "load kk_engine"]
    assert len(lines) == 2 and "broken" in lines[0] and "healed" in lines[1] and dog.healed == 1
    assert dog.problem() is None

    class WrongCanary:
        def ask(self, url):
            return "the canary's answer differs from the validated answer"

    lines.clear()
    failing = FakeServer({"kk": [os.getpid()]}, load_ok=True)
    dog = Watchdog(failing, ["kk"], WrongCanary(), lines.append, probe_every_s=0.0, heal_timeout_s=1.0)
    dog.baseline(timeout_s=0.1)
    with pytest.raises(HealFailed, match="could not be healed within 1 s: the canary's answer differs"):
        dog.step()
    assert failing.calls[-1] == "unload kk"  # left unready for the supervisor
    assert len(lines) == 1 and "broken" in lines[0]

    # A stub that dies while the canary asks (the canary's request fails with it): the cause is named, not the symptom
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    class KillingCanary:
        def ask(self, url):
            victim.kill()
            victim.wait()
            return "the canary's request failed: the stub is gone"

    racing = FakeServer({"kk": [os.getpid(), victim.pid]})
    dog = Watchdog(racing, ["kk"], KillingCanary(), lines.append, probe_every_s=0.0)
    dog.baseline(timeout_s=0.1)
    assert dog.problem() == (["kk"], f"the Python-backend stub of kk (pid {victim.pid}) died")

    # The server itself died (a crash while loading, say): started again, every model with it, then the canary
    lines.clear()
    crashed = FakeServer({"kk": [os.getpid()]})
    restarts = []

    def restart(limit_s):
        restarts.append(limit_s)
        crashed.running = True

    dog = Watchdog(crashed, ["kk"], None, lines.append, heal_timeout_s=5, restart=restart)
    dog.baseline(timeout_s=0.1)
    crashed.running = False
    assert dog.problem() == (["kk"], "tritonserver died (model.py raised)")
    dog.step()
    assert len(restarts) == 1 and 0 < restarts[0] <= 5 and crashed.calls == []  # no unload or load: a fresh server
    assert "restarting tritonserver" in lines[0] and "healed" in lines[1] and "tritonserver restarted" in lines[1]
    crashed.running = False
    with pytest.raises(HealFailed, match="tritonserver died"):  # and without a way to restart it: exit with the reason
        Watchdog(crashed, ["kk"], None, lines.append, heal_timeout_s=5).step()

    # Found alive at the fault (a kill -9 is first seen as a reset connection), dead by the reload: the restart is
    # said in a line of its own before it is healed
    class DiesWhileUnloading(FakeServer):
        def unload(self, model, timeout_s=10.0):
            self.running = False
            return super().unload(model, timeout_s)

        def load(self, model, timeout_s=300.0):
            self.calls.append(f"load {model}")
            return self.running

    lines.clear()
    dying = DiesWhileUnloading({"kk": [os.getpid()]})

    def restart_dying(limit_s):
        dying.running = True

    dog = Watchdog(dying, ["kk"], None, lines.append, heal_timeout_s=5, restart=restart_dying)
    dog.baseline(timeout_s=0.1)
    dog.heal(["kk"], "the canary's request failed: Connection reset by peer")
    assert "unloading (not ready) and reloading" in lines[0]
    assert lines[1] == "watchdog: tritonserver died; restarting tritonserver"
    assert "healed" in lines[2] and "tritonserver restarted" in lines[2] and len(lines) == 3

    # One stub of a model with several instances died: a restart, not an unload (Triton never completes that unload;
    # without a way to restart, the reload is still tried)
    lines.clear()
    several = FakeServer({"kk": [os.getpid(), dead.pid]})
    restarts.clear()

    def restart_several(limit_s):
        restarts.append(limit_s)
        several.stubs = {"kk": [os.getpid(), os.getpid()]}

    dog = Watchdog(several, ["kk"], None, lines.append, heal_timeout_s=5, restart=restart_several)
    dog.baseline(timeout_s=0.1)
    dog.step()
    assert len(restarts) == 1 and several.calls == []
    assert "cannot be unloaded" in lines[0] and "tritonserver restarted" in lines[1]
    # a wrong canary with every stub alive: an unload of a healthy model completes, so a reload as usual
    several.stubs = {"kk": [os.getpid(), os.getpid()]}
    several.calls.clear()
    restarts.clear()

    class WrongOnce:
        answers = ["the canary's answer differs from the validated answer", None, None]

        def ask(self, url):
            return self.answers.pop(0)

    dog = Watchdog(several, ["kk"], WrongOnce(), lines.append, probe_every_s=0.0, heal_timeout_s=5,
                   restart=restart_several)
    dog.baseline(timeout_s=0.1)
    dog.step()
    assert restarts == [] and several.calls == ["unload kk", "load kk"]
    several.stubs = {"kk": [os.getpid(), dead.pid]}
    several.calls.clear()
    dog = Watchdog(several, ["kk"], None, lines.append, heal_timeout_s=5)
    dog.baseline(timeout_s=0.1)
    several.stubs = {"kk": [os.getpid(), os.getpid()]}
    dog.step()
    assert several.calls == ["unload kk", "load kk"]
