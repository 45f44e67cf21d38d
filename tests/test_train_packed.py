"""``python -m dilax.train --pack`` (issue 28): documents, the packer, and a packed run that
stops and resumes."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from dilax import train as T
from dilax.data.make_corpus import documents
from dilax.train.packing import (
    pack_documents,
    packed_batch,
    read_documents,
    split_documents,
    split_text,
)


def test_split_text_on_separator_lines():
    text = "a\nb\n<|endoftext|>\nc <|endoftext|>\n<|endoftext|>\r\n \n<|endoftext|>\nd"
    # only a line that is exactly the separator splits; whitespace-only documents dropped
    assert split_text(text) == ["a\nb\n", "c <|endoftext|>\n", "d"]
    assert split_text("x\n---\ny\n", "---") == ["x\n", "y\n"]
    with pytest.raises(ValueError, match="doc_separator"):
        split_text("x", "a\nb")


def test_read_documents_of_a_directory(tmp_path):
    for name, body in (("b.txt", "second\n"), ("a.txt", "first\n"), (".hidden", "no"),
                       ("c.txt", " \n")):
        (tmp_path / name).write_text(body)
    assert read_documents(str(tmp_path)) == ["first\n", "second\n"]  # by name; no blanks
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="--data .*: no documents"):
        read_documents(str(empty))


def test_read_documents_warns_about_a_single_document(tmp_path):
    """Issue 39: --pack on a file without a separator line trained on "1 documents" silently;
    it now warns, naming the separator to use. Two documents do not warn."""
    one = tmp_path / "one.txt"
    one.write_text("just one text\nwith two lines\n")
    with pytest.warns(UserWarning, match=r"--pack found 1 document \(no line that is exactly "):
        assert read_documents(str(one)) == ["just one text\nwith two lines\n"]
    two = tmp_path / "two.txt"
    two.write_text("first\n<|endoftext|>\nsecond\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_documents(str(two), "<|endoftext|>")) == 2


def test_pack_documents_next_fit_and_splitting():
    docs = [np.arange(1, 4), np.arange(10, 14), np.arange(20, 30), np.arange(40, 42),
            np.arange(50, 51)]  # lengths 3, 4, 10, 2, 1 into rows of 6
    rows = pack_documents(docs, 6)
    # 3 | 4 (does not fit the rest 3) | 10 cut into 6 + 4 | 4 + 2 | 1 (no room left)
    np.testing.assert_array_equal(rows.tokens, [
        [1, 2, 3, 0, 0, 0], [10, 11, 12, 13, 0, 0], [20, 21, 22, 23, 24, 25],
        [26, 27, 28, 29, 40, 41], [50, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(rows.segment_ids, [  # padding: an id of its own
        [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1], [0] * 6, [0, 0, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(rows.lengths, [3, 4, 6, 6, 1])
    # batches: pure functions of (seed, step); y is the next token of the row
    x, y, ids, lengths = packed_batch(rows, 0, 5, 3)
    x2, *_ = packed_batch(rows, 0, 5, 3)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    assert ids.shape == x.shape and lengths.shape == (3,)
    # the held-out split cuts the concatenation at 90%, inside a document if need be
    train, held = split_documents([np.arange(5), np.arange(5, 10)])
    assert [t.tolist() for t in train] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert [t.tolist() for t in held] == [[9]]


MODEL = ["--d-model", "16", "--num-heads", "2", "--num-layers", "1", "--dim-feedforward", "32",
         "--segment-lengths", "8,16", "--dilation-rates", "1,2"]
RUN = ["--pack", "--doc-separator", "===", "--batch-size", "2", "--seq-len", "32",
       "--warmup", "1", "--eval-every", "0", "--checkpoint-every", "100", "--sample-tokens", "0",
       "--no-progress"]


def test_packed_run_stops_and_resumes(tmp_path, capsys):
    """A ``--pack`` run on a separator-split file, stopped after step 1 and resumed with only
    ``--resume --checkpoint-dir`` (``--pack`` and the separator come from the checkpoint; the
    batches are pure functions of (seed, step), tested above, so the resume is exact)."""
    data = tmp_path / "docs.txt"
    data.write_text("\n===\n".join(documents(count=4)), encoding="ascii")
    with pytest.raises(ValueError, match="--doc-separator"):
        T.configs_from_argv(["--data", str(data), "--pack", "--doc-separator", ""])
    ckpt = str(tmp_path / "ckpt")
    assert T.main(["--data", str(data), *MODEL, *RUN, "--steps", "2", "--checkpoint-dir", ckpt,
                   "--stop-after", "1"]) == 0
    assert "packed 4 documents into" in capsys.readouterr().out
    tcfg, _ = T.configs_from_argv(["--resume", "--checkpoint-dir", ckpt])
    assert tcfg.pack and tcfg.doc_separator == "==="
    assert T.main(["--resume", "--checkpoint-dir", ckpt]) == 0
    out = capsys.readouterr().out
    assert "packed 4 documents into" in out and "(step 1)" in out
    assert T.load_model(ckpt).step == 2


def test_benchmark_packed_documents_cover_n_with_a_fixed_draw():
    from benchmarks.rows import packed_document_lengths, packed_segment_ids

    for n in (100, 16384):
        lengths = packed_document_lengths(n)
        assert lengths.sum() == n and (lengths[:-1] >= 256).all() and (lengths <= 8192).all()
        np.testing.assert_array_equal(lengths, packed_document_lengths(n))  # drawn once
    ids = np.asarray(packed_segment_ids(2, 16384))
    assert ids.shape == (2, 16384) and (ids[0] == ids[1]).all()
    assert np.count_nonzero(np.diff(ids[0])) == len(packed_document_lengths(16384)) - 1
