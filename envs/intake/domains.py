"""Interview domains, and the keyword rules that map a clinician's question to them.

Research simulation, not a clinical tool: these rules decide which part of a
simulated case a question is about; they are not a validated interview instrument.

Domains (``DOMAINS``), DSM-style:

- symptom domains: ``mood``, ``anxiety``, ``panic``, ``trauma``, ``mania``,
  ``psychosis``, ``substance``, ``attention``, ``sleep``, ``appetite``;
- risk domains (``RISK_DOMAINS``): ``suicidal_ideation``, ``suicide_plan``,
  ``suicide_intent``, ``suicide_means``, ``harm_others``, ``command_hallucinations``,
  ``withdrawal``;
- history domains: ``medical``, ``medications``, ``family`` (family psychiatric
  history), ``social`` (social and occupational functioning).

Mapping rules (:func:`map_question`), applied to the lower-cased question:

1. Every domain has regular expressions (``RULES``); a question is about each domain
   one of whose patterns it matches, in the order of the first match in the text.
2. Each pattern is ``direct`` or ``general``. For the risk domains the difference
   matters: "have you had thoughts of suicide?" is direct, "are you keeping safe?"
   is general; a patient who minimises, or who conceals a risk, denies it unless the
   question is direct (see :mod:`envs.intake.simulator`). For the other domains all
   patterns are direct.
3. Context: ``suicide_plan``, ``suicide_intent`` and most ``suicide_means`` patterns
   ("do you have a plan?", "do you intend to act on it?", "do you have access to
   ...?") count only when the question itself speaks of suicide or death, or the
   previous question was about a suicide domain.
4. Subsumption: a question about ``family`` history is only about family history
   ("does anyone in your family drink?" is not about the patient's drinking);
   ``withdrawal`` subsumes ``substance``; ``suicide_plan``/``suicide_intent``/
   ``suicide_means`` subsume ``suicidal_ideation``; ``command_hallucinations``
   subsumes ``psychosis``, ``suicidal_ideation`` and ``harm_others``.

Empathy markers (:func:`is_empathic`): phrases such as "I'm sorry", "that sounds
hard", "thank you for sharing", "it makes sense", "take your time"
(``EMPATHY_PATTERNS``). A question with at least one counts as empathic.
"""

from __future__ import annotations

import re

SYMPTOM_DOMAINS = (
    "mood",
    "anxiety",
    "panic",
    "trauma",
    "mania",
    "psychosis",
    "substance",
    "attention",
    "sleep",
    "appetite",
)
RISK_DOMAINS = (
    "suicidal_ideation",
    "suicide_plan",
    "suicide_intent",
    "suicide_means",
    "harm_others",
    "command_hallucinations",
    "withdrawal",
)
HISTORY_DOMAINS = ("medical", "medications", "family", "social")
DOMAINS = SYMPTOM_DOMAINS + RISK_DOMAINS + HISTORY_DOMAINS
SUICIDE_DOMAINS = ("suicidal_ideation", "suicide_plan", "suicide_intent", "suicide_means")
#: Domains a guarded patient discusses only after the clinician has shown empathy.
SENSITIVE_DOMAINS = RISK_DOMAINS + ("substance", "trauma", "psychosis")

D, G, C = "direct", "general", "context"  # C: direct, but only in a suicide context

