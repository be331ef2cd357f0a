"""Threads decoding one dataclass type for the first time, all at once, as the SDK's
workflow-task threads do when a worker starts and many workflows' first activations arrive.

    python -m tests.msgspec_first_decode_race plain      # msgspec.json.decode: segfaults
    python -m tests.msgspec_first_decode_race converter  # core.payload_json: decodes them all

msgspec caches a dataclass's field table on the class before it fills it in (its
DataclassInfo_Convert), and filling it in runs Python code for every nested dataclass, where the
interpreter may switch threads. A second thread then finds the half-built table and reads a
NULL field. A tiny switch interval makes that switch land there every time rather than now and
then. Each round makes fresh types, so each round is a first decode.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from typing import Any

import msgspec
from temporalio.api.common.v1 import Payload

from core.crash_traces import enable_crash_traces
from core.payload_json import PayloadConverter

THREADS = 4
NESTED = 20


def fresh_types() -> tuple[type, bytes]:
    inners = [
        dataclasses.make_dataclass(f"Inner{i}", [(f"f{j}", int) for j in range(8)])
        for i in range(NESTED)
    ]
    outer = dataclasses.make_dataclass(
        "Outer", [(f"i{i}", inner) for i, inner in enumerate(inners)] + [("name", str)]
    )
    value = outer(*(inner(*range(8)) for inner in inners), "x")
    return outer, msgspec.json.encode(value)


def decode_with(mode: str) -> Callable[[type, bytes], Any]:
    if mode == "plain":
        return lambda type_, data: msgspec.json.decode(data, type=type_)
    converter = PayloadConverter()
    return lambda type_, data: converter.from_payloads(
        [Payload(metadata={"encoding": b"json/plain"}, data=data)], [type_]
    )[0]


def main(mode: str, rounds: int) -> int:
    enable_crash_traces()
    sys.setswitchinterval(1e-6)
    decode = decode_with(mode)
    decoded: list[bool] = []  # list.append is atomic: the threads need no lock of their own

    def work(outer: type, data: bytes, barrier: threading.Barrier) -> None:
        barrier.wait()
        value = decode(outer, data)
        decoded.append(isinstance(value, outer) and getattr(value, "name", None) == "x")

    for _ in range(rounds):
        outer, data = fresh_types()
        barrier = threading.Barrier(THREADS)
        threads = [
            threading.Thread(target=work, args=(outer, data, barrier)) for _ in range(THREADS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    print(f"decoded {sum(decoded)} of {rounds * THREADS}", flush=True)
    return 0 if sum(decoded) == rounds * THREADS else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 50))
