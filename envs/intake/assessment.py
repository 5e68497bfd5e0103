"""The structured assessment that ends an intake episode, and its lenient parser.

Format (the documented one; the parser accepts variations, below)::

    <assessment>
    Differential:
    1. Major depressive disorder
    2. Generalised anxiety disorder
    Triage: emergent
    Management:
    - Emergency department evaluation today
    - Safety plan and crisis line number
    - Remove the firearm from the home
    </assessment>

- ``Differential``: a ranked list, most likely first (numbered or bulleted lines, or
  one line separated by commas or semicolons). Items are recognised by name or
  abbreviation (``DIAGNOSIS_RULES``: "MDD", "major depression", "GAD", "panic
  disorder", "PTSD", "bipolar"/"mania", "schizophrenia"/"psychotic disorder",
  "alcohol use disorder"/"AUD", "ADHD"); other items are kept as unrecognised.
- ``Triage``: exactly one of ``routine``, ``urgent``, ``emergent`` ("emergency" and
  "immediate" read as emergent, "non-urgent" and "not urgent" as routine).
- ``Management``: initial management items, one per line or separated by
  semicolons or commas; each is matched to keys by ``MANAGEMENT_RULES`` (for example
  "sertraline" -> ``antidepressant``, "remove firearms" -> ``means_restriction``).

Leniency: the tags are case-insensitive and the closing tag may be missing; without
tags, a reply whose lines include both a ``Differential`` (or ``Diagnosis``/``DDx``)
heading and a ``Triage`` heading is an assessment too. Headings may carry markdown
(``**Triage:**``, ``## Management``) and synonyms (``Risk``/``Urgency``/
``Disposition`` for triage, ``Plan``/``Treatment``/``Recommendations`` for
management). A JSON object with ``differential``, ``triage`` and ``management``
inside the tags is accepted as well.

An assessment with no differential item, no single recognisable triage level or no
management item raises :class:`AssessmentError`, whose message lists every problem;
the env turns it into feedback, never a crash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from envs.intake.cases import CONDITIONS

FORMAT = (
    "<assessment>\nDifferential:\n1. <most likely diagnosis>\n2. <next>\nTriage: routine | urgent | emergent\n"
    "Management:\n- <initial management item>\n- <item>\n</assessment>"
)

#: condition key -> pattern, tried in this order (bipolar before depression).
DIAGNOSIS_RULES: tuple[tuple[str, str], ...] = (
    ("bipolar_mania", r"\bbipolar|\bmania\b|\bmanic\b|\bhypomani"),
    ("psychosis", r"\bpsychos[ie]s|\bpsychotic|\bschizo|\bdelusional disorder"),
    ("ptsd", r"\bptsd\b|\bpost[- ]?traumatic|\btrauma"),
    ("panic", r"\bpanic"),
    ("gad", r"\bgenerali[sz]ed anxiety|\bgad\b|\banxiety disorder\b|\banxiety\b"),
    ("aud", r"\balcohol|\baud\b|\bsubstance use disorder"),
    ("adhd", r"\badhd\b|\battention[- ]deficit"),
    ("mdd", r"\bmajor depress|\bmdd\b|\bdepressi(on|ve)|\bunipolar"),
)

#: management key -> pattern.
MANAGEMENT_RULES: dict[str, str] = {
    "emergency_evaluation": r"\bemergency|\b(ed|a&e|er)\b|\bhospital|\binpatient|\badmi(t|ssion)|"
    r"\bcrisis (team|service)|"
    r"\bconstant observation|\b1:1\b|\bone[- ]to[- ]one observation|\b911\b|\b999\b|"
    r"\bimmediate (psychiatric )?(evaluation|assessment|review)|\bsame[- ]day (psychiatric )?(evaluation|assessment)",
    "safety_plan": r"\bsafety plan|\bcrisis (line|number|plan|card)|\bhotline|\b988\b",
    "means_restriction": r"\bmeans restriction|\brestrict(ing|ion of)? (access|means)|\blethal means|"
    r"\bremov(e|al|ing) (of )?(the |any )?(guns?|firearms?|weapons?|pills|tablets|medications?|means)|"
    r"\bsecur(e|ing) (the |any )?(guns?|firearms?|medications?|pills)|\block (up|away)",
    "duty_to_protect": r"\bduty to (warn|protect)|\bwarn (the )?(potential |intended )?(victim|target|person)|"
    r"\bnotify (the )?(potential |intended )?(victim|police)|\btarasoff|\bpolice",
    "psychotherapy": r"\bpsychotherapy|\btherapy\b|\bcbt\b|\bcognitive[- ]behaviou?ral|\bcounsel+ing|"
    r"\btrauma[- ]focused|"
    r"\bemdr\b|\bexposure\b|\btalking therap|\bbehaviou?ral activation",
    "antidepressant": r"\bssris?\b|\bsnris?\b|\bantidepressants?|\bsertraline|\bescitalopram|\bfluoxetine|"
    r"\bcitalopram|"
    r"\bparoxetine|\bvenlafaxine|\bduloxetine|\bmirtazapine|\bbupropion",
    "mood_stabiliser": r"\bmood stabili[sz]er|\blithium|\bvalpro|\bdivalproex|\blamotrigine|\bcarbamazepine",
    "antipsychotic": r"\bantipsychotics?|\bolanzapine|\brisperidone|\bquetiapine|\baripiprazole|\bhaloperidol|"
    r"\bpaliperidone|\bclozapine",
    "withdrawal_management": r"\bwithdrawal (management|protocol|monitoring|treatment)|"
    r"\bmedically (supervised|managed)|"
    r"\bdetox|\bciwa|\bthiamine|\bchlordiazepoxide|\bbenzodiazepine (taper|protocol|cover)",
    "addiction_treatment": r"\baddiction|\bsubstance (use|misuse) (treatment|services?|program)|\bnaltrexone|"
    r"\bacamprosate|\bdisulfiram|\balcoholics anonymous|\b(aa|smart recovery)\b|"
    r"\bmotivational interview|\balcohol (treatment|services?|team|counsel)|\bbrief intervention",
    "adhd_evaluation": r"\badhd (evaluation|assessment|rating|screen|diagnos)|\brating scales?|\basrs\b|\bconners|"
    r"\bneuropsycholog|\bschool reports",
    "stimulant": r"\bstimulants?\b|\bmethylphenidate|\bamphetamine|\blisdexamfetamine|\bdexamfetamine",
    "medical_workup": r"\blabs?\b|\bblood (tests?|work)|\bbloods\b|\btsh\b|\bthyroid (function|tests?)|\burine drug|"
    r"\btox(icology)? screen|\bdrug screen|\becg\b|\bekg\b|\bmedical (work-?up|evaluation|assessment|review)|"
    r"\bphysical exam|\bimaging|\bmri\b|\bct\b",
    "follow_up": r"\bfollow[- ]?up|\breview in\b|\bsee (you|them|the patient) (again|in)|\breturn (visit|appointment)|"
    r"\bcheck[- ]in|\bappointment in",
}
MANAGEMENT_KEYS = tuple(MANAGEMENT_RULES)

_DIAG = tuple((k, re.compile(p)) for k, p in DIAGNOSIS_RULES)
_MGMT = {k: re.compile(p) for k, p in MANAGEMENT_RULES.items()}
_TRIAGE_WORDS = re.compile(r"non[- ]?urgent|not urgent|semi[- ]urgent|emergen\w*|immediate\w*|urgent\w*|routine\w*")
_HEADINGS = {
    "differential": r"differential(?: diagnos[ie]s)?|diagnos[ie]s|ddx|impression",
    "triage": r"triage(?: level)?|risk(?: level| triage)?|urgency|disposition",
    "management": r"(?:initial )?management(?: plan)?|plan|treatment(?: plan)?|recommendations?|next steps",
}
_HEADING_RE = re.compile(
    r"^\s*(?:[#>*_\-]+\s*)*(?P<name>"
    + "|".join(f"(?P<{k}>{p})" for k, p in _HEADINGS.items())
    + r")\s*(?:[*_]+\s*)?(?::|-|–|—|\n|$)\s*(?:[*_]+)?(?P<rest>.*)$",
    re.IGNORECASE,
)
_BULLET = re.compile(r"^\s*(?:[-*•·]|\(?\d+[.)]|\(?[a-z][.)](?=\s))\s*", re.IGNORECASE)


class AssessmentError(ValueError):
    """An assessment that cannot be scored; the message lists what is wrong."""


@dataclass
class Assessment:
    """A parsed assessment.

    ``differential``: recognised condition keys in rank order (duplicates dropped);
    ``unrecognised``: differential items not matched to a condition; ``triage``: a
    level of ``TRIAGE_LEVELS``; ``management``: recognised management keys;
    ``management_text``: the items as written.
    """

    differential: list[str]
    triage: str
    management: list[str]
    unrecognised: list[str] = field(default_factory=list)
    management_text: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "differential": list(self.differential),
            "triage": self.triage,
            "management": list(self.management),
            "unrecognised": list(self.unrecognised),
        }


def extract(text: str) -> str | None:
    """The assessment body in ``text``, or None if the text is not an assessment."""
    low = text.lower()
    start = low.rfind("<assessment>")
    if start >= 0:
        body = text[start + len("<assessment>") :]
        end = body.lower().find("</assessment>")
        return body[:end] if end >= 0 else body
    heads = {m.group("name").lower() for m in (_HEADING_RE.match(ln) for ln in text.splitlines()) if m}
    kinds = {k for h in heads for k, p in _HEADINGS.items() if re.fullmatch(p, h)}
    if "differential" in kinds and "triage" in kinds:
        return text
    return None


def recognise_condition(item: str) -> str | None:
    """The condition key a differential item names, or None."""
    low = item.lower()
    for key, pat in _DIAG:
        if pat.search(low):
            return key
    return None


def recognise_management(item: str) -> list[str]:
    """The management keys an item names (possibly several, e.g. "SSRI and CBT")."""
    low = item.lower()
    return [k for k, pat in _MGMT.items() if pat.search(low)]


def parse_triage(text: str) -> str:
    """One triage level from free text; raises AssessmentError if none or several."""
    found = []
    for m in _TRIAGE_WORDS.finditer(text.lower()):
        w = m.group(0)
        lvl = (
            "routine"
            if w.startswith(("non", "not", "routine"))
            else "emergent"
            if w.startswith(("emergen", "immediate"))
            else "urgent"
        )
        if lvl not in found:
            found.append(lvl)
    if not found:
        raise AssessmentError(f"the triage level {text.strip()[:40]!r} is not one of routine, urgent, emergent")
    if len(found) > 1:
        raise AssessmentError(f"the triage names several levels ({', '.join(found)}); give exactly one")
    return found[0]


def _split_items(lines: list[str], inline_sep: str) -> list[str]:
    items = []
    for ln in lines:
        ln = _BULLET.sub("", ln).strip().strip("*_").strip()
        if not ln:
            continue
        parts = re.split(inline_sep, ln) if len(lines) == 1 else [ln]
        items += [p.strip().rstrip(".").strip() for p in parts if p.strip().strip(".")]
    return items


def _sections(body: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for ln in body.splitlines():
        m = _HEADING_RE.match(ln)
        if m:
            current = next(k for k in _HEADINGS if m.group(k))
            sections.setdefault(current, [])
            rest = m.group("rest").strip().strip("*_").strip()
            if rest:
                sections[current].append(rest)
        elif current is not None and ln.strip():
            sections[current].append(ln)
    return sections


def _from_json(body: str) -> dict[str, list[str]] | None:
    s = body.strip()
    s = re.sub(r"^```(?:json)?\s*|\s*```$", "", s)
    if not s.startswith("{"):
        return None
    try:
        obj = json.loads(s)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    out = {}
    for key in ("differential", "triage", "management"):
        v = obj.get(key)
        if isinstance(v, str):
            out[key] = [v]
        elif isinstance(v, list):
            out[key] = [str(x) for x in v]
    return out


def parse_assessment(text: str) -> Assessment:
    """Parse an assessment (see the module docstring); raises :class:`AssessmentError`
    listing every problem."""
    body = extract(text)
    if body is None:
        raise AssessmentError("no assessment found; wrap it in <assessment></assessment>")
    js = _from_json(body)
    sections = js if js is not None else _sections(body)
    problems = []
    diff_items = (
        list(sections.get("differential", []))
        if js is not None
        else _split_items(sections.get("differential", []), r"[;,]")
    )
    if not diff_items:
        problems.append("the differential is missing or empty; list diagnoses under 'Differential:', most likely first")
    triage = ""
    if not sections.get("triage"):
        problems.append("the triage level is missing; write 'Triage: routine', 'Triage: urgent' or 'Triage: emergent'")
    else:
        try:
            triage = parse_triage(" ".join(sections["triage"]))
        except AssessmentError as e:
            problems.append(str(e))
    mgmt_items = (
        list(sections.get("management", []))
        if js is not None
        else _split_items(sections.get("management", []), r"[;,]")
    )
    if not mgmt_items:
        problems.append("the management is missing or empty; list initial management items under 'Management:'")
    if problems:
        raise AssessmentError("; ".join(problems))
    differential, unrecognised = [], []
    for item in diff_items:
        key = recognise_condition(item)
        if key is None:
            unrecognised.append(item)
        elif key not in differential:
            differential.append(key)
    management = list(dict.fromkeys(k for item in mgmt_items for k in recognise_management(item)))
    return Assessment(differential, triage, management, unrecognised, mgmt_items)


def render(differential, triage: str, management) -> str:
    """An assessment in the documented format from condition keys (or names), a
    triage level and management item texts."""
    names = [CONDITIONS[d].name if d in CONDITIONS else str(d) for d in differential]
    lines = ["<assessment>", "Differential:"] + [f"{i}. {n}" for i, n in enumerate(names, 1)]
    lines += [f"Triage: {triage}", "Management:"] + [f"- {m}" for m in management] + ["</assessment>"]
    return "\n".join(lines)


#: A phrase per management key, recognised by ``MANAGEMENT_RULES`` (used by the policies).
MANAGEMENT_PHRASES = {
    "emergency_evaluation": "Same-day emergency psychiatric evaluation in the emergency department",
    "safety_plan": "Collaborative safety plan with crisis line numbers",
    "means_restriction": "Lethal means safety: remove firearms and lock away medications",
    "duty_to_protect": "Duty to protect: warn the intended victim as required",
    "psychotherapy": "Refer for psychotherapy (CBT or trauma-focused therapy)",
    "antidepressant": "Start an SSRI (e.g. sertraline)",
    "mood_stabiliser": "Start a mood stabiliser (e.g. lithium)",
    "antipsychotic": "Start an antipsychotic (e.g. aripiprazole)",
    "withdrawal_management": "Medically supervised withdrawal with CIWA monitoring and thiamine",
    "addiction_treatment": "Refer to addiction services; consider naltrexone",
    "adhd_evaluation": "Formal ADHD assessment with rating scales and collateral history",
    "stimulant": "Consider a stimulant (methylphenidate)",
    "medical_workup": "Medical work-up: bloods, TSH, urine drug screen, ECG",
    "follow_up": "Follow-up appointment in one to two weeks",
}
