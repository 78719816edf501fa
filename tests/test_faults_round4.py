"""Nothing lost, round four (issue 28's closing attack): what a fresh attack on the
trainer, its readers and its workdir found, each as a test that failed before its fix.

Everything is called in-process; no test here needs a process boundary.
"""
import os

import pytest

from jaxmp.train.workdir import LOCK_NAME, WorkdirLock


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_left_whole(tmp_path):
    """A ``.jaxmp.lock`` replaced by a symlink (to a file of the user's, or to the run's
    own ``metrics.jsonl``) was followed: taking the lock over truncated the target and
    wrote the holder record into it. It is refused in one line naming the link, and the
    target keeps its bytes."""
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n")
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / LOCK_NAME).symlink_to(victim)
    with pytest.raises(ValueError, match=r"\.jaxmp\.lock is a symbolic link") as e:
        with WorkdirLock(workdir):
            pass
    assert "\n" not in str(e.value)
    assert victim.read_text() == "precious\n"
    assert (workdir / LOCK_NAME).is_symlink()  # left for the user to look at


def test_a_dangling_lock_symlink_creates_nothing_at_its_target(tmp_path):
    """A dangling symlink was followed by ``O_CREAT``: a file appeared where it pointed."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="symbolic link"):
        with WorkdirLock(workdir):
            pass
    assert not os.path.lexists(tmp_path / "elsewhere")


def test_a_sample_prompt_that_is_not_text_is_refused_before_any_work():
    """``--config.train.sample_prompt=$'\\xff'`` (bytes that are not UTF-8 reach Python
    as a lone surrogate, ``'\\udcff'``) was accepted; the run trained to its last step,
    then its closing sample failed to encode the prompt: exit 1 and no sample. It is
    refused at the start, naming the key: the key's declared values are text
    (``jaxmp.train.keys``), checked with the config before any work."""
    from _configs import small_config
    from jaxmp.train.experiment import Experiment
    from jaxmp.train.preflight import check_sample_memory

    with pytest.raises(ValueError, match=r"train\.sample_prompt='def \\udcff\(' is not "
                                         r"allowed") as e:
        Experiment.create(small_config(sample_prompt="def \udcff("), num_devices=1)
    assert "\n" not in str(e.value)
    check_sample_memory(Experiment.create(small_config(sample_prompt="def é("), num_devices=1))


@pytest.mark.parametrize("line, fault", [
    (b'{"step": "45", "split": "train"}', "integer step"),
    (b'{"step": null, "split": "train"}', "integer step"),
    (b'{"step": true, "split": "train"}', "integer step"),
    (b'{"step": 4\xa0, "split": "train"}', "not UTF-8 text"),
])
def test_a_damaged_metrics_line_is_one_line_naming_the_file_and_line(tmp_path, line, fault):
    """A resume reads ``metrics.jsonl`` to drop what lies past its checkpoint. A line
    whose step is not an integer was a raw ``TypeError`` traceback (``'<=' not
    supported``); a byte that is not UTF-8 (a flipped high bit) a ``UnicodeDecodeError``
    naming neither the file nor the line. Both are a ValueError naming both, and the
    history is left as it was."""
    from jaxmp.train.metrics import MetricsWriter, read_metrics

    path = tmp_path / "metrics.jsonl"
    good = b'{"step": 5, "split": "train", "loss": 4.5}\n'
    path.write_bytes(good + line + b"\n")
    for call in (lambda: read_metrics(path), lambda: MetricsWriter(tmp_path, start_step=5)):
        with pytest.raises(ValueError, match=rf"metrics\.jsonl, line 2: .*{fault}") as e:
            call()
        assert "\n" not in str(e.value)
    assert path.read_bytes() == good + line + b"\n"


def test_a_jsonl_text_with_an_unpaired_surrogate_escape_names_the_file_and_line(tmp_path):
    """``{"text": "\\ud800abc"}`` is valid JSON (tools that cut a surrogate pair in two
    write it) but not text: it was ``'utf-8' codec can't encode character`` with no file,
    line or field named."""
    from jaxmp.train.data import load_documents

    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "\\ud800abc"}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl, line 2: field 'text' is not text "
                                         r"\(surrogates not allowed at character 0: an "
                                         r"unpaired \\ud800 escape\)") as e:
        load_documents(str(tmp_path))
    assert "\n" not in str(e.value)
