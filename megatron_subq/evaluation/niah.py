"""Needle in a haystack (RULER's ``niah`` task, offline): sample generation, scoring, heatmaps.

A sample is RULER's base-model prompt: the instruction, a haystack of corpus sentences with one
or more needles "One of the special magic numbers for {key} is: {value}." (keys: adjective-noun
words, values: 7-digit numbers, as RULER's niah_single_2 / niah_multikey_1), then the question
and RULER's answer prefix; the answer is " {value}". The queried needle sits at a sentence
boundary at ``depth`` % of the haystack; other needles (distractors with other keys) at random
boundaries. The prompt is exactly ``length`` tokens in the given tokenizer, and the answer's
tokens are those that follow it when prompt + answer is tokenized as one text. Every sample
depends only on (seed, length, depth, index), so cells can be generated in any order.

Scoring (``score_tokens``): a sample is correct iff greedy decoding from the prompt reproduces
the answer's tokens. That holds iff, in one teacher-forced forward pass over prompt + answer,
the argmax at every answer position equals the next answer token (the greedy chain and the
teacher-forced inputs coincide up to the first mismatch), so one pass per sample is exact.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
import math
import os
import random
import re
from dataclasses import asdict, dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

DEFAULT_CORPUS = os.path.join("..", "shared", "data", "docs-corpus.jsonl.xz")

# RULER's niah templates (synthetic.yaml / the niah task): instruction, needle, question and
# the answer prefix a base model continues
PREFIX = ("Some special magic numbers are hidden within the following text. Make sure to "
          "memorize it. I will quiz you about the numbers afterwards.\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = ("\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
            "The special magic numbers for {key} mentioned in the provided text are")
ANSWER = " {value}"

MIN_HAYSTACK_TOKENS = 32  # below this a "haystack" holds no sentence to hide a needle in
MIN_WORDS, MAX_WORDS = 4, 60  # haystack sentences: no fragments, no run-on code blocks

_ADJECTIVES = (
    "abundant", "adorable", "agreeable", "alive", "ancient", "angry", "bashful", "bitter",
    "bright", "brisk", "calm", "careful", "cheerful", "clever", "clumsy", "curious", "damp",
    "delightful", "eager", "elegant", "faithful", "fancy", "fierce", "gentle", "gifted",
    "glossy", "grumpy", "handsome", "helpful", "hollow", "humble", "icy", "jolly", "kind",
    "lively", "lucky", "massive", "mellow", "modern", "nervous", "nimble", "obedient", "odd",
    "polite", "proud", "quaint", "quiet", "rapid", "rustic", "silly", "smooth", "sparkling",
    "steady", "swift", "tender", "thankful", "tidy", "vivid", "wandering", "witty", "zealous")
_NOUNS = (
    "apple", "badge", "basket", "beacon", "bicycle", "blossom", "bottle", "breeze", "bridge",
    "butter", "cabin", "candle", "canyon", "carpet", "castle", "cherry", "cloud", "comet",
    "copper", "cottage", "crayon", "desert", "dolphin", "engine", "falcon", "feather", "forest",
    "garden", "glacier", "hammer", "harbor", "island", "jacket", "kettle", "lantern", "lemon",
    "meadow", "mirror", "needle", "ocean", "orchard", "pebble", "pepper", "pillow", "planet",
    "pocket", "quilt", "rabbit", "river", "saddle", "scarf", "shadow", "spider", "teapot",
    "thunder", "tiger", "tunnel", "valley", "violin", "wagon", "window", "zebra")

_FILLERS = ("a", "I", "the", "of", "to", "in", "is", "and", "on", "as", "it", "by", "or")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


@dataclass
class NiahSample:
    """One NIAH sample (a jsonl record of ``tools/niah.py generate --format eval``).

    ``prompt`` is exactly ``prompt_tokens`` (= ``length``) tokens; ``answer`` (" {value}") is
    ``answer_tokens`` tokens after it. ``needle_position`` is the token index in the prompt of the
    queried needle's first token; ``needle_positions`` those of all needles, in ``keys`` order
    (the queried one first). ``depth`` is in percent of the haystack (``haystack_tokens`` = the
    tokens between the instruction and the question, needles included)."""

    id: str
    length: int
    depth: float
    index: int
    seed: int
    prompt: str
    answer: str
    prompt_tokens: int
    answer_tokens: int
    haystack_tokens: int
    needle_position: int
    needle_tokens: int
    needle_positions: List[int]
    query_key: str
    query_value: str
    keys: List[str]
    values: List[str]
    tokenizer: str = ""

    def to_record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> "NiahSample":
        names = set(cls.__dataclass_fields__)
        missing = [n for n in ("prompt", "answer", "length", "depth") if n not in record]
        if missing:
            raise ValueError(f"NIAH record {record.get('id', '?')}: missing fields {missing}")
        data = {k: v for k, v in record.items() if k in names}
        defaults = dict(id="", index=0, seed=0, prompt_tokens=record["length"], answer_tokens=0,
                        haystack_tokens=0, needle_position=-1, needle_tokens=0,
                        needle_positions=[], query_key="", query_value="", keys=[], values=[])
        return cls(**{**defaults, **data})


# ------------------------------------------------------------------------------------------------
# settings
# ------------------------------------------------------------------------------------------------
def parse_numbers(text: str, flag: str, doubling: bool = False) -> List[float]:
    """A comma list; ``A,B,...,C`` is the arithmetic progression of step B-A up to C, and with
    ``doubling`` ``A,...,C`` is A, 2A, 4A ... C (as in ``--lengths 4096,...,65536``)."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{flag}: empty (give a comma list, e.g. 0,50,100)")
    try:
        if "..." in parts:
            i = parts.index("...")
            if i != len(parts) - 2 or parts.count("...") != 1:
                raise ValueError
            head = [float(p) for p in parts[:i]]
            end = float(parts[-1])
            if doubling and len(head) == 1:
                out, x = [], head[0]
                if x <= 0:
                    raise ValueError
                while x <= end:
                    out.append(x)
                    x *= 2
            else:
                if len(head) < 2 or head[1] <= head[0]:
                    raise ValueError
                step = head[1] - head[0]
                out = head[:-1] + [head[-1] + k * step
                                   for k in range(int(math.floor((end - head[-1]) / step
                                                                 + 1e-9)) + 1)]
            if not out or abs(out[-1] - end) > 1e-9:
                raise ValueError
            return out
        return [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"{flag}={text!r}: allowed a comma list of numbers, or A,B,...,C (step "
                         f"B-A){' or A,...,C (doubling)' if doubling else ''} ending at C") \
            from None