RULES: dict[str, tuple[tuple[str, str], ...]] = {
    "mood": (
        (D, r"\bmood"),
        (D, r"\bdepress"),
        (D, r"\bsad(ness)?\b"),
        (D, r"\b(feel|feeling|felt) (down|low|blue|empty|flat)"),
        (D, r"\bhopeless"),
        (D, r"\blost interest|\binterest in\b|\benjoy"),
        (D, r"\bcry(ing)?\b|\btearful"),
    ),
    "anxiety": (
        (D, r"\banxi"),
        (D, r"\bworr(y|ied|ies|ying)"),
        (D, r"\bnervous"),
        (D, r"\bon edge\b"),
        (D, r"\btense\b"),
    ),
    "panic": (
        (D, r"\bpanic"),
        (D, r"\bheart (racing|pounding|pounds|races)"),
        (D, r"\b(sudden|intense) (episodes? of |surges? of |rushes of )?(fear|terror|dread)"),
        (D, r"\bcan'?t breathe\b|\bshort(ness)? of breath"),
    ),
    "trauma": (
        (D, r"\btrauma"),
        (D, r"\bflashbacks?"),
        (D, r"\bnightmares?"),
        (D, r"\b(assault|assaulted|abuse|abused|combat)\b"),
        (D, r"\bsomething (terrible|frightening|horrible|awful|bad) (happen|has happen)"),
        (D, r"\b(frightening|terrible|horrible|upsetting) (event|experience)"),
        (D, r"\baccident\b"),
    ),
    "mania": (
        (D, r"\bmania\b|\bmanic\b|\bhypomani"),
        (D, r"\beuphori"),
        (D, r"\bunusually (high|happy|energetic|elevated|good|up)\b"),
        (D, r"\bracing thoughts|\bthoughts (were |are )?racing"),
        (D, r"\b(full of|boundless|lots of|extra) energy"),
        (D, r"\bspending (spree|sprees|a lot)|\bimpulsiv"),
        (D, r"\b(need|needing|needed) (much |a lot )?less sleep"),
    ),
    "psychosis": (
        (D, r"\bhear(ing)? (voices|things)"),
        (D, r"\bvoices?\b"),
        (D, r"\bsee(ing)? things"),
        (D, r"\bhallucinat"),
        (D, r"\bparanoi"),
        (D, r"\b(watch|watching|watched|follow|following|followed|spy|spying|spied) (on )?you\b"),
        (D, r"\bplotting against|\bout to get you|\bagainst you\b"),
        (D, r"\bunusual (experiences|beliefs|thoughts)"),
        (D, r"\bpsycho(sis|tic)"),
    ),
    "substance": (
        (D, r"\balcohol"),
        (D, r"\bdrink(s|ing)?\b|\bdrank\b"),
        (D, r"\bbeer|\bwine\b|\bliquor|\bspirits\b"),
        (D, r"\bdrugs?\b"),
        (D, r"\bsubstances?\b"),
        (D, r"\bcannabis|\bmarijuana|\bweed\b|\bcocaine|\bopioids?\b|\bheroin|\bmeth\b"),
        (D, r"\baddict"),
        (D, r"\brecreational"),
    ),
    "attention": (
        (D, r"\battention\b"),
        (D, r"\bconcentrat"),
        (D, r"\bfocus"),
        (D, r"\bdistract"),
        (D, r"\badhd\b"),
        (D, r"\bforgetful|\bdisorgani[sz]|\blos(e|ing) things"),
        (D, r"\bfidget"),
    ),
    "sleep": (
        (D, r"\b(sleep|sleeping|slept)\b"),
        (D, r"\binsomnia"),
        (D, r"\b(fall|falling|stay|staying) asleep"),
        (D, r"\bwak(e|ing) (up )?(early|at night|in the night)"),
    ),
    "appetite": ((D, r"\bappetite"), (D, r"\beat(ing)?\b"), (D, r"\bweight\b"), (D, r"\bhung(ry|er)")),
    "suicidal_ideation": (
        (D, r"\bsuicid"),
        (D, r"\bkill(ing)? (yourself|your ?self)"),
        (D, r"\bend(ing)? (your (own )?life|it all)"),
        (D, r"\btak(e|ing) your (own )?life"),
        (D, r"\bbetter off dead|\bwant(ed|ing)? to die\b|\bwish(ed|ing)? (you were|to be) dead"),
        (D, r"\bnot (want|wanting|wanted) to (live|be alive|be here|wake up)"),
        (D, r"\bnot worth living"),
        (G, r"\b(hurt|hurting|harm|harming) (yourself|your ?self)"),
        (G, r"\bself[- ]harm"),
        (G, r"\bsafe\b|\bsafety\b"),
        (G, r"\bdark thoughts"),
        (G, r"\bgiv(e|ing) up\b"),
        (G, r"\bthoughts? (of|about) death|\bthink(ing)? about death"),
    ),
    "suicide_plan": (
        (C, r"\bplans?\b|\bplanned|\bplanning"),
        (C, r"\bhow (you would|you'd|you might|would you|might you)"),
        (C, r"\bmethod"),
        (C, r"\bthought about how"),
    ),
    "suicide_intent": (
        (C, r"\bintend|\bintent(ion)?s?\b"),
        (C, r"\bact on\b"),
        (C, r"\bgo(ing)? through with|\bfollow through"),
        (C, r"\bgoing to (do it|do something|act)"),
        (C, r"\bhow likely"),
        (C, r"\bprepar(e|ed|ations?)\b|\bsuicide note|\bgoodbye"),
    ),
    "suicide_means": (
        (D, r"\b(guns?|firearms?|rifles?|shotguns?|weapons?)\b"),
        (D, r"\bstockpil|\bsav(ed|ing) up\b|\bhoard"),
        (D, r"\blethal\b"),
        (C, r"\bmeans\b"),
        (C, r"\baccess to\b"),
        (C, r"\b(pills|tablets|medications?|rope) (at home|in the house|saved|stored)"),
    ),
    "harm_others": (
        (
            D,
            r"\b(hurt|hurting|harm|harming|kill|killing|attack|attacking) (someone|anyone|somebody|anybody|others|"
            r"other people|another person|people)\b",
        ),
        (D, r"\bthoughts? (of|about) (hurting|harming|killing) (others|someone|anyone|other people)"),
        (G, r"\bviolen"),
        (G, r"\bangry at (someone|anyone|people)|\brevenge|\bget back at"),
        (G, r"\banger\b|\btemper\b"),
    ),
    "command_hallucinations": (
        (D, r"\bvoices?\b.{0,40}\b(tell|telling|told|command|commanding|order|ordering|instruct)"),
        (D, r"\bcommand hallucinat"),
        (D, r"\b(tell|telling|told|order|ordering|command|commanding)s? you to (do|hurt|harm|kill|act)"),
    ),
    "withdrawal": (
        (D, r"\bwithdraw"),
        (D, r"\bshak(es|y|ing)\b|\btremors?\b"),
        (D, r"\bseizures?\b|\bfits\b"),
        (D, r"\bdts\b|\bdelirium tremens"),
        (D, r"\bmorning drink|\beye[- ]opener"),
        (D, r"\bsweats?\b|\bsweaty\b"),
        (G, r"\b(cut|cutting) (down|back)\b"),
        (G, r"\b(stop|stopped|stopping) (drinking|using)"),
    ),
    "medical": (
        (D, r"\bmedical\b"),
        (D, r"\bphysical (health|illness|problems?|conditions?)"),
        (D, r"\bhealth (problems?|conditions?|issues?)"),
        (D, r"\billness(es)?\b"),
        (D, r"\b(thyroid|diabetes|epilepsy|head injur|heart (condition|disease|problems?)|blood pressure|asthma)"),
    ),
    "medications": (
        (D, r"\bmedications?\b|\bmedicines?\b"),
        (D, r"\bprescri"),
        (D, r"\bsupplements?\b"),
        (D, r"\btak(e|ing) anything (for|regularly)"),
    ),
    "family": (
        (D, r"\bfamily (history|members?)"),
        (D, r"\b(anyone|anybody|someone|history) in (your|the) family"),
        (D, r"\bruns? in (the|your) family"),
        (D, r"\b(blood )?relatives?\b"),
        (
            D,
            r"\b(parents?|mother|father|mum|mom|dad|siblings?|brothers?|sisters?)\b.{0,40}"
            r"\b(history|diagnos|suffer|struggle|problems?|illness)",
        ),
    ),
    "social": (
        (D, r"\bwork\b|\bjob\b|\bemploy|\bcareer"),
        (D, r"\bschool\b|\bstudies\b|\bstudying\b|\bcollege\b|\buniversity\b"),
        (D, r"\brelationships?\b|\bpartner\b|\bmarri|\bfriends?\b"),
        (D, r"\bliv(e|ing) (with|situation|arrangement|alone)|\bhome life"),
        (D, r"\bsupport\b"),
        (D, r"\bday[- ]to[- ]day|\bdaily (life|activities)|\bfunctioning|\bcop(e|ing)\b"),
        (D, r"\bfinanc|\bmoney\b"),
    ),
}

