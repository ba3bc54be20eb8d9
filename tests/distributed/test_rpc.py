"""Worker processes and calls: round trips, the wire format, errors, security, clean shutdown."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import trio
import trio.testing

import asyncgrad as ag
from asyncgrad import distributed as dist
from asyncgrad.distributed import _connection

from . import _fns
from .conftest import TIMEOUT, children, fds, threads


async def test_calls_round_trip_plain_values(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(2) as workers:
            assert len(workers) == 2 and [w.name for w in workers] == ["worker0", "worker1"]
            w = workers[1]
            assert await w.call(_fns.add, 1, b=2) == 3
            assert await w.call(_fns.async_add, "a", "b") == "ab"  # an async function: a task there
            assert await w.call(f"{_fns.__name__}:add", 5) == 5
            values = (
                None, True, False, 0, -7, 2**70, -(2**65), 1.5, float("inf"), 2 + 3j, "text ü", b"\x00bytes",
                [1, [2, (3, 4)]], (1,), (), {"k": [1, 2], 3: "int key", (1, 2): "tuple key"},
                np.float32(1.25), np.int16(-3), np.bool_(True), np.dtype("float16"), ag.float64,
            )
            args, kwargs = await w.call(_fns.echo, *values, key=values)
            assert args == values and kwargs == {"key": values}
            assert [type(a) for a in args] == [type(v) for v in values]  # tuples stay tuples, numpy scalars typed
            pids = {await w.call(_fns.pid) for w in workers}
            assert len(pids) == 2 and os.getpid() not in pids
            assert {w.pid for w in workers} == pids


async def test_call_nowait_returns_a_future(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            fut = workers[0].call_nowait(_fns.sleep, 0.05, "late")
            assert isinstance(fut, dist.Future) and not fut.done()
            with pytest.raises(RuntimeError, match="not done"):
                fut.value()
            assert await fut == "late"
            assert fut.done() and fut.value() == "late" and fut.exception() is None
            assert await fut.wait() == "late"  # awaiting again gives the same value
            bad = workers[0].call_nowait(_fns.raise_value_error, "nope")
            with pytest.raises(ValueError, match="nope"):
                await bad
            assert isinstance(bad.exception(), ValueError)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: np.arange(24.0).reshape(2, 3, 4), id="C"),
        pytest.param(lambda: np.asfortranarray(np.arange(24.0).reshape(2, 3, 4)), id="Fortran"),
        pytest.param(lambda: np.arange(120.0).reshape(2, 3, 4, 5).transpose(0, 2, 3, 1), id="channels-last"),
        pytest.param(lambda: np.arange(24.0).reshape(4, 6)[:, ::2], id="strided-view"),
        pytest.param(lambda: np.broadcast_to(np.arange(4.0), (3, 4)), id="broadcast"),
        pytest.param(lambda: np.arange(24.0).reshape(4, 6)[::-1], id="negative-strides"),
        pytest.param(lambda: np.array(3.0), id="0-d"),
        pytest.param(lambda: np.ones((0, 3)), id="empty"),
    ],
)
async def test_tensor_layouts_arrive_as_sent(rt, make) -> None:
    src = make()
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            w = workers[0]
            t = ag.from_numpy(src)
            got = await w.call(_fns.identity, t)
            assert isinstance(got, ag.Tensor)
            a = got.numpy()
            np.testing.assert_array_equal(a, src)
            dense = src.size == 0 or ag.is_dense_nonoverlapping(src)
            expected = src.strides if dense else np.ascontiguousarray(src).strides
            assert a.strides == expected
            assert a.flags.writeable and not np.shares_memory(a, src)
            # the worker saw the same layout
            kind, dtype, shape, strides, _, writeable = await w.call(_fns.describe, t)
            assert (kind, dtype, tuple(shape), tuple(strides)) == ("tensor", "float64", src.shape, expected)
            assert writeable
            arr = await w.call(_fns.identity, src)  # a numpy array stays a numpy array
            assert type(arr) is np.ndarray and arr.strides == expected
            np.testing.assert_array_equal(arr, src)


async def test_dtypes_requires_grad_and_identity_are_preserved(rt) -> None:
    dtypes = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "bool",
              "complex64", "complex128", ">f8"]
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            w = workers[0]
            ts = [ag.from_numpy((np.arange(12) % 3).astype(d).reshape(3, 4)) for d in dtypes]
            back = await w.call(_fns.identity, ts)
            for t, b in zip(ts, back):
                assert b.dtype == t.dtype
                np.testing.assert_array_equal(b.numpy(), t.numpy())
            x = ag.randn(5, requires_grad=True)
            *_, rg, _ = await w.call(_fns.describe, x)
            assert rg is True
            y = await w.call(_fns.identity, x.detach())
            assert not y.requires_grad
            # one tensor passed twice arrives as one tensor (sent once)
            pair = await w.call(_fns.identity, [y, y])
            assert pair[0] is pair[1]
            big = ag.randn(512, 1024)  # 2 MiB: received straight into its buffer
            np.testing.assert_array_equal((await w.call(_fns.double, big)).numpy(), big.numpy() * 2)


async def test_errors_come_back_as_one_exception(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            w = workers[0]
            with pytest.raises(ValueError, match="bad input") as ei:
                await w.call(_fns.raise_value_error, "bad input")
            assert type(ei.value) is ValueError
            note = "\n".join(ei.value.__notes__)
            assert "remote traceback (worker0)" in note and "raise_value_error" in note
            with pytest.raises(KeyError) as ki:
                await w.call(_fns.raise_key_error)
            assert ki.value.args == ("missing",)
            with pytest.raises(dist.RemoteError) as ri:
                await w.call(_fns.raise_custom)
            err = ri.value
            assert err.type_name == f"{_fns.__name__}.CustomError"
            assert "a custom failure" in str(err) and "raise_custom" in err.remote_traceback
            # a group of one exception (a nursery in the remote function) comes back as that exception
            with pytest.raises(ZeroDivisionError, match="in a child task"):
                await w.call(_fns.raise_in_nursery)
            # a remote SystemExit does not end the caller
            with pytest.raises(dist.RemoteError, match="SystemExit"):
                await w.call(_fns.raise_system_exit)
            # an unknown function is an error of the call, the worker keeps serving
            with pytest.raises(AttributeError):
                await w.call(f"{_fns.__name__}:no_such_function")
            with pytest.raises(ModuleNotFoundError):
                await w.call("no_such_module_here:fn")
            assert await w.call(_fns.add, 2, 2) == 4


async def test_values_the_wire_cannot_carry_are_a_clear_type_error(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            w = workers[0]
            with pytest.raises(TypeError, match=r"'set' at args\[1\]\['k'\]\[0\]"):
                await w.call(_fns.echo, 1, {"k": [{1, 2}]})
            with pytest.raises(TypeError, match=r"at kwargs\['opt'\]"):
                await w.call(_fns.echo, opt=object())
            with pytest.raises(TypeError, match="module level"):
                await w.call(lambda: 1)

            def local() -> None:
                pass

            with pytest.raises(TypeError, match="module level"):
                w.call_nowait(local)
            with pytest.raises(TypeError, match=r"'set' at the result\[1\]"):
                await w.call(_fns.return_a_set)
            with pytest.raises(TypeError, match="object"):
                await w.call(_fns.identity, np.array([object()]))
            assert await w.call(_fns.add, 1, 1) == 2


async def test_workers_start_with_the_parents_default_dtype_and_grad_mode(rt) -> None:
    before = ag.get_default_dtype()
    ag.set_default_dtype(ag.float64)
    try:
        with trio.fail_after(TIMEOUT), ag.no_grad():
            async with dist.open_workers(1) as workers:
                env = await workers[0].call(_fns.environment)
    finally:
        ag.set_default_dtype(before)
    assert env["dtype"] == "float64" and env["grad"] is False and env["default_float"] == "<f8"
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            env = await workers[0].call(_fns.environment)
    assert env["dtype"] == "float32" and env["grad"] is True


async def test_1000_concurrent_calls_from_50_tasks(rt) -> None:
    results: dict[tuple[int, int], object] = {}
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(2) as workers:

            async def caller(k: int) -> None:
                for i in range(20):
                    w = workers[(k + i) % 2]
                    x = ag.full((4,), float(k * 100 + i))
                    if i % 2:
                        results[k, i] = await w.call(_fns.double, x)
                    else:
                        results[k, i] = await w.call_nowait(_fns.async_add, x, 1.0)

            async with trio.open_nursery() as n:
                for k in range(50):
                    n.start_soon(caller, k)
    assert len(results) == 1000
    for (k, i), v in results.items():
        want = (k * 100 + i) * 2 if i % 2 else k * 100 + i + 1
        np.testing.assert_array_equal(v.numpy(), np.full(4, want, np.float32))


async def test_a_wrong_secret_is_refused_and_logged(rt, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="asyncgrad.distributed")
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            for address in (workers.address, workers[0].address):
                sock = await _connection.connect(address)
                conn = _connection.Connection(sock, address, max_meta_bytes=1 << 20, max_frame_bytes=1 << 20)
                with pytest.raises(dist.AuthenticationError, match="wrong secret"):
                    await _connection.client_handshake(conn, b"not-the-secret")
                conn.close()
            assert any("refused a connection" in r.getMessage() for r in caplog.records)  # the parent's log
            assert dist.statistics().connections_refused >= 1
            with trio.fail_after(10):
                while (await workers[0].call(_fns.stats))[1] < 1:  # the worker's count
                    await trio.sleep(0.01)
            assert await workers[0].call(_fns.add, 1, 2) == 3  # still serving


def test_a_worker_with_a_wrong_token_exits(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("wrong-token\n")

    async def run() -> tuple[int, str]:
        async with ag.open_runtime(lanes=1):
            listener = _connection.Listener()
            address = listener.address
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "asyncgrad.distributed.worker", "--connect", address,
                 "--token-file", str(token)],
                stderr=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(ag.__file__))},
            )
            from asyncgrad.distributed import _peer

            node = _peer.Node("test-parent")
            limits = {"max_meta_bytes": 1 << 20, "max_frame_bytes": 1 << 20, "max_inflight_bytes": 1 << 20}
            with trio.fail_after(TIMEOUT):
                async with trio.open_nursery() as n:
                    n.start_soon(lambda: _peer.serve_connections(listener, b"the-real-secret", node, limits=limits))
                    code = await proc.wait()
                    err = (await proc.stderr.receive_some(100000)).decode() if proc.stderr else ""
                    n.cancel_scope.cancel()
            listener.close()
            assert node.connections_refused == 1
            return code, err

    code, err = trio.run(run)
    assert code != 0 and "wrong secret" in err


async def test_shutdown_leaves_no_process_thread_or_fd(rt) -> None:
    kids, before, files = children(), threads(), fds()
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(2) as workers:
            pids = {w.pid for w in workers}
            assert pids <= children()
            await workers[0].call(_fns.double, ag.randn(300, 300))
            workers[1].call_nowait(_fns.sleep, 30)  # still running when the block ends
    assert children() == kids
    assert threads() <= before
    assert fds() <= files  # none new (a segment kept for reuse by an earlier test may be gone)
    # also when the block fails, and when it is cancelled
    with pytest.raises(ZeroDivisionError):
        with trio.fail_after(TIMEOUT):
            async with dist.open_workers(1) as workers:
                workers[0].call_nowait(_fns.sleep, 30)
                1 / 0  # noqa: B018
    assert children() == kids and fds() <= files and threads() <= before
    with trio.CancelScope() as cs:
        async with dist.open_workers(1) as workers:
            cs.deadline = trio.current_time() + 0.5  # cancelled while the call runs, once the worker is up
            await workers[0].call(_fns.sleep, 30)
    assert cs.cancelled_caught
    assert children() == kids and fds() <= files and threads() <= before


async def test_a_cancelled_exit_watcher_does_not_keep_the_other_waiters_waiting() -> None:
    """Two tasks wait for one worker process's exit; the one watching its pidfd is cancelled (as the
    workers' monitor is when the block around them is). The other must see the exit when it happens: it
    used to wait for word from the cancelled watcher, which never came, until the 10 s kill timeout."""
    from asyncgrad.distributed._workers import _Process

    script = "import sys, time; sys.stdin.readline(); time.sleep(0.3)"
    proc = _Process([sys.executable, "-c", script], dict(os.environ), b"secret")
    try:
        with trio.fail_after(5):  # (the bug: a hang here)
            async with trio.open_nursery() as n:
                watcher = trio.CancelScope()

                async def watch() -> None:
                    with watcher:
                        await proc.wait()

                n.start_soon(watch)
                await trio.testing.wait_all_tasks_blocked()  # the watcher is on the pidfd
                got: list[int] = []

                async def wait_too() -> None:
                    got.append(await proc.wait())

                n.start_soon(wait_too)
                await trio.testing.wait_all_tasks_blocked()
                watcher.cancel()
            assert got == [0] and proc.ended and watcher.cancelled_caught
    finally:
        proc.kill()
        proc.close()


async def test_a_worker_from_another_host_joins_with_a_token_file(rt, tmp_path) -> None:
    token = tmp_path / "cluster.token"
    port = free_port()
    # a worker elsewhere imports the functions from its own copy of the code: here, the same checkout
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(ag.__file__)), tests_dir])}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as n:

            async def remote_worker() -> None:
                while not token.exists():
                    await trio.sleep(0.01)
                await trio.run_process(
                    [sys.executable, "-m", "asyncgrad.distributed.worker", "--connect", f"127.0.0.1:{port}",
                     "--token-file", str(token), "--name", "far-away"],
                    env=env,
                )

            n.start_soon(remote_worker)
            async with dist.open_workers(1, remote=1, port=port, token_file=token) as workers:
                assert sorted(w.name for w in workers) == ["far-away", "worker0"]
                far = workers.by_name("far-away")
                assert far.process is None and await far.call(_fns.add, 40, 2) == 42
                np.testing.assert_array_equal((await far.call(_fns.double, ag.ones(3))).numpy(), [2, 2, 2])
            assert oct(token.stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_large_tensors_keep_their_layout_and_share_nothing(rt, transport) -> None:
    """Over a Unix socket a large buffer is handed over as a shared segment (staged once); over TCP it is
    received straight into its buffer. Either way: the layout arrives, and nothing is shared."""
    from asyncgrad.distributed import _shm

    rng = np.random.default_rng(0)
    c = rng.standard_normal((8, 64, 64, 64)).astype(np.float32)  # 8 MiB
    layouts = {"C": c, "F": np.asfortranarray(c), "channels-last": c.transpose(0, 2, 3, 1)}
    kids, files = children(), fds()
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1, transport=transport) as workers:
            w = workers[0]
            for name, src in layouts.items():
                t = ag.from_numpy(src)
                back = await w.call(_fns.identity, t)
                a = back.numpy()
                assert a.strides == src.strides, name
                np.testing.assert_array_equal(a, src)
                assert not np.shares_memory(a, src)
                a += 1  # ours to write; the worker's copy and the source are untouched
                np.testing.assert_array_equal(src, layouts[name])
                assert await w.call(_fns.describe, t) == ["tensor", "float32", list(src.shape),
                                                          list(src.strides), False, True]
                del back, a
            # computed remotely, sent back while its kernel may still be queued on the call's stream
            y = await w.call(_fns.double, ag.from_numpy(c))
            np.testing.assert_array_equal(y.numpy(), c * 2)
            del y
            if transport == "unix" and _shm.available:
                assert _shm.pool.reused >= 1  # a segment whose tensor died was used again
    assert children() == kids and fds() <= files


async def test_unix_socket_transport(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1, transport="unix") as workers:
            assert workers.address.startswith("unix:") and workers[0].address.startswith("unix:")
            x = ag.randn(64, 64)
            np.testing.assert_array_equal((await workers[0].call(_fns.double, x)).numpy(), x.numpy() * 2)


def free_port() -> int:
    """A TCP port that was free a moment ago (for a fixed-port listener)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


async def test_a_running_call_streams_messages_to_its_caller(rt) -> None:
    from asyncgrad.distributed import _peer

    got: list[tuple[float, dict]] = []
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            peer = workers[0].peer
            out = peer.prepare(_peer.CALL, [f"{_fns.__name__}:stream_steps"], (5,), {}, "stream_steps")
            result = await peer.roundtrip(out, None, on_notify=lambda m: got.append((trio.current_time(), m)))
            done_at = trio.current_time()
    assert result == "finished"
    assert [m["step"] for _, m in got] == [0, 1, 2, 3, 4]  # in order, as they happened
    assert got[0][0] < done_at - 0.02  # the first arrived while the call was still running
    np.testing.assert_array_equal(got[4][1]["value"].numpy(), [4.0, 4.0])
