"""Corpus, tokenizer, split and batching of run_clm (xla_fsdp/train/data.py)."""
import argparse

import pytest
import torch

from xla_fsdp.train import data


def _args(**kw):
    base = dict(tokenizer_name=None, cache_dir=None, dataset_name=None, dataset_config_name=None,
                train_file=None, max_train_samples=None, block_size=64)
    base.update(kw)
    return argparse.Namespace(**base)


def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # café, naïve, 日本語"
    ids = tok.encode(text)
    assert max(ids) < 256 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id]) == text   # EOS is not text
    assert tok.vocab_size == 257 and tok.eos_token_id == 256


def test_embedded_corpus_is_real_text_of_useful_size():
    docs = data.embedded_documents()
    assert len(docs) >= 50
    total = sum(len(d.encode("utf-8")) for d in docs)
    assert total > 300_000
    joined = "\n".join(docs)
    assert "lambda" in joined and "The " in joined
    assert docs == data.embedded_documents()   # fixed order


def test_stream_ends_every_document_with_eos():
    tok = data.ByteTokenizer()
    stream = data.tokenize_stream(["ab", "c"], tok)
    assert stream.tolist() == [97, 98, 256, 99, 256]


def test_split_is_deterministic_contiguous_and_sized():
    stream = torch.arange(1000)
    train, held = data.split_stream(stream, 0.05)
    assert train.numel() == 950 and held.numel() == 50
    assert torch.equal(torch.cat([train, held]), stream)
    train2, held2 = data.split_stream(stream, 0.05)
    assert torch.equal(train, train2) and torch.equal(held, held2)


def test_blocks_drop_the_ragged_tail():
    blocks = data.to_blocks(torch.arange(10), 3)
    assert blocks.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="--block_size"):
        data.to_blocks(torch.arange(2), 3)


def test_batches_same_seed_same_order_new_epoch_new_order():
    blocks = torch.arange(40).view(20, 2)
    a = [b.tolist() for b in data.BlockBatches(blocks, 4, seed=1).epoch(0)]
    b = [b.tolist() for b in data.BlockBatches(blocks, 4, seed=1).epoch(0)]
    c = [b.tolist() for b in data.BlockBatches(blocks, 4, seed=1).epoch(1)]
    assert a == b and a != c
    assert len(a) == len(data.BlockBatches(blocks, 4)) == 5
    seen = sorted(row[0] for batch in a for row in batch)
    assert seen == list(range(0, 40, 2))   # one epoch visits every block once


def test_ranks_split_each_global_batch_without_overlap():
    blocks = torch.arange(48).view(24, 2)
    whole = list(data.BlockBatches(blocks, 8, seed=3).epoch(0))
    parts = [list(data.BlockBatches(blocks, 8, rank=r, world=4, seed=3).epoch(0)) for r in range(4)]
    for i, batch in enumerate(whole):
        assert all(p[i].shape == (2, 2) for p in parts)
        assert torch.equal(torch.cat([p[i] for p in parts]), batch)


def test_batches_refuse_too_little_text():
    with pytest.raises(SystemExit, match="per_device_train_batch_size"):
        data.BlockBatches(torch.zeros(3, 4, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="divisible"):
        data.BlockBatches(torch.zeros(30, 4, dtype=torch.long), 6, world=4)


def test_build_corpus_embedded_default():
    corpus = data.build_corpus(_args(), config_vocab_size=512)
    assert corpus.train.shape[1] == 64 and corpus.eval.shape[1] == 64
    assert corpus.train.shape[0] > 10 * corpus.eval.shape[0] > 0
    assert int(corpus.train.max()) <= 256 and "pydoc_data" in corpus.source
    capped = data.build_corpus(_args(max_train_samples=7), config_vocab_size=512)
    assert capped.train.shape[0] == 7 and torch.equal(capped.train, corpus.train[:7])


def test_build_corpus_refuses_small_config_vocab():
    with pytest.raises(SystemExit, match="vocab_size"):
        data.build_corpus(_args(), config_vocab_size=200)


def test_build_corpus_from_train_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(("one paragraph of text.\n\nanother one here.\n\n" * 40), encoding="utf-8")
    corpus = data.build_corpus(_args(train_file=str(path), block_size=16), config_vocab_size=257)
    assert corpus.train.shape[0] > 0 and str(path) in corpus.source
    text = data.ByteTokenizer().decode(corpus.train[0].tolist())
    assert text.startswith("one paragraph")


def test_dataset_name_without_datasets_says_how_to_fix():
    try:
        import datasets  # noqa: F401
        pytest.skip("`datasets` is installed here")
    except ImportError:
        pass
    with pytest.raises(SystemExit, match="pip install datasets"):
        data.build_corpus(_args(dataset_name="wikitext"), config_vocab_size=50257)
