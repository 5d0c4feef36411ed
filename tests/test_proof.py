"""kkdeploy.kernels.proof: a kernel runs only where a proof made here found it bit-identical (fake ops on the CPU;
the real kernels' arithmetic is the GPU's and the interpreter tests')."""

import json

import pytest
import torch

from kkdeploy.kernels import proof


def fake_cases(n=3, bad_on=None, crash_on=None):
    """Cases whose reference is x * 2; launch 'exact' doubles, 'off-by-one-ulp' perturbs case ``bad_on``,
    'slow' doubles slowly, 'crash' raises on case ``crash_on``."""
    cases = []
    for i in range(n):
        x = torch.arange(16, dtype=torch.float16) + i

        def run(launch, x=x, i=i):
            y = x * 2
            if launch == "off-by-one-ulp" and i == bad_on:
                y = y.clone()
                y.view(torch.int16)[3] += 1
            if launch == "crash" and i == crash_on:
                raise RuntimeError("launch failed\nsecond line")
            if launch == "slow":
                for _ in range(20000):
                    pass
            return y

        cases.append(proof.ProofCase(f"case {i}", lambda x=x: x * 2, run))
    return cases


def test_only_launches_with_zero_differing_bits_on_every_case_are_proven_and_the_fastest_is_chosen():
    record = proof.prove_launches("fake", {"n": 16}, ["slow", "off-by-one-ulp", "exact", "crash"],
                                  fake_cases(bad_on=2, crash_on=1), "cpu", environment={"k": 1}, repeats=3)
    status = {r.launch: r for r in record.launches}
    assert status["off-by-one-ulp"].status == "differs" and status["off-by-one-ulp"].differing == 1
    assert status["off-by-one-ulp"].detail == "first difference on case 2"
    assert status["crash"].status == "error" and status["crash"].detail == "case 1: RuntimeError: launch failed"
    assert status["exact"].status == status["slow"].status == "proven"
    assert status["exact"].elements == 48 and status["exact"].cases == 3
    assert record.chosen == "exact" and status["exact"].ms <= status["slow"].ms
    assert "2 of 4 launches bit-identical on 3 cases" in record.reason
    assert record.to_dict()["launches"][2]["launch"] == "exact"
    assert proof.ProofRecord.from_dict(record.to_dict()) == record


def test_no_bit_identical_launch_proves_nothing_and_says_why():
    record = proof.prove_launches("fake", {}, ["off-by-one-ulp"], fake_cases(bad_on=0), "cpu", environment={})
    assert record.chosen is None and not record.proven
    assert record.reason == "no launch was bit-identical on every case: off-by-one-ulp differs (1 differing)"


def test_a_spent_budget_leaves_launches_unproven():
    ticks = iter([0.0, 5.0, 100.0, 100.0, 100.0])  # the first case always runs: no clock asked before it
    record = proof.prove_launches("fake", {}, ["exact"], fake_cases(n=3), "cpu", environment={}, budget_s=10,
                                  clock=lambda: next(ticks))
    assert record.cases == ["case 0", "case 1"] and record.chosen is None
    assert record.reason == "budget of 10 s spent before case 'case 2'"
    assert record.launches[0].status == "unproven"


