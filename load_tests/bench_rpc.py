"""RPC throughput: sequential vs pipelined small calls, and a 1 MiB array echo.

Clients on this host reach the server over a Unix socket (``stream_persia/rpc/unix.py``);
the last line compares that with TCP loopback, measured the same way.

Runs the server in a child process (so client and server do not share one event loop)
and the client on plain asyncio and on uvloop, then prints every figure as a ratio to the
baseline measured in the same invocation: sequential small calls on plain asyncio, and
for the array echo, a memcpy of the same bytes. Absolute numbers are printed too but
depend on the machine::

    python load_tests/bench_rpc.py [--seconds 2] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import numpy as np

from stream_persia.core import aio
from stream_persia.rpc import RpcClient

SERVER = r"""
import sys
from stream_persia.core import aio
from stream_persia.rpc import RpcServer

async def echo(p):
    return p

async def main():
    server = RpcServer({"echo": echo}, name="bench", max_in_flight_per_conn=256)
    await server.start()
    print(server.port, flush=True)
    await aio.asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop()

aio.run(main())
"""


async def sequential(client: RpcClient, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(100):
            await client.call("echo", {"ids": [1, 2, 3]})
        n += 100
    return n / (time.perf_counter() - t0)


async def pipelined(client: RpcClient, seconds: float, concurrency: int) -> float:
    n, t0 = 0, time.perf_counter()

    async def worker() -> int:
        done = 0
        while time.perf_counter() - t0 < seconds:
            await client.call("echo", {"ids": [1, 2, 3]})
            done += 1
        return done

    n = sum(await asyncio.gather(*(worker() for _ in range(concurrency))))
    return n / (time.perf_counter() - t0)


async def array_echo(client: RpcClient, seconds: float) -> float:
    arr = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)  # 1 MiB
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        got = await client.call("echo", arr)
        n += 1
    assert np.array_equal(got, arr)
    return n * arr.nbytes / (time.perf_counter() - t0)


def memcpy_rate(seconds: float) -> float:
    src = np.ones(1 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        np.copyto(dst, src)
        n += 1
    return n * src.nbytes / (time.perf_counter() - t0)


def measure(address: str, use_uvloop: bool, seconds: float, concurrency: int) -> dict:
    async def main() -> dict:
        async with RpcClient(address, name="bench") as client:
            await client.wait_ready(10)
            return {"sequential calls/s": await sequential(client, seconds),
                    "pipelined calls/s": await pipelined(client, seconds, concurrency),
                    "1 MiB echo bytes/s": await array_echo(client, seconds)}

    loop = aio.new_event_loop() if use_uvloop else asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--concurrency", type=int, default=64, help="pipelined callers")
    args = parser.parse_args()

    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{int(proc.stdout.readline())}"
        results = {"asyncio": measure(address, False, args.seconds, args.concurrency)}
        if aio.uvloop_available():
            results["uvloop"] = measure(address, True, args.seconds, args.concurrency)
        # The same-host Unix socket (stream_persia/rpc/unix.py) against plain TCP loopback:
        # the client reads the switch when it connects.
        os.environ["STREAM_PERSIA_RPC_UNIX"] = "0"
        try:
            results["tcp only"] = measure(address, aio.uvloop_available(), args.seconds,
                                          args.concurrency)
        finally:
            del os.environ["STREAM_PERSIA_RPC_UNIX"]
        copy = memcpy_rate(args.seconds / 2)
    finally:
        proc.stdin.close()
        proc.wait(30)

    base = results["asyncio"]["sequential calls/s"]
    print(f"server: uvloop={aio.uvloop_available()} (child process); "
          f"baseline = sequential calls on plain asyncio = {base:,.0f}/s; "
          f"memcpy of 1 MiB = {copy / 2**30:.1f} GiB/s")
    for loop_name, r in results.items():
        seq, pipe, echo = (r["sequential calls/s"], r["pipelined calls/s"],
                           r["1 MiB echo bytes/s"])
        print(f"{loop_name:8s} sequential {seq:9,.0f}/s ({seq / base:4.2f}x baseline)  "
              f"pipelined x{args.concurrency} {pipe:9,.0f}/s ({pipe / base:4.2f}x baseline, "
              f"{pipe / seq:4.2f}x sequential)  "
              f"1 MiB echo {echo / 2**20:7.1f} MiB/s ({echo / copy:.3f}x memcpy)")
    fast = results["uvloop" if "uvloop" in results else "asyncio"]["1 MiB echo bytes/s"]
    print(f"1 MiB echo over the same-host Unix socket: {fast / results['tcp only']['1 MiB echo bytes/s']:.2f}x "
          "TCP loopback (STREAM_PERSIA_RPC_UNIX=0)")


if __name__ == "__main__":
    main()
