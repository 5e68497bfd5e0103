"""The simulated patient: deterministic disclosure rules, and pluggable voices.

Research simulation, not a clinical tool.

A patient's turn has two parts:

1. **What is disclosed** (:class:`PatientState.disclose`, always rule-based and
   deterministic): the question is mapped to domains (:mod:`envs.intake.domains`)
   and, per domain, the persona and the case decide whether the patient reveals the
   case's item (the truth, present or absent), denies a present finding, deflects, or
   leaves it unanswered. The rubric is computed from these decisions, so the reward
   does not depend on how the reply is worded.
2. **How it is said** (a *simulator*, the voice): :class:`RuleBasedSimulator` (the
   default, templates and a seeded choice per turn) or :class:`LLMSimulator` (any
   ``generate(messages) -> str`` callable, e.g. :class:`OpenAIChatClient` for an
   OpenAI-compatible ``/chat/completions`` endpoint the user runs). An LLM voice is
   told exactly which facts to share and which to deny or withhold.

Disclosure rules, per domain a question is about (in order of mention):

- at most ``max_domains_per_question`` domains are answered (the rest are left for a
  later question, and the patient asks for one thing at a time); a *tangential*
  patient answers only the first;
- a *concealed* present risk (the adversarial set) is denied unless the question
  is direct (see the ``direct``/``general`` patterns in :mod:`envs.intake.domains`);
- *guarded*: sensitive domains (risk, substance use, trauma, psychosis) are deflected
  until the clinician has shown empathy at least once (rapport), present or not;
- *minimising*: a present risk is denied unless the question is direct; other
  findings are revealed but played down;
- *forthcoming*: reveals everything asked about, and volunteers one related,
  non-sensitive finding (``VOLUNTEERS``: mood -> sleep/appetite, anxiety -> sleep,
  trauma -> sleep, substance use -> functioning, psychosis -> functioning);
- *tangential*: reveals what it answers, after a digression.

A domain already elicited is told again, truthfully, whatever the question. Revealing
a present suicide plan, intent or means also reveals suicidal ideation.
A question is *repeated* if its normalised text was asked before, or every domain it
is about was already elicited. A question about no domain is off-topic.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from envs.intake.cases import PERSONAS, Case, Item
from envs.intake.domains import (
    _SUICIDE_CONTEXT,
    DOMAINS,
    RISK_DOMAINS,
    RULES,
    SENSITIVE_DOMAINS,
    SUICIDE_DOMAINS,
    SYMPTOM_DOMAINS,
    is_empathic,
    map_question,
    normalize,
)

VOLUNTEERS = {
    "mood": ("sleep", "appetite"),
    "anxiety": ("sleep",),
    "trauma": ("sleep",),
    "substance": ("social",),
    "psychosis": ("social",),
}


class SimulatorError(RuntimeError):
    """An LLM-backed simulator failed (unreachable endpoint, bad response)."""


@dataclass
class Disclosure:
    """What the patient discloses in reply to one question.

    ``domains``: ``[(domain, "direct"|"general")]`` the question is about;
    ``revealed``: items told truthfully (present or absent), in order;
    ``volunteered``: items told unasked; ``denied``: present findings falsely denied;
    ``refused``: domains deflected; ``unanswered``: domains left for later.
    """

    question: str
    domains: list[tuple[str, str]]
    revealed: list[Item] = field(default_factory=list)
    volunteered: list[Item] = field(default_factory=list)
    denied: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    repeated: bool = False
    empathic: bool = False

    @property
    def off_topic(self) -> bool:
        return not self.domains

    def to_dict(self) -> dict:
        return {
            "domains": [d for d, _ in self.domains],
            "revealed": [it.domain for it in self.revealed],
            "volunteered": [it.domain for it in self.volunteered],
            "denied": list(self.denied),
            "refused": list(self.refused),
            "unanswered": list(self.unanswered),
            "new": list(self.new),
            "repeated": self.repeated,
            "empathic": self.empathic,
            "off_topic": self.off_topic,
        }


class PatientState:
    """The disclosure state of one patient over an episode; see the module docstring."""

    def __init__(self, case: Case, *, max_domains_per_question: int = 2):
        if case.persona not in PERSONAS:
            raise ValueError(f"unknown persona {case.persona!r}; known: {', '.join(PERSONAS)}")
        self.case = case
        self.max_domains = max_domains_per_question
        self.rapport = False
        self.elicited: dict[str, Item] = {}
        self._asked: set[str] = set()
        self._previous: tuple[str, ...] = ()

    def disclose(self, question: str) -> Disclosure:
        case, persona = self.case, self.case.persona
        domains = map_question(question, self._previous)
        d = Disclosure(question, domains, empathic=is_empathic(question))
        text = normalize(question)
        d.repeated = text in self._asked or bool(domains) and all(dom in self.elicited for dom, _ in domains)
        self._asked.add(text)
        self.rapport = self.rapport or d.empathic
        cap = 1 if persona == "tangential" else self.max_domains
        for i, (dom, spec) in enumerate(domains):
            if i >= cap:
                d.unanswered.append(dom)
                continue
            item = case.item(dom)
            if dom in self.elicited:  # already told: told again, consistently
                d.revealed.append(item)
            elif item.present and item.concealed and spec != "direct":
                d.denied.append(dom)
            elif persona == "guarded" and dom in SENSITIVE_DOMAINS and not self.rapport:
                d.refused.append(dom)
            elif persona == "minimising" and item.present and dom in RISK_DOMAINS and spec != "direct":
                d.denied.append(dom)
            else:
                d.revealed.append(item)
        told = {it.domain for it in d.revealed}
        if persona == "forthcoming":
            extras = [
                x
                for it in d.revealed
                for x in VOLUNTEERS.get(it.domain, ())
                if case.item(x).present and x not in self.elicited and x not in told
            ]
            if extras:
                d.volunteered.append(case.item(extras[0]))
        implied = any(it.present and it.domain in SUICIDE_DOMAINS[1:] for it in d.revealed)
        if implied and "suicidal_ideation" not in self.elicited and "suicidal_ideation" not in told:
            d.volunteered.append(case.item("suicidal_ideation"))
        for it in d.revealed + d.volunteered:
            if it.domain not in self.elicited:
                self.elicited[it.domain] = it
                d.new.append(it.domain)
        self._previous = tuple(dom for dom, _ in domains)
        return d


class Simulator(Protocol):
    """The voice of the patient: the reply text for a disclosure.

    ``history``: the earlier ``(question, reply)`` pairs of the episode; ``turn``:
    1-based. Must be deterministic for a deterministic episode.
    """

    def reply(self, case: Case, disclosure: Disclosure, history: list[tuple[str, str]], turn: int) -> str: ...


_TANGENTS = (
    "That reminds me, my neighbour's dog got out again yesterday, we were chasing it for an hour. Anyway —",
    "Sorry, I was just thinking about the traffic on the way here, it was terrible. Where was I —",
    "My mum always says I talk too much. She's in Spain at the moment, actually. But to answer you —",
    "Funny, I was watching a programme about this the other night, something about the brain. Anyway,",
)
_MINIMISE = (
    "It's probably nothing, but",
    "I'm sure it's not a big deal —",
    "Everyone gets this, but",
    "It's not that bad,",
)
_MINIMISE_RISK = ("I don't want to make a fuss, but", "I wasn't going to mention it, but", "Since you ask directly,")
_GUARDED = ("Well...", "If you must know,", "")
_DENY = (
    "No, no, I'm fine. Really.",
    "Nothing like that — I'm managing.",
    "No. I'm okay.",
    "No, nothing to worry about there.",
)
_REFUSE = (
    "I'd rather not get into that.",
    "I don't really want to talk about that.",
    "Can we talk about something else?",
)
_OFF_TOPIC = (
    "I'm not sure what you mean.",
    "Sorry, I don't follow — what do you want to know?",
    "I don't know how to answer that.",
)


def _lower_first(text: str) -> str:
    if not text or text.startswith(("I ", "I'", "I,")):
        return text
    return text[0].lower() + text[1:]


class RuleBasedSimulator:
    """The default voice: the case's templates, styled by the persona. Deterministic:
    every choice uses a generator seeded with the case id and the turn."""

    def reply(self, case: Case, disclosure: Disclosure, history: list[tuple[str, str]], turn: int) -> str:
        rng = random.Random(f"intake-voice:{case.case_id}:{turn}")
        persona = case.persona
        parts: list[str] = []
        if disclosure.off_topic:
            base = rng.choice(_OFF_TOPIC)
            return f"{rng.choice(_TANGENTS)} {base[0].lower()}{base[1:]}" if persona == "tangential" else base
        for k, item in enumerate(disclosure.revealed):
            text = item.text
            again = disclosure.repeated and item.domain not in disclosure.new
            if again:
                text = "Like I said, " + _lower_first(text)
            elif persona == "minimising" and item.present and item.domain in SYMPTOM_DOMAINS + RISK_DOMAINS:
                phrases = _MINIMISE_RISK if item.domain in RISK_DOMAINS else _MINIMISE
                text = f"{rng.choice(phrases)} {_lower_first(text)}"
            elif persona == "guarded" and item.present:
                prefix = rng.choice(_GUARDED)
                text = f"{prefix} {_lower_first(text)}" if prefix else text
            elif persona == "tangential" and k == 0:
                text = f"{rng.choice(_TANGENTS)} {_lower_first(text)}"
            parts.append(text)
        if disclosure.denied:
            parts.append(rng.choice(_DENY))
        if disclosure.refused:
            parts.append(rng.choice(_REFUSE))
        for item in disclosure.volunteered:
            parts.append(f"And {_lower_first(item.text)}" if parts else item.text)
        if disclosure.unanswered and persona != "tangential":
            parts.append("Sorry — could you ask me one thing at a time?")
        return " ".join(parts)


# ---------------------------------------------------------------- LLM-backed voice

PERSONA_DESCRIPTIONS = {
    "forthcoming": "open and talkative; you answer fully and readily",
    "guarded": "reserved and slow to trust; you give short answers",
    "tangential": "easily side-tracked; you drift onto unrelated topics before answering",
    "minimising": "inclined to play your problems down and say you are fine",
}


_LABELS = {
    "suicidal_ideation": "suicidal thoughts",
    "suicide_plan": "a suicide plan",
    "suicide_intent": "intent to act on suicidal thoughts",
    "suicide_means": "access to means of suicide",
    "harm_others": "thoughts of harming others",
    "command_hallucinations": "voices telling you what to do",
    "withdrawal": "alcohol withdrawal symptoms",
    "substance": "alcohol or drug use",
    "social": "work, relationships and daily life",
    "family": "your family's history",
    "medical": "your physical health",
    "medications": "your medications",
}


def _label(domain: str) -> str:
    return _LABELS.get(domain, domain.replace("_", " "))


def build_messages(case: Case, disclosure: Disclosure, history: list[tuple[str, str]]) -> list[dict]:
    """Chat messages for an LLM voice: the role, the persona, the previous turns, and
    this turn's question with exact instructions on what to disclose."""
    system = (
        "You are role-playing a patient in a simulated psychiatric intake interview, for AI research; it is not "
        "a real clinical encounter. Stay in character and reply in the first person, in one to three sentences. "
        f"You are a {case.age}-year-old {case.gender} ({case.occupation}). Your manner: "
        f"{PERSONA_DESCRIPTIONS[case.persona]}. Say nothing about your health or history beyond the facts you "
        "are told to share in each turn."
    )
    messages = [{"role": "system", "content": system}]
    for q, a in history:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    rules = []
    told = disclosure.revealed + disclosure.volunteered
    if told:
        rules.append("Share these facts, in your own words: " + " | ".join(it.text for it in told))
    if disclosure.denied:
        rules.append(
            "Deny having any problem with " + ", ".join(map(_label, disclosure.denied)) + " (do not reveal the truth)"
        )
    if disclosure.refused:
        rules.append("Politely decline to talk about " + ", ".join(map(_label, disclosure.refused)))
    if disclosure.unanswered:
        rules.append("Ask the clinician to ask one thing at a time")
    if disclosure.off_topic:
        rules.append("The question is unclear or off-topic: say so briefly, without sharing any facts")
    if disclosure.repeated:
        rules.append("The clinician has asked this before: you may say so")
    said = "; ".join(r.rstrip(". ") for r in rules)
    content = f"{disclosure.question}\n\n[Simulator instructions, not said by the clinician: {said}.]"
    messages.append({"role": "user", "content": content})
    return messages


