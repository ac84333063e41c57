"""A training prompts file from text people wrote, under public licences, for ``finetune --prompts FILE``.

    python -m experiments.real_prompts --out /work/runs/real_prompts.jsonl

Each source is read where it lies and never copied into the repository; the file is JSONL in Spec-Bench's form
(``question_id``, ``category``, ``turns``) plus, on every line, ``source`` (what the text is, and where from),
``license`` and ``origin`` (the file and line, or path). Categories follow Spec-Bench's where they fit:

* **math_reasoning**: GSM8K's train questions (MIT; Spec-Bench's math_reasoning is GSM8K's test split), from the
  ``openai/grade-school-math`` git mirror;
* **qa**: Natural Questions open-domain questions (CC BY-SA 3.0; NQ-open dev and EfficientQA dev and test),
  written as Spec-Bench writes its qa (capitalised, a question mark);
* **instruction**: self-instruct's human-written seed tasks and user-oriented instructions (Apache 2.0), each with
  an instance input where it has one; they stand in for MT-bench's eight categories;
* **translation**: "Translate German to English: ..." on German sentences of 8-40 words from Debian's
  ``manpages-de`` (GPL-3+; ``apt-get install manpages-de``), rendered with ``groff``;
* **summarization**: "Summarize: ..." on 300-900 words of documentation a Python or Debian install ships (Python's
  help topics, PSF-2.0; ``/usr/share/doc/<package>/`` READMEs, NEWS, FAQs and ``.txt``/``.md``/``.rst`` files of
  packages whose machine-readable copyright file names their licence, recorded per prompt;
  ``/usr/share/common-licenses``, whose texts permit verbatim copies), prose paragraphs only, each paragraph once;
* **rag**: documentation paragraphs no summary holds, 350-600 words, then an NQ question no qa prompt asks, as
  Spec-Bench's rag puts a short question after a long retrieved passage; these passages do not answer it;
* **code**: the openings of standard-library modules (PSF-2.0), as continuation prompts.

Every candidate that meets a Spec-Bench question of either half (a shared 12-word window, a shorter question whole,
or a piece of 6-11 words of one: ``skipkey.quality.overlap``) or one of the project's own test prompts is dropped
and counted, and so is a repeat; each source is shuffled with ``--seed``, so the file is a function of the sources
and the options. The file written is then checked as ``finetune --prompts`` checks it (Spec-Bench's test half).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import subprocess
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path

from skipkey.quality.overlap import HeldOut, joined, words
from skipkey.quality.prompt_file import SPEC_BENCH_BESIDE_REPO, read_prompts
from skipkey.quality.splits import test_prompts
from skipkey.training.prompt_source import check_prompt_file
from skipkey.training.recipe import FinetuneConfig

COUNTS = {"math_reasoning": 800, "qa": 800, "instruction": 500, "translation": 600, "summarization": 120,
          "rag": 200, "code": 150}  # a few thousand prompts; every category well represented
ARTICLE_WORDS = (300, 900)  # Spec-Bench's CNN/DailyMail articles are about 530 words
RAG_WORDS = (350, 600)  # its rag passages about 500, before the question
SENTENCE_WORDS = (8, 40)
DOC_FILES = re.compile(r"(README|NEWS|FAQ|[^.]+\.(txt|md|rst)(\.gz)?$)(?!.*Debian)")  # not Debian's own notes
ARTICLES_PER_DOCUMENT = 3  # so no long document (a licence, a big help topic) dominates
GERMAN = set("der die das und ist nicht mit werden wird ein eine einen von für den dem zu auf sie es im sich bei oder "
             "wenn kann des auch als wie durch nach aus über".split())
ENGLISH = set("the and is of to with this that for are be by from which".split())


@dataclass(frozen=True)
class Candidate:
    """One prompt before it is checked: its text, category, what it is and where from, and its licence."""

    text: str
    category: str
    source: str
    license: str
    origin: str


def git_lines(repo: Path, path: str) -> list[str]:
    return subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout.splitlines()


def jsonl_rows(repo: Path, path: str) -> list[tuple[int, dict]]:
    return [(number, json.loads(line)) for number, line in enumerate(git_lines(repo, path), 1) if line.strip()]


def gsm8k(mirrors: Path) -> list[Candidate]:
    path = "grade_school_math/data/train.jsonl"
    return [Candidate(row["question"].strip(), "math_reasoning",
                      "GSM8K train questions (github.com/openai/grade-school-math)", "MIT", f"{path}:{number}")
            for number, row in jsonl_rows(mirrors / "openai+grade-school-math" / "repo", path)]


NQ_FILES = ("nq_open/NQ-open.dev.jsonl", "nq_open/NQ-open.efficientqa.dev.1.1.jsonl",
            "nq_open/NQ-open.efficientqa.test.1.1.jsonl")


def nq_questions(mirrors: Path) -> list[Candidate]:
    """NQ-open questions as Spec-Bench writes them: the first letter capitalised, a question mark at the end."""
    out = []
    for path in NQ_FILES:
        for number, row in jsonl_rows(mirrors / "google-research-datasets+natural-questions" / "repo", path):
            question = row["question"].strip().rstrip("?").strip()
            out.append(Candidate(question[:1].upper() + question[1:] + "?", "qa",
                                 "Natural Questions, NQ-open questions (github.com/google-research-datasets/"
                                 "natural-questions)", "CC-BY-SA-3.0", f"{path}:{number}"))
    return out


def self_instruct(mirrors: Path) -> list[Candidate]:
    """Each human-written task's instruction, with each of its instance inputs where it has some."""
    out = []
    for path in ("data/seed_tasks.jsonl", "human_eval/user_oriented_instructions.jsonl"):
        for number, row in jsonl_rows(mirrors / "yizhongw+self-instruct" / "repo", path):
            inputs = [i["input"].strip() for i in row.get("instances", []) if i.get("input", "").strip()] or [""]
            for given in inputs:
                text = row["instruction"].strip() + (f"\n\n{given}" if given else "")
                out.append(Candidate(text, "instruction", "self-instruct human-written instructions "
                                     "(github.com/yizhongw/self-instruct)", "Apache-2.0", f"{path}:{number}"))
    return out


