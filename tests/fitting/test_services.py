"""Big bodies are worked on off the event loop, in one thread."""

import asyncio
import threading

from contextpaw import wire
from contextpaw.fitting.services import off_loop
from support import fitters


async def test_big_work_runs_in_one_thread_one_piece_at_a_time() -> None:
    """A burst of big bodies keeps one thread, not a pool, asking for the interpreter's lock: the
    event loop gets it back after one switch interval."""
    running, most, names = 0, 0, set()

    def work() -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        names.add(threading.current_thread().name)
        threading.Event().wait(0.02)
        running -= 1

    await asyncio.gather(*(off_loop(True, work) for _ in range(6)))
    assert most == 1
    assert len(names) == 1 and threading.current_thread().name not in names


async def test_small_work_stays_on_the_loop() -> None:
    assert await off_loop(False, lambda: threading.current_thread().name) == threading.current_thread().name


async def test_a_big_chat_s_line_digests_are_read_in_the_worker_thread(monkeypatch) -> None:
    """Reading every line of a multi-megabyte chat took 50 ms on the event loop for each request."""
    read_in: list[str] = []
    original = wire.Chat.fingerprints

    def recorded(self: wire.Chat) -> tuple[tuple[int, int], ...]:
        if not self.read_lines:
            read_in.append(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(wire.Chat, "fingerprints", recorded)
    body = fitters.chat(turns=600, num_ctx=32768)
    await fitters.fitter().fit(fitters.state(body))
    assert read_in and all(name.startswith("contextpaw-big-body") for name in read_in)