_COMPILED = {d: tuple((kind, re.compile(p)) for kind, p in rules) for d, rules in RULES.items()}
_SUICIDE_CONTEXT = re.compile(
    r"\bsuicid|\bkill(ing)? (yourself|your ?self)|\b(die|dying|death|dead|overdose)\b|"
    r"\bend(ing)? (your|it all)|\byour (own )?life\b|\bthese thoughts|\bthose thoughts"
)

SUBSUMES: dict[str, tuple[str, ...]] = {
    "family": tuple(d for d in DOMAINS if d != "family"),
    "withdrawal": ("substance",),
    "suicide_plan": ("suicidal_ideation",),
    "suicide_intent": ("suicidal_ideation",),
    "suicide_means": ("suicidal_ideation",),
    "command_hallucinations": ("psychosis", "suicidal_ideation", "harm_others"),
}

EMPATHY_PATTERNS = (
    r"\b(i'?m|i am) (so |really |very |truly )?sorry",
    r"\bthat (sounds|must be|must have been|seems) (really |very |so |incredibly )?"
    r"(hard|difficult|tough|painful|frightening|scary|overwhelming|exhausting|distressing|upsetting|a lot|lonely)",
    r"\bthank you for (sharing|telling|being|trusting|coming|opening)|\bthanks for (sharing|telling)",
    r"\bi (can )?(understand|imagine|see) (that|how|why)",
    r"\bit makes sense|\bthat'?s (completely |very )?understandable",
    r"\byou'?re not alone|\btake your time|\bi appreciate (you|your)|\bit takes (courage|a lot)",
    r"\bi'?m glad you",
)
_EMPATHY = re.compile("|".join(EMPATHY_PATTERNS))