def test_bits_not_values_decide():
    a = torch.tensor([0.0, 1.0], dtype=torch.float16)
    assert proof.differing_elements(a, torch.tensor([-0.0, 1.0], dtype=torch.float16)) == 1  # +0, -0: other bits
    assert proof.differing_elements(a, a.float()) == 2  # another dtype: every element
    assert proof.differing_elements(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 0


def test_the_cache_is_keyed_by_environment_op_and_shape(tmp_path):
    cache = proof.ProofCache(tmp_path)
    record = proof.ProofRecord(op="fake", shape={"n": 16}, environment={"torch": "a"}, chosen="exact", reason="r")
    cache.put(record)
    assert cache.get({"torch": "a"}, "fake", {"n": 16}) == record
    assert cache.get({"torch": "b"}, "fake", {"n": 16}) is None  # another environment proves again
    assert cache.get({"torch": "a"}, "fake", {"n": 32}) is None  # another op shape too
    assert cache.get({"torch": "a"}, "other", {"n": 16}) is None
    cache.path({"torch": "a"}, "fake", {"n": 16}).write_text("{not json")
    assert cache.get({"torch": "a"}, "fake", {"n": 16}) is None  # a damaged file is no proof


def test_a_cached_record_timed_another_way_is_proven_again(tmp_path, monkeypatch):
    """The record says how its launches were timed; the disk cache finds only records timed as this process times
    (a record from before the 16-calls timer, with no timer, or with the other one, chose on other clocks). The
    manifest's records are adopted at load whatever their timer."""
    cache = proof.ProofCache(tmp_path)
    record = proof.ProofRecord(op="fake", shape={"n": 16}, environment={"torch": "a"}, chosen="exact")
    assert record.timer == proof.timer() == "16 calls per graph under 0.05 ms"
    path = cache.put(record)
    assert cache.get({"torch": "a"}, "fake", {"n": 16}) == record
    monkeypatch.setattr(proof, "MANY_CALLS_PER_GRAPH", False)
    assert proof.timer() == "1 call per graph" and cache.get({"torch": "a"}, "fake", {"n": 16}) is None
    monkeypatch.setattr(proof, "MANY_CALLS_PER_GRAPH", True)
    data = json.loads(path.read_text())
    del data["timer"]  # a record written before records said how they were timed
    path.write_text(json.dumps(data))
    assert cache.get({"torch": "a"}, "fake", {"n": 16}) is None
    adopted = proof.ProofRecord.from_dict(data)  # what a manifest's adoption reads
    assert adopted.chosen == "exact" and adopted.timer == "not recorded"
    cpu = proof.ProofRecord(op="fake", shape={"n": 16}, environment={"device_type": "cpu"}, chosen="exact")
    assert cpu.timer == "wall clock, one call at a time"  # no graph off CUDA
    cache.put(cpu)
    assert cache.get({"device_type": "cpu"}, "fake", {"n": 16}) == cpu


def test_remembered_proofs_are_found_in_process_then_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path))
    proof.forget_proofs()
    try:
        record = proof.ProofRecord(op="fake", shape={"n": 1}, environment={"e": 1}, chosen="exact")
        assert proof.lookup_proof({"e": 1}, "fake", {"n": 1}) is None
        proof.remember_proof(record)
        assert proof.lookup_proof({"e": 1}, "fake", {"n": 1}) is record
        proof.forget_proofs()
        assert proof.lookup_proof({"e": 1}, "fake", {"n": 1}) == record  # from $KKDEPLOY_CACHE_DIR/proofs
        assert proof.lookup_proof({"e": 2}, "fake", {"n": 1}) is None
    finally:
        proof.forget_proofs()


def test_the_environment_key_names_what_the_machine_code_depends_on():
    key = proof.environment_key("cpu", {"kernel": "k", "source": "abc"})
    assert key["device_type"] == "cpu" and key["torch"] == torch.__version__ and key["source"] == "abc"
    assert "triton" in key and "cuda" in key


def test_a_launch_that_differed_is_not_run_again():
    runs = []
    cases = fake_cases(n=3, bad_on=0)
    for case in cases:
        inner = case.run
        case.run = lambda launch, inner=inner: (runs.append(launch), inner(launch))[1]
    record = proof.prove_launches("fake", {}, ["off-by-one-ulp", "exact"], cases, "cpu", environment={}, repeats=1)
    assert runs.count("off-by-one-ulp") == 1 and record.chosen == "exact"
    assert {r.launch: r.cases for r in record.launches} == {"off-by-one-ulp": 1, "exact": 3}


