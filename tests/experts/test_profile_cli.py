import numpy as np
import pytest

from strata_ray.experts.profile import check_shape, rank_from_counts, read_profile
from strata_ray.experts.profile_cli import profile_main, profile_text

CORPUS = "The quick brown fox jumps over the lazy dog. " * 20 + "def f(x):\n    return x * 2\n" * 10


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_missing_corpus(tmp_path, capsys):
    rc = profile_main(["--corpus", str(tmp_path / "absent.txt"), "-o", str(tmp_path / "p.strp")])
    assert rc == 2
    assert "corpus" in one_line_error(capsys) and not (tmp_path / "p.strp").exists()


def test_a_corpus_that_is_a_folder_is_one_line(tmp_path, capsys):
    rc = profile_main(["--corpus", str(tmp_path), "-o", str(tmp_path / "p.strp")])
    assert rc == 2 and one_line_error(capsys) == f"strata_ray profile: corpus {tmp_path}: Is a directory\n"


def test_an_empty_corpus_path_is_one_line(tmp_path, capsys):
    rc = profile_main(["--corpus", "", "-o", str(tmp_path / "p.strp")])
    assert rc == 2 and one_line_error(capsys) == (
        "strata_ray profile: --corpus: an empty path; give the text file to profile\n")


def test_no_corpus_flag_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        profile_main(["-o", str(tmp_path / "p.strp")])
    err = one_line_error(capsys)
    assert e.value.code == 2 and err.startswith("strata_ray profile: ") and "--corpus" in err


def test_run_dispatches_profile(tmp_path, capsys):
    """`python -m strata_ray.run profile ...` is profile_main: its own one-line errors and exit codes."""
    from strata_ray.run import main

    rc = main(["profile", "--corpus", str(tmp_path / "absent.txt"), "-o", str(tmp_path / "p.strp")])
    err = one_line_error(capsys)
    assert rc == 2 and err.startswith("strata_ray profile: corpus ") and "absent.txt" in err


