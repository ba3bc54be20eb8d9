"""Serve a model over HTTP while it trains online, in one trio process (hypercorn on trio + asyncgrad).

    python3 examples/serve_and_train.py --port 8000

Endpoints (JSON in, JSON out):

- ``POST /predict``  ``{"inputs": [[64 floats], ...]}`` -> ``{"classes": [...], "model_version": n}``.
  Inputs are 8x8 digit images flattened, pixel values 0..16 as in `sklearn.datasets.load_digits`.
- ``POST /train``    ``{"inputs": [[64 floats], ...], "labels": [ints 0..9]}`` -> ``{"accepted": k, ...}``.
  The examples join a replay buffer that a background training task learns from continuously (it pauses
  after ``idle_steps`` steps without new data, and resumes when some arrive).
- ``GET /stats``     training steps, recent loss, model version, request counts and latency percentiles.

How it fits together:

- One trio run: `asyncgrad.open_runtime()` is open, and inside it a nursery runs hypercorn's trio
  server and the training task side by side. Every request handler is a trio task in that runtime.
- Atomic model swaps. The trainer owns a private set of weights (tensors with ``requires_grad``) and
  updates them in place. Every ``publish_every`` steps it waits for the weights' values, copies them into
  new read-only numpy arrays and publishes a new immutable `Snapshot` (weights + version) with one
  reference assignment. ``/predict`` reads ``service.snapshot`` once and computes only from that object,
  so it never sees half-updated weights, and the trainer never waits for readers.
- The loop never blocks: forward and backward kernels go to the runtime's device (worker lanes; kernels
  this small may run inline when their stream is idle), and the handlers ``await out.ready()`` before
  reading a value instead of calling a blocking ``.numpy()`` on a pending tensor.

`serve(port, task_status=...)` is the entry point for tests: started with ``await nursery.start(serve, 0)``
it binds an ephemeral loopback port and reports a `Running` (url, service); cancel the nursery to stop it
(the runtime closes and joins its worker threads).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import time
import types
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import numpy as np
import trio

import asyncgrad as ag

N_FEATURES = 64
N_CLASSES = 10
MAX_BODY_BYTES = 16 * 1024 * 1024


# ---- the model: a two-layer MLP written with plain asyncgrad ops -------------------------------------


def init_params(hidden: int, seed: int = 0) -> dict[str, np.ndarray]:
    """He-initialised weights of a 64 -> hidden -> 10 MLP (float32)."""
    rng = np.random.default_rng(seed)
    return {
        "W1": (rng.standard_normal((N_FEATURES, hidden)) * math.sqrt(2.0 / N_FEATURES)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "W2": (rng.standard_normal((hidden, N_CLASSES)) * math.sqrt(2.0 / hidden)).astype(np.float32),
        "b2": np.zeros(N_CLASSES, np.float32),
    }


def forward(p: Mapping[str, Any], x: Any) -> Any:
    """Logits of the MLP; ``x`` holds raw pixels 0..16 (scaled here)."""
    h = ag.relu((x * (1.0 / 16.0)) @ p["W1"] + p["b1"])
    return h @ p["W2"] + p["b2"]


@attrs.frozen
class Snapshot:
    """An immutable published model: read-only weight arrays and a version number."""

    version: int
    params: Mapping[str, np.ndarray]
    steps: int


def _freeze(params: Mapping[str, np.ndarray], version: int, steps: int) -> Snapshot:
    frozen = {}
    for k, v in params.items():
        a = np.array(v, dtype=np.float32, copy=True)
        a.setflags(write=False)
        frozen[k] = a
    return Snapshot(version=version, params=types.MappingProxyType(frozen), steps=steps)


# ---- the service: snapshot, replay buffer, trainer, statistics --------------------------------------


class BadRequest(ValueError):
    """A request the client got wrong (answered with 400)."""


def _percentiles(samples: Any) -> dict[str, float | int | None]:
    if not samples:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.fromiter(samples, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "n": int(a.size),
        "p50": round(float(p50), 3),
        "p90": round(float(p90), 3),
        "p99": round(float(p99), 3),
        "max": round(float(a.max()), 3),
    }


class Service:
    """The model being served and trained: the current snapshot, the replay buffer and the counters."""

    def __init__(
        self,
        *,
        hidden: int = 64,
        lr: float = 0.2,
        batch_size: int = 64,
        publish_every: int = 10,
        idle_steps: int = 2000,
        max_examples: int = 50_000,
        seed: int = 0,
    ) -> None:
        self.hidden = hidden
        self.lr = lr
        self.batch_size = batch_size
        self.publish_every = publish_every
        self.idle_steps = idle_steps
        self.max_examples = max_examples
        self._rng = np.random.default_rng(seed)
        # the published model: replaced, never mutated (one reference assignment per publish)
        self.snapshot: Snapshot = _freeze(init_params(hidden, seed), version=0, steps=0)
        self._x = np.empty((0, N_FEATURES), np.float32)
        self._y = np.empty((0,), np.int64)
        self._new_data = trio.Event()
        self.steps = 0
        self.training = False
        self.losses: collections.deque[float] = collections.deque(maxlen=50)
        self.latency: dict[str, collections.deque[float]] = {
            "predict": collections.deque(maxlen=5000),
            "train": collections.deque(maxlen=5000),
        }
        self.requests: collections.Counter[str] = collections.Counter()

    # -- requests --

    async def predict(self, inputs: np.ndarray) -> tuple[list[int], int]:
        """Classes for ``inputs`` from the current snapshot, and that snapshot's version."""
        snap = self.snapshot  # read once: everything below uses this one immutable model
        if inputs.shape[0] == 0:
            return [], snap.version
        with ag.no_grad():
            p = {k: ag.from_numpy(v) for k, v in snap.params.items()}
            logits = forward(p, ag.from_numpy(inputs))
            await logits.ready()  # wait on the stream without blocking the loop
        # the value is ready: reading it no longer blocks; a [n, 10] argmax is trivial work
        return logits.numpy().argmax(axis=1).tolist(), snap.version

    def add_examples(self, inputs: np.ndarray, labels: np.ndarray) -> int:
        """Add labelled examples to the replay buffer (oldest dropped past ``max_examples``)."""
        self._x = np.concatenate([self._x, inputs])[-self.max_examples :]
        self._y = np.concatenate([self._y, labels])[-self.max_examples :]
        self._new_data.set()
        return len(self._y)

    # -- training --

    async def train_forever(self) -> None:
        """The background trainer: SGD on minibatches from the replay buffer; publishes snapshots."""
        params = {k: ag.tensor(v, requires_grad=True) for k, v in self.snapshot.params.items()}  # private
        eye = np.eye(N_CLASSES, dtype=np.float32)
        idle = 0
        while True:
            if len(self._y) == 0 or idle >= self.idle_steps:
                self.training = False
                await self._new_data.wait()
                self._new_data = trio.Event()
                idle = 0
            if self._new_data.is_set():  # more data arrived while training: keep going
                self._new_data = trio.Event()
                idle = 0
            self.training = True
            n = len(self._y)
            idx = self._rng.integers(0, n, size=min(self.batch_size, n))
            x = ag.from_numpy(self._x[idx])
            target = ag.from_numpy(eye[self._y[idx]])
            loss = -(ag.log_softmax(forward(params, x), dim=-1) * target).sum() * (1.0 / len(idx))
            await loss.backward()
            with ag.no_grad():
                for w in params.values():
                    w -= self.lr * w.grad
                    w.grad = None
            await loss.ready()
            # Yield to the request handlers once per step. Kernels this small run inline and complete
            # at once, and then the awaits above return without a trio checkpoint, so without this the
            # trainer would hold the loop (and ignore cancellation) for as long as it has data.
            await trio.lowlevel.checkpoint()
            self.losses.append((await loss.ready()).item())  # the async form: never blocks the loop
            self.steps += 1
            idle += 1
            if self.steps % self.publish_every == 0 or idle >= self.idle_steps:
                await self.publish(params)

    async def publish(self, params: Mapping[str, Any]) -> Snapshot:
        """Copy the trainer's weights into a new immutable snapshot and swap it in atomically."""
        for w in params.values():
            await w.ready()
        snap = _freeze(
            {k: w.numpy() for k, w in params.items()}, version=self.snapshot.version + 1, steps=self.steps
        )
        self.snapshot = snap  # the atomic swap: readers hold either the old snapshot or this one
        return snap

    # -- stats --

    def stats(self) -> dict[str, Any]:
        snap = self.snapshot
        return {
            "steps": self.steps,
            "training": self.training,
            "model_version": snap.version,
            "model_steps": snap.steps,
            "examples": len(self._y),
            "loss": round(float(np.mean(self.losses)), 6) if self.losses else None,
            "last_loss": round(self.losses[-1], 6) if self.losses else None,
            "requests": dict(self.requests),
            "latency_ms": {k: _percentiles(v) for k, v in self.latency.items()},
        }