def _int_or_float(x: float):
    return int(x) if float(x).is_integer() else float(x)


def check_settings(lengths: Sequence[float], depths: Sequence[float], samples_per_cell: int,
                   needles: int) -> Tuple[List[int], List[float]]:
    """Validated (lengths, depths): lengths positive integers, depths within 0-100, at least
    one sample per cell and one needle. Raises ValueError naming the flag."""
    bad = [x for x in lengths if not float(x).is_integer() or x <= 0]
    if bad or not lengths:
        raise ValueError(f"--lengths {bad or lengths}: allowed positive integers (tokens)")
    bad = [x for x in depths if not 0 <= x <= 100]
    if bad or not depths:
        raise ValueError(f"--depths {bad or depths}: allowed numbers from 0 to 100 (percent of "
                         "the haystack)")
    if not isinstance(samples_per_cell, int) or samples_per_cell < 1:
        raise ValueError(f"--samples-per-cell {samples_per_cell}: allowed an integer >= 1")
    if not isinstance(needles, int) or not 1 <= needles <= 16:
        raise ValueError(f"--needles {needles}: allowed an integer from 1 to 16")
    return ([int(x) for x in dict.fromkeys(lengths)],
            [_int_or_float(x) for x in dict.fromkeys(depths)])


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.tokenize(text))


