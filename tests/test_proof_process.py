"""The proof step in a spawned child (kkdeploy.kernels.proof_process), on the CPU with the fake kernels of
test_model_proofs installed in the child by this module's task: the records come back as the build's process would
have made them; an op shape whose proof kills the child (a signal, a hang) is refused with the reason while the
others are proven by a new child; a Python error is one line; nothing is spawned where every record is known. The
real fault (a sticky CUDA error) is the GPU's: docs/layer-kernels.md has the device run."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kkdeploy.errors import KKError
from kkdeploy.kernels import faithful_attention as fa
from kkdeploy.kernels import model_proofs as mp
from kkdeploy.kernels import proof_process as pp
from kkdeploy.models.weights import build_models

from .test_model_proofs import CONFIG, CPU, FakeKernels

TASK = f"{__name__}:fake_kernels_task"


class _Patch:
    """What FakeKernels needs of pytest's monkeypatch, in a child that has none."""
    setattr = staticmethod(setattr)


def fake_kernels_task(model, config, dtype, device, args, report):
    """The child's proof with FakeKernels; ``args["die_at"]`` (a kind) and ``args["how"]`` (``segv``, ``hang``,
    ``raise``) make the child die when it names that kind's first op shape, or (``args["die_launch"]``) that launch
    of it."""
    FakeKernels(_Patch, bad=set(args.get("bad", ())))
    die_at, how, die_launch = args.get("die_at"), args.get("how"), args.get("die_launch")
    report(None, f"child pid {os.getpid()}")

    def dying_report(key, message):
        report(key, message)
        if (key and die_at and key.startswith(f"{die_at} ")
                and (die_launch is None or key.endswith(f"{mp.LAUNCH_SEP}{die_launch}"))):
            if how == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if how == "hang":
                time.sleep(600)
            raise ValueError(f"the fake {die_at} kernel broke")

    return pp.model_kernels_task(model, config, dtype, device, args, dying_report)


@pytest.fixture
def model():
    return build_models(CONFIG, torch.float16, CPU)[0]


def prove(model, **kw):
    return pp.prove_model_kernels_isolated(model, CONFIG, torch.float16, CPU, mp.KINDS, isolate=True, **kw)


def test_a_child_s_records_are_the_build_s_and_this_process_knows_them(monkeypatch, proof_sandbox, model):
    messages = []
    proofs = prove(model, task=TASK, progress=messages.append)
    assert [r.op for r in proofs.records] == [fa.OP, "layer_norm_rows"] + ["fused_linear"] * 7
    assert all(r.proven for r in proofs.records) and proofs.reused == 0
    assert any(m.startswith("proving attention") for m in messages)  # the child's progress, as it went
    assert proofs.phases["processes"] > 0 and {"cases", "prove"} <= set(proofs.phases)
    # the records are this process's now: a sibling candidate's proof spawns nothing, and reuses them all
    monkeypatch.setattr(pp, "run_proof_child", lambda *a, **kw: pytest.fail("spawned a child for known records"))
    again = prove(model, task=TASK)
    assert again.reused == len(proofs.records) and again.to_list() == proofs.to_list()


def test_a_study_s_launches_reach_the_child(proof_sandbox, model):
    """scripts/kernel_selftest.py --all-launches proves every variant in a child, as a build proves its own: the
    child proves the launches it is given, not a build's."""
    proofs = prove(model, task=TASK, reuse=False, launches={"layer_norm": ["rows1"]})
    norm = next(r for r in proofs.records if r.op == "layer_norm_rows")
    assert [r.launch for r in norm.launches] == ["rows1"] and norm.chosen == "rows1"


def test_a_failing_launch_is_rejected_in_the_child_as_in_the_build_s_process(monkeypatch, proof_sandbox, model):
    real = pp.run_proof_child
    monkeypatch.setattr(pp, "run_proof_child",
                        lambda task, *a, **kw: real(task, *a[:4], {**a[4], "bad": ["rows2", "rows2_full"]}, **kw))
    norm = next(r for r in prove(model, task=TASK).records if r.op == "layer_norm_rows")
    assert norm.chosen == "rows1"
    assert {r.launch: r.status for r in norm.launches} == {"rows2_full": "differs", "rows2": "differs",
                                                             "rows1": "proven"}


