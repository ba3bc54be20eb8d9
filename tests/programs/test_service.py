"""End-to-end test of examples/serve_and_train.py over real HTTP on a loopback port.

hypercorn serves the app on trio in this test's own trio run; httpx is the client (it runs on trio
through anyio). Predicts keep answering while the model trains; /train raises held-out accuracy; every
prediction matches exactly one published snapshot; shutdown leaves no asyncgrad thread.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import trio

# timing bounds: run alone, not beside another xdist worker (README's serial phase)
pytestmark = pytest.mark.serial

httpx = pytest.importorskip("httpx")
pytest.importorskip("hypercorn")
datasets = pytest.importorskip("sklearn.datasets")

P99_BOUND_S = 0.5  # generous: measured p99 is a few ms to a few tens of ms on 2 cores


def _load_example():
    name = "serve_and_train"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[2] / "examples" / "serve_and_train.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


example = _load_example()


def _asyncgrad_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("asyncgrad-")}


@pytest.fixture(scope="module")
def digits():
    X, y = datasets.load_digits(return_X_y=True)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    X, y = X[order].astype(np.float32), y[order]
    return (X[:1400], y[:1400]), (X[1400:], y[1400:])


@asynccontextmanager
async def running_service(**options):
    """Serve on an ephemeral loopback port; on exit, stop it and check no asyncgrad thread is left."""
    before = _asyncgrad_threads()
    async with trio.open_nursery() as nursery:
        running = await nursery.start(partial(example.serve, 0, host="127.0.0.1", quiet=True, **options))
        assert running.url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(base_url=running.url, timeout=30, trust_env=False) as client:
            yield running, client
        nursery.cancel_scope.cancel()
    assert _asyncgrad_threads() == before, "the service left asyncgrad threads behind"


async def _accuracy(client, X, y):
    r = await client.post("/predict", json={"inputs": X.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    return float(np.mean(np.asarray(body["classes"]) == y)), body["model_version"]


async def _wait_for_steps(client, steps, timeout=30):
    with trio.fail_after(timeout):
        while True:
            stats = (await client.get("/stats")).json()
            if stats["steps"] >= steps:
                return stats
            await trio.sleep(0.05)


async def test_train_raises_held_out_accuracy(digits):
    (Xtr, ytr), (Xte, yte) = digits
    async with running_service(idle_steps=600) as (_, client):
        acc_before, v0 = await _accuracy(client, Xte, yte)
        assert v0 == 0
        r = await client.post("/train", json={"inputs": Xtr.tolist(), "labels": ytr.tolist()})
        assert r.status_code == 200 and r.json()["accepted"] == len(ytr)
        stats = await _wait_for_steps(client, 600)
        # the trainer publishes a final snapshot when it goes idle
        with trio.fail_after(10):
            while not (stats := (await client.get("/stats")).json())["model_steps"] >= 600:
                await trio.sleep(0.05)
        acc_after, v1 = await _accuracy(client, Xte, yte)
    print(
        f"held-out accuracy {acc_before:.3f} -> {acc_after:.3f} (model v{v0} -> v{v1}, "
        f"{stats['steps']} steps, loss {stats['loss']})"
    )
    assert acc_before < 0.3
    assert acc_after > 0.85
    assert v1 > v0
    assert stats["loss"] < 0.5


async def test_predicts_keep_answering_while_training(digits):
    (Xtr, ytr), (Xte, _) = digits
    batch = Xte[:16]
    async with running_service(idle_steps=10**9, publish_every=5) as (running, client):
        service = running.service
        # record every published snapshot, to check each answer against exactly one of them
        published = {0: service.snapshot}
        real_publish = service.publish

        async def recording_publish(params):
            snap = await real_publish(params)
            published[snap.version] = snap
            return snap

        service.publish = recording_publish
        r = await client.post("/train", json={"inputs": Xtr.tolist(), "labels": ytr.tolist()})
        assert r.status_code == 200
        await _wait_for_steps(client, 5)
        steps_before = service.steps

        latencies: list[float] = []
        answers: list[tuple[int, list[int]]] = []
        deadline = trio.current_time() + 2.0

        async def predictor():
            last_version = -1
            while trio.current_time() < deadline:
                t0 = time.perf_counter()
                r = await client.post("/predict", json={"inputs": batch.tolist()})
                latencies.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["model_version"] >= last_version, "a client saw the model go back in time"
                last_version = body["model_version"]
                answers.append((body["model_version"], body["classes"]))

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(predictor)
        steps_during = service.steps - steps_before
        stats = (await client.get("/stats")).json()

    lat = np.asarray(latencies)
    p50, p99 = np.percentile(lat, [50, 99])
    versions = sorted({v for v, _ in answers})
    print(
        f"{len(lat)} predicts by 8 concurrent clients in 2 s while training ran {steps_during} steps: "
        f"p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {lat.max() * 1e3:.1f} ms; "
        f"{len(versions)} model versions served; server-side {stats['latency_ms']['predict']}"
    )
    assert len(lat) >= 40
    assert steps_during >= 20, "training did not run while predicts were served"
    assert len(versions) >= 2, "predicts never saw a new model while training"
    assert p99 < P99_BOUND_S, f"predict p99 {p99 * 1e3:.0f} ms over {P99_BOUND_S * 1e3:.0f} ms"
    # atomic swaps: every answer equals the numpy forward of the one snapshot it names
    for version, classes in answers:
        p = published[version].params
        h = np.maximum(batch / 16.0 @ p["W1"] + p["b1"], 0)
        logits = h @ p["W2"] + p["b2"]
        chosen = logits[np.arange(len(classes)), classes]
        # equal to the argmax, up to float32 rounding on near-ties
        assert np.all(chosen >= logits.max(axis=1) - 1e-4), f"answer inconsistent with model v{version}"
    assert stats["requests"]["predict"] == len(lat)
    assert stats["latency_ms"]["predict"]["p99"] is not None


async def test_snapshots_are_immutable_and_bad_requests_are_rejected():
    async with running_service() as (running, client):
        snap = running.service.snapshot
        with pytest.raises(ValueError):
            snap.params["W1"][0, 0] = 1.0
        with pytest.raises(TypeError):
            snap.params["W1"] = None
        r = await client.post("/predict", json={"inputs": [[1.0, 2.0]]})
        assert r.status_code == 400 and "shape" in r.json()["error"]
        r = await client.post("/train", json={"inputs": [[0.0] * 64], "labels": [12]})
        assert r.status_code == 400
        r = await client.post("/predict", content=b"{not json")
        assert r.status_code == 400
        r = await client.get("/predict")
        assert r.status_code == 405
        r = await client.get("/nope")
        assert r.status_code == 404
        r = await client.post("/predict", json={"inputs": []})
        assert r.status_code == 200 and r.json()["classes"] == []
        stats = (await client.get("/stats")).json()
        assert stats["steps"] == 0 and stats["training"] is False and stats["examples"] == 0


def _census(objs, skip=frozenset()) -> dict[str, int]:
    """Counts of the objects of asyncgrad, of this example, and numpy arrays, by type (ids in ``skip`` left out)."""
    counts: dict[str, int] = {}
    for o in objs:
        if id(o) in skip:
            continue
        t = type(o)
        mod = t.__dict__.get("__module__", "")
        if (isinstance(mod, str) and mod.startswith(("asyncgrad", "serve_and_train"))) or t is np.ndarray:
            key = f"{mod}.{t.__qualname__}"
            counts[key] = counts.get(key, 0) + 1
    return counts


async def test_training_and_predicts_make_no_garbage_cycles_and_no_growing_objects(digits):
    """The soak's service RSS must not creep because of the model: a training step and a predict free
    everything they make by reference counting (no cycle left for the collector: a cycle per step would
    make the heap follow the collector's schedule), and the live objects do not grow with the steps."""
    import gc

    import asyncgrad as ag

    (Xtr, ytr), (Xte, _) = digits
    batches = [Xte[i : i + 8] for i in range(0, 256, 8)]

    async def run_steps(service, nursery, steps):
        target = service.steps + steps
        with trio.fail_after(60):
            while service.steps < target:
                for x in batches:
                    classes, _ = await service.predict(x)
                    assert len(classes) == len(x)
                await trio.sleep(0)

    async with ag.open_runtime():
        service = example.Service(idle_steps=10**9, publish_every=5)
        service.add_examples(Xtr, ytr)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.train_forever)
            await run_steps(service, nursery, 100)  # warm-up: caches, snapshots, deques fill
            gc.collect()
            alive = gc.get_objects()
            before = _census(alive)
            # objects alive now (say, the devices of an earlier test's closed runtime that the collector
            # has not reached yet) are not this window's garbage
            old_ids = frozenset(map(id, alive))
            del alive
            was_enabled = gc.isenabled()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)  # whatever the collector would free is kept for a look
            try:
                await run_steps(service, nursery, 300)
                gc.collect()
                garbage = list(gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                if was_enabled:
                    gc.enable()
            after = _census(gc.get_objects())
            nursery.cancel_scope.cancel()
    cycles = _census(garbage, old_ids)
    del garbage
    assert cycles == {}, f"a training step or a predict left reference cycles: {cycles}"
    grown = {k: (before.get(k, 0), v) for k, v in after.items() if v > before.get(k, 0) + 8}
    assert grown == {}, f"live objects grew over 300 steps (before, after): {grown}"


async def test_a_connection_the_client_closed_is_closed_by_the_server_at_once():
    """hypercorn 0.18 kept such connections until its 5 s keep-alive timer ended (the service's RSS then grew
    with each peak of lingering connections under clients that open new ones): the example stops that timer.
    32 concurrent requesters over one httpx pool (it keeps 20 connections alive and closes the rest)."""
    import os

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async with running_service() as (running, _):
        base = open_fds()
        with trio.fail_after(30):
            async with httpx.AsyncClient(base_url=running.url, timeout=30, trust_env=False) as client:
                end = time.perf_counter() + 1.0

                async def requester() -> None:
                    while time.perf_counter() < end:
                        assert (await client.get("/stats")).status_code == 200

                async with trio.open_nursery() as n:
                    for _ in range(32):
                        n.start_soon(requester)
            # every client connection is closed now; the server's ends close well inside the keep-alive time
            with trio.fail_after(2):
                while open_fds() > base + 2:
                    await trio.sleep(0.02)