def min_length(tokenizer, needles: int = 1) -> int:
    """The shortest prompt that holds the instruction, question, ``needles`` needles and
    ``MIN_HAYSTACK_TOKENS`` of haystack in this tokenizer."""
    key = "-".join((max(_ADJECTIVES, key=len), max(_NOUNS, key=len)))
    fixed = count_tokens(tokenizer, PREFIX) + count_tokens(tokenizer, QUESTION.format(key=key))
    return fixed + needles * count_tokens(tokenizer, NEEDLE.format(key=key, value="9999999")) \
        + MIN_HAYSTACK_TOKENS


def check_lengths(tokenizer, lengths: Sequence[int], needles: int) -> None:
    """Raises ValueError naming --lengths when one is too short for the needles and question."""
    shortest = min_length(tokenizer, needles)
    short = [n for n in lengths if n < shortest]
    if short:
        raise ValueError(f"--lengths {short}: too short to hold the instruction, question, "
                         f"{needles} needle(s) and a haystack in this tokenizer; allowed: "
                         f"lengths >= {shortest}")


# ------------------------------------------------------------------------------------------------
# the haystack: corpus sentences
# ------------------------------------------------------------------------------------------------
def _open_corpus(path: str):
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    if path.endswith(".xz"):
        return io.TextIOWrapper(lzma.open(path, "rb"), encoding="utf-8", errors="replace")
    if path.endswith(".zst"):
        import zstandard  # noqa: PLC0415

        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def split_sentences(text: str) -> Iterator[str]:
    """Haystack sentences of a document: paragraphs (blank-line separated) with whitespace
    collapsed, split after . ! ? before a capital or digit; kept when they end a sentence, have
    MIN_WORDS..MAX_WORDS words and are mostly letters (markup and code are dropped)."""
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para:
            continue
        for s in _SENTENCE_END.split(para):
            n = len(s.split())
            if not MIN_WORDS <= n <= MAX_WORDS or s[-1] not in ".!?":
                continue
            compact = s.replace(" ", "")
            if sum(c.isalpha() for c in compact) < 0.7 * len(compact):
                continue
            if "magic number" in s.lower():
                continue
            yield s


@dataclass
class SentencePool:
    """Corpus sentences and their token counts (each tokenized alone) in one tokenizer."""

    sentences: List[str]
    tokens: List[int]
    source: str = ""

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)


def load_pool(tokenizer, corpus: str = DEFAULT_CORPUS, min_tokens: int = 65536,
              json_key: str = "text", skip_documents: int = 0) -> SentencePool:
    """Sentences of the jsonl(.gz/.xz/.zst) ``corpus`` (documents under ``json_key``, after the
    first ``skip_documents``), read until they hold ``min_tokens`` tokens or the corpus ends.
    Raises ValueError naming --corpus when it is missing or holds fewer than ``min_tokens``."""
    if not os.path.isfile(corpus):
        raise ValueError(f"--corpus {corpus}: no such file (a jsonl, .jsonl.gz/.xz/.zst file "
                         f"of documents under --json-key {json_key!r})")
    sentences: List[str] = []
    counts: List[int] = []
    total = 0
    with _open_corpus(corpus) as f:
        for number, line in enumerate(f):
            if number < skip_documents or not line.strip():
                continue
            try:
                text = json.loads(line)[json_key]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            if not isinstance(text, str):
                continue
            for s in split_sentences(text):
                n = count_tokens(tokenizer, s)
                sentences.append(s)
                counts.append(n)
                total += n
            if total >= min_tokens:
                break
    if total < min_tokens:
        raise ValueError(f"--corpus {corpus}: its usable sentences hold {total} tokens (after "
                         f"--skip-documents {skip_documents}); at least {min_tokens} are needed "
                         "for the longest of --lengths")
    return SentencePool(sentences, counts, corpus)


def pool_tokens_for(lengths: Sequence[int]) -> int:
    """How many pool tokens to read for haystacks up to max(lengths): 4x, so that samples start
    at varied places of the corpus."""
    return 4 * max(lengths)