def test_an_op_shape_whose_proof_kills_the_child_is_refused_and_the_rest_proven(monkeypatch, proof_sandbox, model):
    calls = []
    real = pp.run_proof_child

    def counting(task, *a, **kw):
        calls.append(dict(a[4]))
        a[4].update(die_at="attention", how="segv")
        return real(task, *a, **kw)

    monkeypatch.setattr(pp, "run_proof_child", counting)
    proofs = prove(model, task=TASK)
    attention = proofs.records[0]
    assert not attention.proven
    assert attention.reason == ("its proof crashed: SIGSEGV (signal 11) in a fresh process, so ATen runs it (the same "
                                "bits)")
    assert all(r.proven for r in proofs.records[1:])
    # the second child was told to refuse the op shape the first one died on, and did not die (no kernel ran)
    assert len(calls) == 2 and list(calls[1]["refusals"]) == [mp.op_key("attention", attention.shape)]
    assert not proofs.proven("attention") and proofs.proven("linear")


@pytest.mark.parametrize("timeout_s, stall_s, why", [
    (20.0, None, "no answer within 20 s"),
    # a study gives its child an hour (scripts/kernel_selftest.py): a kernel that never returns is caught by the
    # silence instead
    (3600.0, 8.0, "no progress for 8 s"),
])
def test_a_hung_proof_is_ended_and_its_op_shape_refused(monkeypatch, proof_sandbox, model, timeout_s, stall_s, why):
    real = pp.run_proof_child

    def hanging_at_layer_norm(task, *a, **kw):
        a[4].update(die_at="layer_norm", how="hang")
        return real(task, *a, **{**kw, "timeout_s": timeout_s})

    monkeypatch.setattr(pp, "run_proof_child", hanging_at_layer_norm)
    started = time.perf_counter()
    proofs = prove(model, task=TASK, stall_s=stall_s)
    norm = next(r for r in proofs.records if r.op == "layer_norm_rows")
    assert norm.reason.startswith(f"its proof hung: {why} in a fresh process") and not norm.proven
    assert proofs.proven("attention") and proofs.proven("linear")
    assert time.perf_counter() - started < 120


def test_a_launch_that_hangs_its_child_is_refused_alone(monkeypatch, proof_sandbox, model):
    """The child names each launch before it runs it: a launch that never returns (a new tile's deadlock, in a
    study) is refused by itself, and its op shape's other launches are proven by the next child."""
    real = pp.run_proof_child
    children = []

    def hanging_at_rows2(task, *a, **kw):
        children.append(dict(a[4].get("refusals") or {}))
        a[4].update(die_at="layer_norm", die_launch="rows2", how="hang")
        return real(task, *a, **kw)

    monkeypatch.setattr(pp, "run_proof_child", hanging_at_rows2)
    messages = []
    proofs = prove(model, task=TASK, stall_s=8.0, progress=messages.append)
    norm = next(r for r in proofs.records if r.op == "layer_norm_rows")
    launches = {r.launch: r for r in norm.launches}
    assert launches["rows2"].status == "error"
    assert launches["rows2"].detail == "it hung: no progress for 8 s in a fresh process, so it does not run here"
    assert launches["rows1"].status == launches["rows2_full"].status == "proven" and norm.chosen != "rows2"
    assert all(r.proven for r in proofs.records)
    key = mp.launch_key(mp.op_key("layer_norm", norm.shape), "rows2")
    assert len(children) == 2 and list(children[1]) == [key]
    assert f"refused {key}: it hung: no progress for 8 s in a fresh process, so it does not run here" in messages
    assert not norm.conclusive  # a refusal is this run's, not a lasting fact: the record is not cached


