"""The embedded model's training text: English that ships with Python itself, split into train/held-out.

Two sources, both read from the running interpreter so nothing is downloaded:
- `pydoc_data.topics.topics`: the language reference (what `help("for")` prints), cut into
  paragraph groups so the held-out split samples every topic rather than a few whole topics;
- docstrings of a fixed, sorted list of standard-library modules (module, class, function and method
  docstrings), deduplicated.
The order is deterministic and the held-out split is chosen by a hash of each document's text, so the
same interpreter always yields the same corpus.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import warnings
from dataclasses import dataclass

from strata_ray.model.gguf_writer import SPECIAL_TOKENS
from strata_ray.model.tokenizer import PRE_TOKENIZER_REGEX

# Well-documented, side-effect-free modules (no GUI, no network at import, no easter eggs).
DOC_MODULES: tuple[str, ...] = tuple(sorted((
    "abc", "argparse", "ast", "asyncio.base_events", "asyncio.events", "asyncio.futures", "asyncio.locks",
    "asyncio.queues", "asyncio.streams", "asyncio.subprocess", "asyncio.tasks", "base64", "bdb", "bisect",
    "bz2", "calendar", "cmd", "code", "codecs", "collections", "collections.abc", "colorsys",
    "concurrent.futures._base", "concurrent.futures.process", "concurrent.futures.thread", "configparser",
    "contextlib", "copy", "copyreg", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis",
    "doctest", "email.message", "email.parser", "email.utils", "enum", "filecmp", "fileinput", "fnmatch",
    "fractions", "ftplib", "functools", "getopt", "getpass", "gettext", "glob", "graphlib", "gzip",
    "hashlib", "heapq", "hmac", "html", "html.parser", "http.client", "http.cookiejar", "http.server",
    "imaplib", "importlib", "importlib.abc", "importlib.resources", "inspect", "io", "ipaddress",
    "itertools", "json", "json.decoder", "json.encoder", "keyword", "linecache", "locale", "logging",
    "logging.config", "logging.handlers", "lzma", "mailbox", "math", "mimetypes", "modulefinder",
    "multiprocessing.connection", "multiprocessing.pool", "multiprocessing.queues", "netrc", "numbers",
    "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pickletools", "pkgutil", "platform",
    "plistlib", "poplib", "posixpath", "pprint", "profile", "pstats", "py_compile", "pydoc", "queue",
    "quopri", "random", "re", "reprlib", "rlcompleter", "runpy", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "signal", "site", "smtplib", "socket", "socketserver", "sqlite3",
    "ssl", "stat", "statistics", "string", "struct", "subprocess", "symtable", "sys", "sysconfig",
    "tabnanny", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace",
    "traceback", "tracemalloc", "types", "typing", "unittest.case", "unittest.loader", "unittest.mock",
    "unittest.result", "unittest.runner", "unittest.suite", "urllib.error", "urllib.parse",
    "urllib.request", "urllib.robotparser", "uuid", "warnings", "wave", "weakref", "webbrowser",
    "xml.dom.minidom", "xml.etree.ElementTree", "xml.sax.handler", "zipapp", "zipfile", "zipimport",
    "zlib",
)))

MIN_DOC_CHARS = 60  # shorter docstrings ("Return self.") teach nothing
TOPIC_CHUNK_CHARS = 1500  # paragraph groups of the language reference
HELDOUT_EVERY = 20  # ~5% of documents, chosen by text hash


@dataclass(frozen=True)
class Corpus:
    train: list[str]
    heldout: list[str]


def _is_heldout(text: str) -> bool:
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest()[:8], 16) % HELDOUT_EVERY == 0


def topic_documents() -> list[str]:
    """The language reference cut at blank lines into groups of about TOPIC_CHUNK_CHARS characters."""
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        group = ""
        for para in re.split(r"\n\s*\n", topics[key].strip()):
            if group and len(group) + len(para) > TOPIC_CHUNK_CHARS:
                docs.append(group)
                group = ""
            group = f"{group}\n\n{para}" if group else para
        if group:
            docs.append(group)
    return docs


# Functions that other libraries replace at import time (torch patches inspect.getfile), so whether they are
# present would depend on what was imported first: always left out.
EXCLUDED_MEMBERS = frozenset({"inspect.getfile"})


def _original(module, name: str) -> object:
    """The module's own object for `name`: sys keeps the interpreter's hooks as sys.__excepthook__ etc.,
    which test runners and debuggers replace in the live sys.excepthook."""
    obj = vars(module)[name]
    if name.endswith("hook"):
        obj = vars(module).get(f"__{name}__", obj)
    return obj


def _own_members(module) -> list[object]:
    """Classes and functions defined in `module` (not re-exported), then their methods, sorted by name."""
    out = []
    for name in sorted(vars(module)):
        if f"{module.__name__}.{name}" in EXCLUDED_MEMBERS:
            continue
        obj = _original(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__ or name.startswith("_"):
            continue
        out.append(obj)
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                member = vars(obj)[attr]
                if attr.startswith("_") and attr != "__init__":
                    continue
                if inspect.isfunction(member) or inspect.ismethoddescriptor(member) or isinstance(
                    member, (classmethod, staticmethod, property)
                ):
                    out.append(getattr(member, "__func__", getattr(member, "fget", member)))
    return out


def docstring_documents(modules: tuple[str, ...] = DOC_MODULES) -> list[str]:
    """Docstrings of `modules` in a fixed order, cleaned (inspect.cleandoc) and deduplicated."""
    docs, seen = [], set()
    for name in modules:
        with warnings.catch_warnings():  # deprecated modules and aliases (typing.io) warn when touched
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(name)
            except Exception:  # a module missing from this build of Python is simply skipped
                continue
            raws = [getattr(obj, "__doc__", None) for obj in [module, *_own_members(module)]]
        for raw in raws:
            if not isinstance(raw, str):
                continue
            text = inspect.cleandoc(raw).strip()
            if len(text) < MIN_DOC_CHARS or text in seen:
                continue
            seen.add(text)
            docs.append(text)
    return docs


def build_corpus() -> Corpus:
    """All documents, split into train and held-out by text hash (deterministic)."""
    train, heldout = [], []
    for doc in topic_documents() + docstring_documents():
        (heldout if _is_heldout(doc) else train).append(doc)
    return Corpus(train=train, heldout=heldout)


def words(text: str) -> set[str]:
    """Lower-cased alphabetic words: the 'dictionary' of a text."""
    return set(re.findall(r"[a-z]+", text.lower()))


# --- the byte-level BPE tokenizer learned from the corpus -------------------------------------------

# The qwen2 pre-tokenizer split (llama.cpp `qwen2`, HF Qwen2Tokenizer): the very regex the engine's
# tokenizer rebuilds from the GGUF keys, so training with it makes the two encode identically.
QWEN2_SPLIT = PRE_TOKENIZER_REGEX["qwen2"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_bpe(texts: list[str], vocab_size: int):
    """A `tokenizers.Tokenizer` (byte-level BPE, qwen2 split, NFC) trained on `texts`.

    Specials get ids 0..2 (the trainer puts them first); all 256 byte symbols are in the vocab so any
    text encodes."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def bpe_vocab_lists(tok) -> tuple[list[str], list[bool], list[str]]:
    """(tokens by id, is_special by id, merges as "left right") of a trained tokenizer, for the GGUF."""
    import json

    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, [t in SPECIAL_TOKENS for t in tokens], merges