# ------------------------------------------------------------------------------------------------
# one sample
# ------------------------------------------------------------------------------------------------
def _keys_values(rng: random.Random, n: int) -> Tuple[List[str], List[str]]:
    keys: List[str] = []
    while len(keys) < n:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in keys:
            keys.append(k)
    values: List[str] = []
    while len(values) < n:
        v = str(rng.randint(1000000, 9999999))
        if v not in values:
            values.append(v)
    return keys, values


def _assemble(lead: List[str], sentences: List[str], needle_at: Dict[int, List[str]],
              query_key: str) -> Tuple[str, Dict[str, int]]:
    """(prompt text, character offset of each needle). Units: [the lead words (maybe none)] +
    sentences, joined by spaces; needles at boundary b go before unit b (b = len(units): the
    end of the haystack)."""
    units = [" ".join(lead)] + sentences
    pieces: List[str] = []
    starts: Dict[str, int] = {}
    pos = len(PREFIX)
    for b in range(len(units) + 1):
        for needle in needle_at.get(b, ()):
            starts[needle] = pos
            pieces.append(needle)
            pos += len(needle) + 1
        if b < len(units) and units[b]:
            pieces.append(units[b])
            pos += len(units[b]) + 1
    text = PREFIX + " ".join(pieces) + QUESTION.format(key=query_key)
    return text, starts


def answer_token_ids(tokenizer, prompt: str, answer: str,
                     prompt_ids: Optional[List[int]] = None) -> Tuple[List[int], List[int]]:
    """(prompt ids, answer ids): the answer's tokens are those that follow the prompt's when
    prompt + answer is tokenized as one text. Raises ValueError when the joint tokenization does
    not start with the prompt's own tokens (the answer would merge into the prompt)."""
    p = list(prompt_ids) if prompt_ids is not None else tokenizer.tokenize(prompt)
    both = tokenizer.tokenize(prompt + answer)
    if both[:len(p)] != p or len(both) <= len(p):
        raise ValueError(f"answer {answer!r}: tokenizing prompt + answer changes the prompt's "
                         "last tokens; the answer's tokens are not defined")
    return p, both[len(p):]


