"""The gateway's exact-token session ledger (`jaxagent.gateway.sessions`).

Every expected token list is written out here by hand from its pieces: with the byte
tokenizer a text is its UTF-8 bytes and the ChatML specials are ids 256..258; with the
trained BPE, literal ChatML text is encoded with the tokenizer itself. Nothing expected is
computed by the ledger.
"""

import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from jaxagent.gateway.records import SessionClosed, TooManySessions, UnknownSession
from jaxagent.gateway.sessions import ContextTooLong, SessionLedger
from jaxagent.gateway.store import SessionStore
from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
from jaxagent.models.tokenizer_training import train_bpe_tokenizer
from jaxagent.rollout.chat import ChatFormat

EOS, IM_START, IM_END = 256, 257, 258
# ChatML that also renders an assistant message's tool calls (Qwen-like `<tool_call>` JSON,
# written with spaces, unlike what the "model" below samples) and content None as nothing
TOOL_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for tc in m.tool_calls or [] %}"
    '<tool_call>{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}</tool_call>'
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def b(text: str) -> list[int]:
    """Byte-tokenizer ids of plain text."""
    return list(text.encode())


def turn(role: str, content: str) -> list[int]:
    return [IM_START] + b(f"{role}\n{content}") + [IM_END] + b("\n")


GEN = [IM_START] + b("assistant\n")


