"""Judge clients (jaxagent.rewards.judge) against a local stub of /chat/completions.

The stub (stdlib http.server on 127.0.0.1, port 0) picks its behaviour per request from
a marker in the prompt: `CASE=<name>` or `CASE=<name>#<tag>` (a tag counts requests
apart, for "fail first, then succeed"). It records every request's headers and body,
and how many requests were in flight at once.
"""

import json
import pickle
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jaxagent.rewards import (
    DEFAULT_PROMPT,
    CallableJudge,
    JudgeItem,
    JudgeResult,
    OpenAIJudge,
    combine,
    make_judge,
    parse_score,
)
from jaxagent.rewards.judge import Judge

KEY = "sk-test-SECRET-4f9a1c77e2"
KEY_VAR = "JAXAGENT_TEST_JUDGE_KEY"
_CASE = re.compile(r"CASE=([\w.-]+)(?:#(\w+))?")


class _Stub:
    def __init__(self):
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        with self.lock:
            self.requests = []  # (path, case, tag, headers, body)
            self.counts = {}
            self.in_flight = 0
            self.max_in_flight = 0

    def n(self, case, tag=None):
        with self.lock:
            return sum(1 for r in self.requests if r[1] == case and r[2] == tag)


def _handler(stub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _finished(self):
            # a request stops counting as in flight before its reply goes out: the client
            # may send its next request as soon as it has read this one's reply
            with stub.lock:
                if getattr(self, "_counted", False):
                    self._counted = False
                    stub.in_flight -= 1

        def _send(self, code, body, ctype="application/json", headers=()):
            self._finished()
            data = body.encode() if isinstance(body, str) else body
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _reply(self, content):
            self._send(
                200,
                json.dumps(
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                        ],
                    }
                ),
            )

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            m = _CASE.search(body["messages"][-1]["content"]) if self.path == "/v1/chat/completions" else None
            case, tag = (m.group(1), m.group(2)) if m else (None, None)
            with stub.lock:
                stub.requests.append((self.path, case, tag, dict(self.headers), body))
                nth = stub.counts[(case, tag)] = stub.counts.get((case, tag), 0) + 1
                stub.in_flight += 1
                stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                self._counted = True
            try:
                self._serve(case, nth)
            finally:
                self._finished()

        def _serve(self, case, nth):
            auth = self.headers.get("Authorization", "")
            if case == "ok":
                self._reply("The answer is right. A first guess was Score: 0.2, but on reflection\nScore: 0.7")
            elif case == "json":
                self._reply('{"score": 0.25, "reason": "partly {right}"}')
            elif case == "garbage":
                self._reply("I think it went fine, really.")
            elif case == "range":
                self._reply("Score: 7")
            elif case == "notjson":
                self._send(200, "<html>oops</html>", "text/html")
            elif case == "slow":
                stub.stop.wait(1.5)
                self._reply("Score: 0.9")
            elif case == "hang":
                stub.stop.wait(30)
                self._reply("Score: 0.9")
            elif case and case.startswith("sleep"):
                stub.stop.wait(float(case[len("sleep") :]))
                self._reply("Score: 0.5")
            elif case == "flaky500":
                self._send(500, '{"error": "overloaded"}') if nth == 1 else self._reply("Score: 0.6")
            elif case == "flaky429":
                self._send(429, '{"error": "rate"}') if nth == 1 else self._reply("Score: 0.4")
            elif case == "always500":
                self._send(500, '{"error": "down"}')
            elif case == "bad400":
                self._send(400, json.dumps({"error": f"bad request; you sent Authorization: {auth}"}))
            elif case == "echo":
                self._reply(f"your header was {auth}")
            elif case == "redirect":
                self._send(302, "", headers=[("Location", "/elsewhere")])
            elif case == "drop":
                self.close_connection = True  # no status line: the client sees the connection drop
            elif case == "dropthenok":
                if nth == 1:
                    self.close_connection = True
                else:
                    self._reply("Score: 0.3")
            else:
                self._send(404, '{"error": "no such case"}')

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 64

    def handle_error(self, request, client_address):
        pass  # a client that gave up (timeout) makes the late write fail: expected here