class LLMSimulator:
    """A voice backed by a language model: ``generate(messages) -> str`` is any callable
    (a local model, a client); :func:`build_messages` writes the prompt. The
    disclosure rules stay rule-based, so the reward is unchanged by the voice."""

    def __init__(self, generate: Callable[[list[dict]], str]):
        if not callable(generate):
            raise TypeError(f"LLMSimulator needs a callable generate(messages) -> str, got {type(generate).__name__}")
        self.generate = generate

    def reply(self, case: Case, disclosure: Disclosure, history: list[tuple[str, str]], turn: int) -> str:
        text = self.generate(build_messages(case, disclosure, history))
        if not isinstance(text, str) or not text.strip():
            raise SimulatorError(f"the LLM simulator returned {text!r}, not a non-empty string")
        return text.strip()


class OpenAIChatClient:
    """A ``generate(messages) -> str`` callable for an OpenAI-compatible chat endpoint
    (vLLM, llama.cpp server, SGLang, ...), using only the standard library.

    POSTs ``{"model", "messages", "temperature", "max_tokens", "seed"}`` to
    ``{base_url}/chat/completions`` and returns ``choices[0].message.content``.

    Args:
      base_url: e.g. ``"http://127.0.0.1:8000/v1"`` (http or https).
      model: the model name the server expects.
      api_key: sent as a bearer token if given.
      temperature, max_tokens, seed: sampling settings (temperature 0 and a fixed
        seed for reproducible episodes where the server honours them).
      timeout: seconds per request.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 200,
        seed: int | None = 0,
        timeout: float = 30.0,
    ):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self._api_key = model, api_key
        self.temperature, self.max_tokens, self.seed, self.timeout = temperature, max_tokens, seed, timeout

    def __repr__(self) -> str:  # never the key
        return f"OpenAIChatClient({self.url!r}, model={self.model!r}, api_key={'***' if self._api_key else None})"

    def __call__(self, messages: list[dict]) -> str:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:200].decode(errors="replace")
            raise SimulatorError(f"{self.url} answered HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise SimulatorError(f"cannot reach {self.url}: {getattr(e, 'reason', e)}") from None
        try:
            data = json.loads(raw)
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise SimulatorError(f"{self.url} returned no choices[0].message.content: {raw[:200]!r}") from None
        if not isinstance(content, str):
            raise SimulatorError(f"{self.url} returned non-text content: {content!r}")
        return content


# ---------------------------------------------------------------- fidelity of a voice

#: General question patterns too common in a patient's own words to mean the domain
#: ("I feel safe", "I won't give up", "I lose my temper", "I stopped drinking"); the
#: fidelity check leaves them out.
_REPLY_SKIP = {
    r"\bsafe\b|\bsafety\b",
    r"\bgiv(e|ing) up\b",
    r"\banger\b|\btemper\b",
    r"\b(cut|cutting) (down|back)\b",
    r"\b(stop|stopped|stopping) (drinking|using)",
}
_REPLY_RULES = {
    d: tuple((kind, re.compile(p)) for kind, p in rules if p not in _REPLY_SKIP) for d, rules in RULES.items()
}
#: The first person of a reply, put in the second person of the question patterns.
_PERSON = (
    (re.compile(r"\bmyself\b"), "yourself"),
    (re.compile(r"\bi (was|were)\b"), "you were"),
    (re.compile(r"\bmy\b"), "your"),
    (re.compile(r"\bme\b"), "you"),
    (re.compile(r"\bmine\b"), "yours"),
)
#: Clause boundaries: punctuation and the conjunctions that start a new statement.
_CLAUSE = re.compile(r"[.!?;:,\u2014\u2013()]|\s-\s|\b(?:and|but|though|although|however|yet)\b")
#: Negation and refusal cues ("no one" and "nobody" are not).
_NEGATION = re.compile(
    r"\bno\b(?! ?one\b)|\bnot\b|n't\b|\bcannot\b|\bnever\b|\bnothing\b|\bnone\b|\bnor\b|"
    r"\bwithout\b|\b(dont|cant|wont|havent|hasnt|didnt|doesnt|isnt|wasnt|arent)\b|"
    r"\bsomething else\b"
)
#: Domains whose findings are commonly told as negations ("I can't sleep", "I'm not
#: eating", "nothing feels enjoyable", "I can't focus", "I can't work") or whose
#: affirmative words say nothing ("I sleep fine"): a negation there is no evidence of a
#: denial, so the contradiction check leaves them out (the leak check does not).
NEGATIVELY_TOLD = ("mood", "sleep", "appetite", "attention", "social")
_POLAR = tuple(d for d in DOMAINS if d not in NEGATIVELY_TOLD)


@functools.lru_cache(maxsize=4096)
def _mentions(text: str) -> dict[str, tuple[bool, ...]]:  # cached: a case's texts are checked every turn
    t = normalize(text)
    for pat, sub in _PERSON:
        t = pat.sub(sub, t)
    cuts = [0] + [p for m in _CLAUSE.finditer(t) for p in (m.start(), m.end())] + [len(t)]
    clauses = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    negated = [bool(_NEGATION.search(t[a:b])) for a, b in clauses]
    in_context = bool(_SUICIDE_CONTEXT.search(t))
    out: dict[str, list[bool]] = {}
    for domain, rules in _REPLY_RULES.items():
        for kind, pat in rules:
            if kind == "context" and not in_context:
                continue
            for m in pat.finditer(t):
                k = next(i for i, (a, b) in enumerate(clauses) if m.start() < b or i == len(clauses) - 1)
                out.setdefault(domain, []).append(negated[k])
    return {d: tuple(flags) for d, flags in out.items()}


def check_reply(case: Case, disclosure: Disclosure, reply: str, *, elicited: Any = ()) -> dict:
    """Whether a voice's reply keeps to the disclosure rules: ``{"leaked": [domains],
    "contradicted": [domains]}`` (in ``DOMAINS`` order; empty lists when faithful).

    ``elicited``: the domains elicited so far in the episode (e.g.
    ``PatientState.elicited``; this turn's may be included).

    Heuristics (keywords, not understanding):

    - *Mentions*: the reply, lower-cased and put in the second person ("my" -> "your",
      "me" -> "you", ...), is matched against the question patterns of
      :data:`envs.intake.domains.RULES` (the suicide-context ones only when the reply
      itself speaks of suicide or death, as for questions; a few general patterns too
      common in a patient's words are left out, ``_REPLY_SKIP``). No subsumption. A
      mention is *negated* if its clause (split at punctuation and at "and", "but",
      ...) holds a negation cue ("no", "not", "n't", "never", "nothing", "without",
      "something else", ...; "no one" and "nobody" are not cues).
    - *Known* items: those told this turn (revealed or volunteered) and the items of
      the ``elicited`` domains. A known item's domain, and every domain its own case
      text mentions (the mood text may speak of sleep), may be mentioned freely.
    - **Leak**: a domain mentioned that is not allowed so, unless it was denied or
      refused this turn and every mention of it is negated (the instructed denial,
      "No, I don't drink"). Any other mention counts, negated or not: "I don't hear
      voices", unasked, still tells what the rules withheld.
    - **Contradiction** (only for the domains outside ``NEGATIVELY_TOLD``): (a) the
      reply mentions an absent finding affirmatively, the absent item's own text does
      not (so "I'll have a drink now and then" is not evidence), and no known text
      does; or (b) a present item told this turn whose own text mentions its domain
      affirmatively is not in the reply word for word, and every mention of its
      domain in the reply is negated.

    The rule-based voice is faithful by construction (its replies are the told texts
    and stock phrases with no domain keyword) and gets no flag. Limits: keyword checks
    miss paraphrases ("I've been hearing things no one else hears" is caught, "I get
    messages from the TV", "I don't want to live" are not); they flag a domain named in
    passing ("I came straight from work", "my boss told me to do overtime"); the
    clause-level negation misreads a negation that carries the finding ("no, the
    voices never stop" reads as a denial) and one outside the clause ("I've never,
    ever heard voices" reads as an affirmation). A flag is a prompt to read the
    transcript, not a verdict.
    """
    mentions = _mentions(reply)
    told = list(disclosure.revealed) + list(disclosure.volunteered)
    known = {it.domain: it for it in told}
    for dom in elicited:
        known.setdefault(dom, case.item(dom))
    allowed, affirmed = set(known), set[str]()
    for it in known.values():
        own = _mentions(it.text)
        allowed.update(own)
        affirmed.update(d for d, neg in own.items() if not all(neg))
    instructed = set(disclosure.denied) | set(disclosure.refused)
    leaked = {d for d, neg in mentions.items() if d not in allowed and not (d in instructed and all(neg))}
    contradicted = set()
    for d, neg in mentions.items():
        item = case.item(d)
        if d in _POLAR and not item.present and not all(neg) and d not in affirmed:
            flags = _mentions(item.text).get(d, ())
            if all(flags):  # the absent item's text does not affirm it either
                contradicted.add(d)
    said = normalize(reply)
    for it in told:
        d = it.domain
        if not it.present or d not in _POLAR or d not in mentions or not all(mentions[d]):
            continue
        flags = _mentions(it.text).get(d, ())
        if flags and not all(flags) and normalize(it.text).rstrip(".!? ") not in said:
            contradicted.add(d)
    return {"leaked": [d for d in DOMAINS if d in leaked], "contradicted": [d for d in DOMAINS if d in contradicted]}


def make_simulator(spec: Any) -> Simulator:
    """A simulator from config: ``None`` or ``"rule"`` (rule-based), an object with a
    ``reply`` method, a ``generate(messages) -> str`` callable, or a dict
    ``{"type": "openai", "base_url": ..., "model": ..., "api_key_env": "NAME", ...}`` (an
    :class:`OpenAIChatClient` and its keyword arguments; the API key is read from the
    environment variable ``NAME``, in each env worker, and never appears in a config)."""
    if spec is None or spec == "rule":
        return RuleBasedSimulator()
    if hasattr(spec, "reply"):
        return spec
    if callable(spec):
        return LLMSimulator(spec)
    if isinstance(spec, dict):
        kind = spec.get("type")
        if kind != "openai":
            raise ValueError(f"simulator dict needs type 'openai', got {kind!r}")
        if "api_key" in spec:  # a secret in a config would be written to config.yaml and checkpoints
            raise ValueError(
                "simulator: an API key does not go in the config (it would be written to the run "
                "directory); put it in an environment variable and name the variable in "
                "'api_key_env'"
            )
        kwargs = {k: v for k, v in spec.items() if k not in ("type", "api_key_env")}
        name = spec.get("api_key_env")
        if name is not None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"simulator: api_key_env must name an environment variable, got {name!r}")
            if name not in os.environ:
                raise ValueError(f"simulator: the environment variable {name} (api_key_env) is not set")
            kwargs["api_key"] = os.environ[name]
        try:
            return LLMSimulator(OpenAIChatClient(**kwargs))
        except TypeError as e:  # e.g. a mistyped option; the message names options, never values
            raise ValueError(f"bad simulator config (options {sorted(spec)}): {e}") from None
    raise ValueError(
        f"simulator must be None, 'rule', a callable, an object with reply(), or an "
        f"{{'type': 'openai', ...}} dict; got {spec!r}"
    )