def man_pages(man_dir: Path, package: str) -> list[Path]:
    """The German man pages under ``man_dir``: those ``package`` installed, or every page where it is ''."""
    pages = sorted(man_dir.rglob("*.gz"))
    if package:
        owned = set(subprocess.run(["dpkg", "-L", package], check=True, capture_output=True,
                                   text=True).stdout.splitlines())
        pages = [p for p in pages if str(p) in owned]
    return pages


def german_sentences(rendered: str) -> list[str]:
    """Whole German sentences of 8-40 words from a rendered man page (option lists and English left out)."""
    out = []
    for block in re.split(r"\n\s*\n", rendered):
        text = " ".join(" ".join(line.split()) for line in block.splitlines() if line[:1].isspace())  # no headings
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-ZÄÖÜ])", text):
            w = words(sentence)
            if not (SENTENCE_WORDS[0] <= len(sentence.split()) <= SENTENCE_WORDS[1]) or sentence[-1] not in ".!?":
                continue
            if not sentence[0].isupper() or re.search(r"[=/|<>{}\[\]_$\\]|--|\.\.\.|…", sentence):
                continue
            if len(GERMAN.intersection(w)) >= 2 and len(ENGLISH.intersection(w)) < 2:
                out.append(sentence)
    return out


def translations(man_dir: Path, package: str) -> list[Candidate]:
    out = []
    for page in man_pages(man_dir, package):
        rendered = subprocess.run(["groff", "-k", "-Tutf8", "-mandoc", "-rHY=0", "-rLL=1000n", "-P-cbou"],
                                  input=gzip.decompress(page.read_bytes()), capture_output=True).stdout
        for sentence in german_sentences(rendered.decode("utf-8", "replace")):
            out.append(Candidate(f"Translate German to English: {sentence}", "translation",
                                 f"German sentences of Debian's {package or 'German'} man pages",
                                 "GPL-3+" if package == "manpages-de" else "unstated", str(page)))
    return out


@dataclass(frozen=True)
class Document:
    """A document's prose paragraphs, what it is and its licence."""

    paragraphs: tuple[str, ...]
    source: str
    license: str
    origin: str