@pytest.fixture(scope="module")
def server():
    stub = _Stub()
    srv = _Server(("127.0.0.1", 0), _handler(stub))
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    stub.base_url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    yield stub
    stub.stop.set()
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def stub(server, monkeypatch):
    server.reset()
    monkeypatch.setenv(KEY_VAR, KEY)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    return server


def item(key, case, tag=None, info=None):
    marker = f"CASE={case}" + (f"#{tag}" if tag else "")
    return JudgeItem(
        key,
        [
            {"role": "system", "content": "Solve the puzzle."},
            {"role": "user", "content": f"Puzzle {key}. {marker}"},
            {"role": "assistant", "content": "My answer is 42."},
        ],
        info or {},
    )


def judge(stub, **opts):
    opts = {"timeout_s": 0.5, "retries": 2, "backoff_s": 0.05, "max_concurrency": 16, **opts}
    return OpenAIJudge(stub.base_url, "judge-model", api_key_env=KEY_VAR, **opts)


def outcome(results):
    return [(r.key, r.score, r.failure_kind) for r in results]


# -- one batch, every behaviour ------------------------------------------------------------


def test_a_batch_gives_each_item_its_score_or_failure_kind_in_the_items_order(stub):
    cases = [
        ("e7", "ok", None),
        ("e3", "slow", None),
        ("e9", "json", None),
        ("e1", "garbage", None),
        ("e4", "range", None),
        ("e0", "bad400", None),
        ("e8", "notjson", None),
        ("e2", "flaky500", "a"),
        ("e6", "drop", None),
        ("e5", "flaky429", "b"),
        ("e10", "dropthenok", "c"),
    ]
    items = [item(k, c, t) for k, c, t in cases]
    t0 = time.monotonic()
    results = judge(stub).score_batch(items)
    elapsed = time.monotonic() - t0

    assert all(isinstance(r, JudgeResult) for r in results)
    assert outcome(results) == [
        ("e7", 0.7, None),
        ("e3", None, "judge_timeout"),
        ("e9", 0.25, None),
        ("e1", None, "judge_bad_reply"),
        ("e4", None, "judge_bad_reply"),
        ("e0", None, "judge_http_error"),
        ("e8", None, "judge_bad_reply"),
        ("e2", 0.6, None),
        ("e6", None, "judge_http_error"),
        ("e5", 0.4, None),
        ("e10", 0.3, None),
    ]
    by = {r.key: r for r in results}
    assert "HTTP 400" in by["e0"].detail and "outside" in by["e4"].detail and "no score" in by["e1"].detail
    assert "connection" in by["e6"].detail and "3 attempts" in by["e6"].detail
    # Retries: 5xx, 429 and a dropped connection are retried; a 400 and a timeout are not.
    assert (stub.n("flaky500", "a"), stub.n("flaky429", "b"), stub.n("dropthenok", "c")) == (2, 2, 2)
    assert (stub.n("drop"), stub.n("bad400"), stub.n("slow")) == (3, 1, 1)
    # The slow item failed at its own timeout (0.5 s), not at the server's 1.5 s.
    assert 0.4 < by["e3"].seconds < 1.2 and elapsed < 2.0
    assert all(r.seconds >= 0 for r in results)


def test_always_failing_server_errors_are_retried_then_reported(stub):
    [r] = judge(stub, retries=1).score_batch([item(0, "always500")])
    assert (r.score, r.failure_kind) == (None, "judge_http_error")
    assert "HTTP 500" in r.detail and stub.n("always500") == 2


def test_a_refused_connection_is_an_http_error_for_each_item():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    j = OpenAIJudge(f"http://127.0.0.1:{port}/v1", "m", timeout_s=0.5, retries=1, backoff_s=0.01)
    results = j.score_batch([JudgeItem(i, [{"role": "user", "content": "hi"}]) for i in range(3)])
    assert [(r.key, r.failure_kind) for r in results] == [(i, "judge_http_error") for i in range(3)]
    assert all("connection" in r.detail for r in results)