def _gone(pid: int) -> bool:
    """Whether a process has ended: no such pid, or a zombie its new parent has not reaped (a container's init may
    never reap)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return _gone(pid)


def test_an_interrupted_proof_ends_its_child(proof_sandbox, model):
    """Ctrl-C, or a campaign step's time limit (SIGINT), while a child proves: the child in its own session gets no
    signal from the terminal, so the parent ends it on the way out. On an H100 an orphaned study child went on
    proving for minutes under the next command's timings."""
    pids = []

    def interrupt(message):
        if message.startswith("child pid "):
            pids.append(int(message.split()[-1]))
        if pids and message.startswith("proving "):  # the child is at work: interrupt the parent's wait
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pp.run_proof_child(TASK, model, CONFIG, torch.float16, CPU,
                           {"kinds": list(mp.KINDS), "die_at": "layer_norm", "how": "hang"}, progress=interrupt,
                           timeout_s=600.0)
    assert pids and _gone(pids[0])


@pytest.mark.parametrize("spawn", [
    # one of our Python children (the proof's, the load check's): it asks at its start (die_with_parent)
    "child = spawn_python('tests.proof_child_sleeper', [], open(LOG, 'wb'))",
    # a binary (the Triton server): the parent asks for it between fork and exec (death_signal_hook)
    "child = subprocess.Popen(['sleep', '600'], start_new_session=True, preexec_fn=death_signal_hook()); "
    "open(LOG, 'w').write('sleeping')",
], ids=["python-child", "binary"])
def test_a_child_dies_with_a_parent_killed_outright(tmp_path, spawn):
    """SIGKILL (or SIGTERM's default) ends a parent without running its ``finally``: the child was set to be ended by
    the kernel with its parent (``PR_SET_PDEATHSIG``)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    ready = tmp_path / "log"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        "from kkdeploy.processes import death_signal_hook, spawn_python\n"
        f"LOG = {str(ready)!r}\n"
        f"{spawn}\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while not (ready.is_file() and b"sleeping" in ready.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.1)  # the child has asked to die with its parent
    assert not _gone(child)
    parent.kill()
    parent.wait()
    assert _wait_gone(child, 10.0)


def test_a_child_whose_parent_is_already_gone_exits_at_once():
    import subprocess
    import sys

    from kkdeploy.processes import ORPHANED_EXIT, PARENT_ENV

    run = subprocess.run([sys.executable, "-c", "from kkdeploy.processes import die_with_parent\n"
                          "die_with_parent(); print('still here')"], capture_output=True, text=True,
                         env={**os.environ, PARENT_ENV: "1" if os.getpid() != 1 else "2"})
    assert run.returncode == ORPHANED_EXIT and "still here" not in run.stdout


def test_a_python_error_in_the_child_is_one_line(monkeypatch, proof_sandbox, model):
    real = pp.run_proof_child
    monkeypatch.setattr(pp, "run_proof_child",
                        lambda task, *a, **kw: real(task, *a[:4], {**a[4], "die_at": "linear", "how": "raise"}, **kw))
    with pytest.raises(KKError, match=r"^the kernel proof failed in a fresh process: ValueError: the fake linear "
                                      r"kernel broke$"):
        prove(model, task=TASK)


def test_proofs_run_in_a_child_on_cuda_only_unless_switched_off(monkeypatch):
    assert pp.isolation_wanted("cuda") and not pp.isolation_wanted("cpu")
    monkeypatch.setenv("KKDEPLOY_PROOF_PROCESS", "0")
    assert not pp.isolation_wanted("cuda")


def test_refused_op_shapes_run_nothing_and_the_others_are_named_before_they_run(monkeypatch, proof_sandbox, model):
    fakes = FakeKernels(monkeypatch)
    named = []
    key = mp.op_key("attention", fa.proof_shape(4, 8, 8, True))
    proofs = mp.prove_model_kernels(model, CONFIG, torch.float16, CPU, refusals={key: "it faulted"},
                                    on_op=named.append)
    assert named == [mp.op_key(kind, shape) for kind, _, shape in mp.kernel_op_shapes(CONFIG, mp.KINDS)][1:]
    assert proofs.records[0].reason == "it faulted" and not proofs.records[0].proven
    assert not any(launch in fa.LAUNCHES for launch in fakes.calls)  # no attention launch ran