def make_sample(pool: SentencePool, tokenizer, length: int, depth: float, index: int = 0,
                seed: int = 0, needles: int = 1, tokenizer_name: str = "") -> NiahSample:
    """The sample (length, depth, index) of ``seed``: deterministic, independent of other cells.
    Raises ValueError naming --lengths if ``length`` is too short."""
    check_lengths(tokenizer, [length], needles)
    rng = random.Random(f"niah:{seed}:{length}:{_int_or_float(depth)}:{index}")
    n_pool = len(pool.sentences)
    start = rng.randrange(n_pool)
    shrink = 0  # tokens the sentences took beyond their own counts in a failed attempt
    for attempt in range(8):
        keys, values = _keys_values(rng, needles)
        needle_texts = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
        fixed = count_tokens(tokenizer, PREFIX) + count_tokens(tokenizer,
                                                               QUESTION.format(key=keys[0]))
        needle_counts = [count_tokens(tokenizer, t) for t in needle_texts]
        budget = length - fixed - sum(needle_counts) - 4 * attempt - shrink
        sentences, counts, total = [], [], 0
        i = start
        while len(sentences) < n_pool and total + pool.tokens[i % n_pool] <= budget:
            sentences.append(pool.sentences[i % n_pool])
            counts.append(pool.tokens[i % n_pool])
            total += counts[-1]
            i += 1
        # the haystack opens with the last words of the following sentences: they fill, one
        # word at a time, the tokens that whole sentences leave over
        source = " ".join(pool.sentences[(i + k) % n_pool] for k in range(4)).split()
        word_counts = [count_tokens(tokenizer, w) for w in source]
        spare = budget - total
        j = 0
        while j < len(source) and sum(word_counts[len(source) - j - 1:]) <= spare:
            j += 1
        # the queried needle at the boundary nearest depth% of the haystack's content; the
        # other needles (distractors) at random other boundaries
        cum = [0]
        for c in [sum(word_counts[len(source) - j:]) if j else 0] + counts:
            cum.append(cum[-1] + c)
        target = depth / 100.0 * cum[-1]
        b0 = min(range(len(cum)), key=lambda b: (abs(cum[b] - target), b))
        needle_at: Dict[int, List[str]] = {b0: [needle_texts[0]]}
        others = [b for b in range(len(cum)) if b != b0] or [b0]
        for t in needle_texts[1:]:
            needle_at.setdefault(rng.choice(others), []).append(t)
        fitted = _fit_lead(tokenizer, length, source, word_counts, j, sentences, needle_at,
                           keys[0])
        if fitted is None:
            # sentences tokenized together can take more tokens than alone (a byte-level BPE
            # merges across the joining spaces differently): when even no lead words overshoot,
            # the next attempt's budget ends that overshoot below the sentences taken now (a
            # budget cut that stays above them would take the same sentences again: the next
            # sentence can be long)
            bare, _ = _assemble([], sentences, needle_at, keys[0])
            over = count_tokens(tokenizer, bare) - length
            if over > 0:
                shrink += (budget - total) + over
            continue
        text, starts, ids = fitted
        # every needle and value exactly once (a value could occur in the corpus)
        if any(text.count(v) != 1 for v in values) or any(text.count(t) != 1
                                                           for t in needle_texts):
            continue
        break
    else:
        raise RuntimeError(f"NIAH sample length={length} depth={depth} index={index}: could not "
                           "fit the haystack to the exact token count")
    positions = [count_tokens(tokenizer, text[:starts[t]].rstrip(" ")) for t in needle_texts]
    answer = ANSWER.format(value=values[0])
    _, a_ids = answer_token_ids(tokenizer, text, answer, ids)
    return NiahSample(
        id=f"L{length}-d{_int_or_float(depth)}-i{index}", length=length,
        depth=_int_or_float(depth), index=index, seed=seed, prompt=text, answer=answer,
        prompt_tokens=len(ids), answer_tokens=len(a_ids), haystack_tokens=length - fixed,
        needle_position=positions[0], needle_tokens=needle_counts[0], needle_positions=positions,
        query_key=keys[0], query_value=values[0], keys=keys, values=values,
        tokenizer=tokenizer_name)


def _fit_lead(tokenizer, length: int, source: List[str], word_counts: List[int], j: int,
              sentences: List[str], needle_at: Dict[int, List[str]], query_key: str):
    """Change the number ``j`` of lead words (the last j of ``source``) until the whole prompt
    is exactly ``length`` tokens: (text, needle starts, ids), or None when nothing hits it. When
    one more word overshoots, the lead opens with the last characters of that word instead
    (coarse tokenizers: a word of several tokens), or with a short word."""
    diffs: Dict[int, int] = {}
    n = len(source)

    def attempt(lead):
        text, starts = _assemble(lead, sentences, needle_at, query_key)
        ids = tokenizer.tokenize(text)
        return text, starts, ids, length - len(ids)

    for _ in range(64):
        text, starts, ids, diff = attempt(source[n - j:] if j else [])
        if diff == 0:
            return text, starts, ids
        diffs[j] = diff
        if diff > 0 and diffs.get(j + 1, 0) < 0:
            break  # j words are too few, j + 1 too many
        if diff < 0 and diffs.get(j - 1, 0) > 0:
            j -= 1
            break
        # move j by the words whose own token counts make up the difference (at least one)
        step, acc = 0, 0
        if diff > 0:
            while j + step < n and (step == 0 or acc + word_counts[n - j - step - 1] <= diff):
                acc += word_counts[n - j - step - 1]
                step += 1
            j += step
        else:
            while j - step > 0 and (step == 0 or acc + word_counts[n - j + step] <= -diff):
                acc += word_counts[n - j + step]
                step += 1
            j -= step
        if step == 0:
            return None
    else:
        return None
    if j >= n:
        return None
    # j words are a few tokens short: open with a piece that costs exactly that many (the end
    # of the next word, or a short word), tried in a fixed order
    word = source[n - j - 1]
    pieces = [word[-c:] for c in range(1, len(word))] + list(_FILLERS) + sorted(
        set(source), key=lambda w: (len(w), w))
    lead = source[n - j:] if j else []
    for piece in list(dict.fromkeys(pieces))[:48]:
        text, starts, ids, diff = attempt([piece] + lead)
        if diff == 0:
            return text, starts, ids
    return None