def test_redirects_are_refused_so_the_key_never_follows_one(stub):
    [r] = judge(stub).score_batch([item(0, "redirect")])
    assert (r.score, r.failure_kind) == (None, "judge_http_error") and "HTTP 302" in r.detail
    assert [p for p, *_ in stub.requests] == ["/v1/chat/completions"]


# -- the deadline and concurrency ----------------------------------------------------------


def test_the_batch_returns_by_its_deadline_even_with_a_hanging_request(stub):
    j = judge(stub, timeout_s=10.0, retries=0, batch_timeout_s=0.8)
    t0 = time.monotonic()
    results = j.score_batch([item("a", "ok"), item("b", "hang"), item("c", "json")])
    elapsed = time.monotonic() - t0
    assert 0.7 < elapsed < 2.0
    assert outcome(results) == [("a", 0.7, None), ("b", None, "judge_timeout"), ("c", 0.25, None)]
    assert "deadline" in results[1].detail and 0.6 < results[1].seconds < 1.5


def test_a_call_cut_short_by_the_deadline_says_so_whichever_thread_reports_it(stub):
    # the worker's own view: its call's timeout was cut to what was left of the batch, and
    # its timeout must name the deadline too (the batch thread and the worker race to report it)
    from jaxagent.rewards.judge import _Batch

    j = judge(stub, timeout_s=10.0, retries=0)
    batch = _Batch(1, time.monotonic() + 0.4)
    assert batch.start(0)
    r = j._score_one(item("b", "hang"), batch)
    assert (r.score, r.failure_kind) == (None, "judge_timeout")
    assert "batch deadline" in r.detail and 0.3 < r.seconds < 1.5
    # a call that times out on its own timeout_s, well before the deadline, says that instead
    r = judge(stub, timeout_s=0.3, retries=0)._score_one(item("c", "hang"), _Batch(1, time.monotonic() + 30))
    assert r.failure_kind == "judge_timeout" and r.detail == "no reply within 0.3 s"


def test_items_still_queued_at_the_deadline_fail_as_timeouts(stub):
    j = judge(stub, timeout_s=10.0, retries=0, batch_timeout_s=0.5, max_concurrency=1)
    t0 = time.monotonic()
    results = j.score_batch([item("a", "hang"), item("b", "ok")])
    assert time.monotonic() - t0 < 2.0
    assert outcome(results) == [("a", None, "judge_timeout"), ("b", None, "judge_timeout")]
    assert "not started" in results[1].detail and results[1].seconds == 0.0
    assert stub.n("ok") == 0


def test_the_default_deadline_is_one_items_worst_case_per_wave_plus_a_margin():
    j = CallableJudge(lambda it: 0.5, timeout_s=2.0, retries=2, backoff_s=0.5, max_concurrency=8)
    assert j.item_budget_s() == 2.0 * 3 + 0.5 + 1.0
    assert j.default_batch_timeout_s(1) == j.default_batch_timeout_s(8) == 7.5 + 1.0
    assert j.default_batch_timeout_s(9) == 2 * 7.5 + 1.0


def test_calls_run_concurrently_up_to_max_concurrency(stub):
    t0 = time.monotonic()
    results = judge(stub, timeout_s=3.0, max_concurrency=8).score_batch([item(i, "sleep0.4") for i in range(8)])
    elapsed = time.monotonic() - t0
    assert [r.score for r in results] == [0.5] * 8
    assert elapsed < 2.0, f"8 calls of 0.4 s took {elapsed:.2f} s: not concurrent"
    assert stub.max_in_flight == 8

    stub.reset()
    t0 = time.monotonic()
    results = judge(stub, timeout_s=3.0, max_concurrency=3).score_batch([item(i, "sleep0.2") for i in range(6)])
    elapsed = time.monotonic() - t0
    assert [r.score for r in results] == [0.5] * 6
    assert stub.max_in_flight == 3 and elapsed >= 0.38