def test_empty_corpus(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("  \n\n")
    rc = profile_main(["--corpus", str(tmp_path / "empty.txt"), "-o", str(tmp_path / "p.strp")])
    assert rc == 2 and "is empty" in one_line_error(capsys)


def test_a_corpus_that_is_not_utf8_is_one_line(tmp_path, capsys):
    (tmp_path / "bin.txt").write_bytes(b"text \xff\xfe more")
    rc = profile_main(["--corpus", str(tmp_path / "bin.txt"), "-o", str(tmp_path / "p.strp")])
    want = f"strata_ray profile: corpus {tmp_path / 'bin.txt'} is not UTF-8 text (byte 5)\n"
    assert rc == 2 and one_line_error(capsys) == want and not (tmp_path / "p.strp").exists()


def test_a_corpus_past_the_limit_is_one_line(tmp_path, capsys, monkeypatch):
    """/dev/zero as the corpus was read until memory ran out: CORPUS_LIMIT characters at most."""
    import strata_ray.experts.profile_cli as profile_cli

    monkeypatch.setattr(profile_cli, "CORPUS_LIMIT", 4)
    (tmp_path / "c.txt").write_text("words")
    rc = profile_main(["--corpus", str(tmp_path / "c.txt"), "-o", str(tmp_path / "p.strp")])
    err = one_line_error(capsys)
    assert rc == 2 and err.startswith(f"strata_ray profile: corpus {tmp_path / 'c.txt'} is longer than ")
    assert err.endswith(" MiB (read whole: give a part of it)\n") and not (tmp_path / "p.strp").exists()


def test_output_directory_missing(tmp_path, capsys):
    (tmp_path / "c.txt").write_text(CORPUS)
    rc = profile_main(["--corpus", str(tmp_path / "c.txt"), "-o", str(tmp_path / "nodir" / "p.strp")])
    assert rc == 2 and "folder not found" in one_line_error(capsys)


@pytest.mark.parametrize("output", ["folder", ""])
def test_output_that_is_a_folder_is_refused_before_the_run(tmp_path, capsys, monkeypatch, output):
    """-o naming a folder (or empty: the working folder) fails at once, not after routing the whole corpus
    (the corpus is missing here too: the output is checked first)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    rc = profile_main(["--corpus", str(tmp_path / "absent.txt"), "-o", output])
    assert rc == 2 and "is a folder; give a file path" in one_line_error(capsys)


@pytest.mark.parametrize("target, line", [
    ("c.txt", "-o: {path} is the --corpus file; give another path"),
    ("m.gguf", "-o: {path} is the --model file; give another path"),
    ("notes.txt", "-o: {path} exists and is not an STRP profile; remove it or give another path"),
])
def test_the_output_never_replaces_an_input_or_a_file_that_is_not_a_profile(tmp_path, capsys, target, line):
    for name, data in (("c.txt", CORPUS), ("m.gguf", "GGUF..."), ("notes.txt", "mine")):
        (tmp_path / name).write_text(data)
    path = tmp_path / target
    inputs = ["--corpus", str(tmp_path / "c.txt"), "--model", str(tmp_path / "m.gguf")]
    rc = profile_main([*inputs, "-o", str(path)])
    assert rc == 2 and one_line_error(capsys) == f"strata_ray profile: {line.format(path=path)}\n"
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "c.txt").read_text() == CORPUS


@pytest.mark.parametrize("device", ["mps", "meta"])
def test_a_torch_device_the_engine_does_not_run_on_is_one_line(tmp_path, capsys, device):
    (tmp_path / "c.txt").write_text(CORPUS)
    rc = profile_main(["--corpus", str(tmp_path / "c.txt"), "-o", str(tmp_path / "p.strp"), "--device",
                       device])
    want = f"strata_ray profile: --device {device}: the profile runs on cpu or cuda\n"
    assert rc == 2 and one_line_error(capsys) == want


def test_a_bad_command_line_speaks_as_profile(capsys):
    with pytest.raises(SystemExit) as e:
        profile_main(["--bogus"])
    assert e.value.code == 2 and one_line_error(capsys).startswith("strata_ray profile: ")


def test_bad_flag_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        profile_main(["--corpus", "c.txt", "-o", "p.strp", "--chunk", "0"])
    assert e.value.code == 2 and "positive integer" in one_line_error(capsys)


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory):
    synth = pytest.importorskip("strata_ray.model.synth")
    pytest.importorskip("strata_ray.model.loader")
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    synth.write_synth(path, arch="qwen3next", preset="tiny")
    return path


def test_bad_model_is_one_line(tmp_path, capsys, tiny_model_path):
    (tmp_path / "c.txt").write_text(CORPUS)
    (tmp_path / "not.gguf").write_bytes(b"this is not a model")
    rc = profile_main(["--model", str(tmp_path / "not.gguf"), "--corpus", str(tmp_path / "c.txt"),
                       "-o", str(tmp_path / "p.strp")])
    assert rc == 2 and "not.gguf" in one_line_error(capsys)


def test_strata_model_is_the_model_as_the_other_commands_read_it(tmp_path, capsys, monkeypatch,
                                                                   tiny_model_path):
    """It profiled the embedded model (4 x 16 pairs) where STRATA_MODEL named another, whose run then refused
    the profile for its shape; a missing file is one line."""
    (tmp_path / "c.txt").write_text(CORPUS)
    out = tmp_path / "p.strp"
    monkeypatch.setenv("STRATA_MODEL", str(tiny_model_path))
    rc = profile_main(["--corpus", str(tmp_path / "c.txt"), "-o", str(out), "--max-tokens", "20",
                       "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    from strata_ray.model.loader import load_model

    check_shape(read_profile(out), load_model(str(tiny_model_path)).hp)
    monkeypatch.setenv("STRATA_MODEL", str(tmp_path / "missing.gguf"))
    rc = profile_main(["--corpus", str(tmp_path / "c.txt"), "-o", str(out), "--no-progress"])
    assert rc == 2 and "missing.gguf" in one_line_error(capsys)


class CountingTokenizer:
    """The real tokenizer, counting the characters it was given (what corpus_tokens read)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.chars = tokenizer, 0

    def encode(self, text: str) -> list[int]:
        self.chars += len(text)
        return self.tokenizer.encode(text)


def test_the_corpus_is_tokenized_in_pieces_and_only_as_far_as_max_tokens(tiny_model_path, monkeypatch):
    """The same ids as the whole text at once (pieces end after a newline); with --max-tokens the reading
    stops once they are made (the whole corpus was tokenized first: ~165 bytes of memory a character)."""
    from strata_ray.experts import profile_cli
    from strata_ray.model.loader import load_model

    tokenizer = load_model(str(tiny_model_path)).tokenizer
    text = "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(2000))
    monkeypatch.setattr(profile_cli, "PIECE_CHARS", 997)  # awkward: pieces of 17-18 lines
    whole = tokenizer.encode(text)
    counting = CountingTokenizer(tokenizer)
    assert profile_cli.corpus_tokens(counting, text, None) == whole and counting.chars == len(text)
    counting = CountingTokenizer(tokenizer)
    assert profile_cli.corpus_tokens(counting, text, 33) == whole[:33]
    assert counting.chars <= 997  # one piece


def test_profile_end_to_end(tmp_path, capsys, tiny_model_path):
    from strata_ray.model.loader import load_model

    (tmp_path / "c.txt").write_text(CORPUS)
    out = tmp_path / "p.strp"
    rc = profile_main(["--model", str(tiny_model_path), "--corpus", str(tmp_path / "c.txt"), "-o", str(out),
                       "--max-tokens", "60", "--chunk", "16", "--context", "40", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    rc = profile_main(["--model", str(tiny_model_path), "--corpus", str(tmp_path / "c.txt"), "-o", str(out),
                       "--max-tokens", "60", "--chunk", "16", "--context", "40", "--no-progress"])
    assert rc == 0, capsys.readouterr().err  # an earlier profile at -o: replaced
    assert "60 tokens" in capsys.readouterr().err
    loaded = load_model(str(tiny_model_path))
    profile = read_profile(out)
    check_shape(profile, loaded.hp)
    assert profile.n_ranked == loaded.hp.n_layer * loaded.hp.n_expert  # every pair ranked

    # the same run in-process: same ranking, counts that add up, the model's backend restored
    inner = loaded.model.experts
    again, counts, n_tokens = profile_text(loaded, CORPUS, 60, 16, 40, progress=False)
    assert loaded.model.experts is inner
    assert again == profile and again == rank_from_counts(counts)
    assert n_tokens == 60
    np.testing.assert_array_equal(counts.sum(axis=1), [60 * loaded.hp.n_expert_used] * loaded.hp.n_layer)
