"""The NATS yardstick of the wire benchmarks: a process that answers every request on one subject at once,
with its body, and does nothing else. Timed from a benchmark's client beside a service's subject, it shows
what the bus and two Python clients cost on the same machine at the same moment: a service can be no faster.

    python -m tests.bench.echo NATS_URL SUBJECT [--seed NKEY_SEED_FILE]

Runs until SIGTERM or SIGINT; prints ``ready`` once it is subscribed.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import nats
from nats.aio.msg import Msg


async def serve(url: str, subject: str, seed: str | None) -> None:
    nc = await nats.connect(url, name="bench-echo", **({"nkeys_seed": seed} if seed else {}))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def answer(msg: Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(subject, cb=answer)
    await nc.flush()
    print("ready", flush=True)
    await stop.wait()
    await nc.drain()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("subject")
    parser.add_argument("--seed", default=None, help="NKey seed file to connect with")
    args = parser.parse_args()
    asyncio.run(serve(args.url, args.subject, args.seed))