# what the worker processes of generate_samples(workers > 1) share, inherited through fork
_SHARED: dict = {}


def _make_shared(cell) -> NiahSample:
    n, d, i = cell
    return make_sample(_SHARED["pool"], _SHARED["tokenizer"], n, d, i, _SHARED["seed"],
                       _SHARED["needles"], _SHARED["name"])


def generate_samples(tokenizer, lengths: Sequence[int], depths: Sequence[float],
                     samples_per_cell: int = 1, needles: int = 1, seed: int = 0,
                     corpus: str = DEFAULT_CORPUS, json_key: str = "text",
                     skip_documents: int = 0, pool: Optional[SentencePool] = None,
                     tokenizer_name: str = "", progress: bool = False,
                     workers: int = 1) -> List[NiahSample]:
    """Samples for every (length, depth) cell, ``samples_per_cell`` each, in length, depth,
    index order. Validates the settings first (ValueError naming the flag); ``pool`` reuses
    sentences already read (else ``load_pool`` on ``corpus``). ``workers`` > 1 makes the samples
    in that many forked processes (the same samples: each depends on its cell only)."""
    lengths, depths = check_settings(lengths, depths, samples_per_cell, needles)
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers {workers}: allowed an integer >= 1")
    check_lengths(tokenizer, lengths, needles)
    if pool is None:
        pool = load_pool(tokenizer, corpus, pool_tokens_for(lengths), json_key, skip_documents)
    cells = [(n, d, i) for n in lengths for d in depths for i in range(samples_per_cell)]
    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=len(cells), desc="niah generate", unit="sample")
    workers = min(workers, len(cells))
    out: List[NiahSample] = []
    if workers == 1:
        for n, d, i in cells:
            out.append(make_sample(pool, tokenizer, n, d, i, seed, needles, tokenizer_name))
            if bar is not None:
                bar.update(1)
    else:
        import multiprocessing  # noqa: PLC0415

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked Rust tokenizers
        _SHARED.update(pool=pool, tokenizer=tokenizer, seed=seed, needles=needles,
                       name=tokenizer_name)
        try:
            with multiprocessing.get_context("fork").Pool(workers) as procs:
                chunk = max(1, min(64, len(cells) // (4 * workers)))
                for sample in procs.imap(_make_shared, cells, chunksize=chunk):
                    out.append(sample)
                    if bar is not None:
                        bar.update(1)
        finally:
            _SHARED.clear()
    if bar is not None:
        bar.close()
    return out


# ------------------------------------------------------------------------------------------------
# scoring
# ------------------------------------------------------------------------------------------------
def score_tokens(model, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                 vocab_size: Optional[int] = None) -> List[Tuple[bool, float]]:
    """(correct, mean answer-token log-prob) per sample, in one teacher-forced forward pass over
    prompt + answer (``full_logits``; every prompt + answer of the batch has the same length).
    Correct iff the argmax over the first ``vocab_size`` logits (the tokenizer's; default all)
    at every answer position is the next answer token: exactly when greedy decoding reproduces
    the answer. Log-probs are normalised over the padded vocabulary, as the training loss is."""
    import torch  # noqa: PLC0415

    from ..inference import full_logits  # noqa: PLC0415

    seqs = [list(p) + list(a) for p, a in zip(prompts, answers)]
    if len({len(s) for s in seqs}) != 1:
        raise ValueError("score_tokens: every prompt + answer of a batch needs the same length")
    tokens = torch.tensor(seqs, dtype=torch.long)
    logits = full_logits(model, tokens)
    out = []
    for b, (p, a) in enumerate(zip(prompts, answers)):
        rows = logits[b, len(p) - 1:len(p) - 1 + len(a)]
        target = torch.tensor(list(a), dtype=torch.long, device=rows.device)
        greedy = rows[:, :vocab_size].argmax(-1) if vocab_size else rows.argmax(-1)
        lp = torch.log_softmax(rows, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        out.append((bool((greedy == target).all()), float(lp.mean())))
    del logits
    return out


def evaluate_samples(model, tokenizer, samples: Sequence[NiahSample],
                     max_batch_tokens: int = 16384, progress: bool = False) -> List[dict]:
    """Per sample {id, length, depth, correct, answer_logprob, tokens}: samples tokenized with
    ``tokenizer``, batched by equal prompt + answer length (as many as fit in
    ``max_batch_tokens``, at least one), scored by ``score_tokens``."""
    encoded = []
    for s in samples:
        p, a = answer_token_ids(tokenizer, s.prompt, s.answer)
        encoded.append((p, a))
    groups: Dict[int, List[int]] = {}
    for k, (p, a) in enumerate(encoded):
        groups.setdefault(len(p) + len(a), []).append(k)
    batches = []
    for total in sorted(groups):
        per = max(1, max_batch_tokens // total)
        members = groups[total]
        batches += [members[i:i + per] for i in range(0, len(members), per)]
    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=len(samples), desc="niah eval", unit="sample")
    results: List[Optional[dict]] = [None] * len(samples)
    vocab = getattr(tokenizer, "vocab_size", None)
    for batch in batches:
        scores = score_tokens(model, [encoded[k][0] for k in batch],
                              [encoded[k][1] for k in batch], vocab)
        for k, (ok, lp) in zip(batch, scores):
            s = samples[k]
            results[k] = dict(id=s.id, length=s.length, depth=s.depth, correct=ok,
                              answer_logprob=lp, prompt_tokens=len(encoded[k][0]),
                              answer_tokens=len(encoded[k][1]),
                              needle_position=s.needle_position)
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    return results  # type: ignore[return-value]


def summarize(results: Sequence[dict]) -> List[dict]:
    """Per (length, depth) cell: accuracy, n and mean answer-token log-prob, sorted."""
    cells: Dict[Tuple[int, float], List[dict]] = {}
    for r in results:
        cells.setdefault((r["length"], r["depth"]), []).append(r)
    return [dict(length=n, depth=d, accuracy=sum(r["correct"] for r in rs) / len(rs), n=len(rs),
                 mean_answer_logprob=sum(r["answer_logprob"] for r in rs) / len(rs))
            for (n, d), rs in sorted(cells.items())]


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------
def _atomic_path(path: str) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")


def write_jsonl(path: str, records: Iterable[dict]) -> None:
    """Write records as jsonl to a temporary name, then rename it to ``path``."""
    tmp = _atomic_path(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_answer_masked(prefix: str, samples: Sequence[NiahSample], tokenizer) -> dict:
    """Training samples as a megatron indexed dataset ``PREFIX_text_document`` (each sample's
    prompt + answer tokens, then EOD) and its loss-mask sidecar ``PREFIX_text_document_lossmask``
    (uint8, 1 on the answer's tokens, 0 on the prompt and the EOD): with the trainer's
    ``--subq-loss-mask-data`` the loss counts the answers only, not the haystack (memorised
    text) or the needles' random values (noise). The tokens are ``tokenizer.tokenize(prompt +
    answer)``, what ``tools/preprocess_data.py`` writes for ``{"text": prompt + answer}``; a
    sample whose tokens are not its ``prompt_tokens`` + ``answer_tokens`` is a ValueError.
    Written under temporary names, renamed when both are complete. Returns counts."""
    import numpy  # noqa: PLC0415
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: PLC0415

    from ..training.loss_mask_data import sidecar_prefix  # noqa: PLC0415

    if not samples:
        raise ValueError("write_answer_masked: no samples")
    base = f"{prefix}_text_document"
    names = {"tokens": base, "mask": sidecar_prefix(base)}
    tmp = {k: (_atomic_path(v + ".bin"), _atomic_path(v + ".idx")) for k, v in names.items()}
    builders = {"tokens": IndexedDatasetBuilder(tmp["tokens"][0],
                                                dtype=DType.optimal_dtype(tokenizer.vocab_size)),
                "mask": IndexedDatasetBuilder(tmp["mask"][0], dtype=numpy.uint8)}
    answer_tokens = tokens = 0
    try:
        for s in samples:
            ids = list(tokenizer.tokenize(s.prompt + s.answer))
            if len(ids) != s.prompt_tokens + s.answer_tokens:
                raise ValueError(f"NIAH sample {s.id}: prompt + answer tokenize to {len(ids)} "
                                 f"tokens, not {s.prompt_tokens} + {s.answer_tokens}")
            ids.append(tokenizer.eod)
            mask = [0] * s.prompt_tokens + [1] * s.answer_tokens + [0]
            builders["tokens"].add_document(numpy.array(ids, dtype=numpy.int64), [len(ids)])
            builders["mask"].add_document(numpy.array(mask, dtype=numpy.uint8), [len(mask)])
            answer_tokens += s.answer_tokens
            tokens += len(ids)
        for k, builder in builders.items():
            builder.finalize(tmp[k][1])
        for k, name in names.items():
            os.replace(tmp[k][0], name + ".bin")
            os.replace(tmp[k][1], name + ".idx")
    finally:
        for paths in tmp.values():
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)
    return {"samples": len(samples), "tokens": tokens, "answer_tokens": answer_tokens,
            "prefix": base, "mask_prefix": names["mask"]}


def write_json(path: str, data: dict) -> None:
    tmp = _atomic_path(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_samples(path: str) -> List[NiahSample]:
    """Samples of a ``--format eval`` jsonl file. Raises ValueError naming --input."""
    if not os.path.isfile(path):
        raise ValueError(f"--input {path}: no such file (a jsonl written by `tools/niah.py "
                         "generate --format eval`)")
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(NiahSample.from_record(json.loads(line)))
            except (json.JSONDecodeError, ValueError, TypeError) as e:
                raise ValueError(f"--input {path}: line {number} is not a NIAH eval record "
                                 f"({e}); `--format train` files hold text only") from None
    if not out:
        raise ValueError(f"--input {path}: no samples")
    return out


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def write_heatmap(result: dict, path: str, figsize: Tuple[float, float] = (8.0, 6.0),
                  dpi: int = 100, title: Optional[str] = None) -> None:
    """A PNG of ``result["cells"]``: x = context length, y = needle depth % (0 at the top),
    colour = accuracy from red (0) to green (1), each cell annotated; ``figsize`` inches at
    ``dpi`` (the image is exactly figsize * dpi pixels). Written to a temporary name, then
    renamed."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    cells = result.get("cells") or []
    if not cells:
        raise ValueError("write_heatmap: the result has no cells")
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for c in cells:
        grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["accuracy"]
    fig, ax = plt.subplots(figsize=figsize, dpi=dpi)
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (%)")
    for y in range(len(depths)):
        for x in range(len(lengths)):
            if not np.isnan(grid[y, x]):
                dark = grid[y, x] < 0.2 or grid[y, x] > 0.85  # the ends of RdYlGn
                ax.text(x, y, f"{grid[y, x]:.2f}", ha="center", va="center", fontsize=9,
                        color="white" if dark else "black")
    fig.colorbar(im, ax=ax, label="accuracy")
    if title is None:
        ckpt = result.get("checkpoint")
        title = "NIAH accuracy" + (f": {os.path.basename(os.path.normpath(ckpt))}"
                                   f" (iteration {result.get('iteration')})" if ckpt else "")
    ax.set_title(title)
    fig.tight_layout()
    tmp = _atomic_path(path) + ".png"
    try:
        fig.savefig(tmp, format="png", dpi=dpi)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