def test_a_bit_identical_launch_slower_than_aten_is_not_chosen():
    """``against_reference``: ATen gives the same bits, so a slower kernel buys nothing."""
    cases = fake_cases(n=2)
    record = proof.prove_launches("fake", {}, ["slow"], cases, "cpu", environment={}, repeats=3,
                                  against_reference=True)
    assert record.launches[0].status == "proven" and record.chosen is None
    assert record.reference_ms is not None and "ATen is as fast or faster" in record.reason
    fast = proof.prove_launches("fake", {}, ["exact"], [proof.ProofCase("c", lambda: _slow_double(cases[0]),
                                                                        cases[0].run)],
                                "cpu", environment={}, repeats=3, against_reference=True)
    assert fast.chosen == "exact" and fast.reference_ms > fast.launches[0].ms


def _slow_double(case):
    for _ in range(20000):
        pass
    return case.reference()


def test_kernel_environment_holds_the_source_hash(tmp_path):
    source = tmp_path / "k.py"
    source.write_text("a")
    first = proof.kernel_environment("cpu", "op", [source])
    source.write_text("b")
    proof._kernel_environment.cache_clear()
    second = proof.kernel_environment("cpu", "op", [source])
    assert first["kernel"] == "op" and first["source"] != second["source"]
    assert {k: v for k, v in first.items() if k != "source"} == {k: v for k, v in second.items() if k != "source"}


def test_an_inconclusive_proof_is_not_kept_on_disk(tmp_path, monkeypatch):
    """A launch that errored (out of memory, say) or a budget that ran out says nothing lasting: this process keeps
    the record, the next one proves again."""
    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path))
    proof.forget_proofs()
    try:
        crashed = proof.prove_launches("fake", {"n": 1}, ["crash"], fake_cases(n=2, crash_on=0), "cpu",
                                       environment={"e": 1})
        assert not crashed.conclusive
        proof.remember_proof(crashed)
        assert proof.lookup_proof({"e": 1}, "fake", {"n": 1}) is crashed
        proof.forget_proofs()
        assert proof.lookup_proof({"e": 1}, "fake", {"n": 1}) is None
        differs = proof.prove_launches("fake", {"n": 2}, ["off-by-one-ulp"], fake_cases(bad_on=0), "cpu",
                                       environment={"e": 1})
        assert differs.conclusive  # a launch that differs is a fact of this environment
        proof.remember_proof(differs)
        proof.forget_proofs()
        assert proof.lookup_proof({"e": 1}, "fake", {"n": 2}) == differs
    finally:
        proof.forget_proofs()


def test_a_kernel_op_asking_on_every_call_reads_the_disk_once(tmp_path, monkeypatch):
    """A miss in the default cache is remembered too (an op without a proof asks on every call it is not captured
    in a graph); a proof remembered later replaces the miss. A cache passed in (an artifact's proofs/) is always
    read."""
    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path))
    reads = []
    real_get = proof.ProofCache.get
    monkeypatch.setattr(proof.ProofCache, "get", lambda self, *a: reads.append(self.root) or real_get(self, *a))
    proof.forget_proofs()
    try:
        environment = {"e": 1}
        for _ in range(3):
            assert proof.lookup_proof(environment, "fake", {"n": 1}) is None
        assert len(reads) == 1
        record = proof.ProofRecord(op="fake", shape={"n": 1}, environment=environment, chosen="exact")
        proof.remember_proof(record)
        assert proof.lookup_proof({"e": 1}, "fake", {"n": 1}) is record and len(reads) == 1
        local = proof.ProofCache(tmp_path / "artifact")
        for _ in range(2):
            assert proof.lookup_proof(environment, "fake", {"n": 2}, cache=local) is None
        assert len(reads) == 3
    finally:
        proof.forget_proofs()