# -- the request, and the key --------------------------------------------------------------


def test_the_request_carries_the_key_from_the_env_var_and_the_rendered_prompt(stub, monkeypatch):
    j = judge(stub, temperature=0.3, max_tokens=64)
    monkeypatch.setenv(KEY_VAR, "sk-changed-after-build")  # read once, when the judge is built
    [r] = j.score_batch([item(5, "ok", info={"answer": "XYZZY-ANSWER"})])
    assert r.score == 0.7
    [(path, _, _, headers, body)] = stub.requests
    assert path == "/v1/chat/completions"
    assert headers["Authorization"] == f"Bearer {KEY}"
    assert headers["Content-Type"] == "application/json"
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("judge-model", 0.3, 64)
    [msg] = body["messages"]
    assert msg["role"] == "user"
    assert "Score: <number between 0 and 1>" in msg["content"]
    assert "### SYSTEM PROMPT\nSolve the puzzle." in msg["content"]
    assert "### POLICY (assistant)\nMy answer is 42." in msg["content"]
    assert "XYZZY-ANSWER" not in msg["content"]  # info is never sent raw


def test_a_prompt_template_may_use_info_fields(stub):
    j = judge(stub, prompt="Reference: {info[answer]}\n\n{transcript}")
    results = j.score_batch([item(0, "ok", info={"answer": "XYZZY"}), item(1, "ok", info={})])
    assert outcome(results) == [(0, 0.7, None), (1, None, "judge_error")]
    assert "answer" in results[1].detail
    [(_, _, _, _, body)] = stub.requests
    assert body["messages"][0]["content"].startswith("Reference: XYZZY\n\n### SYSTEM PROMPT")


def test_bad_prompt_templates_are_refused_when_the_judge_is_built(stub):
    with pytest.raises(ValueError, match="transcript"):
        judge(stub, prompt="no transcript here")
    with pytest.raises(ValueError, match="unknown fields"):
        judge(stub, prompt="{transcript} {episode}")
    with pytest.raises(ValueError, match="braces"):
        judge(stub, prompt="{transcript} {")


def test_no_api_key_env_sends_no_authorization_header(stub):
    j = OpenAIJudge(stub.base_url, "m", timeout_s=0.5)
    assert [r.score for r in j.score_batch([item(0, "ok")])] == [0.7]
    assert "Authorization" not in stub.requests[0][3]


def test_the_key_never_appears_in_repr_details_or_errors(stub):
    j = judge(stub, retries=0)
    for text in (repr(j), str(j), repr(vars(j)), str(vars(j))):
        assert KEY not in text
    assert KEY_VAR in repr(j)
    results = j.score_batch([item(0, "bad400"), item(1, "echo"), item(2, "ok")])
    assert [r.failure_kind for r in results] == ["judge_http_error", "judge_bad_reply", None]
    assert stub.requests[0][3]["Authorization"] == f"Bearer {KEY}"  # the server did see (and echo) it
    for r in results:
        assert KEY not in r.detail and KEY not in repr(r)
    assert "<redacted>" in results[0].detail and "<redacted>" in results[1].detail
    with pytest.raises(TypeError) as e:
        pickle.dumps(j)
    assert KEY not in str(e.value)

    errors = []
    for bad in (
        lambda: OpenAIJudge(stub.base_url, "m", api_key=KEY),
        lambda: OpenAIJudge(stub.base_url, "m", api_key_env=KEY),  # the key pasted as the variable name
        lambda: make_judge({"type": "openai", "base_url": stub.base_url, "model": "m", "api_key": KEY}),
        lambda: make_judge({"type": "openai", "base_url": stub.base_url, "model": "m", "api_key_env": KEY}),
        lambda: make_judge(
            {"type": "openai", "base_url": stub.base_url, "model": "m", "api_key_env": KEY_VAR, "timeout_s": -1}
        ),
    ):
        with pytest.raises(ValueError) as e:
            bad()
        errors.append(str(e.value))
    assert all(KEY not in msg for msg in errors), errors