# ---- the ASGI app (raw ASGI: no framework needed for three routes) ----------------------------------


def _as_inputs(obj: Any) -> np.ndarray:
    try:
        x = np.asarray(obj, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise BadRequest(f"'inputs' must be a list of lists of {N_FEATURES} numbers") from e
    if x.size == 0:
        return np.empty((0, N_FEATURES), np.float32)
    if x.ndim != 2 or x.shape[1] != N_FEATURES:
        raise BadRequest(f"'inputs' must have shape [n, {N_FEATURES}], got {list(x.shape)}")
    if not np.isfinite(x).all():
        raise BadRequest("'inputs' must be finite numbers")
    return x


def _as_labels(obj: Any, n: int) -> np.ndarray:
    try:
        y = np.asarray(obj)
    except (TypeError, ValueError) as e:
        raise BadRequest("'labels' must be a list of integers") from e
    if y.shape != (n,) or (n and y.dtype.kind not in "iu"):
        raise BadRequest(f"'labels' must be a list of {n} integers (one per input)")
    y = y.astype(np.int64)
    if n and (y.min() < 0 or y.max() >= N_CLASSES):
        raise BadRequest(f"'labels' must be class indices in 0..{N_CLASSES - 1}")
    return y


class App:
    """A raw ASGI application over a `Service`."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.routes: dict[tuple[str, str], Callable[[Any], Awaitable[Any]]] = {
            ("POST", "/predict"): self._predict,
            ("POST", "/train"): self._train,
            ("GET", "/stats"): self._stats,
        }

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        t0 = time.perf_counter()
        path, method = scope["path"], scope["method"]
        handler = self.routes.get((method, path))
        if handler is None:
            allowed = any(p == path for _, p in self.routes)
            why = "method not allowed" if allowed else "not found"
            await _respond(send, 405 if allowed else 404, {"error": f"{method} {path}: {why}"})
            return
        try:
            body = await _read_body(receive)
            payload = json.loads(body) if body else {}
            if not isinstance(payload, dict):
                raise BadRequest("the request body must be a JSON object")
            status, result = 200, await handler(payload)
        except (BadRequest, json.JSONDecodeError, UnicodeDecodeError) as e:
            status, result = 400, {"error": str(e)}
        except _ClientGone:
            return
        await _respond(send, status, result)
        name = path.strip("/")
        self.service.requests[name] += 1
        if name in self.service.latency:
            self.service.latency[name].append(time.perf_counter() - t0)

    async def _predict(self, payload: dict[str, Any]) -> Any:
        if "inputs" not in payload:
            raise BadRequest("missing 'inputs'")
        classes, version = await self.service.predict(_as_inputs(payload["inputs"]))
        return {"classes": classes, "model_version": version}

    async def _train(self, payload: dict[str, Any]) -> Any:
        if "inputs" not in payload or "labels" not in payload:
            raise BadRequest("missing 'inputs' or 'labels'")
        x = _as_inputs(payload["inputs"])
        y = _as_labels(payload["labels"], len(x))
        total = self.service.add_examples(x, y)
        return {"accepted": len(y), "examples": total, "steps": self.service.steps}

    async def _stats(self, payload: dict[str, Any]) -> Any:
        return self.service.stats()


class _ClientGone(Exception):
    """The client disconnected before sending its whole request."""


async def _read_body(receive: Any) -> bytes:
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def _respond(send: Any, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


# ---- serving ---------------------------------------------------------------------------------------


@attrs.frozen
class Running:
    """What `serve` reports once it listens: the base URL and the service (for tests and tools)."""

    url: str
    service: Service


def _close_connections_at_eof() -> None:
    """hypercorn 0.18's trio worker keeps a connection the client closed open until its keep-alive timer
    ends (5 s by default): the read loop returns at EOF but the idle timer is left running in the
    connection's task group. A service whose clients open connections all the time (httpx's pool keeps 20)
    then holds hundreds of closed sockets and their objects at once, and its RSS climbs with each new peak
    (measured with `benchmarks/soak.py service`). Stop that timer when the read loop ends."""
    import hypercorn.trio.run as hrun
    from hypercorn.trio.tcp_server import TCPServer

    if getattr(hrun.TCPServer, "closes_at_eof", False):
        return

    class _TCPServer(TCPServer):
        closes_at_eof = True

        async def _read_data(self) -> None:
            await super()._read_data()
            await self.idle_task.stop()

    hrun.TCPServer = _TCPServer  # type: ignore[misc]


async def serve(
    port: int = 8000,
    *,
    host: str = "127.0.0.1",
    task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED,
    runtime_options: Mapping[str, Any] | None = None,
    quiet: bool = False,
    **service_options: Any,
) -> None:
    """Open a runtime, start the trainer and hypercorn on ``host:port`` (0: ephemeral); run until cancelled.

    ``task_status.started`` gets a `Running` once the socket listens. Keyword arguments go to `Service`.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    _close_connections_at_eof()
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    if quiet:
        config.errorlog = None
    async with ag.open_runtime(**dict(runtime_options or {})):
        service = Service(**service_options)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.train_forever, name="serve_and_train.trainer")
            binds = await nursery.start(hypercorn_serve, App(service), config)
            task_status.started(Running(url=binds[0], service=service))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--idle-steps", type=int, default=2000)
    args = ap.parse_args()
    try:
        trio.run(
            lambda: serve(
                args.port, host=args.host, hidden=args.hidden, lr=args.lr, idle_steps=args.idle_steps
            )
        )
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