def prose_paragraphs(text: str) -> list[str]:
    """The paragraphs of running prose: no code or grammar (indented), headings, lists of options or tables;
    markdown's emphasis, code spans and links reduced to their words."""
    text = re.sub(r"```.*?```", "\n\n", text, flags=re.S)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[*`]{1,3}([^*`\n]+)[*`]{1,3}", r"\1", text)
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or lines[0][:1].isspace() or any(re.match(r"\s*([#=|>*+•·-]|o\s|\d+\))", l) for l in lines):
            continue
        tokens = block.split()
        prose = sum(bool(re.fullmatch(r"[\"'“‘(]*[A-Za-z][A-Za-z'’-]*[\"'”’),.;:!?]*", t)) for t in tokens)
        names = sum(t[:1].isupper() for t in tokens)  # lists of names, languages, credits
        if len(tokens) >= 15 and prose >= 0.85 * len(tokens) and names <= 0.4 * len(tokens):
            out.append(" ".join(tokens))
    return out


def debian_license(package_doc: Path) -> str | None:
    """The licence a machine-readable Debian copyright file gives its upstream files (``Files: *``), or None."""
    try:
        text = (package_doc / "copyright").read_text(errors="replace")
    except OSError:
        return None
    if not text.startswith("Format:"):
        return None
    for stanza in re.split(r"\n\s*\n", text):
        if re.search(r"^Files:\s*\*\s*$", stanza, flags=re.M):
            found = re.search(r"^License:[ \t]*(\S.*)$", stanza, flags=re.M)
            return found.group(1).strip() if found else None
    return None


def documents(doc_dir: Path | None, licenses_dir: Path | None, pydoc_topics: bool) -> list[Document]:
    docs = []
    if pydoc_topics:
        from pydoc_data.topics import topics

        docs += [Document(tuple(prose_paragraphs(text)), "Python's help topics (pydoc_data.topics)", "PSF-2.0",
                          f"pydoc_data.topics[{name!r}]") for name, text in sorted(topics.items())]
    for package in sorted(doc_dir.iterdir()) if doc_dir else []:
        license = debian_license(package)
        if license is None:
            continue
        for path in sorted(p for p in package.iterdir() if DOC_FILES.match(p.name)):
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            docs.append(Document(tuple(prose_paragraphs(raw.decode("utf-8", "replace"))),
                                 "Debian package documentation (/usr/share/doc)", license, str(path)))
    for path in sorted({p.resolve() for p in licenses_dir.iterdir()} if licenses_dir else []):
        if path.is_file():
            docs.append(Document(tuple(prose_paragraphs(path.read_text(errors="replace"))),
                                 "licence texts (/usr/share/common-licenses)", "verbatim copying permitted",
                                 str(path)))
    seen: set[str] = set()  # a paragraph once: packages repeat each other's READMEs, NEWS repeat warnings
    for index, document in enumerate(docs):
        docs[index] = replace(document, paragraphs=tuple(p for p in document.paragraphs
                                                         if p not in seen and not seen.add(p)))
    return [d for d in docs if d.paragraphs]


def articles(document: Document) -> list[tuple[str, ...]]:
    """Runs of a document's consecutive paragraphs of 300-900 words, at most ``ARTICLES_PER_DOCUMENT``."""
    out, run = [], []
    for paragraph in document.paragraphs:
        if sum(len(p.split()) for p in run) + len(paragraph.split()) > ARTICLE_WORDS[1]:
            if sum(len(p.split()) for p in run) >= ARTICLE_WORDS[0]:
                out.append(tuple(run))
            run = []
        if len(paragraph.split()) <= ARTICLE_WORDS[1]:
            run.append(paragraph)
    if sum(len(p.split()) for p in run) >= ARTICLE_WORDS[0]:
        out.append(tuple(run))
    return out[:ARTICLES_PER_DOCUMENT]


def stdlib_openings(stdlib: Path) -> list[Candidate]:
    """The first 40 lines of each standard-library module (tests, IDLE and vendored code left out)."""
    out = []
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if re.search(r"test|idlelib|site-packages|lib2to3|__", str(path.relative_to(stdlib))):
            continue
        lines = path.read_text(errors="replace").splitlines()[:40]
        if sum(bool(line.strip()) for line in lines) >= 15:
            out.append(Candidate("\n".join(lines) + "\n", "code", "Python standard-library module openings",
                                 "PSF-2.0", f"Lib/{path.relative_to(stdlib)}"))
    return out


class Screen:
    """Drops a candidate that meets a held-out prompt (Spec-Bench's either half, the project's own test prompts) or
    repeats one kept before, counting why per category."""

    def __init__(self, spec_bench: Path):
        questions = read_prompts(spec_bench)
        self.held_out = {"Spec-Bench's test half": HeldOut((r.id, r.text) for r in questions.select("test")),
                         "Spec-Bench's validation half": HeldOut((r.id, r.text) for r in questions.select("validation")),
                         "the project's test prompts": HeldOut((str(i), p) for i, p in enumerate(test_prompts()))}
        self.seen: set[str] = set()
        self.dropped: dict[str, dict[str, int]] = {}
        self.examples: list[str] = []

    def keep(self, candidate: Candidate) -> bool:
        key = joined(candidate.text)
        reason = "repeats an earlier prompt" if key in self.seen else self.meets(candidate)
        if reason:
            counts = self.dropped.setdefault(candidate.category, {})
            counts[reason] = counts.get(reason, 0) + 1
            return False
        self.seen.add(key)
        return True

    def meets(self, candidate: Candidate) -> str | None:
        """``meets <what>`` for the first held-out set the candidate meets (an example kept), or None."""
        for name, held_out in self.held_out.items():
            hit = held_out.find(candidate.text)
            if hit:
                self.examples.append(f"{candidate.origin} {hit.describe()} of {name}")
                return f"meets {name}"
        return None

    def pool(self, candidates: list[Candidate], seed: int, category: str) -> list[Candidate]:
        """The candidates that pass, shuffled by the seed and the category (so one count never moves another)."""
        kept = [c for c in candidates if self.keep(c)]
        random.Random(f"{seed}:{category}").shuffle(kept)
        return kept


def summaries(docs: list[Document], screen: Screen, count: int, seed: int) -> tuple[list[Candidate], list[Document]]:
    """``count`` "Summarize:" prompts from the shuffled documents, and the documents with the paragraphs none of
    them holds (for the rag prompts)."""
    order = list(docs)
    random.Random(f"{seed}:documents").shuffle(order)
    out, rest = [], []
    for document in order:
        used = set()
        for run in articles(document):
            candidate = Candidate("Summarize: " + " ".join(run), "summarization", document.source, document.license,
                                  document.origin)
            if screen.keep(candidate) and len(out) < count:
                out.append(candidate)
                used.update(run)
        rest.append(replace(document, paragraphs=tuple(p for p in document.paragraphs if p not in used)))
    return out, rest


def rag_prompts(docs: list[Document], questions: list[Candidate], screen: Screen, count: int) -> list[Candidate]:
    """Paragraphs of ``docs`` in turn, 350-600 words at a time, each run followed by the next question."""
    paragraphs = [(p, d) for d in docs for p in d.paragraphs if len(p.split()) <= RAG_WORDS[1]]
    out, run = [], []
    for paragraph, document in paragraphs:
        if len(out) >= count or not questions:
            break
        if sum(len(p.split()) for p, _ in run) + len(paragraph.split()) > RAG_WORDS[1]:
            run = []
        run.append((paragraph, document))
        if sum(len(p.split()) for p, _ in run) < RAG_WORDS[0]:
            continue
        question = questions.pop(0)
        licences = "; ".join(sorted({d.license for _, d in run}))
        candidate = Candidate(" ".join(p for p, _ in run) + "\n" + question.text, "rag",
                              "RAG-like: documentation paragraphs (Python help topics, Debian docs, licence texts), "
                              "then an NQ-open question they do not answer", f"passages: {licences}; question: "
                              f"{question.license}", " + ".join([*dict.fromkeys(d.origin for _, d in run),
                                                                  question.origin]))
        if screen.keep(candidate):
            out.append(candidate)
        run = []
    return out


def build(args) -> tuple[list[Candidate], Screen, dict]:
    """Every category's prompts, screened, and per category how many were asked, held by the sources (articles for
    summarization; rag prompts are composed), dropped and why, and written."""
    screen, counts = Screen(Path(args.spec_bench)), {c: getattr(args, c) for c in COUNTS}
    pools = {"math_reasoning": gsm8k(args.mirrors), "qa": nq_questions(args.mirrors),
             "instruction": self_instruct(args.mirrors),
             "translation": translations(args.man_dir, args.man_package) if counts["translation"] else [],
             "code": stdlib_openings(args.stdlib) if counts["code"] else []}
    held = {category: len(pool) for category, pool in pools.items()}
    clean = {category: screen.pool(pool, args.seed, category) for category, pool in pools.items()}
    chosen = {category: clean[category][:counts[category]] for category in clean}
    docs = documents(args.doc_dir, args.licenses_dir, args.pydoc_topics)
    chosen["summarization"], rest = summaries(docs, screen, counts["summarization"], args.seed)
    unasked = clean["qa"][counts["qa"]:]  # the rag questions: never one the qa prompts ask
    chosen["rag"] = rag_prompts(rest, unasked, screen, counts["rag"])
    held["summarization"] = sum(len(articles(d)) for d in docs)
    order = ["math_reasoning", "qa", "instruction", "translation", "summarization", "rag", "code"]
    summary = {c: {"asked": counts[c], "in sources": held.get(c), "dropped": screen.dropped.get(c, {}),
                   "written": len(chosen[c])} for c in order}
    return [c for category in order for c in chosen[category]], screen, summary


def write(path: Path, prompts: list[Candidate]) -> str:
    """The JSONL file (written whole, then renamed into place); returns its SHA-256."""
    lines = [json.dumps({"question_id": number, "category": c.category, "turns": [c.text], "source": c.source,
                         "license": c.license, "origin": c.origin}, ensure_ascii=False)
             for number, c in enumerate(prompts, 1)]
    data = ("\n".join(lines) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_bytes(data)
    path.with_suffix(".tmp").replace(path)
    return hashlib.sha256(data).hexdigest()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="the prompts file to write (outside the repository)")
    p.add_argument("--seed", type=int, default=0, help="shuffles each source before its prompts are taken")
    for category, count in COUNTS.items():
        p.add_argument("--" + re.sub(r"[\W_]+", "-", category), dest=category, type=int, default=count,
                       help=f"{category} prompts (default {count})")
    p.add_argument("--spec-bench", default=str(SPEC_BENCH_BESIDE_REPO), help="Spec-Bench's question.jsonl")
    p.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"),
                   help="where the git mirrors of GSM8K, Natural Questions and self-instruct are (OWNER+NAME/repo)")
    p.add_argument("--man-dir", type=Path, default=Path("/usr/share/man/de"))
    p.add_argument("--man-package", default="manpages-de", help="only its pages (dpkg -L); '' for every page")
    p.add_argument("--doc-dir", type=Path, default=Path("/usr/share/doc"))
    p.add_argument("--licenses-dir", type=Path, default=Path("/usr/share/common-licenses"))
    p.add_argument("--no-pydoc-topics", dest="pydoc_topics", action="store_false")
    p.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    p.add_argument("--report", type=Path, help="also write the counts as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    prompts, screen, summary = build(args)
    sha256 = write(args.out, prompts)
    # The file as finetune --prompts reads and checks it: any prompt meeting Spec-Bench's test half is refused.
    check = check_prompt_file(FinetuneConfig(prompts=str(args.out), spec_bench=args.spec_bench, sequences=1,
                                             batch_size=1), log=lambda msg: None)
    report = {"out": str(args.out), "sha256": sha256, "prompts": len(prompts), "seed": args.seed,
              "categories": summary, "dropped_examples": screen.examples[:20], "check": check}
    for category, row in summary.items():
        print(f"{category:15} {row['written']:5} written of {row['asked']} asked; in sources {row['in sources']}, "
              f"dropped {row['dropped'] or 'none'}")
    print(f"{len(prompts)} prompts in {args.out}, SHA-256 {sha256}; checked against {check['against']}")
    if args.report:
        args.report.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return report


if __name__ == "__main__":
    main()