def test_a_key_passed_directly_is_refused(stub):
    with pytest.raises(ValueError, match="environment variable"):
        OpenAIJudge(stub.base_url, "m", api_key=KEY)
    with pytest.raises(ValueError, match="environment variable"):
        make_judge({"type": "openai", "base_url": stub.base_url, "model": "m", "api_key": KEY})


def test_a_missing_or_empty_key_variable_is_a_clear_error(stub, monkeypatch):
    monkeypatch.delenv(KEY_VAR)
    with pytest.raises(ValueError, match=f"{KEY_VAR} is not set"):
        judge(stub)
    monkeypatch.setenv(KEY_VAR, "  ")
    with pytest.raises(ValueError, match=f"{KEY_VAR} is empty"):
        judge(stub)


# -- make_judge ----------------------------------------------------------------------------


def length_score(it):
    """A judge function for make_judge's import: longer last actions score higher."""
    return min(1.0, len(it.messages[-1]["content"]) / 100)


def test_make_judge_builds_both_types_from_a_config_mapping(stub):
    j = make_judge(
        {
            "type": "openai",
            "base_url": stub.base_url + "/",
            "model": "judge-model",
            "api_key_env": KEY_VAR,
            "timeout_s": 2.5,
            "retries": 1,
            "max_concurrency": 4,
            "max_tokens": 32,
            "score_range": [0, 1],
        }
    )
    assert isinstance(j, OpenAIJudge)
    assert (j.url, j.timeout_s, j.retries, j.max_concurrency, j.max_tokens) == (
        stub.base_url + "/chat/completions",
        2.5,
        1,
        4,
        32,
    )
    assert [r.score for r in j.score_batch([item(0, "ok")])] == [0.7]

    c = make_judge({"type": "callable", "fn": "test_rewards_judge:length_score", "timeout_s": 1.0})
    assert isinstance(c, CallableJudge) and c.fn is length_score
    assert [r.score for r in c.score_batch([item(0, "x")])] == [pytest.approx(len("My answer is 42.") / 100)]


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"type": "anthropic"}, r"unknown judge type 'anthropic'; known types: openai, callable"),
        ({"base_url": "http://x"}, r"unknown judge type None; known types: openai, callable"),
        (
            {"type": "openai", "base_url": "http://x", "model": "m", "temprature": 0.1},
            r"unknown keys for a 'openai' judge: \['temprature'\]; known keys: .*temperature",
        ),
        ({"type": "callable", "fn": "math:fabs", "model": "m"}, r"unknown keys .*\['model'\]; known keys: type, fn"),
        ({"type": "openai", "model": "m"}, "needs base_url"),
        ({"type": "openai", "base_url": "ftp://x", "model": "m"}, "http:// or https://"),
        ({"type": "callable"}, "needs fn"),
        (
            {"type": "callable", "fn": "no_such_module_xyz:f"},
            "judge fn 'no_such_module_xyz:f': no module named 'no_such_module_xyz'",
        ),
        ({"type": "callable", "fn": "math:no_such_fn"}, "judge fn 'math:no_such_fn': module 'math' has no attribute"),
        ({"type": "callable", "fn": "math:pi"}, "not callable"),
        ({"type": "callable", "fn": "length_score"}, "judge fn must look like 'module:function'"),
        ({"type": "callable", "fn": "math:fabs", "max_concurrency": 0}, "max_concurrency"),
        ({"type": "callable", "fn": "math:fabs", "score_range": [1, 0]}, "lo < hi"),
        (["openai"], "mapping"),
    ],
)
def test_make_judge_refuses_bad_specs_naming_what_is_known(spec, match):
    with pytest.raises(ValueError, match=match):
        make_judge(spec)


# -- CallableJudge -------------------------------------------------------------------------