def sys_(text):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def asst(text, tool_calls=None):
    return {"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})}


@pytest.fixture(scope="module")
def byte_chat():
    tok = byte_chat_tokenizer()
    tok.chat_template = TOOL_CHATML
    chat = ChatFormat(tok)
    assert chat.end_of_turn_text == "<|im_end|>" and chat.stop_token_ids == (IM_END, EOS)

    def render(messages):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return tok, chat, render


def lps(n, base):
    return [base - 0.01 * i for i in range(n)]


def test_a_session_that_extends_itself_is_one_exact_sequence(byte_chat):
    tok, chat, render = byte_chat
    ledger = SessionLedger(chat, max_context=4096, session_id="s1")
    m1 = [sys_("You add numbers."), user("2+3?")]
    p1 = ledger.prompt(m1, render)
    exp1 = turn("system", "You add numbers.") + turn("user", "2+3?") + GEN
    assert list(p1.prompt_ids) == exp1
    assert (p1.extends, p1.reused, p1.reuse_from, p1.spliced) == (None, 0, None, ())

    # call 1: a tool call, sampled without spaces, ended by the sampled end-of-turn token
    comp1 = b('<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>') + [IM_END]
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]
    ledger.record(p1, comp1, lps(len(comp1), -0.1), 3, "tool_calls", None, tool_calls=calls)
    m2 = m1 + [asst(None, calls), {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    p2 = ledger.prompt(m2, render)
    exp2 = exp1 + comp1 + b("\n") + turn("tool", "5") + GEN  # the sampled end-of-turn is not repeated
    assert list(p2.prompt_ids) == exp2
    assert (p2.extends, p2.reused, p2.reuse_from) == (0, len(exp1) + len(comp1), 0)
    assert p2.spliced == ((0, len(exp1)),) and p2.text_assistants == () and p2.retokenised == ()
    # the template writes the call with spaces: its text would not give the sampled tokens
    assert '{"name": "add", "arguments": {"a":2,"b":3}}' in p2.prompt_text
    assert tok.encode(p2.prompt_text, add_special_tokens=False) != exp2

    # call 2: cut by max_tokens (no end-of-turn sampled): the segment starts with it
    comp2 = b("The sum is")
    ledger.record(p2, comp2, lps(len(comp2), -0.5), 4, "length", "The sum is")
    m3 = m2 + [asst("The sum is"), user("Go on.")]
    p3 = ledger.prompt(m3, render)
    exp3 = exp2 + comp2 + [IM_END] + b("\n") + turn("user", "Go on.") + GEN
    assert list(p3.prompt_ids) == exp3
    assert (p3.extends, p3.reused, p3.reuse_from) == (1, len(exp2) + len(comp2), 1)
    comp3 = b(" 5.") + [IM_END]
    ledger.record(p3, comp3, lps(len(comp3), -0.9), 4, "stop", " 5.")

    (seq,) = ledger.sequences()
    assert seq.session_id == "s1" and seq.branch == 0
    assert seq.tokens.dtype == np.int32 and seq.tokens.tolist() == exp3 + comp3
    n = len(exp3) + len(comp3)
    mask, logp, tids = np.zeros(n, np.int32), np.zeros(n, np.float32), np.full(n, -1)
    for k, (start, comp, base) in enumerate(
        [(len(exp1), comp1, -0.1), (len(exp2), comp2, -0.5), (len(exp3), comp3, -0.9)]
    ):
        mask[start : start + len(comp)] = 1
        logp[start : start + len(comp)] = lps(len(comp), base)
        tids[start : start + len(comp)] = k
    assert seq.loss_mask.tolist() == mask.tolist()
    np.testing.assert_array_equal(seq.logprobs, logp)
    assert seq.turn_ids.tolist() == tids.tolist()
    kinds = ["prompt"] * len(exp1) + ["policy" if m else "observation" for m in mask[len(exp1) :]]
    assert list(seq.kinds) == kinds
    assert (seq.calls, seq.policy_versions, seq.finish_reasons) == (
        (0, 1, 2),
        (3, 4, 4),
        ("tool_calls", "length", "stop"),
    )
    with pytest.raises(ValueError):
        seq.tokens[0] = 1  # read-only

    ep = seq.to_episode(index=5, seed=11, group_id=2, reward=1.5)
    assert ep.tokens == exp3 + comp3 and ep.loss_mask == mask.tolist() and ep.turn_ids == tids.tolist()
    np.testing.assert_allclose(ep.logp, logp, rtol=0, atol=1e-7)
    assert [k for k, _ in ep.segments] == ["prompt", "policy", "observation", "policy", "observation", "policy"]
    assert ep.rewards == [0.0, 0.0, 1.5] and ep.done and ep.end_reason == "program_returned"
    assert ep.actions == ["", "The sum is", " 5."] and (ep.index, ep.seed, ep.group_id) == (5, 11, 2)


def test_retokenisation_drift_is_avoided():
    """A completion sampled as a non-canonical BPE split of its text ("hel" + "lo" where
    the tokenizer merges "hello"): later prompts hold the sampled ids, both when the
    history extends the call and when it was rebuilt around the same assistant message."""
    tok = train_bpe_tokenizer(["hello world, hello there"] * 20 + ["the cat sat"] * 5, 300)
    chat = ChatFormat(tok)

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    def render(messages):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert len(enc("hello")) == 1  # the canonical tokenisation is one token
    comp = enc("hel") + enc("lo") + [im_end]
    assert enc(tok.decode(comp)) != comp  # decode + encode drifts
    ledger = SessionLedger(chat, max_context=512)
    m1 = [user("say hi")]
    p1 = ledger.prompt(m1, render)
    exp1 = enc("<|im_start|>user\nsay hi<|im_end|>\n<|im_start|>assistant\n")
    assert list(p1.prompt_ids) == exp1
    ledger.record(p1, comp, [-0.3] * len(comp), 0, "stop", "hello")

    p2 = ledger.prompt(m1 + [asst("hello"), user("again")], render)
    tail = enc("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    assert list(p2.prompt_ids) == exp1 + comp + tail
    assert p2.extends == 0 and p2.retokenised == ()
    assert enc(p2.prompt_text) != list(p2.prompt_ids)  # what re-tokenising would have given

    # rebuilt history (another system prompt): no extension, the sampled ids still spliced in
    p3 = ledger.prompt([sys_("new rules"), user("say hi"), asst("hello"), user("again")], render)
    head = enc("<|im_start|>system\nnew rules<|im_end|>\n<|im_start|>user\nsay hi<|im_end|>\n<|im_start|>assistant\n")
    assert list(p3.prompt_ids) == head + comp + tail
    assert p3.extends is None and p3.spliced == ((0, len(head)),) and p3.retokenised == ()


def test_a_rewritten_history_gives_one_sequence_per_branch(byte_chat):
    _, chat, render = byte_chat
    ledger = SessionLedger(chat, max_context=4096, session_id="s2")
    m1 = [sys_("Be brief."), user("Q")]
    exp1 = turn("system", "Be brief.") + turn("user", "Q") + GEN
    comp1, comp2, comp3 = b("A1") + [IM_END], b("A2") + [IM_END], b("A3") + [IM_END]
    ledger.record(ledger.prompt(m1, render), comp1, [-1.0] * 3, 1, "stop", "A1")
    p2 = ledger.prompt(m1 + [asst("A1"), user("more")], render)
    exp2 = exp1 + comp1 + b("\n") + turn("user", "more") + GEN
    assert list(p2.prompt_ids) == exp2
    ledger.record(p2, comp2, [-2.0] * 3, 1, "stop", "A2")

    # the program edits its earlier assistant message: a fresh tokenisation, a new branch
    p3 = ledger.prompt(m1 + [asst("A1 (edited)"), user("more")], render)
    exp3 = (
        turn("system", "Be brief.") + turn("user", "Q") + turn("assistant", "A1 (edited)") + turn("user", "more") + GEN
    )
    assert list(p3.prompt_ids) == exp3
    assert (p3.extends, p3.text_assistants, p3.retokenised, p3.spliced) == (None, (2,), (), ())
    # shared with call 1's sequence (exp1 + "A1" then <|im_end|> vs " "); the latest call wins ties
    assert (p3.reused, p3.reuse_from) == (len(exp1) + 2, 1)
    ledger.record(p3, comp3, [-3.0] * 3, 2, "stop", "A3")

    s0, s1 = ledger.sequences()
    assert (s0.session_id, s0.branch, s1.session_id, s1.branch) == ("s2", 0, "s2", 1)
    assert s0.tokens.tolist() == exp2 + comp2 and s1.tokens.tolist() == exp3 + comp3
    assert np.flatnonzero(s0.loss_mask).tolist() == [*range(len(exp1), len(exp1) + 3), *range(len(exp2), len(exp2) + 3)]
    assert np.flatnonzero(s1.loss_mask).tolist() == list(range(len(exp3), len(exp3) + 3))
    assert s1.logprobs[len(exp3) :].tolist() == [-3.0] * 3 and not s1.logprobs[: len(exp3)].any()
    assert (s0.calls, s1.calls, s1.policy_versions) == ((0, 1), (2,), (2,))
    assert set(s1.kinds[: len(exp3)]) == {"prompt"}


def test_a_retry_forks_and_every_completion_is_trained_once(byte_chat):
    _, chat, render = byte_chat
    ledger = SessionLedger(chat, max_context=4096)
    m1 = [user("Q")]
    exp1 = turn("user", "Q") + GEN
    comp1, comp2, comp2b = b("A") + [IM_END], b("B") + [IM_END], b("C!") + [IM_END]
    ledger.record(ledger.prompt(m1, render), comp1, [-1.0] * 2, 0, "stop", "A")
    m2 = m1 + [asst("A"), user("next")]
    p2 = ledger.prompt(m2, render)
    ledger.record(p2, comp2, [-2.0] * 2, 0, "stop", "B")
    # the same call again (the program retries): the same exact prompt, all of it cached
    p2b = ledger.prompt(m2, render)
    exp2 = exp1 + comp1 + b("\n") + turn("user", "next") + GEN
    assert list(p2b.prompt_ids) == exp2 and p2b.extends == 0
    assert (p2b.reused, p2b.reuse_from) == (len(exp2), 1)
    assert ledger.shared_prefix(p2b, 0) == len(exp1) + len(comp1)
    ledger.record(p2b, comp2b, [-4.0] * 3, 1, "stop", "C!")
    s0, s1 = ledger.sequences()
    assert s1.tokens.tolist() == exp2 + comp2b and s1.calls == (2,)
    # call 0's completion is in both sequences, trained only in the first
    assert np.flatnonzero(s1.loss_mask).tolist() == list(range(len(exp2), len(exp2) + 3))
    assert set(s1.kinds[: len(exp2)]) == {"prompt"}
    assert int(s0.loss_mask.sum() + s1.loss_mask.sum()) == len(comp1) + len(comp2) + len(comp2b)


def test_invented_assistant_messages_are_text_with_no_loss(byte_chat):
    _, chat, render = byte_chat
    ledger = SessionLedger(chat, max_context=4096)
    m1 = [sys_("S"), user("example"), asst("example answer"), user("Q")]  # a few-shot turn it never sampled
    p1 = ledger.prompt(m1, render)
    exp1 = turn("system", "S") + turn("user", "example") + turn("assistant", "example answer") + turn("user", "Q") + GEN
    assert list(p1.prompt_ids) == exp1 and p1.text_assistants == (2,) and p1.retokenised == ()
    comp1 = b("A") + [IM_END]
    ledger.record(p1, comp1, [-0.5] * 2, 0, "stop", "A")
    m2 = m1 + [asst("A"), user("x"), asst("invented"), user("y")]
    p2 = ledger.prompt(m2, render)
    exp2 = exp1 + comp1 + b("\n") + turn("user", "x") + turn("assistant", "invented") + turn("user", "y") + GEN
    assert list(p2.prompt_ids) == exp2 and p2.extends == 0 and p2.text_assistants == (2, 6)
    comp2 = b("B") + [IM_END]
    ledger.record(p2, comp2, [-0.7] * 2, 0, "stop", "B")
    (seq,) = ledger.sequences()
    trained = [*range(len(exp1), len(exp1) + 2), *range(len(exp2), len(exp2) + 2)]
    assert np.flatnonzero(seq.loss_mask).tolist() == trained
    at = len(exp1) + len(comp1) + 1 + len(turn("user", "x"))
    invented = slice(at, at + len(turn("assistant", "invented")))
    assert seq.tokens[invented].tolist() == turn("assistant", "invented")
    assert set(seq.kinds[invented]) == {"observation"} and not seq.loss_mask[invented].any()

    # a template that does not render assistant content verbatim: no splicing is possible,
    # and the plan says which known completion had to be re-tokenised
    def hiding(messages):
        return render([{**m, "content": "..."} if m["role"] == "assistant" else m for m in messages])

    p3 = ledger.prompt(m1 + [asst("A"), user("z")], hiding)
    exp3 = turn("system", "S") + turn("user", "example") + turn("assistant", "...") + turn("user", "Q")
    assert list(p3.prompt_ids) == exp3 + turn("assistant", "...") + turn("user", "z") + GEN
    assert (p3.extends, p3.text_assistants, p3.retokenised) == (None, (2, 4), (4,))


def test_a_prompt_longer_than_the_context_is_refused(byte_chat):
    _, chat, render = byte_chat
    msgs = [user("hello there")]
    n = len(turn("user", "hello there") + GEN)
    assert SessionLedger(chat, max_context=n).prompt(msgs, render).num_tokens == n
    with pytest.raises(ContextTooLong, match=rf"{n} tokens.*limit of {n - 1} tokens") as err:
        SessionLedger(chat, max_context=n - 1).prompt(msgs, render)
    assert (err.value.tokens, err.value.limit) == (n, n - 1)


def test_record_checks_its_arguments(byte_chat):
    _, chat, render = byte_chat
    a, other = SessionLedger(chat, max_context=64), SessionLedger(chat, max_context=64)
    plan = a.prompt([user("q")], render)
    with pytest.raises(ValueError, match="2 completion tokens but 1 log-probs"):
        a.record(plan, [1, 2], [0.0], 0, "stop", "x")
    with pytest.raises(ValueError, match="another SessionLedger"):
        other.record(plan, [1], [0.0], 0, "stop", "x")
    assert a.sequences() == [] and a.calls == ()


def test_the_store_bounds_opens_concurrently_and_drains(byte_chat):
    _, chat, render = byte_chat
    store = SessionStore(chat, max_context=256, max_sessions=4)
    start = threading.Barrier(24)
    results: list[tuple[str, object]] = []

    def open_(sid):
        start.wait()
        try:
            got: object = store.open(sid)
        except TooManySessions as e:
            got = e
        results.append((sid, got))  # list.append is atomic

    # the shared id first, so that it is opened at once by some of the threads
    threads = [threading.Thread(target=open_, args=("shared",)) for _ in range(8)]
    threads += [threading.Thread(target=open_, args=(f"s{i}",)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledgers = {sid: r for sid, r in results if isinstance(r, SessionLedger)}
    refused = {sid for sid, r in results if isinstance(r, TooManySessions)}
    assert len(results) == 24 and len(store) == len(ledgers) == 4
    assert refused == {sid for sid, _ in results} - set(ledgers)  # an id is opened by all its callers or none
    assert all("4 sessions are open" in str(r) for _, r in results if isinstance(r, TooManySessions))
    shared = [r for sid, r in results if sid == "shared" and isinstance(r, SessionLedger)]
    assert all(r is shared[0] for r in shared)
    if shared:
        assert store.open("shared") is shared[0]
    with pytest.raises(TooManySessions):
        store.open("one-more")

    sid, ledger = sorted(ledgers.items())[0]
    plan = ledger.prompt([user("q")], render)
    ledger.record(plan, b("a") + [IM_END], [-0.2, -0.1], 0, "stop", "a")
    store.close(sid)
    store.close(sid)  # idempotent
    assert len(store) == 3 and sid not in store
    with pytest.raises(SessionClosed):
        store.open(sid)
    with pytest.raises(SessionClosed):
        ledger.prompt([user("q")], render)
    with pytest.raises(UnknownSession):
        store.get("nobody")
    assert store.open("fresh").session_id == "fresh"  # a slot was freed

    drained = store.drain()
    assert [s for s, _ in drained] == [sid]
    (seq,) = drained[0][1]
    assert seq.session_id == sid and seq.tokens.tolist() == turn("user", "q") + GEN + b("a") + [IM_END]
    assert store.drain() == []
    store.close("fresh", discard=True)  # dropped: never drained
    assert store.open(sid) is not ledger  # after the drain the id is a new session
    everything = store.drain(include_open=True)
    assert sorted(s for s, _ in everything) == sorted([*[s for s in ledgers if s != sid], sid])
    assert all(seqs == [] for _, seqs in everything) and len(store) == 0


def test_the_sessions_and_the_program_workers_import_no_jax():
    """Nor does a program worker process (`python -m jaxagent.gateway.program_worker`)."""
    code = (
        "import json, sys, jaxagent.gateway.store, jaxagent.gateway.processes, jaxagent.gateway.program_worker\n"
        "print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in "
        "('jax', 'jaxlib', 'flax', 'jaxagent', 'transformers', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "jaxagent.gateway.store" in loaded
    # of the rest of jaxagent only the stdlib-only failure kinds (`jaxagent.failures`)
    outside = [m for m in loaded if m not in ("jaxagent", "jaxagent.failures") and not m.startswith("jaxagent.gateway")]
    assert outside == []
