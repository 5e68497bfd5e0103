"""The child side of `jaxagent.gateway.processes`: a process that runs agent programs'
sessions against a gateway and reports how each ended.

    python -m jaxagent.gateway.program_worker

It reads batches from its stdin and writes their outcomes to its stdout, each message a
pickle behind an 8-byte big-endian length (`read_message` / `write_message`). Before
the first message it moves its own stdout aside and points file descriptor 1 at its
stderr, so a program that prints cannot corrupt the protocol (its prints go to the
parent, which forwards them). A batch is a dict:

    program, imports   "module:function" and `agent.imports` (loaded once per pair)
    sys_path           the parent's import path (entries missing here are appended)
    tasks              [(session_id, seed, task), ...]
    urls               {session_id: base URL of the session on the gateway}
    api_key, concurrency, timeout_s

and its answer `{"outcomes": [SessionOutcome, ...]}` in the order of `tasks` (no
"no_calls" check here: the calls are counted by the gateway, in the parent), or
`{"error": message, "traceback": text}` when the program cannot be loaded. End of
input ends the process, and so does its parent's end (a trainer killed outright);
SIGINT is ignored (the trainer handles Ctrl-C). Pure Python: no JAX; `openai` and `httpx` are imported for the
sessions' clients.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from typing import IO, Any

_HEADER = struct.Struct(">Q")
#: the largest message either side accepts (a batch of tasks, or its outcomes)
MAX_MESSAGE_BYTES = 1 << 30


def write_message(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    """The next message, or None at the end of the stream (a message cut short is an
    end too: the writer died while writing)."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    if n > MAX_MESSAGE_BYTES:
        raise ValueError(f"program worker: a message of {n} bytes is over the limit of {MAX_MESSAGE_BYTES}")
    data = stream.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


def _exit_with_parent(parent: int) -> None:
    """Exits this process once its parent is gone (re-parented: `getppid` changed), so a
    trainer killed outright leaves no worker behind, whatever its programs are doing.

    The env pool's workers watch their parent too (`envs.pool.worker._watch_parent`), on
    the sentinel `multiprocessing` gives its children. This process is a plain `python -m`
    subprocess (its protocol is its stdin and stdout, set up before any program runs),
    with no such sentinel: `getppid` is what it has, and suffices, the trainer being its
    direct parent. Nor could one function serve both: the gateway imports nothing of
    `envs`, and `envs` nothing of `jaxagent`."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main() -> None:
    from jaxagent.gateway.program import load_program, run_openai_sessions

    # Ctrl-C in a terminal reaches the whole process group: the trainer decides what a
    # batch in flight becomes, not the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the programs' prints go to stderr, never into the protocol
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    programs: dict[tuple[str, tuple[str, ...]], Any] = {}
    while True:
        batch = read_message(inp)
        if batch is None:
            return
        for entry in batch["sys_path"]:
            if entry not in sys.path:
                sys.path.append(entry)
        key = (batch["program"], tuple(batch["imports"]))
        try:
            if key not in programs:
                programs[key] = load_program(*key)
        except Exception as err:  # noqa: BLE001 - reported to the parent, which fails the sessions
            write_message(out, {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
            continue
        urls = batch["urls"]
        outcomes = run_openai_sessions(
            programs[key],
            batch["tasks"],
            base_url=urls.__getitem__,
            api_key=batch["api_key"],
            concurrency=batch["concurrency"],
            timeout_s=batch["timeout_s"],
            calls_made=None,
        )
        write_message(out, {"outcomes": outcomes})


if __name__ == "__main__":
    main()
