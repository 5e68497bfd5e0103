"""The gateway's sessions: `SessionStore` opens a `SessionLedger` per session id and
hands the closed ones to the trainer as training sequences (`drain`). Thread-safe.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from jaxagent.gateway.records import Sequence, SessionClosed, TooManySessions, UnknownSession
from jaxagent.gateway.sessions import SessionLedger

if TYPE_CHECKING:  # the rollout imports JAX (through its package); this module must not
    from jaxagent.rollout.chat import ChatFormat


class SessionStore:
    """The gateway's sessions: open ledgers by id, and closed ones awaiting `drain`.

    `open(id)` returns the session's ledger, making it on first use (at most
    `max_sessions` open at once: `TooManySessions` beyond; opening a closed, undrained
    id raises `SessionClosed`); `get(id)` the open ledger; `close(id)` ends a session
    (kept for `drain`, or dropped with `discard=True`); `drain()` returns and forgets the
    closed sessions as `(session_id, sequences)` in closing order (a session that made
    no call has []), with `include_open=True` closing the open ones first. After a drain
    an id may be opened again as a new session. All methods are thread-safe.
    """

    def __init__(self, chat: ChatFormat, *, max_context: int, max_sessions: int):
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be a positive integer, got {max_sessions!r}")
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"max_context must be a positive integer, got {max_context!r}")
        self.chat = chat
        self.max_context = max_context
        self.max_sessions = max_sessions
        self._open: dict[str, SessionLedger] = {}
        self._closed: dict[str, SessionLedger] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Open sessions."""
        with self._lock:
            return len(self._open)

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._open

    def open(self, session_id: str) -> SessionLedger:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"a session id must be a non-empty string, got {session_id!r}")
        with self._lock:
            ledger = self._open.get(session_id)
            if ledger is not None:
                return ledger
            if session_id in self._closed:
                raise SessionClosed(f"session {session_id!r} is closed")
            if len(self._open) >= self.max_sessions:
                raise TooManySessions(self.max_sessions)
            ledger = SessionLedger(self.chat, max_context=self.max_context, session_id=session_id)
            self._open[session_id] = ledger
            return ledger

    def get(self, session_id: str) -> SessionLedger:
        with self._lock:
            if session_id in self._open:
                return self._open[session_id]
            if session_id in self._closed:
                raise SessionClosed(f"session {session_id!r} is closed")
            raise UnknownSession(f"no session {session_id!r}")

    def close(self, session_id: str, *, discard: bool = False) -> None:
        """Ends a session (idempotent); `discard`: forget it instead of keeping it for `drain`."""
        with self._lock:
            ledger = self._open.pop(session_id, None)
            if ledger is None:
                if session_id not in self._closed:
                    raise UnknownSession(f"no session {session_id!r}")
                if discard:
                    del self._closed[session_id]
                return
            ledger.close()
            if not discard:
                self._closed[session_id] = ledger

    def drain(self, *, include_open: bool = False) -> list[tuple[str, list[Sequence]]]:
        with self._lock:
            if include_open:
                for session_id, ledger in self._open.items():
                    ledger.close()
                    self._closed[session_id] = ledger
                self._open.clear()
            done = list(self._closed.items())
            self._closed.clear()
        return [(session_id, ledger.sequences()) for session_id, ledger in done]
