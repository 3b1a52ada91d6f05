"""Training text, tokenizers and fixed-length block batching for run_clm.

The embedded default corpus is Python's own reference documentation (`pydoc_data.topics`, ~460 KB of English prose and
code shipped with every CPython), tokenized to bytes, so the job trains on real text on any machine with no download.
Hugging Face datasets/tokenizers are used only when the user names them, and are optional dependencies."""
from __future__ import annotations

from dataclasses import dataclass

import torch

EVAL_FRACTION = 0.05  # tail of the token stream held out for --do_eval


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus an end-of-text id 256."""

    eos_token_id = 256
    vocab_size = 257

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def embedded_documents() -> list[str]:
    """The stdlib reference-documentation topics, in a fixed (sorted) order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distro builds split the stdlib docs out
        raise SystemExit("the embedded corpus needs the stdlib module pydoc_data, missing from this "
                         "Python build; pass --train_file with any plain-text file instead") from None
    return [topics[key] for key in sorted(topics)]


def read_text_file(path: str) -> list[str]:
    """A plain-text file, local or at a URL (gs://bucket/corpus.txt, through fsspec); blank-line-separated paragraphs
    become documents."""
    from xla_fsdp.checkpoint import storage

    try:
        text = storage.storage_for(path).read_bytes(path).decode("utf-8")
    except (ImportError, ValueError, FileNotFoundError) as e:
        raise ValueError(f"--train_file {path}: {e}") from None
    docs = [p for p in text.split("\n\n") if p.strip()]
    if not docs:
        raise ValueError(f"--train_file {path} has no text; give a non-empty UTF-8 file")
    return docs


def hf_dataset_documents(name: str, config_name: str | None, cache_dir: str | None) -> tuple[list[str], list[str] | None]:
    """Train (and validation, if the dataset has one) texts of a HF dataset."""
    try:
        import datasets
    except ImportError:
        raise SystemExit("--dataset_name needs the `datasets` package: pip install datasets; "
                         "or omit it to train on the embedded corpus (or use --train_file)") from None
    try:
        ds = datasets.load_dataset(name, config_name, cache_dir=cache_dir)
    except Exception as e:  # no network, an unknown name or config: datasets' own words, on one line
        said = " ".join(str(e).split())
        raise SystemExit(f"--dataset_name {name}" + (f" --dataset_config_name {config_name}" if config_name else "")
                         + f": could not be loaded ({type(e).__name__}: {said}); check the name and that the "
                         "Hugging Face hub is reachable (or its files are in --cache_dir), or use --train_file")
    column = "text" if "text" in ds["train"].column_names else ds["train"].column_names[0]
    held_out = next((split for split in ("validation", "test") if split in ds), None)
    train = [t for t in ds["train"][column] if t.strip()]
    return train, ([t for t in ds[held_out][column] if t.strip()] if held_out else None)


def load_tokenizer(name: str | None, cache_dir: str | None):
    """`ByteTokenizer` by default, or a `transformers.AutoTokenizer` by name."""
    if name is None:
        return ByteTokenizer()
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(name, cache_dir=cache_dir)
    except Exception as e:  # no network, unknown name, missing files
        said = " ".join(str(e).split())  # one line
        raise SystemExit(f"--tokenizer_name {name!r} could not be loaded ({type(e).__name__}: {said}); check "
                         "that the Hugging Face hub is reachable, or give a local tokenizer directory, or omit it "
                         "to use the byte tokenizer") from None


def tokenize_stream(docs: list[str], tokenizer) -> torch.Tensor:
    """All documents as one id stream, each followed by the EOS id."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc, add_special_tokens=False))
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def to_blocks(stream: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cut the stream into [num_blocks, block_size] rows, dropping the ragged tail (as HF's run_clm `group_texts`
    does)."""
    n = stream.numel() // block_size
    if n == 0:
        raise ValueError(f"only {stream.numel()} tokens, fewer than one block of --block_size "
                         f"{block_size}; use a smaller --block_size or more text")
    return stream[: n * block_size].view(n, block_size)