def test_a_callable_that_raises_fails_only_its_own_item():
    def fn(it):
        if it.key == 1:
            raise RuntimeError("judge exploded")
        if it.key == 2:
            raise TimeoutError("too slow")
        if it.key == 3:
            return "Reasoning...\nScore: 0.35"
        if it.key == 4:
            return 1.5
        if it.key == 5:
            return float("nan")
        return 0.8

    results = CallableJudge(fn).score_batch([item(i, "x") for i in range(6)])
    assert outcome(results) == [
        (0, 0.8, None),
        (1, None, "judge_error"),
        (2, None, "judge_timeout"),
        (3, 0.35, None),
        (4, None, "judge_bad_reply"),
        (5, None, "judge_bad_reply"),
    ]
    assert results[1].detail == "RuntimeError: judge exploded"
    assert [r.score for r in CallableJudge(fn, score_range=None).score_batch([item(4, "x")])] == [1.5]


def test_a_callable_slower_than_its_timeout_is_a_timeout_and_connection_errors_are_retried():
    calls = []

    def fn(it):
        calls.append(it.key)
        if it.key == "slow":
            time.sleep(0.3)
        if it.key == "flaky" and calls.count("flaky") == 1:
            raise ConnectionError("reset")
        return 0.5

    results = CallableJudge(fn, timeout_s=0.1, retries=1, backoff_s=0.01).score_batch(
        [JudgeItem("slow", []), JudgeItem("flaky", [])]
    )
    assert outcome(results) == [("slow", None, "judge_timeout"), ("flaky", 0.5, None)]
    assert calls.count("flaky") == 2 and calls.count("slow") == 1


def test_a_bug_in_a_judge_subclass_fails_its_item_at_once_not_at_the_deadline():
    class Buggy(CallableJudge):
        def _score_one(self, it, batch):
            if it.key == 1:
                raise KeyError("bug")
            return super()._score_one(it, batch)

    t0 = time.monotonic()
    results = Buggy(lambda it: 0.5, timeout_s=30.0).score_batch([item(i, "x") for i in range(3)])
    assert time.monotonic() - t0 < 2.0
    assert outcome(results) == [(0, 0.5, None), (1, None, "judge_error"), (2, 0.5, None)]
    assert results[1].detail == "KeyError: 'bug'"


def test_score_batch_edge_cases():
    j = CallableJudge(lambda it: 0.5)
    assert j.score_batch([]) == []
    with pytest.raises(TypeError, match="JudgeItem"):
        j.score_batch([{"key": 0}])
    with pytest.raises(ValueError, match="callable"):
        CallableJudge("not a function")
    assert isinstance(j, Judge) and "CallableJudge(" in repr(j)


# -- parsing and combining -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, score",
    [
        ("Score: 0.7", 0.7),
        ("First Score: 0.2, then\nScore: 0.9", 0.9),
        ("**Score:** 0.85", 0.85),
        ("score = .5", 0.5),
        ('{"score": 1}', 1.0),
        ('```json\n{"score": 0.4, "why": "a {nested} brace"}\n```', 0.4),
        ('Score: 0.1 ... final: {"score": 0.6}', 0.6),
        ('{"score": 0.6} but then Score: 0.3', 0.3),
        ("Score: 7/10", 7.0),
        ('{"score": "0.5"}', None),
        ('{"score": true}', None),
        ("subscore: 0.3", None),
        ("no number at all", None),
        ("", None),
    ],
)
def test_parse_score_takes_the_last_score(text, score):
    assert parse_score(text) == score


def test_the_default_prompt_asks_for_a_score_line():
    assert "{transcript}" in DEFAULT_PROMPT and "Score: <number between 0 and 1>" in DEFAULT_PROMPT


def test_combine_replaces_or_adds():
    assert combine(3.0, 0.25, "replace") == 0.25
    assert combine(3.0, 0.25, "add") == 3.25
    assert combine(3.0, 0.25, "add", weight=2.0) == 3.5
    with pytest.raises(ValueError, match="known modes: replace, add"):
        combine(1.0, 0.5, "multiply")
    with pytest.raises(ValueError, match="judge failed"):
        combine(1.0, None, "add")
    with pytest.raises(ValueError, match="weight must be 1.0"):
        combine(1.0, 0.5, "replace", weight=0.5)