def normalize(text: str) -> str:
    """Lower case, straight apostrophes, single spaces: the text the rules see."""
    text = text.replace("\u2019", "'").replace("\u2018", "'").lower()
    return " ".join(text.split())


def map_question(question: str, previous: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """The domains a question is about, as ``[(domain, "direct" | "general"), ...]`` in
    the order they are first mentioned; see the module docstring for the rules.

    ``previous``: the domains of the previous question (for the suicide context).
    """
    text = normalize(question)
    in_context = bool(_SUICIDE_CONTEXT.search(text)) or any(d in SUICIDE_DOMAINS for d in previous)
    hits: dict[str, tuple[int, str]] = {}
    for domain, rules in _COMPILED.items():
        for kind, pat in rules:
            if kind == C and not in_context:
                continue
            m = pat.search(text)
            if m is None:
                continue
            spec = G if kind == G else D
            pos, old = hits.get(domain, (m.start(), spec))
            # Direct wins over general; the first position is kept for ordering.
            hits[domain] = (min(pos, m.start()), D if D in (spec, old) else G)
    for domain in [d for d in hits if d in SUBSUMES]:
        for other in SUBSUMES[domain]:
            hits.pop(other, None)
    return [(d, spec) for d, (pos, spec) in sorted(hits.items(), key=lambda kv: (kv[1][0], DOMAINS.index(kv[0])))]


def is_empathic(question: str) -> bool:
    """Whether the question holds an empathy marker (``EMPATHY_PATTERNS``)."""
    return bool(_EMPATHY.search(normalize(question)))