def split_stream(stream: torch.Tensor, eval_fraction: float = EVAL_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic train/eval split: the last `eval_fraction` of the stream is eval.

    A contiguous tail (not a random sample of blocks) keeps eval text out of every training block, so eval loss measures
    generalization."""
    cut = int(stream.numel() * (1.0 - eval_fraction))
    return stream[:cut], stream[cut:]


@dataclass
class Corpus:
    """Train and eval blocks plus what the report needs to describe them."""
    train: torch.Tensor
    eval: torch.Tensor
    vocab_size: int
    source: str


def build_corpus(args, config_vocab_size: int) -> Corpus:
    """Load, tokenize, split and block the text the flags select."""
    tokenizer = load_tokenizer(args.tokenizer_name, args.cache_dir)
    vocab = len(tokenizer) if not isinstance(tokenizer, ByteTokenizer) else tokenizer.vocab_size
    if vocab > config_vocab_size:
        raise SystemExit(f"tokenizer has {vocab} ids but --config_name has vocab_size "
                         f"{config_vocab_size}; raise vocab_size in the model config to at least {vocab}")
    val_docs = None
    if args.dataset_name:
        docs, val_docs = hf_dataset_documents(args.dataset_name, args.dataset_config_name, args.cache_dir)
        source = f"dataset {args.dataset_name}" + (f"/{args.dataset_config_name}" if args.dataset_config_name else "")
    elif args.train_file:
        docs, source = read_text_file(args.train_file), f"file {args.train_file}"
    else:
        docs, source = embedded_documents(), "embedded corpus: pydoc_data.topics (Python reference docs)"
    stream = tokenize_stream(docs, tokenizer)
    held_out = None if val_docs is None else tokenize_stream(val_docs, tokenizer)
    train_stream, eval_stream = split_stream(stream) if held_out is None else (stream, held_out)
    train = to_blocks(train_stream, args.block_size)
    if args.max_train_samples is not None:  # HF semantics: a cap on training blocks
        train = train[: args.max_train_samples]
    return Corpus(train, to_blocks(eval_stream, args.block_size), vocab, source)


class BlockBatches:
    """Batches of blocks for one rank: a seeded shuffle per epoch, shared by all ranks, each rank taking its own
    contiguous slice of every global batch.

    Under the SPMD runtimes on several hosts, `rows` (`xla_fsdp.data.HostBatches.rows`) selects the rows this host reads
    of each global batch instead ([Note: per-host batches] in xla_fsdp/data/per_host.py). An explicit generator (not
    torch's global RNG) keeps the order identical across ranks even when ranks are threads of one process (XLA:CPU)."""

    def __init__(self, blocks: torch.Tensor, global_batch: int, rank: int = 0,
                 world: int = 1, seed: int = 0, shuffle: bool = True, rows=None):
        if rows is not None:
            rows = torch.as_tensor(rows, dtype=torch.long)
            if world != 1 or rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= global_batch:
                raise ValueError(f"rows must be positions 0..{global_batch - 1} of each global batch, "
                                 f"read by one process per host (world 1, not {world})")
        self.rows = rows
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by {world} ranks")
        if blocks.shape[0] < global_batch:
            raise SystemExit(f"only {blocks.shape[0]} blocks of text but one global batch needs "
                             f"{global_batch}; lower --per_device_{'train' if shuffle else 'eval'}"
                             f"_batch_size or --block_size, or give more text")
        self.blocks, self.global_batch = blocks, global_batch
        self.rank, self.world, self.seed, self.shuffle = rank, world, seed, shuffle

    def __len__(self) -> int:
        """Full global batches per epoch (the ragged last batch is dropped)."""
        return self.blocks.shape[0] // self.global_batch

    def epoch(self, epoch: int):
        """Yield this rank's [global_batch / world, block_size] batches for `epoch` (with `rows`: [len(rows),
        block_size], those rows of each global batch)."""
        n = self.blocks.shape[0]
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)) \
            if self.shuffle else torch.arange(n)
        local = self.global_batch // self.world
        for b in range(len(self)):
            if self.rows is not None:
                yield self.blocks[order[b * self.global_batch + self.rows]]
                continue
            rows = order[b * self.global_batch + self.rank * local: b * self.global_batch + (self.rank + 1) * local]
            yield self.blocks[rows]