# -- compiles ahead (kkdeploy.kernels.precompile) ------------------------------------------------------------------
class FakeKernel:
    """Records how it was called: launched (``kernel[grid](...)``) or compiled only (``kernel.warmup``)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("launch", grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("compile", grid, args, kwargs))


def test_a_launch_compiles_only_inside_parallel_compiles():
    from kkdeploy.kernels import precompile

    kernel = FakeKernel()
    precompile.launch(kernel, (2, 1), "x", BLOCK=64)
    with precompile.parallel_compiles(2):
        assert precompile.compile_only()
        precompile.launch(kernel, (4, 1), "y", BLOCK=32)
    assert not precompile.compile_only()
    assert kernel.calls == [("launch", (2, 1), ("x",), {"BLOCK": 64}), ("compile", (4, 1), ("y",), {"BLOCK": 32})]
    with precompile.parallel_compiles(0):  # no pool: launches run as they are
        assert not precompile.compile_only()


def test_inside_parallel_compiles_a_proof_runs_each_launch_once_on_its_first_case_and_proves_nothing():
    import pytest

    from kkdeploy.kernels import precompile

    ran = []
    references = []

    def case(i):
        def run(launch):
            ran.append((launch, i))
            if launch == "crash":
                raise RuntimeError("compile failed")
            return torch.zeros(2)

        return proof.ProofCase(f"case {i}", lambda: references.append(i), run)

    with precompile.parallel_compiles(2), pytest.raises(proof.CompiledAhead):
        proof.prove_launches("fake", {}, ["a", "crash", "b"], [case(0), case(1)], "cpu", environment={})
    assert ran == [("a", 0), ("crash", 0), ("b", 0)] and references == []


def test_the_compile_pass_leaves_the_proofs_the_same_random_cases(monkeypatch):
    from kkdeploy.kernels import model_proofs

    class Cases:
        generator = torch.Generator()

    Cases.generator.manual_seed(5)
    seen = []

    def fake_prove(kind, name, shape, cases, config, device, budget_s, cache, refusal, launches):
        seen.append((name, torch.randn(2, generator=cases.generator)))
        if name == "broken":
            raise ValueError("not this one")
        raise proof.CompiledAhead(name)

    monkeypatch.setattr(model_proofs, "_prove", fake_prove)
    todo = [("linear", "qkv", {}, None), ("linear", "refused", {}, "no GPU"), ("linear", "broken", {}, None)]
    model_proofs._compile_ahead(todo, Cases, None, torch.device("cpu"), None, 2)
    assert [name for name, _ in seen] == ["qkv", "broken"]  # a refused op shape has nothing to compile
    assert torch.equal(torch.randn(2, generator=Cases.generator), seen[0][1])  # the generator was put back


def test_a_proof_replays_a_graph_enough_to_time_it_and_no_more():
    """Each timed repeat spans at least REPLAYED_MS of replays (a replay's own launch stays under 1% of it), and no
    more than GRAPH_REPLAYS: a 5 us launch is replayed 20 times as before, a 1 ms one once (shape 6's 1-15 ms
    launches were replayed 20 times per repeat, most of their proofs' seconds)."""
    from kkdeploy.kernels.proof import GRAPH_REPLAYS, REPLAYED_MS, graph_replays

    assert graph_replays(0.005) == GRAPH_REPLAYS == 20
    assert graph_replays(0.1) == 5 and graph_replays(0.1) * 0.1 >= REPLAYED_MS
    assert graph_replays(1.1) == graph_replays(14.7) == 1
    assert graph_replays(0.0) == GRAPH_REPLAYS  # a replay too short to register: the most replays


def test_a_short_op_is_timed_many_calls_to_a_graph_and_a_long_one_alone(monkeypatch):
    """A graph replay's own launch costs the device microseconds: a short op (one replay under SHORT_OP_MS) is timed
    CALLS_PER_GRAPH calls to a graph, fewer where their outputs would not fit CALLS_OUTPUT_BYTES; a long one alone.
    On in builds since a GPU build ran it (session 47); with MANY_CALLS_PER_GRAPH off, every op is timed one call per
    graph, as before."""
    from kkdeploy.kernels.proof import CALLS_OUTPUT_BYTES, CALLS_PER_GRAPH, SHORT_OP_MS, calls_per_graph, output_bytes

    assert proof.MANY_CALLS_PER_GRAPH
    monkeypatch.setattr(proof, "MANY_CALLS_PER_GRAPH", False)
    assert calls_per_graph(0.0055, 128 << 10) == 1
    monkeypatch.setattr(proof, "MANY_CALLS_PER_GRAPH", True)

    assert calls_per_graph(0.0055, 128 << 10) == CALLS_PER_GRAPH == 16  # shape 3's ops: 128 KiB outputs
    assert calls_per_graph(SHORT_OP_MS, 10) == calls_per_graph(1.3, 10) == 1
    assert calls_per_graph(0.01, CALLS_OUTPUT_BYTES // 3) == 3 and calls_per_graph(0.01, CALLS_OUTPUT_BYTES * 2) == 1
    assert calls_per_graph(0.01, 0) == CALLS_PER_GRAPH  # an op returning nothing the timer can size
    x = torch.zeros(4, 8, dtype=torch.float16)
    assert output_bytes(x) == 64 and output_bytes((x, [x, x], None)) == 192 and output_bytes(3.0) == 0


class _FakeGraph:
    """A captured ``fn``: each replay runs it (counting calls) and takes ``per_call_ms`` per call plus ``launch_ms``
    for the replay's own launch, as the fake event timer reads it."""

    def __init__(self, fn, calls, clock):
        self.fn, self.calls, self.clock = fn, calls, clock

    def replay(self):
        self.fn()
        self.clock["ms"] += self.clock["launch_ms"] + self.calls * self.clock["per_call_ms"]


@pytest.mark.parametrize("capture_many", [True, False, None], ids=["many-calls", "many-calls-refused", "off"])
def test_the_proof_timer_shares_a_replay_between_its_calls(monkeypatch, capture_many):
    """``median_ms`` on a GPU, its CUDA pieces faked: a 2 µs op whose replay launch costs 5 µs times 2.3 µs a call
    with 16 calls to a graph (the launch shared), not 7 µs; where the many-call graph cannot be captured, or while
    MANY_CALLS_PER_GRAPH is off, the one-call graph times it as before."""
    monkeypatch.setattr(proof, "MANY_CALLS_PER_GRAPH", capture_many is not None)
    clock = {"ms": 0.0, "launch_ms": 0.005, "per_call_ms": 0.002}
    calls = []
    out = torch.zeros(1024, dtype=torch.float16)

    def fn():
        calls.append(1)
        return out

    def fake_captured(body, device):
        before = len(calls)
        body()  # what capture records: count the op's calls in the body
        n = len(calls) - before
        if n > 1 and not capture_many:
            return None
        return _FakeGraph(body, n, clock)

    def fake_event_median_ms(body, repeats, device=None, digits=4):
        start = clock["ms"]
        body()
        return clock["ms"] - start

    monkeypatch.setattr(proof, "_captured", fake_captured)
    monkeypatch.setattr(proof, "event_median_ms", fake_event_median_ms)
    ms = proof.median_ms(fn, 3, torch.device("cuda"))
    if capture_many:
        assert ms == pytest.approx(0.002 + 0.005 / proof.CALLS_PER_GRAPH, abs=1e-5)
    else:
        assert ms == pytest.approx(0.007, abs=1e-5)


def test_a_changed_launch_table_is_another_environment():
    """A launch's settings, or the set of launches a build proves, are part of what a proof holds for: a record
    cached before a tile changed (or joined the build's set) is not found, so it is proven again."""
    from kkdeploy.kernels import faithful_attention as fa
    from kkdeploy.kernels import fused_linear as fl
    from kkdeploy.kernels import layer_norm as ln

    environment = fl.proof_environment("cpu", "none")
    assert environment["launches"] == fl.TILES_DIGESTS["gemm"] == proof.launch_table_digest(fl.TILES, fl.BUILD_TILES)
    assert fl.proof_environment("cpu", "none") is environment  # one dict per device: the op's hot path freezes it once
    changed = dict(fl.TILES, m64=dict(fl.TILES["m64"], num_stages=3))
    assert proof.launch_table_digest(changed, fl.BUILD_TILES) != fl.TILES_DIGESTS["gemm"]
    assert proof.launch_table_digest(fl.TILES, (*fl.BUILD_TILES, "tma")) != fl.TILES_DIGESTS["gemm"]
    # each family of tiles keys the launches it serves, and only those
    forms = {"gemm": ("none", "gelu", "add_masked", "gelu_prologue+add_masked", "qkv"),
             "layer_norm": ("add_masked+layer_norm", "masked_sum+layer_norm"),
             "ffn": (fl.FFN_FORM,),
             "norm": (f"{fl.NORM_PROLOGUE}+gelu", fl.NORM_PROLOGUE, f"{fl.NORM_PROLOGUE}+qkv")}
    for family, family_forms in forms.items():
        for form in family_forms:
            assert fl.tile_family(form) == family, form
            assert fl.proof_environment("cpu", form)["launches"] == fl.TILES_DIGESTS[family] == \
                proof.launch_table_digest(*fl.FAMILY_TABLES[family])
    assert len(set(fl.TILES_DIGESTS.values())) == len(fl.TILES_DIGESTS)
    # the LayerNorm epilogue's tiles: "regs" joining the build's set is another environment for its launches
    assert proof.launch_table_digest(fl.LN_TILES, ("auto", "regs")) != fl.TILES_DIGESTS["layer_norm"]
    # the feed-forward launch's: a tile leaving the build's set
    assert proof.launch_table_digest(fl.FFN_TILES, ("auto", "regs")) != fl.TILES_DIGESTS["ffn"]
    # the LayerNorm prologue's: a tile joining the build's set is another environment for the prologue's launches,
    # and the plain GEMMs' records stand (an A/B of the prologue re-proves only what it changes)
    assert proof.launch_table_digest(fl.NORM_TILES, ("ln_m64n32_w8",)) != fl.TILES_DIGESTS["norm"]
    assert fa.proof_environment("cpu")["launches"] == proof.launch_table_digest(fa.LAUNCHES, fa.BUILD_LAUNCHES)
    assert ln.LAUNCHES_DIGEST == proof.launch_table_digest(ln.LAUNCHES, ln.FULL_ROW_WIDTHS, ln.FULL_BLOCK_WIDTHS)


def test_the_survivors_and_aten_are_timed_in_rounds_of_alternating_order(monkeypatch):
    """A slow start (a clock still rising, another process finishing) makes whatever is timed first look slow. Each
    launch and ATen keep their fastest of TIMING_ROUNDS rounds, the second in reverse order, so the launch timed
    first in the first round is still chosen when it is the fastest; the repeats are shared out between rounds."""
    x = torch.arange(16, dtype=torch.float16)
    last = []

    def run(launch):
        last.append(launch)
        return x * 2

    def reference():
        last.append("aten")
        return x * 2

    true_ms = {"fast": 1.0, "slower": 2.0, "aten": 3.0}
    timed = []

    def fake_median_ms(fn, repeats, device):
        fn()
        name = last[-1]
        timed.append((name, repeats))
        return true_ms[name] * (8.0 if len(timed) == 1 else 1.0)  # the first timing of a proof runs slow

    monkeypatch.setattr(proof, "median_ms", fake_median_ms)
    record = proof.prove_launches("fake", {}, ["fast", "slower"], [proof.ProofCase("c", reference, run)], "cpu",
                                  environment={}, repeats=5, against_reference=True)
    assert proof.TIMING_ROUNDS == 2
    assert [name for name, _ in timed] == ["fast", "slower", "aten", "aten", "slower", "fast"]
    assert {repeats for _, repeats in timed} == {3}  # ceil(5 / 2) per round
    assert record.chosen == "fast" and {r.launch: r.ms for r in record.launches} == {"fast": 1.0, "slower": 2.0}
    assert record.reference_ms == 3.0 and "fastest fast at 1.0 ms" in record.reason
